"""The GPU path of ``xfer.ep``: dispatch and combine ordered on a CUDA stream, driven by a host
proxy, with no CPU synchronisation on the compute thread.

The compute thread only *queues*: ``GpuEp.dispatch`` and ``GpuEp.combine`` put two memory
operations on its stream and return at once. At run time the stream

1. writes the request's number into a **watcher slot** (``alloc_uvm_watcher``; a stream
   write-value, so it lands after every kernel queued before it: the inputs are ready), which
   wakes the proxy;
2. waits (a stream wait-value) until a **GPU counter** (``xfer.GpuCounter``: device memory the
   host sets through GDRCopy, else device-mapped host memory) reaches that number.

The proxy (a thread of this object, never the compute thread) carries the request out on the
``EpGroup`` — the same protocol, deadlines and masks as the host path — and sets the counter,
whatever the outcome: a step that fails or masks a rank still releases the stream (a failed
request's outputs are zeros; ``check()`` raises its error on the compute thread later, outside
any graph). Only stream memory operations are queued; a captured graph could not be replayed
yet (each request's number is fixed when queued: docs/moe.md). The active mask is mirrored into device memory after every request
(``mask_ptr``, int32 per rank, 1 active), where a kernel reads it as DeepEP's mask buffer.

What is staged: with ``EpGroup(..., memory=DeviceMemory(driver))`` the regions are device
memory and the writes go GPU-direct, but the packing and unpacking are still the host's (the
proxy copies a request's inputs from the device, packs in a host shadow of the regions and
copies it over; likewise back): kernels that pack on the stream are not built (docs/moe.md,
"The GPU path"). ``CudaDriver`` calls the CUDA driver API through ctypes (``libcuda.so.1``), so the
same code runs against the project's fake driver (gpu-fakes/cuda.c, whose streams run their
operations later, on a thread of their own) and on a GPU.
"""

from __future__ import annotations

import ctypes
import threading
from dataclasses import dataclass

import numpy as np

from .. import _xfer
from .group import EpError, EpGroup

_WAIT_VALUE_GEQ = 0


class CudaError(RuntimeError):
    """A CUDA driver call failed."""


class CudaDriver:
    """The few driver calls the GPU path makes, on device ``device``'s primary context (made
    current on every thread that calls in)."""

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
        self.lib.cuMemcpyHtoD_v2.argtypes = [ctypes.c_uint64, ctypes.c_void_p, ctypes.c_size_t]
        self.lib.cuMemcpyDtoH_v2.argtypes = [ctypes.c_void_p, ctypes.c_uint64, ctypes.c_size_t]
        self.lib.cuMemFree_v2.argtypes = [ctypes.c_uint64]

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

    def upload(self, ptr: int, array: np.ndarray) -> None:
        a = np.ascontiguousarray(array)
        self.bind()
        self._check(self.lib.cuMemcpyHtoD_v2(ptr, a.ctypes.data, a.nbytes), "cuMemcpyHtoD_v2")

    def download(self, ptr: int, shape, dtype) -> np.ndarray:
        return self.download_into(ptr, np.empty(shape, dtype=dtype))

    def download_into(self, ptr: int, out: np.ndarray) -> np.ndarray:
        if not out.flags.c_contiguous:
            raise ValueError("download_into wants a contiguous array")
        self.bind()
        self._check(self.lib.cuMemcpyDtoH_v2(out.ctypes.data, ptr, out.nbytes), "cuMemcpyDtoH_v2")
        return out

    def copy(self, dst: int, src: int, nbytes: int) -> None:
        self.bind()
        self._check(self.lib.cuMemcpy(ctypes.c_uint64(dst), ctypes.c_uint64(src), ctypes.c_size_t(nbytes)), "cuMemcpy")

    def stream(self) -> "Stream":
        self.bind()
        handle = ctypes.c_void_p()
        self._check(self.lib.cuStreamCreate(ctypes.byref(handle), 0), "cuStreamCreate")
        return Stream(self, handle.value, owned=True)


