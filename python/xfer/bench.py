"""``python -m xfer.bench``: transfer-bench's table, measured from Python.

Loopback writes (one engine writing into its own registered buffer, as ``transfer-bench
--mode loopback`` does) for each block size, then the 64-byte write-with-immediate rate
through the paged API. With ``--rust PATH`` (default: ``target/release/transfer-bench`` when
it exists) the Rust bench runs in the same invocation with the same sizes and config, and the
table shows Python over Rust for each row: the ratios are the figures to record, the absolute
numbers move with the machine.
"""

import argparse
import json
import os
import subprocess
import sys
import time

import xfer

MIB = 1 << 20


def _buffer(nbytes):
    """Page-aligned memory (an anonymous mmap), like the Rust bench's HostBuffer: small
    numpy arrays come from the malloc heap, and copying between two of them measured up to
    5x slower than between page-aligned buffers on the same machine (32-128 KiB)."""
    import mmap

    return mmap.mmap(-1, nbytes)


def measure_writes(engine, block, batch, duration):
    """Trips of `batch` writes of `block` bytes, each trip waited for; MiB/s and trips."""
    src = engine.reg_mr(_buffer(block * batch), access="local")
    dst = engine.reg_mr(_buffer(block * batch))
    desc = dst.desc
    trips = 0
    start = time.perf_counter()
    deadline = start + duration
    while True:
        pending = [
            engine.submit_single_write(src, desc, block, src_offset=i * block, dst_offset=i * block)
            for i in range(batch)
        ]
        for t in pending:
            t.wait(30)
        trips += 1
        if time.perf_counter() >= deadline:
            break
    elapsed = time.perf_counter() - start
    src.dereg()
    dst.dereg()
    return trips * batch * block / MIB / elapsed, trips, elapsed


def measure_imm_rate(engine, duration, pages_per_call=1024):
    """64-byte writes with an immediate, submitted through the paged API: ops/s counted at
    the target (expectations consume every arrival)."""
    import numpy as np

    src = engine.reg_mr(_buffer(64 * pages_per_call), access="local")
    dst = engine.reg_mr(_buffer(64 * pages_per_call))
    idx = np.arange(pages_per_call, dtype=np.uint32)
    per_call = engine.expected_arrivals(page_len=64, pages=pages_per_call)
    ops = 0
    start = time.perf_counter()
    deadline = start + duration
    window = []
    while time.perf_counter() < deadline:
        window.append(engine.submit_paged_writes(64, src, idx, dst, idx, imm=0xBE))
        window.append(engine.expect_imm_count(0xBE, per_call))
        if len(window) >= 16:  # keep a few calls in flight, like the Rust bench's window
            for t in window[:8]:
                t.wait(30)
            ops += pages_per_call * 4
            window = window[8:]
    for t in window:
        t.wait(30)
    ops += pages_per_call * (len(window) // 2)
    elapsed = time.perf_counter() - start
    src.dereg()
    dst.dereg()
    return ops / elapsed / 1e6


def rust_bench(path, sizes, batch, duration, config):
    args = [path, "--block-size", ",".join(map(str, sizes)), "--batch-size", str(batch),
            "--duration", str(duration), "--json"]
    if config:
        args += ["--config", config]
    out = subprocess.run(args, check=True, capture_output=True, text=True).stdout
    report = json.loads(out)
    rows = {r["block_size"]: r["throughput_mib_s"] for r in report["rows"]}
    return rows, report.get("imm_rate", {}).get("mops_per_s")


def bench_config(path):
    """The config as a dict, with the mock made an ideal in-order NIC (`inline`) unless the
    file says otherwise: what transfer-bench does, so both measure the engine, not the
    mock's fault injection."""
    import tomllib

    if path is None:
        path = os.environ.get("XFER_CONFIG")
    if path is None:
        config = {"backend": "mock", "groups": [{"nics": ["mock0"]}]}
    else:
        with open(path, "rb") as f:
            config = tomllib.load(f)
    if config.get("backend") == "mock":
        config.setdefault("backends", {}).setdefault("mock", {}).setdefault("inline", True)
    return config


def main(argv=None):
    p = argparse.ArgumentParser(prog="python -m xfer.bench", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--config", help="config file (else $XFER_CONFIG, else the mock)")
    p.add_argument("--block-size", default="4096,65536,1048576",
                   help="comma-separated block sizes in bytes")
    p.add_argument("--batch-size", type=int, default=1, help="writes per trip")
    p.add_argument("--duration", type=float, default=1.0, help="seconds per measurement")
    default_rust = "target/release/transfer-bench"
    p.add_argument("--rust", default=default_rust if os.path.exists(default_rust) else None,
                   help="transfer-bench executable to run alongside (default: %(default)s)")
    p.add_argument("--no-rust", action="store_true", help="do not run the Rust bench")
    a = p.parse_args(argv)
    sizes = [int(s) for s in a.block_size.split(",")]
    rust_rows, rust_imm = {}, None
    if a.rust and not a.no_rust:
        rust_rows, rust_imm = rust_bench(a.rust, sizes, a.batch_size, a.duration, a.config)
    with xfer.TransferEngine(bench_config(a.config)) as engine:
        print(f"backend: {engine.backend}, NICs: {engine.nic_count}, mode: loopback, from Python "
              f"{sys.version.split()[0]}; reference: the Rust transfer-bench in the same run")
        print(f"{'Batch Size':>10} | {'Block Size (Bytes)':>18} | {'Total Trips':>11} | "
              f"{'Duration (s)':>12} | {'Throughput (MiB/s)':>18} | {'Rust (MiB/s)':>12} | "
              f"{'Python / Rust':>13}")
        for size in sizes:
            mib_s, trips, elapsed = measure_writes(engine, size, a.batch_size, a.duration)
            rust = rust_rows.get(size)
            ratio = f"{mib_s / rust:13.3f}" if rust else f"{'-':>13}"
            rust_text = f"{rust:12.1f}" if rust else f"{'-':>12}"
            print(f"{a.batch_size:>10} | {size:>18} | {trips:>11} | {elapsed:>12.3f} | "
                  f"{mib_s:>18.1f} | {rust_text} | {ratio}")
        try:
            mops = measure_imm_rate(engine, a.duration)
        except ImportError:
            print("64-byte write with imm: needs numpy (skipped)")
            return 0
        tail = f"; Rust {rust_imm:.3f} M ops/s, Python / Rust {mops / rust_imm:.3f}" if rust_imm else ""
        print(f"64-byte write with imm, paged API, counted at the target: {mops:.3f} M ops/s{tail}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
