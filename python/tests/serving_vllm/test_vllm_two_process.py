"""The vLLM connector across two processes (issue 28): a prefill instance and a decode instance,
each its own process with vLLM's connectors and torch CPU caches, over libfabric's shm and tcp
providers (loopback), meeting through a rendezvous service in the test process — as two
machines would. Every byte of every block read is checked against what the prefill computed,
and the prefill frees its blocks once read."""

import os

os.environ.setdefault("VLLM_TARGET_DEVICE", "cpu")

import multiprocessing as mp
import sys
from pathlib import Path

import pytest

vllm = pytest.importorskip("vllm")

import xfer  # noqa: E402

sys.path.insert(0, str(Path(__file__).parent))
import vllm_caches  # noqa: E402

# Verbs where rxe0 exists: `cargo xtask vllm` (and so `cargo xtask test`) runs the pull variant
# in the rxe guest, where importing torch and vLLM under emulation takes minutes per process.
PROVIDERS = ["shm", "tcp;ofi_rxm", "verbs"]


def patience(provider):
    """Seconds a process waits for the other one: under the guest's emulation the decode
    process starts minutes after the prefill process offered its requests (and the lease and
    push deadlines must outlast that, or the prefill frees the blocks first)."""
    return 1200 if provider == "verbs" else 60


LAYERS, BLOCKS, BLOCK = 3, 32, 16
NAMES = [f"model.layers.{i}.self_attn.attn" for i in range(LAYERS)]
REQUESTS = {"a": [3, 9, 4], "b": [17], "c": [20, 21, 22, 23, 24, 25, 26, 27]}  # prefill's blocks


def xfer_config(provider):
    if provider == "verbs":
        return {"backend": "verbs", "groups": [{"nics": ["rxe0"]}],
                "timeouts": {"transfer_ms": 60000, "connect_ms": 60000}, "worker": {"idle_poll_us": 0}}
    return {
        "backend": "efa",
        "groups": [{"nics": ["auto"]}],
        "backends": {"efa": {"provider": provider}},
        "timeouts": {"transfer_ms": 20000, "connect_ms": 20000},
        "worker": {"idle_poll_us": 0},
    }


def zlib_crc(text):
    import zlib

    return zlib.crc32(text.encode())


def model_kv(caches, seed):
    """Each layer's bytes as the prefill's model computed them (the same in every process)."""
    import torch

    gen = torch.Generator().manual_seed(seed)
    return {name: torch.randint(0, 64, caches[name].view(torch.uint8).shape, generator=gen,
                                dtype=torch.uint8) for name in NAMES}


def instance(engine_id, rendezvous, provider, model_dir):
    """A vLLM instance's scheduler- and worker-side connectors, and the KV caches vLLM
    allocates for the model (one buffer, a view per layer), registered."""
    from vllm.config import CacheConfig, KVTransferConfig, VllmConfig
    from vllm.distributed.kv_transfer.kv_connector.factory import KVConnectorFactory
    from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorRole

    config = VllmConfig(
        model_config=vllm_caches.load_model_config(model_dir),
        cache_config=CacheConfig(block_size=BLOCK),
        kv_transfer_config=KVTransferConfig(
            kv_connector="XferConnector",
            kv_connector_module_path="xfer.vllm",
            kv_role="kv_both",
            engine_id=engine_id,
            kv_connector_extra_config={
                "rendezvous": rendezvous,
                "xfer_config": xfer_config(provider),
                "free_timeout_s": 2.0 * patience(provider),
                "push_timeout_s": 2.0 * patience(provider),
            },
        ),
    )
    kv_cache_config, caches = vllm_caches.allocate(config, NAMES, BLOCKS)
    scheduler = KVConnectorFactory.create_connector(config, KVConnectorRole.SCHEDULER, kv_cache_config)
    worker = KVConnectorFactory.create_connector(config, KVConnectorRole.WORKER, kv_cache_config)
    return scheduler, worker, caches


