"""A trainer rank's side of weight sync (``WeightSender``); the protocol it carries out and the
glue it shares with the receiver are in ``executor``."""

from __future__ import annotations

import collections
import struct
import threading
import time
from collections.abc import Callable, Iterable, Mapping
from typing import Any

import numpy as np

from .. import _xfer
from . import protocol as P
from .executor import (
    _ENDED,
    _aligned,
    _bytes_of,
    _device_shard,
    _Ended,
    _failed,
    _Member,
    _param_offsets,
    _param_ranks,
    _Stream,
    _verdict,
    _wait_all,
)
from .layout import Layout
from .plan import Writes, plan

__all__ = ["WeightSender"]


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
        self.control.begin(version)
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
