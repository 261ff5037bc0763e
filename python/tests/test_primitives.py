"""Every primitive on the mock, with numpy buffers, data verified."""

import asyncio
import gc
import mmap
import pickle
import sys
import threading
import time

import numpy as np
import pytest

import xfer
from conftest import MOCK


def pattern(n, seed=1):
    return ((np.arange(n, dtype=np.uint64) * 2654435761 + seed) % 251).astype(np.uint8)


def test_single_write_lands_and_is_counted(engine):
    src = pattern(1 << 20)
    dst = np.zeros(1 << 20, dtype=np.uint8)
    s = engine.reg_mr(src, access="local")
    d = engine.reg_mr(dst)
    t = engine.submit_single_write(s, d.desc, imm=1)
    t.wait(5)
    assert t.done() and t.exception() is None
    assert t.nbytes == 1 << 20 and t.kind == "write"
    assert t.completed_at >= t.posted_at and t.duration >= 0
    engine.expect_imm_count(1, engine.expected_arrivals(1 << 20)).wait(5)
    assert np.array_equal(src, dst)
    assert engine.imm_count(1) == 0


def test_offsets_and_lengths(engine):
    src, dst = pattern(4096), np.zeros(4096, dtype=np.uint8)
    s, d = engine.reg_mr(src, access="local"), engine.reg_mr(dst)
    engine.submit_single_write(s, d.desc, 100, src_offset=10, dst_offset=1000).wait(5)
    assert np.array_equal(dst[1000:1100], src[10:110])
    assert not dst[:1000].any() and not dst[1100:].any()


def test_expectation_registered_before_and_after_arrival(engine):
    src, dst = pattern(8192), np.zeros(8192, dtype=np.uint8)
    s, d = engine.reg_mr(src, access="local"), engine.reg_mr(dst)
    n = engine.expected_arrivals(4096)
    before = engine.expect_imm_count(5, n)  # registered before anything arrives
    assert not before.done()
    engine.submit_single_write(s, d.desc, 4096, imm=5).wait(5)
    before.wait(5)
    engine.submit_single_write(s, d.desc, 4096, src_offset=4096, dst_offset=4096, imm=5).wait(5)
    engine.expect_imm_count(5, n).wait(5)  # registered after the arrivals
    assert np.array_equal(src, dst)


def test_paged_writes_take_numpy_indices_and_scatter_pages(engine):
    page, pages = 256, 64
    src = pattern(page * pages)
    dst = np.zeros(page * pages * 2, dtype=np.uint8)
    s, d = engine.reg_mr(src, access="local"), engine.reg_mr(dst)
    src_idx = np.arange(pages, dtype=np.int64)
    dst_idx = np.random.default_rng(3).permutation(pages * 2)[:pages].astype(np.uint32)
    t = engine.submit_paged_writes(page, s, src_idx, d, dst_idx, imm=9)
    t.wait(5)
    assert t.nbytes == page * pages
    engine.expect_imm_count(9, engine.expected_arrivals(page_len=page, pages=pages)).wait(5)
    for i, j in zip(src_idx, dst_idx):
        assert np.array_equal(dst[j * page:(j + 1) * page], src[i * page:(i + 1) * page])


def test_paged_writes_take_plain_lists_with_strides_and_offsets(engine):
    src, dst = pattern(1024), np.zeros(1024, dtype=np.uint8)
    s, d = engine.reg_mr(src, access="local"), engine.reg_mr(dst)
    engine.submit_paged_writes(16, s, [0, 2], d, (1, 3), src_stride=32, dst_stride=64, dst_offset=8).wait(5)
    assert np.array_equal(dst[8 + 64:8 + 80], src[0:16])
    assert np.array_equal(dst[8 + 192:8 + 208], src[64:80])


def test_reads_pull_a_readable_region(engine):
    remote = pattern(65536, seed=4)
    local = np.zeros(65536, dtype=np.uint8)
    r = engine.reg_mr(remote, access="read")
    l = engine.reg_mr(local, access="local")
    engine.submit_single_read(l, r.desc).wait(5)
    assert np.array_equal(local, remote)
    local[:] = 0
    engine.submit_paged_reads(1024, l, [0, 1], r, [63, 62]).wait(5)
    assert np.array_equal(local[:1024], remote[63 * 1024:])
    assert np.array_equal(local[1024:2048], remote[62 * 1024:63 * 1024])


