"""The executor: ``WeightSender`` (``sender``) on each trainer rank, ``WeightReceiver``
(``receiver``) on each inference rank, one version at a time over the protocol of ``protocol``
(read its documentation first: two phases, the coordinator alone decides). This module is the
glue both ends share — the hub of engine messages, the control channel, the member record and
its nonce (``_Hub``, ``_Control``, ``_Member``) — and the exchange they carry out, step by
step; what it decides is decided in ``protocol``.

1. The coordinator (trainer rank 0) sends each receiver the MANIFEST: the layout's digest and
   the version's remaining time, and the layout itself (chunked JSON) only to a receiver that
   has not reported success with it (a new receiver, or one published anew). A receiver
   (re)allocates and registers its parameters when the layout changed (up to ``max_bytes``)
   and tells every sender it is READY (its buffer's descriptor, which the sender checks
   against the receiver's rendezvous record); each sender answers COUNT, the immediates its
   writes bring that receiver as its own engine stripes them, and the receiver arms the count
   of the version's immediate with their sum (the two sides' stripe configs may differ).
2. Each sender writes its runs to each ready receiver: from the shards' own memory
   (registered once while the same memory comes back each version), or, with a ``transform``
   (e.g. a dtype cast), staged into registered buckets — all at once, or two buckets of half a
   memory budget each, one filled while the other's writes are in flight.
3. Every rank reports to the coordinator; the coordinator commits or aborts, to every rank. A
   rank that has not heard a grace period after reporting asks the coordinator, and goes on
   asking until a bound past the deadline (``VersionInDoubt`` then: the version is not applied here, and the
   caller learns that the coordinator was unreachable, not that the version failed).

Deadlines: every receiver takes the coordinator's (the MANIFEST carries the time left), so a
receiver started early does not give up while the others load. Nothing here is capped by the
engine's own timeouts: an expectation that reaches ``[timeouts] expect_ms`` before the
version's deadline is followed by one that waits for the rest (an expectation of nothing,
queued behind the expired one's debt, is met when the debt is paid). Each write of a sender
is still one engine transfer, bounded by ``[timeouts] transfer_ms``: a write that takes
longer at the fabric's rate needs that raised (docs/weight-sync.md).

Receivers write in place — the caller pauses readers of the parameters during ``receive`` (a
failed version leaves them partly overwritten; the next successful one rewrites every byte)
— or double-buffer (``double_buffer=True``): readers see a version only once it is committed.
Peers find each other through an ``xfer.Rendezvous`` (``<group>.s<rank>`` and
``<group>.r<rank>``); each record carries its member's session nonce.
"""

from __future__ import annotations

import os
import threading
import time
from collections.abc import Callable, Iterable, Mapping
from typing import Any

import numpy as np

from .. import _xfer
from .._errors import BusyError as _Busy
from .._errors import TimeoutError as _Timeout
from . import protocol as P
from .layout import Layout

__all__ = ["VersionFailed", "VersionInDoubt", "WeightSender", "WeightReceiver"]


class VersionFailed(RuntimeError):
    """A version did not complete on every rank; ``reason`` says what this rank saw first."""

    def __init__(self, version: int, reason: str) -> None:
        super().__init__(f"weight version {version} failed: {reason}")
        self.version = version
        self.reason = reason


class VersionInDoubt(VersionFailed):
    """This rank did its part but never learned the coordinator's decision (it asked until a
    bound past the deadline): the version is not applied here; the coordinator may have
    committed it on the other ranks."""


def _physical_memory() -> int:
    try:
        return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (ValueError, OSError, AttributeError):
        return 1 << 40


