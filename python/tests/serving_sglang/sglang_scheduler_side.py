"""One SGLang scheduler process's disaggregation side, built as SGLang's ``run_scheduler_process``
and ``Scheduler.init_disaggregation`` build it, for the queue tests (issue 41).

What is SGLang's own: ``load_plugins()`` (the only way xfer gets in: its entry point), the CLI
parser and ``ServerArgs`` with ``--disaggregation-transfer-backend xfer``, ``publish`` of the
runtime context, the process groups (``init_distributed_environment`` and
``initialize_model_parallel`` over gloo), the bootstrap server class ``get_kv_class`` names, the
memory pools (``MHATokenToKVPool``, ``PagedTokenToKVPoolAllocator``, ``ReqToTokenPool`` /
``DecodeReqToTokenPool``), the tree cache (``UnifiedRadixCache`` through SGLang's registry,
radix cache disabled), ``MetadataBuffers`` and ``ReqToMetadataIdxAllocator``, the queues
(``PrefillBootstrapQueue``, ``DecodePreallocQueue``, ``DecodeTransferQueue``), which build their
``KVArgs`` and the manager themselves, ``Req``, and the disaggregation mixins' methods
(``pop_bootstrapped``, ``resolve_waiting_queue_bootstrap``, ``send_kv_chunk``,
``process_disagg_prefill_inflight_queue``, ``process_decode_queue``).

What is not: the ``Scheduler`` object itself (it loads a model and its runner at construction)
— a ``Scheduler``-shaped holder of the pieces above, inheriting the mixins as SGLang's own
queue tests do (``_MockDecodeScheduler(SchedulerDisaggregationDecodeMixin)``) — and the
model's forward: the prefill writes known bytes into the KV pool where its allocation put the
request's tokens, and samples a fixed first token.
"""

from __future__ import annotations

import argparse
from array import array
import socket
import time
from types import SimpleNamespace

LAYERS, HEADS, HEAD_DIM, PAGE = 2, 2, 8, 4
POOL_TOKENS = 1024
WAIT = 60.0


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def until(what, cond, seconds=WAIT, step=None):
    """Calls ``step`` (a scheduler-loop iteration) until ``cond`` holds, for at most
    ``seconds``."""
    deadline = time.monotonic() + seconds
    while True:
        if step is not None:
            step()
        if cond():
            return
        if time.monotonic() > deadline:
            raise TimeoutError(f"timed out waiting for {what}")
        time.sleep(0.002)


class Outputs:
    """Where the scheduler streams finished and aborted requests (to the detokenizer)."""

    def __init__(self):
        self.streamed = []

    def stream_output(self, reqs, return_logprob=False, *args, **kwargs):
        self.streamed.extend(reqs)


def _standin_parts():
    """The scheduler members the queues read that are not memory, the context or requests
    (metrics off, no LoRA, no speculative decoding, no HiSparse/HiCache)."""
    from unittest.mock import MagicMock

    from sglang.srt.speculative.spec_info import SpeculativeAlgorithm

    return dict(
        output_streamer=Outputs(),
        metrics_reporter=SimpleNamespace(enable_metrics=False, kv_transfer_latency_ms=None,
                                         kv_transfer_speed_gb_s=None),
        metrics_collector=MagicMock(),
        spec_algorithm=SpeculativeAlgorithm.NONE,
        enable_priority_scheduling=False,
        enable_hisparse=False,
        enable_lora=False,
        enable_decode_hicache=False,
        enable_overlap=False,
        rust_server=None,
        scheduler_stage_metrics=None,
        kv_shard_widening=1,
        processed_tokens_counter=0,
        random_seed=0,
        waiting_queue=[],
        chunked_req=None,
        last_batch=None,
        sliding_window_size=None,
        schedule_low_priority_values_first=False,
        running_batch=SimpleNamespace(reqs=[], batch_is_full=False),
        model_config=SimpleNamespace(num_hidden_layers=LAYERS,
                                     get_total_num_kv_heads=lambda: HEADS,
                                     hf_text_config=None, hf_config=None),
    )


