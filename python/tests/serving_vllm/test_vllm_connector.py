"""xfer.vllm.XferConnector against vLLM's own classes (issues 28 and 41), on a CPU-only machine.

vLLM 0.33 from PyPI (`cargo xtask vllm` installs it into target/vllm-venv); its platform is
forced to CPU (`VLLM_TARGET_DEVICE=cpu`: the CUDA wheel cannot infer a device here). Each
"instance" is a scheduler-side and a worker-side connector made by vLLM's
KVConnectorFactory from a VllmConfig with a config-only model; each rank's KV caches are the
tensors vLLM itself allocates for that model and rank (`vllm_caches.allocate`: the spec, the
layout the attention backend and the connector resolve, `get_kv_cache_configs`,
`allocate_kv_cache`), over the mock backend; requests are vLLM Requests, blocks vLLM
KVCacheBlocks.
"""

import os

os.environ.setdefault("VLLM_TARGET_DEVICE", "cpu")

import sys
import tempfile
import threading
import time
from pathlib import Path

import pytest

vllm = pytest.importorskip("vllm")

import torch  # noqa: E402
from vllm.config import (  # noqa: E402
    CacheConfig,
    KVTransferConfig,
    ParallelConfig,
    VllmConfig,
)
from vllm.distributed.kv_transfer.kv_connector.factory import KVConnectorFactory  # noqa: E402
from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorRole  # noqa: E402
from vllm.sampling_params import SamplingParams  # noqa: E402
from vllm.v1.core.kv_cache_manager import KVCacheBlocks  # noqa: E402
from vllm.v1.core.kv_cache_utils import KVCacheBlock  # noqa: E402
from vllm.v1.core.sched.output import SchedulerOutput  # noqa: E402
from vllm.v1.request import Request, RequestStatus  # noqa: E402

import xfer  # noqa: E402
import xfer.vllm  # noqa: E402

sys.path.insert(0, str(Path(__file__).parent))
import vllm_caches  # noqa: E402

MOCK = {"backend": "mock", "groups": [{"nics": ["mock0"]}], "timeouts": {"transfer_ms": 2000}}
BLOCK = 16  # tokens per block (vLLM's default)
WAIT = 20.0
_MODELS: dict = {}


def tiny_model(layers=2, heads=4, head=8, config=None):
    """vLLM's ModelConfig of a config-only model; one directory per shape, so instances of
    one shape serve "the same model" (the connector refuses another model's KV)."""
    config = config or vllm_caches.LLAMA_TINY
    key = (layers, heads, head, config["model_type"])
    if key not in _MODELS:
        overrides = {"num_hidden_layers": layers}
        if config is vllm_caches.LLAMA_TINY:
            attention = max(2 * heads, 8)  # TP up to 8 divides the attention heads
            overrides.update(num_key_value_heads=heads, num_attention_heads=attention,
                             hidden_size=attention * head)
        _MODELS[key] = vllm_caches.model_config(Path(tempfile.mkdtemp()), config, **overrides)
    return _MODELS[key]


@pytest.fixture(scope="module")
def server():
    s = xfer.Server()
    yield s
    s.close()


