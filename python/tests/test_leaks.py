"""No leaks: 100k operations and 10k registrations keep the resident set flat, and the
reference counts of registered objects return to where they started."""

import gc
import os
import sys

import numpy as np

import xfer
from conftest import MOCK

PAGE = os.sysconf("SC_PAGE_SIZE")


def rss():
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * PAGE


def run_ops(engine, s, desc, n, batch=1000):
    for _ in range(n // batch):
        ts = [engine.submit_single_write(s, desc, 64, imm=1) for _ in range(batch)]
        for t in ts:
            t.wait(30)
        engine.expect_imm_count(1, batch).wait(30)


def test_operations_and_registrations_do_not_grow_memory():
    with xfer.TransferEngine(MOCK) as e:
        src, dst = np.zeros(4096, np.uint8), np.zeros(4096, np.uint8)
        s, d = e.reg_mr(src, access="local"), e.reg_mr(dst)
        run_ops(e, s, d.desc, 20_000)  # warm up: allocator pools, queues at their size
        gc.collect()
        before = rss()
        run_ops(e, s, d.desc, 100_000)
        gc.collect()
        grown = rss() - before
        # A leak of even 64 bytes per operation would be 6 MiB here.
        assert grown < 4 << 20, f"RSS grew {grown >> 10} KiB over 100k operations"

        buf = np.zeros(1 << 16, np.uint8)
        start = sys.getrefcount(buf)
        for _ in range(1000):
            e.reg_mr(buf).dereg()
        gc.collect()
        before = rss()
        for _ in range(10_000):
            r = e.reg_mr(buf)
            r.dereg()
        del r
        gc.collect()
        grown = rss() - before
        assert grown < 4 << 20, f"RSS grew {grown >> 10} KiB over 10k registrations"
        assert sys.getrefcount(buf) == start
