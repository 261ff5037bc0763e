"""Why one file: the sender, the receiver and the coordinator are the two ends of one
versioned protocol — the message kinds, the layout and its digest, the version's immediate and
the verdict are read and written by both sides, and a change to one side is a change to the
other; the plan itself is in Rust (``xfer-weight-plan``), the engines' integrations in
``engine_weights``, ``vllm_weights``, ``sglang_weights`` and ``verl``.

RL weight sync: trainer ranks write a new version of the weights straight into the inference
ranks' registered parameter memory, on a plan computed once from both sides' metadata.

The plan (``plan``, computed in Rust by the ``xfer-weight-plan`` crate) says which trainer
rank sends which bytes of which of its shards to which offset of which inference parameter:
every parameter byte written exactly once, replicated bytes sent once per destination by the
least loaded of their holders, resharding along any dimension as strided runs.

The executor (``WeightSender`` on each trainer rank, ``WeightReceiver`` on each inference
rank) runs one version at a time:

1. The coordinator (trainer rank 0) sends the layout to every receiver, every version (chunked
   JSON; a receiver compares its digest with the last one's). A receiver (re)allocates and registers its parameters when the
   layout changed, computes how many immediates the version's writes bring
   (``expected_arrivals``), waits for them on the version's own immediate, and tells every
   sender it is ready (with its region's descriptor).
2. Each sender writes its runs to each ready receiver: from the shards' own memory
   (registered once while the same memory comes back each version), or, with a ``transform``
   (e.g. a dtype cast), staged into registered buckets — all at once, or two buckets of half a
   memory budget each, one filled while the other's writes are in flight.
3. Every rank reports to the coordinator (done, or failed and why); the coordinator sends the
   verdict. ``send``/``receive`` return only with a positive verdict: a receiver never reports
   a version complete before every byte of it landed and every other rank succeeded too. A
   dead rank or a timeout fails the version everywhere by ``timeout`` plus a grace period; the
   next version uses fresh immediates, so late arrivals of a failed one cannot count for it.

Receivers write in place — the caller pauses readers of the parameters during ``receive`` (a
failed version leaves them partly overwritten; the next successful one rewrites every byte)
— or double-buffer (``double_buffer=True``): readers see a version only once it is complete
everywhere. Control messages travel as xfer messages; peers find each other through an
``xfer.Rendezvous`` (``<group>.s<rank>`` and ``<group>.r<rank>``).
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import struct
import threading
import time
from collections.abc import Callable, Iterable, Mapping, Sequence
from typing import Any

import numpy as np

from . import _xfer

__all__ = [
    "TensorSpec",
    "Layout",
    "Writes",
    "plan",
    "VersionFailed",
    "WeightSender",
    "WeightReceiver",
    "DTYPE_SIZES",
]

# A trainer shard's slice: None (whole), ("flat", start_byte, end_byte) or ("dim", dim, start, end).
SliceSpec = tuple[Any, ...] | None
# A parameter piece: (tensor name, None or ("dim", dim, start, end), coordinates in the parameter).
PieceSpec = tuple[str, SliceSpec, tuple[int, ...]]

DTYPE_SIZES: dict[str, int] = {
    "bool": 1, "uint8": 1, "int8": 1, "float8_e4m3fn": 1, "float8_e5m2": 1,
    "float16": 2, "bfloat16": 2, "int16": 2,
    "float32": 4, "int32": 4, "uint32": 4,
    "float64": 8, "int64": 8, "uint64": 8,
}


@dataclasses.dataclass(frozen=True)
class TensorSpec:
    """A tensor as the receivers get it: name, full shape, dtype name (``"bfloat16"``, …)."""

    name: str
    shape: tuple[int, ...]
    dtype: str

    @property
    def elem_size(self) -> int:
        try:
            return DTYPE_SIZES[self.dtype]
        except KeyError:
            raise ValueError(f"tensor {self.name!r}: unknown dtype {self.dtype!r} (known: {sorted(DTYPE_SIZES)})") from None

    @property
    def nbytes(self) -> int:
        return int(np.prod(self.shape, dtype=np.int64)) * self.elem_size


@dataclasses.dataclass(frozen=True)
class Layout:
    """Both sides' metadata. ``shards``: (trainer rank, tensor, slice), a write's ``src_shard``
    indexes it; ``params``: (inference rank, name, shape, pieces), ``dst_param`` indexes it."""

    tensors: tuple[TensorSpec, ...]
    shards: tuple[tuple[int, str, SliceSpec], ...]
    params: tuple[tuple[int, str, tuple[int, ...], tuple[PieceSpec, ...]], ...]

    @staticmethod
    def replicated(tensors: Sequence[TensorSpec], senders: int, receivers: int) -> Layout:
        """Every trainer rank holds every tensor whole; every receiver gets every tensor whole
        (verl's contract: each trainer rank yields full tensors; each rollout worker loads
        full tensors through its engine's own ``load_weights``). The plan splits the sending
        evenly over the trainer ranks."""
        shards = tuple((s, t.name, None) for s in range(senders) for t in tensors)
        return Layout(tuple(tensors), shards, Layout.whole_params(tensors, receivers))

    @staticmethod
    def whole_params(tensors: Sequence[TensorSpec], receivers: int) -> tuple[Any, ...]:
        """Every receiver gets every tensor whole."""
        return tuple(
            (r, t.name, tuple(t.shape), ((t.name, None, (0,) * len(t.shape)),)) for r in range(receivers) for t in tensors
        )

    def tensor(self, name: str) -> TensorSpec:
        return self._by_name()[name]

    def _by_name(self) -> dict[str, TensorSpec]:
        cache = self.__dict__.get("_names")
        if cache is None:
            cache = {t.name: t for t in self.tensors}
            object.__setattr__(self, "_names", cache)
        return cache

    def param_elem_size(self, index: int) -> int:
        pieces = self.params[index][3]
        return self.tensor(pieces[0][0]).elem_size

    def param_nbytes(self, index: int) -> int:
        return int(np.prod(self.params[index][2], dtype=np.int64)) * self.param_elem_size(index)

    def shard_nbytes(self, index: int) -> int:
        _, name, sl = self.shards[index]
        t = self.tensor(name)
        if sl is None:
            return t.nbytes
        if sl[0] == "flat":
            return int(sl[2]) - int(sl[1])
        _, dim, start, end = sl
        return t.nbytes // t.shape[dim] * (end - start)

    def to_json(self) -> bytes:
        return json.dumps(
            {
                "tensors": [[t.name, list(t.shape), t.dtype] for t in self.tensors],
                "shards": [[r, n, None if s is None else list(s)] for r, n, s in self.shards],
                "params": [
                    [r, n, list(shape), [[t, None if s is None else list(s), list(at)] for t, s, at in pieces]]
                    for r, n, shape, pieces in self.params
                ],
            },
            separators=(",", ":"),
        ).encode()

    @staticmethod
    def from_json(raw: bytes) -> Layout:
        d = json.loads(raw)
        sl = lambda s: None if s is None else tuple(s)  # noqa: E731
        return Layout(
            tuple(TensorSpec(n, tuple(shape), dtype) for n, shape, dtype in d["tensors"]),
            tuple((int(r), n, sl(s)) for r, n, s in d["shards"]),
            tuple(
                (int(r), n, tuple(shape), tuple((t, sl(s), tuple(at)) for t, s, at in pieces))
                for r, n, shape, pieces in d["params"]
            ),
        )

    def digest(self) -> bytes:
        cache = self.__dict__.get("_digest")
        if cache is None:
            cache = hashlib.sha256(self.to_json()).digest()[:16]
            object.__setattr__(self, "_digest", cache)
        return cache


_COLUMNS = ("src_rank", "src_shard", "src_offset", "dst_rank", "dst_param", "dst_offset", "len", "count", "src_stride", "dst_stride")


@dataclasses.dataclass
class Writes:
    """A plan's writes as numpy columns (uint64): ``count`` rows of ``len`` bytes, row ``i`` from
    ``src_offset + i*src_stride`` of shard ``src_shard`` to ``dst_offset + i*dst_stride`` of
    parameter ``dst_param``; and the bytes each trainer rank sends / inference rank receives."""

    src_rank: np.ndarray
    src_shard: np.ndarray
    src_offset: np.ndarray
    dst_rank: np.ndarray
    dst_param: np.ndarray
    dst_offset: np.ndarray
    len: np.ndarray
    count: np.ndarray
    src_stride: np.ndarray
    dst_stride: np.ndarray
    sent: list[int]
    received: list[int]

    def __len__(self) -> int:
        return int(self.len.shape[0])

    def rows(self, keep: np.ndarray | None = None) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
        """Every row of the (kept) writes as one contiguous write:
        ``(src_shard, src_offset, dst_param, dst_offset, len)``."""
        sel = (lambda c: c) if keep is None else (lambda c: c[keep])  # noqa: E731
        count = sel(self.count).astype(np.int64)
        n = int(count.sum())
        first = np.repeat(np.cumsum(count) - count, count)
        i = (np.arange(n, dtype=np.int64) - first).astype(np.uint64)
        rep = lambda c: np.repeat(sel(c), count)  # noqa: E731
        return (
            rep(self.src_shard),
            rep(self.src_offset) + i * rep(self.src_stride),
            rep(self.dst_param),
            rep(self.dst_offset) + i * rep(self.dst_stride),
            rep(self.len),
        )


def plan(layout: Layout, *, sender: int | None = None, receiver: int | None = None) -> Writes:
    """The plan of ``layout`` (only trainer rank ``sender``'s writes, or only those to inference
    rank ``receiver``, when given). A layout the plan refuses raises
    ``xfer.InvalidArgumentError`` naming the tensor, shard or parameter."""
    params = [
        (r, name, list(shape), layout.param_elem_size(i), [(t, s, list(at)) for t, s, at in pieces])
        for i, (r, name, shape, pieces) in enumerate(layout.params)
    ]
    out = _xfer.plan_weights(
        [(t.name, list(t.shape), t.elem_size) for t in layout.tensors],
        [(r, n, s) for r, n, s in layout.shards],
        params,
        sender=sender,
        receiver=receiver,
    )
    cols = {c: np.frombuffer(out[c], dtype="<u8") for c in _COLUMNS}
    return Writes(**cols, sent=list(out["sent"]), received=list(out["received"]))


class VersionFailed(RuntimeError):
    """A version did not complete on every rank; ``reason`` says what this rank saw first."""

    def __init__(self, version: int, reason: str) -> None:
        super().__init__(f"weight version {version} failed: {reason}")
        self.version = version
        self.reason = reason


# Control messages: magic, kind, version, sender id (senders 0..m-1, receivers m..m+n-1), payload.
_HEADER = struct.Struct("<2sBIi")
_MAGIC = b"XW"
_MANIFEST, _READY, _DONE, _VERDICT = 1, 2, 3, 4
_MSG_BYTES = 1 << 16
_CHUNK = _MSG_BYTES - 64


class _Control:
    """This rank's side of the control channel: xfer messages, collected per (kind, version)."""

    def __init__(self, engine: _xfer.TransferEngine, me: int) -> None:
        self.engine = engine
        self.me = me
        self._cond = threading.Condition()
        self._inbox: dict[tuple[int, int], list[tuple[int, bytes]]] = {}
        engine.submit_recvs(_MSG_BYTES, 64, self._on_message)

    def _on_message(self, raw: bytes) -> None:
        if len(raw) < _HEADER.size:
            return
        magic, kind, version, sender = _HEADER.unpack_from(raw)
        if magic != _MAGIC:
            return
        with self._cond:
            self._inbox.setdefault((kind, version), []).append((sender, bytes(raw[_HEADER.size :])))
            self._cond.notify_all()

    def send(self, addr: bytes, kind: int, version: int, payload: bytes = b"") -> None:
        """Fire and forget: a peer that is gone is the version's failure, seen by its timeout."""
        try:
            self.engine.submit_send(addr, _HEADER.pack(_MAGIC, kind, version, self.me) + payload)
        except Exception:  # noqa: BLE001 - an unreachable peer shows up as a missing report
            pass

    def collect(self, kind: int, version: int, done: Callable[[list[tuple[int, bytes]]], bool], deadline: float) -> list[tuple[int, bytes]]:
        """The messages of (kind, version) once ``done`` says they suffice, or what came by the deadline."""
        with self._cond:
            while True:
                got = self._inbox.get((kind, version), [])
                left = deadline - time.monotonic()
                if done(got) or left <= 0:
                    return list(got)
                self._cond.wait(left)

    def forget(self, version: int) -> None:
        with self._cond:
            for key in [k for k in self._inbox if k[1] <= version]:
                del self._inbox[key]


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


class _Member:
    """What senders and receivers share: the engine, the control channel, the peers' addresses."""

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
        self.rank = rank
        self.senders = senders
        self.receivers = receivers
        self.timeout = timeout
        self.grace = min(5.0, timeout) if grace is None else grace
        self.imm_base = imm_base
        self.me = rank if role == "s" else senders + rank
        self.control = _Control(engine, self.me)
        self._addrs: dict[int, bytes] = {}
        self.publication = rendezvous.publish(f"{group}.{role}{rank}", engine.main_address, ttl=max(2.0, timeout))

    def data_imm(self, version: int) -> int:
        return (self.imm_base + version) & 0xFFFFFFFF

    def addr(self, member: int, deadline: float) -> bytes | None:
        """A member's address, looked up once per version (a restarted rank republishes)."""
        if member in self._addrs:
            return self._addrs[member]
        name = f"{self.group}.s{member}" if member < self.senders else f"{self.group}.r{member - self.senders}"
        try:
            addr = bytes(self.rendezvous.lookup(name, max(0.0, deadline - time.monotonic()))["addr"])
        except Exception:  # noqa: BLE001 - a rank that never appeared fails the version
            return None
        self._addrs[member] = addr
        return addr

    def report(self, version: int, ok: bool, digest: bytes, reason: str, deadline: float) -> None:
        """Tells the coordinator how this rank's part of the version went."""
        payload = bytes([1 if ok else 0]) + digest + reason.encode()[:1024]
        if self.me == 0:
            self.control._on_message(_HEADER.pack(_MAGIC, _DONE, version, 0) + payload)
        else:
            addr = self.addr(0, deadline)
            if addr is not None:
                self.control.send(addr, _DONE, version, payload)

    def verdict(self, version: int, deadline: float) -> None:
        """Waits for the coordinator's verdict on ``version``; raises ``VersionFailed`` unless positive."""
        got = self.control.collect(_VERDICT, version, lambda g: len(g) > 0, deadline)
        self.control.forget(version)
        if not got:
            raise VersionFailed(version, "no verdict from trainer rank 0 (the coordinator) in time")
        payload = got[0][1]
        if payload[:1] != b"\x01":
            raise VersionFailed(version, payload[1:].decode(errors="replace"))

    def close(self) -> None:
        self.publication.unpublish()


class WeightSender(_Member):
    """A trainer rank's side. Rank 0 also coordinates: it sends the layout and the verdicts.

    Without a ``transform``, shards in host memory are written from where they are (no copy):
    each is registered once and stays registered, and referenced, while later versions give
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
        # Shards written from their own memory: (address, bytes) -> (the data, its region).
        self._registered: dict[tuple[int, int], tuple[Any, Any]] = {}

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
        shards: Mapping[int, Any],
        *,
        transform: Callable[[str, Any], Any] | None = None,
    ) -> None:
        """Sends ``version``: ``shards`` maps each of this rank's shard indices (into
        ``layout.shards``) to its data (numpy array or CPU torch tensor, the slice's bytes in
        row-major order), ``transform(tensor name, data)`` (optional) turns it into the wire
        dtype the layout declares. Returns once every rank succeeded; raises ``VersionFailed``."""
        deadline = time.monotonic() + self.timeout
        self._addrs = {}
        failure = ""
        try:
            self._prepare(layout)
        except Exception as e:  # noqa: BLE001 - reported, so that the others fail fast
            failure = f"trainer rank {self.rank}: {e}"
        if self.rank == 0:
            raw = layout.to_json()
            chunks = [raw[i : i + _CHUNK] for i in range(0, len(raw), _CHUNK)] or [b""]
            for r in range(self.receivers):
                addr = self.addr(self.senders + r, deadline)
                if addr is None:
                    failure = failure or f"receiver {r} is not in the rendezvous"
                    continue
                for i, c in enumerate(chunks):
                    self.control.send(addr, _MANIFEST, version, struct.pack("<HH", i, len(chunks)) + c)
        if not failure:
            try:
                self._write(version, layout, shards, transform, deadline)
            except Exception as e:  # noqa: BLE001
                failure = f"trainer rank {self.rank}: {e}"
        self.report(version, not failure, layout.digest(), failure, deadline)
        if self.rank == 0:
            self._decide(version, layout.digest(), deadline + self.grace)
        self.verdict(version, deadline + 2 * self.grace)

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

    def _write(self, version: int, layout: Layout, shards: Mapping[int, Any], transform: Any, deadline: float) -> None:
        targets = self._targets
        ready = self.control.collect(_READY, version, lambda g: {s - self.senders for s, _ in g} >= set(targets), deadline)
        descs = {s - self.senders: _xfer.MrDesc(p) for s, p in ready}
        missing = [r for r in targets if r not in descs]
        if missing:
            raise TimeoutError(f"receivers {missing} were not ready before the deadline")
        if transform is None and self.zero_copy:
            self._write_in_place(version, layout, shards, descs, deadline)
        else:
            self._write_staged(version, layout, shards, transform, descs, deadline)

    def _write_in_place(self, version: int, layout: Layout, shards: Mapping[int, Any], descs: dict[int, Any], deadline: float) -> None:
        """Each shard written from its own memory, registered once while it stays the same."""
        imm = self.data_imm(version)
        used: dict[tuple[int, int], tuple[Any, Any]] = {}
        transfers: list[Any] = []
        try:
            for s, groups in self._rows_of.items():
                data, raw = self._shard_bytes(layout, shards, s, None)
                key = (int(raw.ctypes.data), int(raw.nbytes))
                entry = used.get(key) or self._registered.get(key)
                if entry is None:
                    # The region holds ``raw`` (and through it ``data``): the memory cannot be
                    # freed, and its address reused by other data, while it is registered.
                    entry = (data, self.engine.reg_mr(raw, access="local"))
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
        """Shards (transformed) copied into two buckets, one filled while the other's writes fly."""
        self._prepare_staging(layout)
        imm = self.data_imm(version)
        in_flight: dict[int, list[Any]] = {}
        try:
            for k, round_shards in enumerate(self._rounds):
                b = k % len(self._buckets)
                # The bucket's previous writes must be done before it is refilled.
                _wait_all(in_flight.pop(b, []), deadline)
                buf, region = self._buckets[b]
                per_target: dict[int, list[tuple[np.ndarray, np.ndarray, np.ndarray]]] = {}
                for s in round_shards:
                    _, raw = self._shard_bytes(layout, shards, s, transform)
                    _, at = self._bucket_of[s]
                    buf[at : at + raw.nbytes] = raw
                    for r, src, dst, lens in self._rows_of[s]:
                        per_target.setdefault(r, []).append((src + np.uint64(at), dst, lens))
                transfers = in_flight.setdefault(b, [])
                for r, parts in per_target.items():
                    src, dst, lens = (np.concatenate(c) for c in zip(*parts))
                    transfers.append(self.engine.submit_writes(region, descs[r], src, dst, lens, imm=imm))
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
        self.release()
        for _, region in self._buckets:
            region.dereg()
        self._buckets = []
        super().close()

    def _decide(self, version: int, digest: bytes, deadline: float) -> None:
        everyone = self.senders + self.receivers
        got = self.control.collect(_DONE, version, lambda g: len({s for s, _ in g}) >= everyone, deadline)
        reports = {s: p for s, p in got}
        reason = ""
        for member in range(everyone):
            who = f"trainer rank {member}" if member < self.senders else f"receiver {member - self.senders}"
            p = reports.get(member)
            if p is None:
                reason = f"{who} did not report in time"
                break
            if p[:1] != b"\x01":
                reason = p[17:].decode(errors="replace") or f"{who} failed"
                break
            if p[1:17] != digest:
                reason = f"{who} planned a different layout"
                break
        payload = (b"\x01" if not reason else b"\x00" + reason.encode()[:1024])
        self.control._on_message(_HEADER.pack(_MAGIC, _VERDICT, version, 0) + payload)
        # Only to those who reported: one that did not may be dead, and a message to a dead
        # peer can stall a provider's queue for everyone (libfabric's shm); it fails the
        # version by its own deadline anyway.
        for member in sorted(set(reports) - {0}):
            addr = self.addr(member, deadline)
            if addr is not None:
                self.control.send(addr, _VERDICT, version, payload)


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
    readers do not see, and ``buffer``/``params`` switch to it only once the version is
    complete on every rank. Readers keep reading the previous version during ``receive``, and
    a failed version leaves ``params`` as they were; views taken before a ``receive`` that
    succeeded must be dropped before the next ``receive`` starts (it writes into them)."""

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
    ) -> None:
        super().__init__(engine, rendezvous, group, "r", rank, senders, receivers, timeout=timeout, grace=grace, imm_base=imm_base)
        self.double_buffer = double_buffer
        self.layout: Layout | None = None
        self.buffer: np.ndarray | None = None
        self.params: dict[str, np.ndarray] = {}
        self.specs: dict[str, tuple[tuple[int, ...], str]] = {}
        self._region: Any = None
        # Per buffer (one, or two when double-buffered): the array, its region, its views.
        self._buffers: list[tuple[np.ndarray, Any, dict[str, np.ndarray]]] = []
        self._front = 0
        self._arrivals = 0

    def _prepare(self, layout: Layout) -> None:
        if self.layout is not None and self.layout.digest() == layout.digest():
            return
        for _, region, _ in self._buffers:
            region.dereg()
        self._buffers, self._front, self._region = [], 0, None
        self.layout = None
        offsets = _param_offsets(layout)
        mine = [i for i, p in enumerate(layout.params) if p[0] == self.rank]
        total = max([int(offsets[i]) + _aligned(layout.param_nbytes(i)) for i in mine], default=64)
        self.specs = {}
        for i in mine:
            _, name, shape, pieces = layout.params[i]
            if name in self.specs:
                raise ValueError(f"receiver {self.rank} has two parameters named {name!r}")
            self.specs[name] = (tuple(shape), layout.tensor(pieces[0][0]).dtype)
        for _ in range(2 if self.double_buffer else 1):
            buf = np.zeros(total, dtype=np.uint8)
            views = {layout.params[i][1]: buf[int(offsets[i]) : int(offsets[i]) + layout.param_nbytes(i)] for i in mine}
            self._buffers.append((buf, self.engine.reg_mr(buf), views))
        self._show(0)
        # Immediates the version brings: each row is one write, striped as the sender's engine
        # stripes it (same config on both sides).
        w = plan(layout, receiver=self.rank)
        lens, counts = w.len, w.count
        arrivals = 0
        for n in np.unique(lens):
            arrivals += int(counts[lens == n].sum()) * self.engine.expected_arrivals(int(n))
        self._arrivals = arrivals
        self.layout = layout

    def _show(self, k: int) -> None:
        """Makes buffer ``k`` the one readers see."""
        self._front = k
        self.buffer, self._region, self.params = self._buffers[k]

    def receive(self, version: int) -> dict[str, np.ndarray]:
        """Receives ``version`` into ``params`` (returned); returns only when every byte of it
        landed and every rank succeeded; raises ``VersionFailed`` otherwise."""
        deadline = time.monotonic() + self.timeout
        self._addrs = {}
        failure, digest = "", b"\x00" * 16
        got = self.control.collect(
            _MANIFEST, version, lambda g: bool(g) and len(g) >= struct.unpack_from("<HH", g[0][1])[1], deadline
        )
        expectation = None
        target = self._front
        if not got:
            failure = f"receiver {self.rank}: no layout from trainer rank 0 in time"
        else:
            try:
                chunks = sorted((struct.unpack_from("<HH", p)[0], p[4:]) for _, p in got)
                layout = Layout.from_json(b"".join(c for _, c in chunks))
                digest = layout.digest()
                self._prepare(layout)
                target = (self._front + 1) % len(self._buffers)
                if self._arrivals:
                    expectation = self.engine.expect_imm_count(self.data_imm(version), self._arrivals)
                desc = bytes(self._buffers[target][1].desc)
                for s in range(self.senders):
                    addr = self.addr(s, deadline)
                    if addr is not None:
                        self.control.send(addr, _READY, version, desc)
            except Exception as e:  # noqa: BLE001
                failure = f"receiver {self.rank}: {e}"
        if expectation is not None and not failure:
            try:
                expectation.wait(max(0.0, deadline - time.monotonic()))
            except Exception as e:  # noqa: BLE001 - a timeout, or the engine's own failure
                failure = f"receiver {self.rank}: not every write of version {version} arrived ({type(e).__name__}: {e})"
                try:
                    expectation.cancel()
                except Exception:  # noqa: BLE001
                    pass
        self.report(version, not failure, digest, failure, deadline)
        self.verdict(version, deadline + 2 * self.grace)
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
