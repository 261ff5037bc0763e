//! The errors every operation reports.
//!
//! Caller mistakes (detected before anything is posted), peer or wire problems and backend
//! failures are separate variants, so a caller can tell "my bug" from "their bug" from "the
//! NIC said no" without parsing strings.

use std::time::Duration;

use crate::wire::{DecodeError, NetAddr};

/// Everything that can go wrong in xfer.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[non_exhaustive]
pub enum Error {
    /// The caller passed something that can never work (checked locally, nothing was posted).
    #[error("invalid argument: {0}")]
    InvalidArgument(String),
    /// An offset/length pair reaches past the end of a registered region (nothing was posted).
    #[error("{side} range {offset}+{len} is past the end of a region of {region_len} bytes")]
    OutOfBounds {
        /// `"source"` or `"destination"`.
        side: &'static str,
        /// The first byte asked for.
        offset: u64,
        /// The number of bytes asked for.
        len: u64,
        /// The size of the registered region.
        region_len: u64,
    },
    /// A local memory-region handle that is not (or no longer) registered with this engine.
    #[error("memory region handle {0} is not registered with this engine")]
    UnknownHandle(u64),
    /// A peer group handle that this engine did not create.
    #[error("peer group {0} is unknown to this engine")]
    UnknownPeerGroup(u64),
    /// A handle (memory region or peer group) that another engine created.
    #[error("{what} handle {id} belongs to engine {owner}, not to this engine ({this})")]
    ForeignHandle {
        /// `"memory region"` or `"peer group"`.
        what: &'static str,
        /// The handle's id.
        id: u64,
        /// The engine that created it.
        owner: u32,
        /// The engine it was passed to.
        this: u32,
    },
    /// Too much work is outstanding (`worker.max_outstanding`); nothing was queued. Retry
    /// after some completes, or wait with `TransferEngine::wait_for_capacity`.
    #[error(
        "busy: {outstanding} operations outstanding, the limit is {limit} (worker.max_outstanding)"
    )]
    Busy {
        /// Operations accepted and not yet finished.
        outstanding: usize,
        /// The configured limit.
        limit: usize,
    },
    /// An expectation timed out while the ImmCounter had dropped arrivals because its table of
    /// immediates nobody waited for was full (`worker.max_idle_imms`): its arrivals may be
    /// among them.
    #[error("timed out after {timeout:?}, and {dropped} arrivals were dropped because the table of unexpected immediates was full (worker.max_idle_imms)")]
    ArrivalsDropped {
        /// The expectation's timeout.
        timeout: Duration,
        /// Arrivals dropped so far.
        dropped: u64,
    },
    /// The worker thread failed (a backend or a user sink panicked); everything in flight
    /// failed with this, the Domains were closed, and the engine accepts no more work.
    #[error("the engine's worker failed: {0}")]
    WorkerFailed(String),
    /// A serialized `NetAddr` or `MrDesc` could not be decoded.
    #[error("malformed {what}: {source}")]
    Decode {
        /// What was being decoded.
        what: &'static str,
        /// Why it was rejected.
        source: DecodeError,
    },
    /// The configuration file is unusable.
    #[error(transparent)]
    Config(#[from] crate::config::ConfigError),
    /// A backend plugin could not be found or loaded.
    #[error(transparent)]
    Plugin(#[from] crate::plugin::PluginError),
    /// The remote NIC refused the access (bad rkey, out of bounds, missing permission).
    #[error("remote access error: {0}")]
    RemoteAccess(String),
    /// The peer could not be reached, stopped answering, or went away (the backend's
    /// message names the peer).
    #[error("peer unreachable: {0}")]
    PeerUnreachable(String),
    /// The operation did not finish within its deadline.
    #[error("timed out after {0:?}")]
    Timeout(Duration),
    /// A transfer's data landed, but its notification was not taken within the deadline:
    /// the peer has no receive buffers posted (it never called `listen_notifications` or
    /// `submit_recvs`, or every buffer is in use), or it stopped answering.
    #[error("the data landed, but {peer} took no notification within {waited:?}: it is not listening (a receiver calls listen_notifications or submit_recvs before notified transfers reach it)")]
    NotListening {
        /// The peer the notification was for (its main address).
        peer: NetAddr,
        /// How long the notification's send waited.
        waited: Duration,
    },
    /// The backend reported a failure of its own.
    #[error("backend {backend}: {message}")]
    Backend {
        /// Backend name.
        backend: String,
        /// The backend's own message (status names, provider text).
        message: String,
    },
    /// A watcher slot could not be allocated.
    #[error(transparent)]
    Watcher(#[from] uvm_watcher::WatcherError),
    /// The feature is not available in this build or on this machine.
    #[error("not available: {0}")]
    NotAvailable(String),
    /// The engine is shutting down; the operation was not carried out.
    #[error("the engine is shut down")]
    Shutdown,
    /// The operation was cancelled (`TransferHandle::cancel`) before it completed.
    #[error("cancelled")]
    Cancelled,
}

impl Error {
    /// The variant's name in snake case (a stable label for metrics and logs).
    pub fn kind(&self) -> &'static str {
        match self {
            Error::InvalidArgument(_) => "invalid_argument",
            Error::OutOfBounds { .. } => "out_of_bounds",
            Error::UnknownHandle(_) => "unknown_handle",
            Error::UnknownPeerGroup(_) => "unknown_peer_group",
            Error::ForeignHandle { .. } => "foreign_handle",
            Error::Busy { .. } => "busy",
            Error::ArrivalsDropped { .. } => "arrivals_dropped",
            Error::WorkerFailed(_) => "worker_failed",
            Error::Decode { .. } => "decode",
            Error::Config(_) => "config",
            Error::Plugin(_) => "plugin",
            Error::RemoteAccess(_) => "remote_access",
            Error::PeerUnreachable(_) => "peer_unreachable",
            Error::Timeout(_) => "timeout",
            Error::NotListening { .. } => "not_listening",
            Error::Backend { .. } => "backend",
            Error::Watcher(_) => "watcher",
            Error::NotAvailable(_) => "not_available",
            Error::Shutdown => "shutdown",
            Error::Cancelled => "cancelled",
        }
    }
}

/// Shorthand for results in this crate.
pub type Result<T, E = Error> = std::result::Result<T, E>;
