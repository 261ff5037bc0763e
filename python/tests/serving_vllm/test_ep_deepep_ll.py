"""vLLM's own low-latency DeepEP path over xfer's ``deep_ep`` (``xfer.ep.deep_ep``), in two
processes on CPU tensors over libfabric shm, checked against the communication-free oracle.

What runs is vLLM's: ``DeepEPLLAll2AllManager.get_handle`` makes the ``Buffer`` (its kwargs,
its handle cache), and ``DeepEPLLPrepareAndFinalize`` dispatches (``prepare``, and
``prepare_async`` + hook as DBO does) and combines (``finalize`` / ``finalize_async``) in
vLLM's call order. ``deep_ep`` is xfer's because its directory is first on PYTHONPATH (the
opt-in a user makes). Stand-ins: the manager is built without vLLM's engine around it (its
``__init__`` reads a running VllmConfig; we set the attributes ``get_handle`` uses), and its
``query_active_mask`` allocates on ``cuda``: the mask is read through the same Buffer call it
makes (``low_latency_query_mask_buffer``) on a CPU tensor.

A second control beside the oracle: vLLM's own single-process batched reference,
``BatchedPrepareAndFinalize`` (``fused_moe/prepare_finalize/batched.py``), run in each rank on
every rank's tokens concatenated in rank order with every expert local (``rank=0``,
``num_local_experts`` = all experts, one dispatcher), the oracle's experts between its
``prepare`` and ``finalize``. At each rank and step, xfer's rows through vLLM's
``DeepEPLLPrepareAndFinalize`` must equal the reference's rows of the same global experts:
same counts, same rows, in the same ORDER. The reference fills each expert's batch in token
order of the concatenated batch (a cumsum over its hit mask), i.e. sources in rank order, each
source's tokens in its order, which is the order xfer documents. (The reference keeps one row
per (token, expert), DeepEP one per (token, slot); they agree because a router names distinct
experts per token, as the oracle's does.) Combine: the reference's ``finalize`` (its default
``TopKWeightAndReduceNaiveBatched``) on the same expert outputs, run in float32 and rounded to
bf16 once, must equal vLLM's ``finalize`` over xfer bit for bit (on the oracle's inputs every
product and sum is exact in float32, so its expert-major summation order, not xfer's slot
order, cannot matter). Run in bf16, as in a bf16 model, the reference rounds each weighted
output and each partial sum to bf16 where DeepEP (and xfer) sum in float32 and round once: it
is then compared within ``(top_k + 2) · 2⁻⁸ · Σ|w·y|`` per element (2⁻⁸ is bf16's unit
roundoff; a product and up to top_k - 1 additions rounded in the reference bound its error by
top_k · 2⁻⁸ · Σ|w·y| to first order, xfer's one rounding adds 2⁻⁸, and 2⁻⁸ more covers the
second-order terms). In these runs it differs by one bf16 ulp on some elements of the
8-expert top-8 shapes.

fp8: the reference's quantized ``prepare`` calls ``per_token_group_quant_fp8``, whose CPU path
is a Triton kernel (no Triton on CPU), so it cannot run here. For the fp8 shape, vLLM's
torch-native twin of that quantizer (``QuantFP8(group_shape=(1, 128)).forward_native``, the
same ``amax / 448`` scale) quantizes each expert's rows after the reference's ``prepare``, as
its quantized ``prepare`` does; xfer's e4m3 values and scales must equal it byte for byte, and
the experts and ``finalize`` then run on the dequantized rows (order, combine as above)."""

import multiprocessing as mp
import os
import socket
import traceback

import numpy as np
import pytest

torch = pytest.importorskip("torch")

from xfer.ep import oracle  # noqa: E402
from xfer.ep.deep_ep import shim_path  # noqa: E402
from xfer.ep.layout import EpConfig, from_f32, to_f32  # noqa: E402