class _Hub:
    """The engine's one pool of control-message buffers (an engine takes ``submit_recvs``
    once), shared by every member the engine is or was: a message goes to the member of its
    group, so members come and go (a membership change) on the same engine."""

    _all: dict[int, _Hub] = {}
    _lock = threading.Lock()

    def __init__(self, engine: _xfer.TransferEngine) -> None:
        self.engine = engine
        self.controls: dict[bytes, _Control] = {}
        self.lock = threading.Lock()
        try:
            # The transport-proven sender, where the engine names it (issue 56's contract).
            engine.submit_recvs(P.MSG_BYTES, 64, self._on_message, with_sender=True)  # type: ignore[call-arg]
        except TypeError:
            engine.submit_recvs(P.MSG_BYTES, 64, self._on_message)

    @classmethod
    def of(cls, engine: _xfer.TransferEngine) -> _Hub:
        with cls._lock:
            hub = cls._all.get(id(engine))
            if hub is None or hub.engine is not engine:
                hub = cls._all[id(engine)] = cls(engine)
            return hub

    def attach(self, tag: bytes, control: _Control) -> None:
        with self.lock:
            if tag in self.controls:
                raise ValueError("this engine is already a member of that group (close the other member first)")
            self.controls[tag] = control

    def detach(self, tag: bytes, control: _Control) -> None:
        with self.lock:
            if self.controls.get(tag) is control:
                del self.controls[tag]

    def _on_message(self, raw: bytes, sender: bytes = b"") -> None:
        tag = P.peek_group(raw)
        control = self.controls.get(tag) if tag is not None else None
        if control is not None:
            control.handle(raw, bytes(sender))


class _Control:
    """One member's side of the control channel: every message decoded by ``Rules``, kept in
    the bounded ``Inbox``; QUERYs answered at once by ``on_query`` (the coordinator's)."""

    def __init__(self, engine: _xfer.TransferEngine, rules: P.Rules) -> None:
        self.engine = engine
        self.rules = rules
        self.inbox = P.Inbox()
        self.refused = 0
        self.on_query: Callable[[P.Message], None] | None = None
        # Members' addresses as their records name them: a message whose proven sender is
        # another address is refused (where the engine proves senders).
        self.addresses: dict[int, bytes] = {}
        # Messages (with a proven sender) claiming a member whose record this rank has not
        # looked up yet: held aside, neither acted on nor taking the inbox's place of the
        # real one, until ``learn`` checks them. One per (claimed member, proven sender,
        # kind, version, chunk or sender), at most ``_HELD`` (more are dropped and counted).
        self.held: dict[tuple[int, bytes, int, int, int], tuple[P.Message, bytes]] = {}
        self.held_dropped = 0
        self._cond = threading.Condition()
        self.hub = _Hub.of(engine)
        self.hub.attach(rules.tag, self)

    def handle(self, raw: bytes, sender: bytes = b"") -> None:
        try:
            m = self.rules.decode(raw)
        except P.ProtocolError:
            self.refused += 1
            return
        if m.kind == P.QUERY:
            # Answered to the address in the asker's record, whoever sent it.
            known = self.addresses.get(m.sender)
            if sender and known is not None and known != sender:
                self.refused += 1
            elif self.on_query is not None:
                self.on_query(m)
            return
        with self._cond:
            known = self.addresses.get(m.sender)
            if sender and known is None:
                key = (m.sender, sender, m.kind, m.version, P.parse_manifest(m.payload)[0] if m.kind == P.MANIFEST else m.sender)
                if key in self.held or not self.inbox.admits(m.version):
                    self.inbox.dropped += 1
                elif len(self.held) >= _HELD:
                    self.held_dropped += 1
                else:
                    self.held[key] = (m, sender)
                return
            if sender and known != sender:
                self.refused += 1
                return
            if self.inbox.handle(m):
                self._cond.notify_all()

    def learn(self, member: int, address: bytes) -> None:
        """``member``'s record names ``address``: what was held aside in its name is kept if
        that address sent it, refused otherwise."""
        with self._cond:
            self.addresses[member] = address
            delivered = False
            for key in [k for k in self.held if k[0] == member]:
                m, sender = self.held.pop(key)
                if sender != address:
                    self.refused += 1
                elif self.inbox.handle(m):
                    delivered = True
            if delivered:
                self._cond.notify_all()

    def begin(self, version: int) -> None:
        with self._cond:
            self.inbox.begin(version)

    def deliver(self, m: P.Message) -> None:
        with self._cond:
            if self.inbox.handle(m):
                self._cond.notify_all()

    def send(self, addr: bytes, nonce: bytes, kind: int, version: int, payload: bytes, deadline: float) -> str:
        """Sends; ``""`` or why not (an engine refusal: a full queue is waited out until the
        deadline, never dropped silently)."""
        raw = P.encode(kind, version, self.rules.me, self.rules.tag, nonce, payload)
        while True:
            try:
                self.engine.submit_send(addr, raw)
                return ""
            except _Busy as e:
                left = deadline - time.monotonic()
                if left <= 0:
                    return f"the engine stayed busy: {e}"
                try:
                    self.engine.wait_for_capacity(min(left, 1.0))
                except _Timeout:
                    pass
            except Exception as e:  # noqa: BLE001 - the caller records it as the version's failure
                return f"{type(e).__name__}: {e}"

    def collect(self, kind: int, version: int, done: Callable[[list[P.Message]], bool], deadline: float) -> list[P.Message]:
        """The messages of (kind, version) once ``done`` says they suffice, or what came by the deadline."""
        with self._cond:
            while True:
                got = self.inbox.get(kind, version)
                left = deadline - time.monotonic()
                if done(got) or left <= 0:
                    return got
                self._cond.wait(left)

    def poke(self, _: object = None) -> None:
        """Wakes waiters (an expectation's ``on_done``)."""
        with self._cond:
            self._cond.notify_all()

    def wait_for(self, ready: Callable[[P.Inbox], bool], deadline: float) -> bool:
        """Waits until ``ready(inbox)`` holds or the deadline passed; whether it holds."""
        with self._cond:
            while True:
                if ready(self.inbox):
                    return True
                left = deadline - time.monotonic()
                if left <= 0:
                    return False
                self._cond.wait(left)

    def finish(self, version: int) -> None:
        with self._cond:
            self.inbox.finish(version)

    def close(self) -> None:
        self.hub.detach(self.rules.tag, self)


