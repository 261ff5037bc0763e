"""``python -m xfer.ep.gpu_check``: xfer.ep's GPU path end to end on whatever CUDA driver
``libcuda.so.1`` is — a GPU (``cargo xtask gpu-check`` runs it) or the project's fake driver
(python/tests/test_ep_gpu.py uses the same ranks). Ranks are threads of this process, each with
its own engine (the in-process mock backend), group (its regions in device memory), stream and
proxy; inputs and outputs live in device memory; the expert is a host function queued on the stream (no kernels here), and
every result is checked against the oracle. Prints per-step times (queue to stream done) and
exits non-zero on a wrong byte."""

from __future__ import annotations

import argparse
import sys
import threading
import time

import numpy as np

from . import EpConfig, oracle
from .group import EpGroup
from .gpu import CudaDriver, DeviceMemory, GpuEp, StreamProxy

MOCK = {
    "backend": "mock",
    "groups": [{"nics": ["mock0"]}],
    "timeouts": {"expect_ms": 60000, "transfer_ms": 60000},
    "backends": {"mock": {"seed": 5, "reorder": True}},
}


class Rank:
    """One rank: its engine, group, stream and GPU path, and device memory it allocated."""

    def __init__(self, driver: CudaDriver, rank: int, cfg: EpConfig, *, device_regions: bool = True):
        import xfer

        self.driver, self.rank, self.cfg = driver, rank, cfg
        self.engine = xfer.TransferEngine(MOCK)
        memory = DeviceMemory(driver) if device_regions else None
        self.group = EpGroup(self.engine, rank, cfg, memory=memory)
        self.stream = driver.stream()
        self.gep: GpuEp | None = None
        self.experts: StreamProxy | None = None
        self.allocs: list[int] = []

    def start(self) -> None:
        self.gep = GpuEp(self.group, self.driver, self.stream)
        # The experts: host work in the stream's order (a host function may not call CUDA).
        self.experts = StreamProxy(self.engine, self.driver, self.stream, name=f"experts-{self.rank}")

    def device(self, array: np.ndarray) -> int:
        """Device memory that holds ``array`` once the stream got there (poison before: a
        proxy that ran before the stream reached its request would read that)."""
        ptr = self.empty(array.nbytes)
        self.stream.upload(ptr, array)
        return ptr

    def empty(self, nbytes: int) -> int:
        """Device memory, poisoned (0xA5) now."""
        ptr = self.driver.alloc(nbytes)
        self.allocs.append(ptr)
        self.driver.upload(ptr, np.full(nbytes, 0xA5, dtype=np.uint8))
        return ptr

    def queue_step(self, x: np.ndarray, idx: np.ndarray, w: np.ndarray, *, replay: bool = False):
        """Queues the inputs' copies, a dispatch, the oracle's experts (reading the dispatched
        rows from device memory, writing the outputs back, in the stream's order) and a
        combine; returns ``(handle, y_ptr)`` (with ``replay``, also the inputs' pointers:
        ``(handle, y_ptr, (x_ptr, idx_ptr, w_ptr))``)."""
        cfg, d = self.cfg, self.driver
        x_ptr, idx_ptr, w_ptr = self.device(x), self.device(idx.astype(np.int64)), self.device(w.astype(np.float32))
        h = self.gep.dispatch(x_ptr, idx_ptr, x.shape[0], replay=replay)
        shape = (cfg.experts_per_rank, cfg.ranks * cfg.max_tokens, cfg.hidden)
        out_ptr = self.empty(int(np.prod(shape)) * cfg.storage.itemsize)

        def expert():
            recv = d.download(h.recv_x, shape, cfg.storage)
            count = d.download(h.recv_count, (cfg.experts_per_rank,), np.int64)
            d.upload(out_ptr, oracle.run_experts_deepep(recv, count, self.rank, cfg))

        self.experts.queue(expert, replay=replay)
        y_ptr = self.empty(x.shape[0] * cfg.hidden * 4)
        self.gep.combine(h, out_ptr, w_ptr, y_ptr, replay=replay)
        return (h, y_ptr, (x_ptr, idx_ptr, w_ptr)) if replay else (h, y_ptr)

    def close(self) -> None:
        if self.gep is not None:
            self.gep.close()
        if self.experts is not None:
            self.experts.close(10.0)
            self.experts.check()
        self.stream.close()
        self.group.close()
        self.engine.close()
        for p in self.allocs:
            self.driver.free(p)
        self.allocs.clear()


def make_ranks(driver: CudaDriver, cfg: EpConfig, *, device_regions: bool = True) -> list[Rank]:
    """``cfg.ranks`` connected ranks with their GPU paths started (regions in device memory
    unless ``device_regions=False``)."""
    ranks = [Rank(driver, r, cfg, device_regions=device_regions) for r in range(cfg.ranks)]
    infos = [r.group.local_info() for r in ranks]
    for r in ranks:
        r.group.connect(infos)
        r.start()
    return ranks


def run_threads(bodies, timeout: float = 120.0) -> None:
    """Each body on its own thread; raises the first failure, with its index."""
    errors: dict[int, BaseException] = {}

    def wrap(i, body):
        try:
            body()
        except BaseException as e:  # noqa: BLE001 - re-raised below with its rank
            errors[i] = e

    threads = [threading.Thread(target=wrap, args=(i, b)) for i, b in enumerate(bodies)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout)
        if t.is_alive():
            raise AssertionError("a rank did not finish")
    if errors:
        i, e = sorted(errors.items())[0]
        raise AssertionError(f"rank {i}: {e!r}") from e


