//! Where slots live: blocks of 512 `u64`s at stable addresses.

use std::sync::atomic::AtomicU64;

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

/// One block of slots. Host blocks are a boxed array; the address never changes.
pub(crate) struct Block {
    slots: Box<[AtomicU64]>,
}

impl Block {
    pub(crate) fn host() -> Self {
        Self {
            slots: (0..SLOTS_PER_BLOCK).map(|_| AtomicU64::new(0)).collect(),
        }
    }

    pub(crate) fn slot(&self, i: usize) -> &AtomicU64 {
        &self.slots[i]
    }
}
