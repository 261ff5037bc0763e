"""Why one file (976 lines): both ends of one wire contract — the worker engine publishes its
slices record and outcome region, the trainer engine reads them (``_slices_record``,
``encode_outcome`` / ``decode_outcome``, ``_read_receiver`` beside the two classes that use
them), and ``register`` names both to vLLM's factories under one backend name. If it grows,
the split is along that contract: the worker engine (with the trace and the reload), the
trainer engine, and the contract they share.

xfer as a backend of vLLM's own weight-transfer API (vLLM ≥ 0.33):
``weight_transfer_config={"backend": "xfer"}`` (``--weight-transfer-config '{"backend":
"xfer"}'``), driven through vLLM's RL routes (``/init_weight_transfer_engine``,
``/start_weight_update``, ``/update_weights``, ``/finish_weight_update``) or their offline
twins on ``LLM``, and on the trainer by ``WeightTransferTrainerFactory.trainer_init``.

vLLM is not patched: xfer's wheel names ``register`` as a ``vllm.general_plugins`` entry
point, which vLLM runs in every process it starts (the engine core and each worker, before
the worker builds its weight-transfer engine); it registers ``"xfer"`` with both factories.

Each worker receives only what its own loader takes (``xfer.weights.slices``): at
``init_weight_transfer_engine`` the worker runs ``model.load_weights`` once on ids, into
integer stand-ins of the checkpoint-format parameters vLLM restores for its layerwise reload,
and learns, per checkpoint tensor, which box of it lands where in which of its parameters. A
parameter copied from boxes (a tensor-parallel slice, the parts of a fused ``qkv_proj`` /
``gate_up_proj``) is received as those boxes only; anything the loader transforms (a
quantised model, a cast, a parameter mixing both) and every parameter of an attention layer
is received whole and loaded through ``load_weights``. The trace runs in host memory, never on
the device (whose spare memory vLLM gave its KV cache). A loader that cannot be traced is not
papered over: the worker publishes the failure (naming the checkpoint tensor) instead of its
slices and every trainer rank's ``trainer_init`` raises ``TraceFailed``; ``direct=False``
receives every tensor whole. The worker publishes its part of the layout as a registered
region; each trainer rank reads every worker's part once, at ``trainer_init``, and plans its
writes (``xfer.weights.plan``: the trainer ranks share the sending, each from the tensors
its source's ``ParamMeta.owners`` give it, streamed through two staging buckets).

Every version runs inside vLLM's layerwise reload, as vLLM's own engines run theirs: the
boxes of a layer land in its freshly materialised checkpoint-format parameters, then the
layer's ``process_weights_after_loading`` runs and its result is copied into the tensors the
kernels read; ``finish_weight_update`` processes the attention layers again from what is
now loaded (MLA's ``W_UK`` / ``W_UV`` are derived from ``kv_b_proj``). A parameter the model
post-processes (an MLA attention's absorbed weights, a MoE kernel's reordered ``w13``, a
CPU-packed linear) therefore ends each version exactly as vLLM's own reload leaves it.

A version is all-or-nothing across every worker (``xfer.weights`` executor): the bytes land
in each worker's registered staging, the coordinator (trainer rank 0) commits, and only then
does each worker apply it. A version that fails is applied nowhere; ``send_weights`` raises
``VersionFailed`` on the trainer. Applying can still fail on a worker after the commit (its
``load_weights`` refuses a tensor, vLLM's processing runs out of memory): the worker records
it (``last_outcome`` and an outcome region the trainer reads) instead of raising through
vLLM's executor, its layers not yet processed keep the previous version, the trainer always
finishes the workers' session, and every trainer rank's ``send_weights`` raises
``VersionNotApplied`` naming the version and each such worker (rank 0 reads the workers'
outcomes and publishes what it read; the other ranks wait for it). The instance takes the next version, which, applied
whole, repairs the mix.

Trainer side::

    init = XferTrainerInitInfo(rank=trainer_rank, rendezvous="xfer://10.0.0.1:7000",
                               group="rl-run-7", receivers=tp * dp, senders=trainer_ranks,
                               config="/etc/xfer/verbs.toml")  # or $XFER_CONFIG; None without it is refused
    engine = WeightTransferTrainerFactory.trainer_init(init, client=client, source=ModuleSource(model))
    engine.send_weights()  # each step, on every trainer rank
"""

