//! Page-locked, device-mapped host memory through the CUDA driver, loaded at run time.
//! All of this crate's `unsafe` CUDA calls are here; the watcher's memory uses [`Cuda`] too.

use cudarc::driver::sys;

/// Why CUDA memory is not available.
fn check(what: &str, r: sys::CUresult) -> Result<(), String> {
    if r == sys::CUresult::CUDA_SUCCESS {
        Ok(())
    } else {
        Err(format!("{what} failed: {r:?}"))
    }
}

/// How many times the driver library was probed for (each probe is ~17 `dlopen` attempts:
/// 2.2 s under emulation), for the test that it happens once per process.
pub(crate) static PROBES: std::sync::atomic::AtomicUsize = std::sync::atomic::AtomicUsize::new(0);

/// Whether libcuda can be loaded. Probed once per process: a driver does not appear or vanish
/// under a running program, and every `reg_mr` asks.
pub fn driver_present() -> bool {
    static PRESENT: std::sync::OnceLock<bool> = std::sync::OnceLock::new();
    *PRESENT.get_or_init(|| {
        PROBES.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
        // SAFETY: only probes for the library with dlopen.
        unsafe { sys::is_culib_present() }
    })
}

/// A primary context of one device, made current on the threads that allocate.
pub struct Cuda {
    context: sys::CUcontext,
}

// SAFETY: a CUDA context handle may be used from any thread (it is made current per thread).
unsafe impl Send for Cuda {}
// SAFETY: as above; the handle is only read.
unsafe impl Sync for Cuda {}

