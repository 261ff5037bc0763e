//! GPU memory checks and copies for registration (`reg_mr(ptr, len, Device::Cuda(i))`), through
//! the CUDA driver loaded at run time. Without a driver, GPU registrations are refused with the
//! reason and host registrations pass unchecked.

use std::sync::{Arc, Mutex, OnceLock};

use crate::cuda::Cuda;

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

/// Checks a host registration is not device memory (only where a CUDA driver is present).
pub fn check_host_range(ptr: u64) -> Result<(), String> {
    if !crate::cuda_driver_present() {
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