def test_a_region_peers_may_not_read_is_refused(engine):
    remote = engine.reg_mr(np.zeros(4096, dtype=np.uint8))  # write only
    local = engine.reg_mr(np.zeros(4096, dtype=np.uint8), access="local")
    with pytest.raises(xfer.RemoteAccessError):
        engine.submit_single_read(local, remote.desc).wait(5)


def test_scatter_barrier_and_peer_groups(engine):
    src = pattern(3000)
    dsts = [np.zeros(1000, dtype=np.uint8) for _ in range(3)]
    s = engine.reg_mr(src, access="local")
    regions = [engine.reg_mr(d) for d in dsts]
    group = engine.add_peer_group([engine.main_address])
    t = engine.submit_scatter(s, [(1000, 1000 * i, r.desc, 0) for i, r in enumerate(regions)], imm=3, group=group)
    t.wait(5)
    assert t.nbytes == 3000
    engine.expect_imm_count(3, engine.expected_arrivals(scatter_lens=[1000] * 3)).wait(5)
    for i, d in enumerate(dsts):
        assert np.array_equal(d, src[1000 * i:1000 * (i + 1)])
    engine.submit_barrier(4, [regions[0].desc], group=group).wait(5)
    engine.expect_imm_count(4, engine.expected_arrivals(barrier=True)).wait(5)


def test_send_and_receive_messages(engine):
    got, lock = [], threading.Condition()

    def handler(msg):
        with lock:
            got.append(msg)
            lock.notify_all()

    engine.submit_recvs(256, 8, handler)
    for i in range(20):
        engine.submit_send(engine.main_address, b"hello %d" % i).wait(5)
    with lock:
        assert lock.wait_for(lambda: len(got) == 20, timeout=5)
    assert sorted(got) == sorted(b"hello %d" % i for i in range(20))
    assert all(isinstance(m, bytes) for m in got)


def test_mirror_reports_running_totals(engine):
    totals, lock = [], threading.Condition()

    def sink(total):
        with lock:
            totals.append(total)
            lock.notify_all()

    engine.mirror_imm_count(11, sink)
    src, dst = pattern(64), np.zeros(64, dtype=np.uint8)
    s, d = engine.reg_mr(src, access="local"), engine.reg_mr(dst)
    for _ in range(3):
        engine.submit_single_write(s, d.desc, imm=11).wait(5)
    with lock:
        assert lock.wait_for(lambda: totals and totals[-1] == 3, timeout=5)
    assert totals == sorted(totals)


def test_completion_three_ways(engine):
    src, dst = pattern(64), np.zeros(64, dtype=np.uint8)
    s, d = engine.reg_mr(src, access="local"), engine.reg_mr(dst)
    seen = threading.Event()
    results = []
    engine.submit_single_write(s, d.desc, on_done=lambda e: (results.append(e), seen.set()))
    assert seen.wait(5) and results == [None]

    late = []
    t = engine.submit_single_write(s, d.desc)
    t.wait(5)
    t.add_done_callback(late.append)  # already done: called at once
    assert late == [None]

    async def main():
        ts = [engine.submit_single_write(s, d.desc) for _ in range(10)]
        done = await asyncio.gather(*ts)
        assert all(x.done() for x in done)
        with pytest.raises(xfer.OutOfBoundsError):
            engine.submit_single_write(s, d.desc, 65)
        failing = engine.expect_imm_count(99, 1)
        with pytest.raises(xfer.TimeoutError):
            await failing

    engine_with_short_expect = None  # the engine's expect_ms is 5 s: fine for one await
    asyncio.run(main())
    assert engine_with_short_expect is None


def test_a_failure_reaches_every_way_of_waiting():
    config = dict(MOCK, timeouts={"expect_ms": 50, "transfer_ms": 1000})
    with xfer.TransferEngine(config) as e:
        got, called = [], threading.Event()
        t = e.expect_imm_count(1, 1, on_done=lambda exc: (got.append(exc), called.set()))
        with pytest.raises(xfer.TimeoutError) as info:
            t.wait(5)
        assert isinstance(info.value, TimeoutError)  # the builtin, too
        assert isinstance(t.exception(), xfer.TimeoutError)
        # Callbacks run on the bindings' callback thread, after the outcome is visible.
        assert called.wait(5)
        assert len(got) == 1 and isinstance(got[0], xfer.TimeoutError)
        assert e.imm_owed(1) == 1