impl Cuda {
    /// The driver and device `device`, or why not. Never panics: the library's presence is
    /// checked before any driver call.
    pub fn open(device: i32) -> Result<Self, String> {
        if !driver_present() {
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
    pub fn alloc_mapped(&self, len: usize) -> Result<(*mut u8, u64), String> {
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
    pub unsafe fn free_mapped(&self, host: *mut u8) {
        // SAFETY: per this function's contract.
        unsafe {
            sys::cuCtxSetCurrent(self.context);
            sys::cuMemFreeHost(host.cast());
        }
    }
}

impl Cuda {
    fn make_current(&self) -> Result<(), String> {
        // SAFETY: the context was retained in open.
        check("cuCtxSetCurrent", unsafe {
            sys::cuCtxSetCurrent(self.context)
        })
    }

    /// The memory type of `ptr` (`None` when the driver does not know it: plain host memory).
    fn memory_type(&self, ptr: u64) -> Result<Option<sys::CUmemorytype>, String> {
        self.make_current()?;
        let mut kind: u32 = 0;
        // SAFETY: `kind` is a valid out-pointer for this attribute (an unsigned int).
        let r = unsafe {
            sys::cuPointerGetAttribute(
                (&mut kind as *mut u32).cast(),
                sys::CUpointer_attribute::CU_POINTER_ATTRIBUTE_MEMORY_TYPE,
                ptr,
            )
        };
        if r != sys::CUresult::CUDA_SUCCESS {
            return Ok(None);
        }
        Ok(Some(
            if kind == sys::CUmemorytype::CU_MEMORYTYPE_DEVICE as u32 {
                sys::CUmemorytype::CU_MEMORYTYPE_DEVICE
            } else {
                sys::CUmemorytype::CU_MEMORYTYPE_HOST
            },
        ))
    }

    /// Checks that `[ptr, ptr + len)` is device memory of `device`, inside one allocation.
    pub fn check_device_range(&self, ptr: u64, len: u64, device: i32) -> Result<(), String> {
        if self.memory_type(ptr)? != Some(sys::CUmemorytype::CU_MEMORYTYPE_DEVICE) {
            return Err(format!("{ptr:#x} is not CUDA device memory (host memory passed as Device::Cuda({device})?)"));
        }
        let mut ordinal: i32 = -1;
        // SAFETY: valid out-pointer for this attribute (an int); context current.
        let r = unsafe {
            sys::cuPointerGetAttribute(
                (&mut ordinal as *mut i32).cast(),
                sys::CUpointer_attribute::CU_POINTER_ATTRIBUTE_DEVICE_ORDINAL,
                ptr,
            )
        };
        check("cuPointerGetAttribute(DEVICE_ORDINAL)", r)?;
        if ordinal != device {
            return Err(format!(
                "{ptr:#x} belongs to CUDA device {ordinal}, not {device}"
            ));
        }
        let (mut base, mut size) = (0u64, 0usize);
        // SAFETY: valid out-pointers; context current.
        check("cuMemGetAddressRange", unsafe {
            sys::cuMemGetAddressRange_v2(&mut base, &mut size, ptr)
        })?;
        if ptr
            .checked_add(len)
            .is_none_or(|end| end > base + size as u64)
        {
            return Err(format!("{ptr:#x}+{len} crosses the end of its allocation {base:#x}+{size}: register each allocation separately"));
        }
        Ok(())
    }

    /// Refuses device memory registered as host memory.
    pub fn check_host_range(&self, ptr: u64) -> Result<(), String> {
        match self.memory_type(ptr)? {
            Some(sys::CUmemorytype::CU_MEMORYTYPE_DEVICE) => Err(format!(
                "{ptr:#x} is CUDA device memory: register it as Device::Cuda"
            )),
            _ => Ok(()),
        }
    }

    /// Copies `len` bytes between any two addresses the driver can reach (unified addressing).
    ///
    /// # Safety
    /// Both ranges must be valid for the copy.
    pub unsafe fn copy(&self, dst: u64, src: u64, len: usize) -> Result<(), String> {
        self.make_current()?;
        // SAFETY: per this function's contract.
        check("cuMemcpy", unsafe { sys::cuMemcpy(dst, src, len) })
    }
}

impl Cuda {
    /// How many devices the driver reports (`cuInit` ran in `open`).
    pub fn device_count(&self) -> Result<i32, String> {
        let mut count = 0;
        // SAFETY: valid out-pointer; the driver was initialised in open.
        check("cuDeviceGetCount", unsafe {
            sys::cuDeviceGetCount(&mut count)
        })?;
        Ok(count)
    }

    /// The name of device `ordinal`, as the driver gives it.
    pub fn name(&self, ordinal: i32) -> Result<String, String> {
        let mut dev = 0;
        // SAFETY: valid out-pointer; the driver was initialised in open.
        check("cuDeviceGet", unsafe {
            sys::cuDeviceGet(&mut dev, ordinal)
        })?;
        let mut buf = [0 as std::ffi::c_char; 256];
        // SAFETY: the buffer holds the length passed; the driver NUL-terminates within it.
        check("cuDeviceGetName", unsafe {
            sys::cuDeviceGetName(buf.as_mut_ptr(), buf.len() as i32, dev)
        })?;
        buf[buf.len() - 1] = 0;
        // SAFETY: NUL-terminated (forced above) and live.
        Ok(unsafe { std::ffi::CStr::from_ptr(buf.as_ptr()) }
            .to_string_lossy()
            .into_owned())
    }

    /// Allocates `len` bytes of device memory.
    pub fn alloc_device(&self, len: usize) -> Result<u64, String> {
        self.make_current()?;
        let mut ptr = 0;
        // SAFETY: valid out-pointer; context current.
        check("cuMemAlloc", unsafe { sys::cuMemAlloc_v2(&mut ptr, len) })?;
        Ok(ptr)
    }

    /// Frees device memory from `alloc_device`.
    ///
    /// # Safety
    /// `ptr` came from `alloc_device` and is no longer used.
    pub unsafe fn free_device(&self, ptr: u64) {
        let _ = self.make_current();
        // SAFETY: per this function's contract.
        unsafe { sys::cuMemFree_v2(ptr) };
    }

    /// Copies host bytes to device memory.
    ///
    /// # Safety
    /// `dst..dst+src.len()` must be live device memory.
    pub unsafe fn upload(&self, dst: u64, src: &[u8]) -> Result<(), String> {
        self.make_current()?;
        // SAFETY: per this function's contract; src is a live slice.
        check("cuMemcpyHtoD", unsafe {
            sys::cuMemcpyHtoD_v2(dst, src.as_ptr().cast(), src.len())
        })
    }

    /// Copies device memory to host bytes.
    ///
    /// # Safety
    /// `src..src+dst.len()` must be live device memory.
    pub unsafe fn download(&self, dst: &mut [u8], src: u64) -> Result<(), String> {
        self.make_current()?;
        // SAFETY: per this function's contract; dst is a live slice.
        check("cuMemcpyDtoH", unsafe {
            sys::cuMemcpyDtoH_v2(dst.as_mut_ptr().cast(), src, dst.len())
        })
    }

    /// A dma-buf file descriptor for `[base, base + len)` (page aligned), for NICs that
    /// register GPU memory through dma-buf.
    pub fn dmabuf_fd(&self, base: u64, len: u64) -> Result<i32, String> {
        self.make_current()?;
        let mut fd: i32 = -1;
        // SAFETY: `fd` is a valid out-pointer for a DMA_BUF_FD handle (an int).
        let r = unsafe {
            sys::cuMemGetHandleForAddressRange(
                (&mut fd as *mut i32).cast(),
                base,
                len as usize,
                sys::CUmemRangeHandleType::CU_MEM_RANGE_HANDLE_TYPE_DMA_BUF_FD,
                0,
            )
        };
        check("cuMemGetHandleForAddressRange(DMA_BUF_FD)", r)?;
        Ok(fd)
    }
}

#[cfg(test)]
mod tests {
    #[test]
    fn the_driver_is_probed_once_per_process() {
        for _ in 0..10 {
            let _ = super::driver_present();
            let _ = crate::check_host_range(0x1000);
        }
        assert_eq!(super::PROBES.load(std::sync::atomic::Ordering::Relaxed), 1);
    }
}
