"""xfer as a backend of vLLM's own weight-transfer API (vLLM ≥ 0.33):
``weight_transfer_config={"backend": "xfer"}`` (``--weight-transfer-config '{"backend":
"xfer"}'``), driven through vLLM's RL routes (``/init_weight_transfer_engine``,
``/start_weight_update``, ``/update_weights``, ``/finish_weight_update``) or their offline
twins on ``LLM``, and on the trainer by ``WeightTransferTrainerFactory.trainer_init``.

vLLM is not patched: xfer's wheel names ``register`` as a ``vllm.general_plugins`` entry
point, which vLLM runs in every process it starts (the engine core and each worker, before
the worker builds its weight-transfer engine); it registers ``"xfer"`` with both factories.

Each worker receives only what its own loader takes (``xfer.weights.slices``): at
``init_weight_transfer_engine`` the worker runs ``model.load_weights`` once on ids and
learns, per checkpoint tensor, which box of it lands where in which of its parameters. A
parameter copied from boxes (a tensor-parallel slice, the parts of a fused ``qkv_proj`` /
``gate_up_proj``) is received as those boxes only; anything the loader transforms (a
quantised model, a cast, a parameter mixing both) is received whole and loaded through
``load_weights`` inside vLLM's layerwise reload, as vLLM's own ``nccl_m2n`` does. The worker
publishes its part of the layout as a registered region; each trainer rank reads every
worker's part once, at ``trainer_init``, and plans its writes (``xfer.weights.plan``: the
trainer ranks share the sending).

A version is all-or-nothing across every worker (``xfer.weights`` executor): the bytes land
in each worker's registered staging, the coordinator (trainer rank 0) commits, and only then
does each worker copy its boxes into the parameters and run ``load_weights`` on the whole
tensors. A version that fails is applied nowhere; ``send_weights`` raises ``VersionFailed`` on
the trainer (the workers' ``update_weights`` return: see ``receive_weights``).

Trainer side::

    init = XferTrainerInitInfo(rank=trainer_rank, rendezvous="xfer://10.0.0.1:7000",
                               group="rl-run-7", receivers=tp * dp, senders=trainer_ranks,
                               config="/etc/xfer/verbs.toml")  # or $XFER_CONFIG; None without it is refused
    engine = WeightTransferTrainerFactory.trainer_init(init, client=client, source=ModuleSource(model))
    engine.send_weights()  # each step, on every trainer rank
"""

from __future__ import annotations

import dataclasses
import logging
import threading
import time
from collections.abc import Iterator
from typing import Any

import numpy as np

from .. import _xfer
from .engines import _Member as _EngineMember
from .executor import VersionFailed, WeightReceiver, WeightSender
from .layout import MAX_LAYOUT_BYTES, Layout, LayoutError, TensorSpec
from .slices import ReceiverSlices, decode_receiver_layout, id_bases, receiver_params, trace_tensor
from .vllm import receiver_rank

__all__ = [
    "BACKEND",
    "XferInitInfo",
    "XferTrainerInitInfo",
    "XferTrainerWeightTransferEngine",
    "XferUpdateInfo",
    "XferWeightTransferEngine",
    "register",
]

BACKEND = "xfer"
_log = logging.getLogger(__name__)

from vllm.distributed.weight_transfer.base import (
    TrainerInitInfo,
    TrainerWeightTransferEngine,
    WeightTransferEngine,
    WeightTransferInitInfo,
    WeightTransferUpdateInfo,
)


def register() -> None:
    """The ``vllm.general_plugins`` entry point: registers ``"xfer"`` with vLLM's worker and
    trainer factories (by module path, as vLLM registers its own). vLLM runs it once per
    process; a second call is a no-op."""
    from vllm.distributed.weight_transfer.factory import WeightTransferEngineFactory, WeightTransferTrainerFactory

    if BACKEND not in WeightTransferEngineFactory._registry:
        WeightTransferEngineFactory.register_engine(BACKEND, __name__, "XferWeightTransferEngine")
    if BACKEND not in WeightTransferTrainerFactory._registry:
        WeightTransferTrainerFactory.register_engine(BACKEND, __name__, "XferTrainerWeightTransferEngine")


