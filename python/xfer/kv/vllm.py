"""Why one file: it is the module vLLM loads by path (``kv_connector_module_path``) — the connector,
its scheduler side and its worker side, whose state (the engine, the peers found, one lock,
the stats, the blocks kept) pull and push both use. Push is a component the worker owns
(``vllm_push.PushSide``), given what it uses of the worker as an explicit ``PushContext``;
what both halves pass around (``Load``, ``Peer``) is in ``vllm_records``, the page arithmetic
and message framing in ``pages``.

xfer as a vLLM KV connector (vLLM's V1 connector API), for disaggregated prefill/decode.

Select it without patching vLLM::

    --kv-transfer-config '{"kv_connector": "XferConnector", "kv_connector_module_path": "xfer.vllm",
                           "kv_role": "kv_both",
                           "kv_connector_extra_config": {"rendezvous": "xfer://10.0.0.5:7300",
                                                         "xfer_config": "/etc/xfer/verbs.toml"}}'

**Caches** are what vLLM 0.33 allocates: one buffer per KV cache tensor, one strided view per
layer, ``[num_blocks, kv_heads, block_size, head_size_k + head_size_v]`` (K and V packed) in
the stride order the attention backend resolved (NHD or HND; MLA's latent; fp8 as bytes).
Each distinct buffer is registered once; each layer's view of it is published. The connector
asks for HND (``get_required_kvcache_layout``): a head slice of a block is then one run.

**Pull.** The prefill instance finishes a request (its proxy asked for ``do_remote_decode``;
a request that stopped at its first token is handed off too) and keeps its blocks;
``request_finished`` hands back the parameters a decode instance needs. The decode instance,
given them, reads the blocks with RDMA READ — per layer, one paged read per contiguous run of
a block (``pages.block_runs``), offsets computed from block ids — off vLLM's model-runner
thread, after each prefill rank it reads from granted its claim of those blocks, and then
tells the prefill instance, which frees them and answers whether it held them for this reader
throughout: the load counts only then. Every message carries the request's random token
(``xfer_token`` in the parameters); what a prefill keeps and answers is ``xfer.kv.lease``'s,
from positive knowledge. A prefill whose reader never comes frees them after
``free_timeout_s`` (a lease, renewed while the decode request waits); a reader that comes
later, or a second reader, gets a load error, never another request's KV. Parameters are
untrusted input (``xfer.kv.params``): a set that does not parse is computed locally.

**Peers** are found through xfer's rendezvous (``extra_config["rendezvous"]``, an ``xfer://``
or ``etcd://`` URL), or through each instance's own side channel (``extra_config
["side_channel"] = "host:port"``: the instance's scheduler process serves its records there and
every request's parameters carry the URL, so no shared service is needed). One of the two is
required, so nothing defaults silently to localhost across machines:
each worker publishes ``vllm.<engine_id>.<tp_rank>`` with its engine's address and one region per
layer, the region's name carrying a tag of the layer's name and its view of the buffer. vLLM
gives each data-parallel engine its own engine id (``_dp<rank>``); its side channel is served
at the configured port plus the DP index. Pipeline parallelism is refused at start.

**Failures** — a peer that is gone, a refused read, a timeout (xfer's ``timeouts.transfer_ms``),
a layout that does not match — end the load with the request's blocks reported by
``get_block_ids_with_load_errors`` and the request reported as finished (and failed) receiving,
so vLLM recomputes or fails it by its policy; never a hang.

**Tensor parallelism** may differ between the instances (one size dividing the other): a decode
rank with fewer KV heads per rank reads its head slice of one prefill rank, one with more reads
each prefill rank holding some of its heads into place; with more ranks than KV heads, each
rank reads from one replica. MLA's latent cache, the same on every rank, is read whole from one
rank. Every decode rank tells every prefill rank when it is done; a prefill rank frees the
blocks once all have.

**Push** (``kv_transfer_params["xfer_push"]``, chosen per request by the proxy, which then
asks the decode instance first): the decode instance allocates the request's blocks and sends
their ids to the prefill ranks it expects data from; the prefill instance writes each layer's
blocks as soon as the layer is computed (``save_kv_layer``; for GPU tensors once the step's
stream is synchronised, in ``wait_for_save``), and after the writes completed tells each
decode rank; a decode rank completes when every prefill rank it expects said so. At ``push_timeout_s`` it
tells the ranks still owing data to stop and reports the request's blocks as load errors once
each answered that nothing of theirs is in flight (vLLM then reuses the blocks). Ids that arrive after the prefill
computed the request are pushed at once; a prefill request aborted or never scheduled fails
its decoder's load instead of letting it wait. The decode side then frees the prefill's
blocks as in pull mode. Proxy parameters — to the decode instance:
``{"do_remote_prefill": true, "xfer_push": true, "remote_engine_id": <prefill engine>,
"remote_request_id": <the prefill's request id>, "remote_tp_size": <its TP>}``; to the prefill
instance: ``{"do_remote_decode": true, "xfer_push": true}``.

**Hybrid models** (``SupportsHMA``): block ids travel per KV cache group; a sliding-window
group moves only the blocks its window still reaches (see ``_Groups``); push takes one group only.

**Sleep mode**: ``unregister_kv_caches`` withdraws the record and deregisters the buffers,
``restore_kv_caches`` registers and publishes them anew.

**Metrics**: ``get_kv_connector_stats`` per worker (vLLM sums and logs them) and Prometheus
``vllm:xfer_*`` counters and a load-time histogram through ``build_prom_metrics``.
"""

from __future__ import annotations

import concurrent.futures
import dataclasses
import functools
import logging
import os
import re
import threading
import zlib
import time
from collections.abc import Sequence
from typing import Any

from vllm.distributed.kv_transfer.kv_connector.v1.base import (
    KVConnectorBase_V1,
    KVConnectorMetadata,
    KVConnectorRole,
    KVConnectorTransferResults,
    SupportsHMA,
)

import xfer
from xfer.rendezvous_security import RendezvousSecurity

from vllm.distributed.kv_transfer.kv_connector.v1.metrics import (
    KVConnectorPromMetrics,
    KVConnectorStats,
)

from . import compat
from .control import (ControlError, Header, block_id_array, block_ids_payload, is_token,
                      new_token, same_token)
from .control import decode as decode_message
from .control import encode as encode_message
from .lease import Answer, Message, Offers, Reader
from .lookups import LookupGate
from .params import MAX_ID, MAX_TP, ParamsError, RemotePrefill, parse_remote_prefill
from .vllm_push import _CANCEL, _PUSHED, _WANT, MAX_MESSAGE, PushContext, PushSide, WaitTaken
from .vllm_records import Load, Peer
from .pages import (
    LayerView,
    LayoutError,
    block_runs,
    clip_to_windows,
    matched_blocks,
    parse_view,
    view_of,
)

logger = logging.getLogger("xfer.vllm")

PROTOCOL = 5
"""Changes when two versions of this connector can no longer work together (2: vLLM 0.33's
layer views, a read confirmed by the prefill before it counts; 3: block ids per KV cache
group; 4: kernel-block views, the cache dtype's fp8 variant, per-request tokens; 5: the
compatibility factors in the record, ``xfer.kv.compat``)."""

_CLAIM = b"xfer-vllm-read:"
"""A reader rank's claim, before it reads: the request's blocks it will read, with the
request's token (``xfer.kv.lease``)."""
_GRANT = b"xfer-vllm-okay:"
"""A prefill rank's answer to a claim: granted, or refused with why (another token: no
answer at all)."""
_DONE = b"xfer-vllm-done:"
"""Prefix of the message a reader sends once it read a request's blocks (or gave up)."""
_HELD = b"xfer-vllm-held:"
"""A prefill rank's answer to a reader's done: whether it held the request's blocks for that
reader throughout (positive knowledge: its offer with that token still exists), or not."""
_RENEW = b"xfer-vllm-renw:"
"""A decode instance's request still waits to be scheduled: its prefill ranks keep the
blocks a lease longer (up to ``max_lease_s``)."""
_KINDS = (_WANT, _PUSHED, _DONE, _HELD, _CANCEL, _CLAIM, _GRANT, _RENEW)


