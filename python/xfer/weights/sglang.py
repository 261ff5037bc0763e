"""xfer weight sync inside SGLang, for RL frameworks that drive SGLang themselves: a custom
weight loader (SGLang's ``--custom-weight-loader``) reached through SGLang's own
``update_weights_from_tensor``, inside a weight-update session (SGLang 0.5.23's scheduler
refuses ``update_weights_from_tensor`` outside ``begin_weight_update()`` /
``end_weight_update()``); ``update`` makes the three calls::

    # launch: --custom-weight-loader xfer.sglang_weights.load_version
    #   (Engine(..., custom_weight_loader=["xfer.sglang_weights.load_version"]))
    ok, message = xfer.sglang_weights.update(
        engine, version, rendezvous="xfer://10.0.0.1:7000", group="rl-run-7", senders=8,
        receivers=16, rank_base=0, config="/etc/xfer/verbs.toml")
    # which is:
    #   engine.begin_weight_update()
    #   engine.update_weights_from_tensor(named_tensors=xfer.sglang_weights.request(version, ...),
    #                                     load_format=xfer.sglang_weights.LOADER)
    #   engine.end_weight_update()        # always, also after a failure

SGLang hands the request (one small uint8 tensor of JSON) to ``load_version`` on every
tensor-parallel rank, with the model. The loader joins the group the first time (and
again when the request names another group), receives the version whole into registered
staging (``xfer.engine_weights``) and only then loads it through the model's own
``load_weights`` (fused ``qkv_proj`` / ``gate_up_proj``, this rank's tensor-parallel slice).

A rank's receiver rank is ``rank_base`` + its place in the instance as SGLang's own parallel
state says (``receiver_rank``): its WORLD rank (``ep_join_rank_offset + pp_rank * tp_size +
tp_rank``: an elastic-EP scale joiner follows the ranks it joined), and with data-parallel
replicas (``dp_size`` > 1), ``dp_rank * tp_size * pp_size`` more (SGLang 0.5.23's tokenizer
manager itself refuses ``update_weights_from_tensor`` with ``dp_size`` > 1: an assertion).
``receivers`` counts every rank of every replica of every instance. A rank SGLang cannot place
is refused (``ReceiverRankError``, recorded as the version's outcome), never given a guess:
two receivers claiming one rank fail the whole version.

A version that fails to arrive is not loaded: the model keeps its previous weights. The
loader never raises — an exception in a custom loader ends SGLang's scheduler process — but
logs the failure and records it (``last_outcome()`` in that process); the framework learns the
verdict from its trainer side, where ``FullTensorSender.send`` raises ``VersionFailed`` on
every rank when any rank failed (the verdict is one for the whole group).

A version that arrived whole but that the model's own ``load_weights`` refuses part-way (a
tensor of a shape or name the model does not take) is different: the parameters loaded before
the refused tensor hold the new version, the rest the previous one. The outcome says so
(``loaded: False, model_changed: True``) and the trainer's ``send`` succeeded (the transfer
did): the model is a mix until a version loads whole, so the framework must check
``last_outcome()`` on each rank (SGLang reports the update itself a success) and send a
complete version before serving from it.
"""

from __future__ import annotations

import json
import logging
from typing import Any

from .engines import StagedReceiver

__all__ = ["LOADER", "ReceiverRankError", "request", "update", "load_version", "receiver_rank", "last_outcome",
           "close"]

LOADER = "xfer.sglang_weights.load_version"
REQUEST_NAME = "xfer.weights.request"

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
) -> list[tuple[str, Any]]:
    """The ``named_tensors`` to pass to SGLang's ``update_weights_from_tensor`` (with
    ``load_format=LOADER``) so that every rank receives ``version`` from ``group``: one uint8
    tensor of JSON (SGLang's unpickler admits tensors only).

    ``device``: where the tensor is made. A process that applied SGLang's patched tensor
    pickling (``monkey_patch_torch_reductions``, which SGLang's own
    ``weight_sync.utils.update_weights`` applies) can pickle only CUDA tensors: pass
    ``device="cuda"`` there."""
    import torch

    raw = json.dumps({
        "version": int(version), "rendezvous": rendezvous, "group": group, "receivers": int(receivers),
        "senders": int(senders), "rank_base": int(rank_base), "config": config, "timeout": float(timeout),
        "grace": grace,
    }).encode()
    return [(REQUEST_NAME, torch.frombuffer(bytearray(raw), dtype=torch.uint8).to(device))]


def update(engine: Any, version: int, *, flush_cache: bool = True, **membership: Any) -> tuple[bool, str]:
    """Receives ``version`` into SGLang ``engine`` (an ``sglang.Engine``) through its
    weight-update session: ``begin_weight_update``, ``update_weights_from_tensor`` with this
    loader and ``request(version, **membership)``, then ``end_weight_update`` — always, so a
    failed update leaves no session open. Returns SGLang's ``(success, message)`` of the
    update; whether the version itself was loaded is the trainer's verdict (and
    ``last_outcome()`` on each rank)."""
    began = engine.begin_weight_update()
    ok, message = (began[0], began[1]) if isinstance(began, tuple) else (True, "")
    if not ok:
        raise RuntimeError(f"SGLang refused to open a weight-update session: {message}")
    try:
        result = engine.update_weights_from_tensor(
            named_tensors=request(version, **membership), load_format=LOADER, flush_cache=flush_cache)
    finally:
        engine.end_weight_update()
    return result


_FIELDS = ("version", "rendezvous", "group", "receivers", "senders", "rank_base", "config", "timeout", "grace")


def _parse(named_tensors: Any) -> dict[str, Any]:
    items = list(named_tensors)
    if len(items) != 1 or items[0][0] != REQUEST_NAME:
        names = [n for n, _ in items][:4]
        raise ValueError(f"{LOADER} takes what xfer.sglang_weights.request() makes, not tensors named {names}")
    req = json.loads(items[0][1].detach().cpu().numpy().tobytes())
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


def load_version(model: Any, named_tensors: Any) -> None:
    """SGLang's custom weight loader: receives the requested version and loads it into
    ``model`` (see the module's documentation)."""
    global _receiver, _membership, _outcome
    version = None
    try:
        req = _parse(named_tensors)
        version = req["version"]
        membership = json.dumps({k: v for k, v in req.items() if k != "version"}, sort_keys=True)
        if membership != _membership:
            close()
            _receiver = StagedReceiver(
                rendezvous=req["rendezvous"], group=req["group"], rank=receiver_rank(req["rank_base"]),
                receivers=req["receivers"], senders=req["senders"], config=req["config"],
                timeout=req["timeout"], grace=req["grace"],
            )
            _membership = membership
        assert _receiver is not None
        tensors = _receiver.receive(version)
    except Exception as e:  # noqa: BLE001 - raising here would end SGLang's scheduler process
        # Nothing was loaded: the model keeps the previous version.
        _outcome = {"version": version, "loaded": False, "model_changed": False, "reason": str(e)}
        _log.error("xfer: weight version %s not loaded (the model keeps its previous weights): %s", version, e)
        return
    try:
        model.load_weights(iter(tensors))
    except Exception as e:  # noqa: BLE001 - raising here would end SGLang's scheduler process
        # The tensors before the refused one are in the model: it is a mix of two versions.
        _outcome = {"version": version, "loaded": False, "model_changed": True,
                    "reason": f"the model's load_weights failed part-way: {type(e).__name__}: {e}"}
        _log.error("xfer: weight version %s only partly loaded (the model's load_weights failed part-way; "
                   "it holds a mix of versions until one loads whole): %s: %s", version, type(e).__name__, e)
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
