"""The GPU path of ``xfer.ep``: dispatch and combine ordered on a CUDA stream, driven by a host
proxy, with no CPU synchronisation on the compute thread.

The compute thread only *queues*: ``GpuEp.dispatch`` and ``GpuEp.combine`` put two memory
operations on its stream and return at once. At run time the stream

1. writes the request's number into a **watcher slot** (``alloc_uvm_watcher``; a stream
   write-value, so it lands after every kernel queued before it: the inputs are ready), which
   wakes the proxy;
2. waits (a stream wait-value) until a **GPU counter** (``xfer.GpuCounter``: device memory the
   host sets through GDRCopy, else device-mapped host memory) reaches that number.

The proxy (``StreamProxy``: a thread, never the compute thread) carries the request out on the
``EpGroup`` — the same protocol, deadlines and masks as the host path — and sets the counter,
whatever the outcome: a step that fails or masks a rank still releases the stream (a failed
dispatch hands the experts no rows and its combine zeros; ``check()`` raises the error on the
compute thread later). Only stream memory operations are queued; requests queued with
``replay=True`` may be captured in a CUDA graph and replayed (``StreamProxy``). The active mask
is mirrored into device memory before the counter is set (``mask_ptr``, int32 per rank, 1
active), where a kernel reads it as DeepEP's mask buffer.

The proxy's copies go on a non-blocking stream of the driver's own and are waited for there:
never on the legacy default stream, which would wait for a blocking compute stream that waits
for the proxy; and a copy from pageable memory is done only when its stream says so. The
compute stream must be a created one: the default streams are refused.

What is staged: with ``EpGroup(..., memory=DeviceMemory(driver))`` the regions are device
memory and the writes go GPU-direct, but the packing and unpacking are still the host's (the
proxy copies a request's inputs from the device, packs in a host shadow of the regions and
copies it over; likewise back): kernels that pack on the stream are not built (docs/moe.md,
"The GPU path"). ``CudaDriver`` calls the CUDA driver API through ctypes (``libcuda.so.1``), so
the same code runs against the project's fake driver (gpu-fakes/cuda.c, whose streams run their
operations later, on a thread of their own) and on a GPU.
"""

from __future__ import annotations

import ctypes
import threading
import time
from dataclasses import dataclass

import numpy as np

from .. import _xfer
from .group import EpError, EpGroup

_WAIT_VALUE_GEQ = 0  # CU_STREAM_WAIT_VALUE_GEQ
_WAIT_VALUE_EQ = 1  # CU_STREAM_WAIT_VALUE_EQ
_STREAM_NON_BLOCKING = 1  # CU_STREAM_NON_BLOCKING
_LEGACY_STREAM, _PER_THREAD_STREAM = 0, 2  # CU_STREAM_LEGACY, CU_STREAM_PER_THREAD
# A replayable request's ticket: the top bit, a sequence number, the request's index.
_TICKET = 1 << 63
_TICKET_INDEX = 1 << 16


def _ticket(seq: int, index: int) -> int:
    return _TICKET | ((seq % (1 << 46)) * _TICKET_INDEX) | index


class CudaError(RuntimeError):
    """A CUDA driver call failed."""


