"""xfer weight sync inside SGLang, for RL frameworks that drive SGLang themselves: a custom
weight loader (SGLang's ``--custom-weight-loader``) reached through SGLang's own
``update_weights_from_tensor``, inside a weight-update session (SGLang 0.5.23's scheduler
refuses ``update_weights_from_tensor`` outside ``begin_weight_update()`` /
``end_weight_update()``); ``update`` makes the calls::

    # launch: --custom-weight-loader xfer.sglang_weights.load_version
    #   (Engine(..., custom_weight_loader=["xfer.sglang_weights.load_version"]))
    ok, message = xfer.sglang_weights.update(
        engine, version, rendezvous="xfer://10.0.0.1:7000", group="rl-run-7", senders=8,
        receivers=16, rank_base=0, config="/etc/xfer/verbs.toml")
    # which is:
    #   engine.begin_weight_update()
    #   engine.update_weights_from_tensor(named_tensors=xfer.sglang_weights.request(
    #       version, ..., verdict_follows=True), load_format=xfer.sglang_weights.LOADER,
    #       flush_cache=False)
    #   engine.update_weights_from_tensor(named_tensors=xfer.sglang_weights.verdict(version),
    #       load_format=xfer.sglang_weights.LOADER, flush_cache=flush_cache)  # SGLang's answer
    #   engine.end_weight_update()        # always, also after a failure

SGLang hands the request (one small uint8 tensor of JSON) to ``load_version`` on every
tensor-parallel rank, with the model. The loader joins the group the first time (and
again when the request names another group), receives the version whole into registered
staging (``xfer.engine_weights``), and only after the coordinator commits it loads it through
the model's own ``load_weights`` (fused ``qkv_proj`` / ``gate_up_proj``, this rank's
tensor-parallel slice).

A rank's receiver rank is ``rank_base`` + its place in the instance as SGLang's own parallel
state says (``receiver_rank``): its WORLD rank (``ep_join_rank_offset + pp_rank * tp_size +
tp_rank``: an elastic-EP scale joiner follows the ranks it joined), and with data-parallel
replicas (``dp_size`` > 1), ``dp_rank * tp_size * pp_size`` more (SGLang 0.5.23's tokenizer
manager itself refuses ``update_weights_from_tensor`` with ``dp_size`` > 1: an assertion).
``receivers`` counts every rank of every replica of every instance. A rank SGLang cannot place
is refused (``ReceiverRankError``, recorded as the version's outcome), never given a guess:
two receivers claiming one rank fail the whole version.

How a failure reaches SGLang's answer. SGLang 0.5.23's model runner discards what a custom
loader returns and answers ``(True, "Success")`` after it; an exception from the loader is not
caught by the runner, the scheduler's manager or its dispatcher and ends SGLang's scheduler
process (``run_scheduler_process`` signals the engine to quit). The loader therefore never
raises. The one ``(False, message)`` SGLang's runner gives before touching the model is its
pre-check of every module's ``_derived_weight_cache_error``, made at the start of each
``update_weights_from_tensor``. So ``update`` makes two calls: the first (``flush_cache=False``,
no weight version) receives and, if committed, loads the version; on any failure the loader
arms a verdict module it attached to the model (no parameters, no buffers, never called) whose
``_derived_weight_cache_error`` gives the failure once. The second call (the caller's
``flush_cache`` and ``weight_version``) is SGLang's answer: refused by that pre-check with the
reason, so SGLang answers ``success=False``, records no weight version and flushes nothing; or,
the version loaded, passed to the loader, which finds it loaded, and SGLang records and flushes.
A version that fails to arrive is not loaded: the model keeps its previous weights, and the
trainer's ``FullTensorSender.send`` raises ``VersionFailed`` on every rank (the verdict is one
for the whole group). ``last_outcome()`` in the rank's process says the same.

A version that arrived whole but that the model's own ``load_weights`` refuses part-way (a
tensor of a shape or name the model does not take) is different: the parameters loaded before
the refused tensor hold the new version, the rest the previous one. SGLang answers
``success=False`` with a reason that says the model is a mix, the outcome says so
(``loaded: False, model_changed: True``), and the trainer's ``send`` succeeded (the transfer
did): the framework must send a complete version before serving from it.

A framework that calls ``update_weights_from_tensor`` once with ``request(version, ...)`` (no
``verdict_follows``) gets the loading but SGLang's ``success=True`` whatever happened (the
outcome is then only in ``last_outcome()`` and the trainer's verdict).
"""