def step(scheduler, worker, done):
    from vllm.v1.core.sched.output import SchedulerOutput

    worker.bind_connector_metadata(scheduler.build_connector_meta(SchedulerOutput.make_empty()))
    worker.start_load_kv(None)
    worker.clear_connector_metadata()
    poll(worker, done)


def poll(worker, done):
    r = worker.get_transfer_results(set())
    done["sent"] |= r.finished_sending
    done["recved"] |= r.finished_recving
    done["failed"] |= r.failed_recving


def until(what, cond, worker, done, seconds=60):
    import time

    deadline = time.monotonic() + seconds
    while not cond():
        if time.monotonic() > deadline:
            raise TimeoutError(f"timed out waiting for {what}: {done}")
        poll(worker, done)
        time.sleep(0.002)


def prefill_process(rendezvous, provider, mode, model_dir, conn):
    os.environ["FI_TCP_IFACE"] = "lo"
    from vllm.sampling_params import SamplingParams
    from vllm.v1.core.kv_cache_manager import KVCacheBlocks
    from vllm.v1.core.kv_cache_utils import KVCacheBlock
    from vllm.v1.request import Request, RequestStatus

    import torch

    scheduler, worker, kv = instance("prefill", rendezvous, provider, model_dir)
    for name, computed in model_kv(kv, seed=11).items():
        kv[name].view(torch.uint8).copy_(computed)
    worker.register_kv_caches(kv)
    done = {"sent": set(), "recved": set(), "failed": set()}
    params, requests = {}, {}
    push = {"do_remote_decode": True, "xfer_push": True} if mode == "push" else {"do_remote_decode": True}
    for req_id, block_ids in REQUESTS.items():
        # A pushed request's token: the proxy's, given to both instances.
        token = {"xfer_token": f"{zlib_crc(req_id):08x}" * 4} if mode == "push" else {}
        r = Request(req_id, list(range(len(block_ids) * BLOCK)),
                    SamplingParams(max_tokens=1,
                                   extra_args={"kv_transfer_params": dict(push, **token)}),
                    None)
        requests[req_id] = r
        if mode == "push":
            # Scheduled; the decode instance is asked first and sends its block ids.
            scheduler.update_state_after_alloc(r, KVCacheBlocks((tuple(KVCacheBlock(i) for i in block_ids),)), 0)
            params[req_id] = {"do_remote_prefill": True, "xfer_push": True, "remote_engine_id": "prefill",
                              "remote_request_id": req_id, "remote_tp_size": 1,
                              "remote_block_ids": [block_ids], **token}
        else:
            r.status = RequestStatus.FINISHED_LENGTH_CAPPED
            delay, params[req_id] = scheduler.request_finished(r, block_ids)
            assert delay
    step(scheduler, worker, done)
    conn.send(params)
    if mode == "push":
        push = worker._worker.push
        until("every decoder's block ids",
              lambda: all(push.wants(r) for r in REQUESTS), worker, done,
              patience(provider))
        for name, cache in kv.items():  # the forward pass, layer by layer
            worker.save_kv_layer(name, cache, None)
        worker.wait_for_save()
        for req_id, block_ids in REQUESTS.items():
            requests[req_id].status = RequestStatus.FINISHED_LENGTH_CAPPED
            assert scheduler.request_finished(requests[req_id], block_ids) == (True, None)
        step(scheduler, worker, done)
    until("every request freed", lambda: set(REQUESTS) <= done["sent"], worker, done,
          patience(provider))
    conn.send(("freed", sorted(done["sent"])))
    # Serving on until the decode instance has its answers, as a prefill instance does: its
    # last replies (that it held the blocks) may still be in flight when the blocks are freed.
    assert conn.recv() == "stop"
    worker.shutdown()


