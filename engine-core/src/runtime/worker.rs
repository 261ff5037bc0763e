//! The worker: one thread per DomainGroup, the only one that calls its Domains, a loop around
//! the [`Dispatch`] core whose scheduling — when to pause, look at the clock, end what timed
//! out, park — is the pure [`Scheduler`] (`schedule.rs`; the loop body is its `step`).
//!
//! Each pass takes the queued commands (transfers and messages go to the core; registrations
//! and the rest it carries out itself, after posting what the core holds, `control.rs`),
//! hands the Domains what `Dispatch::poll_post` returns and the core their answers, retries
//! queued work once, polls the Domains and feeds their events back, counts arrivals into the
//! shared ImmCounter, carries out the core's routing of messages, delivers (`delivery.rs`) —
//! then, once more, posts what its own callbacks and wakers submitted during that delivery
//! (kept on this thread, see `local`). Idle, it parks until the scheduler's `park_until` or a
//! wake.
//!
//! What lives where: the core decides — tracking, backpressure per (NIC, peer), coalescing,
//! deadlines, cancellation, message routing, whether the NICs can register a region — and
//! keeps the statistics; the scheduler decides when; the worker reads the clock (one read per
//! batch of submissions), takes the locks and calls the Domains.
//!
//! Failure containment: each step of the loop runs under `catch_unwind`. If a backend (or
//! anything else on this thread) panics, or a Domain fails for good, the worker closes its
//! Domains first — so no NIC touches registered memory afterwards — then fails everything in
//! flight with `Error::WorkerFailed`, and from then on refuses new work until the engine is
//! dropped (`ending.rs`). User code that runs here (flag wakers, mirror sinks) is caught on
//! its own and never gets that far.

use std::collections::VecDeque;
use std::panic::{catch_unwind, AssertUnwindSafe};
use std::sync::Arc;
use std::time::Duration;

use super::clock::{Anchor, Stamp};
use super::completion::{CallbackBatch, OnDone};
use super::dispatch::{Dispatch, Post, PostAnswer, PostList};
use super::schedule::{step, Passes, Scheduler, Stop};
use super::{local, panic_message, Command, Shared};
use crate::domain::{DomainError, DomainErrorKind, Event, PostStatus};
use crate::group::DomainGroup;
use crate::imm::Outcome;

mod control;
mod delivery;
mod ending;
mod open;
#[cfg(test)]
mod tests;

pub(crate) use open::spawn_worker;

pub(crate) struct Worker {
    shared: Arc<Shared>,
    /// The NICs, driven as one; which group it is (built-in striping or a backend's own)
    /// does not matter here.
    group: Box<dyn DomainGroup>,
    /// Whether every Domain wakes the worker on new events.
    domains_wake: bool,
    /// Some Domain moves only while polled (also to receive): never park.
    needs_polling: bool,
    /// The decisions: tracking, queues, coalescing, deadlines (see `dispatch`).
    core: Dispatch<OnDone>,
    /// Commands taken from the submission queue and not handled yet (see `pass`).
    commands: VecDeque<Command>,
    events: Vec<Event>,
    imm_outcomes: Vec<Outcome<OnDone>>,
    /// Immediates that arrived in one batch of events, for mirrors.
    arrived: Vec<u32>,
    callbacks: CallbackBatch,
    /// The clock as of the current batch of submissions.
    stamp: Stamp,
    /// Turns stamps into `Instant`s and back (the ImmCounter's deadlines, the Domains'
    /// timers).
    anchor: Anchor,
    /// Poll errors that were not fatal, logged at a bounded rate.
    poll_errors: u64,
}

/// Sets the "Domains closed" latch when the worker's thread ends, however it ends (declared
/// before the worker, so dropped after it and its Domains).
struct ClosesDomains(Arc<Shared>);

impl Drop for ClosesDomains {
    fn drop(&mut self) {
        self.0.set_domains_closed();
    }
}

