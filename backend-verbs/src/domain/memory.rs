//! Registering GPU memory with the device: dma-buf first, then a plain registration
//! (nvidia-peermem), with both reasons when neither works.

use xfer_plugin::domain::{DomainError, DomainErrorKind, MemoryRegion};

use super::{err, VerbsDomain};
use crate::ffi::{Mr, RemoteBits};

impl VerbsDomain {
    /// GPU memory: dma-buf first (`cuMemGetHandleForAddressRange` → `ibv_reg_dmabuf_mr`),
    /// then plain `ibv_reg_mr` (works with nvidia-peermem); both reasons if neither works.
    pub(super) fn register_gpu(
        &mut self,
        region: &MemoryRegion,
        index: u32,
    ) -> Result<Mr, DomainError> {
        let dmabuf = xfer_cuda::dmabuf(region.ptr, region.len, index).and_then(|(fd, offset)| {
            // SAFETY: the engine checked the range is live device memory of this GPU; the fd
            // was just exported for it and is handed over.
            unsafe {
                self.device.register_dmabuf(
                    offset,
                    region.len as usize,
                    region.ptr,
                    fd,
                    RemoteBits::of(region.remote_write, region.remote_read),
                )
            }
        });
        let dmabuf_error = match dmabuf {
            Ok(mr) => return Ok(mr),
            Err(e) => e,
        };
        let remote = RemoteBits::of(region.remote_write, region.remote_read);
        // SAFETY: as for host memory; with nvidia-peermem the NIC pins GPU pages itself.
        match unsafe { self.device.register(region.ptr, region.len as usize, remote) } {
            Ok(mr) => Ok(mr),
            Err(peermem_error) => Err(err(
                DomainErrorKind::InvalidArgument,
                format!("GPU memory of CUDA device {index} cannot be registered with {}: dma-buf: {dmabuf_error}; nvidia-peermem: {peermem_error} (see `xfer doctor`)", self.name),
            )),
        }
    }
}
