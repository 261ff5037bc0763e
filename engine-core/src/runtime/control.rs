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
    pub(crate) fn take(&self, id_if_posted: impl FnOnce() -> (u64, u64)) -> Result<()> {
        let mut s = self.lock();
        if s.cancel_requested {
            return Err(Error::Cancelled);
        }
        let (id, requests) = id_if_posted();
        s.id = Some(id);
        s.status = TransferStatus::Posted { requests };
        Ok(())
    }

    /// The transfer finished with `result`.
    pub(crate) fn finish(&self, result: &Result<()>) {
        let mut s = self.lock();
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
            shared.submit(Command::Cancel {
                control: Arc::clone(&self.control),
            })?;
        }
        let deadline = Instant::now() + self.bound;
        let mut s = self.control.lock();
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
