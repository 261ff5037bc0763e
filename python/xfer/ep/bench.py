"""Benchmark of ``xfer.ep`` (not a test): dispatch, combine and a whole step, p50 / p99, beside
``torch.distributed`` gloo in the same run — ``all_to_all_single`` (counts, then the rows, as
Megatron does) and all-gather + reduce (vLLM's CPU default) — plus the figures that do not
depend on the machine: writes per rank per step, bytes on the wire over the minimum, planning
time per token.

    python -m xfer.ep.bench --ranks 2 --tokens 128 --hidden 7168 --top-k 8 --experts-per-rank 32
    python -m xfer.ep.bench --ranks 8 --layout flat --private-rows 256 --overflow-rows 1024   # oversubscribed here
    python -m xfer.ep.bench --fp8 e4m3

Ranks are threads over the mock (one process: the mock's fabric is in-process) and processes
over libfabric shm and tcp (``tcp;ofi_rxm`` on 127.0.0.1) and gloo. Expert compute is left out (the outputs are the inputs): this
measures communication and the host's packing. Numbers are rank 0's."""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import os
import socket
import threading
import time

import numpy as np

from . import oracle
from .group import EpGroup
from .layout import EpConfig


#: Where a step's time goes at a rank (``Handle.stats``): the host's copies and the waits.
_HOST = ("pack", "dispatch_wait", "unpack", "repack", "combine_wait", "reduce")


def pct(xs, q):
    return float(np.percentile(np.asarray(xs) * 1e6, q)) if xs else float("nan")


def summary(name, d, c, s, extra=None):
    out = {"transport": name, "dispatch_p50_us": pct(d, 50), "dispatch_p99_us": pct(d, 99),
           "combine_p50_us": pct(c, 50), "combine_p99_us": pct(c, 99), "step_p50_us": pct(s, 50), "step_p99_us": pct(s, 99)}
    out.update(extra or {})
    return out


