"""Two Python processes over the libfabric backend (shm and tcp), exchanging the address and
descriptors through a pipe, as two hosts would through any channel."""

import multiprocessing as mp
import os

import numpy as np
import pytest

import xfer
from conftest import plugin_available

# libfabric's shm and tcp here; verbs on soft-RoCE where the rxe guest provides rxe0.
FABRICS = ["shm", "tcp;ofi_rxm", "verbs"]
SIZE = 1 << 20
PAGE = 4096


def config(fabric):
    common = {
        "timeouts": {"expect_ms": 60000, "transfer_ms": 60000, "connect_ms": 20000},
        "worker": {"idle_poll_us": 0},
    }
    if fabric == "verbs":
        return dict(common, backend="verbs", groups=[{"nics": ["rxe0"]}])
    return dict(common, backend="efa", groups=[{"nics": ["auto"]}], backends={"efa": {"provider": fabric}})


def expected(n, seed):
    return ((np.arange(n, dtype=np.uint64) * 7 + seed) % 253).astype(np.uint8)


def target(provider, conn):
    """The receiving process: publishes a writable and a readable region, checks what lands."""
    with xfer.TransferEngine(config(provider)) as e:
        inbox = np.zeros(SIZE, dtype=np.uint8)
        outbox = expected(SIZE, 5)
        w = e.reg_mr(inbox)
        r = e.reg_mr(outbox, access="read")
        messages = []
        e.submit_recvs(256, 4, messages.append)
        conn.send((e.main_address, bytes(w.desc), bytes(r.desc)))
        pages = conn.recv()
        # One immediate per page, in whatever order they land.
        e.expect_imm_count(1, len(pages)).wait(30)
        for i, p in enumerate(pages):
            if not np.array_equal(inbox[p * PAGE:(p + 1) * PAGE], expected(SIZE, 1)[i * PAGE:(i + 1) * PAGE]):
                conn.send(f"page {p} differs")
                return
        e.expect_imm_count(2, 1).wait(30)  # the message was sent before this barrier
        conn.send(("ok", messages))
        conn.recv()  # the initiator's read is done


@pytest.mark.parametrize("provider", FABRICS)
def test_two_processes_write_read_and_send(provider):
    backend = "verbs" if provider == "verbs" else "efa"
    if not plugin_available(backend):
        pytest.skip(f"the {backend} plugin is not in the package (cargo xtask python builds it)")
    if backend == "verbs" and not os.path.exists("/sys/class/infiniband/rxe0"):
        pytest.skip("no soft-RoCE device (runs in the rxe guest: cargo xtask test)")
    ctx = mp.get_context("spawn")
    here, there = ctx.Pipe()
    child = ctx.Process(target=target, args=(provider, there))
    child.start()
    try:
        assert here.poll(60), "the target did not start"
        addr, wdesc, rdesc = here.recv()
        with xfer.TransferEngine(config(provider)) as e:
            src = e.reg_mr(expected(SIZE, 1), access="local")
            pages = np.random.default_rng(1).permutation(SIZE // PAGE)[:64]
            here.send([int(p) for p in pages])
            e.submit_paged_writes(PAGE, src, np.arange(64), xfer.MrDesc(wdesc), pages, imm=1).wait(30)
            e.submit_send(addr, b"req-42 ready").wait(30)
            e.submit_barrier(2, [xfer.MrDesc(wdesc)]).wait(30)
            assert here.poll(60)
            reply = here.recv()
            assert reply == ("ok", [b"req-42 ready"]), reply
            pulled = np.zeros(SIZE, dtype=np.uint8)
            dst = e.reg_mr(pulled, access="local")
            try:
                e.submit_single_read(dst, xfer.MrDesc(rdesc)).wait(30)
                assert np.array_equal(pulled, expected(SIZE, 5))
            except xfer.NotAvailableError:
                pass  # a provider without FI_READ: the engine says so
            here.send("done")
        child.join(60)
        assert child.exitcode == 0
    finally:
        if child.is_alive():
            child.kill()