def check_steps(driver: CudaDriver, ranks: list[Rank], steps: int, seed: int = 7) -> list[list[float]]:
    """Every rank queues ``steps`` steps behind a gate (a host function that holds its stream:
    a GPU path that waited on the compute thread would never get past its first call), opens
    it, and checks each step's output against the oracle. Returns each rank's per-step times in
    seconds from the gate opening to that step's output."""
    cfg = ranks[0].cfg
    times: list[list[float]] = [[] for _ in ranks]

    def body(rank: Rank):
        gate = threading.Event()
        rank.stream.host_func(gate.wait)
        try:
            run(rank, gate)
        finally:
            gate.set()  # never leave a stream held by the gate

    def run(rank: Rank, gate: threading.Event):
        ins = [[oracle.inputs(seed, s, r, cfg) for r in range(cfg.ranks)] for s in range(steps)]
        marks: list[float] = []
        queued = []
        for s in range(steps):
            queued.append(rank.queue_step(*ins[s][rank.rank]))
            rank.stream.host_func(lambda: marks.append(time.perf_counter()))
        if rank.gep.done.value != 0:
            raise AssertionError("the proxy ran before the stream reached the request")
        opened = time.perf_counter()
        gate.set()
        rank.stream.synchronize()
        rank.gep.check()
        rank.experts.check()
        if rank.stream.errors:
            raise AssertionError(f"a host function raised: {rank.stream.errors[0]!r}")
        for s, (h, y_ptr) in enumerate(queued):
            x, idx, w = ins[s][rank.rank]
            y = driver.download(y_ptr, (x.shape[0], cfg.hidden), np.float32)
            if h.error is not None or not np.array_equal(y, oracle.expected_combine(x, idx, w, cfg)):
                raise AssertionError(f"step {s}: wrong output ({h.error})")
        if rank.gep.done.value != 2 * steps:
            raise AssertionError(f"the counter says {rank.gep.done.value}, not {2 * steps}")
        mask = driver.download(rank.gep.mask_ptr, (cfg.ranks,), np.int32)
        if list(mask) != [1] * cfg.ranks:
            raise AssertionError(f"mask {list(mask)}")
        times[rank.rank] = [m - opened for m in marks]

    run_threads([lambda r=r: body(r) for r in ranks])
    return times


def check_replays(driver: CudaDriver, ranks: list[Rank], replays: int, seed: int = 61) -> None:
    """Every rank queues one step with ``replay=True`` (dispatch, experts, combine), then
    replays it ``replays`` times as a CUDA graph replays what it captured — the same stream
    operations again (queued again here: no capture is needed for the check), new inputs
    copied into the same input buffers first — and checks every run's output against the
    oracle."""
    cfg = ranks[0].cfg

    def body(rank: Rank):
        ins = [[oracle.inputs(seed, n, r, cfg) for r in range(cfg.ranks)] for n in range(replays + 1)]
        _h, y_ptr, (x_ptr, idx_ptr, w_ptr) = rank.queue_step(*ins[0][rank.rank], replay=True)
        # What the graph holds, in order: the dispatch, the experts, the combine.
        graph = [(rank.gep.proxy, 0), (rank.experts, 0), (rank.gep.proxy, 1)]
        for n in range(replays + 1):
            x, idx, w = ins[n][rank.rank]
            if n > 0:
                rank.stream.upload(x_ptr, x)
                rank.stream.upload(idx_ptr, idx.astype(np.int64))
                rank.stream.upload(w_ptr, w.astype(np.float32))
                for proxy, index in graph:
                    proxy._replay_operations(index)
            if not rank.stream.reached(60):
                raise AssertionError(f"run {n} of the graph did not finish")
            y = driver.download(y_ptr, (x.shape[0], cfg.hidden), np.float32)
            if not np.array_equal(y, oracle.expected_combine(x, idx, w, cfg)):
                raise AssertionError(f"run {n} of the graph: wrong output")
        rank.gep.check()
        rank.experts.check()

    run_threads([lambda r=r: body(r) for r in ranks])


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--ranks", type=int, default=2)
    p.add_argument("--steps", type=int, default=20)
    p.add_argument("--tokens", type=int, default=128)
    p.add_argument("--hidden", type=int, default=7168)
    p.add_argument("--experts-per-rank", type=int, default=4)
    p.add_argument("--top-k", type=int, default=8)
    a = p.parse_args(argv)
    cfg = EpConfig(ranks=a.ranks, experts_per_rank=a.experts_per_rank, top_k=min(a.top_k, a.ranks * a.experts_per_rank),
                   max_tokens=a.tokens, hidden=a.hidden, timeout=10.0)
    driver = CudaDriver(0)
    import xfer

    counter = xfer.GpuCounter(0)
    print(f"GPU counter memory: {counter.memory}")
    ranks = make_ranks(driver, cfg)
    try:
        times = check_steps(driver, ranks, a.steps)
        check_replays(driver, ranks, 5)
    except AssertionError as e:
        print(f"EP GPU check FAILED: {e}")
        return 1
    finally:
        for r in ranks:
            r.close()
    # The k-th step is done at marks[k]; its own time is the gap since the step before.
    per_step = np.diff([0.0] + times[0]) * 1e6
    print(f"EP GPU check passed: {a.ranks} ranks, {a.steps} steps and a step replayed 5 times exact; rank 0 per step (stream): "
          f"p50 {np.percentile(per_step, 50):.0f} µs, p99 {np.percentile(per_step, 99):.0f} µs "
          f"(regions in device memory, packed by the host proxy; ranks are threads on the mock)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
