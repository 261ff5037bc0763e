"""The weight-sync executor's benchmark: seconds per weight version from trainer ranks to
inference ranks, each rank its own process on this machine, for ``xfer.weights`` over
libfabric's shm or tcp provider and for verl's own ``nixl`` checkpoint engine (NIXL 1.5.1 on
UCX, ``device="cpu"``) on the same data, next to the same run's reference rates.

The update is TinyLlama-1.1B-shaped by default (its 201 tensor shapes, an untied head, bf16:
2.20 GB; ``--model qwen2.5-0.5b``: 290 tensors, 0.99 GB). The bytes live once in a file in
/dev/shm that every trainer process maps (each holds every tensor, verl's contract: xfer's plan
splits the sending evenly over them; verl's nixl engine sends from trainer rank 0 alone, its
other ranks consume their weights and return). Every inference rank receives every tensor
whole: xfer writes it into the receiver's registered parameters; the nixl engine yields it
from its bucket and the receiver copies it into its own parameters (what ``load_weights``
does). The last version is checked byte for byte on every receiver.

A version's time: from the moment every rank was told to go to the last rank's answer (for
nixl: ``send_weights``/``receive_weights`` only; the per-step ``prepare`` and
``init_process_group`` verl's manager also calls are not in it). The fractions: bytes each
receiver needs / that time / a reference rate measured in the same run:

- ``memcpy``: one core copying 256 MiB (numpy), best of three — the ceiling of anything that
  moves bytes with this machine's CPUs, as shm and tcp do;
- ``write``: one 256 MiB xfer write from trainer rank 0 to receiver 0 over the provider,
  best of three, with every process of the run alive (xfer runs only);
- the same bytes without the executor (xfer runs only): every trainer rank writes its share of
  the data (what the plan gives it) to every receiver as one write each, all at once, best of
  three — what this machine's cores move for this traffic; the fraction is that time over the
  version's. On a machine whose links, not its cores, limit (NICs), the first two are the
  link's figure; here, where shm and tcp move bytes with the same two cores every rank and
  the other sessions share, this one is.

    target/vllm-venv/bin/python python/benches/weight_sync_bench.py [--engine xfer|nixl|verl] \\
        [--provider shm|tcp] [--trainers 2] [--receivers 2] [--versions 4] [--double-buffer]

``--engine verl`` is the like-for-like comparison: verl's two checkpoint engines, ``xfer``
(``xfer.verl.XferCheckpointEngine``, loaded as ``custom_backend_module=xfer.verl`` does) and
``nixl``, one after the other in one run, each through verl's registry and the call sequence of
verl's ``CheckpointEngineManager`` (per step ``prepare``, ``build_topology``,
``init_process_group``; ``send_weights`` with the trainer rank's generator over the same
mapped tensors, ``receive_weights`` with each yielded tensor copied into the receiver's
parameters; ``finalize``), the same process count, the same bucket size, memcpy measured right
after each engine's versions.

``--provider``: libfabric's ``shm`` or ``tcp;ofi_rxm`` for xfer; for nixl, UCX's own choice of
transports (``shm``) or ``UCX_TLS=tcp,self`` (``tcp``), UCX kept on the loopback device.
"""

from __future__ import annotations

import argparse
import asyncio
import multiprocessing as mp
import os
import tempfile
import time

import numpy as np

REFERENCE_BYTES = 256 << 20


def tinyllama_11b() -> list[tuple[str, tuple[int, ...]]]:
    hidden, inter, layers, heads, kv, head_dim, vocab = 2048, 5632, 22, 32, 4, 64, 32000
    out = [("model.embed_tokens.weight", (vocab, hidden))]
    for i in range(layers):
        p = f"model.layers.{i}."
        out += [
            (p + "self_attn.q_proj.weight", (heads * head_dim, hidden)),
            (p + "self_attn.k_proj.weight", (kv * head_dim, hidden)),
            (p + "self_attn.v_proj.weight", (kv * head_dim, hidden)),
            (p + "self_attn.o_proj.weight", (hidden, heads * head_dim)),
            (p + "mlp.gate_proj.weight", (inter, hidden)),
            (p + "mlp.up_proj.weight", (inter, hidden)),
            (p + "mlp.down_proj.weight", (hidden, inter)),
            (p + "input_layernorm.weight", (hidden,)),
            (p + "post_attention_layernorm.weight", (hidden,)),
        ]
    return out + [("model.norm.weight", (hidden,)), ("lm_head.weight", (vocab, hidden))]


