"""xfer.ep's GPU path (``xfer.ep.gpu``) against the fake CUDA driver and GDRCopy
(gpu-fakes/): the compute thread only queues stream operations, the stream signals the proxy
through a watcher slot and waits on a GPU counter in device memory, results checked against
the oracle. The fake driver's streams run their operations later, on a thread of their own (as
a GPU does), and its device memory is unreachable to the CPU except through the driver: a path
that skipped the driver would crash, one that waited on the compute thread would deadlock
behind the gate put first on the stream (``gpu_check.check_steps``). Run with the fakes on
LD_LIBRARY_PATH ($XFER_GPU_FAKES): `cargo xtask test`."""

import os
import threading

import numpy as np
import pytest

import xfer
from xfer.ep import EpConfig, EpError, oracle

pytestmark = pytest.mark.skipif(
    not os.environ.get("XFER_GPU_FAKES"), reason="needs the GPU fakes ($XFER_GPU_FAKES): cargo xtask test"
)


@pytest.fixture(scope="module")
def driver():
    from xfer.ep.gpu import CudaDriver

    return CudaDriver(0)


def make(driver, cfg, **kw):
    from xfer.ep.gpu_check import make_ranks

    return make_ranks(driver, cfg, **kw)


CFG = EpConfig(ranks=2, experts_per_rank=2, top_k=2, max_tokens=8, hidden=64, timeout=5.0)


@pytest.mark.parametrize("device_regions", [True, False])
def test_a_stream_carries_steps_exactly_and_the_compute_thread_only_queues(driver, device_regions):
    from xfer.ep.gpu_check import check_steps

    ranks = make(driver, CFG, device_regions=device_regions)
    try:
        # Device regions: peers write into this rank's device memory (the CPU cannot reach it
        # but through the driver: a stage that skipped fetch/publish reads poison).
        want = "cuda:0" if device_regions else "cpu"
        assert {mr.device for r in ranks for mr in r.group._mrs.values()} == {want}
        times = check_steps(driver, ranks, steps=3)
        assert all(len(t) == 3 for t in times)
    finally:
        for r in ranks:
            r.close()


SHORT = EpConfig(ranks=2, experts_per_rank=2, top_k=2, max_tokens=8, hidden=64, timeout=0.5)


@pytest.fixture
def short_ranks(driver):
    """Two ranks with half-second deadlines, of which the tests drive rank 0 only."""
    ranks = make(driver, SHORT)
    yield ranks
    for r in ranks:
        r.close()


def test_a_silent_rank_is_masked_and_the_stream_is_released(driver, short_ranks):
    cfg, rank = SHORT, short_ranks[0]
    x, idx, w = oracle.inputs(3, 0, 0, cfg)
    _h, y_ptr = rank.queue_step(x, idx, w)
    rank.stream.synchronize()  # rank 1 never queues: its deadlines end rank 0's waits
    rank.gep.check()
    y = driver.download(y_ptr, (x.shape[0], cfg.hidden), np.float32)
    assert np.array_equal(y, oracle.expected_combine(x, idx, w, cfg, active=[True, False]))
    assert list(driver.download(rank.gep.mask_ptr, (2,), np.int32)) == [1, 0]


def test_a_failed_request_releases_the_stream_and_raises_on_the_compute_thread(driver, short_ranks):
    cfg, rank = SHORT, short_ranks[0]
    x, idx, w = oracle.inputs(3, 0, 0, cfg)
    idx = idx.copy()
    idx[0, 0] = cfg.ranks * cfg.experts_per_rank  # no such expert: refused before sending
    h, y_ptr = rank.queue_step(x, idx, w)
    rank.stream.synchronize()
    assert h.error is not None
    counts = driver.download(h.recv_count, (cfg.experts_per_rank,), np.int64)
    assert not counts.any(), "a failed dispatch hands its expert no rows"
    assert not driver.download(y_ptr, (x.shape[0], cfg.hidden), np.float32).any()
    with pytest.raises(EpError, match="GPU request 1"):
        rank.gep.check()
    with pytest.raises(EpError, match="GPU request 2"):
        rank.gep.check()
    rank.gep.check()  # nothing more


def test_a_graph_of_a_step_replays_with_new_inputs(driver):
    """A step queued with ``replay=True`` (dispatch, experts, combine), then replayed three
    times as a CUDA graph replays what it captured (``gpu_check.check_replays``: the same
    stream operations again, new inputs copied into the same input buffers first). Each run
    is exact on both ranks (before tickets, a replay found the counter at the last run's value
    and passed without running: replay 1 returned replay 0's output)."""
    from xfer.ep.gpu_check import check_replays

    ranks = make(driver, CFG)
    try:
        check_replays(driver, ranks, 3)
    finally:
        for r in ranks:
            r.close()


def test_closing_releases_a_stream_whose_requests_it_never_reached(driver, short_ranks):
    cfg, rank = SHORT, short_ranks[0]
    gate = threading.Event()
    rank.stream.host_func(gate.wait)
    try:
        x, idx, w = oracle.inputs(3, 0, 0, cfg)
        rank.queue_step(x, idx, w)
        assert rank.gep.proxy.close(0.2) is False  # the stream never got there: slot kept
        with pytest.raises(EpError, match="closed before the stream reached it"):
            rank.gep.check()
        with pytest.raises(RuntimeError, match="closed"):
            rank.gep.dispatch(0, 0, 0)
    finally:
        gate.set()
    # Released all the same: the counter was set past every request, so the stream runs on.
    assert rank.stream.reached(10)


def test_the_legacy_default_stream_is_refused(driver):
    from xfer.ep.gpu import Stream

    for handle in (0, 2):
        with pytest.raises(ValueError, match="default stream"):
            Stream(driver, handle)


def test_a_gpu_counter_mirrors_arrivals_in_device_memory_and_a_stream_waits_on_it(driver):
    from xfer.ep.gpu_check import MOCK

    a, b = xfer.TransferEngine(MOCK), xfer.TransferEngine(MOCK)
    stream = driver.stream()
    try:
        counter = xfer.GpuCounter(0)
        assert counter.memory == "gdr" and counter.device_ptr is not None
        imm = 0x5A5A
        b.mirror_imm_count(imm, counter)
        buf = np.zeros(64, dtype=np.uint8)
        mr = b.reg_mr(buf, access="write")
        smr = a.reg_mr(np.arange(64, dtype=np.uint8), access="local")
        for i in range(1, 6):
            a.submit_single_write(smr, mr.desc, 64, imm=imm).wait(10)
            # A stream waiting for i arrivals passes, and the counter (read by the "GPU"
            # through the driver) holds exactly i.
            stream.wait_value(counter.device_ptr, i)
            assert stream.reached(10), f"the stream did not pass {i} arrivals"
            assert int(driver.download(counter.device_ptr, (1,), np.uint64)[0]) == i == counter.value
    finally:
        stream.close()
        a.close()
        b.close()
