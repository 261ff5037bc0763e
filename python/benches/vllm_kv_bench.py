"""Issue 41's benchmark: the time from the decode's ``start_load_kv`` to vLLM reporting the
request's KV loaded, xfer's connector against vLLM's own NixlConnector, on the caches vLLM
allocates, in the same run.

Both instances run in this process, each as its engine core drives it (vLLM's Scheduler,
each rank's worker connector through the model runner's KV connector hooks, vLLM's
KVOutputAggregator: the harness of ``python/tests/serving_vllm/test_vllm_scheduler.py``).
The clock starts at the decode step that calls ``start_load_kv`` and stops at the step whose
``update_from_output`` reports the request finished receiving (its first token sampled).

    VLLM_TARGET_DEVICE=cpu target/vllm-venv/bin/python python/benches/vllm_kv_bench.py \
        --tokens 1024 8192 --rounds 3

Transports: ``xfer-mock`` (xfer's in-process mock NIC: the connector's own cost),
``xfer-tcp`` and ``xfer-shm`` (xfer's efa backend over libfabric's tcp;ofi_rxm on 127.0.0.1
and its shm provider), ``nixl-tcp`` (NIXL 1.5.1 on UCX with ``UCX_TLS=tcp,self``) and
``nixl`` (UCX's own choice: shared memory between two agents of one process). NIXL runs TP
1×1 only: its worker takes its TP rank from vLLM's process group, and this process holds one. Shapes: ``llama3-8b`` (32
layers, 8 KV heads of 128, fp16) and ``deepseek-v3`` (MLA: 61 layers, a 576-wide latent,
bf16). Blocks (``--blocks``): ``32/CPU_ATTN`` (vLLM's CPU attention takes multiples of 32),
``128/CPU_ATTN`` (blocks of 128, one kernel block each) and ``128/FLASHINFER`` (vLLM's model
runner allocates FlashInfer's caches in kernel blocks of 64: each manager block is two rows of
the views the connector gets). For MLA they are CPU_MLA (which takes blocks of 16: vLLM sets
them) and FLASHMLA (kernel blocks of 64). NixlConnector runs only with the CPU backends: its
worker takes the kernel block size from the platform's attention backend, not from the caches.
"""

from __future__ import annotations

import argparse
import gc
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

os.environ.setdefault("VLLM_TARGET_DEVICE", "cpu")
HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent / "tests" / "serving_vllm"))

import test_vllm_scheduler as harness  # noqa: E402
import vllm_caches  # noqa: E402

import xfer  # noqa: E402

SHAPES = {
    "llama3-8b": dict(vllm_caches.LLAMA_TINY, hidden_size=4096, num_attention_heads=32,
                      num_key_value_heads=8, num_hidden_layers=32, intermediate_size=14336),
    "deepseek-v3": dict(vllm_caches.DEEPSEEK_V2_TINY, hidden_size=7168, num_attention_heads=128,
                        num_key_value_heads=128, num_hidden_layers=61, kv_lora_rank=512,
                        qk_rope_head_dim=64, qk_nope_head_dim=128, v_head_dim=128,
                        first_k_dense_replace=61),
}


def libfabric(provider: str) -> dict:
    return {"backend": "efa", "groups": [{"nics": ["auto"]}],
            "backends": {"efa": {"provider": provider}},
            "timeouts": {"transfer_ms": 60000, "connect_ms": 20000}}


XFER = {"xfer-mock": None, "xfer-tcp": libfabric("tcp;ofi_rxm"), "xfer-shm": libfabric("shm")}
UCX_TLS = {"nixl-tcp": "tcp,self", "nixl": None, "nixl-lf-tcp": None}
"""NIXL on UCX's own choice of transports (in one process: shared memory), or on tcp only;
``nixl-lf-tcp``: NIXL's LIBFABRIC plugin (in the wheel) on libfabric's tcp provider."""