def test_wait_with_a_timeout_raises_timeout_while_pending(engine):
    t = engine.expect_imm_count(77, 1)
    with pytest.raises(xfer.TimeoutError):
        t.wait(0.05)
    with pytest.raises(xfer.InvalidArgumentError):
        t.exception()


def test_a_raising_callback_is_reported_and_the_engine_goes_on(engine):
    src, dst = pattern(64), np.zeros(64, dtype=np.uint8)
    s, d = engine.reg_mr(src, access="local"), engine.reg_mr(dst)
    reported = []
    old = sys.unraisablehook
    sys.unraisablehook = lambda u: reported.append(u.exc_type)
    try:
        before = xfer.callback_errors()
        engine.submit_single_write(s, d.desc, on_done=lambda e: 1 / 0).wait(5)
        engine.submit_recvs(64, 2, lambda m: {}["missing"])
        engine.submit_send(engine.main_address, b"x").wait(5)
        for _ in range(100):
            if xfer.callback_errors() - before >= 2:
                break
            threading.Event().wait(0.02)
        assert xfer.callback_errors() - before == 2
        assert ZeroDivisionError in reported and KeyError in reported
    finally:
        sys.unraisablehook = old
    engine.submit_single_write(s, d.desc, imm=2).wait(5)  # still working
    engine.expect_imm_count(2, 1).wait(5)


def test_buffer_protocol_objects_register(engine):
    ba = bytearray(4096)
    mm = mmap.mmap(-1, 4096)
    view = memoryview(bytearray(b"\x07" * 4096))
    regions = [engine.reg_mr(o) for o in (ba, mm, view)]
    src = engine.reg_mr(pattern(4096), access="local")
    for r in regions:
        engine.submit_single_write(src, r.desc).wait(5)
    assert bytes(ba) == pattern(4096).tobytes()
    assert mm[:] == pattern(4096).tobytes()
    assert bytes(view) == pattern(4096).tobytes()
    for r in regions:
        r.dereg()
    mm.close()


def test_descriptors_and_addresses_are_bytes_and_pickle(engine):
    d = engine.reg_mr(np.zeros(64, dtype=np.uint8)).desc
    assert xfer.MrDesc(bytes(d)) == d
    assert pickle.loads(pickle.dumps(d)) == d
    assert d.nbytes == 64 == len(d)
    assert bytes(d.owner) == engine.main_address
    a = xfer.NetAddr(engine.main_address)
    assert pickle.loads(pickle.dumps(a)) == a and hash(a) == hash(xfer.NetAddr(bytes(a)))
    with pytest.raises(xfer.DecodeError):
        xfer.MrDesc(b"\x00garbage")


def test_watcher_reports_changes(engine):
    seen, lock = [], threading.Condition()

    def cb(old, new):
        with lock:
            seen.append((old, new))
            lock.notify_all()
        return new < 3

    w = engine.alloc_uvm_watcher(cb)
    assert w.host_ptr != 0
    for v in (1, 2, 3):
        w.store(v)
        with lock:
            assert lock.wait_for(lambda: seen and seen[-1][1] == v, timeout=5)
    w.close()


def test_expected_arrivals_module_function():
    assert xfer.expected_arrivals(4096) == 1
    assert xfer.expected_arrivals(page_len=4096, pages=10) == 10
    assert xfer.expected_arrivals(1 << 20, nics=2) == 2
    assert xfer.expected_arrivals(barrier=True) == 1
    with pytest.raises(xfer.InvalidArgumentError):
        xfer.expected_arrivals(4096, barrier=True)


def test_registered_objects_stay_alive_and_are_released():
    arr = np.zeros(4096, dtype=np.uint8)
    start = sys.getrefcount(arr)
    e = xfer.TransferEngine(MOCK)
    r = e.reg_mr(arr)
    assert sys.getrefcount(arr) > start
    r.dereg()
    assert not r.registered
    assert sys.getrefcount(arr) == start
    r2 = e.reg_mr(arr)
    e.close()
    assert sys.getrefcount(arr) == start
    assert e.closed
    del r2
    # Garbage collection closes an engine that was never closed, releasing its objects.
    e2 = xfer.TransferEngine(MOCK)
    e2.reg_mr(arr)
    assert sys.getrefcount(arr) > start
    del e2
    gc.collect()
    assert sys.getrefcount(arr) == start


