"""What both halves of the vLLM connector pass around — the pull half and the connector itself
in ``xfer.kv.vllm``, the push half in ``xfer.kv.vllm_push``: a load (a request's blocks a decode rank
receives, and where from) and a peer worker as its record describes it. Kept apart so that
neither of those modules imports the other's types."""

from __future__ import annotations

import dataclasses

import xfer

from .pages import LayerView


@dataclasses.dataclass
class Load:
    """A request whose blocks a decode worker reads from its prefill instance (pull), or
    that the prefill instance writes to it (push)."""

    local_block_ids: list[list[int]]
    """Per KV cache group this connector moves (one unless vLLM's hybrid allocator is on)."""
    remote_engine_id: str
    remote_block_ids: list[list[int]]
    remote_request_id: str
    remote_tp_size: int = 1
    remote_rendezvous: str | None = None
    """Where the peer's records are, when it serves them itself (its side channel)."""
    token: str = ""
    """The prefill's random token for the request (its parameters'): every control message
    about it carries it, and the prefill acts on none without it."""
    local_request_id: str = ""
    """This decode instance's request id: with its engine id, who reads (a second reader of
    the same prefill request is refused)."""


@dataclasses.dataclass
class Peer:
    """Another instance's worker as its record describes it."""

    address: bytes
    layers: dict[str, tuple[xfer.MrDesc, LayerView]]
    """Its layers by name (by tag for a layer this worker does not have), each with its
    region's descriptor and its view of that region."""
    drafts: set[str] = dataclasses.field(default_factory=set)
    """Its layers that are a speculative drafter's (by name, or by tag if not known here)."""
    factors: dict[str, str] = dataclasses.field(default_factory=dict)
    """Its compatibility factors (``xfer.kv.compat``), compared before anything moves."""