class CudaDriver:
    """The few driver calls the GPU path makes, on device ``device``'s primary context (made
    current on every thread that calls in). Its copies run on a non-blocking stream of its own
    and return when they are done."""

    def __init__(self, device: int = 0, library: str = "libcuda.so.1"):
        self.lib = ctypes.CDLL(library)
        self._check(self.lib.cuInit(0), "cuInit")
        dev = ctypes.c_int()
        self._check(self.lib.cuDeviceGet(ctypes.byref(dev), device), "cuDeviceGet")
        self.context = ctypes.c_void_p()
        self._check(self.lib.cuDevicePrimaryCtxRetain(ctypes.byref(self.context), dev), "cuDevicePrimaryCtxRetain")
        self.device = device
        # CUDA 12 names the stream memory operations with a _v2 suffix; older drivers without.
        self._write64 = getattr(self.lib, "cuStreamWriteValue64_v2", None) or self.lib.cuStreamWriteValue64
        self._wait64 = getattr(self.lib, "cuStreamWaitValue64_v2", None) or self.lib.cuStreamWaitValue64
        for f in (self._write64, self._wait64):
            f.argtypes = [ctypes.c_void_p, ctypes.c_uint64, ctypes.c_uint64, ctypes.c_uint]
        self.lib.cuMemcpyHtoDAsync_v2.argtypes = [ctypes.c_uint64, ctypes.c_void_p, ctypes.c_size_t, ctypes.c_void_p]
        self.lib.cuMemcpyDtoHAsync_v2.argtypes = [ctypes.c_void_p, ctypes.c_uint64, ctypes.c_size_t, ctypes.c_void_p]
        self.lib.cuMemcpyAsync.argtypes = [ctypes.c_uint64, ctypes.c_uint64, ctypes.c_size_t, ctypes.c_void_p]
        self.lib.cuMemFree_v2.argtypes = [ctypes.c_uint64]
        self._copies = self.stream()
        self._copy_lock = threading.Lock()

    @staticmethod
    def _check(result: int, call: str) -> None:
        if result != 0:
            raise CudaError(f"{call} failed: CUDA error {result}")

    def bind(self) -> None:
        """Makes the context current on the calling thread."""
        self._check(self.lib.cuCtxSetCurrent(self.context), "cuCtxSetCurrent")

    def alloc(self, nbytes: int) -> int:
        self.bind()
        ptr = ctypes.c_uint64()
        self._check(self.lib.cuMemAlloc_v2(ctypes.byref(ptr), ctypes.c_size_t(max(nbytes, 1))), "cuMemAlloc_v2")
        return ptr.value

    def free(self, ptr: int) -> None:
        self.bind()
        self._check(self.lib.cuMemFree_v2(ptr), "cuMemFree_v2")

    def _copy(self, call: str, *args) -> None:
        with self._copy_lock:
            self.bind()
            self._check(getattr(self.lib, call)(*args, self._copies.handle), call)
            self._copies.synchronize()

    def upload(self, ptr: int, array: np.ndarray) -> None:
        a = np.ascontiguousarray(array)
        self._copy("cuMemcpyHtoDAsync_v2", ptr, a.ctypes.data, a.nbytes)

    def download(self, ptr: int, shape, dtype) -> np.ndarray:
        return self.download_into(ptr, np.empty(shape, dtype=dtype))

    def download_into(self, ptr: int, out: np.ndarray) -> np.ndarray:
        if not out.flags.c_contiguous:
            raise ValueError("download_into wants a contiguous array")
        self._copy("cuMemcpyDtoHAsync_v2", out.ctypes.data, ptr, out.nbytes)
        return out

    def copy(self, dst: int, src: int, nbytes: int) -> None:
        self._copy("cuMemcpyAsync", dst, src, nbytes)

    def stream(self) -> "Stream":
        """A new non-blocking stream."""
        self.bind()
        handle = ctypes.c_void_p()
        self._check(self.lib.cuStreamCreate(ctypes.byref(handle), _STREAM_NON_BLOCKING), "cuStreamCreate")
        return Stream(self, handle.value, owned=True)