from __future__ import annotations

import dataclasses
import json
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
    "OUTCOME_BYTES",
    "TraceFailed",
    "VersionNotApplied",
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


# A worker's outcome of its last version, in a region the trainer reads after each version:
# a 4-byte little-endian length, then that many bytes of JSON.
OUTCOME_BYTES = 4096
_REASON_CHARS = 1500


class VersionNotApplied(RuntimeError):
    """A version every rank received and the coordinator committed, that some worker could
    not apply (its ``load_weights`` or vLLM's processing raised): ``failed`` maps each such
    receiver rank to its reason. Those workers' layers are a mix of this version and the
    previous one; the other workers hold this version. The next version that applies whole
    repairs it (every version carries every tensor)."""

    def __init__(self, version: int, failed: dict[int, str]) -> None:
        listed = "; ".join(f"receiver {r}: {why}" for r, why in sorted(failed.items()))
        super().__init__(f"weight version {version} was committed but not applied on {len(failed)} "
                         f"worker(s) (their layers are a mix of versions until one applies whole): {listed}")
        self.version = version
        self.failed = failed


def encode_outcome(outcome: dict[str, Any]) -> bytes:
    """A worker's outcome as its outcome region holds it (the reason cut to fit)."""
    fields = {"version": int(outcome["version"]), "applied": bool(outcome["applied"]),
              "reason": str(outcome.get("reason", ""))[:_REASON_CHARS]}
    raw = json.dumps(fields).encode()
    return len(raw).to_bytes(4, "little") + raw


def decode_outcome(raw: bytes) -> tuple[int, bool, str]:
    """``(version, applied, reason)`` from a worker's outcome region; what is not one (a
    length past the region, not JSON, fields of other types) raises ``LayoutError``."""
    if len(raw) < 4:
        raise LayoutError("an outcome shorter than its length")
    n = int.from_bytes(raw[:4], "little")
    if not 0 < n <= min(len(raw) - 4, OUTCOME_BYTES - 4):
        raise LayoutError(f"an outcome of {n} bytes (bound {OUTCOME_BYTES - 4})")
    try:
        fields = json.loads(bytes(raw[4:4 + n]))
    except ValueError as e:
        raise LayoutError(f"an outcome that is not JSON: {e}") from None
    if not (isinstance(fields, dict) and set(fields) == {"version", "applied", "reason"}
            and type(fields["version"]) is int and type(fields["applied"]) is bool
            and isinstance(fields["reason"], str)):
        raise LayoutError("an outcome without exactly version (int), applied (bool) and reason (str)")
    return fields["version"], fields["applied"], fields["reason"][:_REASON_CHARS]


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


class TraceFailed(RuntimeError):
    """A worker's loader could not be traced (``trace_model``): the message names the
    checkpoint tensor the loader was given when it failed. The worker publishes it instead of
    its slices; the trainer's ``trainer_init`` raises it, naming the worker. Nothing falls
    back to receiving whole tensors behind the user's back: ``direct=False`` asks for that."""


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
    from vllm.model_executor.model_loader.reload.layerwise import (
        LAYERWISE_INFO,
        _get_original_loader,
        initialize_layerwise_reload,
    )

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
        for layer in model.modules():
            info = LAYERWISE_INFO.get(layer)
            if info is not None and info.can_load():
                _end_layer_reload(layer, info)
        if hasattr(model, "_original_do_torchao_reload"):
            model._do_torchao_reload = model._original_do_torchao_reload
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


# The trainer's staging by default: two buckets of 2 GiB, verl's default bucket
# (``update_weights_bucket_megabytes: 2048``), each made as large as the largest tensor the
# rank sends when one is larger and as small as all of them when they fit.
DEFAULT_BUCKET_BYTES = 2048 << 20
DEFAULT_BUDGET_BYTES = 2 * DEFAULT_BUCKET_BYTES


