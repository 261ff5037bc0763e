//! Why one file: it is the one loop that owns the thread, the clock, the locks and the
//! Domains around the pure core; what is left in it is the I/O the core must not do —
//! opening the Domains, calling them, the shared ImmCounter, inbox and mirrors, parking.
//!
//! The worker: one thread per DomainGroup, a loop around the [`Dispatch`] core. Each pass
//! takes the queued commands (transfers and messages go to the core; registrations and the
//! rest it carries out itself, after posting what the core holds), hands the Domains what
//! `Dispatch::poll_post` returns and the core their answers, retries queued work once,
//! polls the Domains and feeds their events back, counts arrivals into the shared
//! ImmCounter, carries out the core's routing of messages (handler, inbox, buffers given
//! back), delivers — then, once more, posts what its own callbacks submitted during that
//! delivery (kept on this thread, see `local`) — and — idle — parks until the core's `poll_timeout`, the ImmCounter's
//! next deadline, the earliest `Domain::poll_timeout` (read after the last poll before the
//! park), or a wake.
//!
//! What lives where: the core (`dispatch.rs`) decides — tracking, backpressure per (NIC,
//! peer), coalescing, deadlines, cancellation, message routing, whether the NICs can register
//! a region — and keeps the statistics, recorded from what it is told (posts' answers,
//! events, registrations the worker reports). The worker reads the clock (one read per batch
//! of submissions), takes the locks and calls the Domains; registration itself is NIC calls
//! (with their undo when one refuses) after the core's check.
//!
//! Failure containment: each pass of the loop runs under `catch_unwind`. If a backend (or
//! anything else on this thread) panics, the worker closes its Domains first — so no NIC
//! touches registered memory afterwards — then fails everything in flight with
//! `Error::WorkerFailed`, and from then on refuses new work until the engine is dropped.
//! User code that runs here (mirror sinks) is caught on its own and never gets that far.
//!
//! Driven while parked: the worker's state lives in `Shared::driver`, a lock its thread holds
//! while awake and lets go only to park. A thread that submits (or waits in
//! `TransferEngine::wait`) while the worker is parked takes the lock and makes the pass
//! itself (`drive_parked`): on a small machine the wake-up of the worker and, for a waiter,
//! its own wake-up by the worker are most of a one-way's latency. While it drives, Domains'
//! wakers leave the worker parked; when it stops it polls once more as a parking worker does
//! (the Domains arm their wake-ups) and wakes the worker for whatever is left — commands only
//! the worker carries out (registrations, statistics, the shutdown), queued work, a deadline
//! before the one the worker parked for, a panic. The worker parks no longer than a new
//! transfer's or expectation's timeout, so what a driver submits is due no earlier than the
//! worker wakes by itself.
//!
//! Spinning policy (its decisions in `idle.rs`, pure): while any transfer is in flight (or a
//! post is waiting for room) the worker busy-polls; after `worker.spin_us` without work it
//! parks until woken by a submission or a Domain's waker, the next deadline, or (for Domains
//! that cannot wake it) `idle_poll_us`. Idle polls while awake yield the CPU between them
//! unless `worker.yield_when_idle` is off.

use std::collections::VecDeque;
use std::panic::{catch_unwind, AssertUnwindSafe};
use std::sync::atomic::Ordering;
use std::sync::Arc;
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use super::clock::{Anchor, Stamp};
use super::completion::{send_batch, CallbackBatch, CounterRun, OnDone};
use super::dispatch::{map_domain_error, Dispatch, Post, PostAnswer, PostList, Routed, Unrouted};
use super::idle::{AfterPass, Idle};
use super::local;
use super::{panic_message, Command, Mirror, Shared};
use crate::domain::{
    Capabilities, Domain, DomainConfig, DomainError, DomainErrorKind, Event, PostStatus,
    Registration, Waker,
};
use crate::error::{Error, Result};
use crate::group::{DomainGroup, SpreadPolicy};
use crate::imm::Outcome;
use crate::notifications::Refused;
use crate::plugin::Backend;
use crate::wire::{NetAddr, MESSAGE_HEADER_LEN};

#[cfg(test)]
mod tests;

/// Logs a dropped notification: the first of each kind, then at every power of two, so a
/// flood from a refused peer cannot flood the log as well.
fn report_dropped_notification(why: Refused, shared: &Shared) {
    let dropped = shared
        .notifications
        .lock()
        .unwrap_or_else(|p| p.into_inner())
        .dropped();
    if dropped.is_power_of_two() {
        let reason = match why {
            Refused::Sender => "its sender is not among the peers allowed to notify",
            Refused::Full => "worker.max_notifications are queued and not taken",
            Refused::Forged => "it claims a sender other than the one the transport proved",
        };
        tracing::error!("a notification was dropped: {reason} ({dropped} dropped so far)");
    }
}

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
    /// Turns stamps into `Instant`s (the ImmCounter's deadlines, parking).
    anchor: Anchor,
    /// Poll errors that were not fatal, logged at a bounded rate.
    poll_errors: u64,
    /// Whether another thread may drive this worker's loop while it is parked: not when a
    /// Domain moves only while polled (the worker never parks then).
    drivable: bool,
    /// When the parked worker wakes by itself; `None` while it is awake.
    wakes_at: Option<Instant>,
    /// A panic on a thread that drove this worker (see [`drive_parked`]): the worker fails
    /// with it when it runs next, as if it had panicked itself.
    driven_panic: Option<String>,
}