def _slices_record(group: str, rank: int) -> str:
    return f"{group}.m{rank}"


@dataclasses.dataclass
class XferInitInfo(WeightTransferInitInfo):
    """What the trainer tells every worker at ``init_weight_transfer_engine`` (a dict over
    vLLM's RL route). ``tensors``: the checkpoint's ``[name, shape, dtype]`` in the order the
    trainer sends them; ``receivers``: every worker of every instance joined to ``group``;
    ``rank_base``: this instance's first receiver rank."""

    rendezvous: str
    group: str
    tensors: list[Any]
    receivers: int
    senders: int = 1
    rank_base: int = 0
    config: Any = None
    timeout: float = 300.0
    grace: float | None = None
    direct: bool = True
    max_bytes: int | None = None

    def specs(self) -> tuple[TensorSpec, ...]:
        out = []
        for i, t in enumerate(self.tensors):
            if not (isinstance(t, (list, tuple)) and len(t) == 3):
                raise ValueError(f"tensors[{i}]: expected [name, shape, dtype]")
            name, shape, dtype = t
            spec = TensorSpec(str(name), tuple(int(d) for d in shape), str(dtype))
            spec.elem_size  # noqa: B018 - refuses an unknown dtype by name
            out.append(spec)
        if len({s.name for s in out}) != len(out):
            raise ValueError("tensors: a name is given twice")
        return tuple(out)


@dataclasses.dataclass
class XferUpdateInfo(WeightTransferUpdateInfo):
    """One ``update_weights`` call: the version the trainer ranks are sending."""

    version: int


def _dtype_name(dtype: Any) -> str:
    return str(dtype).removeprefix("torch.")


def trace_model(model: Any, tensors: tuple[TensorSpec, ...], device: Any) -> dict[str, tuple[np.ndarray, str]]:
    """Runs ``model.load_weights`` on ids (see ``xfer.weights.slices``) into integer stand-ins
    of the model's parameters; returns each parameter's ids and dtype name. The model's
    parameters and buffers are as before afterwards, whatever the loader raised."""
    import torch

    params = dict(model.named_parameters())
    dtypes = {n: _dtype_name(p.dtype) for n, p in params.items()}
    saved = {n: p.data for n, p in params.items()}
    # torch refuses integer data under a parameter that requires gradients.
    grads = {n: p.requires_grad for n, p in params.items()}
    buffers = {n: b.detach().clone() for n, b in model.named_buffers()}
    bases = id_bases(tensors)

    def ids() -> Iterator[tuple[str, Any]]:
        for i, t in enumerate(tensors):
            yield t.name, torch.from_numpy(trace_tensor(i, tensors, bases)).to(device)

    try:
        for n, p in params.items():
            p.requires_grad_(False)
            p.data = torch.full(tuple(p.shape), -1, dtype=torch.int64, device=p.device)
        try:
            from vllm.model_executor.model_loader.mtp_validation import disable_mtp_completeness_check
        except ImportError:  # pragma: no cover - older vLLM
            import contextlib

            disable_mtp_completeness_check = contextlib.nullcontext
        with torch.no_grad(), disable_mtp_completeness_check():
            model.load_weights(ids())
        return {n: (p.data.cpu().numpy().copy(), dtypes[n]) for n, p in params.items()}
    finally:
        for n, p in params.items():
            p.data = saved[n]
            p.requires_grad_(grads[n])
        with torch.no_grad():
            for n, b in model.named_buffers():
                if n in buffers:
                    b.copy_(buffers[n])