from __future__ import annotations

import json
import logging
from typing import Any

from .engines import StagedReceiver

__all__ = ["LOADER", "ReceiverRankError", "request", "verdict", "update", "load_version", "receiver_rank",
           "last_outcome", "close"]

LOADER = "xfer.sglang_weights.load_version"
REQUEST_NAME = "xfer.weights.request"
# The verdict module's name in SGLang's model (an attribute of the model's root module).
VERDICT_MODULE = "xfer_weight_verdict"

_log = logging.getLogger(__name__)
_receiver: StagedReceiver | None = None
_membership: str | None = None
_outcome: dict[str, Any] | None = None


def request(
    version: int,
    *,
    rendezvous: str,
    group: str,
    receivers: int,
    senders: int = 1,
    rank_base: int = 0,
    config: str | dict[str, Any] | None = None,
    timeout: float = 300.0,
    grace: float | None = None,
    device: Any = "cpu",
    verdict_follows: bool = False,
) -> list[tuple[str, Any]]:
    """The ``named_tensors`` to pass to SGLang's ``update_weights_from_tensor`` (with
    ``load_format=LOADER``) so that every rank receives ``version`` from ``group``: one uint8
    tensor of JSON (SGLang's unpickler admits tensors only).

    ``verdict_follows``: the caller sends ``verdict(version)`` next in the same session, and a
    failure of this version is SGLang's answer to that call (see the module's documentation).

    ``config``: the xfer engine config each SGLang rank builds its engine from (a TOML path
    or a dict); ``None``: the rank's ``$XFER_CONFIG``, and with neither the rank refuses the
    version (its outcome names the missing config), never the in-process mock.

    ``device``: where the tensor is made. A process that applied SGLang's patched tensor
    pickling (``monkey_patch_torch_reductions``, which SGLang's own
    ``weight_sync.utils.update_weights`` applies) can pickle only CUDA tensors: pass
    ``device="cuda"`` there."""
    import torch

    raw = json.dumps({
        "version": int(version), "rendezvous": rendezvous, "group": group, "receivers": int(receivers),
        "senders": int(senders), "rank_base": int(rank_base), "config": config, "timeout": float(timeout),
        "grace": grace, "verdict_follows": bool(verdict_follows),
    }).encode()
    return [(REQUEST_NAME, torch.frombuffer(bytearray(raw), dtype=torch.uint8).to(device))]


def verdict(version: int, *, device: Any = "cpu") -> list[tuple[str, Any]]:
    """The ``named_tensors`` of the call after ``request(version, ..., verdict_follows=True)``:
    SGLang answers it ``success=False`` with the reason when the version was not loaded whole."""
    import torch

    raw = json.dumps({"verdict": int(version)}).encode()
    return [(REQUEST_NAME, torch.frombuffer(bytearray(raw), dtype=torch.uint8).to(device))]