@dataclasses.dataclass(frozen=True)
class Options:
    """``kv_connector_extra_config``."""

    rendezvous: str | None
    """URL of the rendezvous both instances use (``xfer://host:port`` or ``etcd://…``)."""
    xfer_config: Any
    """The xfer engine's config: a path, a dict, or ``None`` for ``$XFER_CONFIG``."""
    free_timeout_s: float = 120.0
    """How long a prefill instance keeps a finished request's blocks for its reader."""
    lookup_timeout_s: float = 30.0
    """How long a lookup waits for a peer found before to reappear in the rendezvous (one
    lookup at a time; a record never found is only checked: ``xfer.kv.lookups``)."""
    publish_ttl_s: float = 10.0
    tp_rank: int | None = None
    """This worker's tensor-parallel rank (default: vLLM's, or 0 outside a TP group)."""
    tp_size: int | None = None
    """This instance's tensor-parallel size (default: vLLM's ``tensor_parallel_size``)."""
    push_timeout_s: float = 60.0
    """Push: how long a decode rank waits for its prefill ranks' data."""
    side_channel: str | None = None
    """``host:port`` this instance serves its workers' records at (its scheduler process runs
    the rendezvous service there): peers learn it from the request's parameters, so no shared
    service is needed. ``host`` is what peers dial — never a default."""
    peer_side_channels: Any = None
    """The side channels (``host:port`` each) of the prefill instances this one may read from:
    a request whose parameters name another is computed here (parameters come from API
    clients: the instance dials nothing a request names on its own). ``"*"``: any
    ``xfer://host:port``."""
    max_lease_s: float | None = None
    """How long a waiting decode may keep renewing a prefill's lease (default 10 leases)."""

    @staticmethod
    def parse(extra: dict[str, Any] | None) -> Options:
        extra = dict(extra or {})
        known = {f.name for f in dataclasses.fields(Options)}
        unknown = sorted(set(extra) - known)
        if unknown:
            raise ValueError(
                f"XferConnector: unknown kv_connector_extra_config keys {unknown} (known: {sorted(known)})"
            )
        if not extra.get("rendezvous") and not extra.get("side_channel"):
            raise ValueError(
                "XferConnector needs kv_connector_extra_config['rendezvous'] (xfer://host:port or "
                "etcd://host:port/prefix), where the instances find each other, or "
                "['side_channel'] (host:port this instance serves its records at, which peers "
                "learn from each request's parameters)"
            )
        side = extra.get("side_channel")
        if side is not None:
            host, _, port = str(side).rpartition(":")
            if not host or not port.isdigit() or host in ("0.0.0.0", "::", "[::]"):
                raise ValueError(
                    f"XferConnector: side_channel {side!r} must be host:port with the host peers "
                    "dial (not a wildcard address)"
                )
        extra.setdefault("rendezvous", None)
        extra.setdefault("xfer_config", None)
        if extra["xfer_config"] is None and not os.environ.get("XFER_CONFIG"):
            # The engine would otherwise open its default (the mock): a production pair that
            # "works" without moving a byte across machines.
            raise ValueError(
                "XferConnector needs an engine config: kv_connector_extra_config['xfer_config'] "
                "(a TOML path or a dict) or $XFER_CONFIG"
            )
        peers = extra.get("peer_side_channels")
        if peers is not None and peers != "*" and (
                not isinstance(peers, (list, tuple)) or not all(isinstance(x, str) for x in peers)):
            raise ValueError("XferConnector: peer_side_channels must be a list of host:port "
                             "strings, or \"*\"")
        return Options(**extra)

    def dialable(self) -> tuple[frozenset[str], bool]:
        """The rendezvous URLs a request's parameters may name, and whether any side channel
        may be."""
        urls = {u for u in (self.rendezvous, self.side_channel and f"xfer://{self.side_channel}")
                if u}
        if self.peer_side_channels == "*":
            return frozenset(urls), True
        urls |= {f"xfer://{x}" for x in self.peer_side_channels or ()}
        return frozenset(urls), False

    def of_dp_engine(self, index: int) -> Options:
        """The options of data-parallel engine ``index``: vLLM starts one engine (one
        scheduler process) per DP rank from one config, so each serves its side channel on
        the port after the previous one's (as NixlConnector offsets its own)."""
        if not self.side_channel or not index:
            return self
        host, _, port = self.side_channel.rpartition(":")
        return dataclasses.replace(self, side_channel=f"{host}:{int(port) + index}")


@dataclasses.dataclass(frozen=True)
class Offered:
    """Prefill: a finished request's blocks kept for its reader."""

    seconds: float
    """The lease."""
    token: str
    """The request's random token, handed to the reader in its parameters."""
    blocks: list[list[int]]
    """Per KV cache group, what a reader may claim."""


class XferConnectorMetadata(KVConnectorMetadata):
    """What the scheduler side tells the workers each step."""

    def __init__(self) -> None:
        self.loads: dict[str, Load] = {}
        """Decode: requests to read now."""
        self.notify_only: dict[str, Load] = {}
        """Decode: requests whose prefix was all here already; only free them at the peer."""
        self.sends: dict[str, Offered] = {}
        """Prefill: finished requests whose blocks wait for their reader."""
        self.renew: dict[str, Load] = {}
        """Decode: requests still waiting to be scheduled whose prefill's lease is renewed."""
        self.awaits: dict[str, Load] = {}
        """Decode, push: requests whose blocks the prefill instance writes (ids to send)."""
        self.push_now: dict[str, list[int]] = {}
        """Prefill, push: requests computed in this step, with their blocks."""
        self.push_finish: dict[str, list[int]] = {}
        """Prefill, push: requests computed to the end, with all their blocks."""
        self.push_abort: set[str] = set()
        self.push_tokens: dict[str, str] = {}
        """Prefill, push: the tokens of requests scheduled (their parameters')."""

        """Prefill, push: requests aborted (their decoders are told)."""
        self.refused: dict[str, tuple[Load, str]] = {}
        """Decode: requests refused before any transfer (another model), with why."""


_COUNTERS = ("loads", "load_failures", "blocks_loaded", "freed_after_read", "freed_at_lease")


