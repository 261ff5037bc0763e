"""The control protocol of a weight-sync group, pure (no engine, no thread, no clock): the
messages, the one decoder every received message goes through (bounds, then who may send
what), the inbox (bounded to the version a rank is on and the next one, anchored at the
rank's own progress) and the
coordinator's decision.

A version is all-or-nothing, in two phases. The coordinator (trainer rank 0) sends the
MANIFEST (the layout's digest, the version's remaining time, the layout itself only to a
receiver that lacks it); each receiver answers every sender READY (its buffer's descriptor),
the senders write, and every rank reports DONE: senders once their writes completed,
receivers once every byte landed in their staging. Only the coordinator decides: COMMIT when
every rank reported success with the same layout, ABORT otherwise, sent to every rank. A rank
that has not heard the decision a grace period after reporting asks (QUERY) and waits for the answer; it
never decides alone. Applying the version (swapping buffers, loading into the model) happens
after a COMMIT only.

Every message carries the group's tag and session nonce (random per coordinator, published
in its rendezvous record, so only those who can read the group's records can forge one) and
the claimed member id; the decoder refuses MANIFEST and VERDICT from anyone but the
coordinator, READY from anyone but a receiver, COUNT (the immediates a sender's writes bring a
receiver, as the sender's engine stripes them) from anyone but a sender, DONE and QUERY sent anywhere but to the
coordinator, and any payload past its bound.
"""

from __future__ import annotations

import dataclasses
import hashlib
import struct

__all__ = [
    "MANIFEST", "READY", "DONE", "VERDICT", "QUERY", "COUNT",
    "MSG_BYTES", "CHUNK", "ProtocolError", "Message", "Rules", "Inbox", "decide",
    "group_tag", "encode", "manifest_payload", "parse_manifest",
]

MANIFEST, READY, DONE, VERDICT, QUERY, COUNT = 1, 2, 3, 4, 5, 6
_KINDS = {MANIFEST: "MANIFEST", READY: "READY", DONE: "DONE", VERDICT: "VERDICT", QUERY: "QUERY", COUNT: "COUNT"}

_MAGIC = b"XW"
_PROTO = 2
# magic, protocol, kind, version, sender id (senders 0..m-1, receivers m..m+n-1), group tag, session.
_HEADER = struct.Struct("<2sBBQI8s16s")
_TAG_AT = struct.calcsize("<2sBBQI")
MSG_BYTES = 1 << 16
# MANIFEST: chunk index, chunk count, remaining milliseconds of the coordinator's deadline,
# the layout's digest, the layout's JSON length; then the chunk.
_MANIFEST = struct.Struct("<IIQ16sQ")
CHUNK = MSG_BYTES - _HEADER.size - _MANIFEST.size - 16
_MAX_REASON = 1024
_MAX_DESC = 4096
_MAX_CHUNKS = (1 << 30) // CHUNK + 1


class ProtocolError(ValueError):
    """A message this rank must not act on (malformed, past a bound, or from someone the
    protocol does not allow to send it)."""


@dataclasses.dataclass(frozen=True)
class Message:
    kind: int
    version: int
    sender: int
    payload: bytes


def group_tag(group: str) -> bytes:
    return hashlib.sha256(group.encode()).digest()[:8]


def encode(kind: int, version: int, sender: int, tag: bytes, session: bytes, payload: bytes = b"") -> bytes:
    return _HEADER.pack(_MAGIC, _PROTO, kind, version, sender, tag, session) + payload


def manifest_payload(index: int, count: int, remaining_ms: int, digest: bytes, total: int, chunk: bytes) -> bytes:
    return _MANIFEST.pack(index, count, remaining_ms, digest, total) + chunk


def parse_manifest(payload: bytes) -> tuple[int, int, int, bytes, int, bytes]:
    """(index, count, remaining_ms, digest, total JSON length, chunk) of a decoded MANIFEST."""
    index, count, remaining_ms, digest, total = _MANIFEST.unpack_from(payload)
    return index, count, remaining_ms, digest, total, payload[_MANIFEST.size :]


def peek_group(raw: bytes) -> bytes | None:
    """The group tag of a message, or None if it is not one of this protocol's."""
    if len(raw) < _HEADER.size or raw[:2] != _MAGIC:
        return None
    return bytes(raw[_TAG_AT : _TAG_AT + 8])


