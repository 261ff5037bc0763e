"""The SGLang backend's control messages, as untrusted input (pure: no SGLang, no engine, no
clock): their one decoder, the per-room token and proof they carry, and the checks a rank
makes against its own records before it acts on one (issue 56).

Anything that can address an engine can send it a message, so a message is acted on only if

- it decodes (``control.decode``: bounded, typed; anything else is dropped, counted);
- it is about a room the receiver holds: a decode rank only hears about rooms a live receiver
  of its own sent indices for, a prefill rank only acts on a decode rank it can find at its
  *own* bootstrap (never an address a message names);
- it carries the room's **token**: 128 random bits the decode receiver draws for the room and
  sends with its indices. The indices and the decode's abort also carry a **proof**: an HMAC,
  under the **key** the decode rank published in its bootstrap record, of everything they
  name (room, token, rank, shape, pages, aux slot). Only the decode rank and readers of the
  bootstrap know the key, so a third party cannot make a meta or an abort the prefill takes,
  and cannot learn the token but by watching the wire;
- it comes from the engine its record names, where the transport proves a sender (mock,
  verbs; EFA/libfabric with the cluster secret, and without one from a sender's second
  message on); where it cannot (``b""``: a stranger's first message over EFA/libfabric
  without a secret), the token and proof alone vouch for it;
- an abort ends a room only from the decode rank whose indices the room holds, with their
  token (the prefill manager binds it: ``XferKVManager._aborted``);
- what it names was offered: pages inside the decode rank's published KV regions, an aux slot
  inside its aux regions, a decode rank inside its TP size, a prefill rank this room was sent
  to.

The decode's answers need no key: a done, fail or abort-ack is taken only with the room's
token, from a prefill rank the room's indices went to.
"""

from __future__ import annotations

import dataclasses
import hashlib
import hmac
import re
from typing import Any

import numpy as np

from .control import ControlError, Header, block_ids_of, decode, encode, new_token, same_token

META, DONE, FAIL = b"xsg-meta\n", b"xsg-done\n", b"xsg-fail\n"
ABORT, ABORT_ACK = b"xsg-stop\n", b"xsg-stok\n"
"""Prefixes of the messages (a bounded JSON header follows): a decode rank's page indices and
its giving up of a room; a prefill rank's done, failure and answer to an abort."""
KINDS = (META, DONE, FAIL, ABORT, ABORT_ACK)

MAX_ROOM = (1 << 64) - 1
"""SGLang's bootstrap rooms are random non-negative 63-bit integers."""
MAX_TP = 4096
MAX_HEADS = 1 << 16
MAX_BYTES = 1 << 48
MAX_WHY = 512
MAX_PAGES = 1 << 14
"""Page indices in one meta (4 bytes each: a 64 KiB receive buffer holds 16 Ki)."""
KEY_PREFIX = "xsgkey."
"""A decode record's region whose name carries the rank's key (the region: 1 byte of zeros)."""
_DECODE_NAME = re.compile(r"sglang\.decode\.[0-9a-f]{12}\.[0-9]{1,4}")
_KEY = re.compile(r"xsgkey\.([0-9a-f]{32})")

new_key = new_token
"""A decode rank's key: 128 random bits, as 32 hex digits (drawn once per manager)."""


def key_region(key: str) -> str:
    """The name of the region that carries ``key`` in a decode rank's record."""
    return KEY_PREFIX + key


def key_of(record: dict[str, Any]) -> str | None:
    """The key a decode rank's bootstrap record carries, or ``None``."""
    for name in record.get("regions") or ():
        m = _KEY.fullmatch(name)
        if m is not None:
            return m[1]
    return None


def is_decode_name(name: str) -> bool:
    """Whether ``name`` has the form of a decode rank's bootstrap record."""
    return _DECODE_NAME.fullmatch(name) is not None