/// How long a doze lasts (see `Parking`), and how long after a wait the worker dozes rather
/// than parks: `idle_poll_us`, within these bounds — the longest an arrival that nobody waits
/// for may go unseen right after threads waited.
fn doze(idle_poll: Duration) -> Duration {
    idle_poll.clamp(Duration::from_micros(500), Duration::from_millis(100))
}

/// What the worker's thread does after a pass.
enum Next {
    /// The next pass.
    Go,
    /// Park (the lock released) for at most this long, then the next pass. `doze`: a doze
    /// (see `Parking`), with when the worker's own work is next due (see `run`).
    Park(Duration, Option<Instant>),
    /// The engine is being dropped: shut down.
    Stop,
}

/// What the engine keeps of its worker.
pub(crate) struct WorkerHandle {
    pub(crate) thread: JoinHandle<()>,
    pub(crate) addresses: Vec<NetAddr>,
    /// Whether every Domain supports RDMA READ.
    pub(crate) reads: bool,
    /// Each Domain's capabilities, in NIC order.
    pub(crate) caps: Vec<Capabilities>,
    /// The group's spread policy, for planning and counting on the callers' threads.
    pub(crate) spread: Arc<dyn SpreadPolicy>,
}

/// Starts the worker: pins it, then opens the group's Domains on it (so their memory is
/// allocated near the pinned CPU), and returns once they are open.
pub(crate) fn spawn_worker(
    shared: Arc<Shared>,
    backend: Backend,
    group: usize,
) -> Result<WorkerHandle> {
    type Ready = (Vec<NetAddr>, bool, Vec<Capabilities>, Arc<dyn SpreadPolicy>);
    let (ready_tx, ready_rx) = crossbeam_channel::bounded::<Result<Ready>>(1);
    let thread_shared = Arc::clone(&shared);
    let thread = std::thread::Builder::new()
        .name(format!("xfer-worker-{group}"))
        .spawn(move || {
            let shared = thread_shared;
            match open_domains(&shared, &backend, group) {
                Ok(worker) => {
                    let domains = worker.group.domains();
                    let addresses = domains.iter().map(|d| d.address()).collect();
                    let caps = worker.core.caps().to_vec();
                    let reads = caps.iter().all(|c| c.reads);
                    let spread = worker.group.spread();
                    let _ = ready_tx.send(Ok((addresses, reads, caps, spread)));
                    *lock_driver(&shared) = Some(worker);
                    run(&shared);
                }
                Err(e) => {
                    let _ = ready_tx.send(Err(e));
                }
            }
        })
        .map_err(|e| Error::backend_io(&shared.backend, "cannot spawn the worker thread", &e))?;
    shared.parking.set_worker(thread.thread().clone());
    let timeout =
        shared.config.timeouts.control() + Duration::from_millis(shared.config.timeouts.connect_ms);
    let (addresses, reads, caps, spread) = match ready_rx.recv_timeout(timeout) {
        Ok(Ok(a)) => a,
        Ok(Err(e)) => {
            let _ = thread.join();
            return Err(e);
        }
        Err(_) => {
            // Still opening: tell it to stop as soon as it starts, so no orphan lives on.
            shared.push_shutdown();
            shared.close();
            return Err(Error::Timeout(timeout));
        }
    };
    Ok(WorkerHandle {
        thread,
        addresses,
        reads,
        caps,
        spread,
    })
}

