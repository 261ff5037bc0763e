//! Registering GPU memory with the device: dma-buf first, then a plain registration
//! (nvidia-peermem), with both reasons when neither works.

use xfer_plugin::domain::{DomainError, DomainErrorKind, MemoryRegion};

use super::{err, VerbsDomain};
use crate::ffi::Mr;

impl VerbsDomain {
    /// GPU memory: dma-buf first (`cuMemGetHandleForAddressRange` → `ibv_reg_dmabuf_mr`),
    /// then plain `ibv_reg_mr` (works with nvidia-peermem); both reasons if neither works.
    pub(super) fn register_gpu(
        &mut self,
        region: &MemoryRegion,
        index: u32,
    ) -> Result<Mr, DomainError> {
        let dmabuf = self.device.register_region_dmabuf(region, index);
        let dmabuf_error = match dmabuf {
            Ok(mr) => return Ok(mr),
            Err(e) => e,
        };
        match self.device.register_region(region) {
            Ok(mr) => Ok(mr),
            Err(peermem_error) => Err(err(
                DomainErrorKind::InvalidArgument,
                format!("GPU memory of CUDA device {index} cannot be registered with {}: dma-buf: {dmabuf_error}; nvidia-peermem: {peermem_error} (see `xfer doctor`)", self.name),
            )),
        }
    }
}
