"""``python -m xfer.bench_kv``: posting a KV-cache request, as the serving connectors do it and
block by block.

A decode worker pulls a request's blocks from every layer (pull), or a prefill worker pushes
them (push: writes). The connectors post one paged read or write per layer (pages from block
ids); a connector built on per-block descriptors posts one per block per layer. For requests of 1,000, 10,000 and 100,000 pages (a page is one plane of
one block of one layer; 4 layers; 1 KiB pages, so the copies stay small next to the posting),
both ways, on the same
engines in the same run: the time to post (the submit calls returning) and to the last byte
(every completion). The ratios are the figures to record (issue 28: posting must not grow with
the block count beyond the NIC work itself); absolute numbers move with the machine.
"""

import argparse
import json
import time

import numpy as np

import xfer

PAGE = 1024
LAYERS = 4


def measure(engine, pages_per_layer, per_block, push=False):
    """(post seconds, last-byte seconds) for one request of `pages_per_layer` pages in each of
    LAYERS layers, read by the decoder (pull) or written by the prefill (push)."""
    n = pages_per_layer * LAYERS
    # Pull: the decoder's `dst` reads the peer's `src`; push: the prefill's `src` is written
    # into the peer's `dst` (the same pages either way).
    src = engine.reg_mr(np.arange(n * PAGE, dtype=np.uint8), access="local" if push else "read")
    dst = engine.reg_mr(np.zeros(n * PAGE, dtype=np.uint8), access="write" if push else "local")
    rng = np.random.default_rng(pages_per_layer)
    transfers = []
    start = time.perf_counter()
    for layer in range(LAYERS):
        base = layer * pages_per_layer
        remote = rng.permutation(pages_per_layer) + base
        local = np.arange(pages_per_layer) + base
        if per_block and push:
            for lp, rp in zip(local.tolist(), remote.tolist()):
                transfers.append(engine.submit_single_write(
                    src, dst.desc, PAGE, src_offset=rp * PAGE, dst_offset=lp * PAGE))
        elif per_block:
            for lp, rp in zip(local.tolist(), remote.tolist()):
                transfers.append(engine.submit_single_read(
                    dst, src.desc, PAGE, local_offset=lp * PAGE, remote_offset=rp * PAGE))
        elif push:
            transfers.append(engine.submit_paged_writes(PAGE, src, remote, dst.desc, local))
        else:
            transfers.append(engine.submit_paged_reads(PAGE, dst, local, src.desc, remote))
    posted = time.perf_counter() - start
    for t in transfers:
        t.wait(600)
    last = time.perf_counter() - start
    engine.dereg_mr(src)
    engine.dereg_mr(dst)
    return posted, last


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--config", help="xfer config (default: the mock)")
    ap.add_argument("--sizes", default="1000,10000,100000", help="blocks x layers per request")
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args()
    config = args.config or {
        "backend": "mock",
        "groups": [{"nics": ["mock0"]}],
        "worker": {"max_outstanding": 1 << 20},
        "timeouts": {"transfer_ms": 600000},
    }
    rows = []
    with xfer.TransferEngine(config) as engine:
        for mode in ("pull", "push"):
            for total in (int(s) for s in args.sizes.split(",")):
                per_layer = max(1, total // LAYERS)
                paged = measure(engine, per_layer, per_block=False, push=mode == "push")
                block = measure(engine, per_layer, per_block=True, push=mode == "push")
                rows.append({"mode": mode, "pages": per_layer * LAYERS,
                             "paged_post_ms": paged[0] * 1e3, "paged_last_ms": paged[1] * 1e3,
                             "per_block_post_ms": block[0] * 1e3,
                             "per_block_last_ms": block[1] * 1e3})
    if args.json:
        print(json.dumps(rows))
        return
    print(f"{'mode':>5} {'pages':>8} {'paged post':>11} {'last byte':>10} {'per-block post':>15} {'last byte':>10} {'post ratio':>11}")
    for r in rows:
        print(f"{r['mode']:>5} {r['pages']:>8} {r['paged_post_ms']:>9.2f}ms {r['paged_last_ms']:>8.1f}ms "
              f"{r['per_block_post_ms']:>13.1f}ms {r['per_block_last_ms']:>8.1f}ms "
              f"{r['per_block_post_ms'] / max(r['paged_post_ms'], 1e-6):>10.0f}x")


if __name__ == "__main__":
    main()