fn open_domains(shared: &Arc<Shared>, backend: &Backend, group: usize) -> Result<Worker> {
    let config = &shared.config;
    let group_config = &config.groups[group];
    if let Some(cpu) = group_config.worker_cpu {
        if !core_affinity::set_for_current(core_affinity::CoreId { id: cpu }) {
            return Err(Error::InvalidArgument(format!(
                "cannot pin the worker of group {group} to CPU {cpu} (see groups[{group}].worker_cpu in {})",
                config.source.display()
            )));
        }
    }
    let options = config.backend_options();
    let mut domains = Vec::with_capacity(group_config.nics.len());
    // Queried once per Domain (a plugin's is a call through the ABI), checked here, kept.
    let mut caps: Vec<Capabilities> = Vec::with_capacity(group_config.nics.len());
    let mut domains_wake = true;
    for nic in &group_config.nics {
        let mut domain = backend
            .open(&DomainConfig {
                nic,
                options: &options,
            })
            .map_err(|mut e| {
                e.message = format!("cannot open NIC {nic:?}: {}", e.message);
                Error::Backend {
                    backend: shared.backend.clone(),
                    source: e,
                }
            })?;
        let (waking, asking) = (Arc::clone(&shared.parking), Arc::clone(&shared.parking));
        domains_wake &= domain.set_waker(Waker::with_parking(
            move || waking.wake(),
            move || asking.is_parked(),
        ));
        let declared = domain.capabilities();
        let address_len = domain.address().raw().len();
        if declared.max_address_len > crate::wire::MAX_ADDR_LEN
            || address_len > declared.max_address_len
        {
            return Err(Error::backend_other(
                &shared.backend,
                format!(
                    "NIC {nic:?}: the backend declares addresses of up to {} bytes and handed out one of {address_len}; the engine carries at most {}",
                    declared.max_address_len,
                    crate::wire::MAX_ADDR_LEN
                ),
            ));
        }
        domains.push(domain);
        caps.push(declared);
    }
    let needs_polling = caps.iter().any(|c| c.needs_receiver_polling);
    let nics = domains.len();
    let group = (backend.open_group())(domains, config).map_err(|mut e| {
        e.message = format!("cannot make the DomainGroup: {}", e.message);
        Error::Backend {
            backend: shared.backend.clone(),
            source: e,
        }
    })?;
    if group.domains().len() != nics {
        return Err(Error::backend_other(
            &shared.backend,
            format!(
                "the backend's DomainGroup has {} NICs; the config names {nics}",
                group.domains().len()
            ),
        ));
    }
    let anchor = Anchor::now();
    let core = Dispatch::new(
        shared.backend.clone(),
        caps,
        config.timeouts.transfer(),
        anchor,
    );
    Ok(Worker {
        shared: Arc::clone(shared),
        group,
        domains_wake,
        needs_polling,
        core,
        commands: VecDeque::new(),
        events: Vec::new(),
        imm_outcomes: Vec::new(),
        arrived: Vec::new(),
        callbacks: Vec::new(),
        stamp: Stamp::now(),
        anchor,
        poll_errors: 0,
        drivable: false,
        wakes_at: None,
        driven_panic: None,
    })
}

/// The worker's state, locked: held by its thread while awake, by a driver while parked.
fn lock_driver(shared: &Shared) -> std::sync::MutexGuard<'_, Option<Worker>> {
    // A pass that panics is caught inside the guard's scope, so the lock is never poisoned
    // by one; should it be, the state is as consistent as a caught panic leaves it.
    shared.driver.lock().unwrap_or_else(|p| p.into_inner())
}

/// The worker's thread: passes under the lock, which it lets go only to park.
fn run(shared: &Arc<Shared>) {
    let config = &shared.config.worker;
    let spin = Duration::from_micros(config.spin_us);
    let idle_poll = Duration::from_micros(config.idle_poll_us);
    let mut guard = lock_driver(shared);
    let Some(worker) = guard.as_mut() else {
        return;
    };
    // Domains that cannot wake us and need polling to make progress (libfabric's
    // manual-progress providers) with `idle_poll_us = 0`: never park.
    let never_park = (!worker.domains_wake && idle_poll.is_zero()) || worker.needs_polling;
    worker.drivable = !never_park && config.drive_when_parked;
    let mut idle = Idle::new(spin, never_park);
    local::enter(shared);
    let failure = loop {
        let Some(worker) = guard.as_mut() else {
            return;
        };
        if let Some(why) = worker.driven_panic.take() {
            break Some(why);
        }
        match catch_unwind(AssertUnwindSafe(|| worker.pass(idle_poll, &mut idle))) {
            Ok(Next::Go) => {}
            Ok(Next::Park(timeout, doze)) => {
                drop(guard);
                std::thread::park_timeout(timeout);
                guard = match doze {
                    Some(due) => relock_after_doze(shared, due, timeout),
                    None => lock_driver(shared),
                };
                shared.parking.announce(false);
                if let Some(worker) = guard.as_mut() {
                    worker.wakes_at = None;
                }
                continue;
            }
            Ok(Next::Stop) => break None,
            Err(panic) => break Some(panic_message(&*panic)),
        }
        if let Some(why) = worker.core.fatal() {
            break Some(why.clone());
        }
    };
    // Out of the lock (and out of `Shared`, which it holds): from here on nobody drives it.
    let Some(worker) = guard.take() else {
        return;
    };
    drop(guard);
    match failure {
        None => worker.shutdown(),
        Some(why) => worker.fail(why),
    }
}