@dataclasses.dataclass(frozen=True)
class Rules:
    """What one member of one group accepts: its id, the group's size, tag and session."""

    me: int
    senders: int
    receivers: int
    tag: bytes
    session: bytes

    def decode(self, raw: bytes) -> Message:
        """The message in ``raw`` if this member may act on it; ``ProtocolError`` otherwise."""
        if len(raw) < _HEADER.size:
            raise ProtocolError(f"{len(raw)} bytes is shorter than the header")
        if len(raw) > MSG_BYTES:
            raise ProtocolError(f"{len(raw)} bytes is longer than a control message")
        magic, proto, kind, version, sender, tag, session = _HEADER.unpack_from(raw)
        if magic != _MAGIC or proto != _PROTO:
            raise ProtocolError("not a weight-sync message of this protocol")
        if tag != self.tag:
            raise ProtocolError("another group's message")
        if session != self.session:
            raise ProtocolError("wrong session nonce (not from this group's members)")
        if kind not in _KINDS:
            raise ProtocolError(f"unknown kind {kind}")
        everyone = self.senders + self.receivers
        if sender >= everyone or sender == self.me:
            raise ProtocolError(f"sender id {sender} is not another member of {everyone}")
        name = _KINDS[kind]
        if kind in (MANIFEST, VERDICT) and sender != 0:
            raise ProtocolError(f"{name} from member {sender}: only the coordinator sends it")
        if kind == MANIFEST and self.me < self.senders:
            raise ProtocolError("MANIFEST to a sender")
        if kind == READY and (sender < self.senders or self.me >= self.senders):
            raise ProtocolError(f"READY from member {sender} to member {self.me}: only receivers send it, to senders")
        if kind == COUNT and (sender >= self.senders or self.me < self.senders):
            raise ProtocolError(f"COUNT from member {sender} to member {self.me}: only senders send it, to receivers")
        if kind in (DONE, QUERY) and self.me != 0:
            raise ProtocolError(f"{name} to member {self.me}: only the coordinator takes it")
        payload = bytes(raw[_HEADER.size :])
        bound = {
            MANIFEST: _MANIFEST.size + CHUNK,
            READY: 16 + 1 + _MAX_DESC,
            DONE: 1 + 16 + _MAX_REASON,
            VERDICT: 1 + _MAX_REASON,
            QUERY: 0,
            COUNT: 8,
        }[kind]
        least = {MANIFEST: _MANIFEST.size, READY: 16 + 1, DONE: 17, VERDICT: 1, QUERY: 0, COUNT: 8}[kind]
        if not least <= len(payload) <= bound:
            raise ProtocolError(f"{name} payload of {len(payload)} bytes outside {least}..{bound}")
        if kind == MANIFEST:
            index, count, _, _, total, chunk = parse_manifest(payload)
            if not (1 <= count <= _MAX_CHUNKS and index < count) or total > count * CHUNK:
                raise ProtocolError(f"MANIFEST chunk {index} of {count} ({total} bytes) is out of bounds")
        return Message(kind, version, sender, payload)


class Inbox:
    """Messages kept per (kind, version): at most one per sender and kind (a MANIFEST: one per
    chunk index), only for the version this rank is on and the next one. The window is
    anchored at this rank's own progress, never at what arrives: the version it began
    (``begin``), else the one after the last it finished (``finish``). Before a rank began
    or finished any version it cannot know where its group's numbering starts (a member made
    at a membership change joins at the group's version); it keeps messages of at most two
    versions then, and ``begin`` drops what lies outside the window it anchors."""

    def __init__(self, open: int = 2) -> None:
        self.floor = -1
        self.open = open
        # The version this rank is on (None: none begun or finished yet).
        self.current: int | None = None
        self.dropped = 0
        self._by: dict[tuple[int, int], dict[int, Message]] = {}

    def _versions(self) -> set[int]:
        return {v for _, v in self._by}

    def admits(self, version: int) -> bool:
        """Whether a message for ``version`` may be kept now (before any repeat check)."""
        if version <= self.floor:
            return False
        if self.current is not None:
            return self.current <= version < self.current + self.open
        versions = self._versions()
        return version in versions or len(versions) < self.open

    def handle(self, m: Message) -> bool:
        """Keeps ``m``; False when it is dropped (stale, a version past the window, a repeat)."""
        if not self.admits(m.version):
            self.dropped += 1
            return False
        slot = self._by.setdefault((m.kind, m.version), {})
        key = parse_manifest(m.payload)[0] if m.kind == MANIFEST else m.sender
        if key in slot:
            self.dropped += 1
            return False
        slot[key] = m
        return True

    def get(self, kind: int, version: int) -> list[Message]:
        return list(self._by.get((kind, version), {}).values())

    def begin(self, version: int) -> None:
        """This rank starts ``version``: the window is it and the next; the rest is dropped."""
        self.current = version
        self._trim()

    def finish(self, version: int) -> None:
        """This rank is done with ``version``: it and everything older are dropped, now and
        later; the window moves to the next one."""
        self.floor = max(self.floor, version)
        self.current = self.floor + 1
        self._trim()

    def _trim(self) -> None:
        for key in [k for k in self._by if not self.admits(k[1])]:
            del self._by[key]


def decide(reports: dict[int, bytes], senders: int, receivers: int, digest: bytes) -> str:
    """The coordinator's decision from the DONE payloads by member id: ``""`` (commit) when
    every member reported success with ``digest``, else why not (a member's own failure
    first: it is the cause, a missing report often its consequence)."""

    def who(member: int) -> str:
        return f"trainer rank {member}" if member < senders else f"receiver {member - senders}"

    everyone = range(senders + receivers)
    for member in everyone:
        p = reports.get(member)
        if p is not None and p[:1] != b"\x01":
            return p[17:].decode(errors="replace") or f"{who(member)} failed"
    for member in everyone:
        if member not in reports:
            return f"{who(member)} did not report in time"
        if reports[member][1:17] != digest:
            return f"{who(member)} planned a different layout"
    return ""