_HELD = 1024

_DL_CUDA, _DL_CUDA_MANAGED = 2, 13


def _device_shard(x: Any) -> tuple[Any, int, int] | None:
    """A shard in GPU memory as what registers it (a flat byte view for torch), its address
    and its bytes; None for host memory and for a GPU tensor that is not contiguous (copied
    to the host then). Beside torch, any DLPack CUDA object with torch's ``data_ptr()`` and
    ``nbytes``."""
    dlpack_device = getattr(x, "__dlpack_device__", None)
    if dlpack_device is None or dlpack_device()[0] not in (_DL_CUDA, _DL_CUDA_MANAGED):
        return None
    if type(x).__module__.startswith("torch"):
        import torch

        t = x.detach()
        if not t.is_contiguous():
            return None
        flat = t.view(-1).view(torch.uint8)
        # The fabric reads the memory, outside any CUDA stream: what the trainer's kernels
        # queued on it (the optimizer step) must have finished.
        torch.cuda.current_stream(t.device).synchronize()
        return flat, int(flat.data_ptr()), int(flat.numel())
    return x, int(x.data_ptr()), int(x.nbytes)


def _bytes_of(x: Any) -> np.ndarray:
    """A tensor's or array's bytes as a flat uint8 array (torch tensors: from CPU memory)."""
    if type(x).__module__.startswith("torch"):
        import torch

        t = x.detach()
        if t.device.type != "cpu":
            t = t.cpu()
        return t.contiguous().view(-1).view(torch.uint8).numpy()
    a = np.ascontiguousarray(x)
    return a.reshape(-1).view(np.uint8)


_NONCE_PREFIX = "nonce."


