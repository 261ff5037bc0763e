"""The KV connectors' control messages as untrusted input: one decoder that bounds what it
reads and types every field (pure: no framework, no engine, no clock).

A message is a fixed-length prefix naming its kind, a 4-byte little-endian header length, a
JSON object (the header) and raw bytes (block ids as little-endian int32: a request has
thousands). Anything that can reach an engine can send one, so :func:`decode` never raises
anything but :class:`ControlError` — no ``KeyError``, ``RecursionError`` (nested JSON),
``OverflowError`` (``Infinity``) or ``UnicodeDecodeError`` escapes to a receive handler — and
the typed accessors (:class:`Header`) refuse a missing field, a wrong type, an absurd number
or a string past its bound. What a field *means* (is this token the one offered for that
request? are these blocks the ones offered?) is checked by the component against its records.

Each request a connector hands off gets a random :func:`new_token`; it travels in the
request's parameters and in every control message about the request, and a message whose
token is not the one the receiver recorded for that request is dropped (compared in constant
time, :func:`same_token`).
"""

from __future__ import annotations

import array
import dataclasses
import hmac
import json
import re
import secrets
import sys
from collections.abc import Iterable
from typing import Any

MAX_HEADER = 4096
"""The longest JSON header a control message may carry (the connectors' are < 600 bytes)."""

TOKEN_BYTES = 16
"""A request's token: 128 random bits, as 32 lowercase hex digits."""

_TOKEN = re.compile(r"[0-9a-f]{32}")


class ControlError(ValueError):
    """A control message that is malformed, out of bounds, or not for anything the receiver
    offered. The message is dropped; it never fails anything else."""


def new_token() -> str:
    """A fresh request token (see the module docs)."""
    return secrets.token_hex(TOKEN_BYTES)


def is_token(value: object) -> bool:
    """Whether ``value`` has a token's form (32 lowercase hex digits)."""
    return isinstance(value, str) and _TOKEN.fullmatch(value) is not None


def same_token(expected: str | None, given: object) -> bool:
    """Whether ``given`` is the token ``expected`` (constant time; never for ``None``)."""
    return (expected is not None and isinstance(given, str)
            and hmac.compare_digest(expected.encode(), given.encode()))


def encode(prefix: bytes, header: dict[str, Any], payload: bytes = b"") -> bytes:
    """A control message (see the module docs)."""
    text = json.dumps(header, separators=(",", ":")).encode()
    if len(text) > MAX_HEADER:
        raise ControlError(f"a header of {len(text)} bytes is over {MAX_HEADER}")
    return prefix + len(text).to_bytes(4, "little") + text + payload


def _no_constants(name: str) -> Any:
    raise ControlError(f"a header holds {name}, which is not JSON")


def decode(data: bytes, prefixes: Iterable[bytes]) -> tuple[bytes, Header, bytes]:
    """The kind (one of ``prefixes``, all of one length), header and payload of ``data``.
    Raises :class:`ControlError` for anything else."""
    prefixes = tuple(prefixes)
    width = len(prefixes[0])
    kind = bytes(data[:width])
    if kind not in prefixes:
        raise ControlError("not a message of this connector")
    if len(data) < width + 4:
        raise ControlError("a message cut short before its header")
    n = int.from_bytes(data[width:width + 4], "little")
    if n > MAX_HEADER or width + 4 + n > len(data):
        raise ControlError(f"a header length of {n} bytes (at most {MAX_HEADER}, and in the message)")
    try:
        value = json.loads(bytes(data[width + 4:width + 4 + n]).decode("utf-8"),
                           parse_constant=_no_constants)
    except ControlError:
        raise
    except (ValueError, RecursionError) as e:  # UnicodeDecodeError is a ValueError
        raise ControlError(f"a header that is not JSON ({type(e).__name__})") from None
    if not isinstance(value, dict):
        raise ControlError(f"a header that is a JSON {type(value).__name__}, not an object")
    return kind, Header(value), bytes(data[width + 4 + n:])


@dataclasses.dataclass(frozen=True)
class Header:
    """A decoded header, read through typed, bounded accessors."""

    fields: dict[str, Any]

    def _get(self, name: str, default: Any, required: bool) -> Any:
        if name not in self.fields:
            if required:
                raise ControlError(f"a header without {name!r}")
            return default
        return self.fields[name]

    def text(self, name: str, max_len: int = 256, *, default: str | None = None) -> str:
        value = self._get(name, default, default is None)
        if value is None and default is not None:
            return default
        if not isinstance(value, str) or len(value) > max_len:
            raise ControlError(f"{name!r} is not a string of at most {max_len} characters")
        return value

    def optional_text(self, name: str, max_len: int = 256) -> str | None:
        value = self._get(name, None, False)
        if value is None:
            return None
        if not isinstance(value, str) or len(value) > max_len:
            raise ControlError(f"{name!r} is not a string of at most {max_len} characters")
        return value

    def integer(self, name: str, low: int, high: int) -> int:
        value = self._get(name, None, True)
        # bool is an int in Python; JSON's true is not a number.
        if not isinstance(value, int) or isinstance(value, bool) or not low <= value <= high:
            raise ControlError(f"{name!r} is not an integer in [{low}, {high}]")
        return value

    def flag(self, name: str, *, default: bool = False) -> bool:
        value = self._get(name, default, False)
        if not isinstance(value, bool):
            raise ControlError(f"{name!r} is not true or false")
        return value

    def token(self, name: str = "token") -> str:
        value = self._get(name, None, True)
        if not is_token(value):
            raise ControlError(f"{name!r} is not a request token")
        return value

    def hex_bytes(self, name: str, max_bytes: int = 256) -> bytes:
        text = self.text(name, 2 * max_bytes)
        try:
            return bytes.fromhex(text)
        except ValueError:
            raise ControlError(f"{name!r} is not hex") from None


def block_ids_payload(blocks: Iterable[int]) -> bytes:
    """Block ids as they travel: 4 bytes each, little-endian."""
    ids = array.array("i", blocks)
    if sys.byteorder != "little":
        ids.byteswap()
    return ids.tobytes()


_BELOW_0X80 = bytes(range(0x80))


def block_id_array(payload: bytes, max_count: int = 1 << 20) -> array.array[int]:
    """The block ids of :func:`block_ids_payload`, 4 bytes each (as Python ints a message's
    16k ids take ten times the room, and a receiver keeps some of them for a while): refuses
    a length that is not a multiple of 4, more than ``max_count`` ids, and negative ids."""
    if len(payload) % 4:
        raise ControlError(f"{len(payload)} bytes are not whole block ids")
    if len(payload) // 4 > max_count:
        raise ControlError(f"{len(payload) // 4} block ids (at most {max_count})")
    # Negative: the high byte of a little-endian id has its top bit set (looked at as bytes:
    # no Python int is made per id).
    if bytes(payload[3::4]).translate(None, _BELOW_0X80):
        raise ControlError("a negative block id")
    ids = array.array("i")
    ids.frombytes(payload)
    if sys.byteorder != "little":
        ids.byteswap()
    return ids


def block_ids_of(payload: bytes, max_count: int = 1 << 20) -> list[int]:
    """:func:`block_id_array` as a list."""
    return block_id_array(payload, max_count).tolist()