class XferWeightTransferEngine(WeightTransferEngine):
    """The worker side (vLLM builds it from ``weight_transfer_config``)."""

    init_info_cls = XferInitInfo
    update_info_cls = XferUpdateInfo
    supports_draft_weight_update = False

    def __init__(self, config: Any, vllm_config: Any, device: Any, model: Any) -> None:
        super().__init__(config, vllm_config, device, model)
        self._member: _EngineMember | None = None
        self.receiver: WeightReceiver | None = None
        self.slices: ReceiverSlices | None = None
        self.rank: int | None = None
        self.trace_failure = ""
        self._published: Any = None
        self._slices_buf: np.ndarray | None = None
        self._slices_region: Any = None
        self._reloading = False
        # The parameters' storage as it was at init: boxes are copied into it. During vLLM's
        # layerwise reload the live parameters are on the meta device, and finishing the
        # reload puts these tensors back where nothing was loaded through load_weights.
        self._storage: dict[str, Any] = {}
        self.last_outcome: dict[str, Any] | None = None

    def init_transfer_engine(self, init_info: XferInitInfo) -> None:
        """Joins the group as receiver ``rank_base`` + this worker's place (see
        ``xfer.weights.vllm.receiver_rank``), learns its slices from its own loader and
        publishes them for the trainer ranks. A second call replaces the first."""
        self.shutdown()
        tensors = init_info.specs()
        rank = receiver_rank(init_info.rank_base, int(self.parallel_config.rank), self.parallel_config)
        direct = bool(init_info.direct) and getattr(self.model_config, "quantization", None) is None
        traced: dict[str, tuple[np.ndarray, str]] = {}
        if direct:
            try:
                traced = trace_model(self.model, tensors, self.device)
            except Exception as e:  # noqa: BLE001 - every tensor then goes through load_weights
                self.trace_failure = f"{type(e).__name__}: {e}"
                _log.warning("xfer weight transfer: the loader could not be traced (%s); every tensor is received whole",
                             self.trace_failure)
                direct = False
        self.slices = receiver_params(rank, traced, tensors, direct=direct)
        self._storage = {n: p.data for n, p in self.model.named_parameters()}
        raw = Layout(tensors, (), self.slices.params).to_json()
        member = _EngineMember(init_info.rendezvous, init_info.config, "XferInitInfo")
        try:
            self.receiver = WeightReceiver(
                member.engine, member.rendezvous, init_info.group, rank, init_info.senders, init_info.receivers,
                timeout=init_info.timeout, grace=init_info.grace, max_bytes=init_info.max_bytes,
            )
            self._slices_buf = np.frombuffer(bytearray(raw), dtype=np.uint8)
            self._slices_region = member.engine.reg_mr(self._slices_buf, access="read")
            self._published = member.rendezvous.publish(
                _slices_record(init_info.group, rank), member.engine.main_address,
                {"slices": self._slices_region.desc}, ttl=max(2.0, init_info.timeout))
        except BaseException:
            self._member = member
            self.shutdown()
            raise
        self._member, self.rank = member, rank

    def start_weight_update(self) -> None:
        """vLLM's layerwise reload, when some tensor goes through ``load_weights``."""
        self._reloading = bool(self.slices and self.slices.whole)
        if self._reloading:
            from vllm.model_executor.model_loader.reload import initialize_layerwise_reload

            initialize_layerwise_reload(self.model)

    def update_weights(self, update_info: dict[str, Any]) -> None:
        self.receive_weights(self.parse_update_info(update_info))
        import torch

        if torch.cuda.is_available():
            torch.cuda.synchronize()

    def receive_weights(self, update_info: XferUpdateInfo) -> None:
        """Receives the version (waits until the coordinator decided it for every rank), then
        applies it only if it was committed: each box copied into its parameter's storage,
        the whole tensors through ``load_weights``. A version that failed is not applied and
        does not raise (``last_outcome`` says why): vLLM's multiprocess executor answers a
        call with the first worker's failure and leaves the other workers' answers queued
        (without ``enable_fault_tolerance``), so every later call would read a stale failure.
        The trainer has the group's one verdict (``send_weights`` raises ``VersionFailed``)."""
        r, slices = self.receiver, self.slices
        if r is None or slices is None:
            raise RuntimeError("xfer weight transfer: update_weights before init_weight_transfer_engine")
        version = update_info.version
        if type(version) is not int or version < 0:
            raise ValueError(f"xfer weight transfer: version must be a non-negative integer, got {version!r}")
        try:
            r.receive(version)
        except VersionFailed as e:
            self.last_outcome = {"version": version, "applied": False, "reason": str(e)}
            _log.warning("xfer weight transfer: %s; the model keeps its weights", e)
            return
        import torch

        staged = dict(r.tensors())
        with torch.no_grad():
            for box in slices.boxes:
                window = tuple(slice(a, a + n) for a, n in zip(box.at, box.shape))
                self._storage[box.param][window].copy_(staged[box.name])
        if slices.whole:
            self.model.load_weights((name[2:], t) for name, t in staged.items() if name.startswith("t:"))
        self.last_outcome = {"version": version, "applied": True, "reason": ""}

    def finish_weight_update(self) -> None:
        if self._reloading:
            from vllm.model_executor.model_loader.reload import finalize_layerwise_reload

            finalize_layerwise_reload(self.model, self.model_config)
        self._reloading = False

    def shutdown(self) -> None:
        """Leaves the group, frees the staging and closes the engine (idempotent)."""
        receiver, member, published, region = self.receiver, self._member, self._published, self._slices_region
        self.receiver = self._member = self._published = self._slices_region = None
        try:
            if published is not None:
                published.unpublish()
            if receiver is not None:
                receiver.close()
            if region is not None:
                region.dereg()
        finally:
            self._slices_buf = None
            if member is not None:
                member._close_engine()


