"""Write bandwidth of xfer against peer engines on the same soft-RoCE device, same process
layout, same bytes in flight, data verified (issue 29's "peers" goal).

Run by ``cargo xtask peer-bench`` inside the rxe guest, from a venv holding the xfer package
(with its verbs plugin) and the peers from PyPI. Each engine gets an initiator and a target
on ``rxe0`` in this one process; a trip is one call posting ``--batch`` writes of a size
(xfer: one paged write; DLSlime: one ``write`` with ``--batch`` assignments; Mooncake: one
``batch_transfer_sync_write``), waited for; trips repeat for ``--seconds``. After each
measurement the target buffer is compared with the source. Rounds rotate the engines' order
so that none always runs first or last; the figures to record are each round's ratios of
xfer over a peer (one boot of the TCG guest moves absolute rates by tens of percent).
"""

import argparse
import ctypes
import json
import mmap
import os
import statistics
import sys
import time

MIB = 1 << 20


def _buffers(nbytes):
    """A page-aligned source with random bytes and a zeroed target, and their addresses."""
    src, dst = mmap.mmap(-1, nbytes), mmap.mmap(-1, nbytes)
    src.write(os.urandom(nbytes))
    addr = lambda m: ctypes.addressof(ctypes.c_char.from_buffer(m))  # noqa: E731
    return src, dst, addr(src), addr(dst)


def _verify(name, src, dst, nbytes):
    if src[:nbytes] != dst[:nbytes]:
        first = next(i for i in range(nbytes) if src[i] != dst[i])
        raise SystemExit(f"peer-bench: {name}: the target differs from the source at byte {first}")


def _trips(post, seconds):
    """Runs `post` (one trip, waited for) until `seconds` have passed; trips and elapsed."""
    trips, start = 0, time.perf_counter()
    while True:
        post()
        trips += 1
        elapsed = time.perf_counter() - start
        if elapsed >= seconds:
            return trips, elapsed


class Xfer:
    name = "xfer"

    def __init__(self, size, batch):
        import xfer

        config = {
            "backend": "verbs",
            "groups": [{"nics": ["rxe0"]}],
            "worker": {"idle_poll_us": 1000},
            "timeouts": {"transfer_ms": 60000},
            "backends": {"verbs": {"gid_index": 0}},
        }
        self.a, self.b = xfer.TransferEngine(config), xfer.TransferEngine(config)
        self.size, self.batch = size, batch
        self.src, self.dst, _, _ = _buffers(size * batch)
        self.src_mr = self.a.reg_mr(self.src, access="local")
        self.dst_mr = self.b.reg_mr(self.dst)
        self.pages = list(range(batch))

    def trip(self):
        self.a.submit_paged_writes(
            self.size, self.src_mr, self.pages, self.dst_mr.desc, self.pages
        ).wait(60)

    def close(self):
        self.src_mr.dereg()
        self.dst_mr.dereg()
        self.a.close()
        self.b.close()


class XferSingles(Xfer):
    """The same trip posted the other way: one single write per assignment, as DLSlime's
    ``write`` takes them, then all waited for."""

    name = "xfer-singles"

    def trip(self):
        size, desc = self.size, self.dst_mr.desc
        pending = [
            self.a.submit_single_write(self.src_mr, desc, size, src_offset=i * size, dst_offset=i * size)
            for i in self.pages
        ]
        for t in pending:
            t.wait(60)


class DLSlime:
    name = "dlslime"

    def __init__(self, size, batch):
        from dlslime import RDMAEndpoint

        self.a = RDMAEndpoint(device_name="rxe0", ib_port=1, link_type="RoCE")
        self.b = RDMAEndpoint(device_name="rxe0", ib_port=1, link_type="RoCE")
        n = size * batch
        self.src, self.dst, src_ptr, dst_ptr = _buffers(n)
        self.local = self.a.register_memory_region("src", src_ptr, 0, n)
        self.b.register_memory_region("dst", dst_ptr, 0, n)
        self.remote = self.a.register_remote_memory_region("dst", self.b.endpoint_info()["mr_info"]["dst"])
        self.b.connect(self.a.endpoint_info())
        self.a.connect(self.b.endpoint_info())
        self.assign = [(self.local, self.remote, i * size, i * size, size) for i in range(batch)]

    def trip(self):
        self.a.write(self.assign, None).wait()

    def close(self):
        del self.a, self.b


class Mooncake:
    name = "mooncake"

    def __init__(self, size, batch):
        from mooncake.engine import TransferEngine

        def engine(port):
            e = TransferEngine()
            rc = e.initialize(f"127.0.0.1:{port}", "P2PHANDSHAKE", "rdma", "rxe0")
            if rc != 0:
                raise RuntimeError(f"Mooncake initialize returned {rc}")
            return e

        self.a, self.b = engine(17801), engine(17802)
        # P2PHANDSHAKE: a peer is named by its host and the RPC port its engine picked.
        self.target = f"127.0.0.1:{self.b.get_rpc_port()}"
        n = size * batch
        self.src, self.dst, src_ptr, dst_ptr = _buffers(n)
        for e, ptr in ((self.a, src_ptr), (self.b, dst_ptr)):
            if e.register_memory(ptr, n) != 0:
                raise RuntimeError("Mooncake register_memory failed")
        self.srcs = [src_ptr + i * size for i in range(batch)]
        self.dsts = [dst_ptr + i * size for i in range(batch)]
        self.lens = [size] * batch

    def trip(self):
        rc = self.a.batch_transfer_sync_write(self.target, self.srcs, self.dsts, self.lens)
        if rc != 0:
            raise RuntimeError(f"Mooncake batch_transfer_sync_write returned {rc}")

    def close(self):
        del self.a, self.b


ENGINES = {"xfer": Xfer, "xfer-singles": XferSingles, "dlslime": DLSlime, "mooncake": Mooncake}


def measure(kind, size, batch, seconds):
    engine = kind(size, batch)
    try:
        engine.trip()  # connects; not timed
        trips, elapsed = _trips(engine.trip, seconds)
        _verify(kind.name, engine.src, engine.dst, size * batch)
    finally:
        engine.close()
    return trips * size * batch / MIB / elapsed


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--sizes", default="4096,65536,1048576")
    p.add_argument("--batch", type=int, default=64)
    p.add_argument("--seconds", type=float, default=3.0)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--engines", default="xfer,xfer-singles,dlslime,mooncake")
    args = p.parse_args(argv)
    names = args.engines.split(",")
    sizes = [int(s) for s in args.sizes.split(",")]
    results = {s: {n: [] for n in names} for s in sizes}
    for r in range(args.rounds):
        order = names[r % len(names):] + names[: r % len(names)]
        for size in sizes:
            for name in order:
                rate = measure(ENGINES[name], size, args.batch, args.seconds)
                results[size][name].append(rate)
                print(f"peer-bench: round {r + 1} size {size} {name}: {rate:.1f} MiB/s", flush=True)
    print("peer-bench: median of per-round ratios xfer/peer (spread):")
    for size in sizes:
        row = results[size]
        for ours in ("xfer", "xfer-singles"):
            for peer in names:
                if peer.startswith("xfer") or ours not in names:
                    continue
                ratios = [x / y for x, y in zip(row[ours], row[peer])]
                print(
                    f"peer-bench: {size} B {ours}/{peer} {statistics.median(ratios):.2f} "
                    f"({min(ratios):.2f}-{max(ratios):.2f})"
                )
    print("peer-bench: json " + json.dumps({str(k): v for k, v in results.items()}))


if __name__ == "__main__":
    sys.exit(main())