def decode_process(rendezvous, provider, model_dir, conn):
    os.environ["FI_TCP_IFACE"] = "lo"
    import torch
    from vllm.sampling_params import SamplingParams
    from vllm.v1.core.kv_cache_manager import KVCacheBlocks
    from vllm.v1.core.kv_cache_utils import KVCacheBlock
    from vllm.v1.request import Request

    scheduler, worker, mine = instance("decode", rendezvous, provider, model_dir)
    for cache in mine.values():
        cache.zero_()
    worker.register_kv_caches(mine)
    # Started beside the prefill process (their imports overlap): its requests come now.
    params = conn.recv()
    done = {"sent": set(), "recved": set(), "failed": set()}
    local = {}
    free = iter(range(BLOCKS - 1, -1, -1))  # other block ids than the prefill's
    for req_id, p in params.items():
        [remote] = p["remote_block_ids"]  # one KV cache group
        ids = [next(free) for _ in remote]
        local[req_id] = ids
        r = Request(req_id + "-d", list(range(len(ids) * BLOCK)),
                    SamplingParams(max_tokens=4, extra_args={"kv_transfer_params": dict(p)}), None)
        n, is_async = scheduler.get_num_new_matched_tokens(r, 0)
        assert (n, is_async) == (len(ids) * BLOCK, True)
        scheduler.update_state_after_alloc(r, KVCacheBlocks((tuple(KVCacheBlock(i) for i in ids),)), n)
    step(scheduler, worker, done)
    want = {r + "-d" for r in params}
    until("every load", lambda: want <= done["recved"], worker, done, patience(provider))
    if done["failed"]:
        conn.send(f"failed loads: {done['failed']}, blocks {worker.get_block_ids_with_load_errors()}")
        return
    expected = model_kv(mine, seed=11)
    for req_id, p in params.items():
        for name, computed in expected.items():
            got = mine[name].view(torch.uint8)[local[req_id]]
            if not torch.equal(got, computed[p["remote_block_ids"][0]]):
                conn.send(f"{req_id} {name}: blocks differ")
                return
    conn.send("ok")
    worker.shutdown()


@pytest.mark.parametrize("mode", ["pull", "push"])
@pytest.mark.parametrize("provider", PROVIDERS)
def test_prefill_and_decode_processes(provider, mode, tmp_path):
    backend = "verbs" if provider == "verbs" else "efa"
    if backend == "verbs" and not os.path.exists("/sys/class/infiniband/rxe0"):
        pytest.skip("no soft-RoCE device here: cargo xtask vllm runs this in the rxe guest")
    plugins = os.path.join(os.path.dirname(xfer.__file__), "plugins", f"libbackend_{backend}.so")
    if not os.path.exists(plugins):
        pytest.skip(f"the {backend} plugin is not in the package (cargo xtask vllm stages it)")
    ctx = mp.get_context("spawn")
    # Both instances serve one model (the connector refuses another model's KV).
    vllm_caches.write_model(tmp_path, num_hidden_layers=LAYERS)
    server = xfer.Server()
    try:
        p_here, p_there = ctx.Pipe()
        d_here, d_there = ctx.Pipe()
        prefill = ctx.Process(target=prefill_process, args=(server.url, provider, mode, tmp_path, p_there))
        decode = ctx.Process(target=decode_process, args=(server.url, provider, tmp_path, d_there))
        prefill.start()
        decode.start()
        try:
            # Importing torch and vLLM under the rxe guest's emulation takes minutes.
            start = 900 if provider == "verbs" else 120
            assert p_here.poll(start), "the prefill process did not start"
            d_here.send(p_here.recv())
            assert d_here.poll(start), "the decode process did not answer"
            assert d_here.recv() == "ok"
            assert p_here.poll(60), "the prefill never freed its blocks"
            assert p_here.recv() == ("freed", sorted(REQUESTS))
            decode.join(60)
            p_here.send("stop")
            prefill.join(60)
            assert (decode.exitcode, prefill.exitcode) == (0, 0)
        finally:
            for p in (prefill, decode):
                if p is not None and p.is_alive():
                    p.kill()
    finally:
        server.close()
