"""xfer.ep's GPU path (``xfer.ep.gpu``) against the fake CUDA driver and GDRCopy
(gpu-fakes/): the compute thread only queues stream operations, the stream signals the proxy
through a watcher slot and waits on a GPU counter in device memory, results checked against
the oracle. The fake driver's streams run their operations later, on a thread of their own (as
a GPU does), and its device memory is unreachable to the CPU except through the driver: a path
that skipped the driver would crash, one that waited on the compute thread would deadlock
behind the gate each test puts first on the stream. Run with the fakes on LD_LIBRARY_PATH ($XFER_GPU_FAKES): `cargo xtask test`."""

import os
import threading

import numpy as np
import pytest

import xfer
from xfer.ep import EpConfig, EpError, oracle
from xfer.ep.group import EpGroup

pytestmark = pytest.mark.skipif(
    not os.environ.get("XFER_GPU_FAKES"), reason="needs the GPU fakes ($XFER_GPU_FAKES): cargo xtask test"
)

MOCK = {
    "backend": "mock",
    "groups": [{"nics": ["mock0"]}],
    "timeouts": {"expect_ms": 60000, "transfer_ms": 60000},
    "backends": {"mock": {"seed": 5, "reorder": True}},
}


@pytest.fixture(scope="module")
def driver():
    from xfer.ep.gpu import CudaDriver

    return CudaDriver(0)


class Rank:
    """One rank: engine, group, GPU path, its inputs in device memory."""

    def __init__(self, driver, rank, cfg):
        from xfer.ep.gpu import GpuEp

        self.driver, self.rank, self.cfg = driver, rank, cfg
        self.engine = xfer.TransferEngine(MOCK)
        self.group = EpGroup(self.engine, rank, cfg)
        self.stream = driver.stream()
        self.GpuEp = GpuEp
        self.gep = None
        self.allocs = []

    def start(self):
        self.gep = self.GpuEp(self.group, self.driver, self.stream)

    def device(self, array):
        ptr = self.driver.alloc(array.nbytes)
        self.driver.upload(ptr, array)
        self.allocs.append(ptr)
        return ptr

    def empty(self, nbytes):
        ptr = self.driver.alloc(nbytes)
        self.allocs.append(ptr)
        return ptr

    def queue_step(self, x, idx, w):
        """Queues a dispatch, an expert "kernel" (a host function on the stream: it reads the
        dispatched rows from device memory and writes the outputs back) and a combine."""
        cfg, d = self.cfg, self.driver
        h = self.gep.dispatch(self.device(x), self.device(idx.astype(np.int64)), x.shape[0])
        shape = (cfg.experts_per_rank, cfg.ranks * cfg.max_tokens, cfg.hidden)
        out_ptr = self.empty(int(np.prod(shape)) * cfg.storage.itemsize)

        def expert():
            recv = d.download(h.recv_x, shape, cfg.storage)
            count = d.download(h.recv_count, (cfg.experts_per_rank,), np.int64)
            d.upload(out_ptr, oracle.run_experts_deepep(recv, count, self.rank, cfg))

        self.stream.host_func(expert)
        y_ptr = self.empty(x.shape[0] * cfg.hidden * 4)
        self.gep.combine(h, out_ptr, self.device(w.astype(np.float32)), y_ptr)
        return h, y_ptr

    def close(self):
        if self.gep is not None:
            self.gep.close()
        self.stream.close()
        self.group.close()
        self.engine.close()
        for p in self.allocs:
            self.driver.free(p)


def run_threads(bodies, timeout=120):
    errors = {}

    def wrap(r, body):
        try:
            body()
        except BaseException as e:  # noqa: BLE001 - re-raised below with its rank
            errors[r] = e

    threads = [threading.Thread(target=wrap, args=(r, b)) for r, b in enumerate(bodies)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout)
        assert not t.is_alive(), "a rank did not finish"
    if errors:
        r, e = sorted(errors.items())[0]
        raise AssertionError(f"rank {r}: {e!r}") from e


def make(driver, cfg):
    ranks = [Rank(driver, r, cfg) for r in range(cfg.ranks)]
    infos = [r.group.local_info() for r in ranks]
    for r in ranks:
        r.group.connect(infos)
        r.start()
    return ranks


