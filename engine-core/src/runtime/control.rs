//! Status and cancel of one transfer: the state its handle reads, which the worker moves
//! forward (queued → posted → done / failed / cancelled) and the transfer's completion ends.

use std::sync::{Arc, Condvar, Mutex, Weak};
use std::time::{Duration, Instant};

use super::{Command, Shared};
use crate::error::{Error, Result};

/// Where a transfer is.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum TransferStatus {
    /// Accepted, not yet taken by the worker.
    Queued,
    /// Its work requests (`requests` of them) were handed to the NICs.
    Posted {
        /// Work requests the transfer was split into.
        requests: u64,
    },
    /// Completed successfully.
    Done,
    /// Failed with this error.
    Failed(Error),
    /// Cancelled before it completed.
    Cancelled,
}

/// What one transfer did, for tracing a slow request (as the Python completion reports).
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct Telemetry {
    /// When it was submitted (`None` until the worker took it).
    pub submitted: Option<Instant>,
    /// When the worker handed its work requests to the NICs.
    pub posted: Option<Instant>,
    /// When it finished (done, failed or cancelled).
    pub completed: Option<Instant>,
    /// Bytes it moves.
    pub bytes: u64,
    /// Work requests it was split into (pages, stripes, destinations).
    pub requests: u64,
    /// The NICs (indices in the DomainGroup) its requests went to.
    pub nics: Vec<usize>,
}

impl Telemetry {
    /// From submit to posted.
    pub fn post_duration(&self) -> Option<Duration> {
        Some(self.posted?.saturating_duration_since(self.submitted?))
    }

    /// From submit to completion.
    pub fn duration(&self) -> Option<Duration> {
        Some(self.completed?.saturating_duration_since(self.submitted?))
    }
}

impl TransferStatus {
    fn is_final(&self) -> bool {
        matches!(self, Self::Done | Self::Failed(_) | Self::Cancelled)
    }
}

#[derive(Debug)]
struct State {
    status: TransferStatus,
    /// The tracker id, once posted.
    id: Option<u64>,
    cancel_requested: bool,
    telemetry: Telemetry,
}

/// Shared by a [`TransferHandle`] and the transfer's `OnDone`.
#[derive(Debug)]
pub struct TransferControl {
    state: Mutex<State>,
    changed: Condvar,
}

impl TransferControl {
    fn lock(&self) -> std::sync::MutexGuard<'_, State> {
        // Every method leaves the state whole before it can panic: poisoning is ignored.
        self.state.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// The worker took the transfer: `Err(Cancelled)` if it was cancelled while queued (it
    /// is then not posted), else it is posted as `id`.
    pub(crate) fn take(&self, id_if_posted: impl FnOnce() -> (u64, Telemetry)) -> Result<()> {
        let mut s = self.lock();
        if s.cancel_requested {
            return Err(Error::Cancelled);
        }
        let (id, telemetry) = id_if_posted();
        s.id = Some(id);
        s.status = TransferStatus::Posted {
            requests: telemetry.requests,
        };
        s.telemetry = telemetry;
        Ok(())
    }

    /// The transfer finished with `result`.
    pub(crate) fn finish(&self, result: &Result<()>) {
        let mut s = self.lock();
        s.telemetry.completed = Some(Instant::now());
        s.status = match result {
            Ok(()) => TransferStatus::Done,
            Err(Error::Cancelled) => TransferStatus::Cancelled,
            Err(e) => TransferStatus::Failed(e.clone()),
        };
        self.changed.notify_all();
    }

    /// The tracker id, if posted and a cancel was asked for.
    pub(crate) fn posted_id(&self) -> Option<u64> {
        self.lock().id
    }
}

/// Watches and cancels one transfer; see
/// [`TransferEngine::cancellable`](crate::TransferEngine::cancellable).
#[derive(Clone, Debug)]
pub struct TransferHandle {
    control: Arc<TransferControl>,
    shared: Weak<Shared>,
    /// How long `cancel` waits for the NICs to let go of a posted transfer.
    bound: Duration,
}

impl TransferHandle {
    pub(crate) fn new(shared: &Arc<Shared>) -> (Self, Arc<TransferControl>) {
        let control = Arc::new(TransferControl {
            state: Mutex::new(State {
                status: TransferStatus::Queued,
                id: None,
                cancel_requested: false,
                telemetry: Telemetry::default(),
            }),
            changed: Condvar::new(),
        });
        let bound = shared.config.timeouts.transfer() + shared.config.timeouts.control();
        (
            Self {
                control: Arc::clone(&control),
                shared: Arc::downgrade(shared),
                bound,
            },
            control,
        )
    }

    /// Where the transfer is now.
    pub fn status(&self) -> TransferStatus {
        self.control.lock().status.clone()
    }

    /// When it was submitted, posted and completed, and what it moved (filled in as it
    /// goes: nothing until the worker takes it).
    pub fn telemetry(&self) -> Telemetry {
        self.control.lock().telemetry.clone()
    }

    /// Cancels the transfer. One still queued fails at once with [`Error::Cancelled`] and is
    /// never posted. A posted one cannot be recalled from a NIC: its requests not yet handed
    /// to a NIC are dropped, and this returns once the NICs are done with the rest (their
    /// completions, or the transfer's timeout) — after that no NIC touches its memory — with
    /// the transfer completed as `Cancelled` unless it had completed before. Exactly one
    /// completion either way. Returns the final status.
    pub fn cancel(&self) -> Result<TransferStatus> {
        {
            let mut s = self.control.lock();
            if s.status.is_final() {
                return Ok(s.status.clone());
            }
            s.cancel_requested = true;
        }
        if let Some(shared) = self.shared.upgrade() {
            // An expectation (expect_imm_count) ends at once, its arrivals owed as after a
            // timeout; anything else is the worker's to cancel.
            let expectation = shared
                .lock_imm()
                .cancel_where(|w| w.control().is_some_and(|c| Arc::ptr_eq(c, &self.control)));
            match expectation {
                Some(waiter) => waiter.complete(Err(Error::Cancelled), &shared.jobs),
                None => shared.submit(Command::Cancel {
                    control: Arc::clone(&self.control),
                })?,
            }
        }
        let deadline = Instant::now() + self.bound;
        let mut s = self.control.lock();
        // On the worker's own thread (inside a waker) the worker carries the cancel out after
        // this pass: the status as it is now, not a wait for itself.
        if self
            .shared
            .upgrade()
            .is_some_and(|shared| shared.on_worker_thread())
        {
            return Ok(s.status.clone());
        }
        while !s.status.is_final() {
            let left = deadline.saturating_duration_since(Instant::now());
            if left.is_zero() {
                return Err(Error::Timeout(self.bound));
            }
            s = self
                .control
                .changed
                .wait_timeout(s, left)
                .unwrap_or_else(|p| p.into_inner())
                .0;
        }
        Ok(s.status.clone())
    }
}