def xfer_rank(g: EpGroup, cfg: EpConfig, iters: int, warmup: int, barrier, layout: str = "deepep",
              weights_at_dispatch: bool = False):
    """Steps at one rank; returns timings and the hardware-independent figures. With
    ``weights_at_dispatch`` combine returns one partial sum per (token, rank)."""
    d, c, s = [], [], []
    writes, remote, minimum, plan_ns, pack_ns, tokens = [], [], [], [], [], 0
    remote_phase = {"dispatch": [], "combine": []}
    minimum_phase = {"dispatch": [], "combine": []}
    host = {}
    for i in range(warmup + iters):
        x, idx, w = oracle.inputs(7, i % 4, g.rank, cfg, drop=0.0)
        barrier()
        t0 = time.perf_counter()
        recv, cnt, h = g.dispatch(x, idx, layout=layout, weights=w if weights_at_dispatch else None)
        t1 = time.perf_counter()
        # Expert compute left out: the outputs are the inputs (dequantized-free bf16 for fp8:
        # the combine rows are the tokens' own dtype).
        g.combine(recv if cfg.fp8 is None else _bf16_like(recv, cfg, layout), h, None if weights_at_dispatch else w)
        t2 = time.perf_counter()
        if i < warmup:
            continue
        d.append(t1 - t0)
        c.append(t2 - t1)
        s.append(t2 - t0)
        writes.append(h.stats["writes"])
        remote.append(h.stats.get("remote_bytes", 0))
        # The least any scheme moves: each token once to each other rank it needs (dispatch:
        # what this protocol sends, plus headers and route records) and one partial sum back
        # from each, in the tokens' dtype (combine: this protocol returns one row per (token,
        # expert), as DeepEP's low-latency layout does, or with the weights at dispatch one
        # fp32 partial sum per (token, rank): twice the minimum in bf16).
        pairs = {(t, int(e) // cfg.experts_per_rank) for t in range(idx.shape[0]) for e in idx[t] if e >= 0}
        remote_pairs = sum(1 for _t, r in pairs if r != g.rank)
        minimum.append(remote_pairs * (cfg.row_bytes + cfg.combine_row_bytes))
        for phase, row in (("dispatch", cfg.row_bytes), ("combine", cfg.combine_row_bytes)):
            remote_phase[phase].append(h.stats.get(f"remote_{phase}_bytes", 0))
            minimum_phase[phase].append(remote_pairs * row)
        plan_ns.append(h.stats["plan_ns"])
        pack_ns.append(h.stats["pack_ns"])
        for key in _HOST:
            host.setdefault(key, []).append(h.stats.get(key + "_ns", 0))
        tokens += x.shape[0]
    figures = {
        "writes_per_rank_per_step": float(np.mean(writes)),
        "writes_per_peer_per_phase_max": 2,
        "bytes_over_minimum": float(np.sum(remote) / max(1, np.sum(minimum))),
        "dispatch_bytes_over_minimum": float(np.sum(remote_phase["dispatch"]) / max(1, np.sum(minimum_phase["dispatch"]))),
        "combine_bytes_over_minimum": float(np.sum(remote_phase["combine"]) / max(1, np.sum(minimum_phase["combine"]))),
        "wire_bytes_per_step": float(np.mean(remote)),
        "plan_ns_per_token": float(np.sum(plan_ns) / max(1, tokens)),
        "pack_ns_per_token": float(np.sum(pack_ns) / max(1, tokens)),
        "host_p50_us": {k: float(np.percentile(v, 50)) / 1e3 for k, v in host.items()},
    }
    return d, c, s, figures


def _bf16_like(recv, cfg: EpConfig, layout: str) -> np.ndarray:
    """Expert outputs in combine's dtype for fp8 rows (their values as they are: the bench
    moves bytes, it does not compute)."""
    values = recv[0]
    return np.zeros(values.shape, dtype=cfg.storage)


def run_mock(cfg: EpConfig, iters: int, warmup: int, layout: str = "deepep", weights_at_dispatch: bool = False):
    import xfer

    conf = {"backend": "mock", "groups": [{"nics": ["mock0"]}], "backends": {"mock": {"inline": True}},
            "timeouts": {"expect_ms": 120000, "transfer_ms": 120000}}
    engines = [xfer.TransferEngine(conf) for _ in range(cfg.ranks)]
    groups = [EpGroup(e, r, cfg) for r, e in enumerate(engines)]
    infos = [g.local_info() for g in groups]
    for g in groups:
        g.connect(infos)
    b = threading.Barrier(cfg.ranks)
    results = {}

    def body(r):
        results[r] = xfer_rank(groups[r], cfg, iters, warmup, b.wait, layout, weights_at_dispatch)

    ts = [threading.Thread(target=body, args=(r,)) for r in range(cfg.ranks)]
    for t in ts:
        t.start()
    for t in ts:
        t.join()
    for e in engines:
        e.close()
    d, c, s, fig = results[0]
    return summary("xfer mock (threads)", d, c, s, fig)


def _free_port():
    with socket.socket() as so:
        so.bind(("127.0.0.1", 0))
        return so.getsockname()[1]


# Transports of xfer over processes: libfabric providers by name.
_PROVIDERS = {"shm": "shm", "tcp": "tcp;ofi_rxm"}


def _proc(kind, rank, cfg_kw, iters, warmup, port, conn, layout="deepep", weights_at_dispatch=False):
    try:
        import torch.distributed as dist

        cfg = EpConfig(**cfg_kw)
        dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=cfg.ranks)
        if kind in _PROVIDERS:
            import xfer

            conf = {"backend": "efa", "groups": [{"nics": ["auto"]}], "backends": {"efa": {"provider": _PROVIDERS[kind]}},
                    "timeouts": {"expect_ms": 120000, "transfer_ms": 120000, "connect_ms": 20000},
                    "worker": {"idle_poll_us": 0}}
            with xfer.TransferEngine(conf) as e:
                g = EpGroup(e, rank, cfg)
                infos = [None] * cfg.ranks
                dist.all_gather_object(infos, g.local_info())
                g.connect(infos)
                d, c, s, fig = xfer_rank(g, cfg, iters, warmup, dist.barrier, layout, weights_at_dispatch)
                dist.barrier()
                g.close()
            res = summary(f"xfer libfabric {_PROVIDERS[kind]} (processes)", d, c, s, fig)
        else:
            res = gloo_rank(kind, rank, cfg, iters, warmup)
        conn.send(res if rank == 0 else "ok")
        dist.destroy_process_group()
    except BaseException as exc:  # noqa: BLE001
        import traceback

        conn.send(f"rank {rank}: {exc!r}\n{traceback.format_exc()}")


def gloo_rank(kind, rank, cfg, iters, warmup):
    import torch
    import torch.distributed as dist

    from .tensors import tensor_of

    R, E = cfg.ranks, cfg.experts_per_rank
    d, c, s = [], [], []
    for i in range(warmup + iters):
        x_np, idx_np, w_np = oracle.inputs(7, i % 4, rank, cfg, drop=0.0)
        x = tensor_of(x_np, "bfloat16")
        idx = torch.from_numpy(idx_np)
        w = torch.from_numpy(w_np)
        dist.barrier()
        t0 = time.perf_counter()
        if kind == "gloo_a2a":
            # One row per (token, expert), sorted by destination rank: counts first, then rows.
            flat = idx.reshape(-1)
            keep = (flat >= 0).nonzero().squeeze(1)
            dest = flat[keep] // E
            order = torch.argsort(dest, stable=True)
            rows = x[keep[order] // cfg.top_k]
            send_counts = torch.bincount(dest, minlength=R)
            recv_counts = torch.empty_like(send_counts)
            dist.all_to_all_single(recv_counts, send_counts)
            recv = torch.empty((int(recv_counts.sum()), cfg.hidden), dtype=torch.bfloat16)
            dist.all_to_all_single(recv.view(torch.uint8), rows.contiguous().view(torch.uint8),
                                   recv_counts.tolist(), send_counts.tolist())
            t1 = time.perf_counter()
            back = torch.empty_like(rows)
            dist.all_to_all_single(back.view(torch.uint8), recv.view(torch.uint8),
                                   send_counts.tolist(), recv_counts.tolist())
            y = torch.zeros((x.shape[0], cfg.hidden), dtype=torch.float32)
            weights = w.reshape(-1)[keep[order]]
            y.index_add_(0, keep[order] // cfg.top_k, back.float() * weights[:, None])
        else:
            # vLLM's CPU default: every rank gathers every token, runs its experts on them,
            # and the partial sums are reduced (all_reduce, then its own slice: gloo has no
            # reduce_scatter of bf16).
            xs = [torch.empty_like(x) for _ in range(R)]
            dist.all_gather([t.view(torch.uint8) for t in xs], x.view(torch.uint8))
            ids = [torch.empty_like(idx) for _ in range(R)]
            dist.all_gather(ids, idx)
            t1 = time.perf_counter()
            full = torch.cat(xs).float()
            mine = (torch.cat(ids) // E == rank)
            ws = [torch.empty_like(w) for _ in range(R)]
            dist.all_gather(ws, w)
            part = full * (torch.cat(ws) * mine).sum(1, keepdim=True)
            dist.all_reduce(part)
            y = part[rank * x.shape[0]:(rank + 1) * x.shape[0]]
        t2 = time.perf_counter()
        if i >= warmup:
            d.append(t1 - t0)
            c.append(t2 - t1)
            s.append(t2 - t0)
    name = {"gloo_a2a": "gloo all_to_all_single (counts, then rows)", "gloo_ag": "gloo all-gather + all-reduce"}[kind]
    return summary(name, d, c, s)


def run_processes(kind, cfg, iters, warmup, layout="deepep", weights_at_dispatch=False):
    ctx = mp.get_context("spawn")
    port = _free_port()
    pipes = [ctx.Pipe() for _ in range(cfg.ranks)]
    kw = {k: getattr(cfg, k) for k in ("ranks", "experts_per_rank", "top_k", "max_tokens", "hidden", "dtype", "timeout",
                                       "private_rows", "overflow_rows", "fp8")}
    procs = [ctx.Process(target=_proc, args=(kind, r, kw, iters, warmup, port, pipes[r][1], layout, weights_at_dispatch))
             for r in range(cfg.ranks)]
    for p in procs:
        p.start()
    replies = [pipes[r][0].recv() for r in range(cfg.ranks)]
    for p in procs:
        p.join()
    for r in replies:
        if isinstance(r, str) and r != "ok":
            raise RuntimeError(r)
    return replies[0]


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--ranks", type=int, default=2)
    ap.add_argument("--tokens", type=int, default=128)
    ap.add_argument("--hidden", type=int, default=7168)
    ap.add_argument("--top-k", type=int, default=8)
    ap.add_argument("--experts-per-rank", type=int, default=32)
    ap.add_argument("--iters", type=int, default=30)
    ap.add_argument("--warmup", type=int, default=5)
    ap.add_argument("--transports", default="mock,shm,tcp,gloo_a2a,gloo_ag")
    ap.add_argument("--layout", choices=("deepep", "flat"), default="deepep",
                    help="flat: rows only (DeepEP's layout at EP 8 is 470 MB per buffer set and rank)")
    ap.add_argument("--private-rows", type=int, default=None)
    ap.add_argument("--overflow-rows", type=int, default=None)
    ap.add_argument("--fp8", choices=("e4m3", "e4m3_pow2"), default=None, help="fp8 dispatch (bf16 back)")
    ap.add_argument("--weights-at-dispatch", action="store_true",
                    help="give the weights at dispatch: combine returns one fp32 partial sum per (token, rank)")
    ap.add_argument("--json", action="store_true")
    a = ap.parse_args(argv)
    cfg = EpConfig(ranks=a.ranks, experts_per_rank=a.experts_per_rank, top_k=a.top_k, max_tokens=a.tokens,
                   hidden=a.hidden, timeout=30.0, private_rows=a.private_rows, overflow_rows=a.overflow_rows, fp8=a.fp8)
    rows = []
    for t in a.transports.split(","):
        if t == "mock":
            rows.append(run_mock(cfg, a.iters, a.warmup, a.layout, a.weights_at_dispatch))
        else:
            rows.append(run_processes(t, cfg, a.iters, a.warmup, a.layout, a.weights_at_dispatch))
    if a.json:
        print(json.dumps(rows, indent=1))
        return
    cores = os.cpu_count() or 1
    crowded = f" (oversubscribed: {a.ranks} ranks on {cores} cores)" if a.ranks > cores else ""
    print(f"EP {a.ranks}{crowded}, {a.tokens} tokens, hidden {a.hidden}, top-{a.top_k}, "
          f"{'fp8 ' + a.fp8 + ' out, bf16 back' if a.fp8 else 'bf16'}, {a.experts_per_rank} experts/rank, "
          f"layout {a.layout}, {a.iters} iterations (µs, rank 0)"
          + (", weights at dispatch (partial sums back)" if a.weights_at_dispatch else ""))
    print(f"{'transport':46} {'dispatch p50/p99':>18} {'combine p50/p99':>18} {'step p50/p99':>18}")
    for r in rows:
        print(f"{r['transport']:46} {r['dispatch_p50_us']:8.0f}/{r['dispatch_p99_us']:<8.0f} "
              f"{r['combine_p50_us']:8.0f}/{r['combine_p99_us']:<8.0f} {r['step_p50_us']:8.0f}/{r['step_p99_us']:<8.0f}")
    for r in rows:
        if "writes_per_rank_per_step" in r:
            print(f"{r['transport']}: {r['writes_per_rank_per_step']:.1f} writes per rank per step "
                  f"(<= 2 per peer per phase), {r['wire_bytes_per_step'] / 1e6:.1f} MB on the wire per step, "
                  f"{r['bytes_over_minimum']:.2f}x the minimum (one copy per token and rank; dispatch "
                  f"{r['dispatch_bytes_over_minimum']:.2f}x, combine {r['combine_bytes_over_minimum']:.2f}x), "
                  f"planning {r['plan_ns_per_token']:.0f} ns per token, packing {r['pack_ns_per_token']:.0f} ns per token")
            print("  p50 µs: " + ", ".join(f"{k} {v:.0f}" for k, v in r["host_p50_us"].items()))


if __name__ == "__main__":
    main()