@dataclasses.dataclass
class XferTrainerInitInfo(TrainerInitInfo):
    """The trainer side's init info (every trainer rank; ``rank`` is its trainer rank).
    ``receivers``: every vLLM worker joined to ``group`` (TP × PP × DP of each instance);
    ``senders``: the trainer ranks (each writes its share of the plan, from the tensors its
    source's ``ParamMeta.owners`` give it); ``budget_bytes``: a trainer rank's staging, two
    buckets of half of it (default ``DEFAULT_BUDGET_BYTES``): each tensor the source yields is
    copied into one and let go while the other's writes are in flight, so at most the two
    buckets and the tensor being gathered are held, whatever the model's size; a bucket grows
    to the largest tensor this rank sends (it must hold one). ``None``: the tensors are written
    from their own memory, each registered once while the source gives the same memory back —
    every tensor of a version is held until it is written, so only for a source whose tensors
    are memory it keeps anyway (a plain module's own parameters), never a gathering one."""

    backend = BACKEND

    rendezvous: str = ""
    group: str = ""
    receivers: int = 1
    senders: int = 1
    rank_base: int = 0
    config: Any = None
    timeout: float = 300.0
    grace: float | None = None
    budget_bytes: int | None = DEFAULT_BUDGET_BYTES
    direct: bool = True
    max_bytes: int | None = None


def _owned(source: Any, senders: int) -> dict[str, tuple[int, ...]]:
    """Each tensor's owners from the source's ``ParamMeta.owners`` (``None``: every trainer
    rank), checked to be trainer ranks of this group."""
    out: dict[str, tuple[int, ...]] = {}
    for m in source.metadata:
        owners = getattr(m, "owners", None)
        if owners is None:
            out[m.name] = tuple(range(senders))
            continue
        owners = tuple(int(o) for o in owners)
        bad = [o for o in owners if not 0 <= o < senders]
        if bad or not owners:
            raise ValueError(f"parameter {m.name!r}: owners {owners} are not all trainer ranks of the "
                             f"{senders} senders (XferTrainerInitInfo.senders)")
        out[m.name] = owners
    return out


def _summary_record(group: str, version: int) -> str:
    return f"{group}.s0.v{version}"


def encode_summary(version: int, error: str, failed: dict[int, str], bound: int) -> bytes:
    """What trainer rank 0 tells the other trainer ranks of a committed version once the
    workers' session is finished: the error driving it raised on rank 0 (``""``: none) and
    each worker that did not apply it, with its reason — the reasons cut until it fits
    ``bound`` bytes."""
    cap = _REASON_CHARS
    while True:
        raw = json.dumps({"version": int(version), "error": error[:cap],
                          "failed": {str(r): why[:cap] for r, why in sorted(failed.items())}}).encode()
        if len(raw) + 4 <= bound or cap == 0:
            return len(raw).to_bytes(4, "little") + raw
        cap //= 2


def decode_summary(raw: bytes, receivers: int, bound: int) -> tuple[int, str, dict[int, str]]:
    """``(version, error, failed)`` from rank 0's summary; what is not one raises
    ``LayoutError``."""
    if len(raw) < 4:
        raise LayoutError("a summary shorter than its length")
    n = int.from_bytes(raw[:4], "little")
    if not 0 < n <= min(len(raw) - 4, bound - 4):
        raise LayoutError(f"a summary of {n} bytes (bound {bound - 4})")
    try:
        fields = json.loads(bytes(raw[4:4 + n]))
    except ValueError as e:
        raise LayoutError(f"a summary that is not JSON: {e}") from None
    if not (isinstance(fields, dict) and set(fields) == {"version", "error", "failed"}
            and type(fields["version"]) is int and isinstance(fields["error"], str)
            and isinstance(fields["failed"], dict)
            and all(k.isascii() and k.isdigit() and int(k) < receivers and isinstance(v, str) for k, v in fields["failed"].items())):
        raise LayoutError("a summary without exactly version (int), error (str) and failed ({receiver: str})")
    return fields["version"], fields["error"][:_REASON_CHARS], {int(k): v[:_REASON_CHARS] for k, v in fields["failed"].items()}