class Stream:
    """A CUDA stream: one of this driver's, or ``Stream(driver, torch.cuda.Stream().cuda_stream)``
    (a created stream; the legacy default stream is refused: module docs)."""

    _HOST_FN = ctypes.CFUNCTYPE(None, ctypes.c_void_p)

    def __init__(self, driver: CudaDriver, handle: int, *, owned: bool = False):
        if handle in (_LEGACY_STREAM, _PER_THREAD_STREAM):
            raise ValueError("the GPU path needs a created stream, not a default stream (use torch.cuda.Stream())")
        self.driver, self.handle, self._owned = driver, handle, owned
        # Host functions queued and not yet known to have returned (their ctypes thunks must
        # outlive their run), and what they raised.
        self._thunks: list = []
        self._ran = 0
        self.errors: list[BaseException] = []
        self._host_lock = threading.Lock()

    def write_value(self, ptr: int, value: int) -> None:
        """Queues a store of ``value`` (u64) to ``ptr``."""
        self.driver._check(self.driver._write64(self.handle, ptr, value, 0), "cuStreamWriteValue64")

    def wait_value(self, ptr: int, value: int, *, equal: bool = False) -> None:
        """Queues a wait until the u64 at ``ptr`` is at least ``value`` (``equal``: is it)."""
        flags = _WAIT_VALUE_EQ if equal else _WAIT_VALUE_GEQ
        self.driver._check(self.driver._wait64(self.handle, ptr, value, flags), "cuStreamWaitValue64")

    def host_func(self, fn) -> None:
        """Queues ``fn()``, a host function in stream order. CUDA forbids it any CUDA call;
        what it raises is kept in ``errors``."""

        def run(_arg):
            try:
                fn()
            except BaseException as e:  # noqa: BLE001 - kept: nothing above a host function sees it
                self.errors.append(e)
            with self._host_lock:
                self._ran += 1

        thunk = self._HOST_FN(run)
        with self._host_lock:
            # Thunks run in order; those that returned are dropped here, never from inside
            # their own run — except the last one counted, which may still be returning.
            finished = max(0, self._ran - 1)
            del self._thunks[:finished]
            self._ran -= finished
            self._thunks.append(thunk)
        self.driver._check(self.driver.lib.cuLaunchHostFunc(ctypes.c_void_p(self.handle), thunk, None), "cuLaunchHostFunc")

    def copy(self, dst: int, src: int, nbytes: int) -> None:
        """Queues a copy between device-visible addresses."""
        self.driver._check(
            self.driver.lib.cuMemcpyAsync(dst, src, nbytes, ctypes.c_void_p(self.handle)), "cuMemcpyAsync"
        )

    def upload(self, ptr: int, array: np.ndarray) -> None:
        """Queues a copy of ``array`` (kept alive until the stream passed it) to ``ptr``."""
        a = np.ascontiguousarray(array)
        self.driver._check(
            self.driver.lib.cuMemcpyHtoDAsync_v2(ptr, a.ctypes.data, a.nbytes, ctypes.c_void_p(self.handle)),
            "cuMemcpyHtoDAsync_v2",
        )
        self.host_func(lambda: a)  # holds `a` until the copy ran

    def reached(self, timeout: float) -> bool:
        """Queues a marker and waits up to ``timeout`` for the stream to reach it (everything
        queued before it done)."""
        marker = threading.Event()
        self.host_func(marker.set)
        return marker.wait(timeout)

    def synchronize(self) -> None:
        self.driver._check(self.driver.lib.cuStreamSynchronize(ctypes.c_void_p(self.handle)), "cuStreamSynchronize")

    def close(self) -> None:
        if self._owned and self.handle:
            self.driver.lib.cuStreamDestroy_v2(ctypes.c_void_p(self.handle))
            self.handle = 0