def update(engine: Any, version: int, *, flush_cache: bool = True, weight_version: str | None = None,
           **membership: Any) -> tuple[bool, str]:
    """Receives ``version`` into SGLang ``engine`` (an ``sglang.Engine``) through its
    weight-update session: ``begin_weight_update``, ``update_weights_from_tensor`` with this
    loader and ``request(version, **membership, verdict_follows=True)``, then with
    ``verdict(version)``, then ``end_weight_update`` — always, so a failed update leaves no
    session open. Returns SGLang's ``(success, message)``: ``False`` with xfer's reason when the
    version was not loaded whole (SGLang then records no weight version and flushes nothing).
    ``weight_version``: passed to SGLang's second call where the engine takes it (SGLang's HTTP
    engine and route; ``sglang.Engine`` 0.5.23 does not)."""
    began = engine.begin_weight_update()
    ok, message = (began[0], began[1]) if isinstance(began, tuple) else (True, "")
    if not ok:
        raise RuntimeError(f"SGLang refused to open a weight-update session: {message}")
    try:
        loaded = engine.update_weights_from_tensor(
            named_tensors=request(version, **membership, verdict_follows=True), load_format=LOADER,
            flush_cache=False)
        if not loaded[0]:
            return loaded  # SGLang refused it before the loader ran: nothing is pending
        extra = {} if weight_version is None else {"weight_version": weight_version}
        return engine.update_weights_from_tensor(
            named_tensors=verdict(version), load_format=LOADER, flush_cache=flush_cache, **extra)
    finally:
        engine.end_weight_update()


_FIELDS = ("version", "rendezvous", "group", "receivers", "senders", "rank_base", "config", "timeout", "grace")


def _parse(named_tensors: Any) -> dict[str, Any]:
    items = list(named_tensors)
    if len(items) != 1 or items[0][0] != REQUEST_NAME:
        names = [n for n, _ in items][:4]
        raise ValueError(f"{LOADER} takes what xfer.sglang_weights.request() makes, not tensors named {names}")
    req = json.loads(items[0][1].detach().cpu().numpy().tobytes())
    if not isinstance(req, dict):
        raise ValueError(f"{LOADER}: the request is not a JSON object")
    if set(req) == {"verdict"}:
        return req
    missing = [k for k in _FIELDS if k not in req]
    if missing:
        raise ValueError(f"{LOADER}: the request lacks {missing}")
    return req


class ReceiverRankError(RuntimeError):
    """SGLang's parallel state does not say where this process is, so its receiver rank is
    unknown (a guess would give two receivers one rank)."""


def receiver_rank(rank_base: int) -> int:
    """This process's receiver rank (see the module's documentation), from SGLang's parallel
    state; ``ReceiverRankError`` names what it lacks."""
    try:
        from sglang.srt.runtime_context import get_parallel
    except ImportError as e:
        raise ReceiverRankError(
            f"{LOADER} cannot tell this rank's receiver rank: this SGLang has no parallel state "
            f"(sglang.srt.runtime_context, SGLang 0.5.23 has it): {e}") from e
    p = get_parallel()
    try:
        tp_size, tp_rank = int(p.tp_size), int(p.tp_rank)
        pp_size, pp_rank = int(p.pp_size), int(p.pp_rank)
        offset, dp_size = int(p.ep_join_rank_offset), int(p.dp_size)
        dp_rank = p.dp_rank if dp_size > 1 else 0
    except (RuntimeError, ValueError, AttributeError) as e:
        raise ReceiverRankError(f"{LOADER} cannot tell this rank's receiver rank from SGLang's "
                                f"parallel state: {e}") from e
    if dp_rank is None:
        raise ReceiverRankError(
            f"{LOADER} cannot tell this rank's receiver rank: SGLang runs {dp_size} data-parallel "
            "replicas, and this process has no data-parallel rank (no controller numbered it)")
    if dp_size > 1 and offset:
        raise ReceiverRankError(
            f"{LOADER} cannot tell this rank's receiver rank: an elastic-EP scale joiner "
            f"(ep_join_rank_offset {offset}) among {dp_size} data-parallel replicas has no "
            "single numbering")
    return rank_base + int(dp_rank) * tp_size * pp_size + offset + pp_rank * tp_size + tp_rank