def qwen25_05b() -> list[tuple[str, tuple[int, ...]]]:
    hidden, inter, layers, heads, kv, head_dim, vocab = 896, 4864, 24, 14, 2, 64, 151936
    out = [("model.embed_tokens.weight", (vocab, hidden))]
    for i in range(layers):
        p = f"model.layers.{i}."
        out += [
            (p + "self_attn.q_proj.weight", (heads * head_dim, hidden)),
            (p + "self_attn.q_proj.bias", (heads * head_dim,)),
            (p + "self_attn.k_proj.weight", (kv * head_dim, hidden)),
            (p + "self_attn.k_proj.bias", (kv * head_dim,)),
            (p + "self_attn.v_proj.weight", (kv * head_dim, hidden)),
            (p + "self_attn.v_proj.bias", (kv * head_dim,)),
            (p + "self_attn.o_proj.weight", (hidden, heads * head_dim)),
            (p + "mlp.gate_proj.weight", (inter, hidden)),
            (p + "mlp.up_proj.weight", (inter, hidden)),
            (p + "mlp.down_proj.weight", (hidden, inter)),
            (p + "input_layernorm.weight", (hidden,)),
            (p + "post_attention_layernorm.weight", (hidden,)),
        ]
    return out + [("model.norm.weight", (hidden,))]


MODELS = {"tinyllama-1.1b": tinyllama_11b, "qwen2.5-0.5b": qwen25_05b}


def total_bytes(shapes: list[tuple[str, tuple[int, ...]]]) -> int:
    return sum(int(np.prod(s)) * 2 for _, s in shapes)


def offsets(shapes: list[tuple[str, tuple[int, ...]]]) -> tuple[list[int], int]:
    """Each tensor's offset in the data file (64-byte aligned), and the file's size."""
    out, at = [], 0
    for _, shape in shapes:
        out.append(at)
        at += (int(np.prod(shape)) * 2 + 63) // 64 * 64
    return out, at


def xfer_config(provider: str) -> dict:
    return {
        "backend": "efa",
        "groups": [{"nics": ["auto"]}],
        "backends": {"efa": {"provider": provider}},
        "timeouts": {"transfer_ms": 120000, "connect_ms": 20000, "expect_ms": 120000},
        "worker": {"idle_poll_us": 0},
    }


def memcpy_rate() -> float:
    src = np.ones(REFERENCE_BYTES, dtype=np.uint8)
    dst = np.zeros_like(src)
    best = float("inf")
    for _ in range(3):
        t0 = time.perf_counter()
        np.copyto(dst, src)
        best = min(best, time.perf_counter() - t0)
    return REFERENCE_BYTES / best


