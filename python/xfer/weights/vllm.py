"""xfer weight sync inside vLLM: a worker extension for RL frameworks that drive vLLM
themselves. vLLM mixes it into each of its workers (``--worker-extension-cls`` /
``LLM(worker_extension_cls=...)``) and the framework calls its methods on every worker
through ``collective_rpc``::

    llm = LLM(model, worker_extension_cls="xfer.vllm_weights.XferWeightsExtension", ...)
    llm.collective_rpc("xfer_weights_init", kwargs=dict(
        rendezvous="xfer://10.0.0.1:7000", group="rl-run-7", senders=8, receivers=16,
        rank_base=0, config="/etc/xfer/verbs.toml"))
    # each step, while the trainer ranks send version v (xfer.engine_weights.FullTensorSender):
    llm.collective_rpc("xfer_weights_receive", args=(v,))

A worker's receiver rank is ``rank_base`` plus its place in the instance
(``receiver_rank``): its rank in its engine (tensor × pipeline parallel; an object without one
is refused, ``WorkerRankError``) plus, with data parallelism, ``data_parallel_index ×
world_size`` — vLLM numbers each DP engine's workers from 0 again, so without it the DP
replicas' workers would claim the same receiver ranks (with ``external_launcher`` the worker's
rank is already the global one). An RL job with several vLLM instances gives each its own
``rank_base``, and ``receivers`` counts every worker of every replica of every instance.

``xfer_weights_receive`` receives the version whole into registered staging (see
``xfer.engine_weights``) and only then loads it through the worker's ``reload_weights``
(vLLM's in-place reload: the model's own ``load_weights`` mapping — fused ``qkv_proj`` and
``gate_up_proj``, this worker's tensor-parallel slice — inside its layerwise reload, which
re-runs quantized layers' post-processing), or ``model.load_weights`` where the worker has
no ``reload_weights``. A version that fails raises ``xfer.weights.VersionFailed`` from
``collective_rpc`` before anything is loaded: the model keeps its previous weights.

The methods run on vLLM's worker, so ``self`` is the worker; vLLM refuses an extension whose
attribute names the worker class already has, hence the ``xfer_weights_`` prefix, and the
state is one attribute, ``_xfer_weights``.
"""

from __future__ import annotations

from typing import Any

from .engines import StagedReceiver

__all__ = ["WorkerRankError", "XferWeightsExtension", "receiver_rank"]


class WorkerRankError(RuntimeError):
    """The object the extension runs on has no integer ``rank`` (vLLM's workers have one), so
    its receiver rank is unknown (a guess would give two receivers one rank)."""


def receiver_rank(rank_base: int, worker_rank: int, parallel_config: Any | None) -> int:
    """A worker's receiver rank from vLLM's ``ParallelConfig`` (see the module's documentation)."""
    if parallel_config is None or getattr(parallel_config, "distributed_executor_backend", None) == "external_launcher":
        return rank_base + worker_rank
    dp_index = getattr(parallel_config, "data_parallel_index", None)
    if dp_index is None:
        dp_index = getattr(parallel_config, "data_parallel_rank", 0)
    return rank_base + int(dp_index) * int(parallel_config.world_size) + worker_rank


class XferWeightsExtension:
    """vLLM worker extension (``worker_extension_cls``): receive a version into the model."""

    def xfer_weights_init(
        self,
        *,
        rendezvous: str,
        group: str,
        receivers: int,
        senders: int = 1,
        rank_base: int = 0,
        config: str | dict[str, Any] | None = None,
        timeout: float = 300.0,
        grace: float | None = None,
    ) -> int:
        """Joins ``group`` as receiver ``rank_base + <this worker's rank>`` (returned); a
        second call replaces the previous membership. ``config``: the xfer engine config (a
        TOML path or a dict), else ``$XFER_CONFIG``; with neither, refused (``ValueError``)."""
        worker_rank = getattr(self, "rank", None)
        if not isinstance(worker_rank, int) or isinstance(worker_rank, bool):
            raise WorkerRankError(
                f"xfer_weights_init: the worker ({type(self).__name__}) has no rank "
                f"(rank={worker_rank!r}); the extension runs on vLLM's workers, which number "
                "themselves in the engine")
        XferWeightsExtension.xfer_weights_close(self)
        rank = receiver_rank(rank_base, worker_rank, getattr(self, "parallel_config", None))
        self._xfer_weights = StagedReceiver(
            rendezvous=rendezvous, group=group, rank=rank, receivers=receivers, senders=senders,
            config=config, timeout=timeout, grace=grace, who="xfer_weights_init",
        )
        return rank

    def xfer_weights_receive(self, version: int) -> dict[str, int]:
        """Receives ``version`` and loads it into the model; returns what was loaded
        (``version``, ``tensors``, ``bytes``). Raises ``VersionFailed`` with the model
        untouched when the version did not complete on every rank."""
        receiver: StagedReceiver | None = getattr(self, "_xfer_weights", None)
        if receiver is None:
            raise RuntimeError("xfer_weights_receive before xfer_weights_init on this worker")
        tensors = receiver.receive(version)
        reload = getattr(self, "reload_weights", None)
        if callable(reload):
            reload(weights_iterator=iter(tensors))
        else:
            self.model_runner.model.load_weights(iter(tensors))
        return {
            "version": version,
            "tensors": len(tensors),
            "bytes": sum(t.numel() * t.element_size() for _, t in tensors),
        }

    def xfer_weights_close(self) -> None:
        """Leaves the group and frees the staging memory (idempotent)."""
        receiver: StagedReceiver | None = getattr(self, "_xfer_weights", None)
        if receiver is not None:
            self._xfer_weights = None
            receiver.close()

    def destroy_worker_extension(self) -> None:
        """vLLM's shutdown hook for worker extensions (called with the worker)."""
        XferWeightsExtension.xfer_weights_close(self)
