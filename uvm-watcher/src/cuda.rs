//! Page-locked, device-mapped host memory through the CUDA driver, loaded at run time.
//! All of this crate's `unsafe` CUDA calls are here.

use cudarc::driver::sys;

/// Why CUDA memory is not available.
fn check(what: &str, r: sys::CUresult) -> Result<(), String> {
    if r == sys::CUresult::CUDA_SUCCESS {
        Ok(())
    } else {
        Err(format!("{what} failed: {r:?}"))
    }
}

/// Whether libcuda can be loaded.
pub(crate) fn driver_present() -> bool {
    // SAFETY: only probes for the library with dlopen.
    unsafe { sys::is_culib_present() }
}

/// A primary context of one device, made current on the threads that allocate.
pub(crate) struct Cuda {
    context: sys::CUcontext,
}

// SAFETY: a CUDA context handle may be used from any thread (it is made current per thread).
unsafe impl Send for Cuda {}
// SAFETY: as above; the handle is only read.
unsafe impl Sync for Cuda {}

impl Cuda {
    /// The driver and device `device`, or why not. Never panics: the library's presence is
    /// checked before any driver call.
    pub(crate) fn open(device: i32) -> Result<Self, String> {
        // SAFETY: only probes for the library with dlopen.
        if !unsafe { sys::is_culib_present() } {
            return Err("no CUDA driver library (libcuda.so) on this machine".into());
        }
        // SAFETY: the library is present; these are plain driver calls with valid out-pointers.
        unsafe {
            check("cuInit", sys::cuInit(0))?;
            let mut count = 0;
            check("cuDeviceGetCount", sys::cuDeviceGetCount(&mut count))?;
            if device >= count {
                return Err(format!(
                    "CUDA device {device} does not exist ({count} devices)"
                ));
            }
            let mut dev = 0;
            check("cuDeviceGet", sys::cuDeviceGet(&mut dev, device))?;
            let mut context = std::ptr::null_mut();
            check(
                "cuDevicePrimaryCtxRetain",
                sys::cuDevicePrimaryCtxRetain(&mut context, dev),
            )?;
            Ok(Self { context })
        }
    }

    /// Allocates `len` bytes of page-locked host memory mapped into the device's address space;
    /// returns (host pointer, device pointer).
    pub(crate) fn alloc_mapped(&self, len: usize) -> Result<(*mut u8, u64), String> {
        // SAFETY: the context was retained in open; out-pointers are valid.
        unsafe {
            check("cuCtxSetCurrent", sys::cuCtxSetCurrent(self.context))?;
            let mut host = std::ptr::null_mut();
            let flags = sys::CU_MEMHOSTALLOC_DEVICEMAP | sys::CU_MEMHOSTALLOC_PORTABLE;
            check("cuMemHostAlloc", sys::cuMemHostAlloc(&mut host, len, flags))?;
            std::ptr::write_bytes(host as *mut u8, 0, len);
            let mut device = 0;
            if let Err(e) = check(
                "cuMemHostGetDevicePointer",
                sys::cuMemHostGetDevicePointer_v2(&mut device, host, 0),
            ) {
                sys::cuMemFreeHost(host);
                return Err(e);
            }
            Ok((host as *mut u8, device))
        }
    }

    /// Frees what `alloc_mapped` returned.
    ///
    /// # Safety
    /// `host` came from `alloc_mapped` and nothing uses it any more.
    pub(crate) unsafe fn free_mapped(&self, host: *mut u8) {
        // SAFETY: per this function's contract.
        unsafe {
            sys::cuCtxSetCurrent(self.context);
            sys::cuMemFreeHost(host.cast());
        }
    }
}
