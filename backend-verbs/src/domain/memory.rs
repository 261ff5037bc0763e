//! Registering GPU memory with the device: dma-buf first, then a plain registration
//! (nvidia-peermem), with both reasons when neither works.

use xfer_plugin::domain::{DomainCause, DomainError, DomainErrorKind, MemoryRegion};

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
                gpu_registration_kind(peermem_error.errno),
                format!("GPU memory of CUDA device {index} cannot be registered with {}: dma-buf: {dmabuf_error}; nvidia-peermem: {peermem_error} (see `xfer doctor`)", self.name),
            )
            .with_cause(DomainCause::Os(peermem_error.errno))),
        }
    }
}

/// What a failed GPU registration was, by the errno of its last try (the plain registration):
/// memory this NIC cannot take — `EFAULT` (the kernel cannot pin device pages: no
/// nvidia-peermem), `EINVAL`, `EOPNOTSUPP` — is the caller's request refused; anything else
/// (`ENOMEM` pinning, a driver failing) is the backend's failure.
pub(super) fn gpu_registration_kind(errno: i32) -> DomainErrorKind {
    const EFAULT: i32 = 14;
    const EINVAL: i32 = 22;
    const EOPNOTSUPP: i32 = 95;
    match errno {
        EFAULT | EINVAL | EOPNOTSUPP => DomainErrorKind::InvalidArgument,
        _ => DomainErrorKind::Other,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_gpu_registration_is_refused_only_for_memory_the_device_cannot_take() {
        // Device pages the kernel cannot pin (soft-RoCE, or no nvidia-peermem).
        assert_eq!(gpu_registration_kind(14), DomainErrorKind::InvalidArgument);
        assert_eq!(gpu_registration_kind(22), DomainErrorKind::InvalidArgument);
        assert_eq!(gpu_registration_kind(95), DomainErrorKind::InvalidArgument);
        // Pinning that ran out of memory, or a driver's I/O error: the backend failed.
        assert_eq!(gpu_registration_kind(12), DomainErrorKind::Other);
        assert_eq!(gpu_registration_kind(5), DomainErrorKind::Other);
    }
}
