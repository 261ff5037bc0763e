//! The fakes' control entry points, looked up by name. All of this crate's `unsafe` is here.

use std::ffi::{c_char, c_int, CString};
use std::path::Path;

use libloading::Library;

type Fail = unsafe extern "C" fn(*const c_char, c_int) -> c_int;
type Live = unsafe extern "C" fn() -> c_int;
type GdrLive = unsafe extern "C" fn(*mut c_int, *mut c_int);
type Store = unsafe extern "C" fn(u64, u64) -> c_int;
type Fence = unsafe extern "C" fn();
type Synchronize = unsafe extern "C" fn() -> c_int;

/// The two fake libraries and their test-only entry points.
pub struct Fakes {
    cuda_fail: Fail,
    cuda_live: Live,
    gpu_store: Store,
    gpu_fence: Fence,
    synchronize: Synchronize,
    gdr_fail: Fail,
    gdr_live: GdrLive,
    _cuda: Library,
    _gdr: Library,
}

fn symbol<T: Copy>(library: &Library, name: &str) -> Result<T, String> {
    // SAFETY: every T used here is the C signature of that entry point in gpu-fakes/*.c.
    unsafe { library.get::<T>(name.as_bytes()) }
        .map(|s| *s)
        .map_err(|e| format!("the fake lacks {name}: {e}"))
}

fn open(path: &Path) -> Result<Library, String> {
    // SAFETY: the fakes are this repository's own test libraries; loading one by path yields
    // the object already loaded by name through LD_LIBRARY_PATH (same file).
    unsafe { Library::new(path) }.map_err(|e| format!("{}: {e}", path.display()))
}

impl Fakes {
    pub(crate) fn load(dir: &Path) -> Result<Self, String> {
        let cuda = open(&dir.join("libcuda.so.1"))?;
        let gdr = open(&dir.join("libgdrapi.so.2"))?;
        Ok(Self {
            cuda_fail: symbol(&cuda, "xfer_fake_cuda_fail")?,
            cuda_live: symbol(&cuda, "xfer_fake_cuda_live")?,
            gpu_store: symbol(&cuda, "xfer_fake_gpu_store_u64")?,
            gpu_fence: symbol(&cuda, "xfer_fake_gpu_threadfence_system")?,
            synchronize: symbol(&cuda, "cuCtxSynchronize")?,
            gdr_fail: symbol(&gdr, "xfer_fake_gdr_fail")?,
            gdr_live: symbol(&gdr, "xfer_fake_gdr_live")?,
            _cuda: cuda,
            _gdr: gdr,
        })
    }

    /// Fails the next `times` calls of the driver entry point `name` (-1: every call, 0: none).
    pub fn fail_cuda(&self, name: &str, times: i32) {
        let name = CString::new(name).expect("no NUL in a name");
        // SAFETY: a valid C string; the fake copies it.
        assert_eq!(unsafe { (self.cuda_fail)(name.as_ptr(), times) }, 0);
    }

    /// As [`fail_cuda`](Self::fail_cuda), for GDRCopy's entry points.
    pub fn fail_gdr(&self, name: &str, times: i32) {
        let name = CString::new(name).expect("no NUL in a name");
        // SAFETY: as above.
        assert_eq!(unsafe { (self.gdr_fail)(name.as_ptr(), times) }, 0);
    }

    /// Live driver allocations (device and page-locked host memory).
    pub fn live_allocations(&self) -> usize {
        // SAFETY: no arguments.
        unsafe { (self.cuda_live)() as usize }
    }

    /// Live GDRCopy (pins, mappings).
    pub fn live_pins(&self) -> (usize, usize) {
        let (mut pinned, mut mapped) = (0, 0);
        // SAFETY: valid out-pointers.
        unsafe { (self.gdr_live)(&mut pinned, &mut mapped) };
        (pinned as usize, mapped as usize)
    }

    /// A kernel's 8-byte store to device (or device-mapped) memory at `ptr`; it lands later,
    /// and after the kernel's other unfenced stores (see cuda.c).
    pub fn gpu_store(&self, ptr: u64, value: u64) {
        // SAFETY: the fake checks `ptr` names live driver memory.
        let refused = unsafe { (self.gpu_store)(ptr, value) };
        assert_eq!(refused, 0, "{ptr:#x} is not device memory");
    }

    /// `__threadfence_system()` in the kernel making [`gpu_store`](Self::gpu_store)s.
    pub fn gpu_threadfence_system(&self) {
        // SAFETY: no arguments.
        unsafe { (self.gpu_fence)() }
    }

    /// Waits until every kernel store landed.
    pub fn synchronize(&self) {
        // SAFETY: no arguments.
        unsafe { (self.synchronize)() };
    }
}