def result_processor(s):
    """SGLang's batch result processor (the decode's transfer queue accounts the handoff
    token through it), on this scheduler's pieces; a model without reasoning tokens."""
    import dataclasses

    from sglang.srt.disaggregation.utils import DisaggregationMode
    from sglang.srt.managers.scheduler_components.batch_result_processor import (
        SchedulerBatchResultProcessor,
    )

    fields = {f.name: None for f in dataclasses.fields(SchedulerBatchResultProcessor)}
    fields.update(
        is_generation=True, disaggregation_mode=DisaggregationMode.DECODE, enable_overlap=False,
        enable_overlap_mlx=False,
        model_config=SimpleNamespace(self_opened_think_start_ids=None, think_end_ids=None),
        token_to_kv_pool_allocator=s.token_to_kv_pool_allocator, tree_cache=s.tree_cache,
        req_to_token_pool=s.req_to_token_pool, metrics_collector=s.metrics_collector,
        metrics_reporter=s.metrics_reporter, output_streamer=s.output_streamer)
    return SchedulerBatchResultProcessor(**fields)


def server_args(mode: str, bootstrap_port: int, extra=()):
    """The ``ServerArgs`` SGLang's CLI makes of these flags, after ``load_plugins()`` (what
    ``run_scheduler_process`` runs first) let xfer add itself as a transfer backend."""
    from sglang.srt.plugins import load_plugins
    from sglang.srt.server_args import ServerArgs

    load_plugins()
    parser = argparse.ArgumentParser()
    ServerArgs.add_cli_args(parser)
    args = parser.parse_args([
        "--model-path", "dummy", "--device", "cpu", "--host", "127.0.0.1",
        "--disaggregation-mode", mode, "--disaggregation-transfer-backend", "xfer",
        "--disaggregation-bootstrap-port", str(bootstrap_port),
        "--page-size", str(PAGE), "--disable-radix-cache", "--num-reserved-decode-tokens", "16",
        *extra,
    ])
    return ServerArgs.from_cli_args(args)


def context(args, world_rank: int, world_size: int, dist_port: int):
    """``publish`` as ``run_scheduler_process`` does, then the process groups as the model
    runner builds them (gloo: this is a CPU)."""
    from sglang.srt.distributed.parallel_state import (
        init_distributed_environment,
        initialize_model_parallel,
    )
    from sglang.srt.runtime_context import SpawnRanks, publish

    publish(args, role="scheduler", ranks=SpawnRanks(world_rank=world_rank))
    if world_size > 1:
        # A TP group of more than one rank needs a GPU here: initialize_model_parallel builds
        # it with a PyNcclCommunicator (torch.cuda.device: "Expected a cuda device, but got:
        # cpu" in SGLang 0.5.23's PyPI build). Under DP attention the queues only use the
        # attention-TP and -CP groups, one rank each: this process's own gloo world of one
        # stands in for them, the published ranks (TP rank, attention-DP rank) are SGLang's.
        import torch.distributed as dist

        dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{free_port()}",
                                rank=0, world_size=1)
        return
    init_distributed_environment(backend="gloo", world_size=world_size, rank=world_rank,
                                 local_rank=0,
                                 distributed_init_method=f"tcp://127.0.0.1:{dist_port}")
    initialize_model_parallel(backend="gloo")


def memory(decode: bool, requests: int = 8):
    """The pools and the tree cache, at this model's shape (2 layers, 2 KV heads of 8, bf16,
    4-token pages)."""
    import torch
    from sglang.srt.disaggregation.decode import DecodeReqToTokenPool
    from sglang.srt.mem_cache.allocator.paged import PagedTokenToKVPoolAllocator
    from sglang.srt.mem_cache.cache_init_params import CacheInitParams
    from sglang.srt.mem_cache.memory_pool import MHATokenToKVPool, ReqToTokenPool
    from sglang.srt.mem_cache.unified_cache.components import ComponentType
    from sglang.srt.mem_cache.unified_radix_cache import UnifiedRadixCache

    kv = MHATokenToKVPool(POOL_TOKENS, page_size=PAGE, dtype=torch.bfloat16, head_num=HEADS,
                          head_dim=HEAD_DIM, layer_num=LAYERS, device="cpu",
                          enable_memory_saver=False)
    allocator = PagedTokenToKVPoolAllocator(POOL_TOKENS, PAGE, torch.bfloat16, "cpu", kv,
                                            need_sort=False)
    if decode:
        req_to_token = DecodeReqToTokenPool(size=requests, max_context_len=128, device="cpu",
                                            enable_memory_saver=False, pre_alloc_size=requests)
    else:
        req_to_token = ReqToTokenPool(size=requests, max_context_len=128, device="cpu",
                                      enable_memory_saver=False)
    params = CacheInitParams(disable=True, req_to_token_pool=req_to_token,
                             token_to_kv_pool_allocator=allocator, page_size=PAGE,
                             tree_components=(ComponentType.FULL,))
    return kv, allocator, req_to_token, UnifiedRadixCache(params)


