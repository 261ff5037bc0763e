"""XferConnector driven the way a vLLM engine core drives it (issue 41), on a CPU-only machine.

Each instance is vLLM's own ``Scheduler`` (which makes the scheduler-side connector itself,
from the config) over the KV cache config ``get_kv_cache_configs`` computed, and per TP rank a
worker-side connector over the tensors ``allocate_kv_cache`` allocated. A step is what
``EngineCore.step`` does: ``schedule()``, then on every rank the model runner's own KV
connector hooks (``KVConnectorModelRunnerMixin._get_kv_connector_output``, inside a forward
context; each attention layer's ``save_kv_layer``), the ranks' outputs merged by vLLM's
``KVOutputAggregator``, and ``update_from_output``. Only the forward pass itself is left
out (the wheel has no CPU kernels): the prefill's KV is in its blocks from the start, and each
request samples token 7 once its prompt is computed (a chunk of a longer prompt samples
nothing, as in vLLM's model runner).
"""

import os

os.environ.setdefault("VLLM_TARGET_DEVICE", "cpu")

import sys
import tempfile
import time
from pathlib import Path

import pytest

vllm = pytest.importorskip("vllm")

import torch  # noqa: E402
from vllm.config import (  # noqa: E402
    CacheConfig,
    DeviceConfig,
    KVTransferConfig,
    ParallelConfig,
    SchedulerConfig,
    VllmConfig,
)
from vllm.distributed.kv_transfer import kv_transfer_state  # noqa: E402
from vllm.distributed.kv_transfer.kv_connector.factory import KVConnectorFactory  # noqa: E402
from vllm.distributed.kv_transfer.kv_connector.utils import KVOutputAggregator  # noqa: E402
from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorRole  # noqa: E402
from vllm.forward_context import set_forward_context  # noqa: E402
from vllm.sampling_params import SamplingParams  # noqa: E402
from vllm.v1.core.sched.scheduler import Scheduler  # noqa: E402
from vllm.v1.outputs import ModelRunnerOutput  # noqa: E402
from vllm.v1.request import Request  # noqa: E402
from vllm.v1.structured_output import StructuredOutputManager  # noqa: E402
from vllm.v1.worker.kv_connector_model_runner_mixin import (  # noqa: E402
    KVConnectorModelRunnerMixin,
)

import xfer  # noqa: E402
import xfer.vllm  # noqa: E402

sys.path.insert(0, str(Path(__file__).parent))
import vllm_caches  # noqa: E402

