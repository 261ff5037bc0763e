"""The worker side of xfer's vLLM weight-transfer backend: the engine vLLM builds in each
worker from ``weight_transfer_config`` (``XferWeightTransferEngine``), its init and update
infos, and what it runs inside vLLM's layerwise reload — ``trace_model`` (which boxes of each
checkpoint tensor its own loader takes, learned at init) and ``_end_layer_reload``. Apart from
the trainer engine because it runs in another process against other vLLM internals; what it
publishes for the trainer is defined in ``vllm_contract``. The backend's overview is in
``vllm_engine``.
"""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Iterator
from typing import Any

import numpy as np
from vllm.distributed.weight_transfer.base import (
    WeightTransferEngine,
    WeightTransferInitInfo,
    WeightTransferUpdateInfo,
)

from .engines import _Member as _EngineMember
from .executor import VersionFailed, WeightReceiver
from .layout import Layout, TensorSpec
from .slices import ReceiverSlices, id_bases, receiver_params, trace_tensor
from .vllm import receiver_rank
from .vllm_contract import OUTCOME_BYTES, TraceFailed, _dtype_name, _slices_record, encode_outcome

# The name the backend has logged under since it was one module (vllm_engine), kept for the
# logging configurations that name it.
_log = logging.getLogger("xfer.weights.vllm_engine")


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


def _end_layer_reload(layer: Any, info: Any) -> None:
    """Ends vLLM's layerwise reload of ``layer`` without loading or processing it: its kernel
    tensors back in place, nothing pending, and their weight loaders unwrapped. (vLLM wraps
    the loaders of the tensors it keeps live — a ``bias`` — for the reload; left wrapped, a
    later ``load_weights`` outside a reload is dropped as "excessive loading".)"""
    from vllm.model_executor.model_loader.reload.layerwise import _get_original_loader, _place_kernel_tensors
    from vllm.model_executor.model_loader.reload.utils import get_layer_tensors

    if info.kernel_tensors is not None:
        _place_kernel_tensors(layer, info)
    info.reset()
    for t in get_layer_tensors(layer).values():
        loader = getattr(t, "weight_loader", None)
        if getattr(loader, "__name__", "") == "online_process_loader":
            t.weight_loader = _get_original_loader(t)


def end_reloads(model: Any) -> None:
    """Ends vLLM's layerwise reload on every layer of ``model`` still being reloaded
    (``_end_layer_reload``), and restores vLLM's torchao hook: the model as it was, where a
    reload stood."""
    from vllm.model_executor.model_loader.reload.layerwise import LAYERWISE_INFO

    for layer in model.modules():
        info = LAYERWISE_INFO.get(layer)
        if info is not None and info.can_load():
            _end_layer_reload(layer, info)
    if hasattr(model, "_original_do_torchao_reload"):
        model._do_torchao_reload = model._original_do_torchao_reload