class StreamProxy:
    """Host work in a stream's order, without the stream's host functions (which may not call
    CUDA): ``queue(action)`` puts a write-value of the request's number into a watcher slot
    and a wait-value on a ``GpuCounter`` on the stream; a thread of this object runs
    ``action()`` when the stream reaches the write, then sets the counter to that number —
    whatever ``action`` did, so the stream always goes on. What an action raises is kept for
    ``check()``.

    ``queue(action, replay=True)`` makes a request a CUDA graph may replay, whose operations
    are fixed when captured: the stream clears the request's own done flag, copies the
    request's *ticket* (a word the proxy changes after every run, so the slot changes at every
    replay) into the slot, and waits for the flag; the proxy runs the kept action for that
    ticket, writes the next ticket, then sets the flag. Replayed requests are not released by
    ``close`` (synchronize first)."""

    def __init__(self, engine, driver: CudaDriver, stream: Stream, *, name: str = "xfer-stream-proxy", after=None):
        self.driver, self.stream, self._after = driver, stream, after
        self._cv = threading.Condition()
        self._queued: list = []  # (request, action) in stream order, each run once first
        # Requests a graph may replay: request -> (action, ticket, done flag), by index.
        self._replays: dict = {}
        self._signals: list[int] = []  # request numbers the stream wrote, in order
        self._next = 1
        self._closing = False
        self._drained = False
        self.errors: list[tuple[int, BaseException]] = []
        self.done = _xfer.GpuCounter(driver.device)
        self.slot = engine.alloc_uvm_watcher(self._on_signal)
        if self.slot.device_ptr is None or self.done.device_ptr is None:
            self.slot.close()
            raise CudaError("no GPU-visible memory for the watcher slot or the counter (no CUDA driver?)")
        self._thread = threading.Thread(target=self._run, name=name, daemon=True)
        self._thread.start()

    def queue(self, action, *, replay: bool = False) -> int:
        """Queues ``action``; returns its request number."""
        with self._cv:
            if self._closing:
                raise RuntimeError("the proxy is closed")
            request = self._next
            self._next += 1
            if replay:
                if len(self._replays) >= _TICKET_INDEX:
                    raise ValueError(f"at most {_TICKET_INDEX} replayable requests per proxy")
                index = len(self._replays)
                ticket, flag = _xfer.GpuCounter(self.driver.device), _xfer.GpuCounter(self.driver.device)
                ticket.set(_ticket(1, index))
                self._replays[index] = (request, action, ticket, flag)
                self._replay_operations(index)
                return request
            # Both operations under the lock: the stream sees the requests in number order.
            self.stream.write_value(self.slot.device_ptr, request)
            self.stream.wait_value(self.done.device_ptr, request)
            self._queued.append((request, action))
        return request

    def _replay_operations(self, index: int) -> None:
        """Queues replayable request ``index``'s operations — what a graph capturing them
        holds (the tests queue them again to replay, having no capture)."""
        _request, _action, ticket, flag = self._replays[index]
        self.stream.write_value(flag.device_ptr, 0)
        self.stream.copy(self.slot.device_ptr, ticket.device_ptr, 8)
        self.stream.wait_value(flag.device_ptr, 1, equal=True)

    def check(self) -> None:
        """Raises the first error of a request that ran."""
        with self._cv:
            if self.errors:
                request, error = self.errors.pop(0)
                raise EpError(f"GPU request {request}: {error}") from error

    def _on_signal(self, _old: int, new: int):
        # Every request the stream reaches is a change of the slot: the stream writes the next
        # number only once the counter says this one ran.
        with self._cv:
            self._signals.append(new)
            self._cv.notify_all()

    def _next_work(self):
        """``(request, action, release)`` of the oldest signal, if any (under the lock)."""
        while self._signals:
            value = self._signals.pop(0)
            if value & _TICKET:
                entry = self._replays.get(value & (_TICKET_INDEX - 1))
                if entry is None or entry[2].value != value:
                    continue  # not a ticket this proxy issued now
                request, action, ticket, flag = entry
                seq = (value & ~_TICKET) // _TICKET_INDEX

                def release(ticket=ticket, flag=flag, index=value & (_TICKET_INDEX - 1), seq=seq):
                    ticket.set(_ticket(seq + 1, index))  # before the flag: the next replay copies it
                    flag.set(1)

                return request, action, release
            if self._queued and self._queued[0][0] == value:
                request, action = self._queued.pop(0)
                return request, action, lambda request=request: self.done.set(request)
        return None

    def _run(self) -> None:
        self.driver.bind()
        while True:
            with self._cv:
                self._cv.wait_for(lambda: self._closing or self._signals)
                work = self._next_work()
                if work is None:
                    if self._closing:
                        return
                    continue
                request, action, release = work
            try:
                for work in (action, self._after):
                    try:
                        if work is not None:
                            work()
                    except BaseException as e:  # noqa: BLE001 — reported by check()
                        with self._cv:
                            self.errors.append((request, e))
            finally:
                release()  # whatever happened: the stream must go on

    def close(self, timeout: float) -> bool:
        """Runs what the stream reaches within ``timeout``, fails the rest (the stream is
        released all the same: the counter is set past every request), and frees the slot once
        the stream is past its last use. Returns whether it got there in time (else the slot
        is kept: the stream may still write it). Idempotent."""
        deadline = time.monotonic() + timeout
        with self._cv:
            if self._closing:
                return self._drained
            self._cv.wait_for(lambda: not self._queued, timeout=max(0.0, deadline - time.monotonic()))
            self._closing = True
            for request, _action in self._queued:
                self.errors.append((request, RuntimeError("closed before the stream reached it")))
            self._queued.clear()
            self._cv.notify_all()
        self._thread.join()
        self.done.set(self._next - 1)
        # The stream may still write the slot: it goes back to the engine's pool only once the
        # stream is past it.
        self._drained = self.stream.reached(max(0.0, deadline - time.monotonic()))
        if self._drained:
            self.slot.close()
        return self._drained


