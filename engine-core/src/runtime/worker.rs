//! Why one file: it is one thread and the state only that thread owns (`Worker`'s fields: the
//! tracker, the parked posts, the events, the batch of finished operations). Every method reads
//! or writes that state; the pure parts it drives live elsewhere (tracker, ImmCounter, planning).
//! Not yet pure: the dispatch decisions between a command and its posts, and the four clock
//! reads for deadlines, still sit in these methods; moving them into a core driven by time
//! passed in (as the handshake is) is the planned split, and would shrink this file.
//!
//! The worker: one thread per DomainGroup that posts work, polls completions and enforces
//! deadlines. It is a thin loop around [`Tracker`] and the [`ImmCounter`](crate::ImmCounter);
//! the planning happened on the caller's thread.
//!
//! Failure containment: each pass of the loop runs under `catch_unwind`. If a backend (or
//! anything else on this thread) panics, the worker closes its Domains first — so no NIC
//! touches registered memory afterwards — then fails everything in flight with
//! `Error::WorkerFailed`, and from then on refuses new work until the engine is dropped.
//! User code that runs here (mirror sinks) is caught on its own and never gets that far.
//!
//! Backpressure from a NIC parks work per (NIC, peer), so one peer with a full queue (a dead
//! one, say) never holds up work for the others.
//!
//! Spinning policy: while any transfer is in flight (or a post is waiting for room) the worker
//! busy-polls; after `worker.spin_us` without work it parks until woken by a submission or a
//! Domain's waker, the next deadline, or (for Domains that cannot wake it) `idle_poll_us`.
//! Idle polls while awake yield the CPU between them unless `worker.yield_when_idle` is off.

use super::clock::{Anchor, Stamp};
use std::collections::VecDeque;
use std::panic::{catch_unwind, AssertUnwindSafe};
use std::sync::atomic::Ordering;
use std::sync::Arc;
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use foldhash::HashMap;
use smallvec::SmallVec;

use super::completion::{send_batch, CallbackBatch, CounterRun, OnDone};
use super::tracker::{Finished, Tracker};
use super::work::{RdmaWork, Shift};
use super::{panic_message, Command, Mirror, Shared};
use crate::domain::{
    Capabilities, Device, DomainConfig, DomainError, DomainErrorKind, Event, PostStatus, RdmaOp,
    RdmaRequest, Registration, Waker,
};
use crate::error::{Error, Result};
use crate::group::{DomainGroup, SpreadPolicy};
use crate::imm::Outcome;
use crate::notifications::{Notification, Refused};
use crate::plugin::Backend;
use crate::stats::{OpKind, Recorder, Started};
use crate::wire::{Message, NetAddr, CHANNEL_NOTIFICATION, MESSAGE_HEADER_LEN};

/// Requests per [`Domain::post_rdma_list`](crate::domain::Domain::post_rdma_list) call (a
/// list lives on the worker's stack), and the burst that is posted at once.
const LIST_LEN: usize = 32;

/// A work request waiting for room on its NIC.
enum Pending {
    Rdma(RdmaWork),
    Send { peer: NetAddr, data: Vec<u8> },
}

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
        };
        tracing::error!("a notification was dropped: {reason} ({dropped} dropped so far)");
    }
}

/// Turns a Domain's error into the engine's typed error.
pub(crate) fn map_domain_error(backend: &str, e: DomainError) -> Error {
    match e.kind {
        DomainErrorKind::RemoteAccess => Error::RemoteAccess(e.message),
        DomainErrorKind::PeerUnreachable => Error::PeerUnreachable(e.message),
        DomainErrorKind::InvalidArgument => Error::InvalidArgument(e.message),
        DomainErrorKind::Timeout => Error::Timeout(Duration::ZERO),
        _ => Error::Backend {
            backend: backend.to_owned(),
            message: e.message,
        },
    }
}

