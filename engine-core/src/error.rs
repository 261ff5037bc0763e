//! The errors every operation reports.
//!
//! Caller mistakes (detected before anything is posted), peer or wire problems and backend
//! failures are separate variants, so a caller can tell "my bug" from "their bug" from "the
//! NIC said no" without parsing strings.

use std::time::Duration;

use crate::domain::{DomainError, DomainErrorKind};
use crate::wire::{DecodeError, NetAddr};

/// Everything that can go wrong in xfer.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[non_exhaustive]
pub enum Error {
    /// The caller passed something that can never work (checked locally, nothing was posted).
    #[error("invalid argument: {0}")]
    InvalidArgument(String),
    /// The backend cannot do what the caller asked (a request its declared capabilities rule
    /// out, or one its NIC refused as malformed): a caller mistake, not a failure of the
    /// peer or the NIC; that request was not carried out.
    #[error("backend {backend} refused the request: {}", source.message)]
    Refused {
        /// Backend name.
        backend: String,
        /// The refusal, in the backend's words (kind [`DomainErrorKind::InvalidArgument`]).
        source: DomainError,
    },
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
    /// The remote NIC refused the access (bad rkey, out of bounds, missing permission): the
    /// backend's error, with its words and, where it knows, its cause (a NIC status).
    #[error("remote access error: {}", .0.message)]
    RemoteAccess(#[source] DomainError),
    /// The peer could not be reached, stopped answering, or went away: the backend's error
    /// (its message names the peer; its cause, where known, is the NIC's status or errno).
    #[error("peer unreachable: {}", .0.message)]
    PeerUnreachable(#[source] DomainError),
    /// The operation did not finish within its deadline: the one given (the caller's, the
    /// configured `timeouts`), or the backend's own that it reported.
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
    /// The backend reported a failure of its own (its `source` says which kind, in its own
    /// words, and what it came from where it knows: an errno, a NIC status).
    #[error("backend {backend}: {}", source.message)]
    Backend {
        /// Backend name.
        backend: String,
        /// The backend's failure.
        source: DomainError,
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
    /// A call that waits for the engine's worker (registration, statistics, a wait) was made
    /// on the worker's own thread — inside a flag's waker or a mirror sink — where it would
    /// wait for itself: make it from another thread (see docs/api.md, "Where your code runs").
    #[error("{0} was called on the engine's worker thread (from a flag's waker or a mirror sink), where it would wait for itself")]
    OnWorkerThread(&'static str),
}

impl Error {
    /// The variant's name in snake case (a stable label for metrics and logs).
    pub fn kind(&self) -> &'static str {
        match self {
            Error::InvalidArgument(_) => "invalid_argument",
            Error::Refused { .. } => "refused",
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
            Error::OnWorkerThread(_) => "on_worker_thread",
        }
    }

    /// A failure of backend `backend` that is the engine's own doing around it (a thread it
    /// could not start), caused by the operating system's `e`.
    pub(crate) fn backend_io(backend: &str, what: &str, e: &std::io::Error) -> Self {
        let mut source = DomainError::new(DomainErrorKind::Other, format!("{what}: {e}"));
        if let Some(errno) = e.raw_os_error() {
            source = source.with_cause(crate::domain::DomainCause::Os(errno));
        }
        Error::Backend {
            backend: backend.to_owned(),
            source,
        }
    }

    /// A remote access refused, as the engine itself names it (`message`).
    pub(crate) fn remote_access(message: impl Into<String>) -> Self {
        Error::RemoteAccess(DomainError::new(DomainErrorKind::RemoteAccess, message))
    }

    /// A failure of backend `backend` that the engine found (the backend broke its contract),
    /// named by `message`.
    pub(crate) fn backend_other(backend: &str, message: impl Into<String>) -> Self {
        Error::Backend {
            backend: backend.to_owned(),
            source: DomainError::new(DomainErrorKind::Other, message),
        }
    }
}

/// Shorthand for results in this crate.
pub type Result<T, E = Error> = std::result::Result<T, E>;

#[cfg(test)]
mod tests {
    use std::error::Error as _;

    use super::*;
    use crate::domain::DomainCause;
    use crate::runtime::dispatch::map_domain_error;

    #[test]
    fn a_backend_failure_keeps_its_kind_and_cause_as_its_source() {
        let failed = DomainError::new(DomainErrorKind::Other, "ibv_post_send: Cannot allocate")
            .with_cause(DomainCause::Os(12));
        let e = map_domain_error("verbs", failed.clone());
        assert!(
            matches!(&e, Error::Backend { backend, source } if backend == "verbs" && *source == failed),
            "{e:?}"
        );
        let source = e.source().expect("the Domain's error is the source");
        let domain = source.downcast_ref::<DomainError>().expect("a DomainError");
        assert_eq!(domain.kind, DomainErrorKind::Other);
        let cause = source.source().expect("the errno is the source's source");
        assert_eq!(
            cause.downcast_ref::<DomainCause>(),
            Some(&DomainCause::Os(12))
        );
        assert_eq!(
            domain.cause.and_then(|c| c.io_error()).map(|io| io.kind()),
            Some(std::io::ErrorKind::OutOfMemory)
        );
        assert_eq!(
            e.to_string(),
            "backend verbs: ibv_post_send: Cannot allocate"
        );
    }

    #[test]
    fn a_peer_failure_keeps_the_nics_status() {
        let flushed = DomainError::new(DomainErrorKind::PeerUnreachable, "WR_FLUSH_ERR from peer")
            .with_cause(DomainCause::Status(5));
        let e = map_domain_error("verbs", flushed.clone());
        assert!(
            matches!(&e, Error::PeerUnreachable(d) if *d == flushed),
            "{e:?}"
        );
        assert_eq!(e.to_string(), "peer unreachable: WR_FLUSH_ERR from peer");
        let cause = e.source().and_then(|s| s.source());
        assert_eq!(
            cause.and_then(|c| c.downcast_ref::<DomainCause>()),
            Some(&DomainCause::Status(5))
        );
    }

    #[test]
    fn a_backend_timeout_carries_the_deadline_it_reported() {
        let after = Duration::from_millis(1500);
        let e = map_domain_error(
            "efa",
            DomainError::timed_out(after, "no reply to the connect"),
        );
        assert_eq!(e, Error::Timeout(after));
        // One that does not say how long it waited claims no length: it stays the backend's.
        let silent = DomainError::new(DomainErrorKind::Timeout, "gave up");
        let e = map_domain_error("plugin", silent);
        assert!(
            matches!(&e, Error::Backend { source, .. } if source.kind == DomainErrorKind::Timeout),
            "{e:?}"
        );
    }

    #[test]
    fn a_backend_refusing_the_request_is_the_callers_mistake_not_a_failure() {
        let e = map_domain_error("mock", crate::domain::refuse_read());
        assert!(
            matches!(&e, Error::Refused { backend, source }
                if backend == "mock" && source.kind == DomainErrorKind::InvalidArgument),
            "{e:?}"
        );
        assert_eq!(e.kind(), "refused");
        assert!(e.source().is_some());
        for (kind, name) in [
            (DomainErrorKind::RemoteAccess, "remote_access"),
            (DomainErrorKind::PeerUnreachable, "peer_unreachable"),
            (DomainErrorKind::Other, "backend"),
            (DomainErrorKind::Fatal, "backend"),
        ] {
            assert_eq!(
                map_domain_error("mock", DomainError::new(kind, "x")).kind(),
                name
            );
        }
    }

    #[test]
    fn an_os_failure_around_a_backend_keeps_its_errno() {
        let io = std::io::Error::from_raw_os_error(11);
        let e = Error::backend_io("mock", "cannot spawn the worker thread", &io);
        assert!(
            matches!(&e, Error::Backend { source, .. } if source.cause == Some(DomainCause::Os(11))),
            "{e:?}"
        );
    }
}
