"""KV-cache transfer from a prefill process to a decode process (disaggregated inference).

The decode process owns a paged KV cache and publishes its descriptor; the prefill process
computes layers one by one and, as each finishes, writes that layer's pages into slots the
decode side chose (scattered anywhere in its cache), one immediate per layer. The decode side
waits per layer with ``expect_imm_count`` — layers may land in any order — and checks every
byte. The two processes exchange the address and descriptor through a pipe (any channel
works: a socket, a rendezvous service).

    python python/examples/kv_cache.py [--config FILE] [--layers 8] [--pages 32]
"""

import argparse
import multiprocessing as mp

import numpy as np

import xfer

PAGE = 4096


def layer_data(layer, pages):
    return ((np.arange(pages * PAGE, dtype=np.uint64) * 31 + layer * 7) % 251).astype(np.uint8)


def decode(config, layers, pages, conn):
    with xfer.TransferEngine(config) as engine:
        slots_total = layers * pages * 2  # a cache larger than this request
        cache = np.zeros(slots_total * PAGE, dtype=np.uint8)
        region = engine.reg_mr(cache)
        rng = np.random.default_rng(42)
        slots = rng.permutation(slots_total)[: layers * pages].reshape(layers, pages).astype(np.uint32)
        # Expectations registered before anything is sent: one immediate per layer.
        waits = [engine.expect_imm_count(100 + l, engine.expected_arrivals(page_len=PAGE, pages=pages))
                 for l in range(layers)]
        conn.send((engine.main_address, bytes(region.desc), slots.tolist()))
        for l, w in enumerate(waits):
            w.wait(60)
            got = cache.reshape(-1, PAGE)[slots[l]].reshape(-1)
            assert np.array_equal(got, layer_data(l, pages)), f"layer {l} differs"
        conn.send("ok")


def prefill(config, layers, pages, conn):
    addr, desc, slots = conn.recv()
    desc = xfer.MrDesc(desc)
    with xfer.TransferEngine(config) as engine:
        pending = []
        for l in range(layers):
            kv = layer_data(l, pages)  # "compute" the layer
            src = engine.reg_mr(kv, access="local")
            pending.append((src, engine.submit_paged_writes(
                PAGE, src, np.arange(pages, dtype=np.uint32), desc, np.array(slots[l], dtype=np.uint32),
                imm=100 + l)))
        for src, t in pending:
            t.wait(60)
            src.dereg()
        total = sum(t.nbytes for _, t in pending)
        slowest = max(t.duration for _, t in pending)
        print(f"prefill: {layers} layers, {total >> 10} KiB sent to {xfer.NetAddr(addr)}; "
              f"slowest layer {slowest * 1e3:.2f} ms")


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--config", help="config file (default: $XFER_CONFIG or the mock)")
    p.add_argument("--layers", type=int, default=8)
    p.add_argument("--pages", type=int, default=32)
    a = p.parse_args()
    if a.config is None:
        # The mock is in-process: both roles in one process, as two engines.
        here, there = mp.Pipe()
        import threading

        d = threading.Thread(target=decode, args=(None, a.layers, a.pages, there))
        d.start()
        prefill(None, a.layers, a.pages, here)
        d.join()
        assert here.recv() == "ok"
    else:
        ctx = mp.get_context("spawn")
        here, there = ctx.Pipe()
        d = ctx.Process(target=decode, args=(a.config, a.layers, a.pages, there))
        d.start()
        prefill(a.config, a.layers, a.pages, here)
        assert here.recv() == "ok"
        d.join(60)
        assert d.exitcode == 0
    print("decode: every layer verified")


if __name__ == "__main__":
    main()
