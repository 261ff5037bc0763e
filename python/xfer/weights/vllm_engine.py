"""xfer as a backend of vLLM's own weight-transfer API (vLLM ≥ 0.33): the module that vLLM's
plugin entry point names (``xfer_weights = "xfer.weights.vllm_engine:register"``) and users
import. It holds ``register`` and re-exports the backend's names from the three modules that
hold them, split along the wire contract between the two ends: ``vllm_worker`` (the worker
engine, with the loader trace and the layerwise reload), ``vllm_trainer`` (the trainer
engine) and ``vllm_contract`` (the slices record, outcome region and summary record, with
their encoders and decoders).

Selected by ``weight_transfer_config={"backend": "xfer"}`` (``--weight-transfer-config
'{"backend": "xfer"}'``), driven through vLLM's RL routes (``/init_weight_transfer_engine``,
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

from .vllm_contract import (
    BACKEND,
    OUTCOME_BYTES,
    TraceFailed,
    decode_outcome,
    decode_summary,
    encode_outcome,
    encode_summary,
    read_receiver_slices,
)
from .vllm_trainer import (
    DEFAULT_BUCKET_BYTES,
    DEFAULT_BUDGET_BYTES,
    VersionNotApplied,
    XferTrainerInitInfo,
    XferTrainerWeightTransferEngine,
)
from .vllm_worker import XferInitInfo, XferUpdateInfo, XferWeightTransferEngine, trace_model

# The private names this module held before the split, for the callers and branches that
# import them from here (pyflakes counts them unused: they are re-exports).
from .vllm_contract import _dtype_name, _read_receiver, _REASON_CHARS, _slices_record, _summary_record  # noqa: F401
from .vllm_trainer import _owned  # noqa: F401
from .vllm_worker import _end_layer_reload, _log  # noqa: F401

# Every public name this module held before the split, each the same object as where it now
# lives; vLLM's factories resolve the two engines through this module (``register``).
__all__ = [
    "BACKEND",
    "DEFAULT_BUCKET_BYTES",
    "DEFAULT_BUDGET_BYTES",
    "OUTCOME_BYTES",
    "TraceFailed",
    "VersionNotApplied",
    "XferInitInfo",
    "XferTrainerInitInfo",
    "XferTrainerWeightTransferEngine",
    "XferUpdateInfo",
    "XferWeightTransferEngine",
    "decode_outcome",
    "decode_summary",
    "encode_outcome",
    "encode_summary",
    "read_receiver_slices",
    "register",
    "trace_model",
]


def register() -> None:
    """The ``vllm.general_plugins`` entry point: registers ``"xfer"`` with vLLM's worker and
    trainer factories (by module path, as vLLM registers its own). vLLM runs it once per
    process; a second call is a no-op."""
    from vllm.distributed.weight_transfer.factory import WeightTransferEngineFactory, WeightTransferTrainerFactory

    if BACKEND not in WeightTransferEngineFactory._registry:
        WeightTransferEngineFactory.register_engine(BACKEND, __name__, "XferWeightTransferEngine")
    if BACKEND not in WeightTransferTrainerFactory._registry:
        WeightTransferTrainerFactory.register_engine(BACKEND, __name__, "XferTrainerWeightTransferEngine")
