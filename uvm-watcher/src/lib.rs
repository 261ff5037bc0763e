//! # uvm-watcher (not built yet)
//!
//! A GPU kernel bumps a u64 in host-visible memory; a pinned CPU thread sees the change and
//! fires a callback (start the RDMA of a layer the moment it is computed). Until it lands,
//! `TransferEngine::alloc_uvm_watcher` returns `Error::NotAvailable`.

/// What this crate will provide.
pub const STATUS: &str = "planned: GPU-to-CPU watcher slots with a host-memory fallback";