@dataclasses.dataclass
class XferTrainerInitInfo(TrainerInitInfo):
    """The trainer side's init info (every trainer rank; ``rank`` is its trainer rank).
    ``receivers``: every vLLM worker joined to ``group`` (TP × PP × DP of each instance);
    ``senders``: the trainer ranks (each writes its share of the plan); ``budget_bytes``: a
    trainer rank's staging (two buckets of half of it, filled while the other's writes are in
    flight; ``None``: the tensors are written from their own memory, each registered once
    while the source gives the same memory back)."""

    backend = BACKEND

    rendezvous: str = ""
    group: str = ""
    receivers: int = 1
    senders: int = 1
    rank_base: int = 0
    config: Any = None
    timeout: float = 300.0
    grace: float | None = None
    budget_bytes: int | None = None
    direct: bool = True
    max_bytes: int | None = None


class XferTrainerWeightTransferEngine(TrainerWeightTransferEngine):
    """The trainer side: every trainer rank sends its share of each version; rank 0 (vLLM's
    sender) also drives the workers through ``client`` and coordinates the version."""

    init_info_cls = XferTrainerInitInfo

    def __init__(self, *, client: Any, source: Any, is_sender: bool, rank: int, info: XferTrainerInitInfo,
                 member: _EngineMember, sender: WeightSender, layout: Layout) -> None:
        super().__init__(client=client, source=source, is_sender=is_sender, rank=rank)
        self.info = info
        self._member: _EngineMember | None = member
        self.sender: WeightSender | None = sender
        self.layout = layout
        self.version = 0
        self._index = {t.name: i for i, t in enumerate(layout.tensors)}

    @classmethod
    def trainer_init(cls, init_info: XferTrainerInitInfo, *, client: Any, source: Any = None) -> XferTrainerWeightTransferEngine:
        if source is None:
            raise ValueError("the xfer trainer engine sends a WeightSource each version (source=...)")
        if not init_info.rendezvous or not init_info.group:
            raise ValueError("XferTrainerInitInfo: rendezvous (xfer://host:port) and group are required")
        tensors = tuple(TensorSpec(m.name, tuple(int(d) for d in m.shape), _dtype_name(m.dtype)) for m in source.metadata)
        is_sender = init_info.rank == 0
        member = _EngineMember(init_info.rendezvous, init_info.config, "XferTrainerInitInfo")
        try:
            sender = WeightSender(
                member.engine, member.rendezvous, init_info.group, init_info.rank, init_info.senders,
                init_info.receivers, timeout=init_info.timeout, grace=init_info.grace, budget_bytes=init_info.budget_bytes,
            )
            if is_sender:
                client.init_weight_transfer_engine({
                    "rendezvous": init_info.rendezvous, "group": init_info.group,
                    "tensors": [[t.name, list(t.shape), t.dtype] for t in tensors],
                    "receivers": init_info.receivers, "senders": init_info.senders, "rank_base": init_info.rank_base,
                    "config": init_info.config, "timeout": init_info.timeout, "grace": init_info.grace,
                    "direct": init_info.direct, "max_bytes": init_info.max_bytes,
                })
            params = []
            deadline = time.monotonic() + init_info.timeout
            for r in range(init_info.receivers):
                params.extend(read_receiver_slices(member.engine, member.rendezvous, init_info.group, r, tensors, deadline).params)
            shards = tuple((s, t.name, None) for s in range(init_info.senders) for t in tensors)
            layout = Layout(tensors, shards, tuple(params))
        except BaseException:
            if "sender" in locals():
                sender.close()
            member._close_engine()
            raise
        return cls(client=client, source=source, is_sender=is_sender, rank=init_info.rank, info=init_info,
                   member=member, sender=sender, layout=layout)

    def send_weights(self) -> None:
        """One version: rank 0 starts the workers' update and calls their ``update_weights``
        while every trainer rank writes its share, then finishes it; returns once the version
        is committed and applied on every worker; raises ``VersionFailed`` (after finishing
        the workers' session, nothing applied) otherwise."""
        s = self.sender
        if s is None:
            raise RuntimeError("send_weights after shutdown")
        self.version += 1
        version = self.version
        first = self.rank * len(self.layout.tensors)
        index = self._index

        def shards() -> Iterator[tuple[int, Any]]:
            for name, t in self.source.iter_full():
                yield first + index[name], t

        rpc_error: list[BaseException] = []
        rpc: threading.Thread | None = None
        if self.is_sender:
            self.client.start_weight_update()

            def update() -> None:
                try:
                    self.client.update_weights({"version": version})
                except BaseException as e:  # noqa: BLE001 - raised on the trainer's thread below
                    rpc_error.append(e)

            rpc = threading.Thread(target=update, name=f"xfer-vllm-update-{version}", daemon=True)
            rpc.start()
        failed: VersionFailed | None = None
        try:
            if self.info.budget_bytes is None:
                s.send(version, self.layout, dict(shards()))
            else:
                s.send(version, self.layout, shards())
        except VersionFailed as e:
            failed = e
        finally:
            if rpc is not None:
                rpc.join()
        if rpc_error:
            raise rpc_error[0]
        if self.is_sender:
            # Also after a failed version: the workers applied nothing and end the session
            # (their update_weights did not raise, see XferWeightTransferEngine).
            self.client.finish_weight_update()
        if failed is not None:
            raise failed

    def shutdown(self) -> None:
        sender, member = self.sender, self._member
        self.sender = self._member = None
        try:
            if sender is not None:
                sender.close()
        finally:
            if member is not None:
                member._close_engine()


