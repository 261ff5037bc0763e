//! [`GpuCounter`]: a u64 the CPU sets and a GPU kernel polls — the opposite direction of a
//! watcher slot, e.g. "all pages of layer k have arrived", mirrored from the ImmCounter.
//!
//! Best first: GPU memory mapped for the CPU with GDRCopy (the kernel polls its own memory);
//! else page-locked host memory mapped into the GPU (the kernel polls over PCIe); else plain
//! host memory (no GPU: CPU consumers only). The choice is logged once.

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;

use crate::memory::Block;

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

enum Backing {
    Gdr {
        gdr: gdrcopy_sys::Gdr,
        mh: gdrcopy_sys::MemHandle,
        va: *mut u8,
        memory: crate::gpu::DeviceBuffer,
    },
    Mapped(Block),
    Host(Box<AtomicU64>),
}

/// A CPU-written, GPU-readable u64.
pub struct GpuCounter {
    backing: Backing,
}

// SAFETY: the GDRCopy mapping is written with single aligned stores and owned by the counter;
// the other backings are Send + Sync already.
unsafe impl Send for GpuCounter {}
// SAFETY: as above.
unsafe impl Sync for GpuCounter {}

impl std::fmt::Debug for GpuCounter {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "GpuCounter({:?}, {})", self.memory(), self.value())
    }
}

/// GDRCopy maps whole GPU pages of 64 KiB.
const GPU_PAGE: usize = 64 << 10;

impl GpuCounter {
    /// A counter for CUDA device `device`, in the best memory available (see the module docs).
    pub fn new(device: u32) -> Arc<Self> {
        let gdr = gdrcopy_sys::Gdr::open().and_then(|gdr| {
            let memory = crate::gpu::DeviceBuffer::new(device, GPU_PAGE)?;
            // SAFETY: `memory` is kept with the mapping and freed after unmap (Drop).
            let (mh, va) = unsafe { gdr.pin_and_map(memory.ptr(), GPU_PAGE) }?;
            Ok(Backing::Gdr {
                gdr,
                mh,
                va,
                memory,
            })
        });
        let backing = match gdr {
            Ok(b) => b,
            Err(why) => {
                let mapped = crate::cuda::Cuda::open(device as i32)
                    .and_then(|c| Block::mapped(&Arc::new(c)));
                match mapped {
                    Ok(block) => {
                        tracing::info!(
                            "uvm-watcher: GPU counter in device-mapped host memory ({why})"
                        );
                        Backing::Mapped(block)
                    }
                    Err(no_cuda) => {
                        tracing::info!(
                            "uvm-watcher: GPU counter in host memory ({why}; {no_cuda})"
                        );
                        Backing::Host(Box::new(AtomicU64::new(0)))
                    }
                }
            }
        };
        let counter = Arc::new(Self { backing });
        counter.set(0);
        counter
    }

    /// Where it lives.
    pub fn memory(&self) -> CounterMemory {
        match self.backing {
            Backing::Gdr { .. } => CounterMemory::Gdr,
            Backing::Mapped(_) => CounterMemory::DeviceMapped,
            Backing::Host(_) => CounterMemory::Host,
        }
    }

    /// The address a GPU kernel polls (none in host memory).
    pub fn device_ptr(&self) -> Option<u64> {
        match &self.backing {
            Backing::Gdr { memory, .. } => Some(memory.ptr()),
            Backing::Mapped(block) => block.device_ptr(0),
            Backing::Host(_) => None,
        }
    }

    /// Sets the value (visible to the GPU after the store; a fence orders it after prior writes).
    pub fn set(&self, value: u64) {
        match &self.backing {
            Backing::Gdr { va, .. } => {
                std::sync::atomic::fence(Ordering::Release);
                // SAFETY: `va` maps at least 8 bytes of live GPU memory for the counter's
                // lifetime; GPU pages are 64 KiB aligned, so the store is aligned.
                unsafe { std::ptr::write_volatile((*va).cast::<u64>(), value) };
                std::sync::atomic::fence(Ordering::SeqCst);
            }
            Backing::Mapped(block) => block.slot(0).store(value, Ordering::Release),
            Backing::Host(cell) => cell.store(value, Ordering::Release),
        }
    }

    /// The value last set.
    pub fn value(&self) -> u64 {
        match &self.backing {
            // SAFETY: as in `set`.
            Backing::Gdr { va, .. } => unsafe { std::ptr::read_volatile((*va).cast::<u64>()) },
            Backing::Mapped(block) => block.slot(0).load(Ordering::Acquire),
            Backing::Host(cell) => cell.load(Ordering::Acquire),
        }
    }
}

impl Drop for GpuCounter {
    fn drop(&mut self) {
        if let Backing::Gdr { gdr, mh, va, .. } = &self.backing {
            // SAFETY: mapped in new, unmapped once; the device buffer drops after this.
            unsafe { gdr.unmap(*mh, *va, GPU_PAGE) };
        }
    }
}