SHM = {
    "backend": "efa",
    "groups": [{"nics": ["auto"]}],
    "backends": {"efa": {"provider": "shm"}},
    "timeouts": {"expect_ms": 700000, "transfer_ms": 120000, "connect_ms": 20000},
    "worker": {"idle_poll_us": 0},
}
HIDDEN = 2048  # the smallest hidden size vLLM's DeepEPLLPrepareAndFinalize accepts
RANKS = 2


def rank_main(rank, port, conn, shapes, max_tokens, steps):
    try:
        import json
        import sys

        # The opt-in as the process sees it: PYTHONPATH's entries lead sys.path (multiprocessing's
        # spawn hands the child the parent's sys.path, so it is put there as the interpreter would).
        sys.path.insert(0, shim_path())

        import torch.distributed as dist
        from types import SimpleNamespace

        import deep_ep
        from vllm.distributed.device_communicators.all2all import DeepEPLLAll2AllManager
        from vllm.distributed.device_communicators.base_device_communicator import Cache

        assert getattr(deep_ep, "__xfer__", False), f"deep_ep is not xfer's: {deep_ep.__file__}"
        os.environ["XFER_EP_CONFIG"] = json.dumps(SHM)
        os.environ["XFER_EP_TIMEOUT"] = "60"  # no failure is tested here: no live rank may be masked under load
        dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=RANKS)
        group = dist.new_group(list(range(RANKS)), backend="gloo")

        manager = DeepEPLLAll2AllManager.__new__(DeepEPLLAll2AllManager)
        manager.cpu_group, manager.support_fault_tolerance, manager.handle_cache = group, True, Cache()
        manager.world_size = RANKS
        for num_experts, top_k, fp8 in shapes:
            run_shape(rank, manager, group, num_experts, top_k, max_tokens, steps, fp8)
        dist.barrier(group)
        manager.destroy()
        conn.send("ok")
    except BaseException as exc:  # noqa: BLE001 - reported to the parent
        conn.send(f"rank {rank}: {exc!r}\n{traceback.format_exc()}")


def batched_reference(ins, num_experts, top_k, quantize=None):
    """vLLM's single-process batched reference on every rank's inputs ``ins``:
    ``BatchedPrepareAndFinalize.prepare`` on the concatenation of the ranks' tokens, ``topk_ids``
    and ``topk_weights`` (rank order), every expert local; the oracle's experts; its ``finalize``
    in float32 (on the bf16 expert outputs) and in bf16. ``quantize`` (fp8): applied to each
    expert's rows after ``prepare``, as the reference's quantized ``prepare`` does (rows
    selected, then quantized), returning ``(e4m3 codes, float32 scales)``; the experts then run
    on the dequantized rows. Returns a dict: ``rows`` ``[experts, all tokens, hidden]`` (bf16
    bits; dequantized for fp8), ``counts``, ``codes`` / ``scales`` (per expert, fp8 only),
    ``y`` (expert outputs, bf16 bits) and ``combine``: per rank, the float32 combine, the bf16
    combine (bits) and ``Σ|w·y|`` (float32)."""
    from vllm.model_executor.layers.fused_moe.config import FusedMoEQuantConfig
    from vllm.model_executor.layers.fused_moe.prepare_finalize.batched import BatchedPrepareAndFinalize
    from vllm.model_executor.layers.fused_moe.topk_weight_and_reduce import TopKWeightAndReduceDelegate

    from xfer.ep.tensors import storage_of, tensor_of

    # One intra-op thread: the reference is small, and the two ranks already share the cores
    # (its index_add_ took ~0.1 s with two threads on a loaded 2-core machine, ~1 ms with one).
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        x = np.concatenate([t for t, _, _ in ins])
        topk_ids = torch.from_numpy(np.concatenate([i for _, i, _ in ins]))
        topk_weights = torch.from_numpy(np.concatenate([w for _, _, w in ins]))
        n = x.shape[0]
        pf = BatchedPrepareAndFinalize(max_num_tokens=n, num_local_experts=num_experts, num_dispatchers=1, rank=0)
        rows, scale, meta, _, _ = pf.prepare(tensor_of(x.copy(), "bfloat16"), topk_weights, topk_ids, num_experts, None, False,
                                             FusedMoEQuantConfig.make())
        assert scale is None
        ref = {"rows": storage_of(rows).copy(), "counts": meta.expert_num_tokens.numpy().copy()}
        if quantize is not None:
            ref["codes"], ref["scales"] = [], []
            for e in range(num_experts):
                k = int(ref["counts"][e])
                codes, scales = quantize(ref["rows"][e, :k])
                ref["codes"].append(codes)
                ref["scales"].append(scales)
                ref["rows"][e, :k] = from_f32(oracle.dequantize_fp8(codes, scales, HIDDEN), "bfloat16")
        every_expert_local = EpConfig(ranks=1, experts_per_rank=num_experts, top_k=top_k, max_tokens=n, hidden=HIDDEN)
        ref["y"] = oracle.run_experts_deepep(ref["rows"], ref["counts"], 0, every_expert_local)
        y32 = torch.from_numpy(to_f32(ref["y"], "bfloat16"))
        combine32, combine16, magnitude = (torch.empty((n, HIDDEN), dtype=d) for d in (torch.float32, torch.bfloat16, torch.float32))
        pf.finalize(combine32, y32, topk_weights, topk_ids, False, TopKWeightAndReduceDelegate())
        pf.finalize(combine16, tensor_of(ref["y"], "bfloat16"), topk_weights, topk_ids, False, TopKWeightAndReduceDelegate())
        pf.finalize(magnitude, y32.abs(), topk_weights.abs(), topk_ids, False, TopKWeightAndReduceDelegate())
        bounds = np.cumsum([0] + [len(t) for t, _, _ in ins])
        ref["combine"] = [(combine32.numpy()[a:b], storage_of(combine16)[a:b], magnitude.numpy()[a:b])
                          for a, b in zip(bounds[:-1], bounds[1:])]
    finally:
        torch.set_num_threads(threads)
    return ref