def test_notifications_follow_their_data_under_reordering():
    config = dict(MOCK, backends={"mock": {"seed": 3, "reorder": True, "delay_us": 1000, "jitter_us": 2000}})
    with xfer.TransferEngine(config) as a, xfer.TransferEngine(config) as b:
        b.listen_notifications(32)
        chunk, n = 32 << 10, 16
        src = pattern(chunk * n)
        dst = np.zeros(chunk * n, dtype=np.uint8)
        s, d = a.reg_mr(src, access="local"), b.reg_mr(dst)
        ts = [a.submit_single_write(s, d.desc, chunk, src_offset=i * chunk, dst_offset=i * chunk,
                                    notify=b"req-%d" % i) for i in range(n - 1)]
        ts.append(a.submit_paged_writes(chunk, s, [n - 1], d, [n - 1], notify=b"req-last"))
        seen = set()
        while len(seen) < n:
            note = b.wait_notification(10)
            i = n - 1 if note == b"req-last" else int(note[4:])
            # Seen only once every byte of its transfer landed.
            assert np.array_equal(dst[i * chunk:(i + 1) * chunk], src[i * chunk:(i + 1) * chunk]), note
            seen.add(i)
        for t in ts:
            t.wait(10)
        assert b.poll_notifications() == []

        async def stream():
            a.submit_single_write(s, d.desc, 64, notify=b"async-1")
            async for note in b.notifications():
                return note

        assert asyncio.run(stream()) == b"async-1"
        with pytest.raises(xfer.TimeoutError):
            b.wait_notification(0.05)


def test_batched_descriptor_lists_as_numpy_arrays(engine):
    src, dst = pattern(1 << 16), np.zeros(1 << 16, dtype=np.uint8)
    s, d = engine.reg_mr(src, access="local"), engine.reg_mr(dst)
    n = 100
    rng = np.random.default_rng(5)
    src_off = rng.integers(0, (1 << 16) - 512, n).astype(np.int64)
    dst_off = (np.arange(n, dtype=np.uint64) * 600)[::-1].copy()
    lens = rng.integers(1, 512, n).astype(np.uint32)
    t = engine.submit_writes(s, d.desc, src_off, dst_off, lens, imm=12)
    t.wait(10)
    assert t.nbytes == int(lens.sum())
    engine.expect_imm_count(12, engine.expected_arrivals(scatter_lens=lens.tolist())).wait(10)
    for so, do, ln in zip(src_off, dst_off, lens):
        assert np.array_equal(dst[do:do + ln], src[so:so + ln])
    # One length for all, plain lists.
    engine.submit_writes(s, d, [0, 64], [1000, 2000], 16).wait(10)
    assert np.array_equal(dst[2000:2016], src[64:80])
    with pytest.raises(xfer.InvalidArgumentError, match="different lengths"):
        engine.submit_writes(s, d, [0, 1], [0], [1, 1])
    with pytest.raises(xfer.InvalidArgumentError, match="negative"):
        engine.submit_writes(s, d, [-1], [0], 1)
    with pytest.raises(xfer.OutOfBoundsError):
        engine.submit_writes(s, d, [0], [(1 << 16) - 1], 2)


def test_notifications_name_their_sender_and_can_be_restricted():
    """Issue 25 §3: a notification names its sender; a receiver can refuse other peers."""
    with xfer.TransferEngine(MOCK) as a, xfer.TransferEngine(MOCK) as b, \
            xfer.TransferEngine(MOCK) as c:
        b.listen_notifications(8)
        dst = np.zeros(64, dtype=np.uint8)
        d = b.reg_mr(dst)
        sa, sc = a.reg_mr(pattern(64), access="local"), c.reg_mr(pattern(64), access="local")
        a.submit_single_write(sa, d.desc, 64, notify=b"from-a").wait(10)
        assert b.wait_notification(10, with_sender=True) == (b"from-a", a.main_address)
        b.restrict_notifications([c.main_address])
        a.submit_single_write(sa, d.desc, 64, notify=b"refused").wait(10)
        c.submit_single_write(sc, d.desc, 64, notify=b"from-c").wait(10)
        assert b.wait_notification(10) == b"from-c"
        deadline = time.monotonic() + 10
        while b.notifications_dropped < 1 and time.monotonic() < deadline:
            time.sleep(0.001)
        assert b.notifications_dropped == 1
        assert b.poll_notifications(with_sender=True) == []
        b.restrict_notifications(None)
        a.submit_single_write(sa, d.desc, 64, notify=b"again").wait(10)
        assert b.wait_notification(10) == b"again"
        with pytest.raises(xfer.InvalidArgumentError, match="256"):
            a.submit_single_write(sa, d.desc, 64, notify=b"x" * 257)