def metadata(size: int):
    import torch
    from sglang.srt.disaggregation.utils import MetadataBuffers, ReqToMetadataIdxAllocator

    # The sizes init_disaggregation uses without speculative decoding.
    return (ReqToMetadataIdxAllocator(size),
            MetadataBuffers(size, hidden_size=16, hidden_states_dtype=torch.float32,
                            max_sampling_mask_tokens=16))


def make_req(rid: str, prompt, host: str, port: int, room: int, dp_rank=None):
    from sglang.srt.managers.schedule_batch import Req
    from sglang.srt.sampling.sampling_params import SamplingParams

    params = SamplingParams(max_new_tokens=4)
    params.normalize(None)
    return Req(rid, "", array("q", prompt), params, bootstrap_host=host, bootstrap_port=port,
               bootstrap_room=room, disagg_prefill_dp_rank=dp_rank)


def prefill_side(bootstrap_port: int, world_rank=0, world_size=1, dist_port=None, extra=()):
    """A prefill scheduler's disaggregation half: its bootstrap queue (which makes the xfer
    manager), inflight queue and the pools."""
    from sglang.srt.disaggregation.prefill import (
        PrefillBootstrapQueue,
        SchedulerDisaggregationPrefillMixin,
    )
    from sglang.srt.disaggregation.utils import TransferBackend
    from sglang.srt.managers.scheduler import Scheduler
    from sglang.srt.runtime_context import get_disagg, get_parallel

    args = server_args("prefill", bootstrap_port, extra)
    context(args, world_rank, world_size, dist_port or free_port())

    class PrefillScheduler(SchedulerDisaggregationPrefillMixin):
        _release_aborted_request = Scheduler._release_aborted_request

    s = PrefillScheduler()
    s.__dict__.update(_standin_parts())
    s.server_args = args
    kv, s.token_to_kv_pool_allocator, s.req_to_token_pool, s.tree_cache = memory(decode=False)
    s.kv = kv
    s.tp_worker = SimpleNamespace(model_runner=SimpleNamespace(
        effective_logical_max_total_num_tokens=POOL_TOKENS, kv_cache_dtype_str="auto"),
        is_hybrid_swa=False)
    if world_size > 1:  # DP attention: see context()
        import torch.distributed as dist

        s.attn_tp_cpu_group = s.attn_cp_cpu_group = dist.group.WORLD
    else:
        parallel = get_parallel()
        s.attn_tp_cpu_group = parallel.attn_tp_group.cpu_group
        s.attn_cp_cpu_group = parallel.attn_cp_group.cpu_group
    s.req_to_metadata_buffer_idx_allocator, s.disagg_metadata_buffers = metadata(16)
    s.transfer_backend = TransferBackend(get_disagg().disaggregation_transfer_backend)
    s.disagg_prefill_bootstrap_queue = PrefillBootstrapQueue(
        token_to_kv_pool=kv, draft_token_to_kv_pool=None,
        req_to_metadata_buffer_idx_allocator=s.req_to_metadata_buffer_idx_allocator,
        metadata_buffers=s.disagg_metadata_buffers, gpu_id=0,
        bootstrap_port=get_disagg().disaggregation_bootstrap_port,
        max_total_num_tokens=POOL_TOKENS, scheduler=s,
        scheduler_stage_metrics=None, transfer_backend=s.transfer_backend)
    s.disagg_prefill_inflight_queue = []
    s.disagg_prefill_pending_chunk_rids = set()
    s.enable_staging = False
    return s


