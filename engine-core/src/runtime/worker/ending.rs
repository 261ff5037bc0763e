//! How the worker ends: at the shutdown, or failing — the Domains closed first, so no NIC
//! touches registered memory afterwards, then everything it holds finished with the reason.

use std::panic::{catch_unwind, AssertUnwindSafe};
use std::time::Duration;

use super::Worker;
use crate::error::Error;
use crate::runtime::{local, panic_message, Command, Shared};

impl Worker {
    /// Closes every Domain, so no NIC touches registered memory from here on. A Domain that
    /// panics while closing is abandoned (leaked) rather than half-dropped twice — and then
    /// that promise cannot be kept: the engine says so, and deregistrations from then on keep
    /// (leak) the memory they were to free and fail (see `Shared::domains_abandoned`).
    pub(super) fn close_domains(&mut self) {
        for domain in self.group.domains_mut().drain(..) {
            if let Err(panic) = catch_unwind(AssertUnwindSafe(|| drop(domain))) {
                tracing::error!(panic = %panic_message(&*panic), "a Domain panicked while closing");
                self.shared.abandon_domains();
            }
        }
        self.shared.set_domains_closed();
    }

    /// Fails everything the worker holds with `error`: transfers in flight or parked, and
    /// commands still queued. Deregistrations succeed: the Domains are closed already.
    /// Returns whether a queued shutdown was among them (the engine is being dropped).
    pub(super) fn fail_everything(&mut self, error: &Error) -> bool {
        self.core.fail_everything(error);
        let waiting = self.shared.lock_imm().drain_waiting();
        for w in waiting {
            w.complete_batched(Err(error.clone()), &mut self.callbacks);
        }
        let mut shutdown = false;
        // The commands taken and not yet handled first, then those kept on this thread,
        // then those still queued: in order.
        for cmd in std::mem::take(&mut self.commands) {
            shutdown |= self.refuse(cmd, error);
        }
        // From here on what this thread submits goes to the shared queue, as before the
        // worker ran: refused there (the engine is closed or failed), or by `fail`'s loop.
        for cmd in local::leave() {
            shutdown |= self.refuse(cmd, error);
        }
        while let Some(cmd) = self.shared.queue.pop() {
            shutdown |= self.refuse(cmd, error);
        }
        self.deliver();
        shutdown
    }

    /// Fails `cmd` with `error`; true if it was the shutdown.
    pub(super) fn refuse(&mut self, cmd: Command, error: &Error) -> bool {
        match cmd {
            Command::Listed { on_done, .. }
            | Command::Pages { on_done, .. }
            | Command::Send { on_done, .. } => self.core.finish_now(on_done, Err(error.clone())),
            Command::Register { reply, .. } => {
                let _ = reply.send(Err(error.clone()));
            }
            Command::Deregister { reply, keep, .. } => {
                if self.shared.domains_abandoned() {
                    // An abandoned Domain may still hold the registration: the memory is
                    // never freed.
                    std::mem::forget(keep);
                    let _ = reply.send(Err(Shared::abandoned_error()));
                } else {
                    let _ = reply.send(Ok(()));
                }
            }
            Command::PostRecvs { reply, .. } => {
                if let Some(reply) = reply {
                    let _ = reply.send(Err(error.clone()));
                }
            }
            // Dropping the reply tells the caller the engine is gone.
            Command::Stats { .. } => {}
            // The transfer it names fails with `error` on its own.
            Command::Cancel { .. } => {}
            Command::Shutdown => return true,
        }
        false
    }

    /// The engine is being dropped: Domains close first (on the thread that opened them), and
    /// only then do completions fire, so a caller that frees memory on `Shutdown` is safe.
    pub(super) fn shutdown(mut self) {
        self.close_domains();
        self.fail_everything(&Error::Shutdown);
    }

    /// Something on this thread panicked: contain it (see the module docs).
    pub(super) fn fail(mut self, why: String) {
        tracing::error!(reason = %why, "the xfer worker failed; failing everything in flight");
        self.close_domains();
        let error = Error::WorkerFailed(why.clone());
        // Set before draining expectations: `expect_imm_count` checks it under the same lock.
        let _ = self.shared.failed.set(why);
        // The engine's shutdown may already be queued (dropped while this thread panicked):
        // then that was the last command, and waiting for another would hang the drop.
        if self.fail_everything(&error) {
            return;
        }
        // Serve the queue until the engine is dropped: whatever still arrives is refused.
        loop {
            while let Some(cmd) = self.shared.queue.pop() {
                if matches!(cmd, Command::Shutdown) {
                    self.fail_everything(&Error::Shutdown);
                    return;
                }
                self.refuse(cmd, &error);
                self.deliver();
            }
            self.shared.parking.announce(true);
            if self.shared.queue.is_empty() {
                std::thread::park_timeout(Duration::from_millis(100));
            }
            self.shared.parking.announce(false);
        }
    }
}
