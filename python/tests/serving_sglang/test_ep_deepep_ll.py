"""SGLang's own low-latency DeepEP dispatcher over xfer's ``deep_ep`` (``xfer.ep.deep_ep``), in
two processes on CPU tensors over libfabric shm, checked against the communication-free oracle.

What runs is SGLang's: the server arguments its CLI makes of ``--moe-a2a-backend deepep
--deepep-mode low_latency --deepep-dispatcher-output-dtype bf16``, published as its scheduler
does; ``_DeepEPDispatcherImplLowLatency`` (``dispatch_a``/``dispatch_b``/``combine_a``/
``combine_b``, with and without the receive hook), whose ``DeepEPBuffer.get_deepep_buffer``
builds the ``Buffer`` with its own kwargs. ``deep_ep`` is xfer's because its directory is first
on the path (the opt-in). Stand-ins: ``get_deepep_buffer`` reads the GPU's SM count
(``torch.cuda.get_device_properties``) only to warn about normal mode: it is given a GPU's
answer; the process group is a gloo group of the two processes, not SGLang's model-parallel
one."""

import multiprocessing as mp
import os
import socket
import traceback

import numpy as np
import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("sglang")

from xfer.ep import oracle  # noqa: E402
from xfer.ep.deep_ep import shim_path  # noqa: E402
from xfer.ep.layout import EpConfig, from_f32  # noqa: E402

SHM = {
    "backend": "efa",
    "groups": [{"nics": ["auto"]}],
    "backends": {"efa": {"provider": "shm"}},
    "timeouts": {"expect_ms": 700000, "transfer_ms": 120000, "connect_ms": 20000},
    "worker": {"idle_poll_us": 0},
}
HIDDEN, RANKS, MAX_TOKENS, EXPERTS, TOP_K = 2048, 2, 8, 8, 4


def rank_main(rank, port, conn, steps):
    try:
        import argparse
        import json
        import sys
        from types import SimpleNamespace

        sys.path.insert(0, shim_path())  # PYTHONPATH's entries lead sys.path (spawn copies the parent's)
        os.environ["SGLANG_DEEPEP_NUM_MAX_DISPATCH_TOKENS_PER_RANK"] = str(MAX_TOKENS)
        os.environ["XFER_EP_CONFIG"] = json.dumps(SHM)
        os.environ["XFER_EP_TIMEOUT"] = "60"  # no failure is tested here: no live rank may be masked under load
        import torch.distributed as dist
        from sglang.srt.runtime_context import SpawnRanks, publish
        from sglang.srt.server_args import ServerArgs

        parser = argparse.ArgumentParser()
        ServerArgs.add_cli_args(parser)
        args = ServerArgs.from_cli_args(parser.parse_args([
            "--model-path", "dummy", "--device", "cpu", "--moe-a2a-backend", "deepep",
            "--deepep-mode", "low_latency", "--deepep-dispatcher-output-dtype", "bf16",
            "--tp-size", str(RANKS), "--ep-size", str(RANKS),
        ]))
        publish(args, role="scheduler", ranks=SpawnRanks(world_rank=rank))
        dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=RANKS)
        group = dist.new_group(list(range(RANKS)), backend="gloo")

        import deep_ep
        from sglang.srt.layers.moe.token_dispatcher import deepep as sglang_deepep
        from sglang.srt.layers.moe.utils import DeepEPMode

        assert getattr(deep_ep, "__xfer__", False) and sglang_deepep.use_deepep, sglang_deepep._deepep_import_error
        torch.cuda.get_device_properties = lambda device=None: SimpleNamespace(multi_processor_count=132)

        from xfer.ep.tensors import storage_of, tensor_of

        cfg = EpConfig(ranks=RANKS, experts_per_rank=EXPERTS // RANKS, top_k=TOP_K, max_tokens=MAX_TOKENS, hidden=HIDDEN)
        for hook in (True, False):
            impl = sglang_deepep._DeepEPDispatcherImplLowLatency(
                return_recv_hook=hook, group=group, router_topk=TOP_K, permute_fusion=False, num_experts=EXPERTS,
                num_local_experts=EXPERTS // RANKS, hidden_size=HIDDEN, params_dtype=torch.bfloat16,
                deepep_mode=DeepEPMode.LOW_LATENCY,
            )
            assert not impl.use_fp8
            for step in range(steps):
                ins = [oracle.inputs(41, step + 10 * hook, s, cfg, routing=("zipf", "uniform")[step % 2]) for s in range(RANKS)]
                x, idx, w = ins[rank]
                topk = SimpleNamespace(topk_weights=torch.from_numpy(w), topk_ids=torch.from_numpy(idx))
                state = impl.dispatch_a(tensor_of(x.copy(), "bfloat16"), topk)
                out = impl.dispatch_b(*state)
                counts = out.masked_m.numpy()
                got = storage_of(out.hidden_states)
                expected = oracle.expected_recv(ins, rank, cfg)
                for le in range(cfg.experts_per_rank):
                    assert counts[le] == len(expected[le]) and np.array_equal(got[le, : counts[le]], expected[le]), (
                        f"step {step} expert {le}"
                    )
                fused = tensor_of(oracle.run_experts_deepep(got, counts, rank, cfg), "bfloat16")
                combined = impl.combine_b(*impl.combine_a(fused, out.topk_ids, out.topk_weights))
                ref = from_f32(oracle.expected_combine(x, idx, w, cfg), "bfloat16")
                assert np.array_equal(storage_of(combined), ref), f"step {step}: combine differs"
            mask = torch.ones(RANKS, dtype=torch.int32)
            impl._get_buffer().low_latency_query_mask_buffer(mask)
            assert mask.tolist() == [0] * RANKS
        dist.barrier(group)
        conn.send("ok")
    except BaseException as exc:  # noqa: BLE001 - reported to the parent
        conn.send(f"rank {rank}: {exc!r}\n{traceback.format_exc()}")


def efa_plugin():
    import xfer  # noqa: F401 - puts the package's plugins on XFER_PLUGIN_PATH

    dirs = [d for d in os.environ.get("XFER_PLUGIN_PATH", "").split(os.pathsep) if d]
    return any(os.path.exists(os.path.join(d, "libbackend_efa.so")) for d in dirs)


def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def wait_all(pipes, limit=240):
    """Every rank's verdict; the first failure fails at once (its peers may wait forever)."""
    import time

    pending = set(range(len(pipes)))
    deadline = time.monotonic() + limit
    while pending:
        from multiprocessing.connection import wait

        ready = wait([pipes[r][0] for r in pending], timeout=max(0.0, deadline - time.monotonic()))
        assert ready, f"ranks {sorted(pending)} did not finish"
        for r in [r for r in pending if pipes[r][0] in ready]:
            reply = pipes[r][0].recv()
            assert reply == "ok", reply
            pending.discard(r)


def test_sglang_low_latency_dispatcher_over_xfer():
    if not efa_plugin():
        pytest.skip("the efa plugin (libfabric shm) is not in the package")
    ctx = mp.get_context("spawn")
    port = free_port()
    pipes = [ctx.Pipe() for _ in range(RANKS)]
    procs = [ctx.Process(target=rank_main, args=(r, port, pipes[r][1], 2)) for r in range(RANKS)]
    for p in procs:
        p.start()
    try:
        wait_all(pipes)
    finally:
        for p in procs:
            p.join(30)
            if p.is_alive():
                p.kill()
