"""Issue 44's executor benchmark: seconds per weight version from trainer ranks to inference
ranks through ``xfer.weights``, each rank its own process, over libfabric's shm or tcp
provider on this machine, next to the same link's rate for one large write in the same run.

The update is Qwen2.5-0.5B-shaped (its 290 tensor shapes, tied embeddings, bf16 — 0.99 GB);
every trainer rank holds every tensor (verl's contract), so the plan splits the sending
evenly; every inference rank receives every tensor whole. A version's time is from the
moment every rank started it to the last rank's verdict; the fraction is bytes each receiver
needs / that time / the single-write rate.

    target/python-venv/bin/python python/benches/weight_sync_bench.py [--provider shm] \
        [--trainers 2] [--receivers 2] [--versions 3]

Only numpy and xfer are needed (no torch: bf16 is two bytes as far as the wire goes).
"""

from __future__ import annotations

import argparse
import multiprocessing as mp
import time

import numpy as np

import xfer
from xfer import weights as W

REFERENCE_BYTES = 256 << 20


def qwen25_05b() -> list[W.TensorSpec]:
    hidden, inter, layers, heads, kv, head_dim, vocab = 896, 4864, 24, 14, 2, 64, 151936
    out = [W.TensorSpec("model.embed_tokens.weight", (vocab, hidden), "bfloat16")]
    for i in range(layers):
        p = f"model.layers.{i}."
        out += [
            W.TensorSpec(p + "self_attn.q_proj.weight", (heads * head_dim, hidden), "bfloat16"),
            W.TensorSpec(p + "self_attn.q_proj.bias", (heads * head_dim,), "bfloat16"),
            W.TensorSpec(p + "self_attn.k_proj.weight", (kv * head_dim, hidden), "bfloat16"),
            W.TensorSpec(p + "self_attn.k_proj.bias", (kv * head_dim,), "bfloat16"),
            W.TensorSpec(p + "self_attn.v_proj.weight", (kv * head_dim, hidden), "bfloat16"),
            W.TensorSpec(p + "self_attn.v_proj.bias", (kv * head_dim,), "bfloat16"),
            W.TensorSpec(p + "self_attn.o_proj.weight", (hidden, heads * head_dim), "bfloat16"),
            W.TensorSpec(p + "mlp.gate_proj.weight", (inter, hidden), "bfloat16"),
            W.TensorSpec(p + "mlp.up_proj.weight", (inter, hidden), "bfloat16"),
            W.TensorSpec(p + "mlp.down_proj.weight", (hidden, inter), "bfloat16"),
            W.TensorSpec(p + "input_layernorm.weight", (hidden,), "bfloat16"),
            W.TensorSpec(p + "post_attention_layernorm.weight", (hidden,), "bfloat16"),
        ]
    return out + [W.TensorSpec("model.norm.weight", (hidden,), "bfloat16")]


def config(provider: str) -> dict:
    return {
        "backend": "efa",
        "groups": [{"nics": ["auto"]}],
        "backends": {"efa": {"provider": provider}},
        "timeouts": {"transfer_ms": 120000, "connect_ms": 20000, "expect_ms": 120000},
        "worker": {"idle_poll_us": 0},
    }


def rank_main(role: str, rank: int, args: argparse.Namespace, url: str, conn) -> None:
    tensors = qwen25_05b()
    layout = W.Layout.replicated(tensors, args.trainers, args.receivers)
    engine = xfer.TransferEngine(config(args.provider))
    rdv = xfer.Rendezvous(url)
    if role == "s":
        member = W.WeightSender(engine, rdv, "bench", rank, args.trainers, args.receivers, timeout=120, budget_bytes=args.budget_mib << 20)
        rng = np.random.default_rng(rank)
        # Two bytes per element: the bytes are what travels; the values are the same on every rank.
        data = {i: np.random.default_rng(hash(n) & 0xFFFF).integers(0, 255, layout.shard_nbytes(i), dtype=np.uint8)
                for i, (r, n, _) in enumerate(layout.shards) if r == rank}
        del rng
    else:
        member = W.WeightReceiver(engine, rdv, "bench", rank, args.trainers, args.receivers, timeout=120)
    conn.send(("up", bytes(engine.main_address)))
    while True:
        cmd, arg = conn.recv()
        if cmd == "version":
            conn.recv()  # the start signal, sent once every rank is waiting for it
            if role == "s":
                member.send(arg, layout, data)
            else:
                member.receive(arg)
            conn.send(("done", time.monotonic()))
        elif cmd == "reference" and role == "r" and rank == 0:
            conn.send(bytes(member._region.desc))
        elif cmd == "reference" and role == "s" and rank == 0:
            buf = np.ones(REFERENCE_BYTES, dtype=np.uint8)
            region = engine.reg_mr(buf, access="local")
            dst = xfer.MrDesc(arg)
            engine.submit_single_write(region, dst, REFERENCE_BYTES).wait(60)  # warm the path
            t0 = time.monotonic()
            engine.submit_single_write(region, dst, REFERENCE_BYTES).wait(60)
            conn.send(REFERENCE_BYTES / (time.monotonic() - t0))
        elif cmd == "exit":
            return


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--provider", default="shm")
    p.add_argument("--trainers", type=int, default=2)
    p.add_argument("--receivers", type=int, default=2)
    p.add_argument("--versions", type=int, default=3)
    p.add_argument("--budget-mib", type=int, default=768, help="staging per trainer rank, MiB (two buckets of half: the largest tensor must fit one)")
    args = p.parse_args()
    tensors = qwen25_05b()
    total = sum(t.nbytes for t in tensors)
    layout = W.Layout.replicated(tensors, args.trainers, args.receivers)
    t0 = time.monotonic()
    plan = W.plan(layout)
    print(f"update: {len(tensors)} tensors, {total / 1e9:.3f} GB; plan {time.monotonic() - t0:.3f} s, "
          f"{len(plan)} writes, sent per trainer rank {[round(s / 1e9, 3) for s in plan.sent]} GB")
    server = xfer.Server()
    ctx = mp.get_context("spawn")
    ranks = [("s", r) for r in range(args.trainers)] + [("r", r) for r in range(args.receivers)]
    pipes, procs = [], []
    for role, r in ranks:
        a, b = ctx.Pipe()
        proc = ctx.Process(target=rank_main, args=(role, r, args, server.url, b))
        proc.start()
        pipes.append(a)
        procs.append(proc)
    for a in pipes:
        assert a.recv()[0] == "up"
    times = []
    for v in range(args.versions):
        for a in pipes:
            a.send(("version", v))
        start = time.monotonic()
        for a in pipes:
            a.send(("go", None))
        ends = [a.recv()[1] for a in pipes]
        times.append(max(ends) - start)
        print(f"version {v}: {times[-1]:.3f} s, {total / times[-1] / 1e9:.2f} GB/s into each receiver")
    pipes[args.trainers].send(("reference", None))
    desc = pipes[args.trainers].recv()
    pipes[0].send(("reference", desc))
    rate = pipes[0].recv()
    best = min(times)
    print(f"one {REFERENCE_BYTES >> 20} MiB write over the same provider: {rate / 1e9:.2f} GB/s; "
          f"best version {best:.3f} s = {total / best / rate:.2f} of it")
    for a in pipes:
        a.send(("exit", None))
    for proc in procs:
        proc.join(60)
    server.close()


if __name__ == "__main__":
    main()
