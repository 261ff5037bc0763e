//! # uvm-watcher: watch u64 slots, fire a callback on every change
//!
//! A producer — a GPU kernel writing device-mapped host memory, or a CPU thread — bumps a
//! 64-bit value; one polling thread per [`WatcherPool`], pinned to a configured CPU, sees the
//! change and calls the slot's callback with `(old, new)`. The typical use: start the RDMA of
//! a layer's KV pages the moment the GPU has computed it, while the next layer computes.
//!
//! **Coalescing.** The poller reads each slot once per pass. If a producer writes several
//! times between two reads, the callback sees one `(old, new)` pair spanning them: no change
//! is lost (the callback always learns the latest value and where it moved from), but
//! intermediate values may be skipped. Producers that need every step counted should
//! increment a counter (as GPUs do) and consumers should look at `new - old`.
//!
//! **Memory.** Slots live in blocks of 512 (one 4 KiB page) that never move while the pool
//! lives. On machines without CUDA the blocks are ordinary host memory — a real feature for
//! CPU producers, not a stub. With a CUDA driver present (feature `cuda`, loaded at run time)
//! they are page-locked, device-mapped host memory and [`Watcher::device_ptr`] gives the
//! address a kernel writes.
//!
//! **Threads.** The poller spins while any slot is active and parks when none is. A callback
//! returns [`Control::Stop`] to free its slot; dropping the [`Watcher`] frees it too.

mod counter;
mod memory;
mod pool;

pub use counter::{CounterMemory, GpuCounter};
pub use memory::{MemoryKind, SLOTS_PER_BLOCK};
pub use pool::{probe, Control, MemoryChoice, PoolConfig, Watcher, WatcherPool};

/// Whether a CUDA driver library is present (device-mapped slots are possible).
pub fn cuda_driver_present() -> bool {
    xfer_cuda::driver_present()
}

/// Why a pool or watcher could not be created.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[non_exhaustive]
pub enum WatcherError {
    /// The pool's memory could not be allocated.
    #[error("cannot allocate watcher memory: {0}")]
    Memory(String),
    /// The polling thread could not be started or pinned.
    #[error("cannot start the watcher thread: {0}")]
    Thread(String),
    /// The pool already serves its maximum number of slots.
    #[error("all {0} watcher slots are in use")]
    Full(usize),
}