@dataclasses.dataclass
class XferConnectorStats(KVConnectorStats):
    """What a worker did in one interval, summed over workers (vLLM aggregates them): loads
    and their failures, blocks loaded, requests freed after their reader or at their lease,
    and each load's seconds."""

    def __post_init__(self) -> None:
        for key in _COUNTERS:
            self.data.setdefault(key, 0)
        self.data.setdefault("load_seconds", [])

    def reset(self) -> None:
        self.data = {}
        self.__post_init__()

    def aggregate(self, other: KVConnectorStats) -> XferConnectorStats:
        for key in _COUNTERS:
            self.data[key] += other.data.get(key, 0)
        self.data["load_seconds"] = self.data["load_seconds"] + list(other.data.get("load_seconds", []))
        return self

    def reduce(self) -> dict[str, int | float]:
        out: dict[str, int | float] = {key: self.data[key] for key in _COUNTERS}
        seconds = sorted(self.data["load_seconds"])
        if seconds:
            out["load_ms_avg"] = 1e3 * sum(seconds) / len(seconds)
            out["load_ms_p50"] = 1e3 * seconds[len(seconds) // 2]
            out["load_ms_max"] = 1e3 * seconds[-1]
        return out

    def is_empty(self) -> bool:
        return not any(self.data[key] for key in _COUNTERS)


class XferPromMetrics(KVConnectorPromMetrics):
    """The connector's Prometheus metrics, through vLLM's own (``build_prom_metrics``): the
    counters of :class:`XferConnectorStats` as ``vllm:xfer_*`` counters and each load's time
    as a histogram, per engine label."""

    _BUCKETS = (0.001, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0)

    def __init__(self, vllm_config: Any, metric_types: dict[type, type], labelnames: list[str],
                 per_engine_labelvalues: dict[int, list[object]]):
        super().__init__(vllm_config, metric_types, labelnames, per_engine_labelvalues)
        from vllm.v1.metrics.utils import create_metric_per_engine

        self._counters = {
            key: create_metric_per_engine(
                self._counter_cls(name=f"vllm:xfer_{key}",
                                  documentation=f"xfer KV connector: {key.replace('_', ' ')}",
                                  labelnames=labelnames),
                per_engine_labelvalues)
            for key in _COUNTERS
        }
        self._load_time = create_metric_per_engine(
            self._histogram_cls(name="vllm:xfer_load_time_seconds",
                                documentation="xfer KV connector: seconds from a load's start "
                                "to its last byte (pulled or pushed)",
                                buckets=list(self._BUCKETS), labelnames=labelnames),
            per_engine_labelvalues)

    def observe(self, transfer_stats_data: dict[str, Any], engine_idx: int = 0) -> None:
        for key, counter in self._counters.items():
            value = transfer_stats_data.get(key, 0)
            if value:
                counter[engine_idx].inc(value)
        for seconds in transfer_stats_data.get("load_seconds", []):
            self._load_time[engine_idx].observe(seconds)


class XferConnector(KVConnectorBase_V1, SupportsHMA):
    """See the module docs."""

    def __init__(self, vllm_config: Any, role: KVConnectorRole, kv_cache_config: Any = None):
        super().__init__(vllm_config, role, kv_cache_config)
        parallel = getattr(vllm_config, "parallel_config", None)
        stages = int(getattr(parallel, "pipeline_parallel_size", 1) or 1)
        if stages > 1:
            raise NotImplementedError(
                f"XferConnector does not support pipeline parallelism (pipeline_parallel_size="
                f"{stages}): its records and reads assume every layer on each TP rank")
        for name in ("decode_context_parallel_size", "prefill_context_parallel_size"):
            size = int(getattr(parallel, name, 1) or 1)
            if size > 1:
                # A manager block then spans block_size x size tokens spread over the ranks:
                # reads planned per rank from block ids would move the wrong tokens (MLA).
                raise NotImplementedError(
                    f"XferConnector does not support context parallelism ({name}={size}): "
                    f"a block's tokens are spread over the ranks, which its reads do not map")
        self._options = Options.parse(self._kv_transfer_config.kv_connector_extra_config) \
            .of_dp_engine(int(getattr(parallel, "data_parallel_index", 0) or 0))
        self._engine_id = str(self._kv_transfer_config.engine_id)
        model = getattr(vllm_config, "model_config", None)
        self._mla = bool(getattr(model, "use_mla", False))
        # What a peer must be serving too: moving one model's KV into another's cache would
        # pass every layout check (same shapes) and be wrong.
        self._model = str(getattr(model, "model", "") or "")
        tp_size = self._options.tp_size or int(getattr(parallel, "tensor_parallel_size", 1) or 1)
        groups = _Groups(kv_cache_config)
        # The operator's rendezvous settings (the cluster secret, etcd's TLS and user: the
        # engine config's, else the environment's), refused on both roles at start if they
        # cannot work.
        self._security = RendezvousSecurity.of(self._options.xfer_config, who="XferConnector")
        self._side_channel: xfer.Server | None = None
        if role == KVConnectorRole.SCHEDULER:
            if self._options.side_channel:
                # One service per instance, in its scheduler process; its workers publish there.
                self._side_channel = xfer.Server(
                    self._options.side_channel, secret_file=self._security.secret_file)
                logger.info("XferConnector: serving this instance's records at %s",
                            self._side_channel.url)
            self._scheduler: _Scheduler | None = _Scheduler(
                self._engine_id, self._options, tp_size, self._model, groups,
                int(getattr(model, "max_model_len", 0) or 0))
            self._worker: _Worker | None = None
        else:
            self._scheduler = None
            cache = getattr(vllm_config, "cache_config", None)
            self._worker = _Worker(self._engine_id, self._options, self._mla, tp_size, self._model,
                                   _total_kv_heads(model), groups, _target_layers(model),
                                   str(getattr(cache, "cache_dtype", "auto") or "auto"),
                                   _compat_factors(vllm_config, groups))

    @classmethod
    def get_required_kvcache_layout(cls, vllm_config: Any) -> str | None:
        """Heads outside tokens in each block (vLLM's LBHNC, "HND"): a decode rank at another
        tensor-parallel size then reads one head slice of a block as one run, where tokens
        outside heads would take one run per token. MLA's latent has one head: no preference.
        vLLM keeps its own choice (with a warning) where the attention backend cannot."""
        model = getattr(vllm_config, "model_config", None)
        if model is None or getattr(model, "use_mla", False):
            return None
        return "LBHNC"

    # ---- scheduler side ----

    def get_loaded_kv_cache_group_ids(self, request: Any) -> tuple[int, ...]:
        """Every transfer group: the load moves the request's own blocks of each (vLLM's
        default, the prefix-cacheable groups, would leave the others to be zeroed while the
        reads land)."""
        return tuple(self._kv_cache_config.transfer_group_ids)

    def get_num_new_matched_tokens(self, request: Any, num_computed_tokens: int) -> tuple[int | None, bool]:
        assert self._scheduler is not None
        return self._scheduler.matched_tokens(request, num_computed_tokens)

    def update_state_after_alloc(self, request: Any, blocks: Any, num_external_tokens: int) -> None:
        assert self._scheduler is not None
        self._scheduler.allocated(request, blocks, num_external_tokens)

    def build_connector_meta(self, scheduler_output: Any) -> KVConnectorMetadata:
        assert self._scheduler is not None
        return self._scheduler.take_metadata(scheduler_output)

    def request_finished(self, request: Any, block_ids: list[int]) -> tuple[bool, dict[str, Any] | None]:
        """vLLM's path with its hybrid allocator off: one KV cache group."""
        assert self._scheduler is not None
        return self._scheduler.finished(request, (block_ids,))

    def request_finished_all_groups(self, request: Any, block_ids: tuple[list[int], ...]
                                    ) -> tuple[bool, dict[str, Any] | None]:
        """``SupportsHMA``: vLLM keeps its hybrid allocator on (sliding-window layers hold
        only their window's blocks) and hands every group's blocks."""
        assert self._scheduler is not None
        return self._scheduler.finished(request, block_ids)

    # ---- worker side ----

    def register_kv_caches(self, kv_caches: dict[str, Any]) -> None:
        assert self._worker is not None
        self._worker.register(kv_caches)

    def unregister_kv_caches(self) -> None:
        """Sleep mode (vLLM drained the transfers first)."""
        if self._worker is not None:
            self._worker.unregister()

    def restore_kv_caches(self) -> None:
        if self._worker is not None:
            self._worker.restore()

    def start_load_kv(self, forward_context: Any, **kwargs: Any) -> None:
        assert self._worker is not None
        meta = self._get_connector_metadata()
        assert isinstance(meta, XferConnectorMetadata)
        self._worker.start(meta)

    def wait_for_layer_load(self, layer_name: str) -> None:
        # Loads (pulled or pushed) finish between steps (the request waits for its blocks):
        # nothing to wait for inside a forward pass.
        return None

    def save_kv_layer(self, layer_name: str, kv_layer: Any, attn_metadata: Any, **kwargs: Any) -> None:
        # Pull: the reader comes for the blocks. Push: this layer goes to the decoders now.
        assert self._worker is not None
        # With async loads vLLM calls start_load_kv after the forward: this step's push
        # requests are taken from the metadata bound before it, at its first layer.
        if self.has_connector_metadata():
            meta = self._get_connector_metadata()
            assert isinstance(meta, XferConnectorMetadata)
            self._worker.push_step(meta)
        self._worker.push.layer_computed(layer_name, kv_layer)

    def wait_for_save(self) -> None:
        assert self._worker is not None
        self._worker.push.step_computed()

    def get_finished(self, finished_req_ids: set[str]) -> tuple[set[str] | None, set[str] | None]:
        r = self.get_transfer_results(finished_req_ids)
        return r.finished_sending or None, r.finished_recving or None

    def get_transfer_results(self, finished_req_ids: set[str]) -> KVConnectorTransferResults:
        assert self._worker is not None
        return self._worker.results()

    def get_block_ids_with_load_errors(self) -> set[int]:
        assert self._worker is not None
        return self._worker.take_load_errors()

    def shutdown(self) -> None:
        if self._worker is not None:
            self._worker.close()
        if self._side_channel is not None:
            self._side_channel.close()
            self._side_channel = None

    def get_kv_connector_stats(self) -> XferConnectorStats | None:
        """This worker's counters since the last call (vLLM sums the workers')."""
        if self._worker is None:
            return None
        return self._worker.take_stats()

    @classmethod
    def build_kv_connector_stats(cls, data: dict[str, Any] | None = None) -> XferConnectorStats:
        return XferConnectorStats(data=dict(data or {}))

    @classmethod
    def build_prom_metrics(cls, vllm_config: Any, metric_types: dict[type, type],
                           labelnames: list[str],
                           per_engine_labelvalues: dict[int, list[object]]) -> XferPromMetrics:
        return XferPromMetrics(vllm_config, metric_types, labelnames, per_engine_labelvalues)


class _Groups:
    """The KV cache groups a request's blocks come in, as vLLM's ``KVCacheConfig`` says: one
    per kind of layer when its hybrid allocator is on (full attention, each sliding window),
    else one. A sliding-window group moves only the blocks its window still reaches; state
    groups (Mamba) are refused at start, named."""

    def __init__(self, kv_cache_config: Any) -> None:
        self._config = kv_cache_config
        self.windows: list[int] = [0]
        """Per group this connector moves: the blocks kept at the tail (0: all of them)."""
        self.of_layer: dict[str, int] = {}
        """Layer name → its group's index (empty: one group holding every layer)."""
        self.block_sizes: list[int | None] = [None]
        """Per group this connector moves: tokens per block of vLLM's KV cache manager (what
        block ids count; a kernel-block view's rows are smaller). None: the view's own."""
        self.kinds: list[str] = ["unknown"]
        """Per group this connector moves: its kind of attention, as peers compare it (full,
        mla, sw<window>)."""
        if kv_cache_config is None:
            return
        from vllm.v1.kv_cache_interface import AttentionSpec, SlidingWindowSpec

        self.windows = []
        self.block_sizes = []
        self.kinds = []
        for group in kv_cache_config.transfer_groups:
            spec = group.kv_cache_spec
            self.block_sizes.append(int(spec.block_size))
            window = getattr(spec, "sliding_window", None)
            self.kinds.append(f"sw{window}" if isinstance(spec, SlidingWindowSpec) else
                              {"FullAttentionSpec": "full", "MLAAttentionSpec": "mla"}.get(
                                  type(spec).__name__, type(spec).__name__))
            if not isinstance(spec, AttentionSpec):
                raise NotImplementedError(
                    f"XferConnector moves attention KV caches only: layers "
                    f"{list(group.layer_names)[:3]} hold {type(spec).__name__} state")
            if isinstance(spec, SlidingWindowSpec):
                # The tokens below a request's next position that stay readable, and the
                # block that next position is in.
                self.windows.append(-(-spec.num_retained_tokens // spec.block_size) + 1)
            else:
                self.windows.append(0)
        self.of_layer = dict(kv_cache_config.transfer_group_index_by_layer)

    def moved(self, block_ids: Any, prompt_tokens: int | None = None) -> list[list[int]]:
        """A request's block ids (vLLM's tuple, one list per KV cache group) cut to the groups
        and blocks this connector moves; with ``prompt_tokens``, to the blocks holding the
        prompt (a speculating prefill is allocated lookahead blocks past it: vLLM's
        ``num_lookahead_tokens``, which no decoder's blocks match — its own are allocated
        without, for an async load)."""
        if self._config is not None:
            block_ids = self._config.select_transfer_block_ids(block_ids)
        if prompt_tokens:
            block_ids = [list(ids[:-(-prompt_tokens // size)]) if size else list(ids)
                         for ids, size in zip(block_ids, self.block_sizes)]
        return clip_to_windows(block_ids, self.windows)

    def block_size(self, layer: str) -> int | None:
        """Tokens per manager block of ``layer``'s group (None: unknown, the view's own)."""
        group = self.group(layer)
        return self.block_sizes[group] if group is not None and group < len(self.block_sizes) \
            else None

    def group(self, layer: str) -> int | None:
        """The index of ``layer``'s group; None for a layer vLLM does not transfer."""
        if not self.of_layer:
            return 0
        return self.of_layer.get(layer)


class _Scheduler:
    """The scheduler side: which requests to read, which to keep for a reader."""

    def __init__(self, engine_id: str, options: Options, tp_size: int, model: str,
                 groups: _Groups, max_model_len: int = 0) -> None:
        self._engine_id = engine_id
        self._options = options
        self._tp_size = tp_size
        self._model = model
        self._groups = groups
        self._meta = XferConnectorMetadata()
        self._remote: dict[str, tuple[RemotePrefill, float]] = {}
        """Decode: requests whose parameters were accepted and that wait for their blocks,
        with when their prefill's lease was last renewed. Left at allocation or finish."""
        self._dialable = options.dialable()
        sizes = [b for b in groups.block_sizes if b]
        self._block_size = min(sizes) if sizes else 1
        self._max_model_len = max_model_len
        """Bounds the blocks a request's parameters may name (no request has more)."""
        self._push_allocated: dict[str, tuple[Any, list[int]]] = {}
        """Prefill, push: requests allocated this step, with their blocks (lookahead included)."""
        self.params_refused = 0
        """Requests whose parameters were refused (computed here instead)."""

    def _parsed(self, request: Any, params: Any) -> RemotePrefill | None:
        """The request's prefill, parsed once (its parameters come from the API client);
        None, and the request is computed here, if they are refused."""
        known = self._remote.get(request.request_id)
        if known is not None:
            return known[0]
        try:
            remote = parse_remote_prefill(
                params, prompt_tokens=max(len(request.prompt_token_ids), self._max_model_len),
                block_size=self._block_size,
                local_tp=self._tp_size, groups=len(self._groups.windows),
                allowed=self._dialable[0], any_side_channel=self._dialable[1],
                protocol=PROTOCOL)
        except ParamsError as e:
            # This request alone: computed here, as without parameters; nothing looked up,
            # dialled or read on their word.
            self.params_refused += 1
            logger.warning("XferConnector: request %s: kv_transfer_params refused (%s); "
                           "computed here", request.request_id, e)
            params["do_remote_prefill"] = False
            return None
        self._remote[request.request_id] = (remote, time.monotonic())
        return remote

    def matched_tokens(self, request: Any, num_computed_tokens: int) -> tuple[int, bool]:
        params = request.kv_transfer_params
        if not isinstance(params, dict) or not params.get("do_remote_prefill"):
            return 0, False
        remote = self._parsed(request, params)
        if remote is None:
            return 0, False
        # Asked again each step it waits for room: the prefill keeps its blocks meanwhile.
        _, renewed = self._remote[request.request_id]
        now = time.monotonic()
        lease = min(self._options.free_timeout_s, remote.lease_s or self._options.free_timeout_s)
        if now - renewed > lease / 3:
            self._remote[request.request_id] = (remote, now)
            self._meta.renew[request.request_id] = self._load_of(request, remote)
        # Every prompt token the prefill instance computed, beyond what is here already.
        missing = len(request.prompt_token_ids) - num_computed_tokens
        return (missing, True) if missing > 0 else (0, False)

    @staticmethod
    def _load_of(request: Any, remote: RemotePrefill) -> Load:
        return Load(local_block_ids=[], remote_engine_id=remote.engine_id,
                    remote_block_ids=[list(ids) for ids in remote.block_ids],
                    remote_request_id=remote.request_id, remote_tp_size=remote.tp_size,
                    remote_rendezvous=remote.rendezvous, token=remote.token,
                    local_request_id=request.request_id)

    def allocated(self, request: Any, blocks: Any, num_external_tokens: int) -> None:
        params = request.kv_transfer_params
        if not isinstance(params, dict):
            return
        if params.get("do_remote_decode") and params.get("xfer_push"):
            moved = self._groups.moved(blocks.get_block_ids(), _prompt_tokens(request))
            token = params.get("xfer_token")
            if not is_token(token):
                # The proxy gives both instances the request's token; without it no decoder's
                # ids could be told from a forger's.
                logger.error("XferConnector: request %s: push without xfer_token (the proxy's "
                             "random token for the request, 32 hex digits); not pushed",
                             request.request_id)
                self._meta.push_abort.add(request.request_id)
                return
            self._meta.push_tokens[request.request_id] = token
            if len(moved) != 1:
                # Its decoder refuses it too (the same model has the same groups).
                logger.error("XferConnector: request %s: push with %d KV cache groups (a hybrid "
                             "model) is not supported; use pull", request.request_id, len(moved))
                self._meta.push_abort.add(request.request_id)
                return
            # Which blocks go, and whether this step computes the prompt, once the step's
            # scheduled tokens are known (``take_metadata``).
            self._push_allocated[request.request_id] = (request, moved[0])
            return
        if not params.get("do_remote_prefill"):
            return
        parsed = self._remote.pop(request.request_id, None)
        if parsed is None:  # vLLM asks get_num_new_matched_tokens first; refused there
            return
        remote, _ = parsed
        load = self._load_of(request, remote)
        theirs = remote.model
        if num_external_tokens > 0:
            # The blocks allocated for what the prefill computed (the prefix cache's come
            # first and are hashed), per group, nothing the window left behind.
            load.local_block_ids = self._groups.moved(blocks.get_unhashed_block_ids_all_groups())
        if num_external_tokens > 0 and theirs and self._model and theirs != self._model:
            self._meta.refused[request.request_id] = (load, (
                f"the prefill instance serves model {theirs!r}, this one {self._model!r}"))
        elif (num_external_tokens > 0 and not params.get("xfer_push")
              and len(load.local_block_ids) != len(load.remote_block_ids)):
            self._meta.refused[request.request_id] = (load, (
                f"the prefill instance sent block ids for {len(load.remote_block_ids)} KV cache "
                f"groups, this instance has {len(load.local_block_ids)} (vLLM's hybrid allocator "
                f"on one side only?)"))
        elif params.get("xfer_push") and num_external_tokens > 0:
            if len(load.local_block_ids) != 1:
                self._meta.refused[request.request_id] = (load, (
                    f"push with {len(load.local_block_ids)} KV cache groups (a hybrid model) is "
                    f"not supported; use pull"))
            else:
                # The prefill instance writes them; this side sends it the block ids.
                self._meta.awaits[request.request_id] = load
        elif num_external_tokens > 0:
            self._meta.loads[request.request_id] = load
        else:
            # Everything was here: the prefill instance only needs to free its blocks.
            self._meta.notify_only[request.request_id] = load
        # Once: a second allocation for this request (after the load) loads nothing.
        params["do_remote_prefill"] = False

    def take_metadata(self, scheduler_output: Any = None) -> XferConnectorMetadata:
        scheduled = getattr(scheduler_output, "num_scheduled_tokens", None) or {}
        for req_id, (request, blocks) in self._push_allocated.items():
            # Layer by layer only in the step that computes the prompt's last token: a chunk's
            # layers are not the prompt's KV yet (its blocks, lookahead included, may already
            # number the decoder's); a chunked prompt goes whole once it is finished.
            if request.num_computed_tokens + scheduled.get(req_id, 0) >= request.num_prompt_tokens:
                self._meta.push_now[req_id] = blocks
        self._push_allocated = {}
        meta, self._meta = self._meta, XferConnectorMetadata()
        return meta

    def finished(self, request: Any, block_ids: Any) -> tuple[bool, dict[str, Any] | None]:
        """``block_ids``: one list per KV cache group (vLLM's tuple)."""
        params = request.kv_transfer_params
        if not isinstance(params, dict):
            return False, None
        waiting = self._remote.pop(request.request_id, None)
        if waiting is not None:
            # A decode request that ends before its load started (aborted, refused
            # admission): its prefill is told at once, not left holding the blocks for a lease.
            self._meta.notify_only[request.request_id] = self._load_of(request, waiting[0])
            return False, None
        if not params.get("do_remote_decode"):
            return False, None
        block_ids = self._groups.moved(block_ids, _prompt_tokens(request))
        from vllm.v1.request import RequestStatus

        push = bool(params.get("xfer_push"))
        # A prompt whose first token was a stop token finishes STOPPED: its KV is as whole
        # as a length-capped one's.
        handed_off = (RequestStatus.FINISHED_LENGTH_CAPPED, RequestStatus.FINISHED_STOPPED)
        if request.status not in handed_off or not any(block_ids):
            # Aborted (or nothing computed): no reader will come; a waiting decoder is told.
            if push:
                self._meta.push_abort.add(request.request_id)
            return False, None
        # Push: the proxy's token, which the decoder has too; pull: a fresh one, handed to the
        # reader in the parameters below.
        token = params.get("xfer_token") if push else new_token()
        if not is_token(token):
            self._meta.push_abort.add(request.request_id)
            return False, None
        self._meta.sends[request.request_id] = Offered(self._options.free_timeout_s, token,
                                                       [list(ids) for ids in block_ids])
        if push:
            # The decoder already has what it needs; the blocks stay until it says it is done
            # (push has one group: `allocated` refused the others).
            self._meta.push_finish[request.request_id] = block_ids[0]
            return True, None
        return True, {
            "do_remote_prefill": True,
            "do_remote_decode": False,
            "remote_engine_id": self._engine_id,
            "remote_block_ids": block_ids,
            "remote_request_id": request.request_id,
            "remote_tp_size": self._tp_size,
            "remote_rendezvous": _own_rendezvous(self._options),
            "remote_model": self._model,
            "xfer_protocol": PROTOCOL,
            "xfer_token": token,
            "xfer_lease_s": self._options.free_timeout_s,
        }


@dataclasses.dataclass
class _Claim:
    """Decode: a load planned, waiting for the prefill ranks it reads from to grant its claim
    (nothing is read before)."""

    req_id: str
    load: Load
    ranks: set[int]
    plan: list[Any]
    deadline: float


@dataclasses.dataclass
class _Confirm:
    """Decode: a request read whole, waiting for the prefill ranks it read from to say they
    held its blocks throughout."""

    req_id: str
    load: Load
    ranks: set[int]
    deadline: float
    error: BaseException | None = None


class _Worker:
    """The worker side: the engine, its registered caches, loads in flight, blocks kept."""

    def __init__(self, engine_id: str, options: Options, mla: bool, tp_size: int,
                 model: str = "", total_heads: int | None = None,
                 groups: _Groups | None = None, target_layers: int | None = None,
                 cache_dtype: str = "auto", factors: dict[str, str] | None = None) -> None:
        self._engine_id = engine_id
        self._cache_dtype = cache_dtype
        self._factors = dict(factors or {})
        """This instance's compatibility factors (``xfer.kv.compat``) but the kernel block
        size, which the views registered say."""
        self._compat: dict[str, str] = {}
        """This worker's factors as published (tag → value), once its caches are registered."""
        self._target_layers = target_layers
        """The model's own layer count: layers numbered past it are a drafter's."""
        self._groups = groups or _Groups(None)
        self._options = options
        self._mla = mla
        self._model = model
        self._tp_size = tp_size
        self._rank = options.tp_rank if options.tp_rank is not None else _tp_rank()
        self._security = RendezvousSecurity.of(options.xfer_config, who="XferConnector")
        """What every rendezvous client of this worker connects with."""
        self._engine = xfer.TransferEngine(options.xfer_config)
        self._own_url = _own_rendezvous(options)
        self._rendezvous = self._security.connect(self._own_url)
        self._services: dict[str, xfer.Rendezvous] = {self._own_url: self._rendezvous}
        """Rendezvous clients by URL: the shared one, or peers' side channels."""
        self._layers: dict[str, tuple[xfer.MemoryRegion, LayerView]] = {}
        """Each layer's region (its buffer's, shared by the layers in it) and view (the layers
        vLLM transfers: those of its transfer groups)."""
        self._buffers: dict[tuple[str, int], xfer.MemoryRegion] = {}
        """One registration per buffer the layers' views share, by (device, address)."""
        self._total_heads = total_heads
        self._warned_drafts: set[str] = set()
        """Prefill engines already named for lacking this side's draft layers."""
        self._confirming: dict[tuple[str, str, str], _Confirm] = {}
        """Decode: (prefill engine, its request id, this instance's request id) → a read
        waiting for its prefill ranks to say they held the blocks throughout."""
        self._claims: dict[tuple[str, str, str], _Claim] = {}
        """Decode: the same keys → a load waiting for its claim to be granted."""
        self._offers = Offers(options.free_timeout_s,
                              options.max_lease_s or 10 * options.free_timeout_s,
                              early_s=max(1.0, options.lookup_timeout_s))
        """Prefill: the requests kept for their readers, and what they are answered."""
        self._publication: xfer.Publication | None = None
        self._peers: dict[tuple[str, str, int], Peer] = {}
        """Peers' records by (the rendezvous they were found in, engine, rank): a record is
        only ever the answer for the rendezvous it came from (another dialable one may hold a
        record under the same name, published by anyone who can publish there)."""
        self._push_meta: XferConnectorMetadata | None = None
        """The step whose push requests were taken (``push_step``)."""
        self._lookup_gate = LookupGate(options.lookup_timeout_s)
        """How long each lookup of a peer's record may wait (by (where, engine, rank)): a
        record never found is only checked — a request's parameters name any engine id —,
        one found before is waited for by one lookup at a time, with a backoff after a
        failed wait (``xfer.kv.lookups``)."""
        self._lock = threading.Lock()
        self._recved: set[str] = set()
        self._failed_recv: set[str] = set()
        self._load_errors: set[int] = set()
        self._stats = XferConnectorStats()
        self._load_started: dict[str, float] = {}
        self._kv_caches: dict[str, Any] = {}
        """The layer views registered, kept for a wake-up from sleep mode."""
        self._telling: set[concurrent.futures.Future[Any]] = set()
        """Done messages to prefill ranks not sent yet: each ``_tell_done`` queued
        (``_tell_done_soon``), then until its sends complete (``close`` waits for both)."""
        self._lookups = concurrent.futures.ThreadPoolExecutor(
            max_workers=2, thread_name_prefix="xfer-vllm-lookup")
        """Push: decoders' records are looked up here, never on the engine's callback thread
        (a lookup may wait up to ``lookup_timeout_s``; other transfers' callbacks must not)."""
        self.push = PushSide(PushContext(
            engine=self._engine, engine_id=engine_id, rank=self._rank, tp_size=tp_size,
            model=model, rendezvous_url=self._own_url, push_timeout_s=options.push_timeout_s,
            forget_after_s=options.free_timeout_s,
            # A callable: sleep mode replaces the dict.
            layers=lambda: self._layers, peer=self._peer, proven=self._proven,
            shared_layers=self._shared_layers,
            is_draft_layer=self.is_draft_layer, in_background=self._in_background,
            tell_done_soon=self._tell_done_soon, finish_load=self._finish_load, logger=logger,
            dialable=options.dialable(), incompatible=self.incompatible))
        """Push mode: its own state, and what it uses of this worker."""
        # Block-id messages carry 4 bytes per block: 64 KiB buffers hold ~16k blocks.
        try:
            # Each message with the sender the transport proved (b"" where it cannot tell).
            self._engine.submit_recvs(MAX_MESSAGE, 64, self._on_message, with_sender=True)
        except TypeError:  # a binding without sender identity
            self._engine.submit_recvs(MAX_MESSAGE, 64, self._on_message)

    # ---- registration ----

    def register(self, kv_caches: dict[str, Any]) -> None:
        """Registers the buffers behind vLLM's layer views (once each: vLLM 0.33 places every
        layer of a cache tensor in one allocation) and publishes each layer's view of its
        buffer."""
        regions: dict[str, xfer.MrDesc] = {}
        self._kv_caches = dict(kv_caches)
        kernel_blocks: dict[int, set[int]] = {}
        for name, tensor in kv_caches.items():
            if self._groups.group(name) is None:
                continue  # a group vLLM does not transfer (it says which in its config)
            if tensor.dim() != 4:
                raise LayoutError(
                    f"layer {name}: a KV cache of shape {tuple(tensor.shape)} is not a "
                    "[num_blocks, heads, tokens, content] view (state caches such as Mamba's "
                    "are not supported by XferConnector)")
            storage = tensor.untyped_storage()
            key = (str(tensor.device), storage.data_ptr())
            region = self._buffers.get(key)
            if region is None:
                import torch

                whole = torch.empty(0, dtype=torch.uint8, device=tensor.device).set_(storage)
                region = self._engine.reg_mr(whole, access="read_write")
                self._buffers[key] = region
            heads = self._total_heads or int(tensor.shape[1]) * self._tp_size
            # A kernel-block view (the backend's kernels take smaller blocks than the
            # manager's) is addressed by rows: the manager's block ids are mapped to them.
            view = view_of(tuple(tensor.shape), tuple(tensor.stride()), tensor.element_size(),
                           self._dtype_name(tensor), tensor.storage_offset() * tensor.element_size(),
                           1 if self._mla else heads, self._groups.block_size(name))
            self._layers[name] = (region, view)
            regions[_region_name(name, view, self.is_draft_layer(name))] = region.desc
            kernel_blocks.setdefault(self._groups.group(name) or 0, set()).add(int(tensor.shape[2]))
        self._compat = compat.tags({**self._factors, "kernel_block_size": "_".join(
            ".".join(map(str, sorted(kernel_blocks.get(g, ()))))
            for g in range(len(self._groups.block_sizes)))})
        if regions:
            # The factors ride in the record as names (their descriptor is a layer's, already
            # published): every peer compares them before it reads or writes here.
            desc = next(iter(regions.values()))
            for tag, value in self._compat.items():
                regions[f"v{PROTOCOL}-{tag}-{value}"] = desc
        self._publication = self._rendezvous.publish(
            _record_name(self._engine_id, self._rank),
            self._engine.main_address,
            regions,
            ttl=self._options.publish_ttl_s,
        )

    def unregister(self) -> None:
        """Sleep mode, before vLLM unmaps the KV memory: the record is withdrawn and every
        buffer deregistered, so no peer's read or write reaches memory that is about to
        change (a peer's load fails, named, and it looks this worker up afresh later).
        Idempotent."""
        if self._publication is not None:
            self._publication.unpublish()
            self._publication = None
        buffers, self._buffers = list(self._buffers.values()), {}
        self._layers = {}
        for region in buffers:
            region.dereg()

    def restore(self) -> None:
        """Wake-up, the KV memory mapped again: the same views registered and published anew
        (new keys). Idempotent."""
        if self._kv_caches and not self._layers:
            self.register(self._kv_caches)

    # ---- decode: reads ----

    def start(self, meta: XferConnectorMetadata) -> None:
        now = time.monotonic()
        answers: list[Answer] = []
        with self._lock:
            for req_id, offered in meta.sends.items():
                answers += self._offers.offer(req_id, offered.token, offered.blocks, now,
                                              offered.seconds)
        for answer in answers:  # readers that came before this step kept the request
            self._answer(answer)
        for load in meta.renew.values():
            self._in_background(self._renew, load)
        self.push_step(meta, now)
        for req_id, blocks in meta.push_finish.items():
            self.push.request_finished(req_id, blocks, now)
        for req_id in meta.push_abort:
            self.push.request_aborted(req_id, "the request was aborted at the prefill instance")
        for req_id, (load, why) in meta.refused.items():
            with self._lock:
                self._load_started[req_id] = time.monotonic()
            self._tell_done_soon(load)
            self._finish_load(req_id, load, LayoutError(why))
        for req_id, load in meta.awaits.items():
            self._start_load(req_id, load, self._await_push, "announcing")
        for req_id, load in meta.notify_only.items():
            self._tell_done_soon(load)
        for req_id, load in meta.loads.items():
            self._start_load(req_id, load, self._load, "loading")

    def push_step(self, meta: XferConnectorMetadata, now: float | None = None) -> None:
        """This step's push requests, once per step: at its first computed layer (vLLM's
        order under async loads: the forward, then ``start_load_kv``) or at ``start``."""
        if self._push_meta is meta:
            return
        self._push_meta = meta
        now = time.monotonic() if now is None else now
        self.push.tokens_known(meta.push_tokens, now)
        self.push.step_started(meta.push_now, now)

    def _await_push(self, req_id: str, load: Load) -> None:
        """Push, decode side: this rank's block ids sent, its deadline from now."""
        self.push.await_push(req_id, load, time.monotonic())

    def _in_background(self, work: Any, *args: Any) -> concurrent.futures.Future[Any] | None:
        """Runs ``work`` on the lookup threads: a rendezvous lookup may wait up to
        ``lookup_timeout_s``, and neither vLLM's model-runner thread (``start_load_kv``) nor
        the engine's callback thread may wait on the network."""
        try:
            return self._lookups.submit(work, *args)
        except RuntimeError:
            return None  # closing

    def _tell_done_soon(self, load: Load) -> None:
        """``_tell_done`` in the background, remembered until sent: ``close`` lets the ones
        still going out finish (a decode instance shut down right after its last load would
        otherwise leave the prefill holding the blocks until its lease)."""
        future = self._in_background(self._tell_done, load)
        if future is not None:
            self._remember_telling(future)

    def _remember_telling(self, future: concurrent.futures.Future[Any]) -> None:
        """``future`` (done messages going out) is waited for by ``close`` until it is done."""
        with self._lock:
            self._telling.add(future)

        def sent(f: concurrent.futures.Future[Any]) -> None:
            with self._lock:
                self._telling.discard(f)
        future.add_done_callback(sent)

    def _start_load(self, req_id: str, load: Load, start: Any, what: str) -> None:
        """Starts a pulled or pushed load off this thread; any failure to start is this
        request's load error."""
        with self._lock:
            self._load_started[req_id] = time.monotonic()

        def run() -> None:
            try:
                start(req_id, load)
            except Exception as e:  # noqa: BLE001 - any failure is this request's load error
                logger.error("XferConnector: %s request %s failed: %s", what, req_id, e)
                self._finish_load(req_id, load, e)
                if not isinstance(e, WaitTaken):  # the prefill's blocks are another load's
                    self._tell_done(load)

        try:
            self._lookups.submit(run)
        except RuntimeError as e:  # closing
            self._finish_load(req_id, load, e)

    def _load(self, req_id: str, load: Load) -> None:
        # Nothing is planned from a peer whose KV is another thing (named, before the block
        # counts of other windows or block sizes could fail the load less clearly).
        self._shared_layers(load)
        # Per group: the blocks to fill here and the prefill's to read them from.
        matched = [matched_blocks(ours, theirs)
                   for ours, theirs in zip(load.local_block_ids, load.remote_block_ids)]
        # Every prefill rank is told when this rank is done: look them all up first.
        for rank in range(load.remote_tp_size):
            self._peer(load.remote_engine_id, rank, load.remote_rendezvous)
        # Every check before the first read: a refused load posts nothing.
        plan = []
        for name in self._shared_layers(load):
            region, view = self._layers[name]
            local_ids, remote_ids = matched[self._groups.group(name) or 0]
            if not local_ids:
                continue  # this group's blocks were all here (or outside its window)
            for desc, remote_view, run in self._runs(load, name, view):
                plan.append((region, view, desc, remote_view, run, local_ids, remote_ids))
        ranks = {p[4].remote_rank for p in plan}
        if not plan:  # nothing to read: only the prefill's blocks to free
            self._tell_done_soon(load)
            self._finish_load(req_id, load, None)
            return
        # Claimed first: each prefill rank read from checks the token and that these blocks
        # were offered for this request to this reader, before anything is read.
        key = (load.remote_engine_id, load.remote_request_id, load.local_request_id)
        with self._lock:
            self._claims[key] = _Claim(req_id, load, set(ranks), plan,
                                       time.monotonic() + max(1.0, self._options.lookup_timeout_s))
        claimed = [remote_ids for _, remote_ids in matched]
        message = encode_message(_CLAIM, {
            **self._reader_header(load), "groups": [len(ids) for ids in claimed]},
            block_ids_payload([b for ids in claimed for b in ids]))
        for rank in sorted(ranks):
            peer = self._peer(load.remote_engine_id, rank, load.remote_rendezvous)
            self._engine.submit_send(peer.address, message)

    def _reader_header(self, load: Load) -> dict[str, Any]:
        """What every message of this reader rank about ``load`` carries."""
        return {"req": load.remote_request_id, "token": load.token, "engine": self._engine_id,
                "reader": load.local_request_id, "rank": self._rank, "tp": self._tp_size,
                "addr": bytes(self._engine.main_address).hex()}

    def _granted(self, header: Header, sender: bytes = b"") -> None:
        """A prefill rank's answer to this rank's claim: once every rank read from granted
        it, the reads go. Only from the engine of the record its load was planned with."""
        key = (header.text("engine", MAX_ID), header.text("req", MAX_ID),
               header.text("reader", MAX_ID))
        rank = header.integer("rank", 0, MAX_TP - 1)
        token = header.token()
        with self._lock:
            claim = self._claims.get(key)
            if (claim is None or rank not in claim.ranks
                    or not same_token(claim.load.token, token)
                    or not self._proven_locked(key[0], rank, claim.load.remote_rendezvous, sender)):
                return  # not a claim of this rank's (forged, or it timed out)
            ok = header.flag("ok")
            claim.ranks.discard(rank)
            if ok and claim.ranks:
                return
            del self._claims[key]
        if not ok:
            self._tell_done_soon(claim.load)
            self._finish_load(claim.req_id, claim.load, LayoutError(
                f"prefill {key[0]} rank {rank} refused to hand over request {key[1]}'s blocks: "
                f"{header.optional_text('why', 512)}"))
            return
        self._read(claim)

    def _read(self, claim: _Claim) -> None:
        """The claimed reads, submitted; the load counts once the prefill ranks confirm."""
        req_id, load, plan = claim.req_id, claim.load, claim.plan
        ranks = {p[4].remote_rank for p in plan}
        pending = {"left": len(plan), "error": None}

        def one_done(error: BaseException | None) -> None:
            with self._lock:
                if error is not None and pending["error"] is None:
                    pending["error"] = error
                pending["left"] -= 1
                last = pending["left"] == 0
            if not last:
                return
            if pending["error"] is not None:
                self._forget(load.remote_engine_id, load.remote_rendezvous)
                self._tell_done_soon(load)
                self._finish_load(req_id, load, pending["error"])
            else:
                self._confirm(req_id, load, ranks)

        for region, view, desc, remote_view, run, local_ids, remote_ids in plan:
            try:
                self._engine.submit_paged_reads(
                    run.length, region, view.rows(local_ids), desc, remote_view.rows(remote_ids),
                    local_stride=view.strides[0], remote_stride=remote_view.strides[0],
                    local_offset=view.offset + run.local,
                    remote_offset=remote_view.offset + run.remote,
                    on_done=one_done,
                )
            except Exception as e:  # noqa: BLE001 - refused at submit: counted like a failure
                one_done(e)

    def _runs(self, load: Load, name: str, view: LayerView) -> list[tuple[xfer.MrDesc, LayerView, Any]]:
        """One layer's runs, each with the peer rank's descriptor and view (checked first)."""
        planned = []
        for run in block_runs(view, self._remote_view(load, 0, name), self._rank,
                              self._tp_size, load.remote_tp_size):
            peer = self._peer(load.remote_engine_id, run.remote_rank, load.remote_rendezvous)
            if name not in peer.layers:
                raise LayoutError(
                    f"peer {load.remote_engine_id} rank {run.remote_rank} has no layer {name} "
                    f"({len(peer.layers)} layers there, {len(self._layers)} here)"
                )
            desc, remote_view = peer.layers[name]
            block_runs(view, remote_view, self._rank, self._tp_size, load.remote_tp_size)
            planned.append((desc, remote_view, run))
        return planned

    def _remote_view(self, load: Load, rank: int, name: str) -> LayerView:
        return self._peer(load.remote_engine_id, rank, load.remote_rendezvous).layers[name][1]

    def _shared_layers(self, load: Load) -> list[str]:
        """The layers both instances hold, which are moved. A speculative decoder's draft
        layers (EAGLE, MTP) may be on one side only: a prefill without them leaves this
        side's to its drafter (which proposes worse, never wrong: the model verifies), one
        with them has them unread. Any other layer on one side only is a load error."""
        peer = self._peer(load.remote_engine_id, 0, load.remote_rendezvous)
        why = self.incompatible(peer)
        if why is not None:
            raise LayoutError(f"peer {load.remote_engine_id} cannot exchange KV with this "
                              f"instance: {why}")
        only_here = [n for n in self._layers if n not in peer.layers]
        only_there = [n for n in peer.layers if n not in self._layers]
        target = ([n for n in only_here if not self.is_draft_layer(n)]
                  + [n for n in only_there if n not in peer.drafts])
        if target:
            raise LayoutError(
                f"peer {load.remote_engine_id} has other layers ({len(peer.layers)} there, "
                f"{len(self._layers)} here; {len(target)} of them not a drafter's, such as "
                f"{target[0]})")
        if only_here and load.remote_engine_id not in self._warned_drafts:
            self._warned_drafts.add(load.remote_engine_id)
            logger.warning("XferConnector: prefill %s has no draft layers (%d here, such as %s): "
                           "the drafter starts without the prompt's KV", load.remote_engine_id,
                           len(only_here), only_here[0])
        return [n for n in self._layers if n in peer.layers]

    def incompatible(self, peer: Peer) -> str | None:
        """Why this worker's KV cannot move to or from ``peer`` (the first compatibility
        factor that differs, named), or None."""
        return compat.difference(compat.from_tags(self._compat.items()), peer.factors)

    def _dtype_name(self, tensor: Any) -> str:
        """The cache's element type as peers compare it: the tensor's, and the cache dtype
        vLLM was given where it is not the model's (every fp8 variant is stored as uint8:
        e4m3 and e5m2 bytes would pass a check of the tensor's type alone). vLLM's "fp8" is
        e4m3."""
        variant = {"fp8": "fp8_e4m3"}.get(self._cache_dtype, self._cache_dtype)
        if variant in ("auto", ""):
            return str(tensor.dtype)
        return f"{tensor.dtype}.{re.sub(r'[^A-Za-z0-9_]', '_', variant)}"

    def is_draft_layer(self, name: str) -> bool:
        """Whether ``name`` is a speculative drafter's layer, as vLLM names them: under
        ``draft_model.``, or numbered past the model's own layers (EAGLE, MTP)."""
        if name.startswith("draft_model."):
            return True
        number = re.search(r"(?:^|\.)layers\.(\d+)(?:\.|$)", name)
        return (number is not None and self._target_layers is not None
                and int(number[1]) >= self._target_layers)

    def _confirm(self, req_id: str, load: Load, ranks: set[int]) -> None:
        """Every read finished: the load counts once each prefill rank read from says it
        held the blocks for this reader throughout (a rank that freed them at its lease may
        have reused them while they were read — that is a load error, never wrong KV)."""
        with self._lock:
            self._confirming[(load.remote_engine_id, load.remote_request_id,
                              load.local_request_id)] = _Confirm(
                req_id, load, set(ranks),
                time.monotonic() + max(1.0, self._options.lookup_timeout_s))
        self._tell_done_soon(load)

    def _held(self, header: Header, sender: bytes = b"") -> None:
        """A prefill rank's answer to this rank's done (from the engine of the record its load
        was read with)."""
        key = (header.text("engine", MAX_ID), header.text("req", MAX_ID),
               header.text("reader", MAX_ID))
        rank = header.integer("rank", 0, MAX_TP - 1)
        token = header.token()
        with self._lock:
            waiting = self._confirming.get(key)
            if (waiting is None or rank not in waiting.ranks
                    or not same_token(waiting.load.token, token)
                    or not self._proven_locked(key[0], rank, waiting.load.remote_rendezvous,
                                               sender)):
                return  # not a confirmation this rank waits for (forged, or timed out)
            waiting.ranks.discard(rank)
            if not header.flag("ok") and waiting.error is None:
                waiting.error = LayoutError(
                    f"prefill {key[0]} rank {rank} did not hold request {key[1]}'s blocks for "
                    f"this reader throughout ({header.optional_text('why', 512)}): what was "
                    f"read may be another request's")
            if waiting.ranks and waiting.error is None:
                return
            del self._confirming[key]
        self._finish_load(waiting.req_id, waiting.load, waiting.error)

    def _finish_load(self, req_id: str, load: Load, error: BaseException | None) -> None:
        with self._lock:
            self._recved.add(req_id)
            started = self._load_started.pop(req_id, None)
            data = self._stats.data
            data["loads"] += 1
            if started is not None:
                data["load_seconds"].append(time.monotonic() - started)
            if error is not None:
                self._failed_recv.add(req_id)
                if len(load.local_block_ids) == 1:
                    self._load_errors.update(load.local_block_ids[0])
                # With more groups block ids repeat across them: vLLM takes the request's
                # failure from failed_recving alone (and refuses block ids).
                data["load_failures"] += 1
            else:
                data["blocks_loaded"] += sum(len(ids) for ids in load.local_block_ids)
        if error is not None:
            logger.error("XferConnector: request %s: blocks not loaded: %s", req_id, error)

    def _tell_done(self, load: Load) -> None:
        """Tells every rank of the prefill instance that this rank is done with the request:
        a prefill rank frees it once every reader rank said so, and answers whether it held
        the blocks until then."""
        message = encode_message(_DONE, self._reader_header(load))
        # Never waited for here: a gone prefill's sends fail only at the engine's timeouts,
        # and this thread is one of the two lookups run on (review M-B: requests naming a
        # known prefill that died held both, outside the lookup gate). Their outcomes come
        # to `settled`; `close` waits for `sent`.
        sent: concurrent.futures.Future[None] = concurrent.futures.Future()
        self._remember_telling(sent)
        unsettled = set(range(load.remote_tp_size))
        failed = False

        def settled(rank: int, error: BaseException | None) -> None:
            nonlocal failed
            with self._lock:
                if rank not in unsettled:
                    return  # an outcome counts once (a refused submit may report it too)
                unsettled.discard(rank)
                failed = failed or error is not None
                last = not unsettled
            if error is not None:
                logger.warning(
                    "XferConnector: could not tell %s rank %d that request %s was read (%s); "
                    "its lease frees it", load.remote_engine_id, rank, load.remote_request_id,
                    error)
            if last:
                if failed:  # gone, or restarted elsewhere: looked up afresh next time
                    self._forget(load.remote_engine_id, load.remote_rendezvous)
                sent.set_result(None)

        if not unsettled:
            sent.set_result(None)
        for rank in range(load.remote_tp_size):
            try:
                peer = self._peer(load.remote_engine_id, rank, load.remote_rendezvous)
                self._engine.submit_send(peer.address, message,
                                         on_done=functools.partial(settled, rank))
            except Exception as e:  # noqa: BLE001 - its lease frees the blocks anyway
                settled(rank, e)

    def _forget(self, engine_id: str, url: str | None = None) -> None:
        """A peer whose reads failed is looked up afresh next time (it may have restarted):
        its records from the rendezvous ``url`` names (another's are not this load's)."""
        where = self._where(url)
        with self._lock:
            for key in [k for k in self._peers if k[:2] == (where, engine_id)]:
                del self._peers[key]

    def _where(self, url: str | None) -> str:
        """The rendezvous a peer's records are looked up in: ``url`` (its side channel, as a
        request or message names it), else the shared one (or this instance's own)."""
        return url or self._options.rendezvous or self._own_url

    def _service(self, url: str | None) -> xfer.Rendezvous:
        """The rendezvous holding a peer's records: its side channel, else the shared one."""
        url = self._where(url)
        with self._lock:
            known = self._services.get(url)
        if known is None:
            # Tried once, never waited for: a request names the side channel, and one that is
            # down must fail that request only, not hold a lookup thread (its lookups still
            # ride out a restart of a service once connected, for their own wait).
            known = self._security.connect(url, connect_timeout=0.0)
            with self._lock:
                known = self._services.setdefault(url, known)
        return known

    def _peer(self, engine_id: str, rank: int, url: str | None = None) -> Peer:
        """``engine_id`` rank ``rank``'s record in the rendezvous ``url`` names (cached per
        rendezvous: one named by another request is never this one's answer)."""
        where = self._where(url)
        with self._lock:
            known = self._peers.get((where, engine_id, rank))
        if known is not None:
            return known
        key = (where, engine_id, rank)
        with self._lock:
            wait = self._lookup_gate.begin(key, time.monotonic())
        found = False
        try:
            record = self._service(url).lookup(_record_name(engine_id, rank), wait)
            found = True
        except Exception as e:
            if wait:
                raise
            raise LookupError(
                f"{engine_id} rank {rank}: no record found in {where} ({e}); not waited for: "
                + ("the lookup of a record never found here only checks"
                   if not self._lookup_gate.found_before(key) else
                   "its lookups only check during a backoff after a failed wait, and while "
                   "another lookup waits")) from e
        finally:
            with self._lock:
                self._lookup_gate.end(key, wait, found, time.monotonic())
        by_tag = {_layer_tag(name, self.is_draft_layer(name)): name for name in self._layers}
        layers = {}
        drafts = set()
        factors = []
        for key, desc in record["regions"].items():
            version, _, rest = key.partition("-")
            if version == f"v{PROTOCOL}" and rest.startswith(compat.PREFIX):
                factors.append(tuple(rest.split("-", 1)) if "-" in rest else (rest, ""))
                continue
            tag, view = _parse_region_name(key, engine_id)
            # A layer this worker does not have keeps its tag: the layer check names it.
            layers[by_tag.get(tag, tag)] = (desc, view)
            if tag.endswith(_DRAFT):
                drafts.add(by_tag.get(tag, tag))
        peer = Peer(address=bytes(record["addr"]), layers=layers, drafts=drafts,
                    factors=compat.from_tags(factors))
        with self._lock:
            self._peers[(where, engine_id, rank)] = peer
        return peer

    # ---- prefill: freeing ----

    def _proven(self, engine_id: str, rank: int, url: str | None, sender: bytes) -> bool:
        """Whether a message that says it is from ``engine_id`` rank ``rank`` came from that
        worker's engine as its record in the rendezvous ``url`` names it (the one the
        message's request named: a record of that name in another rendezvous proves nothing),
        as far as the transport proves it (where it names no sender, only the token vouches
        for the message)."""
        with self._lock:
            return self._proven_locked(engine_id, rank, url, sender)

    def _proven_locked(self, engine_id: str, rank: int, url: str | None, sender: bytes) -> bool:
        """``_proven``, with ``self._lock`` held."""
        if not sender:
            return True
        peer = self._peers.get((self._where(url), engine_id, rank))
        return peer is not None and peer.address == bytes(sender)

    def _on_message(self, data: bytes, sender: bytes = b"") -> None:
        """Every message to this worker, decoded once (bounded, typed): a malformed one, or
        one whose token or ids are not what this worker offered or waits for, is dropped
        and changes nothing."""
        if bytes(data[:len(_WANT)]) not in _KINDS:
            return
        try:
            kind, header, payload = decode_message(data, _KINDS)
            if kind == _WANT:
                self.push.handle_want(header, payload, time.monotonic(), bytes(sender))
            elif kind == _PUSHED:
                # Its sender is checked against the record the load was planned with.
                self.push.handle_pushed(header, bytes(sender))
            elif kind == _CANCEL:
                self.push.handle_cancel(header, time.monotonic(), bytes(sender))
            elif kind in (_CLAIM, _DONE, _RENEW):
                self._from_reader(kind, header, payload, bytes(sender))
            elif kind == _GRANT:  # a prefill rank's answers: checked against the load's record
                self._granted(header, bytes(sender))
            else:
                self._held(header, bytes(sender))
        except ControlError as e:
            logger.debug("XferConnector: a control message was dropped (%s)", e)

    def _from_reader(self, kind: bytes, header: Header, payload: bytes, sender: bytes = b"") -> None:
        """A reader rank's claim, done or renewal (``xfer.kv.lease``): answered from what this
        rank kept for that request and reader, never from the message's word; the answer goes
        to the engine the transport proved sent it (never to another address it names)."""
        if sender and header.hex_bytes("addr") != sender:
            raise ControlError("a reader's message names another engine's address than its own")
        blocks: tuple[Sequence[int], ...] = ()
        if kind == _CLAIM:
            sizes = header.fields.get("groups")
            if not isinstance(sizes, list) or len(sizes) > 16 or not all(
                    isinstance(n, int) and not isinstance(n, bool) and n >= 0 for n in sizes):
                raise ControlError("a claim's 'groups' is not a list of block counts")
            # 4 bytes an id: a claim may wait here for its request's offer (xfer.kv.lease).
            ids = block_id_array(payload, max_count=MAX_MESSAGE // 4)
            if sum(sizes) != len(ids):
                raise ControlError("a claim's block counts do not add up to its block ids")
            at = 0
            for n in sizes:
                blocks += (ids[at:at + n],)
                at += n
        message = Message(
            {_CLAIM: "claim", _DONE: "done", _RENEW: "renew"}[kind],
            header.text("req", MAX_ID), header.token(),
            Reader(header.text("engine", MAX_ID), header.text("reader", MAX_ID),
                   header.integer("tp", 1, MAX_TP)),
            header.integer("rank", 0, MAX_TP - 1), header.hex_bytes("addr"), blocks)
        with self._lock:
            answer = self._offers.handle(message, time.monotonic())
        if answer is not None:
            self._answer(answer)

    def _answer(self, answer: Answer) -> None:
        """Answers a reader rank's claim or done (its token checked: the address it gave is
        that of a party that knows the request's token)."""
        message = answer.message
        reply = encode_message(_GRANT if message.kind == "claim" else _HELD, {
            "req": message.request, "token": message.token, "engine": self._engine_id,
            "reader": message.reader.request, "rank": self._rank, "ok": answer.ok,
            "why": answer.why})
        try:
            self._engine.submit_send(message.reply_to, reply)
        except Exception as e:  # noqa: BLE001 - the reader's own deadline fails its load
            logger.warning("XferConnector: could not answer %s rank %d about request %s: %s",
                           message.reader.engine, message.rank, message.request, e)

    def _renew(self, load: Load) -> None:
        """Tells the prefill ranks that a decode request still waits for their blocks."""
        message = encode_message(_RENEW, self._reader_header(load))
        for rank in range(load.remote_tp_size):
            try:
                peer = self._peer(load.remote_engine_id, rank, load.remote_rendezvous)
                self._engine.submit_send(peer.address, message)
            except Exception as e:  # noqa: BLE001 - the lease runs out as it would have
                logger.debug("XferConnector: renewal to %s rank %d failed: %s",
                             load.remote_engine_id, rank, e)

    # ---- both ----

    def results(self) -> KVConnectorTransferResults:
        now = time.monotonic()
        with self._lock:
            # The push requests whose blocks are still kept: the others are forgotten.
            kept = self._offers.kept()
            unconfirmed = [k for k, c in self._confirming.items() if now >= c.deadline]
            unconfirmed = [(k, self._confirming.pop(k)) for k in unconfirmed]
            unclaimed = [k for k, c in self._claims.items() if now >= c.deadline]
            unclaimed = [(k, self._claims.pop(k)) for k in unclaimed]
        self.push.poll(now, kept)
        for key, waiting in unconfirmed:
            self._finish_load(waiting.req_id, waiting.load, TimeoutError(
                f"prefill {key[0]} ranks {sorted(waiting.ranks)} did not confirm that they held "
                f"request {key[1]}'s blocks while they were read"))
        for key, claim in unclaimed:
            # Unanswered: the prefill may be gone or restarted at another address under the
            # same id; its record is looked up afresh next time (review M-B).
            self._forget(key[0], claim.load.remote_rendezvous)
            self._tell_done_soon(claim.load)
            self._finish_load(claim.req_id, claim.load, TimeoutError(
                f"prefill {key[0]} ranks {sorted(claim.ranks)} did not answer the claim of "
                f"request {key[1]}'s blocks (nothing was read)"))
        with self._lock:
            read, expired = self._offers.poll(now)
            for r in expired:
                logger.warning("XferConnector: request %s was never read; freed at its lease", r)
            self._stats.data["freed_at_lease"] += len(expired)
            self._stats.data["freed_after_read"] += len(read)
            recved, self._recved = self._recved, set()
            failed, self._failed_recv = self._failed_recv, set()
        return KVConnectorTransferResults(
            finished_sending=read | expired, finished_recving=recved, failed_recving=failed
        )

    def take_stats(self) -> XferConnectorStats:
        with self._lock:
            stats, self._stats = self._stats, XferConnectorStats()
        return stats

    def take_load_errors(self) -> set[int]:
        with self._lock:
            errors, self._load_errors = self._load_errors, set()
        return errors

    def keeping(self) -> int:
        """Requests whose blocks wait for a reader."""
        with self._lock:
            return len(self._offers)

    def close(self) -> None:
        # Bounded by what one message may take (its peer's lookup waits up to
        # lookup_timeout_s; a loaded machine once needed more than 5 s): the prefill's lease
        # frees what is still unsent after that. Looked at again until none is left: a
        # queued `_tell_done` adds its sends when it runs.
        deadline = time.monotonic() + self._options.lookup_timeout_s
        while True:
            with self._lock:
                telling = [f for f in self._telling if not f.done()]
            left = deadline - time.monotonic()
            if not telling or left <= 0:
                break
            concurrent.futures.wait(telling, timeout=left)
        self._lookups.shutdown(wait=False, cancel_futures=True)
        if self._publication is not None:
            self._publication.unpublish()
            self._publication = None
        self._engine.close()


_DRAFT = "d"
"""Ends the tag of a speculative drafter's layer: a peer without that layer still knows it
is not the model's own (the name itself is not published)."""


def _layer_tag(layer: str, draft: bool = False) -> str:
    return f"{zlib.crc32(layer.encode()):08x}{_DRAFT if draft else ''}"


def _region_name(layer: str, view: LayerView, draft: bool = False) -> str:
    """A layer's region name in the record: its tag and its view of the buffer (what a reader
    checks and plans its reads from), in the characters rendezvous names allow."""
    return f"v{PROTOCOL}-{_layer_tag(layer, draft)}-{view.name()}"


def _parse_region_name(name: str, engine_id: str) -> tuple[str, LayerView]:
    version, _, rest = name.partition("-")
    tag, _, view = rest.partition("-")
    if version != f"v{PROTOCOL}" or not tag:
        raise LayoutError(
            f"peer {engine_id} published region {name!r}: not connector protocol {PROTOCOL}"
        )
    return tag, parse_view(view)


def _compat_factors(vllm_config: Any, groups: _Groups) -> dict[str, str]:
    """This instance's compatibility factors (``xfer.kv.compat``) from vLLM's own config
    objects, as NixlConnector hashes them (``compute_nixl_compatibility_hash``), but each kept
    apart so that a mismatch is named; the kernel block size comes from the views registered."""
    import vllm

    model = getattr(vllm_config, "model_config", None)
    cache = getattr(vllm_config, "cache_config", None)
    dtype = str(getattr(cache, "cache_dtype", "auto") or "auto")
    dtype = {"fp8": "fp8_e4m3"}.get(dtype, dtype)  # vLLM's "fp8" is e4m3
    if dtype == "auto":
        dtype = str(getattr(model, "dtype", "auto")).replace("torch.", "")
    try:
        from vllm.distributed.kv_transfer.kv_connector.utils import get_current_attn_backends

        # The model's attention layers' own backends (the platform's choice where there are
        # none, as NixlConnector does).
        backends = ".".join(sorted({b.get_name() for b in get_current_attn_backends(vllm_config)}))
    except Exception as e:  # noqa: BLE001 - no backend for this config on this platform
        backends = f"unknown.{type(e).__name__}"
    speculative = compat.NO_DRAFTER
    spec = getattr(vllm_config, "speculative_config", None)
    draft = getattr(spec, "draft_model_config", None)
    if spec is not None and draft is not None:
        draft_dtype = getattr(spec, "kv_cache_dtype", None) or dtype
        speculative = f"{spec.method}.{draft.model}.{draft_dtype}"
    return {
        "vllm": str(vllm.__version__),
        "cache_dtype": dtype,
        "block_size": "_".join(str(b) for b in groups.block_sizes),
        "attention_backend": backends,
        "kv_cache_groups": "_".join(groups.kinds),
        "speculative": speculative,
    }


def _prompt_tokens(request: Any) -> int:
    return int(getattr(request, "num_prompt_tokens", 0) or len(request.prompt_token_ids))


def _own_rendezvous(options: Options) -> str:
    """Where this instance's workers publish: its side channel, else the shared rendezvous."""
    if options.side_channel:
        return f"xfer://{options.side_channel}"
    assert options.rendezvous is not None
    return options.rendezvous


def _record_name(engine_id: str, rank: int) -> str:
    # Rendezvous names are A-Z a-z 0-9 . _ - (vLLM's engine ids are UUIDs or such names).
    safe = "".join(c if c.isascii() and (c.isalnum() or c in "._-") else "_" for c in engine_id)
    return f"vllm.{safe}.{rank}"


def _total_kv_heads(model: Any) -> int | None:
    """The model's KV heads over all ranks (``None`` without a model config: then each rank's
    share times the TP size, no replicated heads)."""
    try:
        return int(model.get_total_num_kv_heads())
    except Exception:  # noqa: BLE001 - no model config (tests), or one without attention heads
        return None


def _target_layers(model: Any) -> int | None:
    """The model's own layer count (without a drafter's), or None if unknown."""
    try:
        return int(model.get_total_num_hidden_layers())
    except Exception:  # noqa: BLE001 - no model config (a unit test's stand-in)
        return None


def _tp_rank() -> int:
    try:
        from vllm.distributed.parallel_state import get_tensor_model_parallel_rank

        return int(get_tensor_model_parallel_rank())
    except Exception:  # noqa: BLE001 - no TP group: one worker
        return 0