def xfer_rank(role: str, rank: int, args: argparse.Namespace, url: str, path: str, conn) -> None:
    import xfer
    from xfer import weights as W

    shapes = MODELS[args.model]()
    tensors = [W.TensorSpec(n, s, "bfloat16") for n, s in shapes]
    layout = W.Layout.replicated(tensors, args.trainers, args.receivers)
    engine = xfer.TransferEngine(xfer_config(args.xfer_provider))
    rdv = xfer.Rendezvous(url)
    offs, _ = offsets(shapes)
    data = np.memmap(path, dtype=np.uint8, mode="c")
    if role == "s":
        member = W.WeightSender(
            engine, rdv, "bench", rank, args.trainers, args.receivers, timeout=300,
            zero_copy=not args.staged, budget_bytes=None if not args.staged else args.staged << 20,
        )
        first = rank * len(tensors)  # Layout.replicated numbers the shards rank-major
        shards = {first + i: data[o : o + t.nbytes] for i, (t, o) in enumerate(zip(tensors, offs))}
    else:
        member = W.WeightReceiver(
            engine, rdv, "bench", rank, args.trainers, args.receivers, timeout=300, double_buffer=args.double_buffer
        )
    conn.send(("up", None))
    while True:
        cmd, arg = conn.recv()
        if cmd == "version":
            conn.recv()  # the start signal, sent once every rank is waiting for it
            if role == "s":
                member.send(arg, layout, shards)
            else:
                member.receive(arg)
            conn.send(("done", time.monotonic()))
        elif cmd == "check":
            wrong = [t.name for t, o in zip(tensors, offs) if not np.array_equal(member.params[t.name], data[o : o + t.nbytes])]
            conn.send(wrong)
        elif cmd == "desc":
            conn.send(bytes(member._region.desc))
        elif cmd == "pattern":
            # The version's bytes without the executor: this rank's share of the data (the
            # same count of bytes the plan gives it) to every receiver, one write each.
            share = -(-total_bytes(shapes) // args.trainers)
            lo = rank * share
            n = max(0, min(share, total_bytes(shapes) - lo))
            whole = engine.reg_mr(data, access="local")
            dsts = [xfer.MrDesc(d) for d in arg]
            conn.recv()
            ts = [engine.submit_single_write(whole, d, n, src_offset=lo, dst_offset=lo) for d in dsts]
            for t in ts:
                t.wait(120)
            conn.send(("done", time.monotonic()))
            whole.dereg()
        elif cmd == "write":
            buf = np.ones(REFERENCE_BYTES, dtype=np.uint8)
            region = engine.reg_mr(buf, access="local")
            dst = xfer.MrDesc(arg)
            engine.submit_single_write(region, dst, REFERENCE_BYTES).wait(60)  # warm the path
            best = float("inf")
            for _ in range(3):
                t0 = time.monotonic()
                engine.submit_single_write(region, dst, REFERENCE_BYTES).wait(60)
                best = min(best, time.monotonic() - t0)
            conn.send(REFERENCE_BYTES / best)
        elif cmd == "exit":
            member.close()
            engine.close()
            conn.send("bye")
            return


def nixl_on_cpu(ucx_tls: str | None) -> None:
    """What verl's nixl engine needs of a process without a GPU: cupy importable (it imports
    it at load), its pinned buckets unpinned and ``torch.cuda.synchronize`` a no-op (CPU copies
    are synchronous), its ZeroMQ side channel on 127.0.0.1."""
    import ray.util
    import torch

    os.environ["UCX_NET_DEVICES"] = "lo"
    if ucx_tls:
        os.environ["UCX_TLS"] = ucx_tls
    if not torch.cuda.is_available():
        zeros = torch.zeros

        def unpinned_zeros(*a, pin_memory=False, **kw):
            return zeros(*a, **kw)

        torch.zeros = unpinned_zeros
        torch.cuda.synchronize = lambda *a, **kw: None
    ray.util.get_node_ip_address = lambda *a, **kw: "127.0.0.1"
    import verl.checkpoint_engine.nixl_checkpoint_engine  # noqa: F401 - registers "nixl"


def verl_rank(role: str, rank: int, args: argparse.Namespace, url: str, path: str, conn) -> None:
    """A rank of one of verl's checkpoint engines (``args.verl_engine``: ``nixl``, or ``xfer``
    through verl's registry as ``custom_backend_module=xfer.verl`` loads it), driven in the
    call sequence of verl's ``CheckpointEngineManager``."""
    if args.verl_engine == "nixl":
        nixl_on_cpu(args.ucx_tls)
    import torch
    from verl.checkpoint_engine import CheckpointEngineRegistry

    shapes = MODELS[args.model]()
    offs, _ = offsets(shapes)
    data = np.memmap(path, dtype=np.uint8, mode="c")
    if args.verl_engine == "nixl":
        engine = CheckpointEngineRegistry.new(
            "nixl", bucket_size=args.bucket_mib << 20, device="cpu", is_master=(role == "s" and rank == 0)
        )
    else:
        from verl.utils.import_utils import import_external_libs

        import_external_libs("xfer.verl")  # what rollout.checkpoint_engine.custom_backend_module does
        engine = CheckpointEngineRegistry.new(
            "xfer", bucket_size=args.bucket_mib << 20, is_master=(role == "s" and rank == 0),
            config=xfer_config(args.xfer_provider), timeout=300.0, listen="127.0.0.1:0",
        )
    params = {}
    if role == "s":
        weights = [(n, torch.from_numpy(data[o : o + int(np.prod(s)) * 2]).view(torch.bfloat16).view(s)) for (n, s), o in zip(shapes, offs)]
    else:
        params = {n: torch.empty(s, dtype=torch.bfloat16) for n, s in shapes}

    async def receive():
        async for name, t in engine.receive_weights():
            params[name].copy_(t)  # the engine's load_weights

    conn.send(("up", None))
    while True:
        cmd, arg = conn.recv()
        if cmd == "prepare":
            conn.send(engine.prepare())
        elif cmd == "init":
            engine.init_process_group(**arg)
            conn.send("ok")
        elif cmd == "version":
            conn.recv()
            if role == "s":
                asyncio.run(engine.send_weights(iter(weights)))
            else:
                asyncio.run(receive())
            conn.send(("done", time.monotonic()))
        elif cmd == "finalize":
            engine.finalize()
            conn.send("ok")
        elif cmd == "check":
            wrong = [n for (n, s), o in zip(shapes, offs)
                     if not np.array_equal(params[n].view(-1).view(torch.uint8).numpy(), data[o : o + int(np.prod(s)) * 2])]
            conn.send(wrong)
        elif cmd == "exit":
            conn.send("bye")
            os._exit(0)  # NIXL 1.5.1's bundled libnl faults in its destructor at exit (xfer: the same exit)


def run_engine(engine: str, args: argparse.Namespace, shapes, path: str) -> dict:
    """One engine's versions (its own processes: the same count for every engine); returns
    the figures of the versions after the first, with memcpy measured right after."""
    total = sum(int(np.prod(s)) * 2 for _, s in shapes)
    server = None
    url = ""
    verl = engine.startswith("verl:")
    args.verl_engine = engine.removeprefix("verl:")
    try:
        if engine == "xfer":
            import xfer
            from xfer import weights as W

            tensors = [W.TensorSpec(n, s, "bfloat16") for n, s in shapes]
            t0 = time.monotonic()
            plan = W.plan(W.Layout.replicated(tensors, args.trainers, args.receivers))
            print(f"plan {time.monotonic() - t0:.3f} s, {len(plan)} writes, sent per trainer rank "
                  f"{[round(s / 1e9, 3) for s in plan.sent]} GB", flush=True)
            server = xfer.Server()
            url = server.url
        ctx = mp.get_context("spawn")
        target = verl_rank if verl else xfer_rank
        ranks = [("s", r) for r in range(args.trainers)] + [("r", r) for r in range(args.receivers)]
        pipes, procs = [], []
        for role, r in ranks:
            a, b = ctx.Pipe()
            proc = ctx.Process(target=target, args=(role, r, args, url, path, b))
            proc.start()
            pipes.append(a)
            procs.append(proc)
        for a in pipes:
            assert a.recv()[0] == "up"
        times = []
        for v in range(args.versions):
            if verl:  # verl's CheckpointEngineManager, per step
                from verl.checkpoint_engine import CheckpointEngineRegistry

                if args.verl_engine == "xfer":
                    from verl.utils.import_utils import import_external_libs

                    import_external_libs("xfer.verl")
                for a in pipes:
                    a.send(("prepare", None))
                metadata = [a.recv() for a in pipes]
                actor, rollout = CheckpointEngineRegistry.get(args.verl_engine).build_topology(
                    args.trainers, args.receivers, metadata)
                for i, a in enumerate(pipes):
                    kw, j = (actor, i) if i < args.trainers else (rollout, i - args.trainers)
                    a.send(("init", {k: x[j] for k, x in kw.items() if k != "method"}))
                assert all(a.recv() == "ok" for a in pipes)
            for a in pipes:
                a.send(("version", v))
            start = time.monotonic()
            for a in pipes:
                a.send(("go", None))
            ends = [a.recv()[1] for a in pipes]
            times.append(max(ends) - start)
            print(f"{engine} version {v}: {times[-1]:.3f} s, {total / times[-1] / 1e9:.2f} GB/s into each receiver", flush=True)
            if verl:
                for a in pipes:
                    a.send(("finalize", None))
                assert all(a.recv() == "ok" for a in pipes)
        for a in pipes[args.trainers :]:
            a.send(("check", None))
        wrong = [a.recv() for a in pipes[args.trainers :]]
        assert all(not w for w in wrong), f"{engine}: received tensors differ from the trainer's: {wrong}"
        later = times[1:] or times
        out = {"engine": engine, "first": times[0], "best": min(later), "median": float(np.median(later))}
        if engine == "xfer":
            descs = []
            for a in pipes[args.trainers :]:
                a.send(("desc", None))
                descs.append(a.recv())
            raw = []
            for _ in range(3):
                for a in pipes[: args.trainers]:
                    a.send(("pattern", descs))
                start = time.monotonic()
                for a in pipes[: args.trainers]:
                    a.send(("go", None))
                raw.append(max(a.recv()[1] for a in pipes[: args.trainers]) - start)
            out["no_executor"] = min(raw)
            pipes[args.trainers].send(("desc", None))
            pipes[0].send(("write", pipes[args.trainers].recv()))
            out["write"] = pipes[0].recv()
        for a in pipes:
            a.send(("exit", None))
            a.recv()
        for proc in procs:
            proc.join(60)
        out["memcpy"] = memcpy_rate()
        out["load"] = os.getloadavg()[0]
        return out
    finally:
        if server is not None:
            server.close()


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--engine", choices=["xfer", "nixl", "verl"], default="xfer",
                   help="xfer: the executor alone; nixl: verl's nixl engine; verl: verl's xfer and nixl engines, one after the other")
    p.add_argument("--provider", choices=["shm", "tcp"], default="shm")
    p.add_argument("--model", choices=sorted(MODELS), default="tinyllama-1.1b")
    p.add_argument("--trainers", type=int, default=2)
    p.add_argument("--receivers", type=int, default=2)
    p.add_argument("--versions", type=int, default=4)
    p.add_argument("--double-buffer", action="store_true", help="xfer receivers double-buffer")
    p.add_argument("--staged", type=int, default=0, metavar="MIB",
                   help="xfer senders copy into two staging buckets of half this budget (default: written in place)")
    p.add_argument("--bucket-mib", type=int, default=256, help="verl's bucket (each engine keeps two per rank)")
    args = p.parse_args()
    args.xfer_provider = {"shm": "shm", "tcp": "tcp;ofi_rxm"}[args.provider]
    args.ucx_tls = {"shm": None, "tcp": "tcp,self"}[args.provider]
    engines = {"xfer": ["xfer"], "nixl": ["verl:nixl"], "verl": ["verl:xfer", "verl:nixl"]}[args.engine]
    shapes = MODELS[args.model]()
    total = sum(int(np.prod(s)) * 2 for _, s in shapes)
    _, size = offsets(shapes)
    fd, path = tempfile.mkstemp(prefix="xfer-weights-", dir="/dev/shm")
    try:
        with os.fdopen(fd, "wb") as f:
            rng = np.random.default_rng(0)
            for at in range(0, size, 64 << 20):
                f.write(rng.integers(0, 256, min(64 << 20, size - at), dtype=np.uint8).tobytes())
        print(f"update: {args.model}, {len(shapes)} tensors, {total / 1e9:.3f} GB; {engines} over {args.provider}, "
              f"{args.trainers} -> {args.receivers}" + (", double-buffered" if args.double_buffer else ""), flush=True)
        results = [run_engine(e, args, shapes, path) for e in engines]
        for r in results:
            line = (f"{r['engine']}: first {r['first']:.3f} s; after it best {r['best']:.3f} s, median {r['median']:.3f} s; "
                    f"memcpy right after {r['memcpy'] / 1e9:.2f} GB/s: fraction {total / r['best'] / r['memcpy']:.3f} (best), "
                    f"{total / r['median'] / r['memcpy']:.3f} (median); load {r['load']:.1f}")
            if "no_executor" in r:
                line += (f"; the same bytes as one write per (trainer, receiver), no executor: {r['no_executor']:.3f} s: "
                         f"fraction {r['no_executor'] / r['best']:.2f}; one 256 MiB write: {r['write'] / 1e9:.2f} GB/s: "
                         f"fraction {total / r['best'] / r['write']:.2f}")
            print(line, flush=True)
        if len(results) == 2:
            a, b = results
            print(f"{b['engine']} / {a['engine']} seconds per version: {b['best'] / a['best']:.2f} (best), "
                  f"{b['median'] / a['median']:.2f} (median); normalised by each run's memcpy: "
                  f"{(b['median'] * b['memcpy']) / (a['median'] * a['memcpy']):.2f} (median)", flush=True)
    finally:
        os.unlink(path)


if __name__ == "__main__":
    main()
