//! # xfer-cuda: GPU memory checks and copies for registration (`reg_mr(ptr, len, Device::Cuda(i))`)
//!
//! Through the CUDA driver loaded at run time (no toolkit at build time). Without a driver, GPU
//! registrations are refused with the reason and host registrations pass unchecked. Its own
//! crate so that a backend needing only these (the mock's copies, verbs' dma-buf export) does
//! not link the watcher pool, and the engine, the watcher and the backends share one opened
//! context per device. All `unsafe` driver calls are in `ffi`. Without the default feature
//! `driver` (`--no-default-features`), nothing loads CUDA and GPU requests are refused.

#[cfg(not(feature = "driver"))]
#[path = "absent.rs"]
mod ffi;
#[cfg(feature = "driver")]
mod ffi;

use std::sync::{Arc, Mutex, OnceLock};

pub use ffi::{driver_present, Cuda};

/// Opened devices, by index.
type Opened = Mutex<Vec<(u32, Arc<Cuda>)>>;

/// One opened driver context per device, shared by everything in the process.
fn device(device: u32) -> Result<Arc<Cuda>, String> {
    static OPEN: OnceLock<Opened> = OnceLock::new();
    let open = OPEN.get_or_init(|| Mutex::new(Vec::new()));
    let mut open = open.lock().unwrap_or_else(|p| p.into_inner());
    if let Some((_, c)) = open.iter().find(|(d, _)| *d == device) {
        return Ok(Arc::clone(c));
    }
    let ordinal =
        i32::try_from(device).map_err(|_| format!("CUDA device {device} does not exist"))?;
    let c = Arc::new(Cuda::open(ordinal)?);
    open.push((device, Arc::clone(&c)));
    Ok(c)
}

/// Checks a registration of `[ptr, ptr + len)` as memory of CUDA device `index`: the driver
/// and device exist, the pointer is device memory of that device, and the range lies in one
/// allocation. The error says which.
pub fn check_device_range(ptr: u64, len: u64, index: u32) -> Result<(), String> {
    device(index)?.check_device_range(ptr, len, index as i32)
}

/// The CUDA devices the driver reports, by name (for `xfer doctor`), or why there are none
/// to report (no driver library, a driver that fails to initialise, no device).
pub fn devices() -> Result<Vec<String>, String> {
    if !driver_present() {
        return Err("no CUDA driver library (libcuda.so) on this machine".into());
    }
    let first = device(0)?;
    (0..first.device_count()?).map(|i| first.name(i)).collect()
}

/// Checks a host registration is not device memory (only where a CUDA driver is present).
pub fn check_host_range(ptr: u64) -> Result<(), String> {
    if !driver_present() {
        return Ok(());
    }
    match device(0) {
        Ok(c) => c.check_host_range(ptr),
        // A driver without a usable device cannot have handed out device pointers.
        Err(_) => Ok(()),
    }
}

/// Copies `len` bytes between any two addresses (host or device of GPU 0's context, unified
/// addressing), as a NIC's DMA would.
///
/// # Safety
/// Both ranges must be valid for the copy and not freed during it.
pub unsafe fn copy(dst: u64, src: u64, len: usize) -> Result<(), String> {
    // SAFETY: per this function's contract.
    unsafe { device(0)?.copy(dst, src, len) }
}

/// Device memory owned by the caller (tests, examples, the GPU check).
pub struct DeviceBuffer {
    cuda: Arc<Cuda>,
    ptr: u64,
    len: usize,
}

impl std::fmt::Debug for DeviceBuffer {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "DeviceBuffer({:#x}+{})", self.ptr, self.len)
    }
}

impl DeviceBuffer {
    /// Allocates `len` bytes on CUDA device `index`.
    pub fn new(index: u32, len: usize) -> Result<Self, String> {
        let cuda = device(index)?;
        let ptr = cuda.alloc_device(len)?;
        Ok(Self { cuda, ptr, len })
    }

    /// The device address.
    pub fn ptr(&self) -> u64 {
        self.ptr
    }

    /// Length in bytes.
    pub fn len(&self) -> usize {
        self.len
    }

    /// Whether it is empty.
    pub fn is_empty(&self) -> bool {
        self.len == 0
    }

    /// Copies `bytes` to offset `at`.
    pub fn upload(&self, at: usize, bytes: &[u8]) -> Result<(), String> {
        if at.checked_add(bytes.len()).is_none_or(|end| end > self.len) {
            return Err(format!(
                "upload of {} bytes at {at} is past the buffer's {}",
                bytes.len(),
                self.len
            ));
        }
        // SAFETY: the range was checked to lie in this live allocation.
        unsafe { self.cuda.upload(self.ptr + at as u64, bytes) }
    }

    /// Copies the whole buffer to host memory.
    pub fn download(&self) -> Result<Vec<u8>, String> {
        let mut out = vec![0u8; self.len];
        // SAFETY: the whole allocation is live.
        unsafe { self.cuda.download(&mut out, self.ptr) }?;
        Ok(out)
    }
}

impl Drop for DeviceBuffer {
    fn drop(&mut self) {
        // SAFETY: allocated in new; the owner is done with it.
        unsafe { self.cuda.free_device(self.ptr) };
    }
}

/// The page-aligned span covering `[ptr, ptr + len)`: (base, length, offset of `ptr`). dma-buf
/// export works on whole pages; the NIC registration then starts at `offset`.
pub fn page_span(ptr: u64, len: u64, page: u64) -> (u64, u64, u64) {
    let base = ptr / page * page;
    let end = (ptr + len).div_ceil(page) * page;
    (base, end - base, ptr - base)
}

/// A dma-buf fd covering `[ptr, ptr + len)` of CUDA device `index`, with the span it covers:
/// `(fd, offset of ptr within the span)`. The caller closes the fd after registering.
pub fn dmabuf(ptr: u64, len: u64, index: u32) -> Result<(i32, u64), String> {
    let (base, span, offset) = page_span(ptr, len, 4096);
    let fd = device(index)?.dmabuf_fd(base, span)?;
    Ok((fd, offset))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn page_spans_cover_the_range() {
        assert_eq!(page_span(0x1000, 0x1000, 4096), (0x1000, 0x1000, 0));
        assert_eq!(page_span(0x1234, 10, 4096), (0x1000, 0x1000, 0x234));
        assert_eq!(page_span(0x1ff0, 0x20, 4096), (0x1000, 0x2000, 0xff0));
    }
}