class XferTrainerWeightTransferEngine(TrainerWeightTransferEngine):
    """The trainer side: every trainer rank sends its share of each version (of the tensors it
    owns); rank 0 (vLLM's sender) also drives the workers through ``client``, coordinates the
    version, reads each worker's outcome once the session is finished and publishes what it
    read, which every other trainer rank reads: every rank raises the same
    ``VersionNotApplied``."""

    init_info_cls = XferTrainerInitInfo

    def __init__(self, *, client: Any, source: Any, is_sender: bool, rank: int, info: XferTrainerInitInfo,
                 member: _EngineMember, sender: WeightSender, layout: Layout, outcomes: tuple[Any, ...] = ()) -> None:
        super().__init__(client=client, source=source, is_sender=is_sender, rank=rank)
        self.info = info
        self._member: _EngineMember | None = member
        self.sender: WeightSender | None = sender
        self.layout = layout
        self.version = 0
        # This rank's shard of each tensor it owns (in the source's metadata order).
        self._shard_of = {name: i for i, (r, name, _) in enumerate(layout.shards) if r == rank}
        # Each worker's outcome region, read into one local buffer after each version.
        self._outcomes = outcomes
        self._outcome_buf = np.zeros(max(1, len(outcomes)) * OUTCOME_BYTES, dtype=np.uint8)
        self._outcome_region = member.engine.reg_mr(self._outcome_buf, access="local") if outcomes else None
        # Rank 0's summaries of the last versions, published for the other trainer ranks.
        self._summaries: list[tuple[Any, Any]] = []
        self._summary_bound = OUTCOME_BYTES * (1 + info.receivers)

    @classmethod
    def trainer_init(cls, init_info: XferTrainerInitInfo, *, client: Any, source: Any = None) -> XferTrainerWeightTransferEngine:
        if source is None:
            raise ValueError("the xfer trainer engine sends a WeightSource each version (source=...)")
        if not init_info.rendezvous or not init_info.group:
            raise ValueError("XferTrainerInitInfo: rendezvous (xfer://host:port) and group are required")
        tensors = tuple(TensorSpec(m.name, tuple(int(d) for d in m.shape), _dtype_name(m.dtype)) for m in source.metadata)
        owners = _owned(source, init_info.senders)
        budget = init_info.budget_bytes
        if budget is not None:
            mine = [t.nbytes for t in tensors if init_info.rank in owners[t.name]]
            bucket = max(max(mine, default=1), min(budget // 2, sum(-(-n // 64) * 64 for n in mine)))
            budget = 2 * bucket
        is_sender = init_info.rank == 0
        member = _EngineMember(init_info.rendezvous, init_info.config, "XferTrainerInitInfo")
        try:
            sender = WeightSender(
                member.engine, member.rendezvous, init_info.group, init_info.rank, init_info.senders,
                init_info.receivers, timeout=init_info.timeout, grace=init_info.grace, budget_bytes=budget,
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
            outcomes = []
            deadline = time.monotonic() + init_info.timeout
            for r in range(init_info.receivers):
                part, outcome = _read_receiver(member.engine, member.rendezvous, init_info.group, r, tensors, deadline)
                params.extend(part.params)
                outcomes.append(outcome)
            # Each tensor held whole by each of its owners: the plan shares its bytes among them.
            shards = tuple((s, t.name, None) for s in range(init_info.senders) for t in tensors if s in owners[t.name])
            layout = Layout(tensors, shards, tuple(params))
            engine = cls(client=client, source=source, is_sender=is_sender, rank=init_info.rank, info=init_info,
                         member=member, sender=sender, layout=layout, outcomes=tuple(outcomes) if is_sender else ())
        except BaseException:
            if "sender" in locals():
                sender.close()
            member._close_engine()
            raise
        return engine

    def send_weights(self) -> None:
        """One version: rank 0 starts the workers' update and calls their ``update_weights``
        while every trainer rank writes its share, then finishes the session — always, also
        after a failure — and reads every worker's outcome. Each rank's tensors are streamed
        (``budget_bytes``): the source's next tensor is gathered while the last one's writes
        are in flight. Returns once the version is committed and applied on every worker;
        raises ``VersionFailed`` when it was applied nowhere, and ``VersionNotApplied``
        (naming the version and each worker that could not apply it, with its reason) when it
        was committed but some worker's apply failed — on every trainer rank: rank 0 publishes
        what it read, the others wait for it (up to ``timeout``). Either way the session is
        closed and the next version can be sent."""
        s = self.sender
        if s is None:
            raise RuntimeError("send_weights after shutdown")
        self.version += 1
        version = self.version
        shard_of = self._shard_of

        def shards() -> Iterator[tuple[int, Any]]:
            for name, t in self.source.iter_full():
                index = shard_of.get(name)
                if index is None:
                    raise ValueError(f"the source yielded {name!r}, which trainer rank {self.rank} does not own "
                                     "(its ParamMeta.owners) or the source's metadata does not declare")
                yield index, t
                del t  # not held here while the next one is gathered

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
        concluded: list[dict[int, str]] = []
        try:
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
        except BaseException as e:
            rpc_error.append(e)
            raise
        finally:
            if self.is_sender:
                try:
                    # Always: a worker left in its session refuses every later
                    # start_weight_update. The workers' update_weights never raise for a
                    # version (see XferWeightTransferEngine.receive_weights), so their answers
                    # are in step.
                    self.client.finish_weight_update()
                except BaseException as e:
                    rpc_error.append(e)
                    raise
                finally:
                    if failed is None:
                        concluded.append(self._conclude(version, rpc_error))
        if rpc_error:
            raise rpc_error[0]
        if failed is not None:
            raise failed
        not_applied = concluded[0] if self.is_sender else self._hear_summary(version)
        if not_applied:
            raise VersionNotApplied(version, not_applied)

    def _conclude(self, version: int, rpc_error: list[BaseException]) -> dict[int, str]:
        """Rank 0, once the workers' session of a committed ``version`` is finished: the
        workers that did not apply it (their outcomes read now), and that — or the error that
        stopped rank 0 driving the session — published under ``_summary_record`` for the
        other trainer ranks. The last 16 versions' stay published (a rank reads its version's
        once it committed it, and rank 0 cannot run far ahead of it: a version commits only
        with every rank's report)."""
        error = f"{type(rpc_error[0]).__name__}: {rpc_error[0]}" if rpc_error else ""
        failed: dict[int, str] = {}
        if not rpc_error:
            try:
                failed = self._not_applied(version)
            except Exception as e:
                error = f"reading the workers' outcomes failed: {type(e).__name__}: {e}"
                rpc_error.append(e)
        member = self._member
        if member is None or self.info.senders == 1:
            return failed
        raw = encode_summary(version, error, failed, self._summary_bound)
        buf = np.frombuffer(bytearray(raw), dtype=np.uint8)
        region = member.engine.reg_mr(buf, access="read")
        try:
            published = member.rendezvous.publish(_summary_record(self.info.group, version), member.engine.main_address,
                                                  {"summary": region.desc}, ttl=max(2.0, self.info.timeout))
        except BaseException:
            region.dereg()
            raise
        self._summaries.append((published, region, buf))
        while len(self._summaries) > 16:
            old, old_region, _ = self._summaries.pop(0)
            old.unpublish()
            old_region.dereg()
        return failed

    def _hear_summary(self, version: int) -> dict[int, str]:
        """A trainer rank other than 0: rank 0's summary of committed ``version``, waited for
        (up to ``timeout``), checked to come from rank 0's engine, bounded and decoded. Raises
        what stopped rank 0 driving the workers; returns the workers that did not apply it."""
        s, member = self.sender, self._member
        assert s is not None and member is not None
        deadline = time.monotonic() + self.info.timeout
        try:
            rec = member.rendezvous.lookup(_summary_record(self.info.group, version), self.info.timeout)
        except Exception as e:  # noqa: BLE001 - the same failure, named
            raise RuntimeError(f"weight version {version} was committed, but trainer rank 0 did not say whether the "
                               f"workers applied it within {self.info.timeout:.0f} s: {type(e).__name__}: {e}") from e
        coordinator = s.record(0, deadline)
        if coordinator is None or bytes(rec["addr"]) != coordinator[0]:
            raise LayoutError(f"the summary of weight version {version} is not published by trainer rank 0's engine")
        desc = dict(rec["regions"]).get("summary")
        n = int(desc.nbytes) if desc is not None else 0
        if not 0 < n <= self._summary_bound:
            raise LayoutError(f"the summary of weight version {version} is {n} bytes (bound {self._summary_bound})")
        buf = np.zeros(n, dtype=np.uint8)
        region = member.engine.reg_mr(buf)
        try:
            member.engine.submit_single_read(region, desc, n).wait(max(0.0, deadline - time.monotonic()))
        finally:
            region.dereg()
        got, error, failed = decode_summary(buf.tobytes(), self.info.receivers, self._summary_bound)
        if got != version:
            raise LayoutError(f"the summary of weight version {version} is of version {got}")
        if error:
            raise RuntimeError(f"weight version {version} was committed, but trainer rank 0 could not finish the "
                               f"workers' session: {error}")
        return failed

    def _not_applied(self, version: int) -> dict[int, str]:
        """Each worker's outcome of ``version`` read from its outcome region: the receiver
        ranks that did not apply it, with their reasons."""
        region = self._outcome_region
        member = self._member
        if region is None or member is None:
            return {}
        deadline = time.monotonic() + self.info.timeout
        for r, desc in enumerate(self._outcomes):
            member.engine.submit_single_read(region, desc, OUTCOME_BYTES, local_offset=r * OUTCOME_BYTES).wait(
                max(0.0, deadline - time.monotonic()))
        failed: dict[int, str] = {}
        for r in range(len(self._outcomes)):
            raw = self._outcome_buf[r * OUTCOME_BYTES:(r + 1) * OUTCOME_BYTES].tobytes()
            try:
                got, applied, reason = decode_outcome(raw)
            except LayoutError as e:
                failed[r] = f"an unreadable outcome ({e})"
                continue
            if got != version:
                failed[r] = f"its last outcome is of version {got}, not {version}"
            elif not applied:
                failed[r] = reason
        return failed

    def shutdown(self) -> None:
        sender, member, region = self.sender, self._member, self._outcome_region
        summaries, self._summaries = self._summaries, []
        self.sender = self._member = self._outcome_region = None
        try:
            for published, summary, _ in summaries:
                published.unpublish()
                summary.dereg()
            if sender is not None:
                sender.close()
            if region is not None:
                region.dereg()
        finally:
            if member is not None:
                member._close_engine()


def read_receiver_slices(engine: _xfer.TransferEngine, rendezvous: Any, group: str, rank: int,
                         tensors: tuple[TensorSpec, ...], deadline: float) -> Layout:
    """Receiver ``rank``'s part of the layout, read from the region its slices record names
    (published by the same engine as its member record), bounded and decoded by
    ``decode_receiver_layout``."""
    return _read_receiver(engine, rendezvous, group, rank, tensors, deadline)[0]


def _read_receiver(engine: _xfer.TransferEngine, rendezvous: Any, group: str, rank: int,
                   tensors: tuple[TensorSpec, ...], deadline: float) -> tuple[Layout, Any]:
    """``read_receiver_slices``, and the descriptor of the receiver's outcome region."""
    left = max(0.0, deadline - time.monotonic())
    rec = rendezvous.lookup(_slices_record(group, rank), left)
    failure = dict(rec["regions"]).get("trace_failure")
    if failure is not None:
        n = int(failure.nbytes)
        if not 0 < n <= OUTCOME_BYTES:
            raise LayoutError(f"receiver {rank}'s trace failure is {n} bytes (bound {OUTCOME_BYTES})")
        buf = np.zeros(n, dtype=np.uint8)
        region = engine.reg_mr(buf)
        try:
            engine.submit_single_read(region, failure, n).wait(max(0.0, deadline - time.monotonic()))
        finally:
            region.dereg()
        raise TraceFailed(f"receiver {rank} could not learn its slices from its loader: "
                          f"{buf.tobytes().decode(errors='replace')} (init with direct=False to receive every "
                          "tensor whole through load_weights)")
    member = rendezvous.lookup(f"{group}.r{rank}", max(0.0, deadline - time.monotonic()))
    if bytes(rec["addr"]) != bytes(member["addr"]):
        raise LayoutError(f"receiver {rank}'s slices are published by another engine than its membership")
    regions = dict(rec["regions"])
    desc = regions.get("slices")
    if desc is None:
        raise LayoutError(f"receiver {rank}'s slices record names no region")
    outcome = regions.get("outcome")
    if outcome is None or int(outcome.nbytes) != OUTCOME_BYTES:
        raise LayoutError(f"receiver {rank}'s slices record names no outcome region of {OUTCOME_BYTES} bytes")
    n = int(desc.nbytes)
    if not 0 < n <= MAX_LAYOUT_BYTES:
        raise LayoutError(f"receiver {rank}'s slices are {n} bytes (bound {MAX_LAYOUT_BYTES})")
    buf = np.zeros(n, dtype=np.uint8)
    region = engine.reg_mr(buf)
    try:
        engine.submit_single_read(region, desc, n).wait(max(0.0, deadline - time.monotonic()))
    finally:
        region.dereg()
    return decode_receiver_layout(buf.tobytes(), rank, tensors), outcome
