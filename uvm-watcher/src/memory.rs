//! Where slots live: blocks of 512 `u64`s at stable addresses, in one of three kinds of memory:
//!
//! | kind | the producer (a GPU kernel) writes | the poller reads | costs |
//! |---|---|---|---|
//! | `Host` | — (CPU producers only) | its own memory | nothing |
//! | `DeviceMapped` | page-locked host memory, across PCIe | its own memory | each kernel store crosses PCIe |
//! | `GpuGdrcopy` | its own device memory (a local store) | the GPU's BAR through a GDRCopy mapping | each poll is an uncached PCIe read (~1 µs), so a pass reads a block's active span in one bulk copy |
//!
//! **Fencing for `GpuGdrcopy`.** GDRCopy orders nothing for GPU work already running (its
//! header says so, pointing at the GPUDirect RDMA "sync behavior" rules): a kernel that
//! publishes data through a slot must make that data visible system-wide *before* the slot
//! store — `__threadfence_system()` (or a `.release.sys` store) between them — and the poller,
//! having read a new value, orders its later reads after it (an acquire fence, which the pool
//! issues after every bulk read). The same rule serves `DeviceMapped` slots.

use std::sync::atomic::{fence, AtomicU64, Ordering};
use std::sync::Arc;

use xfer_cuda::Cuda;

/// Slots per block: one 4 KiB page.
pub const SLOTS_PER_BLOCK: usize = 512;

/// GDRCopy maps whole GPU pages of 64 KiB, aligned.
const GPU_PAGE: usize = 64 << 10;

/// What kind of memory backs the slots.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum MemoryKind {
    /// Ordinary host memory, for CPU producers (and machines without CUDA).
    Host,
    /// Page-locked host memory mapped into the GPU's address space.
    DeviceMapped,
    /// GPU memory, read by the CPU through a GDRCopy mapping of the GPU's BAR.
    GpuGdrcopy,
}

impl MemoryKind {
    /// The name configs and reports use.
    pub fn name(self) -> &'static str {
        match self {
            Self::Host => "host",
            Self::DeviceMapped => "device_mapped",
            Self::GpuGdrcopy => "gpu_gdrcopy",
        }
    }
}

/// GPU memory pinned and mapped for the CPU with GDRCopy.
pub(crate) struct GdrMapping {
    gdr: Arc<gdrcopy_sys::Gdr>,
    mh: gdrcopy_sys::MemHandle,
    /// The CPU address of `device`.
    va: *mut u8,
    /// The GPU page the slots live in (inside `memory`).
    device: u64,
    memory: xfer_cuda::DeviceBuffer,
}

impl GdrMapping {
    /// Allocates one GPU page (aligned, as `gdr_map` requires: an allocation of twice the
    /// page, rounded up inside it) on device `index`, zeroes it, pins and maps it.
    pub(crate) fn new(gdr: &Arc<gdrcopy_sys::Gdr>, index: u32) -> Result<Self, String> {
        let memory = xfer_cuda::DeviceBuffer::new(index, 2 * GPU_PAGE)?;
        let device = memory.ptr().next_multiple_of(GPU_PAGE as u64);
        memory.upload((device - memory.ptr()) as usize, &[0u8; GPU_PAGE])?;
        // SAFETY: `memory` lives as long as the mapping (dropped after unmap, in Drop), and
        // `device..device + GPU_PAGE` lies inside it.
        let (mh, va) = unsafe { gdr.pin_and_map(device, GPU_PAGE) }?;
        Ok(Self {
            gdr: Arc::clone(gdr),
            mh,
            va,
            device,
            memory,
        })
    }

    /// The GPU address of byte `offset`.
    pub(crate) fn device_ptr(&self, offset: usize) -> u64 {
        self.device + offset as u64
    }

    /// Reads `out.len()` u64s starting at slot `first`, in one bulk BAR read.
    pub(crate) fn read(&self, first: usize, out: &mut [u64]) {
        assert!(first + out.len() <= GPU_PAGE / 8);
        // SAFETY: u64s are plain bytes; the byte view covers exactly `out`.
        let bytes =
            unsafe { std::slice::from_raw_parts_mut(out.as_mut_ptr().cast::<u8>(), out.len() * 8) };
        // SAFETY: the span was checked to lie inside the live mapping.
        unsafe {
            self.gdr
                .copy_from_mapping(self.mh, bytes, self.va.add(first * 8))
        };
    }

    /// Writes slot `i` (a CPU producer; not atomic with a GPU writing the same slot).
    pub(crate) fn write(&self, i: usize, value: u64) {
        assert!(i < GPU_PAGE / 8);
        // SAFETY: in bounds of the live mapping (checked).
        unsafe {
            self.gdr
                .copy_to_mapping(self.mh, self.va.add(i * 8), &value.to_ne_bytes())
        };
    }
}

impl Drop for GdrMapping {
    fn drop(&mut self) {
        // SAFETY: mapped in new, unmapped once, before `memory` is freed.
        unsafe { self.gdr.unmap(self.mh, self.va, GPU_PAGE) };
        let _ = &self.memory;
    }
}

/// One block of slots; its address never changes while it lives.
pub(crate) enum Block {
    Host(Box<[AtomicU64]>),
    Mapped {
        cuda: Arc<Cuda>,
        host: *mut u8,
        device: u64,
    },
    Gdr(GdrMapping),
}

