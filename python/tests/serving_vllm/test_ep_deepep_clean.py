"""xfer's ``deep_ep.Buffer``: the two clean calls after a masked rank, in two processes on CPU
tensors over libfabric shm, checked against the communication-free oracle.

DeepEP's ``clean_low_latency_buffer`` is collective (a barrier on every rank around clearing
the buffer): xfer's re-forms every shape's group there — new regions, the records all-gathered
through the Buffer's process group, the masks cleared and one epoch agreed. Neither host calls
it in what xfer provides (SGLang calls it when switching from normal mode, which xfer does not
provide; vLLM's ``clean_buffers`` calls ``low_latency_clean_mask_buffer``, a local call, which
keeps the epochs: vLLM's ranks run every step): this test calls the ``Buffer`` directly, as a
host would. Stand-ins: no framework around the Buffer; the process group is gloo."""

import multiprocessing as mp
import os
import socket
import traceback

import numpy as np
import pytest

torch = pytest.importorskip("torch")

from xfer.ep import EpError, oracle  # noqa: E402
from xfer.ep.deep_ep import shim_path  # noqa: E402
from xfer.ep.layout import EpConfig, from_f32  # noqa: E402

SHM = {
    "backend": "efa",
    "groups": [{"nics": ["auto"]}],
    "backends": {"efa": {"provider": "shm"}},
    "timeouts": {"expect_ms": 120000, "transfer_ms": 120000, "connect_ms": 20000},
    "worker": {"idle_poll_us": 0},
}
RANKS, EXPERTS, TOP_K, MAX_TOKENS, HIDDEN = 2, 4, 2, 4, 128
SILENT = 1


def rank_main(rank, port, conn, shrink):
    try:
        import json
        import sys

        sys.path.insert(0, shim_path())
        os.environ["XFER_EP_CONFIG"] = json.dumps(SHM)
        # Two timeouts for a header: rank 0 masks the silent rank within 6 s; live ranks on a
        # loaded machine are not late by that much.
        os.environ["XFER_EP_TIMEOUT"] = "3"
        import deep_ep
        import torch.distributed as dist

        from xfer.ep.tensors import storage_of, tensor_of

        assert getattr(deep_ep, "__xfer__", False), f"deep_ep is not xfer's: {deep_ep.__file__}"
        dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=RANKS)
        group = dist.new_group(list(range(RANKS)), backend="gloo")
        # Outputs staged as on a device: separate tensors the receive fills (in the hook).
        import xfer.ep.deep_ep

        xfer.ep.deep_ep.STAGE_CPU_TENSORS = True  # the shim re-exports; the flag is the module's
        buffer = deep_ep.Buffer(group, 0, 1 << 20, low_latency_mode=True, explicitly_destroy=True, enable_shrink=shrink)
        cfg = EpConfig(ranks=RANKS, experts_per_rank=EXPERTS // RANKS, top_k=TOP_K, max_tokens=MAX_TOKENS, hidden=HIDDEN)

        def step(n, active=None):
            ins = [oracle.inputs(37, n, s, cfg) for s in range(RANKS)]
            x, idx, w = ins[rank]
            recv_x, recv_count, handle, _, hook = buffer.low_latency_dispatch(
                tensor_of(x.copy(), "bfloat16"), torch.from_numpy(idx), MAX_TOKENS, EXPERTS, use_fp8=False,
                return_recv_hook=True)
            hook()  # fills the tensors it returned (they were copied before it, and stale, once)
            got, counts = storage_of(recv_x), recv_count.numpy()
            expected = oracle.expected_recv(ins, rank, cfg, active=active)
            for le in range(cfg.experts_per_rank):
                assert counts[le] == len(expected[le]), f"step {n} expert {le}"
                assert np.array_equal(got[le, : counts[le]], expected[le]), f"step {n} expert {le}: rows differ"
            out = tensor_of(oracle.run_experts_deepep(got, counts, rank, cfg), "bfloat16")
            combined, _, _ = buffer.low_latency_combine(out, torch.from_numpy(idx), torch.from_numpy(w), handle)
            ref = from_f32(oracle.expected_combine(x, idx, w, cfg, active=active), "bfloat16")
            assert np.array_equal(storage_of(combined), ref), f"step {n}: combine differs"

        def masked():
            mask = torch.full((RANKS,), 7, dtype=torch.int32)
            buffer.low_latency_query_mask_buffer(mask)
            return mask.tolist()

        step(0)
        if not shrink:
            # No shrink mode: a silent rank is an error, not zeros (DeepEP's meaning).
            if rank != SILENT:
                with pytest.raises(EpError, match=rf"rank\(s\) \[{SILENT}\] missed their deadlines.*enable_shrink"):
                    step(1, active=[r != SILENT for r in range(RANKS)])
            dist.barrier(group)
            buffer.destroy()
            conn.send("ok")
            return
        if rank != SILENT:
            # The silent rank runs no step 1: this one masks it (its tokens count zero).
            step(1, active=[r != SILENT for r in range(RANKS)])
            assert masked() == [1 if r == SILENT else 0 for r in range(RANKS)]
        dist.barrier(group)
        buffer.clean_low_latency_buffer(MAX_TOKENS, HIDDEN, EXPERTS)
        assert masked() == [0] * RANKS
        for n in (2, 3):
            step(n)
        assert masked() == [0] * RANKS
        dist.barrier(group)
        buffer.destroy()
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


@pytest.mark.parametrize("shrink", [True, False])
def test_clean_low_latency_buffer_agrees_the_epoch_after_a_silent_rank(shrink):
    """Rank 1 runs no step 1; rank 0 does, masking it. With ``enable_shrink`` (vLLM's
    --enable-fault-tolerance) both then call ``clean_low_latency_buffer``: the masks are clear
    and the ranks, one step apart before, agree on the epoch — steps 2 and 3 are exact on both
    (before, the call did nothing and the ranks stayed a step apart). Without it, rank 0's
    step 1 raises, naming rank 1 (before, its tokens silently counted zero). Every dispatch
    goes through the receive hook with outputs staged as on a device (before, they were
    copied before the hook ran: an older step's rows)."""
    if not efa_plugin():
        pytest.skip("the efa plugin (libfabric shm) is not in the package")
    ctx = mp.get_context("spawn")
    port = free_port()
    pipes = [ctx.Pipe() for _ in range(RANKS)]
    procs = [ctx.Process(target=rank_main, args=(r, port, pipes[r][1], shrink)) for r in range(RANKS)]
    for p in procs:
        p.start()
    try:
        for r in range(RANKS):
            assert pipes[r][0].poll(180), f"rank {r} did not finish"
            reply = pipes[r][0].recv()
            assert reply == "ok", reply
    finally:
        for p in procs:
            p.join(30)
            if p.is_alive():
                p.kill()