class DeviceMemory:
    """An ``EpGroup``'s regions in device memory (``EpGroup(..., memory=DeviceMemory(driver))``):
    registered as CUDA memory, so peers' writes land there and this rank's are read from there
    (GPU-direct where the backend is). The host stages reach them through a host shadow and the
    driver's copies — the stand-in for the pack/unpack kernels (docs/moe.md, "The GPU path")."""

    def __init__(self, driver: CudaDriver):
        self.driver = driver
        self.ptrs: dict[str, int] = {}

    def register(self, engine, name: str, nbytes: int, access: str):
        shadow = np.full(nbytes, 0xA5, dtype=np.uint8)
        ptr = self.driver.alloc(nbytes)
        try:
            self.driver.upload(ptr, shadow)  # poisoned, as host regions are
            mr = engine.reg_mr_raw(ptr, nbytes, device=f"cuda:{self.driver.device}", access=access)
        except BaseException:
            self.driver.free(ptr)
            raise
        self.ptrs[name] = ptr
        return shadow, mr

    def fetch(self, regions: dict, name: str, lo: int, hi: int) -> None:
        self.driver.download_into(self.ptrs[name] + lo, regions[name][lo:hi])

    def publish(self, regions: dict, name: str, lo: int, hi: int) -> None:
        self.driver.upload(self.ptrs[name] + lo, regions[name][lo:hi])

    def copy(self, regions: dict, dst: str, dst_off: int, src: str, src_off: int, n: int) -> None:
        self.driver.copy(self.ptrs[dst] + dst_off, self.ptrs[src] + src_off, n)

    def release(self, engine, name: str, mr) -> None:
        engine.dereg_mr(mr)
        self.driver.free(self.ptrs.pop(name))


@dataclass
class GpuHandle:
    """A queued dispatch: where its outputs will be (device pointers, valid once the stream
    passed the dispatch), and, once the proxy ran it, the host-side ``Handle`` and any error."""

    request: int
    recv_x: int
    recv_count: int
    num_tokens: int
    step: object = None
    error: BaseException | None = None


