"""A request's ``kv_transfer_params`` as untrusted input (pure: no framework import).

vLLM takes them from the request body: any API client of a decode instance can send them. They
are parsed once, when the scheduler first looks at the request
(``get_num_new_matched_tokens``), into a :class:`RemotePrefill` whose every field is typed and
bounded — a tensor-parallel size the connector supports, block ids a prompt of that length can
have, a rendezvous this instance was configured to use, the prefill's token — or refused with
:class:`ParamsError` naming the field. A refused set fails nothing but that request (the
connector computes it locally, see ``xfer.kv.vllm``); it never reaches a lookup or a read.
"""

from __future__ import annotations

import dataclasses
import re
from collections.abc import Collection, Mapping
from typing import Any

from .control import is_token

MAX_TP = 64
"""The largest tensor-parallel size a peer may claim (one lookup and one message per rank)."""
MAX_ID = 512
"""The longest engine or request id taken from a request."""
MAX_BLOCK_ID = (1 << 31) - 1
"""Block ids travel as int32."""

_ID = re.compile(r"[\x21-\x7e]+")
_SIDE_CHANNEL = re.compile(r"xfer://([A-Za-z0-9.\-]+|\[[0-9A-Fa-f:.]+\]):([0-9]{1,5})")


class ParamsError(ValueError):
    """``kv_transfer_params`` that this connector will not act on; says which field."""


@dataclasses.dataclass(frozen=True)
class RemotePrefill:
    """A decode request's prefill, as its parameters name it (pull, or push)."""

    engine_id: str
    request_id: str
    tp_size: int
    block_ids: list[list[int]]
    """Per KV cache group (pull); empty for push (the decoder sends its own)."""
    rendezvous: str | None
    token: str
    """The prefill's random token for this request: every control message carries it."""
    push: bool
    model: str
    lease_s: float | None = None
    """The prefill's lease on the blocks (``xfer_lease_s``): a waiting decode renews it more
    often than that."""


def _text(params: Mapping[str, Any], name: str, limit: int = MAX_ID) -> str:
    value = params.get(name)
    if not isinstance(value, str) or not 0 < len(value) <= limit or not _ID.fullmatch(value):
        raise ParamsError(f"{name} must be a printable string of 1 to {limit} characters")
    return value


def _int(params: Mapping[str, Any], name: str, low: int, high: int, default: int | None = None) -> int:
    value = params.get(name, default)
    if not isinstance(value, int) or isinstance(value, bool) or not low <= value <= high:
        raise ParamsError(f"{name} must be an integer in [{low}, {high}], not {value!r:.40}")
    return value


def allowed_rendezvous(value: object, allowed: Collection[str], any_side_channel: bool) -> str | None:
    """``remote_rendezvous``: None (the shared rendezvous), one of ``allowed``, or — where the
    operator allowed any side channel — an ``xfer://host:port``. Never another scheme (an
    ``etcd://`` from a request body would have the instance dial whatever it names)."""
    if value is None:
        return None
    if not isinstance(value, str) or len(value) > 300:
        raise ParamsError("remote_rendezvous must be a URL string")
    if value in allowed:
        return value
    if any_side_channel and _SIDE_CHANNEL.fullmatch(value) and int(value.rsplit(":", 1)[1]) < 65536:
        return value
    raise ParamsError(f"remote_rendezvous {value[:80]!r} is not one this instance was configured "
                      "to use (kv_connector_extra_config 'rendezvous' or 'peer_side_channels')")


def parse_remote_prefill(params: Mapping[str, Any], *, prompt_tokens: int, block_size: int,
                         local_tp: int, groups: int, allowed: Collection[str],
                         any_side_channel: bool = False,
                         protocol: int | None = None) -> RemotePrefill:
    """The prefill a decode request's ``params`` name (``do_remote_prefill`` set), or
    :class:`ParamsError`. ``prompt_tokens`` and ``block_size`` bound the block ids (a prompt
    has at most ``ceil(prompt_tokens / block_size)`` blocks per group; one more for the token a
    prefill may have computed past it); ``local_tp`` and the peer's must divide one another;
    ``groups``: the KV cache groups this instance moves; ``allowed``: the rendezvous URLs this
    instance may dial."""
    if not isinstance(params, Mapping):
        raise ParamsError("kv_transfer_params must be an object")
    if protocol is not None and params.get("xfer_protocol", protocol) != protocol:
        raise ParamsError(f"xfer_protocol {params.get('xfer_protocol')!r:.20} is not this "
                          f"connector's ({protocol}): the instances run different xfer versions")
    push = params.get("xfer_push", False)
    if not isinstance(push, bool):
        raise ParamsError("xfer_push must be true or false")
    engine_id = _text(params, "remote_engine_id")
    request_id = _text(params, "remote_request_id")
    tp = _int(params, "remote_tp_size", 1, MAX_TP, 1)
    if max(tp, local_tp) % min(tp, local_tp):
        raise ParamsError(f"remote_tp_size {tp} and this instance's {local_tp}: one must divide "
                          "the other")
    token = params.get("xfer_token")
    if not is_token(token):
        raise ParamsError("xfer_token must be the prefill's request token (32 hex digits)")
    model = params.get("remote_model", "")
    if not isinstance(model, str) or len(model) > 1024:
        raise ParamsError("remote_model must be a string")
    rendezvous = allowed_rendezvous(params.get("remote_rendezvous"), allowed, any_side_channel)
    block_ids: list[list[int]] = []
    if not push:
        raw = params.get("remote_block_ids")
        if not isinstance(raw, list) or not raw:
            raise ParamsError("remote_block_ids must be a list of block id lists (one per KV "
                              "cache group)")
        if len(raw) != groups:
            raise ParamsError(f"remote_block_ids has {len(raw)} KV cache groups, this instance "
                              f"moves {groups} (vLLM's hybrid allocator on one side only?)")
        most = -(-(max(prompt_tokens, 0) + 1) // max(block_size, 1))
        for ids in raw:
            if not isinstance(ids, list) or len(ids) > most:
                raise ParamsError(f"remote_block_ids: a group of more than {most} blocks for a "
                                  f"prompt of {prompt_tokens} tokens")
            for b in ids:
                if not isinstance(b, int) or isinstance(b, bool) or not 0 <= b <= MAX_BLOCK_ID:
                    raise ParamsError("remote_block_ids must be block ids (integers in "
                                      f"[0, {MAX_BLOCK_ID}])")
            if len(set(ids)) != len(ids):
                raise ParamsError("remote_block_ids: a block named twice")
            block_ids.append(list(ids))
    lease = params.get("xfer_lease_s")
    if lease is not None and (isinstance(lease, bool) or not isinstance(lease, (int, float))
                              or not 0.01 <= lease <= 86400):
        raise ParamsError("xfer_lease_s must be a number of seconds in [0.01, 86400]")
    return RemotePrefill(engine_id, request_id, tp, block_ids, rendezvous, token, push, model,
                         None if lease is None else float(lease))
