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
no ``reload_weights``.

It never raises for a version: it returns the worker's outcome (``version``, ``rank``,
``applied``, ``committed``, ``reason``, ``tensors``, ``bytes``; also kept as
``_xfer_weights_outcome``), and ``applied_everywhere(outcomes)`` turns the list
``collective_rpc`` answers into the error by name. A worker that raised would poison the instance: vLLM's multiprocess executor
answers a call with the first worker's failure and leaves the other workers' answers queued
(without ``enable_fault_tolerance``), so every later ``collective_rpc`` reads the previous
call's answer. A version that failed (``committed`` false) is loaded nowhere: the model keeps
its previous weights. One whose load failed after the commit (``committed`` true) leaves
that worker's layers processed before the failure at the new version and the rest at the
previous one (vLLM's reload is ended where it stood) until a version applies whole (every
version carries every tensor). vLLM's weight-transfer API backend (``xfer.weights.vllm_engine``) does the
same with its ``last_outcome``; this extension stays for frameworks that drive workers by
``collective_rpc`` with their own trainer (``FullTensorSender``), which the API's trainer
engine (vLLM's ``WeightSource``) does not serve.

The methods run on vLLM's worker, so ``self`` is the worker; vLLM refuses an extension whose
attribute names the worker class already has, hence the ``xfer_weights_`` prefix, and the
state is one attribute, ``_xfer_weights``.
"""

from __future__ import annotations

import logging
from typing import Any

from .engines import StagedReceiver
from .executor import VersionFailed

__all__ = ["WorkerRankError", "XferWeightsExtension", "applied_everywhere", "receiver_rank"]


_log = logging.getLogger(__name__)


class WorkerRankError(RuntimeError):
    """The object the extension runs on has no integer ``rank`` (vLLM's workers have one), so
    its receiver rank is unknown (a guess would give two receivers one rank)."""


def applied_everywhere(outcomes: list[dict[str, Any]]) -> dict[str, Any]:
    """The answer of ``collective_rpc("xfer_weights_receive", args=(v,))`` (one outcome per
    worker) checked: returns the first worker's outcome when every worker applied the
    version; raises ``VersionFailed`` when the version failed (loaded nowhere), and
    ``xfer.weights.vllm_engine.VersionNotApplied`` naming each receiver rank that could not
    load a committed one (as vLLM's weight-transfer API backend does)."""
    if not outcomes:
        raise ValueError("applied_everywhere: no outcome (collective_rpc reached no worker)")
    versions = {o["version"] for o in outcomes}
    if len(versions) != 1:
        raise RuntimeError(f"applied_everywhere: the workers answered for different versions {sorted(versions)}")
    (version,) = versions
    failed = [o for o in outcomes if not o["applied"]]
    if not failed:
        return outcomes[0]
    if not any(o["committed"] for o in outcomes):
        raise VersionFailed(version, failed[0]["reason"].removeprefix(f"weight version {version} failed: "))
    from .vllm_engine import VersionNotApplied

    raise VersionNotApplied(version, {o["rank"]: o["reason"] for o in failed})


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

    def xfer_weights_receive(self, version: int) -> dict[str, Any]:
        """Receives ``version`` and loads it into the model; returns this worker's outcome:
        ``version``, ``rank`` (this worker's receiver rank), ``applied``, ``committed`` (the
        coordinator committed it on every rank), ``reason`` (empty when applied), ``tensors``
        and ``bytes`` loaded. Never raises for a version (see the module's documentation;
        ``applied_everywhere`` checks the answers)."""
        receiver: StagedReceiver | None = getattr(self, "_xfer_weights", None)
        if receiver is None:
            # A caller's mistake, the same on every worker (each answers it, none is left queued).
            raise RuntimeError("xfer_weights_receive before xfer_weights_init on this worker")
        try:
            tensors = receiver.receive(version)
        except Exception as e:  # noqa: BLE001 - answered as the outcome (a peer's bad message, a closed receiver)
            reason = str(e) if isinstance(e, VersionFailed) else f"{type(e).__name__}: {e}"
            return XferWeightsExtension._xfer_weights_record(self, version, committed=False, reason=reason)
        try:
            reload = getattr(self, "reload_weights", None)
            if callable(reload):
                reload(weights_iterator=iter(tensors))
            else:
                self.model_runner.model.load_weights(iter(tensors))
        except Exception as e:  # noqa: BLE001 - answered as the outcome, never raised through vLLM's executor
            reason = f"loading the committed version failed: {type(e).__name__}: {e}"
            if callable(reload):
                try:
                    XferWeightsExtension._xfer_weights_end_reload(self)
                except Exception as end:  # noqa: BLE001 - said in the outcome
                    reason += f"; ending vLLM's reload failed too: {type(end).__name__}: {end}"
            return XferWeightsExtension._xfer_weights_record(self, version, committed=True, reason=reason)
        return XferWeightsExtension._xfer_weights_record(
            self, version, committed=True, reason="", tensors=len(tensors),
            nbytes=sum(t.numel() * t.element_size() for _, t in tensors))

    def _xfer_weights_record(self, version: int, *, committed: bool, reason: str, tensors: int = 0,
                             nbytes: int = 0) -> dict[str, Any]:
        rank = getattr(getattr(self._xfer_weights, "receiver", None), "rank", None)
        outcome = {"version": version, "rank": rank, "applied": not reason,
                   "committed": committed, "reason": reason, "tensors": tensors, "bytes": nbytes}
        self._xfer_weights_outcome = outcome
        if reason:
            _log.error("xfer_weights_receive: %s", reason if committed else f"{reason}; the model keeps its weights")
        return outcome

    def _xfer_weights_end_reload(self) -> None:
        """After a load that raised inside vLLM's in-place reload (``reload_weights`` does not
        end it then): every layer still being reloaded gets its kernel tensors back (the
        previous version) instead of staying on the meta device with wrapped loaders, so the
        next version's reload starts every layer afresh. Layers processed before the failure
        keep the new version."""
        from vllm.model_executor.model_loader.reload.layerwise import LOADING_LAYERS

        from .vllm_worker import end_reloads

        end_reloads(self.get_model() if callable(getattr(self, "get_model", None)) else self.model_runner.model)
        LOADING_LAYERS.clear()

    def xfer_weights_close(self) -> None:
        """Leaves the group and frees the staging memory (idempotent)."""
        receiver: StagedReceiver | None = getattr(self, "_xfer_weights", None)
        if receiver is not None:
            self._xfer_weights = None
            receiver.close()

    def destroy_worker_extension(self) -> None:
        """vLLM's shutdown hook for worker extensions (called with the worker)."""
        XferWeightsExtension.xfer_weights_close(self)
