//! # xfer engine-core
//!
//! Point-to-point RDMA transfers for LLM systems: KV-cache pages from prefill to decode,
//! weight sync from trainers to inference GPUs, MoE dispatch/combine to data-dependent peers.
//!
//! ## The model
//! - **Reliable but unordered.** xfer assumes only what both RC (ConnectX, RoCE) and SRD
//!   (AWS EFA) give: every write arrives exactly once, in no particular order.
//! - **Counted completion.** A write may carry a 32-bit immediate. The receiver's
//!   [`ImmCounter`] counts arrivals per immediate; [`TransferEngine::expect_imm_count`] fires
//!   once `n` have landed, whether they came before or after the call.
//! - **Striping.** An engine drives a DomainGroup of 1–4 NICs. Large writes are cut into
//!   aligned chunks across them; pages, scatter destinations and barriers are spread over
//!   them. Every chunk carries the immediate, so the receiver counts one arrival per chunk:
//!   [`expected_arrivals`] tells it how many, from the shape alone, because both sides run
//!   the same pure [`plan`] with the same config and NIC count.
//! - **Typed failure, never a hang.** Every operation returns an [`Error`] for what can be
//!   checked locally, and finishes exactly once through [`OnDone`] — success, or a typed
//!   error — within the configured deadline.
//!
//! ## Example
//! ```
//! use std::time::Duration;
//! use engine_core::{
//!     expected_arrivals, Config, DoneFlag, RdmaOp, Request, TransferEngine, TransferShape,
//! };
//! # backend_mock::link();
//! let config = Config::default(); // the in-process mock backend
//! let (a, b) = (TransferEngine::open(&config)?, TransferEngine::open(&config)?);
//! let mut src = vec![7u8; 4096];
//! let mut dst = vec![0u8; 4096];
//! // SAFETY: both buffers outlive their registrations (deregistered below).
//! let (src_mr, _) = unsafe { a.reg_mr(src.as_mut_ptr(), src.len(), engine_core::Device::Host)? };
//! let (dst_mr, dst_desc) = unsafe { b.reg_mr(dst.as_mut_ptr(), dst.len(), engine_core::Device::Host)? };
//!
//! // The receiver waits for the arrivals of immediate 42 ...
//! let landed = DoneFlag::new();
//! let n = expected_arrivals(TransferShape::Single { len: 4096 }, b.nic_count(), &config.stripe);
//! b.expect_imm_count(42, n, landed.clone())?;
//! // ... the sender writes with it.
//! let write = Request::Single {
//!     op: RdmaOp::Write { imm: Some(42) },
//!     len: 4096,
//!     local: (src_mr, 0),
//!     remote: (&dst_desc, 0),
//! };
//! a.submit(write, DoneFlag::new())?;
//! landed.wait(Duration::from_secs(5))?;
//! assert!(dst.iter().all(|&x| x == 7));
//! a.dereg_mr(src_mr)?;
//! b.dereg_mr(dst_mr)?;
//! # Ok::<(), engine_core::Error>(())
//! ```

mod api;
mod buffer;
pub mod config;
pub mod domain;
mod error;
pub mod group;
pub mod imm;
pub mod metrics;
mod notifications;
pub mod plan;
pub mod plugin;
pub mod regcache;
mod runtime;
pub mod stats;
pub mod wire;

pub use api::{
    MrHandle, Pages, PeerGroupHandle, RemoteAccess, Request, ScatterDst, TransferEngine,
};
pub use buffer::HostBuffer;
pub use config::{Config, NicSelection, RendezvousConfig};
pub use domain::{Device, RdmaOp};
pub use error::{Error, Result};
pub use imm::{ImmCounter, ResetReport};
pub use notifications::Notification;
pub use plan::{expected_arrivals, StripePolicy, TransferShape};
pub use runtime::completion::{DoneCounter, DoneFlag, OnDone};
pub use runtime::control::{Telemetry, TransferHandle, TransferStatus};
pub use stats::{OpKind, Stats};
pub use uvm_watcher::{Control as WatchControl, CounterMemory, GpuCounter, Watcher};
pub use wire::{MrDesc, NetAddr, NOTIFICATION_ID_MAX};
pub use xfer_plugin::export_plugin;
