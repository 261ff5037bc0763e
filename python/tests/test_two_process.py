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
        # A hang detector: the child imports numpy and xfer under emulation in the rxe guest
        # (it took over 60 s once with the host loaded).
        assert here.poll(300), "the target did not start"
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


def test_an_ep_group_over_verbs_is_exact_and_refuses_forged_immediates():
    """xfer.ep on soft-RoCE (two ranks and a stranger, engines of one process): steps exact
    against the oracle, and the stranger's zero-byte writes carrying rank 1's immediates are
    refused at rank 0 — on verbs the sender is the RC connection an arrival came on, so this
    checks that the NIC addresses a group restricts to are the ones verbs names (review 56
    M6)."""
    if not plugin_available("verbs") or not os.path.exists("/sys/class/infiniband/rxe0"):
        pytest.skip("no soft-RoCE device (runs in the rxe guest: cargo xtask test)")
    import time

    from test_ep import Ranks, check_step
    from xfer.ep import EpConfig, oracle

    # Soft-RoCE under emulation is slow: deadlines of a minute, not test_ep's 2 s.
    cfg = EpConfig(ranks=2, experts_per_rank=2, top_k=2, max_tokens=5, hidden=8, private_rows=2, timeout=60)
    rs = Ranks(cfg, engine_configs={0: config("verbs"), 1: config("verbs")})
    stranger = xfer.TransferEngine(config("verbs"))
    try:
        victim = rs.groups[0]
        nothing = stranger.reg_mr(np.zeros(8, dtype=np.uint8), access="local")
        forged = [(cfg.tag << 28) | (epoch << 16) | (phase << 14) | 1 for epoch in range(3) for phase in range(3)]
        for imm in forged:
            stranger.submit_single_write(nothing, victim._mrs["dispatch"].desc, 0, imm=imm).wait(60)
        engine, deadline = rs.engines[0], time.monotonic() + 60
        while engine.imm_refused + sum(engine.imm_count(i) for i in forged) < len(forged):
            assert time.monotonic() < deadline, "the forged writes never landed"
            time.sleep(0.01)
        assert engine.imm_refused == len(forged)

        def body(r, g):
            for step in range(3):
                check_step(g, r, cfg, [oracle.inputs(5, step, s, cfg) for s in range(2)])
                assert list(g.query_active_mask()) == [1, 1]

        rs.run(body, timeout=300)
    finally:
        stranger.close()
        rs.close()