/// The worker's state again after a doze: while a waiting thread drives it (holds the
/// lock), the worker dozes on rather than queue for the lock — taking it when that thread
/// lets go would cost the thread a wake-up of the worker at every unlock, and hand the
/// worker passes the waiters make better themselves — until its own work is `due`, or it is
/// woken (then the thread that woke it has let the lock go, or another driver holds it and
/// will wake it again for what it leaves).
fn relock_after_doze(
    shared: &Shared,
    due: Instant,
    doze: Duration,
) -> std::sync::MutexGuard<'_, Option<Worker>> {
    loop {
        match shared.driver.try_lock() {
            Ok(guard) => return guard,
            Err(std::sync::TryLockError::Poisoned(p)) => return p.into_inner(),
            Err(std::sync::TryLockError::WouldBlock) => {}
        }
        let now = Instant::now();
        if now >= due {
            return lock_driver(shared);
        }
        let timeout = doze.min(due - now);
        shared.parking.set_wakes_at(now + timeout);
        std::thread::park_timeout(timeout);
    }
}

/// Drives the parked worker's loop on this thread: one pass of its work (the queue, posts,
/// the Domains' events, deliveries), so that a submission is posted, or an arrival counted,
/// without waking the worker — the wake-up and the hop between threads are most of a
/// one-way's latency on a small machine. Returns `false` when it did not (the worker is
/// awake, another thread drives it, this thread is a worker itself, or the Domains need the
/// worker polling): then the caller wakes the worker as before.
///
/// While it drives, wakers leave the worker parked (see `Parking`); when it stops (see
/// [`Leaving`]) it wakes the worker if anything is left for it: commands it did not take,
/// queued work, something due before the worker's own wake-up, a shutdown, or a panic here.
pub(crate) fn drive_parked(shared: &Shared) -> bool {
    drive_parked_while(shared, || Some(Leaving::Submitted))
}

/// Why a thread stops driving the parked worker, which decides what the worker is left
/// doing: parked with the Domains' wake-ups armed, or dozing (see `Parking`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Leaving {
    /// It submitted. A parked worker stays parked: the Domains are polled once more as by a
    /// parking worker (they arm their wake-ups, and what came before is seen). A dozing one
    /// keeps dozing: threads wait on it.
    Submitted,
    /// Its wait ended: it will likely submit and wait again soon. The worker dozes — a
    /// parked one is woken once to doze instead — so that no armed wake-up sends a thread
    /// running for each completion while waiters poll for them.
    Answered,
    /// Its wait goes to sleep on the flag: the worker must be woken by what arrives. It parks
    /// with the wake-ups armed, dozing no more.
    Sleeps,
}

/// [`drive_parked`], pass after pass until `more()` (asked after each pass) says why it
/// stops, unless the worker must wake for what is left.
pub(crate) fn drive_parked_while(
    shared: &Shared,
    mut more: impl FnMut() -> Option<Leaving>,
) -> bool {
    if !shared.parking.announced_parked() || local::is_worker_thread() {
        return false;
    }
    let Ok(mut guard) = shared.driver.try_lock() else {
        return false;
    };
    let Some(worker) = guard.as_mut() else {
        return false;
    };
    // Holding the lock, the worker is not in a pass: it is parked, or woke and waits for
    // the lock (then it announced nothing yet, and runs a pass after this one).
    if !worker.drivable || !shared.parking.announced_parked() || worker.driven_panic.is_some() {
        return false;
    }
    shared.parking.set_driven(true);
    local::enter(shared);
    let driven = catch_unwind(AssertUnwindSafe(|| loop {
        if worker.driven_pass() {
            break None;
        }
        if let Some(leaving) = more() {
            break Some(leaving);
        }
    }));
    let kept = local::leave();
    shared.parking.set_driven(false);
    let wake = match driven {
        Ok(leaving) => {
            let now = Stamp::now();
            let left = !kept.is_empty();
            for mut cmd in kept {
                cmd.stamp(now);
                shared.queue.push(cmd);
            }
            let arm = match leaving {
                None => None,
                Some(Leaving::Submitted) => Some(!shared.parking.is_dozing()),
                Some(Leaving::Answered) => {
                    shared.parking.waited_now();
                    // A parked worker is woken to doze; a dozing one needs nothing armed.
                    shared.parking.is_dozing().then_some(false)
                }
                Some(Leaving::Sleeps) => {
                    shared.parking.stop_dozing();
                    Some(true)
                }
            };
            left || arm.is_none_or(|arm| {
                catch_unwind(AssertUnwindSafe(|| worker.stop_driving(arm))).unwrap_or_else(
                    |panic| {
                        worker.driven_failed(panic_message(&*panic));
                        true
                    },
                )
            })
        }
        Err(panic) => {
            worker.driven_failed(panic_message(&*panic));
            true
        }
    };
    drop(guard);
    if wake {
        shared.parking.unpark();
    }
    true
}

