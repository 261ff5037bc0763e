"""xfer as verl's checkpoint engine: ``XferCheckpointEngine``, registered as ``xfer`` in verl's
``CheckpointEngineRegistry`` when this module is imported.

verl loads an out-of-tree engine through ``rollout.checkpoint_engine.custom_backend_module``:
every trainer and rollout process imports that module (``import_external_libs``) before it
asks the registry for the backend. So::

    rollout.checkpoint_engine.backend=xfer
    rollout.checkpoint_engine.custom_backend_module=xfer.verl
    +rollout.checkpoint_engine.engine_kwargs.xfer.config=/path/to/xfer.toml   # or $XFER_CONFIG

Every trainer rank with data writes (not only rank 0): the weights each rank's generator yields
become its shards of the plan (``xfer.weights``) — a plain tensor is held whole by every
trainer rank (verl's contract: each rank yields the full tensor), so the plan splits the
sending evenly over the ranks; a ``DTensor`` sharded on a one-dimensional mesh is sent from its
local shards without gathering. Every rollout worker receives every full tensor into its
registered buffer and, once the version is committed on every rank, yields views of it to the
server adapter (which loads them through its engine's own ``load_weights``).

``send_weights`` streams: each tensor the generator yields is copied into one of two staging
buckets of ``bucket_size`` (enlarged to the largest tensor), written at once, and let go
before the next is pulled — never more than the two buckets and the tensor being gathered.
The layout (names, shapes, dtypes, who holds what) is learned from the tensors' metadata on
the first step and kept: it is sent to a receiver only when it changed or the receiver is new.
The first step (and the step after the tensors changed) cannot stream — the receivers need
the layout before the first byte — so it copies each tensor to host memory as it comes (the
yielded tensors still go one by one) and sends from there; a step whose tensors differ from
the learned layout fails everywhere, and the next one learns the new layout.

Per verl step: ``prepare`` (trainer rank 0 starts the rendezvous service the first time unless
``rendezvous`` is given, and numbers the step), ``build_topology`` (everyone learns the service,
the group and the step), ``init_process_group`` (members are made when the membership changes
and reused otherwise, on the same engine: rollout workers may come and go between steps),
then ``send_weights`` / ``receive_weights`` (one version of ``xfer.weights``: committed on
every rank or ``VersionFailed`` on every rank), ``finalize``. ``receive_weights`` receives the
whole version before it returns its iterator and raises a failed one there: verl's vLLM
server adapter cannot end its ZeroMQ hand-off to the vLLM worker on an error (see
``receive_weights``).

Across machines: the service listens on ``listen`` (default ``$XFER_WEIGHTS_LISTEN``, else this
host's address on its default route, port chosen), and a service reachable from other hosts
needs the cluster secret (``secret_file``, default ``$XFER_SECRET_FILE``): without one it is
refused by name. ``config`` is the xfer engine config (default ``$XFER_CONFIG``); there is no
silent default — the mock is ``{"backend": "mock"}``, said explicitly.
"""

from __future__ import annotations

import asyncio
import ipaddress
import os
import socket
import threading
import uuid
from collections.abc import AsyncGenerator, AsyncIterator, Iterable, Iterator
from typing import Any

import numpy as np
from verl.checkpoint_engine.base import CheckpointEngine, CheckpointEngineRegistry

import xfer
from xfer import weights as W
from xfer.rendezvous_security import RendezvousSecurity

from .executor import _aligned, _bytes_of

__all__ = ["XferCheckpointEngine", "LayoutChanged", "default_listen"]


class LayoutChanged(ValueError):
    """The tensors a step yields are not those of the learned layout (another name, shape,
    dtype or placement at the same place): this step fails, the next one learns anew."""


def _dtype_name(t: Any) -> str:
    return str(t.dtype).removeprefix("torch.")