class _Member:
    """What senders and receivers share: the engine, the control channel, the peers' records."""

    def __init__(
        self,
        engine: _xfer.TransferEngine,
        rendezvous: _xfer.Rendezvous,
        group: str,
        role: str,
        rank: int,
        senders: int,
        receivers: int,
        *,
        timeout: float,
        grace: float | None,
        imm_base: int,
    ) -> None:
        if not (0 <= rank < (senders if role == "s" else receivers)):
            raise ValueError(f"rank {rank} is outside the {senders} senders / {receivers} receivers")
        self.engine = engine
        self.rendezvous = rendezvous
        self.group = group
        self.role = role
        self.rank = rank
        self.senders = senders
        self.receivers = receivers
        self.timeout = timeout
        self.grace = min(5.0, timeout) if grace is None else grace
        self.imm_base = imm_base
        self.me = rank if role == "s" else senders + rank
        self.nonce = os.urandom(16)
        self.control = _Control(engine, P.Rules(self.me, senders, receivers, P.group_tag(group), self.nonce))
        # Peers' (address, nonce, regions, incarnation), looked up once per version (a
        # restarted rank republishes).
        self._records: dict[int, tuple[bytes, bytes, dict[str, Any], int]] = {}
        # The last record seen of each member, kept across versions: what the coordinator
        # answers a QUERY with (never a lookup on the engine's callback thread).
        self._known: dict[int, tuple[bytes, bytes, dict[str, Any], int]] = {}
        # A tiny region whose descriptor carries this member's nonce in its record (a record
        # names regions; a peer may write these 64 bytes, which nothing reads).
        self._nonce_buf = np.zeros(64, dtype=np.uint8)
        try:
            self._nonce_region = engine.reg_mr(self._nonce_buf)
            self._regions: dict[str, Any] = {}
            self.publication = self._publish()
        except BaseException:
            self.control.close()
            raise
        # Group formation: every other member's record looked up now, off the engine's
        # callback thread and before any version, so that a message in a member's name is
        # checked against its record from the first one on (until then it is held aside).
        self._closed = threading.Event()
        self._forming = threading.Thread(target=self._form, name="xfer-weights-records", daemon=True)
        self._forming.start()

    def stop_forming(self) -> None:
        """Ends the group-formation lookups, waiting for the one in flight (at most its 1 s):
        the thread holds this member and so the rendezvous client, whose connection closes
        only with its last reference. Called by ``close`` and by an owner whose ``close``
        failed (idempotent)."""
        self._closed.set()
        if self._forming is not threading.current_thread():
            self._forming.join(timeout=5.0)

    def _form(self) -> None:
        unknown = [m for m in range(self.senders + self.receivers) if m != self.me]
        while unknown and not self._closed.is_set():
            member = unknown.pop(0)
            if member not in self._known and self._lookup(member, 1.0) is None:
                unknown.append(member)

    def _publish(self) -> Any:
        role = "s" if self.me < self.senders else "r"
        regions = {_NONCE_PREFIX + self.nonce.hex(): self._nonce_region.desc, **self._regions}
        return self.rendezvous.publish(f"{self.group}.{role}{self.rank}", self.engine.main_address, regions, ttl=max(2.0, self.timeout))

    def data_imm(self, version: int) -> int:
        return (self.imm_base + version) & 0xFFFFFFFF

    def record(self, member: int, deadline: float, *, fresh: bool = False) -> tuple[bytes, bytes, dict[str, Any], int] | None:
        """A member's record (address, nonce, regions, incarnation), or None if it never
        appeared by the deadline (or has no nonce: not a member of this protocol)."""
        if member in self._records and not fresh:
            return self._records[member]
        entry = self._lookup(member, max(0.0, deadline - time.monotonic()))
        if entry is not None:
            self._records[member] = entry
        return entry

    def _lookup(self, member: int, timeout: float) -> tuple[bytes, bytes, dict[str, Any], int] | None:
        """A member's record from the rendezvous (None: absent by ``timeout``, or no nonce);
        remembered as the last one seen and its address checked against from then on."""
        name = f"{self.group}.s{member}" if member < self.senders else f"{self.group}.r{member - self.senders}"
        try:
            rec = self.rendezvous.lookup(name, timeout)
        except Exception:  # noqa: BLE001 - a rank that never appeared fails the version
            return None
        regions = dict(rec["regions"])
        nonces = [n for n in regions if n.startswith(_NONCE_PREFIX)]
        if len(nonces) != 1:
            return None
        try:
            nonce = bytes.fromhex(nonces[0][len(_NONCE_PREFIX) :])
        except ValueError:
            return None
        entry = (bytes(rec["addr"]), nonce, regions, int(rec["incarnation"]))
        self._known[member] = entry
        self.control.learn(member, entry[0])
        return entry

    def tell(self, member: int, kind: int, version: int, payload: bytes, deadline: float) -> str:
        """Sends to ``member``; ``""`` or why it could not."""
        rec = self.record(member, deadline)
        if rec is None:
            who = f"trainer rank {member}" if member < self.senders else f"receiver {member - self.senders}"
            return f"{who} is not in the rendezvous"
        return self.control.send(rec[0], rec[1], kind, version, payload, deadline)

    def report(self, version: int, ok: bool, digest: bytes, reason: str, deadline: float) -> None:
        """Tells the coordinator how this rank's part of the version went."""
        payload = bytes([1 if ok else 0]) + digest + reason.encode()[:1024]
        if self.me == 0:
            self.control.deliver(P.Message(P.DONE, version, 0, payload))
        else:
            self.tell(0, P.DONE, version, payload, deadline)

    def decision(self, version: int, deadline: float) -> bytes:
        """The coordinator's decision on ``version`` (the VERDICT payload): waited for a grace
        period, then asked for (QUERY) until the deadline plus twice the grace and as long
        again as the version's timeout; ``VersionInDoubt`` if it never came. Never a decision
        of this rank's own."""
        wait_until = deadline + 2 * self.grace
        # Asked for after a grace period already (a lost commit costs that, not the rest of
        # the deadline); the coordinator answers only once it decided.
        got = self.control.collect(P.VERDICT, version, bool, min(wait_until, time.monotonic() + self.grace))
        give_up = wait_until + max(self.timeout, 4 * self.grace)
        ask_every = max(0.1, min(1.0, self.grace / 2))
        while not got and self.me != 0 and time.monotonic() < give_up:
            self.tell(0, P.QUERY, version, b"", give_up)
            got = self.control.collect(P.VERDICT, version, bool, min(give_up, time.monotonic() + ask_every))
        if not got:
            raise VersionInDoubt(version, "the coordinator's decision never reached this rank (asked until "
                                 f"{give_up - deadline:.0f} s past the deadline); nothing applied here")
        return got[0].payload

    def close(self) -> None:
        self.stop_forming()
        self.control.close()
        self.publication.unpublish()
        self._nonce_region.dereg()