def load_time(transport: str, shape: str, tokens: int, decode_tp: int, prefill_tp: int,
              server: xfer.Server, tag: str, block: int = 32, backend: str = "CPU_ATTN") -> float:
    """Seconds from the decode's start_load_kv to the request's KV reported loaded."""
    directory = Path(tempfile.mkdtemp())
    max_len = tokens + 64
    vllm_caches.write_model(directory, SHAPES[shape], max_position_embeddings=max_len)
    model = vllm_caches.load_model_config(directory, max_model_len=max_len)
    # vLLM's planner wants room for a whole max_model_len request beside its own reserve;
    # for MLA its estimate comes out twice the latent's size.
    harness.BLOCKS = (2 if model.use_mla else 1) * (-(-max_len // block)) + 4
    harness.WAIT = 600.0
    connector = "xfer" if transport in XFER else "nixl"
    extra = ({"xfer_config": XFER[transport], "lookup_timeout_s": 20.0}
             if XFER.get(transport) else {})
    if transport == "nixl-lf-tcp":
        extra = {"backends": ["LIBFABRIC"]}
        os.environ["FI_PROVIDER"] = "tcp"
    if connector == "nixl":
        harness.one_process_group()
        # Read by UCX when each NIXL agent makes its context.
        os.environ.pop("UCX_TLS", None)
        if UCX_TLS[transport]:
            os.environ["UCX_TLS"] = UCX_TLS[transport]
    args = dict(connector=connector, extra=extra, max_model_len=max_len, block=block,
                backend=backend)
    p = harness.Engine(f"bench-p{tag}", server, model, tp=prefill_tp, **args)
    d = harness.Engine(f"bench-d{tag}", server, model, tp=decode_tp, **args)
    try:
        p.add("r", tokens, 1, {"do_remote_decode": True})
        p.run_until("the prefill", lambda: p.finished("r"))
        [done] = [o for o in p.outputs["r"] if o.finish_reason is not None]
        d.add("r-d", tokens, 2, done.kv_transfer_params)
        start = time.perf_counter()
        d.run_until("the KV loaded", lambda: bool(d.tokens("r-d")))
        took = time.perf_counter() - start
        assert d.tokens("r-d")[0] == harness.TOKEN, "decoded from the loaded KV, not recomputed"
        return took
    finally:
        p.close(), d.close()
        # The instances' caches (GiBs) sit in reference cycles (vLLM's and the connectors'):
        # collected now, not when the collector next counts enough small objects (three
        # 8,192-token Llama rows grew the process past the machine's memory).
        gc.collect()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--tokens", type=int, nargs="+", default=[1024, 8192])
    parser.add_argument("--shapes", nargs="+", default=list(SHAPES))
    parser.add_argument("--transports", nargs="+",
                        default=["xfer-mock", "xfer-tcp", "nixl-tcp", "xfer-shm", "nixl"])
    parser.add_argument("--tp", nargs="+", default=["1x1", "2x1"],
                        help="decode x prefill tensor-parallel sizes")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--blocks", nargs="+", default=["32/CPU_ATTN"],
                        help="block size / attention backend (its class sets the kernel block)")
    args = parser.parse_args()
    server = xfer.Server()
    print("| shape | tokens | TP d×p | block | " + " | ".join(f"{t} (ms)" for t in args.transports)
          + " | tcp: nixl ÷ xfer | sm: nixl ÷ xfer |")
    print("|---|---:|---|---|" + "---:|" * (len(args.transports) + 2))
    n = 0
    for shape, tokens, tp, blocks in ((s, t, p, b) for s in args.shapes for t in args.tokens
                                       for p in args.tp for b in args.blocks):
        block_text, backend = blocks.split("/")
        block = int(block_text)
        if shape == "deepseek-v3":
            # MLA's backends: the CPU's (blocks of 16) and FlashMLA (64-token kernel blocks).
            backend = {"CPU_ATTN": "CPU_MLA", "FLASHINFER": "FLASHMLA"}.get(backend, backend)
        decode_tp, prefill_tp = (int(x) for x in tp.split("x"))
        if shape == "deepseek-v3" and decode_tp != prefill_tp and prefill_tp > 1:
            continue
        times: dict[str, list[float]] = {t: [] for t in args.transports}
        for _ in range(args.rounds):  # rounds alternate the transports
            for transport in args.transports:
                if transport in UCX_TLS and (tp != "1x1" or not backend.startswith("CPU_")):
                    # One process holds one TP rank of vLLM's groups; NIXL's kernel block is
                    # the platform's.
                    continue
                n += 1
                times[transport].append(load_time(transport, shape, tokens, decode_tp,
                                                  prefill_tp, server, f"{n}", block, backend))
        med = {t: statistics.median(v) * 1e3 for t, v in times.items() if v}
        cells = [f"{med[t]:.1f} ({min(times[t]) * 1e3:.1f}–{max(times[t]) * 1e3:.1f})"
                 if times[t] else "–" for t in args.transports]
        ratios = [f"{med[n] / med[x]:.2f}×" if n in med and x in med else "–"
                  for n, x in (("nixl-tcp", "xfer-tcp"), ("nixl", "xfer-shm"))]
        print(f"| {shape} | {tokens} | {tp} | {blocks} | " + " | ".join(cells + ratios) + " |",
              flush=True)
    server.close()


if __name__ == "__main__":
    main()