def trace_model(model: Any, tensors: tuple[TensorSpec, ...]) -> tuple[dict[str, tuple[np.ndarray, str]], set[str]]:
    """Runs ``model.load_weights`` on ids (see ``xfer.weights.slices``) into integer stand-ins
    of the parameters its loaders write: the checkpoint-format parameters vLLM recorded when it
    built the model and restores for its layerwise reload (``initialize_layerwise_reload``),
    not the processed ones the kernels read — a box is copied into the former, and the layer's
    ``process_weights_after_loading`` makes the latter from it, as in vLLM's own reload (its
    ``sharded_rdt`` engine bakes its plan the same way). Returns each parameter's ids and dtype
    name, and the parameters of attention layers (vLLM processes those only when the reload is
    finished: they are received whole). The stand-ins, the ids and the buffers the loaders
    need are host memory, never the device's: the trace runs after vLLM sized its KV cache to
    the device's spare memory, and int64 stand-ins are four times a bf16 model (vLLM's
    ``sharded_rdt`` runs its dry run on meta tensors for the same reason). The model's
    parameters and buffers are as before afterwards, whatever the loader raised. A failure
    raises ``TraceFailed`` naming the checkpoint tensor being loaded."""
    import torch
    from vllm.model_executor.layers.attention import is_deferred_attention_layer
    from vllm.model_executor.model_loader.reload.layerwise import _get_original_loader, initialize_layerwise_reload

    bases = id_bases(tensors)
    dtypes: dict[str, str] = {}
    attention: set[str] = set()
    live_buffers: list[tuple[Any, Any]] = []

    host = torch.device("cpu")
    loading: list[str] = []

    def ids() -> Iterator[tuple[str, Any]]:
        for i, t in enumerate(tensors):
            loading[:] = [t.name]
            yield t.name, torch.from_numpy(trace_tensor(i, tensors, bases))
        loading[:] = []

    initialize_layerwise_reload(model)
    try:
        for prefix, layer in model.named_modules():
            for name, t in list(layer._parameters.items()):
                if t is None:
                    continue
                full = f"{prefix}.{name}" if prefix else name
                dtypes[full] = _dtype_name(t.dtype)
                if is_deferred_attention_layer(layer):
                    attention.add(full)
                # As vLLM materialises a meta parameter (class and loader attributes kept), in
                # int64 ids; the loader is the original, not reload's deferring wrapper.
                ids_of = torch.full(tuple(t.shape), -1, dtype=torch.int64, device=host)
                ids_of.__class__ = t.__class__
                ids_of.__dict__ = t.__dict__.copy()
                try:
                    ids_of.weight_loader = _get_original_loader(t)
                except (AttributeError, ValueError):  # a parameter whose loader vLLM deleted
                    pass
                setattr(layer, name, ids_of)
            for name, b in list(layer._buffers.items()):
                if b is None:
                    continue
                if b.is_meta:
                    setattr(layer, name, torch.zeros(tuple(b.shape), dtype=b.dtype, device=host))
                else:  # live (never on meta): a loader writing it must not change the model
                    live_buffers.append((b, b.detach().clone()))
        try:
            from vllm.model_executor.model_loader.mtp_validation import disable_mtp_completeness_check
        except ImportError:  # pragma: no cover - older vLLM
            import contextlib

            disable_mtp_completeness_check = contextlib.nullcontext
        try:
            with torch.no_grad(), disable_mtp_completeness_check():
                model.load_weights(ids())
            traced = {n: (p.data.cpu().numpy().copy(), dtypes[n]) for n, p in model.named_parameters() if n in dtypes}
        except Exception as e:
            where = f"loading checkpoint tensor {loading[0]!r}" if loading else "after the last checkpoint tensor"
            raise TraceFailed(f"the loader failed {where}: {type(e).__name__}: {e}") from e
        return traced, attention
    finally:
        # What vLLM's sharded_rdt does after its dry run: the kernel tensors back, nothing loaded.
        end_reloads(model)
        with torch.no_grad():
            for b, saved in live_buffers:
                b.copy_(saved)


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
        self._outcome_buf: np.ndarray | None = None
        self._outcome_region: Any = None
        self._reloading = False
        self.last_outcome: dict[str, Any] | None = None

    def init_transfer_engine(self, init_info: XferInitInfo) -> None:
        """Joins the group as receiver ``rank_base`` + this worker's place (see
        ``xfer.weights.vllm.receiver_rank``), learns its slices from its own loader and
        publishes them, with its outcome region, for the trainer ranks. A second call replaces
        the first."""
        self.shutdown()
        tensors = init_info.specs()
        rank = receiver_rank(init_info.rank_base, int(self.parallel_config.rank), self.parallel_config)
        direct = bool(init_info.direct) and getattr(self.model_config, "quantization", None) is None
        traced: dict[str, tuple[np.ndarray, str]] = {}
        attention: set[str] = set()
        self.trace_failure = ""
        if direct:
            try:
                traced, attention = trace_model(self.model, tensors)
            except Exception as e:  # noqa: BLE001 - published for the trainer, which raises it by name
                self.trace_failure = str(e) if isinstance(e, TraceFailed) else f"{type(e).__name__}: {e}"
                _log.error("xfer weight transfer: receiver %s could not trace its loader (%s); it does not join "
                           "the group (init with direct=False to receive every tensor whole)", rank, self.trace_failure)
        self.slices = None
        member = _EngineMember(init_info.rendezvous, init_info.config, "XferInitInfo")
        if self.trace_failure:
            # Never a silent fallback to whole tensors (a whole model staged on every rank):
            # the failure is published in place of the slices, and every trainer rank's
            # trainer_init raises it by name. Not raised here: vLLM's executor would answer
            # with the first worker's failure and keep the others' answers queued.
            try:
                text = self.trace_failure.encode()[:OUTCOME_BYTES]
                self._slices_buf = np.frombuffer(bytearray(text), dtype=np.uint8)
                self._slices_region = member.engine.reg_mr(self._slices_buf, access="read")
                self._published = member.rendezvous.publish(
                    _slices_record(init_info.group, rank), member.engine.main_address,
                    {"trace_failure": self._slices_region.desc}, ttl=max(2.0, init_info.timeout))
            except BaseException:
                self._member = member
                self.shutdown()
                raise
            self._member, self.rank = member, rank
            return
        self.slices = receiver_params(rank, traced, tensors, direct=direct, whole_params=attention)
        raw = Layout(tensors, (), self.slices.params).to_json()
        try:
            self.receiver = WeightReceiver(
                member.engine, member.rendezvous, init_info.group, rank, init_info.senders, init_info.receivers,
                timeout=init_info.timeout, grace=init_info.grace, max_bytes=init_info.max_bytes,
            )
            self._slices_buf = np.frombuffer(bytearray(raw), dtype=np.uint8)
            self._slices_region = member.engine.reg_mr(self._slices_buf, access="read")
            self._outcome_buf = np.zeros(OUTCOME_BYTES, dtype=np.uint8)
            self._outcome_region = member.engine.reg_mr(self._outcome_buf, access="read")
            self._record({"version": -1, "applied": False, "reason": "no version received yet"})
            self._published = member.rendezvous.publish(
                _slices_record(init_info.group, rank), member.engine.main_address,
                {"slices": self._slices_region.desc, "outcome": self._outcome_region.desc},
                ttl=max(2.0, init_info.timeout))
        except BaseException:
            self._member = member
            self.shutdown()
            raise
        self._member, self.rank = member, rank
        self.last_outcome = None

    def start_weight_update(self) -> None:
        """vLLM's layerwise reload, for every version (as vLLM's own engines run it): the
        layers' parameters go back to the checkpoint format they are loaded in, and each
        layer's processing runs again once its weights are in (see ``receive_weights``)."""
        from vllm.model_executor.model_loader.reload import initialize_layerwise_reload

        initialize_layerwise_reload(self.model)
        self._reloading = True

    def update_weights(self, update_info: dict[str, Any]) -> None:
        self.receive_weights(self.parse_update_info(update_info))
        import torch

        if torch.cuda.is_available():
            torch.cuda.synchronize()

    def receive_weights(self, update_info: XferUpdateInfo) -> None:
        """Receives the version (waits until the coordinator decided it for every rank), then
        applies it only if it was committed: each layer with boxes is materialised in its
        checkpoint format, its boxes copied in, and processed into the kernel's tensors (what
        vLLM's reload does once a layer's weights are in); the whole tensors go through
        ``load_weights``, which vLLM's reload defers and processes the same way.

        Never raises for a version (``last_outcome`` says what happened, and the trainer
        reads it from this worker's outcome region): vLLM's multiprocess executor answers a
        call with the first worker's failure and leaves the other workers' answers queued
        (without ``enable_fault_tolerance``), and a worker whose ``update_weights`` raised
        ends its session while the others stay in theirs, so every later call would fail. A
        version that failed is not applied; one whose apply failed after the commit leaves
        the layers processed before the failure at the new version and the rest at the
        previous one (``finish_weight_update`` then re-derives the attention layers from what
        is there); the next version that applies whole repairs it."""
        version = update_info.version
        committed = False
        try:
            committed = self._receive(version)
            if committed:
                self._apply(version)
        except Exception as e:  # noqa: BLE001 - see the docstring: recorded, never raised through vLLM
            if not committed:
                self._record({"version": version, "applied": False, "committed": False,
                              "reason": f"{type(e).__name__}: {e}"})
                _log.error("xfer weight transfer: weight version %s not received (%s: %s); the model keeps "
                           "its weights", version, type(e).__name__, e)
                return
            self._record({"version": version, "applied": False, "committed": True,
                          "reason": f"applying the committed version failed: {type(e).__name__}: {e}"})
            _log.error("xfer weight transfer: weight version %s was committed but not applied on this worker "
                       "(%s: %s); its layers are a mix of this version and the previous one until a version "
                       "applies whole", version, type(e).__name__, e)
            self._abort_reload(attention=False)

    def _receive(self, version: Any) -> bool:
        """Receives ``version``; True once the coordinator committed it, False (recorded) if
        it failed."""
        r = self.receiver
        if r is None or self.slices is None:
            raise RuntimeError("xfer weight transfer: update_weights before init_weight_transfer_engine")
        if type(version) is not int or version < 0:
            raise ValueError(f"xfer weight transfer: version must be a non-negative integer, got {version!r}")
        if not self._reloading:
            raise RuntimeError("xfer weight transfer: update_weights outside start_weight_update / finish_weight_update")
        try:
            r.receive(version)
        except VersionFailed as e:
            self._record({"version": version, "applied": False, "committed": False, "reason": str(e)})
            _log.warning("xfer weight transfer: %s; the model keeps its weights", e)
            return False
        return True

    def _apply(self, version: int) -> None:
        import torch
        from vllm.model_executor.model_loader.reload.layerwise import LAYERWISE_INFO, _layerwise_process
        from vllm.model_executor.model_loader.reload.meta import materialize_layer

        r, slices = self.receiver, self.slices
        assert r is not None and slices is not None
        staged = dict(r.tensors())
        by_layer: dict[str, list[Any]] = {}
        for box in slices.boxes:
            by_layer.setdefault(box.param.rpartition(".")[0], []).append(box)
        with torch.no_grad():
            # A layer with boxes takes no tensor whole (``receiver_params``): once its boxes
            # are in, it is complete, and processing it at once holds one layer's
            # checkpoint-format copy at a time, as vLLM's reload does.
            for prefix, boxes in by_layer.items():
                layer = self.model.get_submodule(prefix)
                info = LAYERWISE_INFO.get(layer)
                if info is None or not info.can_load():
                    raise RuntimeError(f"layer {prefix!r} is not being reloaded (start_weight_update did not prepare it)")
                materialize_layer(layer, info)
                for box in boxes:
                    window = tuple(slice(a, a + n) for a, n in zip(box.at, box.shape))
                    getattr(layer, box.param.rpartition(".")[2]).data[window].copy_(staged[box.name])
                if info.can_load():
                    _layerwise_process(layer, info)
            if slices.whole:
                self.model.load_weights((name[2:], t) for name, t in staged.items() if name.startswith("t:"))
        self._record({"version": version, "applied": True, "committed": True, "reason": ""})

    def finish_weight_update(self) -> None:
        """Finishes vLLM's layerwise reload: attention layers are processed again from the
        layers they read (MLA's ``W_UK`` / ``W_UV`` from ``kv_b_proj``), a layer that took
        nothing gets its previous tensors back. A failure here is recorded as the version's
        outcome, as in ``receive_weights``, never raised."""
        if not self._reloading:
            return
        self._reloading = False
        from vllm.model_executor.model_loader.reload import finalize_layerwise_reload

        try:
            finalize_layerwise_reload(self.model, self.model_config)
        except Exception as e:  # noqa: BLE001 - see receive_weights
            version = (self.last_outcome or {}).get("version", -1)
            self._record({"version": version, "applied": False, "committed": True,
                          "reason": f"finishing vLLM's layerwise reload failed: {type(e).__name__}: {e}"})
            _log.error("xfer weight transfer: finishing the reload of weight version %s failed (%s: %s); the "
                       "model is a mix of versions until a version applies whole", version, type(e).__name__, e)
            self._abort_reload(attention=True)

    def _abort_reload(self, *, attention: bool) -> None:
        """Ends vLLM's layerwise reload where it stands: every layer not yet processed gets its
        kernel tensors back (the previous version; never a half-loaded, uninitialised layer),
        and is no longer being reloaded, so the next ``start_weight_update`` prepares it
        again. Attention layers are left to ``finalize_layerwise_reload`` (which re-derives
        them from the layers now in place) unless ``attention``."""
        from vllm.model_executor.layers.attention import is_deferred_attention_layer
        from vllm.model_executor.model_loader.reload.layerwise import LAYERWISE_INFO

        for layer in self.model.modules():
            info = LAYERWISE_INFO.get(layer)
            if info is None or not info.can_load() or (not attention and is_deferred_attention_layer(layer)):
                continue
            _end_layer_reload(layer, info)
        if attention and hasattr(self.model, "_original_do_torchao_reload"):
            self.model._do_torchao_reload = self.model._original_do_torchao_reload

    def _record(self, outcome: dict[str, Any]) -> None:
        """This worker's outcome of a version, kept and written to its outcome region."""
        self.last_outcome = outcome
        if self._outcome_buf is not None:
            raw = encode_outcome(outcome)
            self._outcome_buf[:] = 0
            self._outcome_buf[:len(raw)] = np.frombuffer(raw, dtype=np.uint8)

    def shutdown(self) -> None:
        """Leaves the group, frees the staging and closes the engine (idempotent)."""
        receiver, member, published = self.receiver, self._member, self._published
        regions = (self._slices_region, self._outcome_region)
        self.receiver = self._member = self._published = self._slices_region = self._outcome_region = None
        try:
            if published is not None:
                published.unpublish()
            if receiver is not None:
                receiver.close()
            for region in regions:
                if region is not None:
                    region.dereg()
        finally:
            self._slices_buf = self._outcome_buf = None
            if member is not None:
                member._close_engine()
