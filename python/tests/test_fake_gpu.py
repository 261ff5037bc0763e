"""A "CUDA" DLPack tensor registered and written end to end, against the fake CUDA driver
(gpu-fakes/cuda.c). Run by `cargo xtask gpu-fakes`-built libraries on LD_LIBRARY_PATH (as
`cargo xtask test` does); skipped elsewhere. The tensor's memory is the fake driver's device
memory, which the CPU cannot touch: the engine must check it with the driver and move it
with the driver's copies."""

import ctypes
import os

import numpy as np
import pytest

import xfer
from conftest import MOCK

FAKES = os.environ.get("XFER_GPU_FAKES")
pytestmark = pytest.mark.skipif(
    not FAKES, reason="needs the GPU fakes on LD_LIBRARY_PATH ($XFER_GPU_FAKES): cargo xtask test"
)

DL_CUDA = 2


class DLDevice(ctypes.Structure):
    _fields_ = [("device_type", ctypes.c_int32), ("device_id", ctypes.c_int32)]


class DLDataType(ctypes.Structure):
    _fields_ = [("code", ctypes.c_uint8), ("bits", ctypes.c_uint8), ("lanes", ctypes.c_uint16)]


class DLTensor(ctypes.Structure):
    _fields_ = [
        ("data", ctypes.c_void_p),
        ("device", DLDevice),
        ("ndim", ctypes.c_int32),
        ("dtype", DLDataType),
        ("shape", ctypes.POINTER(ctypes.c_int64)),
        ("strides", ctypes.POINTER(ctypes.c_int64)),
        ("byte_offset", ctypes.c_uint64),
    ]


class DLManagedTensor(ctypes.Structure):
    _fields_ = [("dl_tensor", DLTensor), ("manager_ctx", ctypes.c_void_p), ("deleter", ctypes.c_void_p)]


_new_capsule = ctypes.pythonapi.PyCapsule_New
_new_capsule.restype = ctypes.py_object
_new_capsule.argtypes = [ctypes.c_void_p, ctypes.c_char_p, ctypes.c_void_p]


class Driver:
    """The fake driver, called as a CUDA program would (ctypes), in the engine's process."""

    def __init__(self):
        self.lib = ctypes.CDLL(os.path.join(FAKES, "libcuda.so.1"))
        assert self.lib.cuInit(0) == 0
        self.context = ctypes.c_void_p()
        assert self.lib.cuDevicePrimaryCtxRetain(ctypes.byref(self.context), 0) == 0
        assert self.lib.cuCtxSetCurrent(self.context) == 0

    def alloc(self, n):
        ptr = ctypes.c_uint64()
        assert self.lib.cuMemAlloc_v2(ctypes.byref(ptr), ctypes.c_size_t(n)) == 0
        return ptr.value

    def upload(self, ptr, data: bytes):
        assert self.lib.cuMemcpyHtoD_v2(ctypes.c_uint64(ptr), data, ctypes.c_size_t(len(data))) == 0

    def download(self, ptr, n) -> bytes:
        out = ctypes.create_string_buffer(n)
        assert self.lib.cuMemcpyDtoH_v2(out, ctypes.c_uint64(ptr), ctypes.c_size_t(n)) == 0
        return out.raw

    def free(self, ptr):
        assert self.lib.cuMemFree_v2(ctypes.c_uint64(ptr)) == 0

    def live(self):
        return self.lib.xfer_fake_cuda_live()


class CudaTensor:
    """A 1-D uint8 tensor in (fake) device memory that exports DLPack as torch.cuda would."""

    def __init__(self, ptr, n, device=0):
        self.ptr, self.n, self.device = ptr, n, device
        self._shape = (ctypes.c_int64 * 1)(n)
        self._managed = DLManagedTensor()
        t = self._managed.dl_tensor
        t.data, t.device, t.ndim = ptr, DLDevice(DL_CUDA, device), 1
        t.dtype, t.shape = DLDataType(1, 8, 1), self._shape

    def __dlpack_device__(self):
        return (DL_CUDA, self.device)

    def __dlpack__(self, **_):
        return _new_capsule(ctypes.addressof(self._managed), b"dltensor", None)


@pytest.fixture
def driver():
    return Driver()


def test_a_cuda_tensor_is_registered_and_written_end_to_end(driver):
    n = 1 << 16
    live = driver.live()
    gpu = CudaTensor(driver.alloc(n), n)
    driver.upload(gpu.ptr, bytes(n))
    pattern = (np.arange(n) % 251).astype(np.uint8)
    with xfer.TransferEngine(MOCK) as a, xfer.TransferEngine(MOCK) as b:
        src = a.reg_mr(pattern, access="local")
        dst = b.reg_mr(gpu)
        assert dst.device == "cuda:0"
        a.submit_single_write(src, dst.desc, n).wait(10)
        assert driver.download(gpu.ptr, n) == pattern.tobytes()
        # And back, device to host, by a read of the device region.
        back = np.zeros(n, dtype=np.uint8)
        readable = b.reg_mr(CudaTensor(gpu.ptr, n), access="read")
        local = a.reg_mr(back, access="local")
        a.submit_single_read(local, readable.desc, n).wait(10)
        assert back.tobytes() == pattern.tobytes()
        for r in (dst, readable):
            r.dereg()
    driver.free(gpu.ptr)
    assert driver.live() == live


def test_a_cuda_tensor_over_host_memory_is_refused_by_name(driver):
    host = np.zeros(4096, dtype=np.uint8)
    liar = CudaTensor(host.ctypes.data, 4096)
    with xfer.TransferEngine(MOCK) as e:
        with pytest.raises(xfer.InvalidArgumentError, match="not CUDA device memory"):
            e.reg_mr(liar)
        wrong = CudaTensor(driver.alloc(4096), 4096, device=1)
        with pytest.raises(xfer.InvalidArgumentError, match="belongs to CUDA device 0, not 1"):
            e.reg_mr(wrong)
        driver.free(wrong.ptr)


class TorchLikeCudaTensor(CudaTensor):
    """The fake device tensor with the two attributes of a torch CUDA tensor the weight
    sender keys its registrations by (``data_ptr()``, ``nbytes``)."""

    def data_ptr(self):
        return self.ptr

    @property
    def nbytes(self):
        return self.n


def test_a_weight_senders_gpu_shard_is_written_gpu_direct_and_registered_once_across_versions(driver):
    # A trainer's parameter in device memory, new values each version in the same memory (an
    # optimizer step): written from the device, registered at the first version only.
    from test_weights import Cluster

    from xfer import weights as W

    n = 1 << 14
    layout = W.Layout((W.TensorSpec("w", (n,), "uint8"),), ((0, "w", None),), W.Layout.whole_params((W.TensorSpec("w", (n,), "uint8"),), 1))
    gpu = TorchLikeCudaTensor(driver.alloc(n), n)
    c = Cluster(layout, 1, 1)
    try:
        for v in range(3):
            values = ((np.arange(n) * (v + 3)) % 251).astype(np.uint8)
            driver.upload(gpu.ptr, values.tobytes())
            results = c.version(v, None, data=lambda s: {0: gpu})
            assert all(e is None for e in results.values()), results
            assert np.array_equal(c.receivers[0].params["w"], values), f"version {v}"
            assert c.senders[0].registrations == 1
        (region,) = [r for _, r in c.senders[0]._registered.values()]
        assert region.device == "cuda:0"
    finally:
        c.close()
    driver.free(gpu.ptr)