struct Worker {
    shared: Arc<Shared>,
    /// The NICs, driven as one; which group it is (built-in striping or a backend's own)
    /// does not matter here.
    group: Box<dyn DomainGroup>,
    /// Whether every Domain wakes the worker on new events.
    domains_wake: bool,
    /// Each Domain's limits, checked before anything is posted to it.
    caps: Vec<Capabilities>,
    /// Some Domain moves only while polled (also to receive): never park.
    needs_polling: bool,
    tracker: Tracker<Tracked>,
    /// Work refused with `Busy`, per (NIC, peer), in submission order within each.
    pending: HashMap<(usize, NetAddr), VecDeque<(u64, Pending)>>,
    /// Commands taken from the submission queue and not handled yet (see `pass`).
    commands: VecDeque<Command>,
    /// Listed writes and reads accepted in this pass and not yet handed to their NICs: they
    /// go in lists (`post_burst`) once there are `LIST_LEN` of them and before any other
    /// command is handled, so the order in which work reaches a NIC is the order it was
    /// submitted in.
    burst: Vec<(u64, RdmaWork)>,
    events: Vec<Event>,
    finished: Vec<Finished<Tracked>>,
    imm_outcomes: Vec<Outcome<OnDone>>,
    callbacks: CallbackBatch,
    transfer_timeout: Duration,
    /// The clock as of the current batch of submissions.
    now: Instant,
    /// The same moment as `now`, as a [`Stamp`] (what statistics measure from).
    stamp: Stamp,
    /// Turns stamps into the `Instant`s of transfer telemetry.
    anchor: Anchor,
    /// A Domain failed for good (a `Fatal` poll error): the worker fails after this pass.
    fatal: Option<String>,
    /// Poll errors that were not fatal, logged at a bounded rate.
    poll_errors: u64,
    /// The engine's counters (see `crate::stats`); only this thread touches them.
    recorder: Recorder,
}

/// A finished (or refused) operation's waiter, with what the counters need of it when it
/// was accepted.
pub(crate) struct Tracked {
    on_done: OnDone,
    started: Option<Started>,
}

impl From<OnDone> for Tracked {
    fn from(on_done: OnDone) -> Self {
        Self {
            on_done,
            started: None,
        }
    }
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
                    let reads = domains.iter().all(|d| d.supports_read());
                    let caps = worker.caps.clone();
                    let spread = worker.group.spread();
                    let _ = ready_tx.send(Ok((addresses, reads, caps, spread)));
                    worker.run();
                }
                Err(e) => {
                    let _ = ready_tx.send(Err(e));
                }
            }
        })
        .map_err(|e| Error::Backend {
            backend: shared.backend.clone(),
            message: format!("cannot spawn the worker thread: {e}"),
        })?;
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
            .map_err(|e| Error::Backend {
                backend: shared.backend.clone(),
                message: format!("cannot open NIC {nic:?}: {}", e.message),
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
            return Err(Error::Backend {
                backend: shared.backend.clone(),
                message: format!(
                    "NIC {nic:?}: the backend declares addresses of up to {} bytes and handed out one of {address_len}; the engine carries at most {}",
                    declared.max_address_len,
                    crate::wire::MAX_ADDR_LEN
                ),
            });
        }
        domains.push(domain);
        caps.push(declared);
    }
    let needs_polling = caps.iter().any(|c| c.needs_receiver_polling);
    let nics = domains.len();
    let group = (backend.open_group())(domains, config).map_err(|e| Error::Backend {
        backend: shared.backend.clone(),
        message: format!("cannot make the DomainGroup: {}", e.message),
    })?;
    if group.domains().len() != nics {
        return Err(Error::Backend {
            backend: shared.backend.clone(),
            message: format!(
                "the backend's DomainGroup has {} NICs; the config names {nics}",
                group.domains().len()
            ),
        });
    }
    Ok(Worker {
        shared: Arc::clone(shared),
        group,
        domains_wake,
        caps,
        needs_polling,
        tracker: Tracker::new(),
        pending: HashMap::default(),
        commands: VecDeque::new(),
        burst: Vec::new(),
        events: Vec::new(),
        finished: Vec::new(),
        recorder: Recorder::default(),
        imm_outcomes: Vec::new(),
        callbacks: Vec::new(),
        now: Instant::now(),
        stamp: Stamp::now(),
        anchor: Anchor::now(),
        transfer_timeout: config.timeouts.transfer(),
        fatal: None,
        poll_errors: 0,
    })
}

impl Worker {
    fn run(mut self) {
        let spin = Duration::from_micros(self.shared.config.worker.spin_us);
        let idle_poll = Duration::from_micros(self.shared.config.worker.idle_poll_us);
        let mut idle_since: Option<Instant> = None;
        let mut rounds: u32 = 0;
        loop {
            let pass = catch_unwind(AssertUnwindSafe(|| {
                self.pass(spin, idle_poll, &mut idle_since, &mut rounds)
            }));
            match pass {
                Ok(true) => {}
                Ok(false) => return self.shutdown(),
                Err(panic) => return self.fail(panic_message(&*panic)),
            }
            if let Some(why) = self.fatal.take() {
                return self.fail(why);
            }
        }
    }