MOCK = {"backend": "mock", "groups": [{"nics": ["mock0"]}], "timeouts": {"transfer_ms": 2000}}
BLOCK, BLOCKS, TOKEN = 32, 24, 7  # the CPU attention backend takes blocks of 32 tokens
PROMPT = 40
PROMPT_BLOCKS = -(-PROMPT // BLOCK)
WAIT = 20.0
LIVE: set = set()
"""The engines of the running test (each steps while it has work: `Engine.run_until`)."""


@pytest.fixture(scope="module")
def server():
    s = xfer.Server()
    yield s
    s.close()


@pytest.fixture(scope="module")
def model():
    directory = Path(tempfile.mkdtemp())
    vllm_caches.write_model(directory, num_hidden_layers=2, num_key_value_heads=4,
                            num_attention_heads=8, hidden_size=64)
    return vllm_caches.load_model_config(directory)


class Engine:
    """One vLLM instance as its engine core runs it (see the module docs)."""

    def __init__(self, engine_id, server, model, tp=1, extra=None, on_load_failure="fail",
                 connector="xfer", sliding=None, max_model_len=64, block=BLOCK,
                 backend="CPU_ATTN"):
        """``sliding``: layer index → the window (tokens) of a sliding-window layer;
        ``block``: ``--block-size``; ``backend``: the attention backend whose class decides the
        kernel block size (and the layout)."""
        names = [f"model.layers.{i}.self_attn.attn" for i in range(model.hf_config.num_hidden_layers)]
        sliding = {names[i]: window for i, window in (sliding or {}).items()}
        if connector == "xfer":
            extra = {"rendezvous": server.url, "xfer_config": MOCK, "lookup_timeout_s": 2.0,
                     **(extra or {})}
            kinds = {"kv_connector": "XferConnector", "kv_connector_module_path": "xfer.vllm"}
        else:  # vLLM's own NixlConnector, on UCX over host memory: the control
            extra = {"backends": ["UCX"], **(extra or {})}
            kinds = {"kv_connector": "NixlConnector", "kv_buffer_device": "cpu"}
            # Each instance's scheduler serves its own side channel.
            os.environ["VLLM_NIXL_SIDE_CHANNEL_PORT"] = str(free_port())

        def config(rank):
            return VllmConfig(
                model_config=model,
                cache_config=CacheConfig(block_size=block, enable_prefix_caching=False),
                scheduler_config=SchedulerConfig(max_num_seqs=8, max_num_batched_tokens=256,
                                                 max_model_len=max_model_len,
                                                 is_encoder_decoder=False),
                parallel_config=ParallelConfig(tensor_parallel_size=tp),
                device_config=DeviceConfig("cpu"),
                kv_transfer_config=KVTransferConfig(
                    **kinds, kv_role="kv_both", engine_id=engine_id,
                    kv_load_failure_policy=on_load_failure,
                    kv_connector_extra_config={**extra, "tp_size": tp, "tp_rank": rank}
                    if connector == "xfer" else extra),
            )

        self.configs = [config(r) for r in range(tp)]
        self.workers, self.ranks = [], []
        gen = torch.Generator().manual_seed(hash(engine_id) % 2**31)
        for c in self.configs:
            kv_cache_config, caches = vllm_caches.allocate(c, names, BLOCKS, backend,
                                                           sliding=sliding)
            for cache in caches.values():
                raw = cache.view(torch.uint8)
                raw.copy_(torch.randint(0, 64, raw.shape, generator=gen, dtype=torch.uint8))
            worker = KVConnectorFactory.create_connector(c, KVConnectorRole.WORKER, kv_cache_config)
            worker.register_kv_caches(caches)
            self.workers.append(worker)
            self.ranks.append(caches)
        first = self.configs[0]
        first.cache_config.num_gpu_blocks = kv_cache_config.num_blocks
        self.kv_cache_config = kv_cache_config
        self.scheduler = Scheduler(vllm_config=first, kv_cache_config=kv_cache_config,
                                   structured_output_manager=StructuredOutputManager(first),
                                   block_size=block, log_stats=True)
        # As EngineCore._set_kv_connector_handshake_metadata: the workers' handshake
        # metadata (NixlConnector's; xfer publishes in its rendezvous instead), keyed by
        # (pp rank, tp rank), handed to the scheduler-side connector.
        handshakes = {(0, rank): md for rank, w in enumerate(self.workers)
                      if (md := w.get_handshake_metadata()) is not None}
        if handshakes:
            self.scheduler.get_kv_connector().set_xfer_handshake_metadata_pp_aware(handshakes)
        self.aggregator = KVOutputAggregator.from_connector(self.workers[0], tp)
        self.outputs = {}
        LIVE.add(self)
        self.blocks = {}
        """Request id → its blocks, as the scheduler allocated them (while it ran)."""
        self.layer_done = None
        """Called on each rank's model runner after each layer of the forward (a test's
        stand-in for the time a GPU forward takes to reach the next)."""
        self.group_blocks = {}
        """Request id → its blocks in each KV cache group, when it was first scheduled."""
        """Request id → its engine core outputs (tokens, finish reason, kv_transfer_params)."""

    def add(self, req_id, tokens, max_tokens, params):
        self.scheduler.add_request(Request(
            req_id, list(range(1, tokens + 1)),
            SamplingParams(max_tokens=max_tokens, ignore_eos=True,
                           extra_args={"kv_transfer_params": params}), None))

    def step(self):
        out = self.scheduler.schedule()
        for req_id in out.num_scheduled_tokens:
            groups = self.scheduler.kv_cache_manager.get_block_ids(req_id)
            self.blocks[req_id] = list(groups[0])
            self.group_blocks.setdefault(req_id, [list(g) for g in groups])
        # As vLLM's model runner: a request whose prompt is not computed yet (a chunk of it was)
        # samples nothing. The scheduler counted this step's tokens as computed already.
        requests = self.scheduler.requests
        sampling = {r for r in out.num_scheduled_tokens
                    if requests[r].num_computed_tokens >= requests[r].num_prompt_tokens}
        runs = [self._run(rank, out, sampling) for rank in range(len(self.workers))]
        merged = self.aggregator.aggregate(runs)
        for outputs in self.scheduler.update_from_output(out, merged).values():
            for o in outputs.outputs:
                self.outputs.setdefault(o.request_id, []).append(o)

    def _run(self, rank, out, sampling):
        """One rank's model runner for one step: its connector through vLLM's hooks; a token
        sampled for each request in ``sampling``."""
        worker, config = self.workers[rank], self.configs[rank]
        kv_transfer_state._KV_CONNECTOR_AGENT = worker
        try:
            reqs = list(out.num_scheduled_tokens)
            if not reqs:
                return KVConnectorModelRunnerMixin.kv_connector_no_forward(out, config)
            with set_forward_context(None, config), \
                    KVConnectorModelRunnerMixin._get_kv_connector_output(out) as kv_output:
                for name, cache in self.ranks[rank].items():  # the forward pass's layers
                    worker.save_kv_layer(name, cache, None)
                    if self.layer_done is not None:
                        self.layer_done(rank, name)
            return ModelRunnerOutput(req_ids=reqs, req_id_to_index={r: i for i, r in enumerate(reqs)},
                                     sampled_token_ids=[[TOKEN] if r in sampling else []
                                                        for r in reqs],
                                     kv_connector_output=kv_output)
        finally:
            kv_transfer_state._KV_CONNECTOR_AGENT = None

    def run_until(self, what, cond):
        """Steps this engine until ``cond``; every other live engine steps meanwhile while it
        has work, as each engine core's busy loop does (``Scheduler.has_requests``: a finished
        request whose blocks wait for their reader keeps its engine stepping)."""
        deadline = time.monotonic() + WAIT
        while not cond():
            assert time.monotonic() < deadline, f"timed out waiting for {what}"
            self.step()
            for other in list(LIVE):
                if other is not self and other.scheduler.has_requests():
                    other.step()
            time.sleep(0.001)

    def finished(self, req_id):
        return any(o.finish_reason is not None for o in self.outputs.get(req_id, []))

    def tokens(self, req_id):
        return [t for o in self.outputs.get(req_id, []) for t in o.new_token_ids]

    def free_blocks(self):
        return self.scheduler.kv_cache_manager.block_pool.get_num_free_blocks()

    def gathered(self):
        return {name: torch.cat([caches[name].view(torch.uint8) for caches in self.ranks], dim=1)
                for name in self.ranks[0]}

    def close(self):
        LIVE.discard(self)
        for worker in self.workers:
            worker.shutdown()
        self.scheduler.shutdown()


def one_process_group():
    """vLLM's distributed state for one process (NixlConnector's worker asks for its TP
    rank through it; xfer's takes it from its config)."""
    from vllm.config import set_current_vllm_config
    from vllm.distributed import parallel_state

    if parallel_state.model_parallel_is_initialized():
        return
    with set_current_vllm_config(VllmConfig()):
        parallel_state.init_distributed_environment(
            world_size=1, rank=0, local_rank=0, backend="gloo",
            distributed_init_method=f"tcp://127.0.0.1:{free_port()}")
        parallel_state.ensure_model_parallel_initialized(1, 1)


def free_port():
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.mark.parametrize("connector,decode_tp,prefill_tp",
                         [("xfer", 1, 1), ("xfer", 2, 1), ("xfer", 1, 2), ("nixl", 1, 1)])
def test_a_request_prefilled_by_one_scheduler_is_decoded_by_another(server, model, connector,
                                                                    decode_tp, prefill_tp):
    """``nixl``: vLLM's own NixlConnector through the same harness, the control (where it
    passes and xfer fails, the defect is xfer's)."""
    if connector == "nixl":
        pytest.importorskip("nixl._api", reason="NIXL (the control) is not installed")
        one_process_group()
    tag = f"{connector}{decode_tp}x{prefill_tp}"
    p = Engine(f"sched-p{tag}", server, model, tp=prefill_tp, connector=connector)
    d = Engine(f"sched-d{tag}", server, model, tp=decode_tp, connector=connector)
    free_p, free_d = p.free_blocks(), d.free_blocks()
    # The proxy's request to the prefill instance: one token, the KV handed off.
    p.add("r", PROMPT, 1, {"do_remote_decode": True})
    p.run_until("the prefill", lambda: p.finished("r"))
    [done] = [o for o in p.outputs["r"] if o.finish_reason is not None]
    params = done.kv_transfer_params
    remote = params["remote_block_ids"]
    remote = remote[0] if remote and isinstance(remote[0], list) else remote  # NIXL: per group
    assert params["do_remote_prefill"] and len(remote) == PROMPT_BLOCKS
    assert p.free_blocks() < free_p, "the blocks are kept for the reader"
    # The proxy's request to the decode instance, with the prefill's parameters.
    d.add("r-d", PROMPT, 3, params)
    d.run_until("the decoded tokens", lambda: d.finished("r-d"))
    assert d.tokens("r-d") == [TOKEN] * 3, "decoded from the loaded KV, not recomputed"
    theirs, ours = p.gathered(), d.gathered()
    blocks_d = d.blocks["r-d"][:PROMPT_BLOCKS]  # the prompt's blocks, where the KV was loaded
    for name in theirs:
        assert torch.equal(ours[name][blocks_d], theirs[name][remote]), name
    p.run_until("the prefill to free the blocks once read", lambda: p.free_blocks() == free_p)
    d.run_until("the decode to free its blocks", lambda: d.free_blocks() == free_d)
    p.close(), d.close()


def test_a_prompt_prefilled_in_chunks_is_handed_off_whole(server):
    """A prompt longer than one step's token budget (256) is prefilled in chunks: the request
    is handed off once its last chunk is computed, with every prompt block, and decoded from
    them."""
    prompt = 300
    blocks = -(-prompt // BLOCK)
    directory = Path(tempfile.mkdtemp())
    vllm_caches.write_model(directory, num_hidden_layers=2, num_key_value_heads=4,
                            num_attention_heads=8, hidden_size=64)
    model = vllm_caches.load_model_config(directory, max_model_len=prompt + 64)
    p = Engine("sched-p-chunks", server, model, max_model_len=prompt + 64)
    d = Engine("sched-d-chunks", server, model, max_model_len=prompt + 64)
    free_p, free_d = p.free_blocks(), d.free_blocks()
    p.add("r", prompt, 1, {"do_remote_decode": True})
    p.run_until("the prefill", lambda: p.finished("r"))
    [done] = [o for o in p.outputs["r"] if o.finish_reason is not None]
    params = done.kv_transfer_params
    [remote] = params["remote_block_ids"]
    assert len(remote) == blocks, "every prompt block, not the first chunk's"
    d.add("r-d", prompt, 2, params)
    d.run_until("the decoded tokens", lambda: d.finished("r-d"))
    assert d.tokens("r-d") == [TOKEN] * 2, "decoded from the loaded KV, not recomputed"
    theirs, ours = p.gathered(), d.gathered()
    for name in theirs:
        assert torch.equal(ours[name][d.blocks["r-d"][:blocks]], theirs[name][remote]), name
    p.run_until("the prefill to free the blocks once read", lambda: p.free_blocks() == free_p)
    d.run_until("the decode to free its blocks", lambda: d.free_blocks() == free_d)
    p.close(), d.close()


@pytest.mark.parametrize("connector,policy",
                         [("xfer", "recompute"), ("xfer", "fail"), ("nixl", "fail")])
def test_a_failed_load_is_recomputed_or_failed_by_the_schedulers_policy(server, model, connector,
                                                                       policy):
    """A prefill that vanished after handing off: by vLLM's kv_load_failure_policy the decode
    scheduler recomputes the prompt itself, or fails the request — never decodes garbage."""
    if connector == "nixl":
        pytest.importorskip("nixl._api", reason="NIXL (the control) is not installed")
        one_process_group()
    p = Engine(f"sched-pf{connector}{policy}", server, model, connector=connector)
    d = Engine(f"sched-df{connector}{policy}", server, model, on_load_failure=policy,
               connector=connector)
    p.add("r", PROMPT, 1, {"do_remote_decode": True})
    p.run_until("the prefill", lambda: p.finished("r"))
    [done] = [o for o in p.outputs["r"] if o.finish_reason is not None]
    p.close()
    d.add("r-d", PROMPT, 3, done.kv_transfer_params)
    d.run_until("the request to end", lambda: d.finished("r-d"))
    [end] = [o for o in d.outputs["r-d"] if o.finish_reason is not None]
    if policy == "recompute":
        assert d.tokens("r-d") == [TOKEN] * 3
    else:
        assert d.tokens("r-d") == [] and end.finish_reason.name == "ERROR"
    d.close()


@pytest.fixture(scope="module")
def hybrid_model():
    directory = Path(tempfile.mkdtemp())
    vllm_caches.write_model(directory, num_hidden_layers=4, num_key_value_heads=4,
                            num_attention_heads=8, hidden_size=64)
    return vllm_caches.load_model_config(directory, max_model_len=256)


@pytest.mark.parametrize("connector", ["xfer", "nixl"])
def test_a_hybrid_model_moves_its_full_and_sliding_window_layers(server, hybrid_model, connector):
    """vLLM's hybrid allocator (``SupportsHMA``): layers 1 and 3 attend to a 32-token window,
    so vLLM gives them a KV cache group of their own that holds only the window's blocks (it
    keeps the allocator on only for a connector that declares it; without, every sliding layer
    holds the whole prompt). The decode's full-attention layers get every block of the prompt,
    its sliding-window layers the blocks the window still reaches, each byte-equal to the
    prefill's; the blocks vLLM dropped from the window are not read."""
    if connector == "nixl":
        pytest.importorskip("nixl._api", reason="NIXL (the control) is not installed")
        one_process_group()
    prompt, window = 200, 32
    blocks = -(-prompt // BLOCK)
    args = dict(sliding={1: window, 3: window}, max_model_len=256, connector=connector)
    p = Engine(f"sched-hp{connector}", server, hybrid_model, **args)
    d = Engine(f"sched-hd{connector}", server, hybrid_model, **args)
    groups = d.kv_cache_config.kv_cache_groups
    assert len(groups) == 2, "vLLM kept its hybrid allocator on for this connector"
    free_p, free_d = p.free_blocks(), d.free_blocks()
    p.add("r", prompt, 1, {"do_remote_decode": True})
    p.run_until("the prefill", lambda: p.finished("r"))
    [done] = [o for o in p.outputs["r"] if o.finish_reason is not None]
    params = done.kv_transfer_params
    d.add("r-d", prompt, 3, params)
    d.run_until("the decoded tokens", lambda: d.finished("r-d"))
    assert d.tokens("r-d") == [TOKEN] * 3, "decoded from the loaded KV, not recomputed"
    theirs, ours = p.gathered(), d.gathered()
    for index, group in enumerate(groups):
        remote = [b for b in params["remote_block_ids"][index] if b != 0]
        local = [b for b in d.group_blocks["r-d"][index][:blocks] if b != 0]
        sliding = group.kv_cache_spec.__class__.__name__ == "SlidingWindowSpec"
        # The window's blocks (32 tokens from the last prompt token reach one block back).
        want = 2 if sliding else blocks
        assert len(local) >= want and len(remote) >= want, (index, local, remote)
        for name in group.layer_names:
            assert torch.equal(ours[name][local[-want:]], theirs[name][remote[-want:]]), name
    p.run_until("the prefill to free the blocks once read", lambda: p.free_blocks() == free_p)
    d.run_until("the decode to free its blocks", lambda: d.free_blocks() == free_d)
    p.close(), d.close()


@pytest.mark.parametrize("connector", ["xfer", "nixl"])
@pytest.mark.parametrize("block,backend", [(128, "FLASHINFER"), (16, "FLASHINFER"),
                                           (128, "FLASH_ATTN")])
def test_kernel_block_views_move_the_managers_blocks(server, connector, block, backend):
    """Issue 54: at ``--block-size 128`` FlashInfer's kernels take blocks of at most 64 tokens,
    so vLLM's model runner allocates the caches in kernel blocks (``prepare_kernel_block_sizes``
    with the backend's class, ``allocate_kv_cache``) and hands the connector views of
    ``[num_blocks * 2, heads, 64, content]``; the scheduler's block ids count blocks of 128.
    Every manager block the decode was given holds the prefill's bytes (the connector read
    rows ``b`` instead of ``2b, 2b + 1`` and reported zeros as loaded). FLASH_ATTN takes
    multiples of 16: one row per block, the control of the control."""
    from vllm.v1.kv_cache_interface import group_kernel_blocks

    if connector == "nixl":
        pytest.importorskip("nixl._api", reason="NIXL (the control) is not installed")
        if backend == "FLASHINFER":
            # Its worker takes the kernel block size from the platform's attention backends
            # (`_sync_block_size_with_kernel`: CPU_ATTN on this machine), not from the caches
            # it is handed: on a CPU it cannot be told that FlashInfer split them.
            pytest.skip("NixlConnector reads the kernel block size from the platform's "
                        "backend (CPU here): the control cannot run FlashInfer's split")
        one_process_group()
    prompt = 300
    directory = Path(tempfile.mkdtemp())
    vllm_caches.write_model(directory, num_hidden_layers=2, num_key_value_heads=4,
                            num_attention_heads=8, hidden_size=64)
    model = vllm_caches.load_model_config(directory, max_model_len=prompt + 64)
    args = dict(max_model_len=prompt + 64, block=block, backend=backend, connector=connector)
    tag = f"{connector}{block}{backend}"
    p = Engine(f"kb-p{tag}", server, model, **args)
    d = Engine(f"kb-d{tag}", server, model, **args)
    rows = next(iter(p.ranks[0].values())).shape[0] // BLOCKS
    assert rows == (2 if (block, backend) == (128, "FLASHINFER") else 1), "vLLM's own split"
    p.add("r", prompt, 1, {"do_remote_decode": True})
    p.run_until("the prefill", lambda: p.finished("r"))
    [done] = [o for o in p.outputs["r"] if o.finish_reason is not None]
    params = done.kv_transfer_params
    remote = params["remote_block_ids"]
    remote = remote[0] if remote and isinstance(remote[0], list) else remote
    d.add("r-d", prompt, 2, params)
    d.run_until("the decoded tokens", lambda: d.finished("r-d"))
    assert d.tokens("r-d") == [TOKEN] * 2, "decoded from the loaded KV, not recomputed"
    blocks = -(-prompt // block)
    local = d.blocks["r-d"][:blocks]
    for name in p.ranks[0]:
        theirs = group_kernel_blocks(p.ranks[0][name], BLOCKS)
        ours = group_kernel_blocks(d.ranks[0][name], BLOCKS)
        assert torch.equal(ours[local], theirs[remote[:blocks]]), name
        assert ours[local].any(), "not the zeros of a fresh cache"
    p.close(), d.close()


def test_other_kv_cache_groups_are_refused_by_name(server, hybrid_model, caplog):
    """Issue 54's handshake check, HMA: the same hybrid model with a sliding window of 32
    tokens at the prefill and of 64 at the decode (vLLM's hybrid allocator gives the window
    layers a group of their own on both: the same shapes, other blocks kept). The decode's
    request is failed by vLLM's policy, the groups named, its blocks never read into."""
    prompt = 200
    p = Engine("sched-gp", server, hybrid_model, sliding={1: 32, 3: 32}, max_model_len=256)
    d = Engine("sched-gd", server, hybrid_model, sliding={1: 64, 3: 64}, max_model_len=256)
    assert len(d.kv_cache_config.kv_cache_groups) == 2
    p.add("r", prompt, 1, {"do_remote_decode": True})
    p.run_until("the prefill", lambda: p.finished("r"))
    [done] = [o for o in p.outputs["r"] if o.finish_reason is not None]
    before = d.gathered()
    d.add("r-d", prompt, 3, done.kv_transfer_params)
    d.run_until("the request to end", lambda: d.finished("r-d"))
    [end] = [o for o in d.outputs["r-d"] if o.finish_reason is not None]
    assert d.tokens("r-d") == [] and end.finish_reason.name == "ERROR"
    assert any("the KV cache groups (vLLM's hybrid allocator: kinds and windows) differs"
               in r.getMessage() for r in caplog.records)
    after = d.gathered()
    assert all(torch.equal(after[n], before[n]) for n in before), "nothing read"
    p.close(), d.close()


@pytest.mark.parametrize("mode", ["pull", "push", "nixl"])
@pytest.mark.parametrize("lookahead", [0, 4])
def test_a_speculating_prefill_hands_off_its_prompts_blocks_not_its_lookahead(server, lookahead,
                                                                            mode):
    """Issue 54: a prefill that runs a drafter is allocated ``num_lookahead_tokens`` slots past
    the prompt (vLLM's scheduler, ``allocate_slots``): a 64-token prompt of 32-token blocks holds
    three blocks, the decoder's (allocated without lookahead for an async load) two. The
    push matched the decoder's two to the last two of the three — shifted by a block — and
    wrote them, then wrote them again from the blocks vLLM finished the request with (clipped to
    its computed tokens): the bytes are right only if the second writes land last, which SRD
    and striping do not promise. Every write posted now pairs a prompt block with the decoder's
    block of the same tokens, each once; pull (vLLM hands off the computed tokens' blocks) and
    NixlConnector's pull are the controls."""
    import dataclasses

    if mode == "nixl":
        pytest.importorskip("nixl._api", reason="NIXL (the control) is not installed")
        one_process_group()
    prompt = 64
    directory = Path(tempfile.mkdtemp())
    vllm_caches.write_model(directory, num_hidden_layers=2, num_key_value_heads=4,
                            num_attention_heads=8, hidden_size=64)
    model = vllm_caches.load_model_config(directory, max_model_len=160)
    tag = f"{mode}{lookahead}"
    connector = "nixl" if mode == "nixl" else "xfer"
    p = Engine(f"la-p{tag}", server, model, max_model_len=160, connector=connector)
    d = Engine(f"la-d{tag}", server, model, max_model_len=160, connector=connector)
    # Stand-in for a speculative config (a drafter needs its weights to be built): the
    # lookahead vLLM's scheduler reserves for it.
    p.scheduler.num_lookahead_tokens = lookahead
    if mode == "push":
        token = "7" * 32
        d.add("r-d", prompt, 2, {"do_remote_prefill": True, "xfer_push": True,
                                 "remote_engine_id": f"la-p{tag}", "remote_request_id": "r",
                                 "remote_tp_size": 1, "xfer_token": token})
        d.step()
        p.add("r", prompt, 1, {"do_remote_decode": True, "xfer_push": True, "xfer_token": token})
        push = p.workers[0]._worker.push
        writes = Writes(push._ctx.engine)
        push._ctx = dataclasses.replace(push._ctx, engine=writes)

        def decoder_found(rank, name):
            # The layers go to the decoder as they are computed once its record is found (off
            # the model-runner thread, from the first layer on); a GPU layer takes that long.
            if any(w.verified for w in push.wants("r")):
                deadline = time.monotonic() + WAIT
                while not all(w.ready for w in push.wants("r")):
                    assert time.monotonic() < deadline, "the decoder's record was not found"
                    time.sleep(0.001)
        p.layer_done = decoder_found
    else:
        p.add("r", prompt, 1, {"do_remote_decode": True})
        p.run_until("the prefill", lambda: p.finished("r"))
        [done] = [o for o in p.outputs["r"] if o.finish_reason is not None]
        d.add("r-d", prompt, 2, done.kv_transfer_params)
    d.run_until("the decoded tokens", lambda: d.finished("r-d"))
    assert d.tokens("r-d") == [TOKEN] * 2, "decoded from the loaded KV, not recomputed"
    blocks = prompt // BLOCK
    assert len(p.blocks["r"]) == blocks + (1 if lookahead else 0), "vLLM's lookahead block"
    theirs, ours = p.gathered(), d.gathered()
    for name in theirs:
        assert torch.equal(ours[name][d.blocks["r-d"][:blocks]],
                           theirs[name][p.blocks["r"][:blocks]]), name
    if mode == "push":
        pairs = set(zip(p.blocks["r"][:blocks], d.blocks["r-d"][:blocks]))
        assert writes.posted and all(set(w) <= pairs for w in writes.posted), writes.posted
        assert len(writes.posted) == len(theirs), "each layer written once"
    p.close(), d.close()


class Writes:
    """The prefill's engine, recording the (source, destination) block pairs of each paged
    write it posts (kernel rows: one per block at these sizes)."""

    def __init__(self, engine):
        self._engine = engine
        self.posted = []

    def submit_paged_writes(self, length, src, src_pages, dst, dst_pages, **kwargs):
        self.posted.append(list(zip(list(src_pages), list(dst_pages))))
        return self._engine.submit_paged_writes(length, src, src_pages, dst, dst_pages, **kwargs)

    def __getattr__(self, name):
        return getattr(self._engine, name)