def _chunks(n: int, k: int) -> list[tuple[int, int]]:
    """torch.chunk's split of ``n`` into ``k`` (what ``Shard(dim)`` holds on each mesh rank)."""
    size = -(-n // k) if n else 0
    return [(min(n, i * size), min(n, (i + 1) * size)) for i in range(k)]


def default_listen() -> str:
    """Where the master's rendezvous service listens by default: ``$XFER_WEIGHTS_LISTEN``, else
    this host's address on its default route (what other hosts reach it by), port chosen."""
    env = os.environ.get("XFER_WEIGHTS_LISTEN")
    if env:
        return env
    try:
        with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
            s.connect(("198.51.100.1", 9))  # TEST-NET-2; no packet is sent, it only picks the route
            host = s.getsockname()[0]
    except OSError:
        host = "127.0.0.1"
    return f"{host}:0"


def _loopback(listen: str) -> bool:
    host = listen.rsplit(":", 1)[0].strip("[]")
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return host == "localhost"


@CheckpointEngineRegistry.register("xfer")
class XferCheckpointEngine(CheckpointEngine):
    """verl checkpoint engine over xfer (see the module's documentation).

    Args:
        bucket_size: verl's ``update_weights_bucket_megabytes`` in bytes: each of the two
            staging buckets a trainer rank fills alternately (enlarged to its largest shard).
        is_master: trainer rank 0 (verl passes it): coordinates versions, runs the rendezvous.
        config: the xfer engine config (path or dict); ``None``: ``$XFER_CONFIG`` (refused if unset).
        rendezvous: ``xfer://host:port`` of a running service instead of the master's own.
        timeout: seconds a version may take before it fails everywhere.
        device: where received tensors are yielded (``"cpu"``; a GPU device gets copies).
        listen: where the master's service listens (default: ``default_listen()``).
        secret_file: the cluster secret (default: the engine config's ``[security]
            secret_file``, else ``$XFER_SECRET_FILE``; naming different files is refused):
            the service admits only clients that prove it; required when it listens beyond
            loopback. etcd's TLS and user come from the engine config's ``[rendezvous]`` or
            ``$XFER_ETCD_*`` (``xfer.rendezvous_security``).
    """

    def __init__(
        self,
        bucket_size: int,
        is_master: bool = False,
        config: str | dict[str, Any] | None = None,
        rendezvous: str | None = None,
        timeout: float = 300.0,
        device: str = "cpu",
        listen: str | None = None,
        secret_file: str | None = None,
    ) -> None:
        if config is None:
            config = os.environ.get("XFER_CONFIG")
            if not config:
                raise ValueError(
                    "XferCheckpointEngine: no xfer config (engine_kwargs.xfer.config or $XFER_CONFIG): "
                    "say which backend; the mock is {'backend': 'mock'}, given explicitly")
        self.bucket_size = bucket_size
        self.is_master = is_master
        self.config = config
        self.rendezvous_url = rendezvous
        self.timeout = timeout
        self.device = device
        self.listen = listen or default_listen()
        # The operator's rendezvous settings (this secret_file, else the engine config's or
        # $XFER_SECRET_FILE; etcd's TLS and user), refused now if they cannot work.
        self.security = RendezvousSecurity.of(config, secret_file=secret_file, who="XferCheckpointEngine")
        self.secret_file = self.security.secret_file
        if is_master and rendezvous is None and self.secret_file is None and not _loopback(self.listen):
            raise ValueError(
                f"XferCheckpointEngine: the rendezvous service would listen on {self.listen}, reachable "
                "from other hosts, without the cluster secret: set $XFER_SECRET_FILE (or secret_file), "
                "or listen on 127.0.0.1 for one machine")
        self.engine: xfer.TransferEngine | None = None
        self._server: xfer.Server | None = None
        self._group = f"verl-{uuid.uuid4().hex[:12]}"
        self._steps = 0
        self._rdv: xfer.Rendezvous | None = None
        self._member: W.WeightSender | W.WeightReceiver | None = None
        self._member_key: tuple[Any, ...] | None = None
        self._version = 0
        self._senders = 0
        self._receivers = 0
        self._rank = 0
        # The learned layout: per tensor (spec, holders), and the sender count it is for.
        self._learned: list[tuple[W.TensorSpec, list[tuple[int, Any]]]] | None = None
        self._learned_senders = 0
        # What the last send_weights held at most at once (tensors the generator yielded and
        # this engine had not let go), for the curious and the tests.
        self.stats: dict[str, Any] = {}

    def prepare(self) -> dict[str, Any]:
        if self.engine is None:
            self.engine = xfer.TransferEngine(self.config)
        if not self.is_master:
            return {"url": None}
        if self.rendezvous_url is None and self._server is None:
            self._server = xfer.Server(self.listen, secret_file=self.security.secret_file)
        self._steps += 1
        return {"url": self.rendezvous_url or self._server.url, "group": self._group, "version": self._steps}

    @classmethod
    def build_topology(cls, actor_wg_world_size: int, rollout_world_size: int, metadata: list[dict]):
        master = next((m for m in metadata[:actor_wg_world_size] if m.get("url")), None)
        if master is None:
            raise ValueError("no trainer rank prepared as master (is_master): nobody coordinates the versions")
        common = {"url": master["url"], "group": master["group"], "version": master["version"],
                  "senders": actor_wg_world_size, "receivers": rollout_world_size}

        def kwargs(role: str, n: int) -> dict[str, list[Any]]:
            out = {k: [v] * n for k, v in common.items()}
            out["role"] = [role] * n
            out["rank"] = list(range(n))
            return out

        return kwargs("sender", actor_wg_world_size), kwargs("receiver", rollout_world_size)

    def init_process_group(self, *, role: str, rank: int, senders: int, receivers: int, url: str, group: str, version: int, **_: Any) -> None:
        if self.engine is None:
            self.engine = xfer.TransferEngine(self.config)
        key = (role, rank, senders, receivers, url, group)
        if key != self._member_key:
            # A membership change (rollout workers added or removed): a new member on the same
            # engine, the old one closed first (one receive pool per engine serves both).
            if self._member is not None:
                self._member.close()
                self._member = None
            if self._rdv is None or self._member_key is None or self._member_key[4] != url:
                self._rdv = self.security.connect(url)
            cls = W.WeightSender if role == "sender" else W.WeightReceiver
            self._member = cls(self.engine, self._rdv, group, rank, senders, receivers, timeout=self.timeout)
            self._member_key = key
        self._version, self._senders, self._receivers, self._rank = version, senders, receivers, rank

    def finalize(self) -> None:
        """Nothing to undo per step: registrations, buckets and peers are reused by the next one."""

    async def send_weights(self, weights: Any, global_steps: int | None = None) -> dict[str, Any]:
        sender = self._member
        if not isinstance(sender, W.WeightSender):
            raise RuntimeError("send_weights on an engine that init_process_group made a receiver (or not at all)")
        loop = asyncio.get_running_loop()
        source = _Pull(_aiter(weights), loop)
        sender.zero_copy = False
        learned = self._learned if self._learned_senders == self._senders else None
        try:
            if learned is not None:
                layout, mine = self._layout_of(learned)
                sender.budget_bytes = 2 * max(self.bucket_size, _aligned(max((layout.shard_nbytes(i) for i in mine), default=0)))
                stream = self._stream(source, learned, mine)
                await asyncio.to_thread(sender.send, self._version, layout, stream)
            else:
                # Learning: every tensor's metadata before the first byte moves; each tensor
                # copied to host memory as it comes and let go.
                found, local = await asyncio.to_thread(self._learn, source)
                layout, mine = self._layout_of(found)
                self._learned, self._learned_senders = found, self._senders
                sender.budget_bytes = 2 * max(self.bucket_size, _aligned(max((layout.shard_nbytes(i) for i in mine), default=0)))
                await asyncio.to_thread(sender.send, self._version, layout, {mine[i]: a for i, a in local.items()})
        finally:
            await asyncio.to_thread(source.drain)
            self.stats = {"most_tensors_held": source.most_alive}
        return {}

    def _layout_of(self, entries: list[tuple[W.TensorSpec, list[tuple[int, Any]]]]) -> tuple[W.Layout, dict[int, int]]:
        """The layout of the learned tensors for this membership; ``mine``: tensor position ->
        this rank's shard index."""
        tensors, shards, mine = [], [], {}
        for pos, (spec, holders) in enumerate(entries):
            tensors.append(spec)
            for rank, sl in holders:
                if rank == self._rank:
                    mine[pos] = len(shards)
                shards.append((rank, spec.name, sl))
        return W.Layout(tuple(tensors), tuple(shards), W.Layout.whole_params(tensors, self._receivers)), mine

    def _learn(self, source: _Pull) -> tuple[list[tuple[W.TensorSpec, list[tuple[int, Any]]]], dict[int, np.ndarray]]:
        found, local = [], {}
        for pos, (name, t) in enumerate(source):
            spec, holders, data = self._shards_of(name, t)
            found.append((spec, holders))
            if any(r == self._rank for r, _ in holders):
                local[pos] = _bytes_of(data).copy()
            del t, data
            source.let_go()
        return found, local

    def _stream(self, source: _Pull, learned: list[tuple[W.TensorSpec, list[tuple[int, Any]]]], mine: dict[int, int]) -> Iterator[tuple[int, Any]]:
        """This rank's shards as the generator yields them, checked against the learned layout."""
        pos = 0
        for name, t in source:
            spec, holders, data = self._shards_of(name, t)
            if pos >= len(learned) or (spec, holders) != learned[pos]:
                self._learned = None
                raise LayoutChanged(
                    f"tensor {pos} ({name!r}, {spec.shape}, {spec.dtype}) is not the learned layout's "
                    f"{learned[pos][0] if pos < len(learned) else 'end'}; the next step learns the new layout")
            del t
            if pos in mine:
                yield mine[pos], data
            del data
            source.let_go()
            pos += 1
        if pos != len(learned):
            self._learned = None
            raise LayoutChanged(f"the generator ended after {pos} tensors, the learned layout has {len(learned)}")

    def _shards_of(self, name: str, t: Any) -> tuple[W.TensorSpec, list[tuple[int, Any]], Any]:
        """The tensor's spec, its holders (trainer rank, slice) and this rank's data."""
        spec = W.TensorSpec(name, tuple(int(d) for d in t.shape), _dtype_name(t))
        everyone = [(r, None) for r in range(self._senders)]
        if not hasattr(t, "placements"):
            return spec, everyone, t
        mesh = t.device_mesh
        if mesh.ndim == 1 and len(t.placements) == 1:
            p = t.placements[0]
            ranks = [int(r) for r in mesh.mesh.tolist()]
            if p.is_replicate():
                return spec, [(r, None) for r in ranks], t.to_local()
            if p.is_shard():
                d = p.dim % len(spec.shape)
                parts = _chunks(spec.shape[d], len(ranks))
                return spec, [(r, ("dim", d, lo, hi)) for r, (lo, hi) in zip(ranks, parts)], t.to_local()
        # Another layout (a 2-D mesh, partial sums): gathered, as verl's own engines do.
        return spec, everyone, t.full_tensor()

    def receive_weights(self, global_steps: int | None = None) -> AsyncIterator[tuple[str, Any]]:
        """Receives the version, then returns the async iterator of its tensors (views of the
        registered staging, or copies on ``device``) for verl's server adapter.

        The version is received before this returns — blocking the caller (verl's rollout
        worker calls it on its event loop, then hands the iterator to its adapter) for the
        version — and a failed one raises ``VersionFailed`` here, not from the iterator:
        verl's vLLM adapter starts the vLLM worker's ZMQ receive (``update_weights_from_ipc``)
        and hands it its bucket before it pulls the first tensor, and cannot end that exchange
        on an error — an iterator that raised would close the sender's socket without
        ``is_last`` and leave the vLLM worker blocked in ``recv_pyobj()`` for good. Raised
        here, the adapter is never called: nothing is started on the vLLM side and its model
        keeps the previous version.

        A tensor larger than ``bucket_size`` (verl's ``update_weights_bucket_megabytes``, the
        adapter's bucket too): verl's adapter sends it alone by device IPC (``reduce_tensor``),
        which a host tensor cannot go through (its handle is not a device one: the vLLM
        worker's ``rebuild_ipc`` fails on it and then never answers the adapter), and with
        shared-memory buckets (verl's platform without IPC) it refuses it. So, as verl's
        adapter will send it: with shared-memory buckets the version is refused by name here
        (``ValueError``, before the adapter starts: the model is not changed); with IPC, such a
        tensor is yielded as a copy on verl's current device (where the adapter's bucket is);
        with no device in this process (where verl's adapter cannot run: its bucket is a device
        tensor), as it is."""
        receiver = self._member
        if not isinstance(receiver, W.WeightReceiver):
            raise RuntimeError("receive_weights on an engine that init_process_group made a sender (or not at all)")
        receiver.receive(self._version)
        tensors = list(receiver.tensors())
        oversized = [(n, int(t.nbytes)) for n, t in tensors if int(t.nbytes) > self.bucket_size]
        device = None
        if oversized and self.device == "cpu":
            from verl.utils.device import get_device_id, get_device_name, get_torch_device, is_support_ipc

            if not is_support_ipc():
                name, nbytes = oversized[0]
                raise ValueError(
                    f"XferCheckpointEngine: weight version {self._version}: {len(oversized)} tensor(s) larger than "
                    f"the bucket ({self.bucket_size} bytes), first {name!r} of {nbytes} bytes; verl's server adapter "
                    "refuses such a tensor with shared-memory buckets (this platform has no IPC): raise "
                    "update_weights_bucket_megabytes above the largest tensor (the model is not changed)")
            if get_torch_device().is_available():
                device = f"{get_device_name()}:{get_device_id()}"
        return self._yield(tensors, {n for n, _ in oversized}, device)

    async def _yield(self, tensors: list[tuple[str, Any]], oversized: set[str], device: Any) -> AsyncGenerator[tuple[str, Any], None]:
        for i in range(len(tensors)):
            (name, t), tensors[i] = tensors[i], None
            if self.device != "cpu":
                t = t.to(self.device)
            elif device is not None and name in oversized:
                t = t.to(device)  # what verl's adapter sends alone by device IPC
            yield name, t
            del t  # not held while the adapter asks for the next one


class _Pull:
    """The trainer's weights, pulled one at a time from a worker thread (the generator, sync
    or async, runs on the event loop): counts the items pulled and not yet let go."""

    def __init__(self, items: AsyncGenerator[tuple[str, Any], None], loop: asyncio.AbstractEventLoop) -> None:
        self._items = items
        self._loop = loop
        self._lock = threading.Lock()
        self.alive = 0
        self.most_alive = 0

    async def _next(self) -> tuple[str, Any]:
        return await self._items.__anext__()

    def __iter__(self) -> Iterator[tuple[str, Any]]:
        while True:
            try:
                item = asyncio.run_coroutine_threadsafe(self._next(), self._loop).result()
            except StopAsyncIteration:
                return
            with self._lock:
                self.alive += 1
                self.most_alive = max(self.most_alive, self.alive)
            yield item
            del item  # the consumer is done with it: not held here while the next is pulled

    def let_go(self) -> None:
        with self._lock:
            self.alive -= 1

    def drain(self) -> None:
        """Pulls what is left (every trainer rank must run its generator to the end: it may
        gather with collectives)."""
        for _ in self:
            self.let_go()


async def _aiter(weights: Any) -> AsyncGenerator[tuple[str, Any], None]:
    if hasattr(weights, "__aiter__"):
        async for item in weights:
            yield item
    else:
        for item in weights if isinstance(weights, Iterable) else ():
            yield item