impl Worker {
    /// One pass of the worker's loop, and what its thread does next.
    fn pass(&mut self, idle_poll: Duration, idle: &mut Idle) -> Next {
        let Some(busy) = self.rounds(false) else {
            return Next::Stop;
        };
        match idle.after_pass(busy) {
            AfterPass::Go => {}
            AfterPass::Expire => self.expire(Stamp::now()),
            AfterPass::Pause => self.idle_pause(),
            AfterPass::Look => {
                let now = Stamp::now();
                self.expire(now);
                let in_flight = self.core.in_flight() > 0 || self.core.has_queued();
                // Waiting threads poll for what is in flight: the worker need not.
                let waiters = self.drivable && self.shared.parking.waited_within(doze(idle_poll));
                if idle.parks(now, in_flight && !waiters, waiters) {
                    if let Some((timeout, doze)) = self.prepare_park(idle_poll) {
                        return Next::Park(timeout, doze);
                    }
                } else {
                    self.idle_pause();
                }
            }
        }
        Next::Go
    }

    /// The work of a pass: commands, posts, queued work, the Domains' events, deliveries.
    /// Returns whether there was any, or `None` once the shutdown was taken (it stays first
    /// among the commands, for the worker's thread to carry out) — or, in a pass another
    /// thread drives, a command for the worker alone: registering memory (which can take
    /// long: the thread that submitted a small write must not wait for another's `reg_mr`),
    /// receive buffers, statistics.
    fn rounds(&mut self, driven: bool) -> Option<bool> {
        let mut busy = false;
        // Kept from the last pass (its second round, below, was spent) first: this thread
        // may have submitted to the shared queue after them (a cancel, say).
        let mut now = None;
        let mut stamped = local::take_into(&mut self.commands, || *now.insert(Stamp::now()));
        if let Some(now) = now {
            self.stamp = now;
        }
        if self.commands.is_empty() {
            self.shared.queue.take_into(&mut self.commands);
        }
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
                    if matches!(cmd, Command::Shutdown) || (driven && cmd.is_for_the_worker()) {
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

    /// A pass driven by another thread while this worker is parked (see [`drive_parked`]);
    /// returns whether the worker must wake for what is left.
    fn driven_pass(&mut self) -> bool {
        self.rounds(true).is_none() || !self.commands.is_empty() || self.core.has_queued()
    }

    /// A driver stops: when the worker is parked (`arm`), the Domains are polled once more
    /// with the worker counted as parked again, so that they arm their wake-ups (and what
    /// came in before that is seen); a dozing worker looks again soon by itself. Returns
    /// whether the worker must wake — for work left, or for a deadline earlier than the one
    /// it parked for.
    fn stop_driving(&mut self, arm: bool) -> bool {
        if arm && self.poll_domains() {
            self.deliver();
        }
        if !self.commands.is_empty()
            || self.core.has_queued()
            || self.core.fatal().is_some()
            || !local::is_empty()
            || !self.shared.queue.is_empty()
        {
            return true;
        }
        let Some(wakes_at) = self.wakes_at else {
            return true;
        };
        self.next_due().is_some_and(|due| due < wakes_at)
    }

    /// When something of the worker's is next due though nothing arrives: a transfer's or
    /// an expectation's deadline, or a Domain's own timer.
    fn next_due(&self) -> Option<Instant> {
        [
            self.core.poll_timeout().map(|d| self.anchor.instant(d)),
            self.shared.lock_imm().next_deadline(),
            self.domains_poll_timeout(),
        ]
        .into_iter()
        .flatten()
        .min()
    }

    /// A driver panicked in this worker's pass: new work is refused now, and the worker
    /// fails (closing its Domains, failing what is in flight) when it runs next.
    fn driven_failed(&mut self, why: String) {
        tracing::error!(reason = %why, "a thread driving the xfer worker panicked");
        let _ = self.shared.failed.set(why.clone());
        self.driven_panic = Some(why);
    }

    /// Between idle polls: by default yield, so that on a small machine the threads we wait
    /// for (submitters, callbacks, peers, a software NIC) get the CPU; with
    /// `worker.yield_when_idle = false` spin instead, for a worker with a core to itself.
    fn idle_pause(&self) {
        if self.shared.config.worker.yield_when_idle {
            std::thread::yield_now();
        } else {
            std::hint::spin_loop();
        }
    }

    /// Decides to park: `Some(timeout)` with the park announced, or `None` (not announced)
    /// when work came in meanwhile.
    fn prepare_park(&mut self, idle_poll: Duration) -> Option<(Duration, Option<Instant>)> {
        // Announce the park first, then read the deadlines and look once more: an expectation
        // registered concurrently (its deadline unknown to a timeout computed earlier) is either
        // seen here or its `expect_imm_count` sees `parked` and unparks us. Computing the
        // timeout before the announcement lost such wake-ups: the worker slept past the new
        // expectation's deadline (up to an hour).
        //
        // A Domain's own timers (`Domain::poll_timeout`: a handshake to resend, retired queue
        // pairs to free) are read after that last poll, which may move them: the worker
        // wakes to poll it then even when nothing arrives and nothing else is due.
        // Threads waiting in `TransferEngine::wait` drove this worker lately: doze, with no
        // wake-up armed (the final poll below arms nothing then), and look again within
        // `idle_poll_us` (see `doze`) — the longest an arrival nobody waits for is left unseen.
        let dozes = self.drivable && self.shared.parking.waited_within(doze(idle_poll));
        if dozes {
            self.shared.parking.announce_doze();
        } else {
            self.shared.parking.announce(true);
        }
        if !(self.commands.is_empty()
            && local::is_empty()
            && self.shared.queue.is_empty()
            && !self.poll_domains())
        {
            self.shared.parking.announce(false);
            return None;
        }
        let deadline = self.next_due();
        // Read now, after the poll: a deadline is not overslept by the time it took.
        let now = Instant::now();
        // Never longer than a new transfer's or expectation's timeout: what is submitted
        // while the worker is parked is then due no earlier than it wakes, and needs no
        // wake-up of its own (see `Parking::wake_unless_due_by`, `drive_parked`).
        let timeouts = &self.shared.config.timeouts;
        let mut timeout = deadline.map_or(Duration::MAX, |d| d.saturating_duration_since(now));
        timeout = timeout.min(timeouts.transfer()).min(timeouts.expect());
        if !self.domains_wake {
            timeout = timeout.min(idle_poll);
        }
        let due = now + timeout;
        if dozes {
            timeout = timeout.min(doze(idle_poll));
        }
        let wakes_at = now + timeout;
        self.wakes_at = Some(wakes_at);
        self.shared.parking.set_wakes_at(wakes_at);
        Some((timeout, dozes.then_some(due)))
    }

    /// The earliest time a Domain asked to be polled at though nothing arrives.
    fn domains_poll_timeout(&self) -> Option<Instant> {
        self.group
            .domains()
            .iter()
            .filter_map(|d| d.poll_timeout())
            .min()
    }

    /// Transfers and messages go to the core; anything else is carried out here, after the
    /// work submitted before it was handed to the NICs.
    fn handle_command(&mut self, cmd: Command) {
        let now = self.stamp;
        // A listed transfer's operations join the burst, posted in lists once it holds a
        // list's worth, at the end of the pass, or before the next command of another kind
        // (whichever comes first: a NIC is not kept waiting for a whole pass).
        match cmd {
            Command::Listed {
                ops,
                on_done,
                submitted,
            } => self.core.handle_rdma(now, ops, on_done, submitted),
            Command::Pages {
                work,
                on_done,
                submitted,
            } => self.core.handle_pages(now, work, on_done, submitted),
            Command::Send {
                peer,
                data,
                on_done,
                submitted,
            } => self.core.handle_send(now, peer, data, on_done, submitted),
            other => {
                self.carry_out_posts();
                return self.handle_control(other);
            }
        };
        if self.core.has_urgent_posts() {
            self.carry_out_posts();
        }
    }

    fn handle_control(&mut self, cmd: Command) {
        match cmd {
            Command::Listed { .. } | Command::Pages { .. } | Command::Send { .. } => {
                unreachable!("the core's")
            }
            Command::Register { region, reply } => {
                let began = Instant::now();
                let result = self.register(&region);
                let took = u64::try_from(began.elapsed().as_micros()).unwrap_or(u64::MAX);
                self.core
                    .handle_registered(result.as_ref().ok().map(|_| (region.len, took)));
                if let Err(unsent) = reply.send(result) {
                    // The caller stopped waiting and was told it failed: undo it, so no
                    // registration outlives the caller's knowledge of it.
                    if let Ok(regs) = unsent.into_inner() {
                        for (d, reg) in self.group.domains_mut().iter_mut().zip(&regs) {
                            let _ = d.deregister(reg.local_key);
                        }
                    }
                }
            }
            Command::Deregister { keys, reply } => {
                self.core.handle_deregistered();
                let mut result = Ok(());
                for (domain, key) in self.group.domains_mut().iter_mut().zip(keys) {
                    if let Err(e) = domain.deregister(key) {
                        result = result.and(Err(map_domain_error(&self.shared.backend, e)));
                    }
                }
                let _ = reply.send(result);
            }
            Command::PostRecvs {
                buf_len,
                count,
                reply,
            } => {
                let result = self.group.domains_mut()[0]
                    .post_recvs(buf_len, count)
                    .map_err(|e| map_domain_error(&self.shared.backend, e));
                match reply {
                    Some(reply) => {
                        let _ = reply.send(result);
                    }
                    None => {
                        if let Err(e) = result {
                            tracing::error!(error = %e, "cannot post a receive buffer again");
                        }
                    }
                }
            }
            Command::Cancel { control } => {
                if let Some(id) = control.posted_id() {
                    self.core.cancel(id);
                }
            }
            Command::Stats { reply } => {
                let mut stats = self.core.stats(Stamp::now());
                stats.outstanding = self.shared.outstanding.load(Ordering::Acquire) as u64;
                {
                    let imm = self.shared.lock_imm();
                    stats.imm_dropped = imm.dropped();
                    stats.imm_idle = imm.idle() as u64;
                    stats.imm_owed = imm.owed_total();
                }
                stats.notifications_dropped = self
                    .shared
                    .notifications
                    .lock()
                    .unwrap_or_else(|p| p.into_inner())
                    .dropped();
                let _ = reply.send(Ok(stats));
            }
            Command::Shutdown => unreachable!("handled by run"),
        }
    }

    /// Registers `region` with every NIC, once the core found they all can; undoes the
    /// registrations made when one NIC refuses.
    fn register(&mut self, region: &crate::domain::MemoryRegion) -> Result<Vec<Registration>> {
        self.core.check_registration(region)?;
        let domains = self.group.domains_mut();
        let mut done = Vec::with_capacity(domains.len());
        for i in 0..domains.len() {
            match domains[i].register(region) {
                Ok(reg) => done.push(reg),
                Err(e) => {
                    for (d, reg) in domains.iter_mut().zip(&done) {
                        let _ = d.deregister(reg.local_key);
                    }
                    return Err(map_domain_error(&self.shared.backend, e));
                }
            }
        }
        Ok(done)
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

    fn poll_domains(&mut self) -> bool {
        let mut any = false;
        for nic in 0..self.group.domains().len() {
            self.events.clear();
            if let Err(e) = self.group.domains_mut()[nic].poll(&mut self.events) {
                if e.kind == DomainErrorKind::Fatal {
                    // Never polled again: the whole group fails, once, with the reason.
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

    /// Carries out the core's routing of the messages that arrived: a user's to the receive
    /// handler on the callback thread, a notification to the inbox; the buffers of those not
    /// handed to the handler go back to the NIC here and now.
    fn route_messages(&mut self) {
        let handler = self.shared.recv_handler.get();
        let payload_max = handler.map(|(max, _)| *max);
        for routed in self.core.poll_messages(payload_max) {
            match routed {
                Routed::User { data, sender } => {
                    // Routed to the handler only when one is set.
                    if let Some((max, handler)) = handler {
                        hand_to_receive_handler(
                            &self.shared,
                            *max,
                            Arc::clone(handler),
                            data,
                            sender,
                        )
                    }
                }
                Routed::Notification(note) => {
                    let offered = self
                        .shared
                        .notifications
                        .lock()
                        .unwrap_or_else(|p| p.into_inner())
                        .offer(note);
                    match offered {
                        Ok(()) => self.shared.notified.notify_all(),
                        Err(why) => report_dropped_notification(why, &self.shared),
                    }
                }
                Routed::Dropped(Unrouted::NoHandler) => {
                    tracing::error!("a message arrived with no receive handler; dropped")
                }
                Routed::Dropped(Unrouted::TooLarge { len, max }) => tracing::error!(
                    "a message of {len} bytes arrived for receive buffers of {max}; dropped"
                ),
                Routed::Dropped(Unrouted::Malformed(e)) => {
                    tracing::warn!("{e} arrived; dropped")
                }
            }
        }
        let reposts = self.core.take_reposts();
        if let (Some(max), true) = (payload_max, reposts > 0) {
            let buf_len = crate::wire::receive_buffer_len(max);
            if let Err(e) = self.group.domains_mut()[0].post_recvs(buf_len, reposts) {
                let e = map_domain_error(&self.shared.backend, e);
                tracing::error!(error = %e, "cannot post a receive buffer again");
            }
        }
    }

    /// Counts the core's runs of arrivals into the ImmCounter, taking its lock once per
    /// batch of events, then reports mirrored totals.
    fn count_arrivals(&mut self) {
        let mirrored = self.shared.has_mirrors.load(Ordering::Acquire);
        let mut counter = self.shared.lock_imm();
        for (value, from, n) in self.core.poll_arrivals() {
            counter.handle_arrivals_from(value, n, from.as_ref(), &mut self.imm_outcomes);
            if mirrored && !self.arrived.contains(&value) {
                self.arrived.push(value);
            }
        }
        if self.arrived.is_empty() {
            return;
        }
        let totals: Vec<(u32, u64)> = self
            .arrived
            .drain(..)
            .map(|v| (v, counter.total(v)))
            .collect();
        drop(counter);
        // User sinks run with no engine lock held; clone them out of the map first.
        let sinks: Vec<(u32, u64, Arc<Mirror>)> = {
            let mirrors = self
                .shared
                .mirrors
                .read()
                .unwrap_or_else(|p| p.into_inner());
            totals
                .iter()
                .flat_map(|&(v, total)| {
                    mirrors
                        .get(&v)
                        .into_iter()
                        .flatten()
                        .map(move |m| (v, total, Arc::clone(m)))
                })
                .collect()
        };
        let mut any_failed = false;
        for (v, total, sink) in sinks {
            sink.report(v, total);
            any_failed |= sink.is_failed();
        }
        if any_failed {
            self.shared
                .mirrors
                .write()
                .unwrap_or_else(|p| p.into_inner())
                .values_mut()
                .for_each(|list| list.retain(|m| !m.is_failed()));
        }
    }

    /// Hands finished transfers and met expectations to their waiters.
    fn deliver(&mut self) {
        let finished = self.core.finished();
        // Most passes of a waiting worker finish nothing: then not even the drains run.
        if finished == 0 && self.imm_outcomes.is_empty() && self.callbacks.is_empty() {
            return;
        }
        // Capacity first: whoever sees one of these done (a flag or counter is set right
        // here) may submit again at the limit at once, and must not be told Busy.
        self.shared.finished(finished);
        let mut run = CounterRun::default();
        if finished > 0 {
            for (on_done, result) in self.core.poll_deliveries(Stamp::now()) {
                run.complete(on_done, result.map_err(|e| *e), &mut self.callbacks);
            }
        }
        let timeout = self.shared.config.timeouts.expect();
        for outcome in self.imm_outcomes.drain(..) {
            match outcome {
                Outcome::Met(w) => run.complete(w, Ok(()), &mut self.callbacks),
                Outcome::Expired { waiter, dropped } => {
                    let error = if dropped > 0 {
                        Error::ArrivalsDropped { timeout, dropped }
                    } else {
                        Error::Timeout(timeout)
                    };
                    run.complete(waiter, Err(error), &mut self.callbacks)
                }
            }
        }
        run.flush();
        send_batch(&mut self.callbacks, &self.shared.jobs);
    }

    /// Ends transfers and expectations whose deadlines are at or before `now`.
    fn expire(&mut self, now: Stamp) {
        self.core.handle_timeout(now);
        self.shared
            .lock_imm()
            .poll_expired(self.anchor.instant(now), &mut self.imm_outcomes);
        self.deliver();
    }

    /// Closes every Domain, so no NIC touches registered memory from here on. A Domain that
    /// panics while closing is abandoned (leaked) rather than half-dropped twice.
    fn close_domains(&mut self) {
        for domain in self.group.domains_mut().drain(..) {
            if let Err(panic) = catch_unwind(AssertUnwindSafe(|| drop(domain))) {
                tracing::error!(panic = %panic_message(&*panic), "a Domain panicked while closing");
            }
        }
    }

    /// Fails everything the worker holds with `error`: transfers in flight or parked, and
    /// commands still queued. Deregistrations succeed: the Domains are closed already.
    /// Returns whether a queued shutdown was among them (the engine is being dropped).
    fn fail_everything(&mut self, error: &Error) -> bool {
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
    fn refuse(&mut self, cmd: Command, error: &Error) -> bool {
        match cmd {
            Command::Listed { on_done, .. }
            | Command::Pages { on_done, .. }
            | Command::Send { on_done, .. } => self.core.finish_now(on_done, Err(error.clone())),
            Command::Register { reply, .. } => {
                let _ = reply.send(Err(error.clone()));
            }
            Command::Deregister { reply, .. } => {
                let _ = reply.send(Ok(()));
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
    fn shutdown(mut self) {
        self.close_domains();
        self.fail_everything(&Error::Shutdown);
    }

    /// Something on this thread panicked: contain it (see the module docs).
    fn fail(mut self, why: String) {
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
/// Runs the receive handler on `data`'s payload on the callback thread, then gives its
/// buffer back to the NIC — also when the handler panics, or the pool would shrink by one
/// buffer per panic.
fn hand_to_receive_handler(
    shared: &Arc<Shared>,
    payload_max: usize,
    handler: super::RecvHandler,
    data: Vec<u8>,
    sender: Option<NetAddr>,
) {
    let buf_len = crate::wire::receive_buffer_len(payload_max);
    let weak = Arc::downgrade(shared);
    let job = Box::new(move || {
        let payload = &data[MESSAGE_HEADER_LEN..];
        let handled = catch_unwind(AssertUnwindSafe(|| handler(payload, sender.as_ref())));
        if let Some(shared) = weak.upgrade() {
            let _ = shared.submit(Command::PostRecvs {
                buf_len,
                count: 1,
                reply: None,
            });
        }
        if let Err(panic) = handled {
            std::panic::resume_unwind(panic);
        }
    });
    let _ = shared.jobs.send(Some(job));
}

/// Carries out one post of the core on its Domain.
fn carry_out(domains: &mut [Box<dyn Domain>], post: Post<'_>) -> PostAnswer {
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
