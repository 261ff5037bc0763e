"""Why one file: the sender and the receiver are the two ends of one exchange over the same
glue — the hub of engine messages, the control channel, the member record and its nonce
(``_Hub``, ``_Control``, ``_Member``) — and each step of one end is answered by a step of the
other; read together they are the protocol carried out. (A split into ``sender.py`` and
``receiver.py`` over a shared base module is the next step if either grows.)

The executor: ``WeightSender`` on each trainer rank, ``WeightReceiver`` on each inference
rank, one version at a time over the protocol of ``protocol`` (read its documentation first:
two phases, the coordinator alone decides). This module is the glue to the engine — its
messages, registrations, immediates and the rendezvous; what it decides is decided there.

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

import collections
import os
import struct
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
from .plan import Writes, plan

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
        self._cond = threading.Condition()
        self.hub = _Hub.of(engine)
        self.hub.attach(rules.tag, self)

    def handle(self, raw: bytes, sender: bytes = b"") -> None:
        try:
            m = self.rules.decode(raw)
        except P.ProtocolError:
            self.refused += 1
            return
        known = self.addresses.get(m.sender)
        if sender and known is not None and known != sender:
            self.refused += 1
            return
        if m.kind == P.QUERY:
            if self.on_query is not None:
                self.on_query(m)
            return
        self.deliver(m)

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
        name = f"{self.group}.s{member}" if member < self.senders else f"{self.group}.r{member - self.senders}"
        try:
            rec = self.rendezvous.lookup(name, max(0.0, deadline - time.monotonic()))
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
        self._records[member] = entry
        self._known[member] = entry
        self.control.addresses[member] = entry[0]
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


class WeightSender(_Member):
    """A trainer rank's side. Rank 0 also coordinates: it sends the layout and decides.

    Without a ``transform``, shards are written from where they are (no copy; GPU memory
    GPU-direct, contiguous torch CUDA tensors and DLPack CUDA objects): each is registered once and stays registered, and referenced, while later versions give
    the same memory (the model's own parameters); a shard not given again is released at the
    next version, or by ``release()``. With a ``transform`` (a cast), or ``zero_copy=False``,
    shards are copied into registered staging: ``budget_bytes=None`` stages all of this rank's
    shards at once, else two buckets of half of it are filled alternately, one while the
    other's writes are in flight (a shard must fit in one)."""

    def __init__(
        self,
        engine: _xfer.TransferEngine,
        rendezvous: _xfer.Rendezvous,
        group: str,
        rank: int,
        senders: int,
        receivers: int,
        *,
        timeout: float = 60.0,
        grace: float | None = None,
        budget_bytes: int | None = None,
        imm_base: int = 1 << 30,
        zero_copy: bool = True,
    ) -> None:
        super().__init__(engine, rendezvous, group, "s", rank, senders, receivers, timeout=timeout, grace=grace, imm_base=imm_base)
        self.budget_bytes = budget_bytes
        self.zero_copy = zero_copy
        self._layout: Layout | None = None
        self._writes: Writes | None = None
        self._staged_for: tuple[bytes, int | None] | None = None
        self._buckets: list[tuple[np.ndarray, Any]] = []
        self._bucket_of: dict[int, tuple[int, int]] = {}
        self._rounds: list[list[int]] = []
        # Per shard of this rank: [(receiver, src offsets in the shard, dst offsets in the
        # receiver's buffer, lengths)], the plan's rows grouped once per layout.
        self._rows_of: dict[int, list[tuple[int, np.ndarray, np.ndarray, np.ndarray]]] = {}
        self._targets: list[int] = []
        self._arrivals_to: dict[int, int] = {}
        # Shards written from their own memory: (address, bytes) -> (the data, its region).
        self._registered: dict[tuple[int, int], tuple[Any, Any]] = {}
        # Regions this rank registered for shards written in place, over its life (a shard
        # given again in the same memory is not registered again).
        self.registrations = 0
        # The coordinator's: decisions of recent versions (answers to QUERY), and which
        # layout each receiver reported success with, under which incarnation of its record.
        self._decided: collections.OrderedDict[int, bytes] = collections.OrderedDict()
        self._has: dict[int, tuple[int, bytes]] = {}
        self.manifests_sent = 0
        self._asked: collections.deque[tuple[int, int]] = collections.deque()
        self._asked_cond = threading.Condition()
        self._answering: threading.Thread | None = None
        self._closing = False
        if self.me == 0:
            self.control.on_query = self._answer

    def _answer(self, m: P.Message) -> None:
        """Answers a QUERY with the decision, if one was made: at once from a record already
        known, else through the answering thread (a rendezvous lookup never runs on the
        engine's callback thread); at most 64 wait for it, more are dropped (they ask again)."""
        payload = self._decided.get(m.version)
        if payload is None:
            return
        rec = self._known.get(m.sender)
        if rec is not None:
            self.control.send(rec[0], rec[1], P.VERDICT, m.version, payload, time.monotonic() + 1.0)
            return
        with self._asked_cond:
            if len(self._asked) < 64:
                self._asked.append((m.sender, m.version))
                self._asked_cond.notify()
            if self._answering is None:
                self._answering = threading.Thread(target=self._answer_loop, name="xfer-weights-answers", daemon=True)
                self._answering.start()

    def _answer_loop(self) -> None:
        while True:
            with self._asked_cond:
                while not self._asked and not self._closing:
                    self._asked_cond.wait()
                if self._closing:
                    return
                member, version = self._asked.popleft()
            rec = self._known.get(member) or self.record(member, time.monotonic() + 2.0)
            payload = self._decided.get(version)
            if rec is not None and payload is not None:
                self.control.send(rec[0], rec[1], P.VERDICT, version, payload, time.monotonic() + 1.0)

    def _prepare(self, layout: Layout) -> None:
        if self._layout is not None and self._layout.digest() == layout.digest():
            return
        writes = plan(layout, sender=self.rank)
        src_shard, src_off, dst_param, dst_off, lens = writes.rows()
        param = dst_param.astype(np.int64)
        dst_rank = _param_ranks(layout)[param]
        dst_abs = dst_off + _param_offsets(layout)[param]
        # Group the rows by (shard, receiver) once: a version then submits one list per group.
        order = np.lexsort((dst_rank, src_shard))
        key_s, key_r = src_shard[order], dst_rank[order]
        cuts = np.flatnonzero((np.diff(key_s) != 0) | (np.diff(key_r) != 0)) + 1
        self._rows_of = {}
        for idx in np.split(order, cuts) if len(order) else []:
            s, r = int(src_shard[idx[0]]), int(dst_rank[idx[0]])
            self._rows_of.setdefault(s, []).append((r, src_off[idx], dst_abs[idx], lens[idx]))
        self._targets = sorted({int(r) for r in dst_rank})
        # The immediates this rank's writes bring each receiver, as this engine stripes them
        # (each row one write): told to the receiver, which cannot know this engine's NICs.
        self._arrivals_to = {r: 0 for r in range(self.receivers)}
        for groups in self._rows_of.values():
            for r, _, _, lens in groups:
                values, counts = np.unique(lens, return_counts=True)
                self._arrivals_to[r] += sum(int(c) * self.engine.expected_arrivals(int(n)) for n, c in zip(values, counts))
        self._layout, self._writes, self._staged_for = layout, writes, None

    def _prepare_staging(self, layout: Layout) -> None:
        """Buckets and rounds for the staged path (once per layout and budget)."""
        if self._staged_for == (layout.digest(), self.budget_bytes):
            return
        mine = sorted(self._rows_of)
        for buf, region in self._buckets:
            region.dereg()
        self._buckets, self._bucket_of, self._rounds = [], {}, []
        sizes = {s: layout.shard_nbytes(s) for s in mine}
        if self.budget_bytes is None:
            cap = max(1, sum(_aligned(n) for n in sizes.values()))
            nbuckets = 1
        else:
            cap = self.budget_bytes // 2
            nbuckets = 2
            for s, n in sizes.items():
                if n > cap:
                    raise ValueError(
                        f"shard {s} ({layout.shards[s][1]!r}, {n} bytes) does not fit a staging bucket "
                        f"of {cap} bytes (half of budget_bytes={self.budget_bytes})"
                    )
        # Rounds: consecutive shards filling one bucket each, buckets alternating.
        at, current = 0, []
        for s in mine:
            n = _aligned(sizes[s])
            if current and at + n > cap:
                self._rounds.append(current)
                at, current = 0, []
            self._bucket_of[s] = (len(self._rounds) % nbuckets, at)
            current.append(s)
            at += n
        if current:
            self._rounds.append(current)
        for _ in range(min(nbuckets, max(1, len(self._rounds)))):
            buf = np.zeros(cap, dtype=np.uint8)
            self._buckets.append((buf, self.engine.reg_mr(buf, access="local")))
        self._staged_for = (layout.digest(), self.budget_bytes)

    def send(
        self,
        version: int,
        layout: Layout,
        shards: Mapping[int, Any] | Iterable[tuple[int, Any]],
        *,
        transform: Callable[[str, Any], Any] | None = None,
    ) -> None:
        """Sends ``version``: ``shards`` maps each of this rank's shard indices (into
        ``layout.shards``) to its data (numpy array or CPU torch tensor, the slice's bytes in
        row-major order), ``transform(tensor name, data)`` (optional) turns it into the wire
        dtype the layout declares. Returns once the coordinator committed the version; raises
        ``VersionFailed`` otherwise.

        ``shards`` may instead be an iterable of ``(index, data)`` in increasing index order (a
        stream: each shard is pulled only when its turn comes, staged into a bucket, written,
        and let go — at most the two buckets and the shard being pulled are held). A stream is
        always consumed to its end, even when the version fails (its producer may be a
        collective every trainer rank must finish)."""
        if not isinstance(shards, Mapping):
            shards = _Stream(shards)
        try:
            self._send(version, layout, shards, transform)
        finally:
            if isinstance(shards, _Stream):
                shards.drain()

    def _send(self, version: int, layout: Layout, shards: Mapping[int, Any], transform: Any) -> None:
        deadline = time.monotonic() + self.timeout
        self._records = {}
        failure = ""
        try:
            self._prepare(layout)
        except Exception as e:  # noqa: BLE001 - reported, so that the others fail fast
            failure = f"trainer rank {self.rank}: {e}"
        if self.rank == 0:
            failure = self._send_manifests(version, layout, deadline) or failure
        cause = failure
        if not failure:
            try:
                self._write(version, layout, shards, transform, deadline)
            except _Ended as e:
                failure = f"trainer rank {self.rank}: {e}"
            except Exception as e:  # noqa: BLE001
                failure = cause = f"trainer rank {self.rank}: {e}"
        self.report(version, not failure, layout.digest(), failure, deadline)
        if self.rank == 0:
            self._decide(version, layout.digest(), deadline + self.grace)
        try:
            payload = self.decision(version, deadline)
        finally:
            self.control.finish(version)
        _verdict(version, payload, cause)

    def _send_manifests(self, version: int, layout: Layout, deadline: float) -> str:
        """The MANIFEST to every receiver, the layout itself only to those without it."""
        digest = layout.digest()
        raw: bytes | None = None
        failure = ""
        for r in range(self.receivers):
            member = self.senders + r
            rec = self.record(member, deadline)
            if rec is None:
                failure = failure or f"receiver {r} is not in the rendezvous"
                continue
            remaining_ms = max(0, int((deadline - time.monotonic()) * 1000))
            if self._has.get(r) == (rec[3], digest):
                chunks = [b""]
                total = 0
            else:
                raw = layout.to_json() if raw is None else raw
                chunks = [raw[i : i + P.CHUNK] for i in range(0, len(raw), P.CHUNK)] or [b""]
                total = len(raw)
                self.manifests_sent += 1
            for i, c in enumerate(chunks):
                payload = P.manifest_payload(i, len(chunks), remaining_ms, digest, total, c)
                why = self.control.send(rec[0], rec[1], P.MANIFEST, version, payload, deadline)
                if why:
                    failure = failure or f"the layout could not be sent to receiver {r}: {why}"
                    break
        return failure

    def _shard_bytes(self, layout: Layout, shards: Mapping[int, Any], s: int, transform: Any) -> tuple[Any, np.ndarray]:
        if s not in shards:
            raise KeyError(f"shard {s} ({layout.shards[s][1]!r}) has writes in the plan but was not given")
        data = shards[s] if transform is None else transform(layout.shards[s][1], shards[s])
        raw = _bytes_of(data)
        if raw.nbytes != layout.shard_nbytes(s):
            raise ValueError(
                f"shard {s} ({layout.shards[s][1]!r}): {raw.nbytes} bytes given, the layout says {layout.shard_nbytes(s)}"
            )
        return data, raw

    def ready(self, version: int, layout: Layout, deadline: float) -> dict[int, Any]:
        """Each target receiver's buffer descriptor, from its READY, checked against its record."""
        targets = set(self._targets)

        def settled(box: P.Inbox) -> bool:
            # Every target is ready, or the version is already lost: the coordinator decided
            # (or, on the coordinator, a rank reported failure) — no point writing on.
            return ({m.sender - self.senders for m in box.get(P.READY, version)} >= targets
                    or bool(box.get(P.VERDICT, version)) or _failed(box.get(P.DONE, version)))

        self.control.wait_for(settled, deadline)
        if self.control.collect(P.VERDICT, version, bool, 0.0):
            raise _Ended(_ENDED)
        got = self.control.collect(P.READY, version, bool, 0.0)
        descs: dict[int, Any] = {}
        for m in got:
            r = m.sender - self.senders
            if r not in targets:
                continue
            if m.payload[:16] != layout.digest():
                raise ValueError(f"receiver {r} is ready for another layout")
            descs[r] = self._checked_desc(m.sender, m.payload[16:17], m.payload[17:], deadline)
        missing = [r for r in targets if r not in descs]
        if missing:
            raise TimeoutError(f"receivers {missing} were not ready before the deadline")
        return descs

    def _checked_desc(self, member: int, which: bytes, raw: bytes, deadline: float) -> Any:
        """The descriptor a READY names, only if the receiver's own record offers it (looked
        up again once if not: the receiver republishes when its buffers change)."""
        name = f"buf{which[0]}"
        for fresh in (False, True):
            rec = self.record(member, deadline, fresh=fresh)
            if rec is not None and name in rec[2] and bytes(rec[2][name]) == raw:
                return rec[2][name]
        raise ValueError(f"receiver {member - self.senders} named a buffer its rendezvous record does not offer")

    def _write(self, version: int, layout: Layout, shards: Mapping[int, Any], transform: Any, deadline: float) -> None:
        descs = self.ready(version, layout, deadline)
        for r in range(self.receivers):
            why = self.tell(self.senders + r, P.COUNT, version, struct.pack("<Q", self._arrivals_to.get(r, 0)), deadline)
            if why:
                raise RuntimeError(f"could not tell receiver {r} what this rank sends it: {why}")
        if transform is None and self.zero_copy and not isinstance(shards, _Stream):
            self._write_in_place(version, layout, shards, descs, deadline)
        else:
            self._write_staged(version, layout, shards, transform, descs, deadline)
        if isinstance(shards, _Stream):
            # Read to its end before reporting: whatever the producer finds wrong after this
            # rank's last shard (more tensors than the layout has) fails the version.
            shards.drain()

    def _write_in_place(self, version: int, layout: Layout, shards: Mapping[int, Any], descs: dict[int, Any], deadline: float) -> None:
        """Each shard written from its own memory, registered once while it stays the same."""
        imm = self.data_imm(version)
        used: dict[tuple[int, int], tuple[Any, Any]] = {}
        transfers: list[Any] = []
        try:
            for s, groups in self._rows_of.items():
                if s not in shards:
                    raise KeyError(f"shard {s} ({layout.shards[s][1]!r}) has writes in the plan but was not given")
                device = _device_shard(shards[s])
                if device is None:
                    data, raw = self._shard_bytes(layout, shards, s, None)
                    key = (int(raw.ctypes.data), int(raw.nbytes))
                else:
                    # GPU memory is written from where it is (GPU-direct), never copied to
                    # the host: the fabric reads it.
                    data = shards[s]
                    raw, ptr, nbytes = device
                    if nbytes != layout.shard_nbytes(s):
                        raise ValueError(f"shard {s} ({layout.shards[s][1]!r}): {nbytes} bytes given, "
                                         f"the layout says {layout.shard_nbytes(s)}")
                    key = (ptr, nbytes)
                entry = used.get(key) or self._registered.get(key)
                if entry is None:
                    # The region holds ``raw`` (and through it ``data``): the memory cannot be
                    # freed, and its address reused by other data, while it is registered.
                    entry = (data, self.engine.reg_mr(raw, access="local"))
                    self.registrations += 1
                used[key] = entry
                for r, src, dst, lens in groups:
                    transfers.append(self.engine.submit_writes(entry[1], descs[r], src, dst, lens, imm=imm))
            _wait_all(transfers, deadline)
        except BaseException:
            _wait_all(transfers, deadline, quietly=True)
            raise
        finally:
            for key, (_, region) in self._registered.items():
                if key not in used:
                    region.dereg()
            self._registered = used

    def _write_staged(
        self, version: int, layout: Layout, shards: Mapping[int, Any], transform: Any, descs: dict[int, Any], deadline: float
    ) -> None:
        """Shards (transformed) copied into two buckets, each written as soon as it is staged
        (while the next is gathered); a bucket is refilled once its writes are done."""
        self._prepare_staging(layout)
        imm = self.data_imm(version)
        in_flight: dict[int, list[Any]] = {}
        try:
            for k, round_shards in enumerate(self._rounds):
                b = k % len(self._buckets)
                # The bucket's previous writes must be done before it is refilled.
                _wait_all(in_flight.pop(b, []), deadline)
                buf, region = self._buckets[b]
                transfers = in_flight.setdefault(b, [])
                for s in round_shards:
                    raw = self._shard_bytes(layout, shards, s, transform)[1]
                    at = self._bucket_of[s][1]
                    buf[at : at + raw.nbytes] = raw
                    del raw  # the shard (a streamed tensor) may go: its bytes are staged
                    for r, src, dst, lens in self._rows_of[s]:
                        transfers.append(self.engine.submit_writes(region, descs[r], src + np.uint64(at), dst, lens, imm=imm))
            _wait_all([t for ts in in_flight.values() for t in ts], deadline)
        except BaseException:
            _wait_all([t for ts in in_flight.values() for t in ts], deadline, quietly=True)
            raise

    def release(self) -> None:
        """Deregisters (and lets go of) the shards the last version was written from."""
        for _, region in self._registered.values():
            region.dereg()
        self._registered = {}

    def close(self) -> None:
        with self._asked_cond:
            self._closing = True
            self._asked_cond.notify_all()
        self.release()
        for _, region in self._buckets:
            region.dereg()
        self._buckets = []
        super().close()

    def _decide(self, version: int, digest: bytes, deadline: float) -> None:
        """Phase two: commit when every member reported success with this layout, else abort
        (as soon as one reported failure: the others stop waiting for writes that will not
        come); the decision goes to every member, those that reported first."""
        everyone = self.senders + self.receivers
        got = self.control.collect(P.DONE, version, lambda g: len(g) >= everyone or _failed(g), deadline)
        reports = {m.sender: m.payload for m in got}
        reason = P.decide(reports, self.senders, self.receivers, digest)
        payload = b"\x01" if not reason else b"\x00" + reason.encode()[:1024]
        self._decided[version] = payload
        while len(self._decided) > 16:
            self._decided.popitem(last=False)
        for member, p in reports.items():
            if member >= self.senders and p[:1] == b"\x01":
                rec = self._records.get(member)
                if rec is not None:
                    self._has[member - self.senders] = (rec[3], p[1:17])
            elif member >= self.senders:
                self._has.pop(member - self.senders, None)
        self.control.deliver(P.Message(P.VERDICT, version, 0, payload))
        for member in sorted(set(reports) - {0}):
            self.tell(member, P.VERDICT, version, payload, deadline)
        # Those that have not reported: only where this version found their records (no
        # lookup for one that never appeared: it fails by its own deadline); a QUERY of one
        # whose record is unknown here is answered once it reported (its record looked up).
        for member in range(1, everyone):
            if member not in reports and member in self._records:
                self.tell(member, P.VERDICT, version, payload, deadline)


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


class WeightReceiver(_Member):
    """An inference rank's side: its parameters live in one registered buffer (``buffer``),
    each a view (``params``: name → uint8 view of its bytes, row-major).

    In place (default), the caller pauses readers of ``params`` during ``receive`` (a failed
    version leaves them partly overwritten; the next successful one rewrites every byte).
    With ``double_buffer=True`` there are two buffers: each version is written into the one
    readers do not see, and ``buffer``/``params`` switch to it only once the coordinator
    committed the version. Readers keep reading the previous version during ``receive``, and
    a failed version leaves ``params`` as they were; views taken before a ``receive`` that
    succeeded must be dropped before the next ``receive`` starts (it writes into them).

    ``max_bytes``: the most this receiver allocates for a layout (default: half the
    machine's memory); a layout that needs more fails the version, allocating nothing."""

    def __init__(
        self,
        engine: _xfer.TransferEngine,
        rendezvous: _xfer.Rendezvous,
        group: str,
        rank: int,
        senders: int,
        receivers: int,
        *,
        timeout: float = 60.0,
        grace: float | None = None,
        imm_base: int = 1 << 30,
        double_buffer: bool = False,
        max_bytes: int | None = None,
    ) -> None:
        super().__init__(engine, rendezvous, group, "r", rank, senders, receivers, timeout=timeout, grace=grace, imm_base=imm_base)
        self.double_buffer = double_buffer
        self.max_bytes = _physical_memory() // 2 if max_bytes is None else max_bytes
        self.layout: Layout | None = None
        self.buffer: np.ndarray | None = None
        self.params: dict[str, np.ndarray] = {}
        self.specs: dict[str, tuple[tuple[int, ...], str]] = {}
        self._region: Any = None
        # Per buffer (one, or two when double-buffered): the array, its region, its views.
        self._buffers: list[tuple[np.ndarray, Any, dict[str, np.ndarray]]] = []
        self._front = 0

    def _prepare(self, layout: Layout) -> None:
        if self.layout is not None and self.layout.digest() == layout.digest():
            return
        offsets = _param_offsets(layout)
        mine = [i for i, p in enumerate(layout.params) if p[0] == self.rank]
        total = max([int(offsets[i]) + _aligned(layout.param_nbytes(i)) for i in mine], default=64)
        copies = 2 if self.double_buffer else 1
        if total * copies > self.max_bytes:
            raise ValueError(f"the layout needs {total * copies} bytes here, past max_bytes={self.max_bytes}")
        specs = {}
        for i in mine:
            _, name, shape, pieces = layout.params[i]
            if name in specs:
                raise ValueError(f"receiver {self.rank} has two parameters named {name!r}")
            specs[name] = (tuple(shape), layout.tensor(pieces[0][0]).dtype)
        for _, region, _ in self._buffers:
            region.dereg()
        self._buffers, self._front, self._region = [], 0, None
        self.layout = None
        self.specs = specs
        for _ in range(copies):
            buf = np.zeros(total, dtype=np.uint8)
            views = {layout.params[i][1]: buf[int(offsets[i]) : int(offsets[i]) + layout.param_nbytes(i)] for i in mine}
            self._buffers.append((buf, self.engine.reg_mr(buf), views))
        self._show(0)
        # The record offers exactly these buffers: a sender writes only into what it names.
        self._regions = {f"buf{k}": region.desc for k, (_, region, _) in enumerate(self._buffers)}
        # A name has one live publisher: the record is replaced, briefly absent (a sender's
        # lookup waits for it).
        self.publication.unpublish()
        self.publication = self._publish()
        self.layout = layout

    def _counts(self, version: int, deadline: float) -> int:
        """The sum of every sender's COUNT for ``version``."""
        def settled(box: P.Inbox) -> bool:
            return len(box.get(P.COUNT, version)) >= self.senders or bool(box.get(P.VERDICT, version))

        self.control.wait_for(settled, deadline)
        got = self.control.collect(P.COUNT, version, bool, 0.0)
        if len(got) < self.senders:
            if self.control.collect(P.VERDICT, version, bool, 0.0):
                raise _Ended(_ENDED)
            missing = sorted(set(range(self.senders)) - {m.sender for m in got})
            raise TimeoutError(f"trainer ranks {missing} never said what they send here")
        return sum(struct.unpack("<Q", m.payload)[0] for m in got)

    def _await_arrivals(self, version: int, expectation: Any, deadline: float) -> str:
        """Waits for every write of ``version`` to land, until the deadline or an abort from
        the coordinator; ``""`` or why not. Past the engine's own ``expect_ms``: when the
        engine times an expectation out first, its debt keeps absorbing the arrivals, and an
        expectation of nothing queued behind it is met exactly when the debt is paid."""
        imm = self.data_imm(version)
        while True:
            self.control.wait_for(lambda box: expectation.done() or bool(box.get(P.VERDICT, version)), deadline)
            if not expectation.done():
                expectation.cancel()
                if self.control.collect(P.VERDICT, version, bool, 0.0):
                    return _ENDED
                return f"not every write of version {version} arrived by the deadline"
            error = expectation.exception()
            if error is None:
                return ""
            if not isinstance(error, _Timeout) or time.monotonic() >= deadline:
                return f"not every write of version {version} arrived ({type(error).__name__}: {error})"
            expectation = self.engine.expect_imm_count(imm, 0, on_done=self.control.poke)

    def _show(self, k: int) -> None:
        """Makes buffer ``k`` the one readers see."""
        self._front = k
        self.buffer, self._region, self.params = self._buffers[k]

    def _layout_of(self, got: list[P.Message]) -> tuple[Layout, float]:
        """The version's layout (sent, or the one this receiver has) and the time left."""
        parts = sorted(P.parse_manifest(m.payload) for m in got)
        _, count, remaining_ms, digest, total, _ = parts[0]
        if any(p[1:5] != (count, remaining_ms, digest, total) for p in parts) or len(parts) != count:
            raise ValueError("the coordinator's MANIFEST chunks disagree")
        if total == 0:
            if self.layout is None or self.layout.digest() != digest:
                raise ValueError("the coordinator sent no layout, and this receiver has none with its digest")
            return self.layout, remaining_ms / 1000
        raw = b"".join(p[5] for p in parts)
        if len(raw) != total:
            raise ValueError(f"the layout's chunks hold {len(raw)} bytes, the MANIFEST says {total}")
        layout = Layout.from_json(raw)
        if layout.digest() != digest:
            raise ValueError("the layout's digest is not the one the MANIFEST names")
        return layout, remaining_ms / 1000

    def receive(self, version: int) -> dict[str, np.ndarray]:
        """Receives ``version`` into ``params`` (returned); returns only when the coordinator
        committed it (every byte landed on every receiver, every rank succeeded); raises
        ``VersionFailed`` otherwise (``VersionInDoubt`` when the decision never came)."""
        deadline = time.monotonic() + self.timeout
        self._records = {}
        failure, digest = "", b"\x00" * 16

        def complete(g: list[P.Message]) -> bool:
            return bool(g) and len(g) >= P.parse_manifest(g[0].payload)[1]

        got = self.control.collect(P.MANIFEST, version, complete, deadline)
        target = self._front
        expectation = None
        if not complete(got):
            failure = f"receiver {self.rank}: no layout from trainer rank 0 in time"
        else:
            try:
                layout, left = self._layout_of(got)
                # The coordinator's deadline is the version's: a receiver that started early
                # waits as long as the coordinator does.
                deadline = time.monotonic() + left
                digest = layout.digest()
                self._prepare(layout)
                target = (self._front + 1) % len(self._buffers)
                payload = digest + bytes([target]) + bytes(self._buffers[target][1].desc)
                for s in range(self.senders):
                    why = self.tell(s, P.READY, version, payload, deadline)
                    if why:
                        raise RuntimeError(f"could not tell trainer rank {s} it is ready: {why}")
                # The immediates the version brings, as each sender's engine stripes its writes.
                arrivals = self._counts(version, deadline)
                if arrivals:
                    expectation = self.engine.expect_imm_count(self.data_imm(version), arrivals, on_done=self.control.poke)
            except _Ended:
                failure = f"receiver {self.rank}: {_ENDED}"
            except Exception as e:  # noqa: BLE001
                failure = f"receiver {self.rank}: {e}"
        cause = "" if failure.endswith(_ENDED) else failure
        if expectation is not None:
            if failure:
                expectation.cancel()
            else:
                why = self._await_arrivals(version, expectation, deadline)
                failure = f"receiver {self.rank}: {why}" if why else ""
                # Ended by the coordinator's abort: the cause is in its verdict.
                cause = "" if why == _ENDED else failure
        self.report(version, not failure, digest, failure, deadline)
        try:
            payload = self.decision(version, deadline)
        finally:
            self.control.finish(version)
        # Phase two's apply: only a committed version is shown.
        _verdict(version, payload, cause)
        self._show(target)
        return self.params

    def tensors(self) -> Iterable[tuple[str, Any]]:
        """The received parameters as torch tensors of their dtypes and shapes (views of ``buffer``)."""
        import torch

        for name, raw in self.params.items():
            shape, dtype = self.specs[name]
            yield name, torch.from_numpy(raw).view(getattr(torch, dtype)).view(shape)

    def close(self) -> None:
        for _, region, _ in self._buffers:
            region.dereg()
        self._buffers, self._region = [], None
        super().close()