/// The worker's thread, once its Domains are open: steps until the shutdown or a failure.
fn run(worker: Worker) {
    let shared = Arc::clone(&worker.shared);
    let _latch = ClosesDomains(Arc::clone(&shared));
    let mut worker = worker;
    let config = &shared.config;
    let idle_poll = Duration::from_micros(config.worker.idle_poll_us);
    // Domains that cannot wake us and need polling to make progress (libfabric's
    // manual-progress providers) with `idle_poll_us = 0`: never park.
    let never_park = (!worker.domains_wake && idle_poll.is_zero()) || worker.needs_polling;
    // Never parked longer than a new transfer's or expectation's timeout: what is submitted
    // meanwhile is then due no earlier than the worker wakes by itself (an expectation needs
    // no wake-up of its own, see `expect_imm_count`).
    let mut longest = config.timeouts.transfer().min(config.timeouts.expect());
    if !worker.domains_wake {
        longest = longest.min(idle_poll);
    }
    let spin = Duration::from_micros(config.worker.spin_us);
    let mut schedule = Scheduler::new(nanos(spin), nanos(longest), never_park);
    local::enter(&shared);
    let failure = loop {
        match catch_unwind(AssertUnwindSafe(|| step(&mut schedule, &mut worker))) {
            Ok(Ok(())) => {}
            Ok(Err(Stop::Shutdown)) => break None,
            Ok(Err(Stop::Fatal(why))) => break Some(why),
            Err(panic) => break Some(panic_message(&*panic)),
        }
    };
    match failure {
        None => worker.shutdown(),
        Some(why) => worker.fail(why),
    }
}

fn nanos(d: Duration) -> u64 {
    u64::try_from(d.as_nanos()).unwrap_or(u64::MAX)
}

impl Passes for Worker {
    fn pass(&mut self) -> Option<bool> {
        self.rounds()
    }

    fn fatal(&self) -> Option<String> {
        self.core.fatal().cloned()
    }

    fn now(&mut self) -> Stamp {
        Stamp::now()
    }

    fn expire(&mut self, now: Stamp) {
        Worker::expire(self, now);
    }

    fn in_flight(&self) -> bool {
        self.core.in_flight() > 0 || self.core.has_queued()
    }

    /// Between idle polls: by default yield, so that on a small machine the threads we wait
    /// for (submitters, callbacks, peers, a software NIC) get the CPU; with
    /// `worker.yield_when_idle = false` spin instead, for a worker with a core to itself.
    fn pause(&mut self) {
        if self.shared.config.worker.yield_when_idle {
            std::thread::yield_now();
        } else {
            std::hint::spin_loop();
        }
    }

    /// Announce first, then look: a submission or an expectation made concurrently is either
    /// seen here or its submitter sees `parked` and unparks us (both sides `SeqCst`). The
    /// Domains, polled while the worker is announced parked, arm their wake-ups.
    fn announce_park(&mut self) -> bool {
        self.shared.parking.announce(true);
        let idle = self.commands.is_empty()
            && local::is_empty()
            && self.shared.queue.is_empty()
            && !self.poll_domains();
        if !idle {
            self.shared.parking.announce(false);
        }
        idle
    }

    /// A transfer's or an expectation's deadline, or a Domain's own timer (a handshake to
    /// resend, retired queue pairs to free), read after the last poll, which may move it.
    fn next_due(&self) -> Option<Stamp> {
        let anchor = self.anchor;
        let instants = [
            self.shared.lock_imm().next_deadline(),
            self.group
                .domains()
                .iter()
                .filter_map(|d| d.poll_timeout())
                .min(),
        ];
        instants
            .into_iter()
            .flatten()
            .map(|at| anchor.stamp(at))
            .chain(self.core.poll_timeout())
            .min()
    }

    fn park(&mut self, until: Stamp) {
        let now = Stamp::now();
        if until > now {
            std::thread::park_timeout(until.since(now));
        }
        self.shared.parking.announce(false);
    }
}