def test_a_message_handler_is_told_the_proven_sender():
    """Issue 56: `with_sender=True` hands the handler the sender the transport proved (its
    engine's main_address bytes), two senders told apart; without it, the message alone."""
    with xfer.TransferEngine(MOCK) as a, xfer.TransferEngine(MOCK) as b, \
            xfer.TransferEngine(MOCK) as c:
        got, lock = [], threading.Condition()

        def handler(msg, sender):
            with lock:
                got.append((msg, sender))
                lock.notify_all()

        b.submit_recvs(64, 8, handler, with_sender=True)
        for sender, name in ((a, b"a"), (c, b"c")):
            for i in range(3):
                sender.submit_send(b.main_address, name + b"%d" % i).wait(10)
        with lock:
            assert lock.wait_for(lambda: len(got) == 6, timeout=10)
        for msg, sender in got:
            assert isinstance(sender, bytes)
            assert sender == (a if msg.startswith(b"a") else c).main_address, msg
        # A notification with its proven sender, and a plain handler is unchanged.
        plain = []
        a.submit_recvs(64, 2, plain.append)
        b.submit_send(a.main_address, b"plain").wait(10)
        deadline = time.monotonic() + 10
        while not plain and time.monotonic() < deadline:
            time.sleep(0.001)
        assert plain == [b"plain"]
        dst = np.zeros(64, dtype=np.uint8)
        d = b.reg_mr(dst)
        s = c.reg_mr(pattern(64), access="local")
        c.submit_single_write(s, d.desc, 64, notify=b"from-c").wait(10)
        assert b.wait_notification(10, with_sender=True) == (b"from-c", c.main_address)


def test_stats_count_operations_bytes_and_latency():
    """Issue 27: engine.stats() as a dict, for a connector's stats hooks."""
    with xfer.TransferEngine(MOCK) as a, xfer.TransferEngine(MOCK) as b:
        src, dst = a.reg_mr(pattern(8192), access="local"), b.reg_mr(np.zeros(8192, dtype=np.uint8))
        for i in range(4):
            a.submit_single_write(src, dst.desc, 1024, src_offset=i * 1024, dst_offset=i * 1024).wait(10)
        s = a.stats()
        w = s["ops"]["write"]
        assert (w["started"], w["completed"], w["bytes"]) == (4, 4, 4096)
        assert sum(w["latency"]["counts"]) == 4
        assert s["stale_completions"] == 0 and s["registrations"]["registered"] >= 1
        assert sum(p["bytes"] for p in s["peers"].values()) == 4096
        peers = a.peers()
        assert peers and all(p["healthy"] and p["address"] in s["peers"] for p in peers)


def test_a_transfer_can_be_watched_and_cancelled():
    """Issue 27: status and cancel. A write on a slow NIC is cancelled once the NIC is done
    with it; exactly one completion, a CancelledError; a finished one stays done."""
    slow = dict(MOCK, backends={"mock": {"delay_us": 300000}})
    with xfer.TransferEngine(slow) as a, xfer.TransferEngine(slow) as b:
        src, dst = a.reg_mr(pattern(4096), access="local"), b.reg_mr(np.zeros(4096, dtype=np.uint8))
        seen = []
        t = a.submit_single_write(src, dst.desc, 4096, on_done=seen.append)
        assert t.status in ("queued", "posted")
        assert t.cancel() == "cancelled"
        with pytest.raises(xfer.CancelledError):
            t.wait(10)
        assert t.status == "cancelled"
        deadline = time.monotonic() + 10
        while not seen and time.monotonic() < deadline:
            time.sleep(0.001)
        assert len(seen) == 1 and isinstance(seen[0], xfer.CancelledError)
        done = a.submit_single_write(src, dst.desc, 64)
        done.wait(10)
        assert done.cancel() == "done" and done.status == "done"
        # An expectation is cancelled too; its arrivals are then owed.
        waiting = b.expect_imm_count(5, 1)
        assert waiting.cancel() == "cancelled"
        with pytest.raises(xfer.CancelledError):
            waiting.wait(10)
        assert b.imm_owed(5) == 1