@dataclasses.dataclass(frozen=True)
class Meta:
    """A decode rank's page indices for a room (``KVReceiver.send_metadata``)."""

    room: int
    token: str
    decode: str
    """Its bootstrap record's name (at the prefill rank's own bootstrap)."""
    to: int
    """The prefill rank it is for."""
    rank: int
    tp: int
    heads: int
    item: int
    prefix: int
    aux_index: int | None
    aux: bool
    """Whether this prefill rank writes the aux row (the first of the room's targets)."""
    pages: np.ndarray

    def signed(self) -> bytes:
        """What the proof covers: every field the prefill acts on, and the pages."""
        head = (f"meta|{self.room}|{self.token}|{self.decode}|{self.to}|{self.rank}|{self.tp}|"
                f"{self.heads}|{self.item}|{self.prefix}|{self.aux_index}|{int(self.aux)}|")
        return head.encode() + np.asarray(self.pages, dtype="<i4").tobytes()

    def header(self, key: str) -> dict[str, Any]:
        return {"room": self.room, "token": self.token, "decode": self.decode, "to": self.to,
                "rank": self.rank, "tp": self.tp, "heads": self.heads, "item": self.item,
                "prefix": self.prefix, "aux_index": self.aux_index, "aux": self.aux,
                "proof": prove(key, self.signed())}

    def encode(self, key: str) -> bytes:
        return encode(META, self.header(key), np.asarray(self.pages, dtype="<i4").tobytes())


@dataclasses.dataclass(frozen=True)
class Abort:
    """A decode rank gave up a room: the prefill ranks write nothing more there and answer."""

    room: int
    token: str
    decode: str
    rank: int

    def signed(self) -> bytes:
        return f"abort|{self.room}|{self.token}|{self.decode}|{self.rank}".encode()

    def encode(self, key: str) -> bytes:
        return encode(ABORT, {"room": self.room, "token": self.token, "decode": self.decode,
                              "rank": self.rank, "proof": prove(key, self.signed())})


@dataclasses.dataclass(frozen=True)
class Answer:
    """A prefill rank's done, failure (``why``) or abort answer for a room."""

    kind: bytes
    room: int
    token: str
    rank: int
    why: str = ""

    def encode(self) -> bytes:
        header: dict[str, Any] = {"room": self.room, "token": self.token, "rank": self.rank}
        if self.kind == FAIL:
            header["why"] = self.why[:MAX_WHY]
        return encode(self.kind, header)


def prove(key: str, signed: bytes) -> str:
    """The proof of ``signed`` under ``key`` (HMAC-SHA256, 32 hex digits)."""
    return hmac.new(key.encode(), signed, hashlib.sha256).hexdigest()[:32]


def proven(key: str | None, signed: bytes, proof: str) -> bool:
    """Whether ``proof`` is that of ``signed`` under ``key`` (constant time)."""
    return key is not None and same_token(prove(key, signed), proof)


def parse(data: bytes) -> tuple[Meta | Abort | Answer, str | None]:
    """A message and its proof (``None`` for answers, which carry none). Raises
    :class:`ControlError` for anything malformed or out of bounds."""
    kind, h, payload = decode(data, KINDS)
    room = h.integer("room", 0, MAX_ROOM)
    token = h.token("token")
    if kind in (META, ABORT):
        decode_name = h.text("decode", 64)
        if not is_decode_name(decode_name):
            raise ControlError(f"{decode_name!r} is not a decode rank's record")
        proof = h.token("proof")
        if kind == ABORT:
            if payload:
                raise ControlError("an abort with trailing bytes")
            return Abort(room, token, decode_name, h.integer("rank", 0, MAX_TP - 1)), proof
        tp = h.integer("tp", 1, MAX_TP)
        rank = h.integer("rank", 0, tp - 1)
        aux_index = None if h.fields.get("aux_index") is None else h.integer("aux_index", 0, (1 << 31) - 1)
        pages = np.asarray(block_ids_of(payload, MAX_PAGES), dtype=np.int64)
        return Meta(room=room, token=token, decode=decode_name,
                    to=h.integer("to", 0, MAX_TP - 1), rank=rank, tp=tp,
                    heads=h.integer("heads", 1, MAX_HEADS), item=h.integer("item", 1, MAX_BYTES),
                    prefix=h.integer("prefix", 0, MAX_BYTES), aux_index=aux_index,
                    aux=h.flag("aux"), pages=pages), proof
    if payload:
        raise ControlError("an answer with trailing bytes")
    why = h.text("why", MAX_WHY, default="the prefill failed") if kind == FAIL else ""
    return Answer(kind, room, token, h.integer("rank", 0, MAX_TP - 1), why), None