impl Worker {
    /// The work of a pass: commands, posts, queued work, the Domains' events, deliveries.
    /// Returns whether there was any, or `None` once the shutdown was taken (it stays first
    /// among the commands).
    fn rounds(&mut self) -> Option<bool> {
        let mut busy = false;
        // Kept from the last pass (its second round, below, was spent) first: this thread
        // may have submitted to the shared queue after them (a cancel, say).
        let mut now = None;
        let mut stamped = local::take_into(&mut self.commands, || *now.insert(Stamp::now()));
        if let Some(now) = now {
            self.stamp = now;
        }
        // Always, behind what was kept: a chain of wakers that submit again must not keep
        // other threads' commands waiting.
        self.shared.queue.take_into(&mut self.commands);
        // Two rounds at most: what this thread's callbacks submitted during the first
        // round's delivery is posted in the second, not a pass later; what they submit in
        // the second waits for the next pass, so a callback that always submits again
        // cannot keep the worker from the shared queue, deadlines or parking decisions.
        for round in 0..2 {
            if !self.commands.is_empty() {
                // One clock read per batch of submissions, not one per transfer (the kept
                // commands were stamped with it).
                if !stamped {
                    self.stamp = Stamp::now();
                }
                // At most 256 commands, then posting and polling; the rest wait.
                for _ in 0..256 {
                    let Some(cmd) = self.commands.pop_front() else {
                        break;
                    };
                    if matches!(cmd, Command::Shutdown) {
                        self.commands.push_front(cmd);
                        self.carry_out_posts();
                        return None;
                    }
                    self.handle_command(cmd);
                }
                self.carry_out_posts();
                busy = true;
            }
            busy |= self.retry_queued();
            busy |= self.poll_domains();
            self.deliver();
            if round == 1 {
                break;
            }
            let mut now = None;
            stamped = local::take_into(&mut self.commands, || *now.insert(Stamp::now()));
            match now {
                Some(now) => self.stamp = now,
                None => break,
            }
        }
        Some(busy)
    }

    /// Hands the Domains what the core has to post, and the core their answers.
    fn carry_out_posts(&mut self) {
        loop {
            let answer = {
                let mut list = PostList::new();
                let Some(post) = self.core.poll_post(&mut list) else {
                    break;
                };
                carry_out(self.group.domains_mut(), post)
            };
            self.core.handle_posted(answer);
        }
        if let Some(why) = self.core.fatal() {
            // Refuse new work from now on, not only once this pass ends: a request's
            // failure is delivered in this pass, and a caller that sees it and submits again
            // must be refused (a race the plugin tests caught, 1 run in 6).
            let _ = self.shared.failed.set(why.clone());
        }
    }

    /// Offers the queued work to its NICs again; returns whether any of it moved.
    fn retry_queued(&mut self) -> bool {
        if !self.core.has_queued() {
            return false;
        }
        self.core.retry_queued();
        self.carry_out_posts();
        self.core.take_progress()
    }

    /// Polls every Domain and feeds its events to the core; returns whether there were any.
    /// A Domain that fails for good is never polled again: the group fails, once.
    fn poll_domains(&mut self) -> bool {
        if self.core.fatal().is_some() {
            return false;
        }
        let mut any = false;
        for nic in 0..self.group.domains().len() {
            self.events.clear();
            if let Err(e) = self.group.domains_mut()[nic].poll(&mut self.events) {
                if e.kind == DomainErrorKind::Fatal {
                    let why = format!("NIC {nic}: {}", e.message);
                    let _ = self.shared.failed.set(why.clone());
                    self.core.set_fatal(why);
                    return any;
                }
                // A poll that keeps failing must not flood the log (one line per pass).
                self.poll_errors += 1;
                if self.poll_errors.is_power_of_two() {
                    tracing::error!(nic, error = %e, times = self.poll_errors, "polling a Domain failed");
                }
            }
            if self.events.is_empty() {
                continue;
            }
            any = true;
            self.core.handle_events(&mut self.events);
            if self.core.has_arrivals() {
                self.count_arrivals();
            }
            if self.core.has_messages() {
                self.route_messages();
            }
        }
        any
    }
}

/// Carries out one post of the core on its Domain.
fn carry_out(domains: &mut [Box<dyn crate::domain::Domain>], post: Post<'_>) -> PostAnswer {
    fn single(status: std::result::Result<PostStatus, DomainError>) -> PostAnswer {
        (usize::from(status == Ok(PostStatus::Posted)), status)
    }
    match post {
        Post::Rdma { nic, rdma } => domains[nic].post_rdma(rdma),
        Post::Send {
            nic,
            wr_id,
            peer,
            data,
        } => single(domains[nic].post_send(wr_id, peer, data)),
    }
}