class _Stream(Mapping[int, Any]):
    """Shards pulled from an iterable of ``(index, data)`` in increasing index order, as the
    staged writer asks for them: only the shard asked for is held, those skipped (no writes
    from this rank) are let go as they come."""

    def __init__(self, items: Iterable[tuple[int, Any]]) -> None:
        self._items = iter(items)
        self._current: tuple[int, Any] | None = None
        self._last = -1

    def _seek(self, index: int) -> bool:
        while self._current is None or self._current[0] < index:
            self._current = None
            item = next(self._items, None)
            if item is None:
                return False
            if int(item[0]) <= self._last:
                raise ValueError(f"a stream of shards must come in increasing index order ({item[0]} after {self._last})")
            self._last = int(item[0])
            self._current = (int(item[0]), item[1])
        return self._current[0] == index

    def __contains__(self, index: object) -> bool:
        return isinstance(index, int) and self._seek(index)

    def __getitem__(self, index: int) -> Any:
        if not self._seek(index):
            raise KeyError(index)
        assert self._current is not None
        data = self._current[1]
        self._current = None  # handed over: not held here any more
        return data

    def __iter__(self) -> Any:
        raise TypeError("a stream of shards is read in order, by index")

    def __len__(self) -> int:
        raise TypeError("a stream of shards has no length")

    def drain(self) -> None:
        self._current = None
        for _ in self._items:
            pass


class _Ended(Exception):
    """The coordinator decided the version while this rank was still at it (an abort)."""


_ENDED = "the coordinator ended the version before every write arrived"


def _failed(reports: list[P.Message]) -> bool:
    return any(m.payload[:1] != b"\x01" for m in reports)


def _verdict(version: int, payload: bytes, failure: str) -> None:
    """Raises unless the decision is a commit (with this rank's own reason, if it failed:
    the abort's cause as this rank saw it)."""
    if payload[:1] != b"\x01":
        raise VersionFailed(version, failure or payload[1:].decode(errors="replace"))


def _wait_all(transfers: Iterable[Any], deadline: float, *, quietly: bool = False) -> None:
    """Waits for every transfer (a failed one does not stop the waits for the others: the
    memory they read stays in use until they end); raises the first failure unless quietly."""
    first: BaseException | None = None
    for t in transfers:
        try:
            t.wait(max(0.0, deadline - time.monotonic()))
        except Exception as e:  # noqa: BLE001 - the first one is raised below
            first = first or e
    if first is not None and not quietly:
        raise first


def _aligned(n: int) -> int:
    return (n + 63) // 64 * 64


def _param_ranks(layout: Layout) -> np.ndarray:
    return np.array([p[0] for p in layout.params], dtype=np.uint64)


def _param_offsets(layout: Layout) -> np.ndarray:
    """Each parameter's offset in its receiver's buffer (packed in order, 64-byte aligned)."""
    offsets = np.zeros(len(layout.params), dtype=np.uint64)
    at: dict[int, int] = {}
    for i, (r, _, _, _) in enumerate(layout.params):
        offsets[i] = at.get(r, 0)
        at[r] = at.get(r, 0) + _aligned(layout.param_nbytes(i))
    return offsets


# The two ends, each in a module of its own; imported here so that ``executor`` stays the
# one place both are reached from (and their names the same objects).
from .receiver import WeightReceiver  # noqa: E402
from .sender import WeightSender  # noqa: E402
