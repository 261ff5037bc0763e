//! [`HostBuffer`]: owned host memory registered with an engine, for callers (tests, benches,
//! CPU-side staging) who do not manage their own allocations.

use std::sync::Arc;

use crate::api::{MrHandle, TransferEngine};
use crate::domain::Device;
use crate::error::Result;
use crate::wire::MrDesc;

/// A heap buffer registered with an engine; deregistered before its memory is freed.
///
/// Peers holding [`desc`](Self::desc) may write into it at any time: read or change its bytes
/// only when your protocol says no write is in flight (after the arrivals you wait for were
/// counted, before you hand out work that targets it).
pub struct HostBuffer {
    engine: Arc<TransferEngine>,
    data: Box<[u8]>,
    mr: MrHandle,
    desc: MrDesc,
}

impl std::fmt::Debug for HostBuffer {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("HostBuffer")
            .field("len", &self.data.len())
            .field("mr", &self.mr)
            .finish()
    }
}

impl HostBuffer {
    /// Allocates `len` zeroed bytes and registers them with `engine`.
    pub fn new(engine: &Arc<TransferEngine>, len: usize) -> Result<Self> {
        Self::from_fn(engine, len, |_| 0)
    }

    /// Allocates `len` bytes filled with `fill(i)` and registers them with `engine`.
    pub fn from_fn(
        engine: &Arc<TransferEngine>,
        len: usize,
        fill: impl Fn(usize) -> u8,
    ) -> Result<Self> {
        let mut data: Box<[u8]> = (0..len).map(fill).collect();
        // SAFETY: `data` is owned by the HostBuffer, never reallocated, and deregistered in
        // Drop before it is freed.
        let (mr, desc) = unsafe { engine.reg_mr(data.as_mut_ptr(), len, Device::Host)? };
        Ok(Self {
            engine: Arc::clone(engine),
            data,
            mr,
            desc,
        })
    }

    /// The local handle, for the source side of writes.
    pub fn mr(&self) -> MrHandle {
        self.mr
    }

    /// The descriptor peers write with.
    pub fn desc(&self) -> &MrDesc {
        &self.desc
    }

    /// The bytes.
    pub fn bytes(&self) -> &[u8] {
        &self.data
    }

    /// The bytes, to fill before sending.
    pub fn bytes_mut(&mut self) -> &mut [u8] {
        &mut self.data
    }

    /// Length in bytes.
    pub fn len(&self) -> usize {
        self.data.len()
    }

    /// Whether it is empty (never: registration needs at least one byte).
    pub fn is_empty(&self) -> bool {
        self.data.is_empty()
    }
}

impl Drop for HostBuffer {
    fn drop(&mut self) {
        if let Err(e) = self.engine.dereg_mr(self.mr) {
            tracing::warn!(error = %e, "deregistering a HostBuffer failed");
        }
    }
}