class Instance:
    """One vLLM instance: its scheduler-side connector, one worker-side connector per
    tensor-parallel rank, and each rank's KV caches as vLLM allocates them (its share of the KV
    heads, one buffer for all layers); a prefill's are filled with random KV."""

    def __init__(self, engine_id, server, *, layers=2, blocks=16, heads=4, head=8, tp=1, extra=None,
                 model=None, backend="CPU_ATTN", cache_dtype="auto", layout=None, dp=(1, 0),
                 pp=1, drafts=0, parallel=None, block=BLOCK, sliding=None):
        """``drafts``: a speculative drafter's layers (EAGLE's, numbered past the model's);
        ``block``: ``--block-size``; ``sliding``: layer index → the window of a sliding-window
        layer (vLLM's hybrid allocator gives those a KV cache group of their own)."""
        extra = {"rendezvous": server.url if server else None, "xfer_config": MOCK,
                 "lookup_timeout_s": 2.0, **(extra or {})}
        model = model or tiny_model(layers, heads, head)
        self.block = block

        def config(rank):
            return VllmConfig(
                model_config=model,
                cache_config=CacheConfig(block_size=block, cache_dtype=cache_dtype),
                parallel_config=ParallelConfig(tensor_parallel_size=tp, data_parallel_size=dp[0],
                                               data_parallel_rank=dp[1],
                                               pipeline_parallel_size=pp,
                                               **(parallel or {})),
                kv_transfer_config=KVTransferConfig(
                    kv_connector="XferConnector",
                    kv_connector_module_path="xfer.vllm",
                    kv_role="kv_both",
                    engine_id=engine_id,
                    kv_connector_extra_config={**extra, "tp_size": tp, "tp_rank": rank},
                ),
            )

        configs = [config(r) for r in range(tp)]
        own = model.hf_config.num_hidden_layers
        names = [f"model.layers.{i}.self_attn.attn" for i in range(own + drafts)]
        self.ranks = []
        self.workers = []
        self.total_heads = model.get_total_num_kv_heads() if not model.use_mla else 1
        gen = torch.Generator().manual_seed(hash(engine_id) % 2**31)
        model_kv = {}  # each layer's KV of every head, as the model computes it on every rank
        windows = {names[i]: w for i, w in (sliding or {}).items()}
        allocated = [vllm_caches.allocate(c, names, blocks, backend, layout, windows)
                     for c in configs]
        # As the engine: the scheduler (serving a side channel, if asked) before the workers.
        self.scheduler = KVConnectorFactory.create_connector(configs[0], KVConnectorRole.SCHEDULER,
                                                             allocated[0][0])
        for rank, (c, (kv_cache_config, caches)) in enumerate(zip(configs, allocated)):
            first = rank * self.total_heads // tp
            for name, cache in caches.items():
                raw = cache.view(torch.uint8)
                if name not in model_kv:
                    shape = (raw.shape[0], self.total_heads, *raw.shape[2:])
                    # Values that are finite in every dtype (bytes 0x00-0x3f).
                    model_kv[name] = torch.randint(0, 64, shape, generator=gen, dtype=torch.uint8)
                raw.copy_(model_kv[name][:, first:first + raw.shape[1]])
            worker = KVConnectorFactory.create_connector(c, KVConnectorRole.WORKER, kv_cache_config)
            worker.register_kv_caches(caches)
            self.ranks.append(caches)
            self.workers.append(worker)
        self.layout = configs[0].cache_config.kv_cache_layout
        self.full = self.gathered()
        self.caches = self.ranks[0]
        self.worker = self.workers[0]
        self._sent = [set() for _ in self.workers]
        self._recved = [set() for _ in self.workers]
        self.failed = set()

    @property
    def sent(self):
        """Requests every rank finished sending (what vLLM's scheduler waits for)."""
        return set.intersection(*self._sent)

    @property
    def recved(self):
        return set.intersection(*self._recved)

    def gathered(self):
        """Each layer's [blocks, heads, tokens, content] with the ranks' heads put back together
        (a replicated head once), as bytes."""
        tp = len(self.ranks)
        firsts = [r * self.total_heads // tp for r in range(tp)]
        holders = [r for r in range(tp) if r == 0 or firsts[r] != firsts[r - 1]]
        return {name: torch.cat([self.ranks[r][name].view(torch.uint8) for r in holders], dim=1)
                for name in self.ranks[0]}

    def step(self, scheduled=None):
        """``scheduled``: request id → the tokens the step computes (vLLM's
        ``num_scheduled_tokens``; none: a step that computes nothing)."""
        out = SchedulerOutput.make_empty()
        out.num_scheduled_tokens = dict(scheduled or {})
        meta = self.scheduler.build_connector_meta(out)
        for worker in self.workers:
            worker.bind_connector_metadata(meta)
            worker.start_load_kv(None)
            worker.clear_connector_metadata()
        self.collect()

    def collect(self):
        for i, worker in enumerate(self.workers):
            r = worker.get_transfer_results(set())
            self._sent[i] |= r.finished_sending
            self._recved[i] |= r.finished_recving
            self.failed |= r.failed_recving

    def wait(self, what, cond):
        deadline = time.monotonic() + WAIT
        while not cond():
            assert time.monotonic() < deadline, f"timed out waiting for {what}"
            self.collect()
            time.sleep(0.001)

    def close(self):
        for worker in self.workers:
            worker.shutdown()
        self.scheduler.shutdown()


def request(req_id, tokens, params, status=None):
    r = Request(
        req_id,
        list(range(tokens)),
        SamplingParams(max_tokens=1, extra_args={"kv_transfer_params": params}),
        None,
    )
    if status is not None:
        r.status = status
    return r


def blocks_of(ids):
    return KVCacheBlocks((tuple(KVCacheBlock(i) for i in ids),))


def prefill(p, req_id, tokens, block_ids):
    """p computed `req_id` into `block_ids` and keeps them for a reader."""
    # A prompt that fills the blocks it was given (vLLM allocates no more; the prefill hands
    # off its prompt's blocks).
    tokens = max(tokens, p.block * (len(block_ids) - 1) + 1)
    r = request(req_id, tokens, {"do_remote_decode": True}, RequestStatus.FINISHED_LENGTH_CAPPED)
    delay, params = p.scheduler.request_finished(r, block_ids)
    assert delay and params["remote_block_ids"] == [block_ids]  # one KV cache group
    p.step()
    return params


def decode(d, req_id, tokens, params, local_ids, computed=0):
    r = request(req_id, tokens, dict(params))
    n, load_async = d.scheduler.get_num_new_matched_tokens(r, computed)
    assert (n, load_async) == (tokens - computed, True)
    d.scheduler.update_state_after_alloc(r, blocks_of(local_ids), n)
    # The request loads once: asked again, nothing more is matched.
    assert d.scheduler.get_num_new_matched_tokens(r, computed) == (0, False)
    return r


def load(d, req_id, tokens, params, local_ids):
    """The decode's scheduler asks for the request's KV, its worker steps, and the load
    finishes (received or failed)."""
    decode(d, req_id, tokens, params, local_ids)
    d.step()
    d.wait("the load", lambda: req_id in d.recved)


def assert_copied(p, d, remote_ids, local_ids, loaded=()):
    """Every block of every layer the decode received is byte-equal to the prefill's, and
    every other block here (but those in ``loaded``, other loads') is as it was."""
    theirs, ours, before = p.gathered(), d.gathered(), d.full
    others = [b for b in range(next(iter(ours.values())).shape[0])
              if b not in local_ids and b not in loaded]
    for name, cache in theirs.items():
        assert torch.equal(ours[name][local_ids], cache[remote_ids]), name
        assert torch.equal(ours[name][others], before[name][others]), f"{name}: other blocks"


def test_vllm_loads_the_connector_from_its_module_path(server):
    p = Instance("load-check", server)
    assert isinstance(p.worker, xfer.vllm.XferConnector)
    assert isinstance(p.scheduler, xfer.vllm.XferConnector)
    from xfer.kv import vllm as kv_vllm

    # Issue 54: the module moved into xfer.kv; the path vLLM is given is the same module.
    assert xfer.vllm is kv_vllm and type(p.worker) is kv_vllm.XferConnector
    p.close()


def test_pull_copies_every_block_then_frees_them_at_the_prefill(server):
    p, d = Instance("p1", server), Instance("d1", server)
    params = prefill(p, "r1", 10, [3, 5, 7])
    load(d, "r1-d", 10, params, [0, 9, 2])
    assert not d.failed and d.worker.get_block_ids_with_load_errors() == set()
    assert_copied(p, d, [3, 5, 7], [0, 9, 2])
    p.wait("the prefill to free its blocks", lambda: "r1" in p.sent)
    p.close(), d.close()


@pytest.mark.parametrize("mode", ["pull", "push"])
@pytest.mark.parametrize("drafter", ["decode", "prefill"])
def test_a_drafters_layers_on_one_side_only_leave_the_models_layers_moved(server, drafter, mode):
    """Speculative decoding (EAGLE, MTP) adds draft layers, numbered past the model's, on the
    instances that run a drafter: with one on one side only, the model's own layers still move
    (byte-equal, the other blocks untouched) and the drafter's are left alone."""
    tag = f"{drafter}{mode}"
    p = Instance(f"draft-p{tag}", server, drafts=1 if drafter == "prefill" else 0)
    d = Instance(f"draft-d{tag}", server, drafts=1 if drafter == "decode" else 0)
    if mode == "pull":
        params = prefill(p, "r", 10, [3, 5, 7])
        load(d, "r-d", 10, params, [0, 9, 2])
    else:
        push_pair(p, d, "r", 10, [3, 5, 7], [0, 9, 2])
    assert not d.failed and d.worker.get_block_ids_with_load_errors() == set()
    theirs, ours, before = p.gathered(), d.gathered(), d.full
    own = [f"model.layers.{i}.self_attn.attn" for i in range(2)]
    for name in own:
        assert torch.equal(ours[name][[0, 9, 2]], theirs[name][[3, 5, 7]]), name
    for name in set(ours) - set(own):
        assert torch.equal(ours[name], before[name]), f"{name}: the drafter's, not loaded"
    p.wait("the prefill to free its blocks", lambda: "r" in p.sent)
    p.close(), d.close()


def test_a_prompt_shorter_than_a_block_and_concurrent_loads(server):
    p, d = Instance("p2", server), Instance("d2", server)
    specs = [("short", 3, [1], [4]), ("a", 8, [2, 3], [5, 6]), ("b", 12, [8, 9, 10], [7, 11, 12])]
    for req_id, tokens, remote, local in specs:
        params = prefill(p, req_id, tokens, remote)
        decode(d, req_id + "-d", tokens, params, local)
    d.step()
    d.wait("three loads", lambda: {"short-d", "a-d", "b-d"} <= d.recved)
    loaded = {b for *_, local in specs for b in local}
    for _, _, remote, local in specs:
        assert_copied(p, d, remote, local, loaded)
    p.wait("three frees", lambda: {"short", "a", "b"} <= p.sent)
    p.close(), d.close()


def test_a_full_prefix_hit_only_frees_the_prefill(server):
    p, d = Instance("p3", server), Instance("d3", server)
    params = prefill(p, "r3", 8, [1, 2])
    r = request("r3-d", 8, dict(params))
    assert d.scheduler.get_num_new_matched_tokens(r, 8) == (0, False)
    d.scheduler.update_state_after_alloc(r, blocks_of([]), 0)
    d.step()
    p.wait("the prefill to free its blocks", lambda: "r3" in p.sent)
    assert "r3-d" not in d.recved
    p.close(), d.close()


def test_a_layout_mismatch_is_a_load_error_not_a_hang(server):
    """The same model with an fp8 KV cache on one side: refused by name before any read."""
    p, d = Instance("p4", server), Instance("d4", server, cache_dtype="fp8")
    params = prefill(p, "r4", 8, [1, 2])
    decode(d, "r4-d", 8, params, [5, 6])
    d.step()
    d.wait("the refused load", lambda: "r4-d" in d.recved)
    assert "r4-d" in d.failed
    assert d.worker.get_block_ids_with_load_errors() == {5, 6}
    # Refused before any read: the blocks here are untouched.
    assert all(torch.equal(d.gathered()[n], d.full[n]) for n in d.full)
    p.wait("the prefill to free its blocks", lambda: "r4" in p.sent)
    p.close(), d.close()


@pytest.mark.parametrize("factor,prefill_side,decode_side", [
    ("the KV cache dtype", dict(cache_dtype="fp8_e4m3"), dict(cache_dtype="fp8_e5m2")),
    ("the block size", dict(block=16), dict(block=32)),
    ("the attention kernels' block size", dict(block=128, backend="FLASHINFER"),
     dict(block=128, backend="FLASH_ATTN")),
    ("the attention backend", dict(backend="FLASH_ATTN"), dict(backend="FLASHINFER")),
    ("the vLLM version", {}, dict(version="0.32.1")),
])
@pytest.mark.parametrize("mode", ["pull", "push", "push-unchecked"])
def test_an_incompatible_prefill_is_refused_by_name_before_anything_moves(
        server, monkeypatch, caplog, factor, prefill_side, decode_side, mode):
    """Issue 54's handshake check, on vLLM's own config objects: caches of the same shapes
    and element type (fp8 e4m3 and e5m2 are both bytes; FLASH_ATTN and FlashInfer lay out the
    same blocks of 16; 16-token blocks of another size are rows of the same width) that hold
    different things. The decode's load fails naming the factor, its blocks untouched (they
    were read or written as if they matched)."""
    if mode == "push-unchecked" and factor not in ("the attention backend", "the vLLM version"):
        pytest.skip("the decoder's own layer check refuses these views first")
    decode_side = dict(decode_side)
    version = decode_side.pop("version", None)
    tag = mode + "".join(word[0] for word in factor.split())
    p = Instance(f"cf-p-{tag}", server, **prefill_side)
    if version is not None:  # another release's decode instance, in this process
        monkeypatch.setattr(vllm, "__version__", version)
    d = Instance(f"cf-d-{tag}", server, **decode_side)
    monkeypatch.undo()
    if mode == "pull":
        params = prefill(p, "r", 8, [1])
        decode(d, "r-d", 8, params, [5])
        d.step()
    else:
        if mode == "push-unchecked":
            # A decoder that does not check (or lies): the prefill refuses to write to it.
            for w in d.workers:
                monkeypatch.setattr(w._worker, "incompatible", lambda peer: None)
        push_decode(d, "r-d", 8, p.scheduler._engine_id, "r", [5])
        d.step()
        if mode == "push-unchecked":
            r = push_prefill(p, "r", 8, [1])
            wanted(p, "r")
            compute(p, list(p.full))
    d.wait("the refused load", lambda: "r-d" in d.recved)
    assert "r-d" in d.failed
    assert d.worker.get_block_ids_with_load_errors() == {5}
    assert all(torch.equal(d.gathered()[n], d.full[n]) for n in d.full), "nothing moved"
    assert any(factor in r.getMessage() and " differs: here " in r.getMessage()
               for r in caplog.records), factor
    p.close(), d.close()


@pytest.mark.parametrize("decode_dtype", ["fp8", "fp8_e4m3"])
def test_fp8_is_fp8_e4m3(server, decode_dtype):
    """vLLM's ``--kv-cache-dtype fp8`` is e4m3: the two spellings exchange KV."""
    p = Instance(f"fp8-same-p{decode_dtype}", server, cache_dtype="fp8")
    d = Instance(f"fp8-same-d{decode_dtype}", server, cache_dtype=decode_dtype)
    params = prefill(p, "r", 8, [1, 2])
    load(d, "r-d", 8, params, [5, 6])
    assert not d.failed
    assert_copied(p, d, [1, 2], [5, 6])
    p.close(), d.close()


def test_a_dead_prefill_ends_in_load_errors_within_the_deadline(server):
    p, d = Instance("p5", server), Instance("d5", server)
    params = prefill(p, "r5", 8, [1, 2])
    # Learn the peer first (its record stays while its lease lives), then it dies.
    d.worker._worker._peer("p5", 0)
    p.worker._worker._engine.close()  # a crash: the engine is gone, the record not yet
    decode(d, "r5-d", 8, params, [3, 4])
    started = time.monotonic()
    d.step()
    d.wait("the failed load", lambda: "r5-d" in d.recved)
    assert "r5-d" in d.failed and d.worker.get_block_ids_with_load_errors() == {3, 4}
    assert time.monotonic() - started < WAIT
    d.close()


def test_an_unknown_peer_is_a_load_error(server):
    d = Instance("d6", server)
    params = {"do_remote_prefill": True, "remote_engine_id": "nobody", "remote_block_ids": [[1]],
              "remote_request_id": "x", "xfer_token": "0" * 32}
    decode(d, "r6-d", 4, params, [2])
    d.step()
    d.wait("the failed lookup", lambda: "r6-d" in d.recved)
    assert "r6-d" in d.failed and d.worker.get_block_ids_with_load_errors() == {2}
    d.close()


def test_a_prefill_whose_reader_never_comes_frees_at_its_lease(server):
    p = Instance("p7", server, extra={"free_timeout_s": 0.2})
    prefill(p, "r7", 8, [1, 2])
    p.collect()
    assert "r7" not in p.sent
    p.wait("the lease to expire", lambda: "r7" in p.sent)
    p.close()


def test_an_aborted_prefill_keeps_nothing(server):
    p = Instance("p8", server)
    r = request("r8", 8, {"do_remote_decode": True}, RequestStatus.FINISHED_ABORTED)
    assert p.scheduler.request_finished(r, [1, 2]) == (False, None)
    p.close()


def test_configuration_mistakes_are_named(monkeypatch):
    with pytest.raises(ValueError, match="rendezvous"):
        xfer.vllm.Options.parse({"xfer_config": MOCK})
    with pytest.raises(ValueError, match="unknown.*rendevous"):
        xfer.vllm.Options.parse({"rendevous": "xfer://x:1"})
    with pytest.raises(ValueError, match="wildcard"):
        xfer.vllm.Options.parse({"side_channel": "0.0.0.0:7300", "xfer_config": MOCK})
    with pytest.raises(ValueError, match="side_channel"):
        xfer.vllm.Options.parse({"rendezvous": None, "xfer_config": MOCK})
    # No engine config anywhere: refused by name, never a silent mock engine in production.
    monkeypatch.delenv("XFER_CONFIG", raising=False)
    with pytest.raises(ValueError, match="xfer_config.*XFER_CONFIG"):
        xfer.vllm.Options.parse({"rendezvous": "xfer://x:1"})
    monkeypatch.setenv("XFER_CONFIG", "/etc/xfer/verbs.toml")
    assert xfer.vllm.Options.parse({"rendezvous": "xfer://x:1"}).xfer_config is None


@pytest.mark.parametrize("decode_tp,prefill_tp", [(1, 1), (2, 1), (4, 2), (4, 4), (1, 2), (2, 4)])
@pytest.mark.parametrize("layouts", [(None, None), ("LBNHC", "LBNHC"), ("BLNHC", "LBHNC")],
                         ids=["HND-asked", "NHD", "layers-between-blocks-to-HND"])
def test_tensor_parallel_sizes_may_differ(server, decode_tp, prefill_tp, layouts):
    """Decode TP > prefill TP reads head slices; prefill TP > decode TP reads several ranks;
    under every layout vLLM allocates (the connector's HND, a user's NHD, layers between
    blocks on one side): every byte lands in place, nothing else is touched, and every
    prefill rank frees only after every reader rank."""
    tag = f"{decode_tp}x{prefill_tp}-{layouts[0]}-{layouts[1]}"
    p = Instance(f"tp-p{tag}", server, heads=8, tp=prefill_tp, backend="FLASH_ATTN",
                 layout=layouts[0])
    d = Instance(f"tp-d{tag}", server, heads=8, tp=decode_tp, backend="FLASH_ATTN",
                 layout=layouts[1])
    assert (p.layout, d.layout) == tuple(name or "LBHNC" for name in layouts)
    params = prefill(p, "r", 40, [3, 5, 7])
    assert params["remote_tp_size"] == prefill_tp
    decode(d, "r-d", 40, params, [0, 9, 2])
    d.step()
    d.wait("every rank's load", lambda: "r-d" in d.recved)
    assert not d.failed
    assert_copied(p, d, [3, 5, 7], [0, 9, 2])
    p.wait("every prefill rank to free", lambda: "r" in p.sent)
    p.close(), d.close()


def test_hnd_reads_a_head_slice_of_a_block_as_one_run_nhd_one_per_token(server):
    """Decode TP 2 from prefill TP 1: under HND (what the connector asks vLLM for) each
    layer's read is one run a block; under NHD one a token (16)."""
    from xfer._kvcache import block_runs

    for layout, runs in (("LBHNC", 1), ("LBNHC", BLOCK)):
        p = Instance(f"runs-p-{layout}", server, heads=8, backend="FLASH_ATTN", layout=layout)
        d = Instance(f"runs-d-{layout}", server, heads=8, tp=2, backend="FLASH_ATTN", layout=layout)
        name = next(iter(d.caches))
        ours, theirs = d.workers[1]._worker._layers[name][1], p.worker._worker._layers[name][1]
        assert len(block_runs(ours, theirs, 1, 2, 1)) == runs
        p.close(), d.close()


@pytest.mark.parametrize("decode_tp,prefill_tp", [(4, 1), (1, 4), (4, 8)])
def test_replicated_heads_more_ranks_than_kv_heads(server, decode_tp, prefill_tp):
    """2 KV heads at TP 4 or 8: vLLM gives each rank one head, replicated; a decode rank reads
    its head from one replica, a decode rank with both heads from two ranks."""
    tag = f"{decode_tp}x{prefill_tp}"
    p = Instance(f"rep-p{tag}", server, heads=2, tp=prefill_tp)
    d = Instance(f"rep-d{tag}", server, heads=2, tp=decode_tp)
    assert next(iter(p.caches.values())).shape[1] == max(1, 2 // prefill_tp)
    params = prefill(p, "r", 20, [3, 5])
    decode(d, "r-d", 20, params, [1, 6])
    d.step()
    d.wait("every rank's load", lambda: "r-d" in d.recved)
    assert not d.failed
    assert_copied(p, d, [3, 5], [1, 6])
    for rank, caches in enumerate(d.ranks):  # each replica holds its head
        first = rank * 2 // decode_tp
        for name, cache in caches.items():
            heads = cache.shape[1]
            assert torch.equal(cache[[1, 6]].view(torch.uint8),
                               p.full[name][[3, 5], first:first + heads]), (rank, name)
    p.wait("every prefill rank to free", lambda: "r" in p.sent)
    p.close(), d.close()


def test_fp8_kv_caches_move_byte_for_byte(server):
    p = Instance("fp8-p", server, cache_dtype="fp8", tp=2)
    d = Instance("fp8-d", server, cache_dtype="fp8")
    assert next(iter(d.caches.values())).element_size() == 1
    load(d, "r-d", 20, prefill(p, "r", 20, [2, 4]), [7, 8])
    assert not d.failed
    assert_copied(p, d, [2, 4], [7, 8])
    p.close(), d.close()


def test_a_prefill_whose_first_token_is_a_stop_token_is_handed_off(server):
    """FINISHED_STOPPED (the first sampled token ended the request) keeps the KV for the
    decode as FINISHED_LENGTH_CAPPED does; otherwise the decode recomputes the prompt."""
    p, d = Instance("stop-p", server), Instance("stop-d", server)
    r = request("s", 20, {"do_remote_decode": True}, RequestStatus.FINISHED_STOPPED)
    delay, params = p.scheduler.request_finished(r, [4, 6])
    assert delay and params["remote_block_ids"] == [[4, 6]]
    p.step()
    load(d, "s-d", 20, params, [1, 2])
    assert not d.failed
    assert_copied(p, d, [4, 6], [1, 2])
    p.close(), d.close()


def test_a_read_after_the_prefill_freed_its_blocks_is_a_load_error_never_wrong_kv(server):
    """The decode's queue backed up past the prefill's lease: the prefill freed the blocks
    (vLLM reuses them: new KV there) before the decode read them. The decode must report a
    load error, not another request's KV as this one's."""
    p = Instance("late-p", server, extra={"free_timeout_s": 0.2})
    d = Instance("late-d", server)
    params = prefill(p, "r", 20, [3, 5])
    p.wait("the lease to free the blocks", lambda: "r" in p.sent)
    for cache in p.caches.values():  # reused by another request
        cache[[3, 5]] = cache[[8, 9]]
    decode(d, "r-d", 20, params, [1, 2])
    d.step()
    d.wait("the load to end", lambda: "r-d" in d.recved)
    assert "r-d" in d.failed
    assert d.worker.get_block_ids_with_load_errors() == {1, 2}
    p.close(), d.close()


def test_start_load_kv_never_waits_for_a_peer_lookup(server):
    """vLLM calls start_load_kv on its model-runner thread, for the whole batch: a prefill
    whose record is slow to find must not hold it. The load waits for its peer off that
    thread and still lands."""
    import threading

    p, d = Instance("slow-p", server), Instance("slow-d", server)
    params = prefill(p, "r", 20, [3, 5])
    worker = d.worker._worker
    gate, lookup, order = threading.Event(), worker._peer, []

    def slow_lookup(*args, **kwargs):
        gate.wait(WAIT)
        order.append("looked up")
        return lookup(*args, **kwargs)

    worker._peer = slow_lookup
    decode(d, "r-d", 20, params, [1, 2])
    d.step()  # returns with the lookup still held at the gate
    order.append("step returned")
    gate.set()
    d.wait("the load", lambda: "r-d" in d.recved)
    assert order[0] == "step returned"
    assert not d.failed
    assert_copied(p, d, [3, 5], [1, 2])
    p.close(), d.close()


def test_a_decode_request_aborted_while_loading_still_reports_its_load(server):
    """vLLM keeps an aborted request's blocks until its load reports done (its scheduler
    waits for finished_recving); the connector must always report it."""
    p, d = Instance("p9", server), Instance("d9", server)
    params = prefill(p, "r9", 8, [1, 2])
    r = decode(d, "r9-d", 8, params, [3, 4])
    d.step()
    r.status = RequestStatus.FINISHED_ABORTED
    assert d.scheduler.request_finished(r, [3, 4]) == (False, None)
    d.wait("the load to report", lambda: "r9-d" in d.recved)
    p.wait("the prefill to free", lambda: "r9" in p.sent)
    p.close(), d.close()


def test_sleep_mode_drops_the_registration_and_wake_up_restores_it(server):
    """vLLM's sleep (gpu_worker.sleep) calls unregister_kv_caches before it unmaps the KV
    memory, wake-up restore_kv_caches after mapping it again: asleep, nothing reads the
    memory (a reader's load fails, named); awake, requests move again."""
    from vllm.config import KVTransferConfig

    assert xfer.vllm.XferConnector.supports_sleep_mode(KVTransferConfig())
    p, d = Instance("sp-p", server), Instance("sp-d", server)
    asleep = prefill(p, "r", 20, [1, 2])
    for worker in p.workers:
        worker.unregister_kv_caches()
        worker.unregister_kv_caches()  # idempotent, as vLLM asks
    decode(d, "r-d", 20, asleep, [5, 6])
    d.step()
    d.wait("the load from a sleeping prefill", lambda: "r-d" in d.recved)
    assert "r-d" in d.failed and d.worker.get_block_ids_with_load_errors() == {5, 6}
    for worker in p.workers:
        worker.restore_kv_caches()
        worker.restore_kv_caches()
    awake = prefill(p, "q", 20, [3, 4])
    decode(d, "q-d", 20, awake, [7, 8])
    d.step()
    d.wait("the load after wake-up", lambda: "q-d" in d.recved)
    assert "q-d" not in d.failed
    assert_copied(p, d, [3, 4], [7, 8], loaded=[5, 6])
    p.close(), d.close()


def test_stats_reach_vllms_own_logging_summed_over_ranks(server):
    """get_kv_connector_stats per worker, summed as vLLM sums them, through its
    KVConnectorLogging (build_kv_connector_stats, aggregate, reduce)."""
    from vllm.distributed.kv_transfer.kv_connector.v1.metrics import KVConnectorLogging

    p, d = Instance("p10", server, heads=4), Instance("d10", server, heads=4, tp=2)
    params = prefill(p, "r10", 12, [1, 2, 3])
    load(d, "r10-d", 12, params, [4, 5, 6])
    p.wait("the free", lambda: "r10" in p.sent)
    per_rank = [w.get_kv_connector_stats() for w in d.workers]
    total = per_rank[0].aggregate(per_rank[1]).reduce()
    assert (total["loads"], total["blocks_loaded"], total["load_failures"]) == (2, 6, 0)
    assert total["load_ms_max"] >= total["load_ms_p50"] > 0
    freed = p.worker.get_kv_connector_stats().reduce()
    assert (freed["freed_after_read"], freed["freed_at_lease"]) == (1, 0)
    assert d.workers[0].get_kv_connector_stats().is_empty(), "an interval starts empty"
    logging = KVConnectorLogging(d.scheduler._kv_transfer_config)
    logging.observe(per_rank[0].data)
    logging.log(log_fn=lambda *a: None)
    p.close(), d.close()


def test_prometheus_metrics_through_vllms_own_prom_hooks(server):
    """vLLM's KVConnectorProm asks the connector class for its metrics (build_prom_metrics) and
    feeds them the aggregated stats: loads, blocks and load times reach the registry."""
    from prometheus_client import REGISTRY
    from vllm.distributed.kv_transfer.kv_connector.v1.metrics import KVConnectorProm

    p, d = Instance("p11", server), Instance("d11", server)
    params = prefill(p, "r11", 8, [1, 2])
    load(d, "r11-d", 8, params, [3, 4])
    config = VllmConfig(kv_transfer_config=KVTransferConfig(
        kv_connector="XferConnector", kv_connector_module_path="xfer.vllm", kv_role="kv_both",
        kv_connector_extra_config={"rendezvous": server.url, "xfer_config": MOCK}))
    prom = KVConnectorProm(config, ["model_name", "engine"], {0: ["m", "0"]})
    assert isinstance(prom.prom_metrics, xfer.vllm.XferPromMetrics)
    prom.observe(d.worker.get_kv_connector_stats().data, 0)
    labels = {"model_name": "m", "engine": "0"}
    assert REGISTRY.get_sample_value("vllm:xfer_loads_total", labels) == 1
    assert REGISTRY.get_sample_value("vllm:xfer_blocks_loaded_total", labels) == 2
    assert REGISTRY.get_sample_value("vllm:xfer_load_failures_total", labels) in (None, 0)
    assert REGISTRY.get_sample_value("vllm:xfer_load_time_seconds_count", labels) == 1
    p.close(), d.close()


# ---- push mode ----


def proxy_token(prefill_req):
    """The random token a proxy makes for a pushed request and gives both instances."""
    import hashlib

    return hashlib.md5(prefill_req.encode()).hexdigest()


def push_decode(d, req_id, tokens, prefill_engine, prefill_req, local_ids, prefill_tp=1):
    """d (asked first) allocates `local_ids` for a request prefill_engine computes and pushes."""
    params = {"do_remote_prefill": True, "xfer_push": True, "remote_engine_id": prefill_engine,
              "remote_request_id": prefill_req, "remote_tp_size": prefill_tp,
              "xfer_token": proxy_token(prefill_req)}
    return decode(d, req_id, tokens, params, local_ids)


def push_prefill(p, req_id, tokens, block_ids, scheduled=None):
    """p schedules `req_id` into `block_ids` (it will push them as it computes) and computes
    ``scheduled`` tokens of it in this step (default: its whole prompt); the prompt fills the
    blocks it is given (a prefill pushes its prompt's blocks)."""
    tokens = max(tokens, p.block * (len(block_ids) - 1) + 1)
    r = request(req_id, tokens, {"do_remote_decode": True, "xfer_push": True,
                                 "xfer_token": proxy_token(req_id)})
    p.scheduler.update_state_after_alloc(r, blocks_of(block_ids), 0)
    p.step({req_id: tokens if scheduled is None else scheduled})
    return r


def compute(p, layers):
    """p's forward pass reaches `layers` (each rank saves its share of each)."""
    for worker, caches in zip(p.workers, p.ranks):
        for name in layers:
            worker.save_kv_layer(name, caches[name], None)
        worker.wait_for_save()


def finish(p, r, block_ids):
    r.status = RequestStatus.FINISHED_LENGTH_CAPPED
    assert p.scheduler.request_finished(r, block_ids) == (True, None)
    p.step()


def wanted(p, req_id, ranks=1):
    """Waits until `ranks` decode ranks' block ids reached each of p's ranks that gets them."""
    def arrived():
        return all(len(w._worker.push.wants(req_id)) >= ranks for w in p.workers)
    p.wait(f"the decoders' block ids for {req_id}", arrived)


def test_a_layer_computed_before_its_decoder_is_found_goes_once_it_is(server):
    """The decoder's record is looked up off the engine's threads: a layer computed before
    the lookup finished is pushed when it does — not held back until the whole request is
    computed (the layer-by-layer overlap lost whenever the lookup was slower than a layer)."""
    import threading

    p, d = Instance("pp9", server, layers=3), Instance("pd9", server, layers=3)
    push = p.workers[0]._worker.push
    gate, resolve = threading.Event(), push._resolve_want
    push._resolve_want = lambda req_id, want: (gate.wait(WAIT), resolve(req_id, want))
    push_decode(d, "r-d", 10, "pp9", "r", [0, 9, 2])
    d.step()
    r = push_prefill(p, "r", 10, [3, 5, 7])
    wanted(p, "r")
    names = list(p.full)
    compute(p, names[:1])   # before the decoder's record is found
    gate.set()
    p.wait("the first layer at the decoder, before the request is computed",
           lambda: torch.equal(d.caches[names[0]][[0, 9, 2]], p.caches[names[0]][[3, 5, 7]]))
    assert not torch.equal(d.caches[names[1]][[0, 9, 2]], p.caches[names[1]][[3, 5, 7]])
    compute(p, names[1:])
    finish(p, r, [3, 5, 7])
    d.wait("the pushed request", lambda: "r-d" in d.recved)
    assert not d.failed
    assert_copied(p, d, [3, 5, 7], [0, 9, 2])
    p.close(), d.close()


def push_pair(p, d, req_id, tokens, remote_ids, local_ids):
    """A pushed request: the decode's ids sent, every layer computed at the prefill, the
    request finished there, and the decoder's load ended."""
    push_decode(d, req_id + "-d", tokens, p.scheduler._engine_id, req_id, local_ids)
    d.step()
    r = push_prefill(p, req_id, tokens, remote_ids)
    wanted(p, req_id)
    compute(p, list(p.full))
    finish(p, r, remote_ids)
    d.wait("the pushed request", lambda: req_id + "-d" in d.recved)


def test_push_writes_each_layer_as_it_is_computed(server):
    p, d = Instance("pp1", server, layers=3), Instance("pd1", server, layers=3)
    push_decode(d, "r-d", 10, "pp1", "r", [0, 9, 2])
    d.step()
    r = push_prefill(p, "r", 10, [3, 5, 7])
    wanted(p, "r")
    names = list(p.full)
    compute(p, names[:1])
    # The first layer lands while the others are still being computed.
    def first_layer_landed():
        return torch.equal(d.caches[names[0]][[0, 9, 2]], p.caches[names[0]][[3, 5, 7]])
    p.wait("the first layer at the decoder", first_layer_landed)
    assert not torch.equal(d.caches[names[2]][[0, 9, 2]], p.caches[names[2]][[3, 5, 7]])
    assert "r-d" not in d.recved, "not complete before the last layer"
    compute(p, names[1:])
    finish(p, r, [3, 5, 7])
    d.wait("the pushed request", lambda: "r-d" in d.recved)
    assert not d.failed and d.worker.get_block_ids_with_load_errors() == set()
    assert_copied(p, d, [3, 5, 7], [0, 9, 2])
    p.wait("the prefill to free after the decoder", lambda: "r" in p.sent)
    assert d.worker.get_kv_connector_stats().reduce()["blocks_loaded"] == 3
    p.close(), d.close()


def test_push_ids_arriving_after_the_prefill_computed_go_at_once(server):
    p, d = Instance("pp2", server), Instance("pd2", server)
    r = push_prefill(p, "r", 12, [1, 2, 3])
    compute(p, list(p.full))
    finish(p, r, [1, 2, 3])
    push_decode(d, "r-d", 12, "pp2", "r", [4, 5, 6])
    d.step()
    d.wait("the pushed request", lambda: "r-d" in d.recved)
    assert not d.failed
    assert_copied(p, d, [1, 2, 3], [4, 5, 6])
    p.wait("the free", lambda: "r" in p.sent)
    p.close(), d.close()


@pytest.mark.parametrize("decode_tp,prefill_tp", [(2, 1), (1, 2), (2, 2), (4, 2)])
def test_push_across_tensor_parallel_sizes(server, decode_tp, prefill_tp):
    tag = f"{decode_tp}x{prefill_tp}"
    p = Instance(f"ptp-p{tag}", server, heads=8, tp=prefill_tp)
    d = Instance(f"ptp-d{tag}", server, heads=8, tp=decode_tp)
    push_decode(d, "r-d", 10, f"ptp-p{tag}", "r", [0, 9, 2], prefill_tp=prefill_tp)
    d.step()
    r = push_prefill(p, "r", 10, [3, 5, 7])
    wanted(p, "r", ranks=max(1, decode_tp // prefill_tp))
    compute(p, list(p.full))
    finish(p, r, [3, 5, 7])
    d.wait("every decode rank", lambda: "r-d" in d.recved)
    assert not d.failed
    assert_copied(p, d, [3, 5, 7], [0, 9, 2])
    p.wait("every prefill rank to free", lambda: "r" in p.sent)
    p.close(), d.close()


def test_a_prompt_prefilled_in_chunks_is_pushed_whole_once_finished(server):
    """Chunked prefill: the first step computes 20 of 40 tokens into the blocks allocated so
    far (two of three); a chunk's layers are not the prompt's KV, so nothing goes until the
    request finished with all its blocks, and then every layer does, the bytes right."""
    p, d = Instance("pp3", server), Instance("pd3", server)
    push_decode(d, "r-d", 40, "pp3", "r", [4, 5, 6])
    d.step()
    r = push_prefill(p, "r", 40, [1, 2], scheduled=20)
    wanted(p, "r")
    compute(p, list(p.full))
    finish(p, r, [1, 2, 3])
    d.wait("the pushed request", lambda: "r-d" in d.recved)
    assert not d.failed
    assert_copied(p, d, [1, 2, 3], [4, 5, 6])
    p.close(), d.close()


def test_a_push_aborted_at_the_prefill_fails_the_decoders_load_at_once(server):
    p = Instance("pp4", server)
    d = Instance("pd4", server, extra={"push_timeout_s": 60.0})
    push_decode(d, "r-d", 8, "pp4", "r", [3, 4])
    d.step()
    r = push_prefill(p, "r", 8, [1, 2])
    wanted(p, "r")
    r.status = RequestStatus.FINISHED_ABORTED
    assert p.scheduler.request_finished(r, [1, 2]) == (False, None)
    p.step()
    started = time.monotonic()
    d.wait("the failed load", lambda: "r-d" in d.failed)
    assert time.monotonic() - started < 30, "told, not timed out"
    assert d.worker.get_block_ids_with_load_errors() == {3, 4}
    p.close(), d.close()


def test_a_retry_naming_the_same_prefill_request_fails_alone_and_the_first_load_lands(server):
    """Review 56b L-3: a second decode request naming the same prefill request with its token
    (a proxy's retry) is refused its wait (review 56 M-A), but its failed load still told the
    prefill it was done: the prefill freed the request's blocks and aborted the first
    request's push where it had not landed yet (here: the decoder's record is found only
    after the request finished). The retry fails alone; the first request's KV lands,
    byte-exact."""
    import threading

    p = Instance("pp10", server)
    d = Instance("pd10", server, extra={"push_timeout_s": 60.0})
    push = p.workers[0]._worker.push
    gate, resolve = threading.Event(), push._resolve_want
    push._resolve_want = lambda req_id, want: (gate.wait(WAIT), resolve(req_id, want))
    push_decode(d, "r-d", 8, "pp10", "r", [3, 4])
    d.step()
    wanted(p, "r")  # the first request waits (its ids are sent once it does)
    push_decode(d, "r-d2", 8, "pp10", "r", [5, 6])  # the same token: the proxy's retry
    d.step()
    d.wait("the retry's failed load", lambda: "r-d2" in d.failed)
    r = push_prefill(p, "r", 8, [1, 2])
    compute(p, list(p.full))
    finish(p, r, [1, 2])
    p.step()
    gate.set()
    d.wait("the first request's load", lambda: "r-d" in d.recved)
    assert d.failed == {"r-d2"}
    assert d.worker.get_block_ids_with_load_errors() == {5, 6}
    assert_copied(p, d, [1, 2], [3, 4])
    p.close(), d.close()


def test_a_push_that_never_comes_is_a_load_error_at_its_deadline(server):
    p = Instance("pp5", server)
    d = Instance("pd5", server, extra={"push_timeout_s": 0.5})
    push_decode(d, "r-d", 8, "pp5", "never", [3, 4])
    d.step()
    d.wait("the timed-out load", lambda: "r-d" in d.failed)
    assert "r-d" in d.recved, "reported finished too, so vLLM stops waiting"
    assert d.worker.get_block_ids_with_load_errors() == {3, 4}
    p.close(), d.close()


def test_a_timed_out_push_is_cancelled_at_the_prefill_before_the_decoder_gives_up_its_blocks(
        server):
    """The decoder's load times out while the prefill still owes the request: the load error
    (after which vLLM reuses the blocks) is reported only once the prefill said it will write
    nothing more there — its later computation must not land in another request's blocks."""
    p = Instance("pp6", server)
    d = Instance("pd6", server, extra={"push_timeout_s": 0.5})
    push_decode(d, "r-d", 8, "pp6", "r", [3, 4])
    d.step()
    r = push_prefill(p, "r", 8, [1, 2])
    wanted(p, "r")
    before = {name: cache[[3, 4]].clone() for name, cache in d.caches.items()}
    d.wait("the timed-out load", lambda: "r-d" in d.failed)
    assert d.worker.get_block_ids_with_load_errors() == {3, 4}
    compute(p, list(p.full))  # the prefill gets to the request after all
    finish(p, r, [1, 2])
    [want] = p.workers[0]._worker.push.wants("r")
    p.wait("the prefill to settle the push", lambda: want.replied and want.pending == 0)
    assert want.transfers == [], "nothing was submitted after the cancel"
    for name, cache in d.caches.items():
        assert torch.equal(cache[[3, 4]], before[name]), f"{name}: written after the load failed"
    p.wait("the prefill to free after the decoder", lambda: "r" in p.sent)
    p.close(), d.close()


def test_a_push_from_a_dead_prefill_times_out_without_its_acknowledgement(server):
    p = Instance("pp7", server)
    d = Instance("pd7", server, extra={"push_timeout_s": 0.5})
    push_decode(d, "r-d", 8, "pp7", "r", [3, 4])
    d.step()
    wanted(p, "r")
    p.close()
    d.wait("the timed-out load", lambda: "r-d" in d.failed)
    assert d.worker.get_block_ids_with_load_errors() == {3, 4}
    d.close()


# ---- side channel ----


def free_port():
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_side_channels_replace_the_shared_rendezvous():
    """Each instance serves its own records; a request's parameters say where, for pull and
    for push (where the decoder's ids say where its own records are)."""
    side = {n: {"rendezvous": None, "side_channel": f"127.0.0.1:{free_port()}"} for n in "pd"}
    # Each may dial the other's side channel (no other: parameters come from API clients).
    side["p"]["peer_side_channels"] = [side["d"]["side_channel"]]
    side["d"]["peer_side_channels"] = [side["p"]["side_channel"]]
    p, d = Instance("sp", None, extra=side["p"]), Instance("sd", None, extra=side["d"])
    params = prefill(p, "r", 10, [3, 5, 7])
    assert params["remote_rendezvous"] == "xfer://" + side["p"]["side_channel"]
    decode(d, "r-d", 10, params, [0, 9, 2])
    d.step()
    d.wait("the pulled request", lambda: "r-d" in d.recved)
    assert not d.failed
    assert_copied(p, d, [3, 5, 7], [0, 9, 2])
    pushed = {"do_remote_prefill": True, "xfer_push": True, "remote_engine_id": "sp",
              "remote_request_id": "q", "remote_rendezvous": params["remote_rendezvous"],
              "xfer_token": proxy_token("q")}
    decode(d, "q-d", 8, pushed, [10, 11])
    d.step()
    r = push_prefill(p, "q", 8, [1, 2])
    wanted(p, "q")
    compute(p, list(p.full))
    finish(p, r, [1, 2])
    d.wait("the pushed request", lambda: "q-d" in d.recved)
    assert not d.failed
    assert_copied(p, d, [1, 2], [10, 11], loaded={0, 9, 2})
    p.wait("both freed", lambda: {"r", "q"} <= p.sent)
    p.close(), d.close()


def test_data_parallel_engines_on_one_node_serve_side_channels_of_their_own():
    """vLLM runs one engine per DP rank, each its own scheduler process, from one config: the
    side channel's port is offset by the DP index (as NixlConnector offsets its own), so
    they do not all bind one port; requests carry each engine's own."""
    port = free_port()
    extra = {"rendezvous": None, "side_channel": f"127.0.0.1:{port}"}
    engines = [Instance(f"dp-p_dp{rank}", None, extra=extra, dp=(2, rank)) for rank in range(2)]
    d = Instance("dp-d", None, extra={"rendezvous": None, "side_channel": f"127.0.0.1:{free_port()}",
                                      "peer_side_channels": [f"127.0.0.1:{port + i}" for i in (0, 1)]})
    for rank, p in enumerate(engines):
        params = prefill(p, f"r{rank}", 10, [3, 5])
        assert params["remote_rendezvous"] == f"xfer://127.0.0.1:{port + rank}"
        load(d, f"r{rank}-d", 10, params, [rank * 2, rank * 2 + 1])
        assert not d.failed
    for p in engines:
        p.close()
    d.close()


def test_pipeline_parallel_instances_are_refused_by_name(server):
    with pytest.raises(NotImplementedError, match="pipeline"):
        Instance("pp-refused", server, pp=2)


def test_decode_context_parallelism_is_refused_by_name(server):
    """Issue 54: with DCP a manager block spans block_size x DCP tokens spread over the ranks;
    the reads took the last blocks of the prefill's list (wrong KV for MLA). Refused, named,
    when the connector is made (vLLM checks DCP for NixlConnector only)."""
    mla = tiny_model(config=vllm_caches.DEEPSEEK_V2_TINY)
    with pytest.raises(NotImplementedError, match="decode_context_parallel_size=2"):
        Instance("dcp-refused", server, model=mla, tp=2,
                 parallel={"decode_context_parallel_size": 2})


def test_every_transfer_group_counts_as_loaded(server):
    """``get_loaded_kv_cache_group_ids``: the connector moves a request's own blocks of every
    transfer group (vLLM's default names the prefix-cacheable ones only)."""
    d = Instance("groups-d", server)
    config = d.scheduler._kv_cache_config
    assert d.scheduler.get_loaded_kv_cache_group_ids(None) == tuple(config.transfer_group_ids)
    d.close()


# ---- MLA from a model's own config ----


@pytest.mark.parametrize("backend", ["TRITON_MLA", "FLASHMLA"])
def test_mla_is_taken_from_the_models_config_and_each_decode_rank_reads_the_latent_whole(
        server, backend):
    """A DeepSeek-V2 config (config.json only: no weights, nothing downloaded) makes vLLM's
    ModelConfig say use_mla and allocate one latent "head" per block; the latent is the same
    on every rank: both decode ranks read it whole from the one prefill rank."""
    model = tiny_model(config=vllm_caches.DEEPSEEK_V2_TINY)
    assert model.use_mla
    p = Instance(f"mla-p-{backend}", server, model=model, backend=backend)
    d = Instance(f"mla-d-{backend}", server, model=model, backend=backend, tp=2)
    assert next(iter(p.caches.values())).shape[1:] == (1, BLOCK, 64 + 16)  # lora + rope
    params = prefill(p, "m", 20, [3, 5])
    decode(d, "m-d", 20, params, [9, 1])
    d.step()
    d.wait("both ranks' loads", lambda: "m-d" in d.recved)
    assert not d.failed
    for caches in d.ranks:
        for name, cache in p.caches.items():
            assert torch.equal(caches[name][[9, 1]], cache[[3, 5]]), name
    p.wait("the prefill to free", lambda: "m" in p.sent)
    p.close(), d.close()


# ---- the same model on both sides ----

@pytest.fixture(scope="module")
def two_models(tmp_path_factory):
    """Two models of the same shapes (config.json only: nothing downloaded)."""
    return [vllm_caches.model_config(tmp_path_factory.mktemp(name))
            for name in ("model-a", "model-b")]


def test_kv_of_another_model_is_refused_pulled_or_pushed(server, two_models):
    """Same layouts, other models: a load would pass every layout check and fill the cache
    with another model's KV. Refused by name as load errors; the prefill is still freed."""
    a, b = two_models
    p, d = Instance("mm-p", server, model=a), Instance("mm-d", server, model=b)
    params = prefill(p, "r", 8, [1, 2])
    assert params["remote_model"] == a.model
    decode(d, "r-d", 8, params, [3, 4])
    d.step()
    d.wait("the refused load", lambda: "r-d" in d.failed)
    assert d.worker.get_block_ids_with_load_errors() == {3, 4}
    p.wait("the prefill to free", lambda: "r" in p.sent)
    push_decode(d, "q-d", 8, "mm-p", "q", [5, 6])
    d.step()
    started = time.monotonic()
    # The proxy's request reaches the prefill too: only then can it tell the decoder's ids
    # (with the request's token) from a forger's, and answer them.
    push_prefill(p, "q", 8, [3, 4])
    d.wait("the refused push", lambda: "q-d" in d.failed)
    assert time.monotonic() - started < 30, "told by the prefill, not timed out"
    same = Instance("mm-d2", server, model=a)
    decode(same, "s-d", 8, prefill(p, "s", 8, [7, 8]), [9, 10])
    same.step()
    same.wait("the same model's load", lambda: "s-d" in same.recved)
    assert not same.failed
    p.close(), d.close(), same.close()


def test_a_decoder_shut_down_right_after_its_push_still_frees_the_prefills_blocks(server):
    """A pushed load ends before the decode rank has told the prefill it is done (that goes
    from a background thread): a decode instance shut down just then still delivers it, so
    the prefill frees the blocks at once, not at its lease minutes later (a CI failure: the
    two-process test's prefill waited for a request its decoder had shut down over)."""
    import threading

    p = Instance("pp-bye", server, extra={"free_timeout_s": 600.0})
    d = Instance("pd-bye", server)
    worker = d.workers[0]._worker
    closing, tell_done, close = threading.Event(), worker._tell_done, worker.close
    # The done message has not gone yet when the instance is shut down.
    worker._tell_done = lambda load: (closing.wait(WAIT), tell_done(load))
    worker.close = lambda: (closing.set(), close())
    push_pair(p, d, "r", 10, [3, 5, 7], [0, 9, 2])
    assert not d.failed
    d.close()
    p.wait("the prefill to free its blocks", lambda: "r" in p.sent)
    p.close()


# ---- leases from positive knowledge, hostile parameters and forged messages (issues 54, 56) ----


def test_a_reader_past_two_leases_with_the_blocks_rewritten_is_a_load_error():
    """Issue 54's measurement: "held" was "not among the requests freed at their lease", a
    record purged a lease later; a reader after two leases (a backed-up decode queue) was told
    "held" and the load finished with the other request's bytes."""
    server = xfer.Server()
    p = Instance("late2-p", server, extra={"free_timeout_s": 0.3})
    d = Instance("late2-d", server)
    params = prefill(p, "r", 20, [3, 5])
    p.wait("the lease to free the blocks", lambda: "r" in p.sent)
    for cache in p.caches.values():  # another request's forward rewrites them
        cache[[3, 5]] = cache[[8, 9]]
    deadline = time.monotonic() + 1.2  # past two leases, the prefill stepping meanwhile
    while time.monotonic() < deadline:
        p.step()
        time.sleep(0.05)
    before = {name: cache[[1, 2]].clone() for name, cache in d.caches.items()}
    decode(d, "r-d", 20, params, [1, 2])
    d.step()
    d.wait("the load to end", lambda: "r-d" in d.recved)
    assert "r-d" in d.failed, "another request's KV reported as loaded"
    assert d.worker.get_block_ids_with_load_errors() == {1, 2}
    for name, cache in d.caches.items():
        assert torch.equal(cache[[1, 2]], before[name]), "nothing is read once the lease ended"
    p.close(), d.close(), server.close()


def test_a_second_reader_of_a_request_is_refused_before_it_reads(server):
    """A proxy's retry reads the same parameters on another decode instance: it was told
    "held" and decoded whatever the blocks held by then."""
    p, d, again = Instance("sr-p", server), Instance("sr-d", server), Instance("sr-d2", server)
    params = prefill(p, "r", 20, [3, 5])
    load(d, "r-d", 20, params, [1, 2])
    assert not d.failed
    before = {name: cache[[6, 7]].clone() for name, cache in again.caches.items()}
    load(again, "r-d2", 20, params, [6, 7])  # after the first, or while it reads: refused
    assert "r-d2" in again.failed
    for name, cache in again.caches.items():
        assert torch.equal(cache[[6, 7]], before[name]), "nothing read"
    assert_copied(p, d, [3, 5], [1, 2])
    p.close(), d.close(), again.close()


def forge(to, prefix, header, payload=b""):
    """A third engine (anyone who can reach the prefill's engine) sends a message."""
    import json

    text = header if isinstance(header, bytes) else json.dumps(header).encode()
    with xfer.TransferEngine(MOCK) as engine:
        engine.submit_send(to, prefix + len(text).to_bytes(4, "little") + text + payload).wait(5)


def test_forged_done_and_claims_from_a_third_engine_free_nothing(server):
    """Issue 56: a forged done with tp 1 counted as every reader and freed the request's
    blocks; the real reader was then told "held" and decoded another request's KV."""
    p, d = Instance("fg-p", server), Instance("fg-d", server)
    params = prefill(p, "r", 20, [3, 5])
    address = bytes(p.worker._worker._engine.main_address)
    forged = {"req": "r", "engine": "x", "reader": "x", "rank": 0, "tp": 1,
              "addr": "00", "token": "0" * 32}
    forge(address, b"xfer-vllm-done:", {"req": "r", "engine": "x", "rank": 0, "tp": 1,
                                        "addr": "00"})  # the old format, no token
    forge(address, b"xfer-vllm-done:", forged)
    forge(address, b"xfer-vllm-read:", {**forged, "groups": [1]}, (3).to_bytes(4, "little"))
    forge(address, b"xfer-vllm-done:", b"{" * 3000)  # garbage: dropped, nothing raised
    time.sleep(0.5)  # the messages are handled on the prefill's callback thread
    p.step()
    assert "r" not in p.sent and p.worker._worker.keeping() == 1, "still kept for its reader"
    load(d, "r-d", 20, params, [1, 2])
    assert not d.failed
    assert_copied(p, d, [3, 5], [1, 2])
    p.close(), d.close()


@pytest.mark.parametrize("bad", [
    {"do_remote_prefill": True},  # no ids at all (NixlConnector asserts here)
    {"remote_engine_id": "p", "remote_request_id": "r", "remote_block_ids": [[1]],
     "remote_tp_size": 10**9},
    {"remote_engine_id": "p", "remote_request_id": "r", "remote_block_ids": [[1]],
     "remote_tp_size": 0},
    {"remote_engine_id": "p", "remote_request_id": "r", "remote_block_ids": [list(range(10**4))]},
    {"remote_engine_id": "p", "remote_request_id": "r", "remote_block_ids": [["1"]]},
    {"remote_engine_id": "p", "remote_request_id": "r", "remote_block_ids": [[1]],
     "remote_rendezvous": "etcd://attacker:2379/x"},
    {"remote_engine_id": ["p"], "remote_request_id": "r", "remote_block_ids": [[1]]},
    {"remote_engine_id": "p", "remote_request_id": "r", "remote_block_ids": [[1]],
     "xfer_token": "not a token"},
    {"remote_engine_id": "p", "remote_request_id": "r", "remote_block_ids": [[1], [2]]},
])
def test_malformed_parameters_from_the_request_body_fail_that_request_only(server, bad):
    """``kv_transfer_params`` come from the API client: a bad set never raises inside vLLM's
    scheduler (a KeyError there took the decode instance down), dials and looks up nothing,
    and the request is computed here; the next request loads as usual."""
    tag = abs(hash(repr(bad))) % 10**6
    d = Instance(f"bad-d{tag}", server)
    params = {"do_remote_prefill": True, "xfer_token": "1" * 32, **bad}
    r = request("bad", 20, params)
    assert d.scheduler.get_num_new_matched_tokens(r, 0) == (0, False)
    d.scheduler.update_state_after_alloc(r, blocks_of([1, 2]), 0)
    r.status = RequestStatus.FINISHED_ABORTED
    assert d.scheduler.request_finished(r, [1, 2]) == (False, None)
    d.step()
    assert d.worker._worker._services.keys() == {server.url}, "nothing dialled"
    p = Instance(f"bad-p{tag}", server)
    load(d, "good-d", 20, prefill(p, "good", 20, [3, 5]), [1, 2])
    assert not d.failed
    p.close(), d.close()


def test_block_ids_the_prefill_never_offered_for_the_request_are_refused_unread(server):
    """Issue 56: a decode's API client named other users' (prefix-cached) blocks in
    ``remote_block_ids`` and read their KV: the prefill grants only the request's own."""
    p, d = Instance("nb-p", server), Instance("nb-d", server)
    params = prefill(p, "r", 20, [3, 5])
    before = {name: cache[[1, 2]].clone() for name, cache in d.caches.items()}
    load(d, "r-d", 20, {**params, "remote_block_ids": [[3, 9]]}, [1, 2])
    assert "r-d" in d.failed
    for name, cache in d.caches.items():
        assert torch.equal(cache[[1, 2]], before[name]), "nothing read"
    p.close(), d.close()


def test_a_decode_request_aborted_before_its_load_tells_the_prefill(server):
    """Client gone or admission refused before the load started: the prefill was left holding
    the blocks for its whole lease (NixlConnector frees them at once)."""
    p, d = Instance("ab-p", server, extra={"free_timeout_s": 600}), Instance("ab-d", server)
    params = prefill(p, "r", 20, [3, 5])
    r = request("r-d", 20, dict(params))
    assert d.scheduler.get_num_new_matched_tokens(r, 0) == (20, True)
    r.status = RequestStatus.FINISHED_ABORTED  # never allocated
    assert d.scheduler.request_finished(r, []) == (False, None)
    d.step()
    p.wait("the prefill to free the blocks long before its lease", lambda: "r" in p.sent)
    p.close(), d.close()


def test_a_forged_pushed_ok_with_the_requests_token_from_a_third_engine_completes_nothing(server):
    """Issue 56, with the engine's sender identity: a third engine that learnt the request's
    token (the proxy's parameters) says "pushed ok" in the prefill's name; the decoder knows
    the prefill's engine from its record and the transport names the sender: the load waits
    for the real push, and gets the prefill's bytes."""
    p, d = Instance("fp-p", server), Instance("fp-d", server)
    push_decode(d, "r-d", 10, "fp-p", "r", [0, 9, 2])
    d.step()
    address = bytes(d.worker._worker._engine.main_address)
    forge(address, b"xfer-vllm-push:", {"engine": "fp-p", "req": "r", "rank": 0, "ok": True,
                                        "why": None, "cancelled": False,
                                        "token": proxy_token("r")})
    time.sleep(0.5)
    d.collect()
    assert "r-d" not in d.recved, "completed by a forged message"
    r = push_prefill(p, "r", 10, [3, 5, 7])
    wanted(p, "r")
    compute(p, list(p.full))
    finish(p, r, [3, 5, 7])
    d.wait("the pushed request", lambda: "r-d" in d.recved)
    assert not d.failed
    assert_copied(p, d, [3, 5, 7], [0, 9, 2])
    p.close(), d.close()


def test_a_failed_lookup_is_remembered_and_backed_off(server):
    """Issue 54: the two lookup threads stalled behind a dead prefill (failed lookups neither
    remembered nor backed off: one wait of up to lookup_timeout_s per rank, per load and per
    message)."""
    d = Instance("lk-d", server, extra={"lookup_timeout_s": 0.3})
    worker = d.worker._worker
    # A prefill this decode found once, now dead (a record never found is only checked).
    gone = Instance("gone", server)
    worker._peer("gone", 0)
    gone.close()
    worker._forget("gone")  # as a failed read does
    service, lookups = worker._service, []

    def counting(url):
        rendezvous = service(url)

        class Counted:
            def lookup(self, name, timeout):
                lookups.append((name, timeout))
                return rendezvous.lookup(name, timeout)
        return Counted()

    worker._service = counting
    params = {"do_remote_prefill": True, "remote_engine_id": "gone", "remote_block_ids": [[1]],
              "remote_request_id": "x", "xfer_token": "0" * 32}
    for i in range(3):
        decode(d, f"lk{i}-d", 4, params, [2 + i])
        d.step()
        d.wait("the failed load", lambda i=i: f"lk{i}-d" in d.failed)
    # One wait for the record; then, within the backoff, only checks (a peer that came back
    # is found, a dead one holds no thread).
    assert [t for _, t in lookups][:1] == [0.3] and all(t == 0 for _, t in lookups[1:]), lookups
    assert len(lookups) >= 3
    d.close()


def test_requests_naming_engines_no_record_names_fail_alone_and_hold_up_no_other_load(server):
    """Issue 56, review M4: ``remote_engine_id`` comes from the API client, and the lookup of a
    name no record answers waited ``lookup_timeout_s`` on the connector's two lookup threads:
    a client sending a fresh name with each request held up every other request's load. A
    name never found is only checked: those requests fail through vLLM's failure path, and
    another request's load lands while their lookups would still be waiting (the lookup
    timeout is longer than the harness waits for anything)."""
    p = Instance("st-p", server)
    d = Instance("st-d", server, extra={"lookup_timeout_s": 3 * WAIT})
    params = prefill(p, "r", 20, [3, 5])
    bogus = {"do_remote_prefill": True, "remote_block_ids": [[1]], "remote_request_id": "x",
             "xfer_token": "0" * 32}
    for i in range(4):
        decode(d, f"b{i}-d", 4, {**bogus, "remote_engine_id": f"nobody-{os.urandom(8).hex()}"},
               [6 + i])
    d.step()
    load(d, "r-d", 20, params, [1, 2])
    assert "r-d" not in d.failed
    assert_copied(p, d, [3, 5], [1, 2], loaded=[6, 7, 8, 9])
    d.wait("the bogus requests' loads", lambda: all(f"b{i}-d" in d.recved for i in range(4)))
    assert {f"b{i}-d" for i in range(4)} <= d.failed
    assert d.worker.get_block_ids_with_load_errors() == {6, 7, 8, 9}
    p.close(), d.close()


def test_one_lookup_at_a_time_waits_for_a_known_peer_to_come_back_the_rest_go_on(server):
    """Issue 56, review M4: a record found before may be waited for (its prefill restarts, or
    sleeps and wakes) — by one lookup at a time. Requests naming two known prefills that are
    both gone hold one lookup thread at most: the other one's request fails at once, a third
    prefill's load lands meanwhile, and the lookup that waited finds its prefill when it comes
    back."""
    g1, g2, p = Instance("kg1", server), Instance("kg2", server), Instance("kg-p", server)
    d = Instance("kg-d", server, extra={"lookup_timeout_s": 3 * WAIT})
    worker = d.worker._worker
    gone = {"kg1": prefill(g1, "r1", 20, [3, 5]), "kg2": prefill(g2, "r2", 20, [3, 5])}
    for g in (g1, g2):
        worker._peer(g.scheduler._engine_id, 0)  # found once
        for w in g.workers:
            w.unregister_kv_caches()  # asleep: the record is withdrawn
        worker._forget(g.scheduler._engine_id)  # as a failed read does
    decode(d, "a-d", 20, gone["kg1"], [1, 2])
    decode(d, "b-d", 20, gone["kg2"], [3, 4])
    d.step()
    d.wait("one of them to fail without waiting", lambda: {"a-d", "b-d"} & d.failed)
    load(d, "r-d", 20, prefill(p, "r", 20, [3, 5]), [5, 6])
    assert "r-d" not in d.failed
    assert_copied(p, d, [3, 5], [5, 6], loaded=[1, 2, 3, 4])
    for g in (g1, g2):
        for w in g.workers:
            w.restore_kv_caches()
    d.wait("the waiting lookup to find its prefill back", lambda: {"a-d", "b-d"} <= d.recved)
    p.close(), d.close(), g1.close(), g2.close()


def test_a_prefill_restarted_under_its_engine_id_is_found_at_its_new_address(server):
    """Review M-B (issue 56): a prefill's record, once found, was kept whatever came after — a
    claim it never answered, a "done" that could not be sent — so a prefill restarted under the
    same engine id (at another address) was never looked up again: every later load from it
    failed at the claim deadline until the decode restarted. A claim unanswered by its deadline
    now forgets the record: the request after it finds the prefill where it is now."""
    p = Instance("rs-p", server)
    d = Instance("rs-d", server, extra={"lookup_timeout_s": 1.0})
    load(d, "a-d", 20, prefill(p, "a", 20, [3, 5]), [1, 2])  # the decode keeps p's record
    assert "a-d" not in d.failed
    p.close()
    p2 = Instance("rs-p", server)  # restarted: the same engine id, another engine and address
    try:
        load(d, "b-d", 20, prefill(p2, "b", 20, [3, 5]), [3, 4])  # may fail: the old record
        load(d, "c-d", 20, prefill(p2, "c", 20, [6, 7]), [5, 6])
        assert "c-d" not in d.failed, "the restarted prefill was not looked up again"
        assert_copied(p2, d, [6, 7], [5, 6], loaded=[1, 2, 3, 4])
    finally:
        p2.close(), d.close()


class Unanswered:
    """A send to a host that is gone, as its sender sees it until the engine's own timeouts
    (RDMA: ``connect_ms``/``transfer_ms``; the mock fails a send to a closed engine at once):
    pending until the test ends it with ``fail``."""

    def __init__(self):
        self._ended = threading.Event()
        self._callbacks = []
        self._error = None

    def add_done_callback(self, callback):
        self._callbacks.append(callback)

    def done(self):
        return self._ended.is_set()

    def wait(self, timeout=None):
        if not self._ended.wait(timeout):
            raise TimeoutError("the send is still pending")
        raise self._error

    def fail(self, error):
        self._error = error
        self._ended.set()
        for callback in self._callbacks:
            callback(error)


class GoneHost:
    """A worker's engine through which sends to ``address`` never complete (``Unanswered``);
    everything else is the engine's own. Stand-in for a host that died: it hides how the engine
    times such a send out (the transfer's own deadline)."""

    def __init__(self, engine, address):
        self._engine, self._address = engine, bytes(address)
        self.pending = []

    def __getattr__(self, name):
        return getattr(self._engine, name)

    def submit_send(self, peer, data, *, on_done=None):
        if bytes(peer) != self._address:
            return self._engine.submit_send(peer, data, on_done=on_done)
        send = Unanswered()
        if on_done is not None:
            send.add_done_callback(on_done)
        self.pending.append(send)
        return send

    def fail_pending(self):
        for send in list(self.pending):
            if not send.done():
                send.fail(ConnectionError("the peer is gone (its transfer timed out)"))


def test_done_messages_to_a_known_prefill_that_is_gone_hold_no_lookup_thread(server):
    """Review M-B (issue 56): a request's "done" messages were waited for on one of the two
    lookup threads (up to ``lookup_timeout_s``), outside the lookup gate: requests naming a
    prefill the decode had found once, now gone (its engine id is in every pull request's
    parameters), held both threads until the sends failed, and every other load queued behind
    them. Here four requests name such a prefill, each a full prefix hit (only the "done" goes
    there); its sends stay pending for longer than the harness waits. A load from a live
    prefill lands meanwhile, and every request's "done" was sent."""
    gone, p = Instance("dg-a", server), Instance("dg-b", server)
    d = Instance("dg-d", server, extra={"lookup_timeout_s": 3 * WAIT})
    worker = d.worker._worker
    named = prefill(gone, "a", 20, [3, 5])
    host = GoneHost(worker._engine, worker._peer("dg-a", 0).address)  # found once
    gone.close()
    worker._engine = host
    try:
        for i in range(4):
            r = request(f"g{i}-d", 20, dict(named))
            assert d.scheduler.get_num_new_matched_tokens(r, 20) == (0, False)
            d.scheduler.update_state_after_alloc(r, blocks_of([]), 0)
        d.step()
        d.wait("both lookup threads to send a done message", lambda: len(host.pending) >= 2)
        load(d, "b-d", 20, prefill(p, "b", 20, [3, 5]), [1, 2])
        assert "b-d" not in d.failed
        assert_copied(p, d, [3, 5], [1, 2])
        d.wait("every request's done message", lambda: len(host.pending) == 4)
    finally:
        host.fail_pending()
    p.close(), d.close()


def test_requests_naming_a_side_channel_that_is_down_fail_alone(server):
    """Issue 56, review M4: a request may name any side channel the instance may dial
    (``peer_side_channels``); the first connection to one waited ``lookup_timeout_s`` for its
    service to come up, on a lookup thread, and a failed one was not kept — so requests naming
    a listed side channel that is down held both lookup threads, each of them for the whole
    wait. A first connection is tried once: those requests fail at once, another prefill's
    load lands meanwhile."""
    down = f"127.0.0.1:{free_port()}"  # listed, nothing serves it
    p = Instance("dc-p", server)
    d = Instance("dc-d", server, extra={"lookup_timeout_s": 3 * WAIT,
                                        "peer_side_channels": [down]})
    bogus = {"do_remote_prefill": True, "remote_block_ids": [[1]], "remote_request_id": "x",
             "xfer_token": "0" * 32, "remote_engine_id": "dc-p",
             "remote_rendezvous": f"xfer://{down}"}
    for i in range(4):
        decode(d, f"b{i}-d", 4, bogus, [6 + i])
    d.step()
    load(d, "r-d", 20, prefill(p, "r", 20, [3, 5]), [1, 2])
    assert "r-d" not in d.failed
    assert_copied(p, d, [3, 5], [1, 2], loaded=[6, 7, 8, 9])
    d.wait("the requests naming it", lambda: all(f"b{i}-d" in d.recved for i in range(4)))
    assert {f"b{i}-d" for i in range(4)} <= d.failed
    p.close(), d.close()


def test_a_decode_request_waiting_for_room_renews_the_prefills_lease(server):
    """Issue 54: no lease renewal while a decode waited (NIXL renews by heartbeat): a decode
    backlog past the lease became recompute or error. vLLM asks ``get_num_new_matched_tokens``
    each step a request waits for room; the prefill keeps the blocks meanwhile (up to
    ``max_lease_s``) and the late load succeeds."""
    p = Instance("rn-p", server, extra={"free_timeout_s": 0.6})
    d = Instance("rn-d", server)
    params = prefill(p, "r", 20, [3, 5])
    r = request("r-d", 20, dict(params))
    deadline = time.monotonic() + 2.0  # three leases, both engines stepping
    while time.monotonic() < deadline:
        assert d.scheduler.get_num_new_matched_tokens(r, 0) == (20, True)
        d.step(), p.step()
        time.sleep(0.05)
    assert "r" not in p.sent, "the lease was renewed"
    d.scheduler.update_state_after_alloc(r, blocks_of([1, 2]), 20)
    d.step()
    d.wait("the late load", lambda: "r-d" in d.recved)
    assert not d.failed
    assert_copied(p, d, [3, 5], [1, 2])
    p.close(), d.close()


def test_push_goes_layer_by_layer_in_vllms_own_order_with_async_loads(server):
    """Issue 54: with async loads vLLM's model runner calls ``start_load_kv`` after the forward
    (``KVConnectorModelRunnerMixin._get_kv_connector_output``: ``has_sync_kv_loads`` false),
    so ``save_kv_layer`` ran before the step's push requests were known and nothing went layer
    by layer. Driven through the mixin itself: the first layer lands at the decoder while the
    forward is still inside the step."""
    from vllm.distributed.kv_transfer import kv_transfer_state
    from vllm.forward_context import set_forward_context
    from vllm.v1.worker.kv_connector_model_runner_mixin import KVConnectorModelRunnerMixin

    p, d = Instance("mo-p", server, layers=3), Instance("mo-d", server, layers=3)
    push_decode(d, "r-d", 10, "mo-p", "r", [0, 9, 2])
    d.step()
    r = request("r", 40, {"do_remote_decode": True, "xfer_push": True,
                          "xfer_token": proxy_token("r")})
    p.scheduler.update_state_after_alloc(r, blocks_of([3, 5, 7]), 0)
    wanted(p, "r")
    names = list(p.full)
    out = SchedulerOutput.make_empty()
    out.num_scheduled_tokens = {"r": 40}
    out.kv_connector_metadata = p.scheduler.build_connector_meta(out)
    assert not out.has_sync_kv_loads, "vLLM starts the loads after the forward"
    worker = p.worker
    kv_transfer_state._KV_CONNECTOR_AGENT = worker
    try:
        with set_forward_context(None, worker._vllm_config), \
                KVConnectorModelRunnerMixin._get_kv_connector_output(out):
            worker.save_kv_layer(names[0], p.caches[names[0]], None)
            p.wait("the first layer at the decoder, inside the forward",
                   lambda: torch.equal(d.caches[names[0]][[0, 9, 2]],
                                       p.caches[names[0]][[3, 5, 7]]))
            for name in names[1:]:
                worker.save_kv_layer(name, p.caches[name], None)
    finally:
        kv_transfer_state._KV_CONNECTOR_AGENT = None
    finish(p, r, [3, 5, 7])
    d.wait("the pushed request", lambda: "r-d" in d.recved)
    assert not d.failed
    assert_copied(p, d, [3, 5, 7], [0, 9, 2])
    p.close(), d.close()


def test_the_drafters_factor_names_method_model_and_cache_dtype():
    """The speculative factor as ``_compat_factors`` reads vLLM's ``SpeculativeConfig`` (a
    drafter needs its weights to be built, so its config is a stand-in with vLLM's field
    names): method, draft model and its cache dtype (the target's where it sets none); a
    drafter without KV of its own (n-gram: no draft model config) is no drafter."""
    import types

    from xfer.kv import compat
    from xfer.kv.vllm import _compat_factors, _Groups

    def config(spec):
        return types.SimpleNamespace(
            model_config=types.SimpleNamespace(dtype="torch.bfloat16"),
            cache_config=types.SimpleNamespace(cache_dtype="fp8"), speculative_config=spec)

    eagle = types.SimpleNamespace(method="eagle3", kv_cache_dtype=None,
                                  draft_model_config=types.SimpleNamespace(model="org/drafter"))
    ngram = types.SimpleNamespace(method="ngram", kv_cache_dtype=None, draft_model_config=None)
    factors = _compat_factors(config(eagle), _Groups(None))
    assert factors["speculative"] == "eagle3.org/drafter.fp8_e4m3"
    assert factors["cache_dtype"] == "fp8_e4m3"
    assert _compat_factors(config(ngram), _Groups(None))["speculative"] == compat.NO_DRAFTER
    assert _compat_factors(config(None), _Groups(None))["speculative"] == compat.NO_DRAFTER
    other = types.SimpleNamespace(method="eagle3", kv_cache_dtype=None,
                                  draft_model_config=types.SimpleNamespace(model="org/other"))
    ours = compat.from_tags(compat.tags(factors).items())
    theirs = compat.from_tags(compat.tags(_compat_factors(config(other), _Groups(None))).items())
    assert "speculative drafter" in compat.difference(ours, theirs)


def squatted_prefill():
    """Issue 56: prefill ``sq-p`` serves side channel A; another instance, serving side channel
    B, calls itself ``sq-p`` too (its record is ``vllm.sq-p.0`` on B, with its own engine's
    address, and its KV other bytes); the decode may dial both (``peer_side_channels``), and has
    read one request that named ``sq-p`` via B: the squatter's own, served as it named."""
    a, b = f"127.0.0.1:{free_port()}", f"127.0.0.1:{free_port()}"
    p = Instance("sq-p", None, extra={"rendezvous": None, "side_channel": a})
    squatter = Instance("sq-p", None, extra={"rendezvous": None, "side_channel": b})
    for rank in squatter.ranks:
        for cache in rank.values():
            cache.view(torch.uint8).fill_(0x2A)
    d = Instance("sq-d", None, extra={"rendezvous": None, "side_channel": f"127.0.0.1:{free_port()}",
                                      "peer_side_channels": [a, b]})
    bait = prefill(squatter, "bait", 20, [3, 5])
    assert bait["remote_rendezvous"] == f"xfer://{b}"
    load(d, "bait-d", 20, bait, [1, 2])
    assert not d.failed
    return p, squatter, d


def test_a_prefills_record_squatted_on_another_side_channel_never_stands_in_for_it():
    """Issue 56: the decode cached a prefill's record by (engine, rank), whatever rendezvous
    the request named: after one request named ``sq-p`` via B, every later load from the real
    ``sq-p`` (via A) went to B's engine — its claims (with the victims' tokens and block ids)
    granted there, its done answered "held", and the decode read B's bytes."""
    p, squatter, d = squatted_prefill()
    params = prefill(p, "r", 20, [3, 5])
    # B's engine grants whatever claim reaches it with the token the claim carries (a stand-in
    # for a hostile engine: here its own offer of the victim's request, that token, those ids).
    worker = squatter.worker._worker
    with worker._lock:
        worker._offers.offer("r", params["xfer_token"], [[3, 5]], time.monotonic())
    load(d, "r-d", 20, params, [6, 7])
    assert not d.failed
    assert_copied(p, d, [3, 5], [6, 7], loaded={1, 2})
    p.close(), squatter.close(), d.close()


def test_a_grant_from_the_engine_another_side_channels_record_names_is_not_the_prefills():
    """Issue 56: a prefill rank's answer counted as proven if its sender matched the record
    cached for that engine and rank from any rendezvous: B's engine (with the token, which the
    decode's API client has) granted a claim of blocks the real prefill never offered for the
    request, before the prefill refused it, and the decode read them."""
    p, squatter, d = squatted_prefill()
    params = prefill(p, "r", 20, [3, 5])
    p.worker._worker._from_reader = lambda *args, **kwargs: None  # slow to answer: never
    before = {name: cache[[6, 7]].clone() for name, cache in d.caches.items()}
    decode(d, "r-d", 20, {**params, "remote_block_ids": [[3, 9]]}, [6, 7])
    d.step()
    worker = d.worker._worker
    d.wait("the claim", lambda: bool(worker._claims))
    [(engine, req, reader)] = worker._claims
    from xfer.kv.control import encode as encode_message

    grant = encode_message(b"xfer-vllm-okay:", {
        "req": req, "token": params["xfer_token"], "engine": engine, "reader": reader,
        "rank": 0, "ok": True, "why": None})
    squatter.worker._worker._engine.submit_send(bytes(worker._engine.main_address), grant).wait(5)
    d.wait("the load to end", lambda: "r-d" in d.recved)
    assert "r-d" in d.failed
    for name, cache in d.caches.items():
        assert torch.equal(cache[[6, 7]], before[name]), "nothing read"
    p.close(), squatter.close(), d.close()


def test_a_decoders_record_squatted_on_another_side_channel_never_stands_in_for_it():
    """Issue 56, push: the prefill cached a decoder's record by (engine, rank), whatever
    rendezvous its ids named: once an instance serving side channel B pushed one request of its
    own in the name of decoder ``sqp-d`` (whose own side channel is A), the prefill took B's
    record for every later push to ``sqp-d`` — with the engine's sender identity it dropped the
    real decoder's ids (their sender is not B's engine) and the load failed; without it, it
    wrote the request's KV into B's memory."""
    a, b, own = (f"127.0.0.1:{free_port()}" for _ in range(3))
    p = Instance("sqp-p", None, extra={"rendezvous": None, "side_channel": own,
                                       "peer_side_channels": [a, b]})
    decoder = {"rendezvous": None, "peer_side_channels": [own], "push_timeout_s": 3.0}
    d = Instance("sqp-d", None, extra={**decoder, "side_channel": a})
    squatter = Instance("sqp-d", None, extra={**decoder, "side_channel": b})

    def pushed(req):
        return {"do_remote_prefill": True, "xfer_push": True, "remote_engine_id": "sqp-p",
                "remote_request_id": req, "remote_rendezvous": f"xfer://{own}",
                "xfer_token": proxy_token(req)}

    def push(req, ids):
        r = push_prefill(p, req, 8, ids)
        wanted(p, req)
        compute(p, list(p.full))
        finish(p, r, ids)

    decode(squatter, "bait-d", 8, pushed("bait"), [10, 11])  # B's own request: pushed to B
    squatter.step()
    push("bait", [1, 2])
    squatter.wait("the bait", lambda: "bait-d" in squatter.recved)
    assert not squatter.failed
    before = {name: cache[[12, 13]].clone() for name, cache in squatter.caches.items()}
    decode(d, "q-d", 8, pushed("q"), [12, 13])
    d.step()
    push("q", [3, 4])
    d.wait("the pushed request", lambda: "q-d" in d.recved)
    assert not d.failed
    assert_copied(p, d, [3, 4], [12, 13])
    for name, cache in squatter.caches.items():
        assert torch.equal(cache[[12, 13]], before[name]), "nothing written to B"
    p.close(), d.close(), squatter.close()


# ---- the operator's rendezvous settings (issue 56 M5) ----


def private(path, text):
    path.write_text(text)
    path.chmod(0o600)
    return path


def test_side_channels_and_their_clients_take_the_secret_and_etcd_settings_of_the_engine_config(
        tmp_path, monkeypatch, rendezvous_dials):
    """Issue 56 M5: the cluster secret and etcd's TLS and user, named only in the engine config
    (``xfer_config``'s ``[security]`` and ``[rendezvous]``; no ``$XFER_SECRET_FILE``): each
    instance's side channel admits only holders of the secret, every rendezvous client of the
    connector (a worker's own, the prefill's it dials) is made with all of them, and a pull
    moves the blocks."""
    for name in ("XFER_SECRET_FILE", "XFER_ETCD_CA_FILE", "XFER_ETCD_USER", "XFER_ETCD_PASSWORD_FILE"):
        monkeypatch.delenv(name, raising=False)
    secret = private(tmp_path / "secret", "s" * 32)
    settings = {"etcd_ca_file": str(tmp_path / "ca.pem"), "etcd_user": "xfer",
                "etcd_password_file": str(tmp_path / "password")}
    config = {**MOCK, "security": {"secret_file": str(secret)}, "rendezvous": settings}
    dialled = rendezvous_dials
    side = {n: f"127.0.0.1:{free_port()}" for n in "pd"}
    p = Instance("m5-p", None, extra={"rendezvous": None, "side_channel": side["p"], "xfer_config": config,
                                      "peer_side_channels": [side["d"]]})
    d = Instance("m5-d", None, extra={"rendezvous": None, "side_channel": side["d"], "xfer_config": config,
                                      "peer_side_channels": [side["p"]]})
    try:
        load(d, "r-d", 10, prefill(p, "r", 10, [3, 5, 7]), [0, 9, 2])
        assert not d.failed
        assert_copied(p, d, [3, 5, 7], [0, 9, 2])
        expected = {"secret_file": str(secret), **settings}
        assert {url for url, _ in dialled} == {f"xfer://{side['p']}", f"xfer://{side['d']}"}
        for url, options in dialled:
            assert {k: options.get(k) for k in expected} == expected, url
        for url in side.values():
            with pytest.raises(xfer.RendezvousError, match="authentication failed"):
                dialled.real(f"xfer://{url}", connect_timeout=2)
    finally:
        p.close(), d.close()


def test_a_password_without_tls_is_refused_by_name_when_the_connector_starts(server, tmp_path, monkeypatch):
    """Issue 56 M5: etcd's user and password without TLS would send the password in cleartext;
    the connector refuses it when vLLM makes it (scheduler and worker alike), naming the
    settings and where they came from — not at the first lookup, and not only in a build with
    the etcd client."""
    monkeypatch.delenv("XFER_ETCD_CA_FILE", raising=False)
    monkeypatch.setenv("XFER_ETCD_USER", "xfer")
    monkeypatch.setenv("XFER_ETCD_PASSWORD_FILE", str(private(tmp_path / "password", "pw\n")))
    with pytest.raises(xfer.ConfigError,
                       match=r"XferConnector: .*etcd_password_file \(\$XFER_ETCD_PASSWORD_FILE\).*cleartext"):
        Instance("m5-refused", server)