def _slots(record: dict[str, Any], name: str, item: int) -> int | None:
    """How many ``item``-byte slots region ``name`` of ``record`` holds (``None``: none)."""
    desc = (record.get("regions") or {}).get(name)
    return None if desc is None else int(desc.nbytes) // item


def check_meta(meta: Meta, proof: str | None, record: dict[str, Any], sender: bytes,
               kv_buffers: int, aux_items: list[int]) -> None:
    """Raises :class:`ControlError` unless ``meta`` is the decode rank's own (its record:
    ``record``, looked up at the prefill rank's own bootstrap) and names only what that rank
    published: the proof under the record's key, the proven sender (where the transport names
    one), pages inside each of the ``kv_buffers`` KV regions, the aux slot inside each aux
    region (``aux_items``: this prefill rank's aux item sizes, the same on both sides)."""
    if sender and bytes(sender) != bytes(record["addr"]):
        raise ControlError(f"a meta naming {meta.decode} from another engine")
    if not proven(key_of(record), meta.signed(), proof or ""):
        raise ControlError(f"a meta naming {meta.decode} without its key's proof")
    top = int(meta.pages.max()) if len(meta.pages) else -1
    for i in range(kv_buffers):
        slots = _slots(record, f"kv{i}", meta.item)
        if slots is None or top >= slots:
            raise ControlError(f"page {top} is not in {meta.decode}'s kv{i} ({slots} pages)")
    if meta.aux_index is not None:
        for i, item in enumerate(aux_items):
            slots = _slots(record, f"aux{i}", item)
            if slots is None or meta.aux_index >= slots:
                raise ControlError(f"aux slot {meta.aux_index} is not in {meta.decode}'s "
                                   f"aux{i} ({slots} slots)")


def check_abort(abort: Abort, proof: str | None, record: dict[str, Any], sender: bytes) -> None:
    """Raises :class:`ControlError` unless ``abort`` is the decode rank's own."""
    if sender and bytes(sender) != bytes(record["addr"]):
        raise ControlError(f"an abort naming {abort.decode} from another engine")
    if not proven(key_of(record), abort.signed(), proof or ""):
        raise ControlError(f"an abort naming {abort.decode} without its key's proof")


@dataclasses.dataclass
class Room:
    """What a decode rank keeps of a room it sent indices for: who may answer, with what."""

    token: str
    prefills: dict[int, bytes]
    """The prefill ranks the indices went to, by rank: their engines' addresses."""
    done: set[int] = dataclasses.field(default_factory=set)
    failure: str | None = None
    acks: set[int] | None = None
    """The prefill ranks that answered this room's abort (``None``: not aborted)."""


class DecodeRooms:
    """A decode rank's rooms (pure: the manager feeds it messages under its lock). A room is
    entered when its receiver sends indices and left when SGLang clears the receiver; answers
    for any other room, without the room's token, from a rank it was not sent to or from
    another engine are refused — so state grows only with SGLang's own receivers."""

    def __init__(self) -> None:
        self.rooms: dict[int, Room] = {}

    def enter(self, room: int, token: str, prefills: dict[int, bytes]) -> None:
        self.rooms[room] = Room(token, dict(prefills))

    def leave(self, room: int) -> None:
        self.rooms.pop(room, None)

    def handle(self, answer: Answer, sender: bytes) -> None:
        """Takes a prefill rank's answer, or raises :class:`ControlError`."""
        r = self.rooms.get(answer.room)
        if r is None or not same_token(r.token, answer.token):
            raise ControlError(f"an answer for room {answer.room} this rank holds no token of")
        addr = r.prefills.get(answer.rank)
        if addr is None:
            raise ControlError(f"room {answer.room}'s indices never went to prefill rank {answer.rank}")
        if sender and bytes(sender) != addr:
            raise ControlError(f"an answer of prefill rank {answer.rank} from another engine")
        if answer.kind == DONE:
            r.done.add(answer.rank)
        elif answer.kind == FAIL:
            if r.failure is None:
                r.failure = answer.why
        elif r.acks is not None:
            r.acks.add(answer.rank)