def decode_side(bootstrap_port: int, extra=()):
    """A decode scheduler's disaggregation half: prealloc and transfer queues (the prealloc
    queue makes the xfer manager) and the pools."""
    from sglang.srt.disaggregation.decode import (
        DecodePreallocQueue,
        DecodeTransferQueue,
        SchedulerDisaggregationDecodeMixin,
    )
    from sglang.srt.disaggregation.utils import TransferBackend
    from sglang.srt.runtime_context import get_disagg

    args = server_args("decode", bootstrap_port, extra)
    context(args, 0, 1, free_port())

    class DecodeScheduler(SchedulerDisaggregationDecodeMixin):
        pass

    s = DecodeScheduler()
    s.__dict__.update(_standin_parts())
    s.server_args = args
    s.kv, s.token_to_kv_pool_allocator, s.req_to_token_pool, s.tree_cache = memory(decode=True)
    s.tp_worker = SimpleNamespace(model_runner=SimpleNamespace(kv_cache_dtype_str="auto"),
                                  is_hybrid_swa=False)
    s.req_to_metadata_buffer_idx_allocator, s.disagg_metadata_buffers = metadata(16)
    s.batch_result_processor = result_processor(s)
    s.disagg_decode_prealloc_queue = None
    s.disagg_decode_transfer_queue = DecodeTransferQueue(
        req_to_metadata_buffer_idx_allocator=s.req_to_metadata_buffer_idx_allocator,
        metadata_buffers=s.disagg_metadata_buffers, scheduler=s, tree_cache=s.tree_cache)
    s.disagg_decode_prealloc_queue = DecodePreallocQueue(
        req_to_token_pool=s.req_to_token_pool,
        token_to_kv_pool_allocator=s.token_to_kv_pool_allocator, draft_token_to_kv_pool=None,
        req_to_metadata_buffer_idx_allocator=s.req_to_metadata_buffer_idx_allocator,
        metadata_buffers=s.disagg_metadata_buffers, scheduler=s,
        transfer_queue=s.disagg_decode_transfer_queue, tree_cache=s.tree_cache, gpu_id=0,
        bootstrap_port=get_disagg().disaggregation_bootstrap_port,
        max_total_num_tokens=POOL_TOKENS,
        num_reserved_decode_tokens=get_disagg().num_reserved_decode_tokens,
        transfer_backend=TransferBackend(get_disagg().disaggregation_transfer_backend))
    return s


def forward(s, req, upto: int, first_token: int, seed: int):
    """Stands in for the model's forward over ``req``'s prompt up to ``upto`` (SGLang's
    ``alloc_for_extend`` and the attention layers' KV writes need a batch and a model): the
    request's tokens get slots from the real allocator the first time, and every layer's K and
    V at the new tokens get bytes derived from ``seed``; the last chunk samples
    ``first_token``."""
    import torch

    n = len(req.origin_input_ids)
    if not req.kv.holds_kv:
        # As alloc_for_extend allocates a fresh request's prompt (and the decode queue its
        # destination): one row, then the tokens through the paged allocator.
        s.req_to_token_pool.alloc([req])
        t = lambda v: torch.tensor([v], dtype=torch.int64)  # noqa: E731
        locs = s.token_to_kv_pool_allocator.alloc_extend(
            prefix_lens=t(0), prefix_lens_cpu=t(0), seq_lens=t(n), seq_lens_cpu=t(n),
            last_loc=t(-1), extend_num_tokens=n)
        assert locs is not None, "the KV pool is full"
        s.req_to_token_pool.write((req.kv.req_pool_idx, slice(0, n)), locs)
        req.kv.kv_allocated_len = n
    start = req.extend_end or 0
    locs = s.req_to_token_pool.req_to_token[req.kv.req_pool_idx, start:upto].long()
    g = torch.Generator().manual_seed(seed * 1000 + start)
    for layer in range(LAYERS):
        for buf in (s.kv.k_buffer[layer], s.kv.v_buffer[layer]):
            buf[locs] = torch.randn(len(locs), HEADS, HEAD_DIM, generator=g).to(buf.dtype)
    req.kv.kv_committed_len = upto
    req.extend_end = upto
    if upto >= n:
        req.output_ids.append(first_token)


def request_pages(s, req, n_tokens: int):
    """Every layer's K and V bytes at ``req``'s first ``n_tokens``, in token order."""
    return pages_at(s, s.req_to_token_pool.req_to_token[req.kv.req_pool_idx, :n_tokens])


def pages_at(s, locs):
    """Every layer's K and V bytes at token slots ``locs``."""
    import torch

    locs = locs.long()
    return [buf[locs].reshape(-1).view(torch.uint8).clone()
            for layer in range(LAYERS) for buf in (s.kv.k_buffer[layer], s.kv.v_buffer[layer])]


def pages_free(s, locs) -> bool:
    """Whether the KV allocator holds every page of ``locs`` as free (could hand it out)."""
    free = set(s.token_to_kv_pool_allocator.get_all_free_pages().tolist())
    return all(p in free for p in set((locs.long() // PAGE).tolist()))