class GpuEp:
    """``EpGroup``'s dispatch and combine on a CUDA stream (module docs). ``group`` is connected;
    ``x``, ``topk_idx``, the expert outputs, ``topk_weights`` and ``y`` are device pointers of
    the group's dtypes (``x``: ``[tokens, hidden]`` storage dtype; ``topk_idx``: int64
    ``[tokens, top_k]``; ``topk_weights``: float32; ``y``: float32 ``[tokens, hidden]``). The
    DeepEP layout: ``recv_x`` ``[experts_per_rank, ranks × max_tokens, hidden]``, ``recv_count``
    int64 ``[experts_per_rank]``, one pair per buffer set (valid until the dispatch two later)."""

    def __init__(self, group: EpGroup, driver: CudaDriver, stream: Stream):
        cfg = group.cfg
        if cfg.fp8 is not None:
            raise NotImplementedError("the GPU path carries the storage dtype; fp8 dispatch is host-only")
        self.group, self.driver, self.stream = group, driver, stream
        rows = cfg.ranks * cfg.max_tokens
        self._recv_shape = (cfg.experts_per_rank, rows, cfg.hidden)
        recv_bytes = int(np.prod(self._recv_shape)) * cfg.storage.itemsize
        self._allocs: list[int] = []
        try:
            self._recv = [(self._alloc(recv_bytes), self._alloc(8 * cfg.experts_per_rank)) for _ in range(2)]
            self.mask_ptr = self._alloc(4 * cfg.ranks)
            driver.upload(self.mask_ptr, group.query_active_mask())
            self.proxy = StreamProxy(group.engine, driver, stream, name=f"xfer-ep-gpu-{group.rank}", after=self._mirror_mask)
        except BaseException:
            for p in self._allocs:
                driver.free(p)
            raise
        self._dispatches = 0

    def _alloc(self, nbytes: int) -> int:
        ptr = self.driver.alloc(nbytes)
        self._allocs.append(ptr)
        return ptr

    @property
    def done(self):
        """The counter the stream waits on (the last request the proxy finished)."""
        return self.proxy.done

    def _mirror_mask(self) -> None:
        self.driver.upload(self.mask_ptr, self.group.query_active_mask())

    # -- the compute thread: queue only ---------------------------------------------------------
    def dispatch(self, x: int, topk_idx: int, num_tokens: int, *, replay: bool = False) -> GpuHandle:
        """Queues a dispatch of ``num_tokens`` tokens; returns at once. ``replay``: a CUDA graph
        may replay it (``StreamProxy``): each replay dispatches what ``x`` and ``topk_idx`` then
        hold into the same outputs."""
        cfg = self.group.cfg
        if not 0 <= num_tokens <= cfg.max_tokens:
            raise ValueError(f"num_tokens must be in 0..{cfg.max_tokens}")
        h = GpuHandle(request=0, recv_x=0, recv_count=0, num_tokens=num_tokens)
        # Queued dispatches alternate between two output sets, so two in flight (two-batch
        # overlap) never share one; on one stream, a dispatch's outputs are written only after
        # everything queued before it ran, so the set two dispatches back is free again.
        h.recv_x, h.recv_count = self._recv[self._dispatches % 2]
        self._dispatches += 1
        h.request = self.proxy.queue(lambda: self._run_dispatch(h, x, topk_idx), replay=replay)
        return h

    def combine(self, h: GpuHandle, expert_out: int, topk_weights: int, y: int, *, replay: bool = False) -> None:
        """Queues the combine of ``h``'s step: ``y`` gets each token's weighted sum (fp32)."""
        self.proxy.queue(lambda: self._run_combine(h, expert_out, topk_weights, y), replay=replay)

    def check(self) -> None:
        """Raises the first error of a request that ran (call it where the compute thread may
        block, e.g. once per iteration)."""
        self.proxy.check()

    # -- the proxy's work ------------------------------------------------------------------------
    def _run_dispatch(self, h: GpuHandle, x: int, topk_idx: int) -> None:
        cfg = self.group.cfg
        h.step, h.error = None, None  # a replay starts afresh
        try:
            xs = self.driver.download(x, (h.num_tokens, cfg.hidden), cfg.storage)
            idx = self.driver.download(topk_idx, (h.num_tokens, cfg.top_k), np.int64)
            h.step = self.group.dispatch_send(xs, idx)
            recv_x, recv_count = self.group.dispatch_recv(h.step)
        except BaseException as e:
            h.error = e
            self.driver.upload(h.recv_count, np.zeros(cfg.experts_per_rank, dtype=np.int64))
            raise
        self.driver.upload(h.recv_x, recv_x)
        self.driver.upload(h.recv_count, recv_count.astype(np.int64))

    def _run_combine(self, h: GpuHandle, expert_out: int, topk_weights: int, y: int) -> None:
        cfg = self.group.cfg
        zeros = np.zeros((h.num_tokens, cfg.hidden), dtype=np.float32)
        if h.step is None or h.error is not None:
            self.driver.upload(y, zeros)
            raise EpError(f"combine of a dispatch that failed: {h.error}")
        try:
            out = self.driver.download(expert_out, self._recv_shape, cfg.storage)
            weights = self.driver.download(topk_weights, (h.num_tokens, cfg.top_k), np.float32)
            self.group.combine_send(h.step, out)
            result = self.group.combine_recv(h.step, weights)
        except BaseException:
            self.driver.upload(y, zeros)
            raise
        self.driver.upload(y, result)

    def close(self, timeout: float = 10.0) -> None:
        """Runs what the stream reaches within ``timeout`` and releases the rest (module docs),
        then frees the device buffers once the stream is idle. The group stays open (the caller
        closes it). Idempotent."""
        if self.proxy.close(timeout):
            for p in self._allocs:
                self.driver.free(p)
            self._allocs.clear()