    /// One pass of the loop; returns `false` once a shutdown was seen.
    fn pass(
        &mut self,
        spin: Duration,
        idle_poll: Duration,
        idle_since: &mut Option<Instant>,
        rounds: &mut u32,
    ) -> bool {
        let mut busy = false;
        if self.commands.is_empty() {
            self.shared.queue.take_into(&mut self.commands);
        }
        if !self.commands.is_empty() {
            // One clock read per batch of submissions, not one per transfer.
            self.stamp = Stamp::now();
            self.now = self.anchor.instant(self.stamp);
            // At most 256 commands, then posting and polling; the rest wait for the next pass.
            for _ in 0..256 {
                let Some(cmd) = self.commands.pop_front() else {
                    break;
                };
                if matches!(cmd, Command::Shutdown) {
                    self.post_burst();
                    return false;
                }
                self.handle_command(cmd);
            }
            self.post_burst();
            busy = true;
        }
        busy |= self.flush_pending();
        busy |= self.poll_domains();
        self.deliver();
        *rounds = rounds.wrapping_add(1);
        if busy {
            *idle_since = None;
            if *rounds % 64 == 0 {
                self.expire(Instant::now());
            }
            return true;
        }
        // Idle: read the clock only every 16th round; between, pause (see `idle_pause`).
        if *rounds % 16 != 0 {
            self.idle_pause();
            return true;
        }
        let now = Instant::now();
        self.expire(now);
        let in_flight = self.tracker.len() > 0 || !self.pending.is_empty();
        let idle_start = *idle_since.get_or_insert(now);
        // Domains that cannot wake us and need polling to make progress (libfabric's
        // manual-progress providers) with `idle_poll_us = 0`: never park.
        let never_park = (!self.domains_wake && idle_poll.is_zero()) || self.needs_polling;
        if in_flight || never_park || now.duration_since(idle_start) < spin {
            self.idle_pause();
            return true;
        }
        self.park(now, idle_poll);
        true
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

    fn park(&mut self, now: Instant, idle_poll: Duration) {
        // Announce the park first, then read the deadlines and look once more: an expectation
        // registered concurrently (its deadline unknown to a timeout computed earlier) is either
        // seen here or its `expect_imm_count` sees `parked` and unparks us. Computing the
        // timeout before the announcement lost such wake-ups: the worker slept past the new
        // expectation's deadline (up to an hour).
        self.shared.parking.announce(true);
        let deadline = [
            self.tracker.next_deadline(),
            self.shared.lock_imm().next_deadline(),
        ]
        .into_iter()
        .flatten()
        .min();
        let mut timeout = deadline.map_or(Duration::from_secs(3600), |d| {
            d.saturating_duration_since(now)
        });
        if !self.domains_wake {
            timeout = timeout.min(idle_poll);
        }
        if self.commands.is_empty() && self.shared.queue.is_empty() && !self.poll_domains() {
            std::thread::park_timeout(timeout);
        }
        self.shared.parking.announce(false);
    }

    fn handle_command(&mut self, cmd: Command) {
        if let Command::Writes {
            ops,
            on_done,
            submitted,
        } = cmd
        {
            // A listed transfer's operations join the burst, posted in lists once it holds a
            // list's worth, at the end of the pass, or before the next command of another
            // kind (whichever comes first: a NIC is not kept waiting for a whole pass).
            if let Some(id) = self.start_writes(ops.iter().map(|op| (op, 1)), on_done, submitted) {
                match ops.into_inner() {
                    // A single write or read (the commonest command), without an iterator.
                    Ok([op]) => self.burst.push((id, op)),
                    Err(ops) => self.burst.extend(ops.into_iter().map(|op| (id, op))),
                }
                if self.burst.len() >= LIST_LEN {
                    self.post_burst();
                }
            }
            return;
        }
        self.post_burst();
        match cmd {
            Command::Writes { .. } => unreachable!("handled above"),
            // A paged transfer: its plans (for checks and statistics), then its pages.
            Command::Pages {
                work,
                on_done,
                submitted,
            } => {
                if let Some(id) = self.start_writes(work.shapes(), on_done, submitted) {
                    work.for_each_batch(|op, shifts| self.post_rdma_pages(id, op, shifts));
                }
            }
            Command::Send {
                peer,
                data,
                on_done,
                submitted,
            } => {
                if let Some(max) = self.caps[0].max_message_size.filter(|&m| data.len() > m) {
                    // Counted as the user sees it: without the channel byte.
                    let refused = format!(
                        "a message of {} bytes is larger than backend {}'s limit of {}",
                        data.len() - MESSAGE_HEADER_LEN,
                        self.shared.backend,
                        max.saturating_sub(MESSAGE_HEADER_LEN)
                    );
                    self.finished.push((
                        on_done.into(),
                        Err(Box::new(Error::InvalidArgument(refused))),
                    ));
                    return;
                }
                let kind = if data.first() == Some(&CHANNEL_NOTIFICATION) {
                    OpKind::Notification
                } else {
                    OpKind::Send
                };
                let bytes = data.len() as u64;
                let deadline = self.now + self.transfer_timeout;
                let Some(id) = self.track(1, deadline, on_done, |w| {
                    w.recorder.started(kind, 1, w.stamp.micros_since(submitted));
                    w.recorder.on_nic(0, 1, bytes);
                    let index = w.recorder.posted_to(&peer, 1, bytes);
                    Started {
                        kind,
                        peer: Some(index),
                        bytes,
                        at: submitted,
                        nics: 1,
                    }
                }) else {
                    return;
                };
                self.post(0, id, Pending::Send { peer, data });
            }
            Command::Register { region, reply } => {
                let began = Instant::now();
                let result = self.register(&region);
                let r = &mut self.recorder.rest.registrations;
                match &result {
                    Ok(_) => {
                        r.registered += 1;
                        r.bytes += region.len;
                        r.time_us += began.elapsed().as_micros() as u64;
                    }
                    Err(_) => r.failed += 1,
                }
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
                self.recorder.rest.registrations.deregistered += 1;
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
                    if self.tracker.cancel(id) {
                        self.drop_pending(id);
                    }
                }
            }
            Command::Stats { reply } => {
                let mut stats = self.recorder.snapshot(Stamp::now());
                stats.stale_completions = self.tracker.stale();
                stats.outstanding = self.shared.outstanding.load(Ordering::Acquire) as u64;
                {
                    let imm = self.shared.lock_imm();
                    stats.imm_dropped = imm.dropped();
                    stats.imm_idle = imm.idle() as u64;
                    stats.imm_owed = imm.owed_total();
                }
                stats.queued_requests = self.pending.values().map(|q| q.len() as u64).sum();
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

    /// Starts tracking a transfer of `requests` work requests (counted by `count`), unless
    /// it was cancelled while queued: then it finishes with `Cancelled`, nothing is posted,
    /// and this returns `None`.
    fn track(
        &mut self,
        requests: u64,
        deadline: Instant,
        on_done: OnDone,
        count: impl FnOnce(&mut Self) -> Started,
    ) -> Option<u64> {
        let Some(control) = on_done.control().cloned() else {
            let started = count(self);
            let tracked = Tracked {
                on_done,
                started: Some(started),
            };
            return Some(self.tracker.insert(requests, deadline, tracked));
        };
        let mut waiter = Some(on_done);
        let taken = control.take(|| {
            let started = count(self);
            let telemetry = super::control::Telemetry {
                submitted: Some(self.anchor.instant(started.at)),
                posted: Some(self.anchor.instant(self.stamp.max(started.at))),
                completed: None,
                bytes: started.bytes,
                requests,
                nics: (0..8).filter(|i| started.nics & (1 << i) != 0).collect(),
            };
            let tracked = Tracked {
                on_done: waiter.take().expect("taken once"),
                started: Some(started),
            };
            (self.tracker.insert(requests, deadline, tracked), telemetry)
        });
        match taken {
            Ok(()) => control.posted_id(),
            Err(e) => {
                let on_done = waiter.take().expect("not taken when refused");
                self.finished.push((on_done.into(), Err(Box::new(e))));
                None
            }
        }
    }

    /// Drops the requests of transfer `id` not yet handed to a NIC (it was cancelled): each
    /// counts as done, cancelled.
    fn drop_pending(&mut self, id: u64) {
        let mut dropped = 0;
        for queue in self.pending.values_mut() {
            let before = queue.len();
            queue.retain(|(queued, _)| *queued != id);
            dropped += before - queue.len();
        }
        self.pending.retain(|_, q| !q.is_empty());
        for _ in 0..dropped {
            if let Some(done) = self.tracker.handle_done(id, Err(Error::Cancelled)) {
                self.finished.push(done);
            }
        }
    }

    /// Checks and tracks a transfer's writes or reads; `shapes` are its distinct requests
    /// with how many each stands for (see `PagedWork::shapes`). Returns the id to post them
    /// under, or `None` when the transfer already finished (nothing to do, refused,
    /// cancelled).
    fn start_writes<'a>(
        &mut self,
        shapes: impl Iterator<Item = (&'a RdmaWork, u64)> + Clone,
        on_done: OnDone,
        submitted: Stamp,
    ) -> Option<u64> {
        let requests = shapes.clone().map(|(_, uses)| uses).sum();
        if requests == 0 {
            self.finished.push((on_done.into(), Ok(())));
            return None;
        }
        if let Some(refused) = shapes
            .clone()
            .find_map(|(op, _)| self.beyond_capabilities(op))
        {
            // Refused whole, before any part is posted: the backend said it cannot.
            self.finished.push((
                on_done.into(),
                Err(Box::new(Error::InvalidArgument(refused))),
            ));
            return None;
        }
        let deadline = self.now + self.transfer_timeout;
        self.track(requests, deadline, on_done, |w| {
            w.count_writes(shapes, requests, submitted)
        })
    }

    /// Counts an accepted transfer from its shapes (one lookup per run of shapes to the same
    /// peer, so a transfer to one peer costs one); returns what its completion needs.
    fn count_writes<'a>(
        &mut self,
        shapes: impl Iterator<Item = (&'a RdmaWork, u64)>,
        requests: u64,
        submitted: Stamp,
    ) -> Started {
        let mut shapes = shapes.peekable();
        let first = shapes
            .peek()
            .expect("the caller checked that there is work")
            .0;
        let kind = match first.op {
            RdmaOp::Read => OpKind::Read,
            RdmaOp::Write { .. } => OpKind::Write,
        };
        let waited = self.stamp.micros_since(submitted);
        self.recorder.started(kind, requests, waited);
        let mut bytes = 0;
        let mut nics = 0u8;
        let mut single_peer = true;
        let mut run = (&first.peer, 0u64, 0u64);
        for (op, uses) in shapes {
            let op_bytes = op.len * uses;
            bytes += op_bytes;
            nics |= 1 << op.nic;
            self.recorder.on_nic(op.nic, uses, op_bytes);
            if op.peer != *run.0 {
                single_peer = false;
                self.recorder.posted_to(run.0, run.1, run.2);
                run = (&op.peer, 0, 0);
            }
            run.1 += uses;
            run.2 += op_bytes;
        }
        let last = self.recorder.posted_to(run.0, run.1, run.2);
        Started {
            kind,
            peer: single_peer.then_some(last),
            bytes,
            at: submitted,
            nics,
        }
    }

    /// Why the backend's declared capabilities rule out `op`, if they do. (The check inline,
    /// once per operation of every transfer; the message only when it fails.)
    #[inline]
    fn beyond_capabilities(&self, op: &RdmaWork) -> Option<String> {
        let caps = &self.caps[op.nic];
        let fits = caps.max_write_size.is_none_or(|m| op.len <= m)
            && (op.len > 0 || caps.zero_byte_writes)
            && (op.op.imm().is_none() || caps.immediates);
        if fits {
            None
        } else {
            self.refusal(op)
        }
    }

    #[cold]
    fn refusal(&self, op: &RdmaWork) -> Option<String> {
        let caps = &self.caps[op.nic];
        let backend = &self.shared.backend;
        let what = match op.op {
            RdmaOp::Read => "read",
            RdmaOp::Write { .. } => "write",
        };
        if let Some(max) = caps.max_write_size.filter(|&m| op.len > m) {
            return Some(format!(
                "a {what} of {} bytes on NIC {} is larger than backend {backend}'s limit of {max} (lower stripe.max_chunk or split the transfer)",
                op.len, op.nic
            ));
        }
        if op.len == 0 && !caps.zero_byte_writes {
            return Some(format!(
                "backend {backend} does not support zero-byte writes"
            ));
        }
        if op.op.imm().is_some() && !caps.immediates {
            return Some(format!(
                "backend {backend} does not support writes with an immediate"
            ));
        }
        None
    }

    fn register(&mut self, region: &crate::domain::MemoryRegion) -> Result<Vec<Registration>> {
        if let Device::Cuda(gpu) = region.device {
            if let Some(nic) = self.caps.iter().position(|c| !c.cuda_memory && !c.dmabuf) {
                return Err(Error::InvalidArgument(format!(
                    "backend {} cannot register CUDA memory (GPU {gpu}) on NIC {nic}: it declares host memory only",
                    self.shared.backend
                )));
            }
        }
        if region.device == Device::Host && !self.caps.iter().all(|c| c.host_memory) {
            return Err(Error::InvalidArgument(format!(
                "backend {} cannot register host memory",
                self.shared.backend
            )));
        }
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

    /// Posts now if the NIC has room and nothing for that peer is queued ahead; queues
    /// otherwise (per NIC and peer, so one stalled peer holds up only its own work).
    fn post(&mut self, nic: usize, id: u64, work: Pending) {
        if !self.queued_ahead(nic, work.peer()) {
            let attempt = self.try_post(nic, id, work.as_ref());
            if self.attempted(id, attempt) {
                return;
            }
        }
        self.queue(nic, id, work);
    }

    /// Hands the burst to its NICs: each run of operations on one NIC whose peers have
    /// nothing queued goes as one list (at most `LIST_LEN`), as posting them one by one
    /// would — an operation the NIC refuses fails its transfer, one it has no room for waits
    /// in its peer's queue, and what follows for that peer queues behind it.
    fn post_burst(&mut self) {
        if self.burst.is_empty() {
            return;
        }
        let burst = std::mem::take(&mut self.burst);
        let mut next = 0;
        while next < burst.len() {
            let nic = burst[next].1.nic;
            let mut list: SmallVec<[RdmaRequest<'_>; LIST_LEN]> = SmallVec::new();
            if self.fatal.is_none() {
                // (An iterator chain: `extend` builds each request in place, where a loop of
                // pushes copied every one once more.)
                list.extend(
                    burst[next..]
                        .iter()
                        .take(LIST_LEN)
                        .take_while(|(_, op)| op.nic == nic && !self.queued_ahead(nic, &op.peer))
                        .map(|(id, op)| op.request(*id, Shift::default())),
                );
            }
            let (posted, status) = match list.len() {
                // Its peer has work queued already (or a Domain failed for good this pass:
                // then all waits, and fails with everything else when the pass ends).
                0 => (0, Ok(PostStatus::Busy)),
                _ => self.group.domains_mut()[nic].post_rdma_list(&list),
            };
            // A Domain that counted more than it was given is broken: trust the list's length.
            next += posted.min(list.len());
            let Some((id, op)) = burst.get(next) else {
                break;
            };
            match status {
                Ok(PostStatus::Posted) if posted >= list.len() => {}
                Ok(PostStatus::Posted | PostStatus::Busy) => {
                    self.queue(nic, *id, Pending::Rdma(op.clone()));
                    next += 1;
                }
                Err(e) => {
                    self.fail_request(*id, e);
                    next += 1;
                }
            }
        }
        self.burst = burst;
        self.burst.clear();
    }

    /// Posts the pages of a paged request that share `op` (moved by each of `shifts`) in one
    /// batch, as [`post_rdma`](Self::post_rdma) would one by one: a page the NIC refuses
    /// fails its request, and what it has no room for queues, in order, with what follows.
    fn post_rdma_pages(&mut self, id: u64, op: &RdmaWork, shifts: &[Shift]) {
        let mut rest = shifts;
        while !rest.is_empty() && self.fatal.is_none() && !self.queued_ahead(op.nic, &op.peer) {
            let (posted, status) = self.group.domains_mut()[op.nic]
                .post_rdma_pages(&op.request(id, Shift::default()), rest);
            rest = &rest[posted.min(rest.len())..];
            match status {
                // A Domain that said "all posted" but counted fewer is broken: what it did
                // not count is neither posted nor lost, but queued again below.
                Ok(PostStatus::Posted) if rest.is_empty() => return,
                Ok(PostStatus::Posted | PostStatus::Busy) => break,
                // The page the error belongs to fails its request; the batch goes on after it.
                Err(e) => {
                    self.fail_request(id, e);
                    rest = rest.get(1..).unwrap_or_default();
                }
            }
        }
        for &shift in rest {
            self.queue(op.nic, id, Pending::Rdma(op.shifted(shift)));
        }
    }

    /// Whether work for `peer` on `nic` waits already (then new work queues behind it).
    fn queued_ahead(&self, nic: usize, peer: &NetAddr) -> bool {
        // With nothing queued at all (the usual case) the queue's key is never built.
        !self.pending.is_empty() && self.pending.contains_key(&(nic, peer.clone()))
    }

    /// Whether a post attempt settled its work: posted, or failed (and reported); `false`
    /// when the NIC was busy.
    fn attempted(&mut self, id: u64, attempt: Result<PostStatus, DomainError>) -> bool {
        match attempt {
            Ok(PostStatus::Posted) => true,
            Ok(PostStatus::Busy) => false,
            Err(e) => {
                self.fail_request(id, e);
                true
            }
        }
    }

    fn queue(&mut self, nic: usize, id: u64, work: Pending) {
        let key = (nic, work.peer().clone());
        self.pending.entry(key).or_default().push_back((id, work));
    }

    /// The one place the worker hands a Domain work.
    fn try_post(&mut self, nic: usize, id: u64, work: Work<'_>) -> Result<PostStatus, DomainError> {
        if self.fatal.is_some() {
            // A Domain failed for good earlier in this pass: none is used again. "Not now"
            // keeps the work queued, and it fails with everything else when the pass ends.
            return Ok(PostStatus::Busy);
        }
        match work {
            Work::Rdma(op) => {
                self.group.domains_mut()[nic].post_rdma(&op.request(id, Shift::default()))
            }
            Work::Send(peer, data) => self.group.domains_mut()[nic].post_send(id, peer, data),
        }
    }

    fn fail_request(&mut self, id: u64, e: DomainError) {
        if e.kind == DomainErrorKind::Fatal {
            self.fatal.get_or_insert_with(|| e.message.clone());
            // Refuse new work from now on, not only once this pass ends: this request's
            // failure is delivered in this pass, and a caller that sees it and submits again
            // must be refused (a race the plugin tests caught, 1 run in 6).
            let _ = self.shared.failed.set(e.message.clone());
        }
        let err = map_domain_error(&self.shared.backend, e);
        if let Some(done) = self.tracker.handle_done(id, Err(err)) {
            self.finished.push(done);
        }
    }

    /// Retries queued posts, in order within each (NIC, peer); returns whether anything
    /// moved.
    fn flush_pending(&mut self) -> bool {
        if self.pending.is_empty() {
            return false;
        }
        let mut moved = false;
        let mut queues = std::mem::take(&mut self.pending);
        for (&(nic, _), queue) in queues.iter_mut() {
            while let Some((id, work)) = queue.pop_front() {
                if !self.tracker.is_live(id) {
                    moved = true; // its transfer already ended (timed out); drop it
                    continue;
                }
                match self.try_post(nic, id, work.as_ref()) {
                    Ok(PostStatus::Posted) => moved = true,
                    Ok(PostStatus::Busy) => {
                        queue.push_front((id, work));
                        break;
                    }
                    Err(e) => {
                        moved = true;
                        self.fail_request(id, e);
                    }
                }
            }
        }
        queues.retain(|_, q| !q.is_empty());
        // Nothing posts into `self.pending` during the flush (failures only finish).
        debug_assert!(self.pending.is_empty());
        self.pending = queues;
        moved
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
                    self.fatal.get_or_insert(why);
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
            let mut events = std::mem::take(&mut self.events);
            self.handle_events(&mut events);
            self.events = events;
        }
        any
    }

    fn handle_events(&mut self, events: &mut Vec<Event>) {
        /// (A function of the two fields: the ImmCounter's guard borrows the worker.)
        fn count_successes(
            tracker: &mut Tracker<Tracked>,
            finished: &mut Vec<Finished<Tracked>>,
            wr_id: u64,
            n: u64,
        ) {
            if let Some(done) = tracker.handle_ok(wr_id, n) {
                finished.push(done);
            }
        }

        /// Counts `n` arrivals of `value` from `from`, taking the ImmCounter's lock once per
        /// batch of events (kept in `imm`), not once per arrival.
        fn count_arrivals<'a>(
            imm: &mut Option<std::sync::MutexGuard<'a, crate::imm::ImmCounter<OnDone>>>,
            shared: &'a Shared,
            outcomes: &mut Vec<Outcome<OnDone>>,
            (value, from, n): (u32, Option<NetAddr>, u64),
        ) {
            let counter = imm.get_or_insert_with(|| shared.lock_imm());
            counter.handle_arrivals_from(value, n, from.as_ref(), outcomes);
        }

        let mut imm = None;
        let mirrored = self.shared.has_mirrors.load(Ordering::Acquire);
        let mut arrived: Vec<u32> = Vec::new();
        // Successes of one request in a row (a batch of its pages) are counted at once, and
        // so are arrivals of one immediate from one sender in a row (a burst's, a batch's).
        let mut run: Option<(u64, u64)> = None;
        let mut arrivals: Option<(u32, Option<NetAddr>, u64)> = None;
        for event in events.drain(..) {
            if let Event::ImmArrival { imm: value, from } = event {
                self.recorder.rest.imm_arrivals += 1;
                match &mut arrivals {
                    Some((v, f, n)) if *v == value && *f == from => *n += 1,
                    _ => {
                        if let Some(counted) = arrivals.replace((value, from, 1)) {
                            count_arrivals(&mut imm, &self.shared, &mut self.imm_outcomes, counted);
                        }
                        if mirrored && !arrived.contains(&value) {
                            arrived.push(value);
                        }
                    }
                }
                continue;
            }
            // In arrival order: the arrivals before this event count first.
            if let Some(counted) = arrivals.take() {
                count_arrivals(&mut imm, &self.shared, &mut self.imm_outcomes, counted);
            }
            match event {
                Event::Done {
                    wr_id,
                    result: Ok(()),
                } => match &mut run {
                    Some((id, n)) if *id == wr_id => *n += 1,
                    _ => {
                        if let Some((id, n)) = run.replace((wr_id, 1)) {
                            count_successes(&mut self.tracker, &mut self.finished, id, n);
                        }
                    }
                },
                Event::Done {
                    wr_id,
                    result: Err(e),
                } => {
                    // In arrival order: the successes before it count first.
                    if let Some((id, n)) = run.take() {
                        count_successes(&mut self.tracker, &mut self.finished, id, n);
                    }
                    let e = map_domain_error(&self.shared.backend, e);
                    if let Some(done) = self.tracker.handle_done(wr_id, Err(e)) {
                        self.finished.push(done);
                    }
                }
                Event::ImmArrival { .. } => unreachable!("counted above"),
                Event::Message { data } => self.deliver_message(data),
            }
        }
        if let Some((id, n)) = run {
            count_successes(&mut self.tracker, &mut self.finished, id, n);
        }
        if let Some(counted) = arrivals {
            count_arrivals(&mut imm, &self.shared, &mut self.imm_outcomes, counted);
        }
        let Some(counter) = imm else { return };
        if arrived.is_empty() {
            return;
        }
        let totals: Vec<(u32, u64)> = arrived.iter().map(|&v| (v, counter.total(v))).collect();
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

    fn deliver_message(&self, data: Vec<u8>) {
        let Some((payload_max, handler)) = self.shared.recv_handler.get() else {
            tracing::error!("a message arrived with no receive handler; dropped");
            return;
        };
        let (payload_max, handler) = (*payload_max, Arc::clone(handler));
        let buf_len = crate::wire::receive_buffer_len(payload_max);
        let repost = move |shared: &Shared| {
            let _ = shared.submit(Command::PostRecvs {
                buf_len,
                count: 1,
                reply: None,
            });
        };
        match crate::wire::decode_message(&data) {
            Ok(Message::User(payload)) if payload.len() <= payload_max => {}
            Ok(Message::User(payload)) => {
                // Only a backend that overran the buffer it was given gets here.
                tracing::error!(
                    "a message of {} bytes arrived for receive buffers of {payload_max}; dropped",
                    payload.len()
                );
                return repost(&self.shared);
            }
            Ok(Message::Notification { from, id }) => {
                // Queued for `poll_notifications`, its buffer reposted at once (no user code
                // runs, so no job for the callback thread).
                let note = Notification {
                    id: id.to_vec(),
                    from,
                };
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
                return repost(&self.shared);
            }
            Err(e) => {
                tracing::warn!("{e} arrived; dropped");
                return repost(&self.shared);
            }
        }
        let weak = Arc::downgrade(&self.shared);
        let job = Box::new(move || {
            // The buffer goes back to the pool only after the handler returns — also when it
            // panics, or the pool would shrink by one buffer per panic.
            let payload = &data[MESSAGE_HEADER_LEN..];
            let handled = catch_unwind(AssertUnwindSafe(|| handler(payload)));
            if let Some(shared) = weak.upgrade() {
                repost(&shared);
            }
            if let Err(panic) = handled {
                std::panic::resume_unwind(panic);
            }
        });
        let _ = self.shared.jobs.send(Some(job));
    }

    /// Hands finished transfers and met expectations to their waiters.
    fn deliver(&mut self) {
        // Most passes of a waiting worker finish nothing: then not even the drains run.
        if self.finished.is_empty() && self.imm_outcomes.is_empty() && self.callbacks.is_empty() {
            return;
        }
        // Capacity first: whoever sees one of these done (a flag or counter is set right
        // here) may submit again at the limit at once, and must not be told Busy.
        self.shared.finished(self.finished.len());
        let now = if self.finished.is_empty() {
            self.stamp
        } else {
            Stamp::now()
        };
        let mut run = CounterRun::default();
        for (tracked, result) in self.finished.drain(..) {
            if let Some(started) = &tracked.started {
                let outcome = result.as_ref().copied().map_err(Box::as_ref);
                self.recorder.finished(started, outcome, now);
            }
            run.complete(tracked.on_done, result.map_err(|e| *e), &mut self.callbacks);
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

    fn expire(&mut self, now: Instant) {
        let timeout = self.transfer_timeout;
        self.tracker
            .poll_expired(now, || Error::Timeout(timeout), &mut self.finished);
        self.shared
            .lock_imm()
            .poll_expired(now, &mut self.imm_outcomes);
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
        self.pending.clear();
        for w in self.tracker.drain() {
            self.finished.push((w, Err(Box::new(error.clone()))));
        }
        let waiting = self.shared.lock_imm().drain_waiting();
        for w in waiting {
            w.complete_batched(Err(error.clone()), &mut self.callbacks);
        }
        let mut shutdown = false;
        // The commands taken and not yet handled first, then those still queued: in order.
        for cmd in std::mem::take(&mut self.commands) {
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
            Command::Writes { on_done, .. }
            | Command::Pages { on_done, .. }
            | Command::Send { on_done, .. } => {
                self.finished
                    .push((on_done.into(), Err(Box::new(error.clone()))));
            }
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

/// Work as a Domain is handed it, borrowed from a queue or from the command it came in.
#[derive(Clone, Copy)]
enum Work<'a> {
    /// An operation (a queued page was moved to its place when it was queued).
    Rdma(&'a RdmaWork),
    Send(&'a NetAddr, &'a [u8]),
}

impl Pending {
    fn as_ref(&self) -> Work<'_> {
        match self {
            Self::Rdma(op) => Work::Rdma(op),
            Self::Send { peer, data } => Work::Send(peer, data),
        }
    }

    fn peer(&self) -> &NetAddr {
        match self {
            Self::Rdma(op) => &op.peer,
            Self::Send { peer, .. } => peer,
        }
    }
}
