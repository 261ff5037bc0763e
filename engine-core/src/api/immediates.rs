//! Counting arrivals of immediates: expectations, mirrors, the counts and their debts.

use super::*;

impl TransferEngine {
    /// Calls `on_done` once `count` writes carrying `imm` have landed here (counting those
    /// that landed before this call), consuming them; fails with `Timeout` after
    /// `timeouts.expect_ms`.
    ///
    /// Expectations on one immediate are met in registration order. **An expectation that
    /// times out still owes its arrivals**: late arrivals of the transfer it waited for are
    /// absorbed when they land, never counted for a later expectation on the same immediate
    /// (which would then complete early, with none of its own data). If they never land (the
    /// sender's transfer failed), later expectations on that immediate time out too; once the
    /// peers agree that nothing more is in flight, [`reset_imm`](Self::reset_imm) clears it.
    pub fn expect_imm_count(&self, imm: u32, count: u64, on_done: impl Into<OnDone>) -> Result<()> {
        let mut counter = self.shared.lock_imm();
        // Read under the lock: a worker reading the deadlines to park sees this one or parks
        // no longer than the timeout from a moment before it (see below).
        let deadline = Instant::now() + self.shared.config.timeouts.expect();
        // Checked under the counter's lock: the worker sets it before draining expectations.
        if let Some(why) = self.shared.failed.get() {
            return Err(Error::WorkerFailed(why.clone()));
        }
        let ready = counter.expect(imm, count, deadline, on_done.into());
        drop(counter);
        // A parked worker needs no wake-up for this deadline: it parks no longer than
        // `timeouts.expect_ms` after it read the deadlines (see `runtime/schedule.rs`), so it
        // wakes by itself before this is due.
        if let Some(w) = ready {
            w.complete(Ok(()), &self.shared.jobs);
        }
        Ok(())
    }

    /// Mirrors the running total of `imm`'s arrivals (consumed or not) into `sink`, called on
    /// the worker thread after each batch in which some arrived (and once now). Keep it to a
    /// store: the typical sink is `GpuCounter::set`, so a GPU kernel can poll "all pages of
    /// layer k have arrived" in its own memory.
    pub fn mirror_imm_count(
        &self,
        imm: u32,
        sink: impl Fn(u64) + Send + Sync + 'static,
    ) -> Result<()> {
        let mirror = Mirror::new(sink);
        // Registered under the counter's lock, so no arrival slips between the first report
        // and the registration; reported after both locks are released (the sink is user
        // code). A racing report from the worker is ordered by the sink's own high-water mark.
        let total = {
            let mut counter = self.shared.lock_imm();
            let total = counter.track_total(imm);
            self.shared
                .mirrors
                .write()
                .unwrap_or_else(|p| p.into_inner())
                .entry(imm)
                .or_default()
                .push(Arc::clone(&mirror));
            self.shared.has_mirrors.store(true, Ordering::Release);
            total
        };
        mirror.report(imm, total);
        Ok(())
    }

    /// Arrivals of `imm` counted and not yet consumed by an expectation.
    pub fn imm_count(&self, imm: u32) -> u64 {
        self.shared.lock_imm().count(imm)
    }

    /// Arrivals of `imm` still owed to expectations that timed out (absorbed when they land).
    pub fn imm_owed(&self, imm: u32) -> u64 {
        self.shared.lock_imm().owed(imm)
    }

    /// Arrivals the ImmCounter dropped because its table of immediates nobody waited for was
    /// full (`worker.max_idle_imms`).
    pub fn imm_dropped(&self) -> u64 {
        self.shared.lock_imm().dropped()
    }

    /// From now on, an arrival of an immediate `imm` with `imm & mask == value` is counted
    /// only from `senders` (NIC addresses, as in a peer's region descriptors) or from a sender
    /// the transport does not name; arrivals from others are refused and counted in
    /// [`imm_refused`](Self::imm_refused). `None` lifts it. For immediates that only known
    /// peers send (an EP group's, one family per source rank): a zero-byte write carrying one
    /// costs its sender nothing, and would tell the waiter that data landed which did not.
    /// Which transports name senders: docs/security.md ("Immediates nobody waits for").
    pub fn restrict_imm_senders(&self, mask: u32, value: u32, senders: Option<Vec<NetAddr>>) {
        self.shared
            .lock_imm()
            .restrict_senders(mask, value, senders)
    }

    /// Arrivals refused by [`restrict_imm_senders`](Self::restrict_imm_senders).
    pub fn imm_refused(&self) -> u64 {
        self.shared.lock_imm().refused()
    }

    /// Forgets `imm`'s unconsumed arrivals and what timed-out expectations still owe. Call it
    /// only once the peers agree that no write carrying `imm` is in flight (e.g. after a
    /// barrier on another immediate, or after the sender's transfers all finished): an
    /// arrival that lands after the reset counts for the next expectation. Waiting
    /// expectations keep waiting for new arrivals.
    pub fn reset_imm(&self, imm: u32) -> ResetReport {
        self.shared.lock_imm().reset(imm)
    }
}
