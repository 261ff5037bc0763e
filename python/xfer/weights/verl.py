"""xfer as verl's checkpoint engine: ``XferCheckpointEngine``, registered as ``xfer`` in verl's
``CheckpointEngineRegistry`` when this module is imported.

verl loads an out-of-tree engine through ``rollout.checkpoint_engine.custom_backend_module``:
every trainer and rollout process imports that module (``import_external_libs``) before it
asks the registry for the backend. So::

    rollout.checkpoint_engine.backend=xfer
    rollout.checkpoint_engine.custom_backend_module=xfer.verl
    +rollout.checkpoint_engine.engine_kwargs.xfer.config=/path/to/xfer.toml   # optional

Every trainer rank with data writes (not only rank 0): the weights each rank's generator yields
become its shards of the plan (``xfer.weights``) — a plain tensor is held whole by every
trainer rank (verl's contract: each rank yields the full tensor), so the plan splits the
sending evenly over the ranks; a ``DTensor`` sharded on a one-dimensional mesh is sent from its
local shards without gathering. Every rollout worker receives every full tensor directly into
its registered buffer and yields views of it to the server adapter (which loads them through
its engine's own ``load_weights``). Tensors on a GPU are staged through host memory.

Per verl step: ``prepare`` (trainer rank 0 starts the rendezvous service the first time unless
``rendezvous`` is given, and numbers the step), ``build_topology`` (everyone learns the service,
the group and the step), ``init_process_group`` (members are made once and reused: buffers stay
registered across steps), then ``send_weights`` / ``receive_weights`` (one version of
``xfer.weights``: complete on every rank or ``VersionFailed`` on every rank), ``finalize``.
"""

from __future__ import annotations

import asyncio
import uuid
from collections.abc import AsyncGenerator, Iterable
from typing import Any

from verl.checkpoint_engine.base import CheckpointEngine, CheckpointEngineRegistry

import xfer
from xfer import weights as W

__all__ = ["XferCheckpointEngine"]


def _dtype_name(t: Any) -> str:
    return str(t.dtype).removeprefix("torch.")


def _chunks(n: int, k: int) -> list[tuple[int, int]]:
    """torch.chunk's split of ``n`` into ``k`` (what ``Shard(dim)`` holds on each mesh rank)."""
    size = -(-n // k) if n else 0
    return [(min(n, i * size), min(n, (i + 1) * size)) for i in range(k)]


@CheckpointEngineRegistry.register("xfer")
class XferCheckpointEngine(CheckpointEngine):
    """verl checkpoint engine over xfer (see the module's documentation).

    Args:
        bucket_size: verl's ``update_weights_bucket_megabytes`` in bytes: each of the two
            staging buckets a trainer rank fills alternately (enlarged to its largest shard).
        is_master: trainer rank 0 (verl passes it): coordinates versions, runs the rendezvous.
        config: the xfer engine config (path or dict; default ``$XFER_CONFIG`` or the mock).
        rendezvous: ``xfer://host:port`` of a running service instead of the master's own.
        timeout: seconds a version may take before it fails everywhere.
        device: where received tensors are yielded (``"cpu"``; a GPU device gets copies).
    """

    def __init__(
        self,
        bucket_size: int,
        is_master: bool = False,
        config: str | dict[str, Any] | None = None,
        rendezvous: str | None = None,
        timeout: float = 300.0,
        device: str = "cpu",
        listen: str = "127.0.0.1:0",
    ) -> None:
        self.bucket_size = bucket_size
        self.is_master = is_master
        self.config = config
        self.rendezvous_url = rendezvous
        self.timeout = timeout
        self.device = device
        self.listen = listen
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

    def prepare(self) -> dict[str, Any]:
        if self.engine is None:
            self.engine = xfer.TransferEngine(self.config)
        if not self.is_master:
            return {"url": None}
        if self.rendezvous_url is None and self._server is None:
            self._server = xfer.Server(self.listen)
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
            if self._member is not None:
                self._member.close()
            self._rdv = xfer.Rendezvous(url)
            cls = W.WeightSender if role == "sender" else W.WeightReceiver
            self._member = cls(self.engine, self._rdv, group, rank, senders, receivers, timeout=self.timeout)
            self._member_key = key
        self._version, self._senders, self._receivers, self._rank = version, senders, receivers, rank

    def finalize(self) -> None:
        """Nothing to undo per step: registrations and peers are reused by the next one."""

    async def send_weights(self, weights: Any, global_steps: int | None = None) -> dict[str, Any]:
        sender = self._member
        if not isinstance(sender, W.WeightSender):
            raise RuntimeError("send_weights on an engine that init_process_group made a receiver (or not at all)")
        tensors: list[W.TensorSpec] = []
        shards: list[tuple[int, str, Any]] = []
        local: dict[int, Any] = {}
        async for name, t in _aiter(weights):
            spec, holders, data = self._shards_of(name, t)
            tensors.append(spec)
            for rank, sl in holders:
                if rank == self._rank:
                    local[len(shards)] = data
                shards.append((rank, name, sl))
        layout = W.Layout(tuple(tensors), tuple(shards), W.Layout.whole_params(tensors, self._receivers))
        largest = max((layout.shard_nbytes(i) for i in local), default=0)
        sender.budget_bytes = 2 * max(self.bucket_size, W._aligned(largest))
        try:
            await asyncio.to_thread(sender.send, self._version, layout, local)
        finally:
            # verl's tensors may be this step's own copies (gathered, or off a GPU): let them
            # go rather than keep them registered until the next step.
            sender.release()
        return {}

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

    async def receive_weights(self, global_steps: int | None = None) -> AsyncGenerator[tuple[str, Any], None]:
        receiver = self._member
        if not isinstance(receiver, W.WeightReceiver):
            raise RuntimeError("receive_weights on an engine that init_process_group made a sender (or not at all)")
        await asyncio.to_thread(receiver.receive, self._version)
        for name, t in receiver.tensors():
            yield name, (t if self.device == "cpu" else t.to(self.device))


async def _aiter(weights: Any) -> AsyncGenerator[tuple[str, Any], None]:
    if hasattr(weights, "__aiter__"):
        async for item in weights:
            yield item
    else:
        for item in weights if isinstance(weights, Iterable) else ():
            yield item