// SAFETY: a mapped block is plain page-locked memory accessed only through atomics; a GDRCopy
// block is a BAR mapping accessed only through GDRCopy's copy routines; the raw pointers are
// owned by the block and freed once, in Drop.
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

    pub(crate) fn gdr(gdr: &Arc<gdrcopy_sys::Gdr>, device: u32) -> Result<Self, String> {
        GdrMapping::new(gdr, device).map(Self::Gdr)
    }

    /// The atomic cell of slot `i`, for the kinds the CPU can address directly.
    fn cell(&self, i: usize) -> Option<&AtomicU64> {
        assert!(i < SLOTS_PER_BLOCK);
        match self {
            Self::Host(slots) => Some(&slots[i]),
            // SAFETY: the block holds SLOTS_PER_BLOCK zeroed, 8-byte aligned u64s (page-locked
            // allocations are page aligned) for as long as it lives; every access is atomic.
            Self::Mapped { host, .. } => Some(unsafe { &*(host.cast::<AtomicU64>().add(i)) }),
            Self::Gdr(_) => None,
        }
    }

    /// Slot `i`'s value.
    pub(crate) fn load(&self, i: usize) -> u64 {
        match (self.cell(i), self) {
            (Some(cell), _) => cell.load(Ordering::Acquire),
            (None, Self::Gdr(m)) => {
                let mut v = [0u64];
                m.read(i, &mut v);
                fence(Ordering::Acquire);
                v[0]
            }
            (None, _) => unreachable!("only GDRCopy blocks have no cells"),
        }
    }

    /// Sets slot `i` (a CPU producer).
    pub(crate) fn store(&self, i: usize, value: u64) {
        match (self.cell(i), self) {
            (Some(cell), _) => cell.store(value, Ordering::Release),
            (None, Self::Gdr(m)) => {
                fence(Ordering::Release);
                m.write(i, value);
            }
            (None, _) => unreachable!("only GDRCopy blocks have no cells"),
        }
    }

    /// Adds to slot `i`; returns the new value. Atomic for host and device-mapped memory; a
    /// read-modify-write over the BAR for GPU memory (GPU-memory slots are meant for GPU
    /// producers; a CPU must not bump one a kernel also writes).
    pub(crate) fn add(&self, i: usize, delta: u64) -> u64 {
        match self.cell(i) {
            Some(cell) => cell.fetch_add(delta, Ordering::AcqRel).wrapping_add(delta),
            None => {
                let new = self.load(i).wrapping_add(delta);
                self.store(i, new);
                new
            }
        }
    }

    /// Reads slots `first..first + out.len()`: one bulk read for GPU memory, then an acquire
    /// fence so whatever the slots publish is read after them.
    pub(crate) fn read_span(&self, first: usize, out: &mut [u64]) {
        assert!(first + out.len() <= SLOTS_PER_BLOCK);
        match self {
            Self::Gdr(m) => {
                m.read(first, out);
                fence(Ordering::Acquire);
            }
            _ => {
                for (k, v) in out.iter_mut().enumerate() {
                    *v = self
                        .cell(first + k)
                        .expect("CPU-addressable")
                        .load(Ordering::Acquire);
                }
            }
        }
    }

    /// The CPU address of slot `i` (for GPU memory: inside the BAR mapping, uncached).
    pub(crate) fn host_ptr(&self, i: usize) -> *mut u64 {
        assert!(i < SLOTS_PER_BLOCK);
        match self {
            Self::Gdr(m) => m.va.cast::<u64>().wrapping_add(i),
            _ => self.cell(i).expect("CPU-addressable").as_ptr(),
        }
    }

    pub(crate) fn device_ptr(&self, i: usize) -> Option<u64> {
        match self {
            Self::Host(_) => None,
            Self::Mapped { device, .. } => Some(device + 8 * i as u64),
            Self::Gdr(m) => Some(m.device_ptr(8 * i)),
        }
    }

    pub(crate) fn kind(&self) -> MemoryKind {
        match self {
            Self::Host(_) => MemoryKind::Host,
            Self::Mapped { .. } => MemoryKind::DeviceMapped,
            Self::Gdr(_) => MemoryKind::GpuGdrcopy,
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

/// What changed in one pass over a block: for each watched slot (its index within the span
/// and the value last seen), the slots whose value differs now, as `(index, old, new)`; the
/// value last seen is updated. Shared by every kind of memory; pure.
pub(crate) fn changed<'a>(
    watched: impl Iterator<Item = (usize, &'a mut u64)>,
    first: usize,
    now: &[u64],
    out: &mut Vec<(usize, u64, u64)>,
) {
    for (index, last) in watched {
        let Some(&value) = index.checked_sub(first).and_then(|k| now.get(k)) else {
            continue;
        };
        if value != *last {
            out.push((index, *last, value));
            *last = value;
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn only_watched_slots_that_moved_are_reported_and_remembered() {
        let mut last = [5u64, 0, 9];
        let now = [5u64, 7, 1, 3];
        let mut out = Vec::new();
        // Slots 10, 11 and 13 watched; the span read starts at slot 10.
        let watched = [10usize, 11, 13].into_iter().zip(last.iter_mut());
        changed(watched, 10, &now, &mut out);
        assert_eq!(out, vec![(11, 0, 7), (13, 9, 3)]);
        assert_eq!(last, [5, 7, 3]);
        out.clear();
        changed(
            [10usize, 11, 13].into_iter().zip(last.iter_mut()),
            10,
            &now,
            &mut out,
        );
        assert!(out.is_empty(), "nothing moved since");
        // A slot outside the span read is left alone.
        changed(
            [2usize].into_iter().zip([0u64].iter_mut()),
            10,
            &now,
            &mut out,
        );
        assert!(out.is_empty());
    }

    #[test]
    fn host_blocks_read_spans_and_add_atomically() {
        let b = Block::host();
        b.store(3, 40);
        assert_eq!(b.add(3, 2), 42);
        let mut span = [0u64; 3];
        b.read_span(2, &mut span);
        assert_eq!(span, [0, 42, 0]);
        assert_eq!(b.kind().name(), "host");
        assert_eq!(b.device_ptr(0), None);
    }
}
