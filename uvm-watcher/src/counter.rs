//! [`GpuCounter`]: a u64 the CPU sets and a GPU kernel polls — the opposite direction of a
//! watcher slot, e.g. "all pages of layer k have arrived", mirrored from the ImmCounter.
//!
//! Best first: GPU memory mapped for the CPU with GDRCopy (the kernel polls its own memory);
//! else page-locked host memory mapped into the GPU (the kernel polls over PCIe); else plain
//! host memory (no GPU: CPU consumers only). The choice is logged once.

use std::sync::Arc;

use crate::memory::{Block, MemoryKind};

/// Where a counter lives.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum CounterMemory {
    /// GPU memory, written by the CPU through a GDRCopy mapping.
    Gdr,
    /// Page-locked host memory mapped into the GPU.
    DeviceMapped,
    /// Host memory only.
    Host,
}

/// A CPU-written, GPU-readable u64: slot 0 of a block of the best memory available.
pub struct GpuCounter {
    block: Block,
}

impl std::fmt::Debug for GpuCounter {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "GpuCounter({:?}, {})", self.memory(), self.value())
    }
}

impl GpuCounter {
    /// A counter for CUDA device `device`, in the best memory available (see the module docs).
    pub fn new(device: u32) -> Arc<Self> {
        let gdr = gdrcopy_sys::Gdr::open().and_then(|gdr| Block::gdr(&Arc::new(gdr), device));
        let block = match gdr {
            Ok(b) => b,
            Err(why) => {
                let mapped =
                    xfer_cuda::Cuda::open(device as i32).and_then(|c| Block::mapped(&Arc::new(c)));
                match mapped {
                    Ok(block) => {
                        tracing::info!(
                            "uvm-watcher: GPU counter in device-mapped host memory ({why})"
                        );
                        block
                    }
                    Err(no_cuda) => {
                        tracing::info!(
                            "uvm-watcher: GPU counter in host memory ({why}; {no_cuda})"
                        );
                        Block::host()
                    }
                }
            }
        };
        let counter = Arc::new(Self { block });
        counter.set(0);
        counter
    }

    /// Where it lives.
    pub fn memory(&self) -> CounterMemory {
        match self.block.kind() {
            MemoryKind::GpuGdrcopy => CounterMemory::Gdr,
            MemoryKind::DeviceMapped => CounterMemory::DeviceMapped,
            MemoryKind::Host => CounterMemory::Host,
        }
    }

    /// The address a GPU kernel polls (none in host memory).
    pub fn device_ptr(&self) -> Option<u64> {
        self.block.device_ptr(0)
    }

    /// Sets the value (ordered after the caller's prior writes; in GPU memory, written through
    /// the GDRCopy mapping, whose copy routine ends with a store fence).
    pub fn set(&self, value: u64) {
        self.block.store(0, value);
    }

    /// The value last set.
    pub fn value(&self) -> u64 {
        self.block.load(0)
    }
}