def read_receiver_slices(engine: _xfer.TransferEngine, rendezvous: Any, group: str, rank: int,
                         tensors: tuple[TensorSpec, ...], deadline: float) -> Layout:
    """Receiver ``rank``'s part of the layout, read from the region its slices record names
    (published by the same engine as its member record), bounded and decoded by
    ``decode_receiver_layout``."""
    left = max(0.0, deadline - time.monotonic())
    rec = rendezvous.lookup(_slices_record(group, rank), left)
    member = rendezvous.lookup(f"{group}.r{rank}", max(0.0, deadline - time.monotonic()))
    if bytes(rec["addr"]) != bytes(member["addr"]):
        raise LayoutError(f"receiver {rank}'s slices are published by another engine than its membership")
    desc = dict(rec["regions"]).get("slices")
    if desc is None:
        raise LayoutError(f"receiver {rank}'s slices record names no region")
    n = int(desc.nbytes)
    if not 0 < n <= MAX_LAYOUT_BYTES:
        raise LayoutError(f"receiver {rank}'s slices are {n} bytes (bound {MAX_LAYOUT_BYTES})")
    buf = np.zeros(n, dtype=np.uint8)
    region = engine.reg_mr(buf)
    try:
        engine.submit_single_read(region, desc, n).wait(max(0.0, deadline - time.monotonic()))
    finally:
        region.dereg()
    return decode_receiver_layout(buf.tobytes(), rank, tensors)