def _verdict_module(model: Any) -> Any:
    """The model's verdict module, attached the first time: SGLang's runner reads every module's
    ``_derived_weight_cache_error`` before it calls a loader and answers ``(False, reason)`` for
    the first that is not None."""
    import torch

    class Verdict(torch.nn.Module):
        """No parameters, no buffers, no forward: holds a failed version's reason until SGLang's
        next pre-check reads it (once)."""

        def __init__(self) -> None:
            super().__init__()
            self.pending: str | None = None

        @property
        def _derived_weight_cache_error(self) -> str | None:
            reason, self.pending = self.pending, None
            return reason

    found = model._modules.get(VERDICT_MODULE)
    if found is None:
        found = Verdict()
        model.add_module(VERDICT_MODULE, found)
    return found


def load_version(model: Any, named_tensors: Any) -> None:
    """SGLang's custom weight loader: receives the requested version and loads it into
    ``model``, or answers the verdict call that follows (see the module's documentation)."""
    global _outcome
    try:
        req = _parse(named_tensors)
    except Exception as e:  # noqa: BLE001 - raising here would end SGLang's scheduler process
        _outcome = {"version": None, "loaded": False, "model_changed": False, "reason": str(e)}
        _log.error("xfer: a weight request not understood (nothing loaded): %s", e)
        return
    if "verdict" in req:
        # SGLang's pre-check found nothing pending: this rank loaded the version whole.
        if _outcome is None or _outcome.get("version") != req["verdict"] or not _outcome["loaded"]:
            _log.error("xfer: SGLang is told weight version %s loaded, but this rank's last outcome is %s "
                       "(another update between the two calls took its verdict)", req["verdict"], _outcome)
        return
    _load(model, req)
    if req.get("verdict_follows") and _outcome is not None and not _outcome["loaded"]:
        _verdict_module(model).pending = _outcome["reason"]


def _load(model: Any, req: dict[str, Any]) -> None:
    global _receiver, _membership, _outcome
    version = req["version"]
    try:
        membership = json.dumps({k: v for k, v in req.items() if k not in ("version", "verdict_follows")},
                                sort_keys=True)
        if membership != _membership:
            close()
            _receiver = StagedReceiver(
                rendezvous=req["rendezvous"], group=req["group"], rank=receiver_rank(req["rank_base"]),
                receivers=req["receivers"], senders=req["senders"], config=req["config"],
                timeout=req["timeout"], grace=req["grace"], who=LOADER,
            )
            _membership = membership
        assert _receiver is not None
        tensors = _receiver.receive(version)
    except Exception as e:  # noqa: BLE001 - raising here would end SGLang's scheduler process
        # Nothing was loaded: the model keeps the previous version.
        reason = f"xfer weight version {version} not loaded (the model keeps its previous weights): {e}"
        _outcome = {"version": version, "loaded": False, "model_changed": False, "reason": reason}
        _log.error("%s", reason)
        return
    try:
        model.load_weights(iter(tensors))
    except Exception as e:  # noqa: BLE001 - raising here would end SGLang's scheduler process
        # The tensors before the refused one are in the model: it is a mix of two versions.
        reason = (f"xfer weight version {version} only partly loaded: the model's load_weights failed part-way "
                  f"({type(e).__name__}: {e}); the model holds a mix of versions until one loads whole")
        _outcome = {"version": version, "loaded": False, "model_changed": True, "reason": reason}
        _log.error("%s", reason)
        return
    _outcome = {"version": version, "loaded": True, "tensors": len(tensors)}


def last_outcome() -> dict[str, Any] | None:
    """This process's last request: ``{"version", "loaded": True, "tensors"}``, or
    ``{"version", "loaded": False, "model_changed", "reason"}`` (``model_changed``: the model's
    ``load_weights`` failed part-way, see the module's documentation)."""
    return _outcome


def close() -> None:
    """Leaves the group and frees the staging memory of this process (idempotent)."""
    global _receiver, _membership
    if _receiver is not None:
        r, _receiver, _membership = _receiver, None, None
        r.close()