def run_shape(rank, manager, group, num_experts, top_k, max_tokens, steps, fp8=False):
    """Steps of one model shape, through vLLM's manager and prepare/finalize. ``fp8``: vLLM's
    fp8 dispatch (``use_fp8_dispatch`` with a 128-block fp8 quant config, so the experts get
    DeepEP's e4m3 values and float32 scales as they are): the rows are checked byte for byte
    against the oracle's own quantizer, and combine against the oracle run on the
    dequantized tokens."""
    import deep_ep
    import torch.distributed as dist
    from vllm.model_executor.layers.fused_moe.config import FusedMoEQuantConfig
    from vllm.model_executor.layers.fused_moe.prepare_finalize.deepep_ll import DeepEPLLPrepareAndFinalize
    from vllm.model_executor.layers.fused_moe.topk_weight_and_reduce import TopKWeightAndReduceDelegate

    from xfer.ep.tensors import storage_of, tensor_of

    buffer = manager.get_handle(dict(
        max_num_tokens_per_dp_rank=max_tokens, token_hidden_size=HIDDEN, num_ep_ranks=RANKS,
        num_global_experts=num_experts, num_local_experts=num_experts // RANKS,
    ))
    assert isinstance(buffer, deep_ep.Buffer) and buffer.low_latency_mode
    pf = DeepEPLLPrepareAndFinalize(buffer, max_tokens_per_rank=max_tokens, num_dispatchers=RANKS, use_fp8_dispatch=fp8)
    if fp8:
        quant = FusedMoEQuantConfig.make(quant_dtype=torch.float8_e4m3fn, block_shape=[128, 128])
    else:
        quant = FusedMoEQuantConfig.make()
    cfg = EpConfig(ranks=RANKS, experts_per_rank=num_experts // RANKS, top_k=top_k, max_tokens=max_tokens, hidden=HIDDEN,
                   fp8="e4m3" if fp8 else None)
    vllm_quantize = None
    if fp8:
        # The batched reference's quantizer (per_token_group_quant_fp8) is a Triton kernel off
        # GPU; its torch-native twin is vLLM's QuantFP8 with 128-channel groups.
        from vllm.config import VllmConfig, set_current_vllm_config
        from vllm.model_executor.layers.quantization.input_quant_fp8 import QuantFP8
        from vllm.model_executor.layers.quantization.utils.quant_utils import GroupShape

        with set_current_vllm_config(VllmConfig()):
            quant_fp8 = QuantFP8(static=False, group_shape=GroupShape(1, 128), use_ue8m0=False)

        def vllm_quantize(rows):
            if len(rows) == 0:
                return np.zeros((0, HIDDEN), dtype=np.uint8), np.zeros((0, HIDDEN // 128), dtype=np.float32)
            values, scales = quant_fp8.forward_native(tensor_of(rows.copy(), "bfloat16"))
            return values.view(torch.uint8).numpy(), scales.numpy()
    for step in range(steps):
        ins = [oracle.inputs(31, step, s, cfg, routing=("uniform", "zipf", "incast")[step % 3], tokens=max_tokens - s)
               for s in range(RANKS)]
        x, idx, w = ins[rank]
        a1 = tensor_of(x.copy(), "bfloat16")
        topk_ids, topk_weights = torch.from_numpy(idx), torch.from_numpy(w)
        if step % 2 == 0:
            expert_x, scale, meta, _, _ = pf.prepare(a1, topk_weights, topk_ids, num_experts, None, False, quant)
        else:
            hook, receiver = pf.prepare_async(a1, topk_weights, topk_ids, num_experts, None, False, quant)
            hook()
            expert_x, scale, meta, _, _ = receiver()
        counts = meta.expert_num_tokens.numpy()
        expected = oracle.expected_recv(ins, rank, cfg)
        if fp8:
            # vLLM hands DeepEP's pair on as it is: values [experts, ranks × max_tokens, hidden]
            # float8_e4m3fn, scales [..., hidden / 128] float32.
            assert expert_x.dtype == torch.float8_e4m3fn and scale.dtype == torch.float32
            codes, scales = expert_x.view(torch.uint8).numpy(), scale.numpy()
            got = np.zeros(codes.shape, dtype=np.uint16)
            for le in range(cfg.experts_per_rank):
                n = int(counts[le])
                assert n == len(expected[le]), f"step {step} expert {le}"
                ref_codes, ref_scales = oracle.quantize_fp8(expected[le], cfg)
                assert np.array_equal(codes[le, :n], ref_codes), f"step {step} expert {le}: e4m3 values differ"
                assert np.array_equal(scales[le, :n], ref_scales), f"step {step} expert {le}: scales differ"
                got[le, :n] = from_f32(oracle.dequantize_fp8(codes[le, :n], scales[le, :n], HIDDEN), "bfloat16")
            # Each token is quantized once, so every expert sees the same dequantized token.
            x_seen = from_f32(oracle.dequantize_fp8(*oracle.quantize_fp8(x, cfg), HIDDEN), "bfloat16")
        else:
            assert scale is None
            got = storage_of(expert_x)
            x_seen = x
            for le in range(cfg.experts_per_rank):
                assert counts[le] == len(expected[le]), f"step {step} expert {le}"
                assert np.array_equal(got[le, : counts[le]], expected[le]), f"step {step} expert {le}: rows differ"
        # vLLM's batched reference on every rank's inputs: this rank's experts' rows, in order.
        ref = batched_reference(ins, num_experts, top_k, vllm_quantize)
        for le in range(cfg.experts_per_rank):
            g, n = rank * cfg.experts_per_rank + le, int(counts[le])
            assert n == ref["counts"][g], f"step {step} expert {g}: {n} rows, the batched reference {ref['counts'][g]}"
            if fp8:
                assert np.array_equal(codes[le, :n], ref["codes"][g]), f"step {step} expert {g}: e4m3 values differ from vLLM's"
                assert np.array_equal(scales[le, :n], ref["scales"][g]), f"step {step} expert {g}: scales differ from vLLM's"
            assert np.array_equal(got[le, :n], ref["rows"][g, :n]), f"step {step} expert {g}: rows or their order differ from the batched reference"
        bf16_cfg = EpConfig(ranks=RANKS, experts_per_rank=cfg.experts_per_rank, top_k=top_k, max_tokens=max_tokens, hidden=HIDDEN)
        y = oracle.run_experts_deepep(got, counts, rank, bf16_cfg)
        for le in range(cfg.experts_per_rank):
            g, n = rank * cfg.experts_per_rank + le, int(counts[le])
            assert np.array_equal(y[le, :n], ref["y"][g, :n]), f"step {step} expert {g}: expert outputs differ"
        fused_out = tensor_of(y, "bfloat16")
        output = torch.empty((x.shape[0], HIDDEN), dtype=torch.bfloat16)
        if step % 2 == 0:
            pf.finalize(output, fused_out, topk_weights, topk_ids, False, TopKWeightAndReduceDelegate())
        else:
            recv_hook, done = pf.finalize_async(output, fused_out, topk_weights, topk_ids, False, TopKWeightAndReduceDelegate())
            recv_hook()
            done()
        expected_out = from_f32(oracle.expected_combine(x_seen, idx, w, bf16_cfg), "bfloat16")
        assert np.array_equal(storage_of(output), expected_out), f"step {step}: combine differs"
        # The batched reference's finalize on the same expert outputs: in float32, rounded once,
        # exactly; in bf16 (a rounding per product and per partial sum), within its error bound.
        ref32, ref16, magnitude = ref["combine"][rank]
        assert np.array_equal(storage_of(output), from_f32(ref32, "bfloat16")), f"step {step}: combine differs from the batched reference's"
        gap = np.abs(to_f32(storage_of(output), "bfloat16") - to_f32(ref16, "bfloat16"))
        bound = np.float32((top_k + 2) * 2.0**-8) * magnitude
        assert (gap <= bound).all(), f"step {step}: combine is {gap.max()} from the batched reference's in bf16"
    mask = torch.ones(RANKS, dtype=torch.int32)
    buffer.low_latency_query_mask_buffer(mask)
    assert mask.tolist() == [0] * RANKS, mask
    buffer.get_local_buffer_tensor(dtype=torch.int8, use_rdma_buffer=True).zero_()
    buffer.low_latency_clean_mask_buffer()
    dist.barrier(group)


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
    from multiprocessing.connection import wait

    pending = set(range(len(pipes)))
    deadline = time.monotonic() + limit
    while pending:
        ready = wait([pipes[r][0] for r in pending], timeout=max(0.0, deadline - time.monotonic()))
        assert ready, f"ranks {sorted(pending)} did not finish"
        for r in [r for r in pending if pipes[r][0] in ready]:
            reply = pipes[r][0].recv()
            assert reply == "ok", reply
            pending.discard(r)


def test_vllm_deepep_ll_prepare_finalize_over_xfer(monkeypatch):
    """Three shapes (4 experts top-2, 8 experts top-8, and 8 experts top-8 with fp8 dispatch;
    one Buffer per shape as vLLM's handle cache keys them), three steps each, sync and async
    forms alternating."""
    if not efa_plugin():
        pytest.skip("the efa plugin (libfabric shm) is not in the package")
    # The opt-in, as a user makes it: xfer's deep_ep first on the path of the processes.
    monkeypatch.setenv("PYTHONPATH", shim_path() + os.pathsep + os.environ.get("PYTHONPATH", ""))
    import importlib.util

    assert importlib.util.find_spec("deep_ep") is None or "deep_ep_shim" not in str(importlib.util.find_spec("deep_ep").origin), (
        "without the opt-in, xfer's deep_ep is not found"
    )
    ctx = mp.get_context("spawn")
    port = free_port()
    pipes = [ctx.Pipe() for _ in range(RANKS)]
    procs = [ctx.Process(target=rank_main, args=(r, port, pipes[r][1], [(4, 2, False), (8, 8, False), (8, 8, True)], 6, 3)) for r in range(RANKS)]
    for p in procs:
        p.start()
    try:
        wait_all(pipes)
    finally:
        for p in procs:
            p.join(30)
            if p.is_alive():
                p.kill()
