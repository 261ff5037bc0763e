//! Where slots live: blocks of 512 `u64`s at stable addresses, in host memory or in
//! page-locked host memory mapped into a GPU's address space.

use std::sync::atomic::AtomicU64;
use std::sync::Arc;

use crate::cuda::Cuda;

/// Slots per block: one 4 KiB page.
pub const SLOTS_PER_BLOCK: usize = 512;

/// What kind of memory backs the slots.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum MemoryKind {
    /// Ordinary host memory, for CPU producers (and machines without CUDA).
    Host,
    /// Page-locked host memory mapped into the GPU's address space.
    DeviceMapped,
}

/// One block of slots; its address never changes while it lives.
pub(crate) enum Block {
    Host(Box<[AtomicU64]>),
    Mapped {
        cuda: Arc<Cuda>,
        host: *mut u8,
        device: u64,
    },
}

// SAFETY: a mapped block is plain page-locked memory accessed only through atomics; the raw
// pointer is owned by the block and freed once, in Drop.
unsafe impl Send for Block {}
// SAFETY: as above.
unsafe impl Sync for Block {}

impl Block {
    pub(crate) fn host() -> Self {
        Self::Host((0..SLOTS_PER_BLOCK).map(|_| AtomicU64::new(0)).collect())
    }

    pub(crate) fn mapped(cuda: &Arc<Cuda>) -> Result<Self, String> {
        let (host, device) = cuda.alloc_mapped(SLOTS_PER_BLOCK * 8)?;
        Ok(Self::Mapped {
            cuda: Arc::clone(cuda),
            host,
            device,
        })
    }

    pub(crate) fn slot(&self, i: usize) -> &AtomicU64 {
        assert!(i < SLOTS_PER_BLOCK);
        match self {
            Self::Host(slots) => &slots[i],
            // SAFETY: the block holds SLOTS_PER_BLOCK zeroed, 8-byte aligned u64s (page-locked
            // allocations are page aligned) for as long as it lives; every access is atomic.
            Self::Mapped { host, .. } => unsafe { &*(host.cast::<AtomicU64>().add(i)) },
        }
    }

    pub(crate) fn device_ptr(&self, i: usize) -> Option<u64> {
        match self {
            Self::Host(_) => None,
            Self::Mapped { device, .. } => Some(device + 8 * i as u64),
        }
    }

    pub(crate) fn kind(&self) -> MemoryKind {
        match self {
            Self::Host(_) => MemoryKind::Host,
            Self::Mapped { .. } => MemoryKind::DeviceMapped,
        }
    }
}

impl Drop for Block {
    fn drop(&mut self) {
        if let Self::Mapped { cuda, host, .. } = self {
            // SAFETY: allocated by alloc_mapped; the pool and every watcher holding this block
            // are gone (they hold Arcs to it).
            unsafe { cuda.free_mapped(*host) };
        }
    }
}