CFG = EpConfig(ranks=2, experts_per_rank=2, top_k=2, max_tokens=8, hidden=64, timeout=5.0)


def test_a_stream_carries_steps_exactly_and_the_compute_thread_only_queues(driver):
    cfg = CFG
    ranks = make(driver, cfg)
    steps = 3
    try:
        def body(rank):
            gate = threading.Event()
            # "A kernel still running": nothing queued after it runs until the gate opens, so a
            # GPU path that waited on the compute thread would never get past its first call.
            rank.stream.host_func(gate.wait)
            ins = [[oracle.inputs(7, s, r, cfg) for r in range(cfg.ranks)] for s in range(steps)]
            queued = [rank.queue_step(*ins[s][rank.rank]) for s in range(steps)]
            assert rank.gep.done.value == 0, "the proxy ran before the stream reached the request"
            gate.set()
            rank.stream.synchronize()
            rank.gep.check()
            for s, (h, y_ptr) in enumerate(queued):
                x, idx, w = ins[s][rank.rank]
                y = driver.download(y_ptr, (x.shape[0], cfg.hidden), np.float32)
                assert np.array_equal(y, oracle.expected_combine(x, idx, w, cfg)), f"step {s}"
                assert h.error is None
            assert rank.gep.done.value == 2 * steps
            assert list(driver.download(rank.gep.mask_ptr, (cfg.ranks,), np.int32)) == [1] * cfg.ranks

        run_threads([lambda r=r: body(r) for r in ranks])
    finally:
        for r in ranks:
            r.close()


def test_a_silent_rank_is_masked_and_the_stream_is_released(driver):
    cfg = EpConfig(ranks=2, experts_per_rank=2, top_k=2, max_tokens=8, hidden=64, timeout=0.5)
    ranks = make(driver, cfg)
    try:
        rank = ranks[0]
        x, idx, w = oracle.inputs(3, 0, 0, cfg)
        _h, y_ptr = rank.queue_step(x, idx, w)
        rank.stream.synchronize()  # rank 1 never queues: its deadlines end rank 0's waits
        rank.gep.check()
        y = driver.download(y_ptr, (x.shape[0], cfg.hidden), np.float32)
        assert np.array_equal(y, oracle.expected_combine(x, idx, w, cfg, active=[True, False]))
        assert list(driver.download(rank.gep.mask_ptr, (2,), np.int32)) == [1, 0]
    finally:
        for r in ranks:
            r.close()


def test_a_failed_request_releases_the_stream_and_raises_on_the_compute_thread(driver):
    cfg = EpConfig(ranks=2, experts_per_rank=2, top_k=2, max_tokens=8, hidden=64, timeout=0.5)
    ranks = make(driver, cfg)
    try:
        rank = ranks[0]
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
    finally:
        for r in ranks:
            r.close()


def test_a_gpu_counter_mirrors_arrivals_in_device_memory_and_a_stream_waits_on_it(driver):
    a, b = xfer.TransferEngine(MOCK), xfer.TransferEngine(MOCK)
    stream = driver.stream()
    try:
        counter = xfer.GpuCounter(0)
        assert counter.memory == "gdr" and counter.device_ptr is not None
        imm, n = 0x5A5A, 5
        b.mirror_imm_count(imm, counter)
        seen = threading.Event()
        stream.wait_value(counter.device_ptr, n)
        stream.host_func(seen.set)
        buf = np.zeros(64, dtype=np.uint8)
        mr = b.reg_mr(buf, access="write")
        src = np.arange(64, dtype=np.uint8)
        smr = a.reg_mr(src, access="local")
        for i in range(n):
            assert not seen.is_set(), f"the stream passed its wait after {i} arrivals"
            a.submit_single_write(smr, mr.desc, 64, imm=imm).wait(10)
        b.expect_imm_count(imm, n).wait(10)
        stream.synchronize()
        assert seen.is_set()
        assert int(driver.download(counter.device_ptr, (1,), np.uint64)[0]) == n == counter.value
    finally:
        stream.close()
        a.close()
        b.close()