class Stream:
    """A CUDA stream (``Stream(driver, torch.cuda.current_stream().cuda_stream)`` wraps one of
    torch's)."""

    _HOST_FN = ctypes.CFUNCTYPE(None, ctypes.c_void_p)

    def __init__(self, driver: CudaDriver, handle: int, *, owned: bool = False):
        self.driver, self.handle, self._owned = driver, handle, owned
        self._host_fns: dict[int, object] = {}
        self._host_fn_ids = 0
        self._host_lock = threading.Lock()

    def write_value(self, ptr: int, value: int) -> None:
        """Queues a store of ``value`` (u64) to ``ptr``."""
        self.driver._check(self.driver._write64(self.handle, ptr, value, 0), "cuStreamWriteValue64")

    def wait_value(self, ptr: int, value: int) -> None:
        """Queues a wait until the u64 at ``ptr`` is at least ``value``."""
        self.driver._check(self.driver._wait64(self.handle, ptr, value, _WAIT_VALUE_GEQ), "cuStreamWaitValue64")

    def host_func(self, fn) -> None:
        """Queues ``fn()`` (a host function in stream order; kept alive until it ran)."""
        with self._host_lock:
            key = self._host_fn_ids
            self._host_fn_ids += 1

        def run(_arg):
            try:
                fn()
            finally:
                with self._host_lock:
                    self._host_fns.pop(key, None)

        thunk = self._HOST_FN(run)
        with self._host_lock:
            self._host_fns[key] = thunk
        self.driver._check(self.driver.lib.cuLaunchHostFunc(ctypes.c_void_p(self.handle), thunk, None), "cuLaunchHostFunc")

    def synchronize(self) -> None:
        self.driver._check(self.driver.lib.cuStreamSynchronize(ctypes.c_void_p(self.handle)), "cuStreamSynchronize")

    def close(self) -> None:
        if self._owned and self.handle:
            self.driver.lib.cuStreamDestroy_v2(ctypes.c_void_p(self.handle))
            self.handle = 0


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
    int64 ``[experts_per_rank]``, one pair per buffer set (valid until the step two later)."""

    def __init__(self, group: EpGroup, driver: CudaDriver, stream: Stream):
        cfg = group.cfg
        if cfg.fp8 is not None:
            raise NotImplementedError("the GPU path carries the storage dtype; fp8 dispatch is host-only")
        self.group, self.driver, self.stream = group, driver, stream
        self._cv = threading.Condition()
        self._queued: list = []  # (request, action) in stream order
        self._reached = 0  # the highest request the stream has signalled
        self._next = 1
        self._dispatches = 0
        self._closing = False
        self.errors: list[tuple[int, BaseException]] = []
        self.slot = group.engine.alloc_uvm_watcher(self._on_signal)
        self.done = _xfer.GpuCounter(driver.device)
        if self.slot.device_ptr is None or self.done.device_ptr is None:
            raise CudaError("no GPU-visible memory for the watcher slot or the counter (no CUDA driver?)")
        rows = cfg.ranks * cfg.max_tokens
        self._recv_shape = (cfg.experts_per_rank, rows, cfg.hidden)
        recv_bytes = int(np.prod(self._recv_shape)) * cfg.storage.itemsize
        self._recv = [(driver.alloc(recv_bytes), driver.alloc(8 * cfg.experts_per_rank)) for _ in range(2)]
        self.mask_ptr = driver.alloc(4 * cfg.ranks)
        driver.upload(self.mask_ptr, group.query_active_mask())
        self._thread = threading.Thread(target=self._proxy, name=f"xfer-ep-gpu-{group.rank}", daemon=True)
        self._thread.start()

    # -- the compute thread: queue only ---------------------------------------------------------
    def _queue(self, action) -> int:
        with self._cv:
            request = self._next
            self._next += 1
            self._queued.append((request, action))
        self.stream.write_value(self.slot.device_ptr, request)
        self.stream.wait_value(self.done.device_ptr, request)
        return request

    def dispatch(self, x: int, topk_idx: int, num_tokens: int) -> GpuHandle:
        """Queues a dispatch of ``num_tokens`` tokens; returns at once."""
        cfg = self.group.cfg
        if not 0 <= num_tokens <= cfg.max_tokens:
            raise ValueError(f"num_tokens must be in 0..{cfg.max_tokens}")
        h = GpuHandle(request=0, recv_x=0, recv_count=0, num_tokens=num_tokens)
        # Queued dispatches alternate between two output sets, so two in flight (two-batch
        # overlap) never share one; on one stream, a dispatch's outputs are written only after
        # everything queued before it ran, so the set two dispatches back is free again.
        with self._cv:
            parity = self._dispatches % 2
            self._dispatches += 1
        h.recv_x, h.recv_count = self._recv[parity]
        h.request = self._queue(lambda: self._run_dispatch(h, x, topk_idx))
        return h

    def combine(self, h: GpuHandle, expert_out: int, topk_weights: int, y: int) -> None:
        """Queues the combine of ``h``'s step: ``y`` gets each token's weighted sum (fp32)."""
        self._queue(lambda: self._run_combine(h, expert_out, topk_weights, y))

    def check(self) -> None:
        """Raises the first error of a request that ran (call it where the compute thread may
        block, e.g. once per iteration)."""
        with self._cv:
            if self.errors:
                request, error = self.errors.pop(0)
                raise EpError(f"GPU request {request}: {error}") from error

    # -- the proxy -------------------------------------------------------------------------------
    def _on_signal(self, _old: int, new: int):
        with self._cv:
            self._reached = max(self._reached, new)
            self._cv.notify_all()
        return not self._closing

    def _proxy(self) -> None:
        self.driver.bind()
        while True:
            with self._cv:
                self._cv.wait_for(lambda: self._closing or (self._queued and self._queued[0][0] <= self._reached))
                if not (self._queued and self._queued[0][0] <= self._reached):
                    return
                request, action = self._queued.pop(0)
            try:
                action()
            except BaseException as e:  # noqa: BLE001 — reported by check(); the stream must go on
                with self._cv:
                    self.errors.append((request, e))
            finally:
                self.driver.upload(self.mask_ptr, self.group.query_active_mask())
                self.done.set(request)

    def _run_dispatch(self, h: GpuHandle, x: int, topk_idx: int) -> None:
        cfg = self.group.cfg
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
        if h.step is None or h.error is not None:
            self.driver.upload(y, np.zeros((h.num_tokens, cfg.hidden), dtype=np.float32))
            raise EpError(f"combine of a dispatch that failed: {h.error}")
        out = self.driver.download(expert_out, self._recv_shape, cfg.storage)
        weights = self.driver.download(topk_weights, (h.num_tokens, cfg.top_k), np.float32)
        try:
            self.group.combine_send(h.step, out)
            result = self.group.combine_recv(h.step, weights)
        except BaseException:
            self.driver.upload(y, np.zeros((h.num_tokens, cfg.hidden), dtype=np.float32))
            raise
        self.driver.upload(y, result)

    def close(self) -> None:
        """Stops the proxy once the queued requests ran (synchronize the stream first), frees
        the device buffers. The group stays open (the caller closes it)."""
        with self._cv:
            self._closing = True
            self._cv.notify_all()
        self._thread.join()
        self.slot.close()
        for recv_x, recv_count in self._recv:
            self.driver.free(recv_x)
            self.driver.free(recv_count)
        self.driver.free(self.mask_ptr)
