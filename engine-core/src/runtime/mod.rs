//! Threads and queues: the worker that drives one DomainGroup, and the callback thread.
//!
//! ```text
//!  caller threads ──submit──▶ SubmissionQueue ──▶ worker ──post/poll──▶ Domains (NICs)
//!        ▲                   (unbounded, taken      │
//!        │                    in whole batches)     ├─ flags/counters: set directly
//!        └────── callbacks ◀── callback thread ◀──────┘  callbacks: crossbeam channel
//! ```
//! Neither queue blocks a producer, so a callback that submits new work can never deadlock
//! against a full queue: no cycle of bounded queues exists. What bounds them is
//! `worker.max_outstanding`: a transfer or send is counted from its acceptance until just
//! before its `OnDone` fires (so whoever sees it done may submit again at once), and past the
//! limit `submit_*` returns `Error::Busy` instead of queueing.

mod callbacks;
pub(crate) mod clock;
pub(crate) mod completion;
pub(crate) mod control;
pub(crate) mod dispatch;
mod local;
mod queue;
mod schedule;
mod tracker;
mod work;
mod worker;

use self::clock::Stamp;
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex, OnceLock};
use std::thread::Thread;
use std::time::{Duration, Instant};

use crossbeam_channel::Sender;

use crate::config::Config;
use crate::domain::{MemoryRegion, Registration};
use crate::error::{Error, Result};
use crate::imm::ImmCounter;
use crate::notifications::Inbox;
use crate::wire::NetAddr;
use completion::{Job, OnDone};

pub(crate) use callbacks::spawn_callback_thread;
pub(crate) use work::{Ops, PagedWork, RdmaWork, Shift};
pub(crate) use worker::spawn_worker;

/// Receives an immediate's running total of arrivals; see `TransferEngine::mirror_imm_count`.
///
/// Reported outside every engine lock. Reports can race (the registration's first report on
/// the caller's thread, later ones on the worker), so each sink remembers what it last saw
/// and only ever moves forward.
pub(crate) struct Mirror {
    sink: Box<dyn Fn(u64) + Send + Sync>,
    last: Mutex<Option<u64>>,
    /// Set when the sink panicked; it is not called again.
    failed: AtomicBool,
}

impl Mirror {
    pub(crate) fn new(sink: impl Fn(u64) + Send + Sync + 'static) -> Arc<Self> {
        Arc::new(Self {
            sink: Box::new(sink),
            last: Mutex::new(None),
            failed: AtomicBool::new(false),
        })
    }

    /// Reports `total` unless a larger one was reported already. A panicking sink is caught,
    /// logged and disabled; it never takes the worker down.
    pub(crate) fn report(&self, imm: u32, total: u64) {
        if self.failed.load(Ordering::Acquire) {
            return;
        }
        let mut last = self.last.lock().unwrap_or_else(|p| p.into_inner());
        if last.is_some_and(|l| l >= total) {
            return;
        }
        *last = Some(total);
        let call = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| (self.sink)(total)));
        if let Err(panic) = call {
            self.failed.store(true, Ordering::Release);
            tracing::error!(
                imm,
                panic = %panic_message(&*panic),
                "a mirror_imm_count sink panicked; it is disabled"
            );
        }
    }

    pub(crate) fn is_failed(&self) -> bool {
        self.failed.load(Ordering::Acquire)
    }
}

pub(crate) use xfer_plugin::panic_message;

/// Handles incoming messages with the sender the transport proved; see
/// `TransferEngine::submit_recvs_with_sender`.
pub(crate) type RecvHandler = Arc<dyn Fn(&[u8], Option<&NetAddr>) + Send + Sync>;

/// What callers ask of the worker.
pub(crate) enum Command {
    /// A transfer made of listed RDMA requests (writes or reads: single, scatter, barrier);
    /// finishes when all have. `submitted`: when the caller submitted it (latencies are
    /// measured from there).
    Listed {
        ops: Ops,
        on_done: OnDone,
        submitted: Stamp,
    },
    /// A paged transfer (its own variant, boxed: a single write's command stays small).
    Pages {
        work: Box<PagedWork>,
        on_done: OnDone,
        submitted: Stamp,
    },
    /// A message to a peer's main address.
    Send {
        peer: NetAddr,
        data: Vec<u8>,
        on_done: OnDone,
        submitted: Stamp,
    },
    /// Register with every NIC; reply with one registration per NIC. If the caller gave up
    /// waiting (the reply cannot be sent), the worker deregisters at once: no registration
    /// outlives its caller's knowledge of it.
    Register {
        region: MemoryRegion,
        reply: Sender<Result<Vec<Registration>>>,
    },
    /// Deregister one local key per NIC; then drop `keep` (what owns the memory, for a
    /// deregistration queued from the worker's own thread: freed only once no NIC can
    /// touch it).
    Deregister {
        keys: Vec<u64>,
        reply: Sender<Result<()>>,
        keep: Option<Box<dyn std::any::Any + Send>>,
    },
    /// Add receive buffers on the main NIC (reply: whether the NIC took them; `None` for the
    /// reposts after a message was handled, whose failure is logged).
    PostRecvs {
        buf_len: usize,
        count: usize,
        reply: Option<Sender<Result<()>>>,
    },
    /// Cancel the transfer behind `control` (see `TransferHandle::cancel`).
    Cancel {
        control: Arc<control::TransferControl>,
    },
    /// A copy of the worker's counters.
    Stats {
        reply: Sender<Result<crate::stats::Stats>>,
    },
    /// Fail what is in flight and stop.
    Shutdown,
}

impl Command {
    /// Sets when a transfer or send was submitted (see `local`); other commands have no time.
    pub(crate) fn stamp(&mut self, now: Stamp) {
        match self {
            Command::Listed { submitted, .. }
            | Command::Pages { submitted, .. }
            | Command::Send { submitted, .. } => *submitted = now,
            _ => {}
        }
    }
}

/// Whether the worker parked, and its thread: all a waker needs. Domains' wakers own it
/// outright (it owns nothing back), so a wake from a completion path — once per operation on
/// an inline backend — is a load and, only when parked, an unpark: no upgrade of a weak
/// handle to the whole engine and no reference count touched.
pub(crate) struct Parking {
    /// Set by the worker before its last look ahead of a park, cleared when it runs again.
    parked: AtomicBool,
    /// Unparks, counted for tests.
    #[cfg(test)]
    unparks: std::sync::atomic::AtomicU64,
    worker: OnceLock<Thread>,
}

impl Default for Parking {
    fn default() -> Self {
        Self {
            parked: AtomicBool::new(false),
            #[cfg(test)]
            unparks: std::sync::atomic::AtomicU64::new(0),
            worker: OnceLock::new(),
        }
    }
}

impl Parking {
    /// Records the worker's thread (once, when it is spawned).
    pub(crate) fn set_worker(&self, thread: Thread) {
        let _ = self.worker.set(thread);
    }

    /// The worker announces that it parks (`true`) or runs again (`false`).
    pub(crate) fn announce(&self, parked: bool) {
        self.parked.store(parked, Ordering::SeqCst);
    }

    /// Whether the worker announced that it parks: what a Domain's waker asks (to wake it,
    /// and whether to arm its own wake-up).
    pub(crate) fn is_parked(&self) -> bool {
        self.parked.load(Ordering::SeqCst)
    }

    /// Wakes the worker if it parked. The worker announces `parked` and then checks the queue
    /// and its Domains once more before parking (both sides use `SeqCst`), so either it sees
    /// the new work or this sees `parked`: no wake-up is lost, and a busy worker costs
    /// submitters one shared load instead of an atomic swap.
    pub(crate) fn wake(&self) {
        if self.is_parked() {
            self.unpark();
        }
    }

    /// How many times the worker was unparked.
    #[cfg(test)]
    pub(crate) fn unparks(&self) -> u64 {
        self.unparks.load(Ordering::Relaxed)
    }

    /// Unparks the worker whatever it announced.
    pub(crate) fn unpark(&self) {
        #[cfg(test)]
        self.unparks.fetch_add(1, Ordering::Relaxed);
        if let Some(t) = self.worker.get() {
            t.unpark();
        }
    }
}

/// State shared by the engine's handle, its worker and its callback thread.
pub(crate) struct Shared {
    pub(crate) config: Config,
    pub(crate) backend: String,
    queue: queue::SubmissionQueue<Command>,
    /// The worker's parking state; Domains' wakers hold it directly (see [`Parking`]).
    pub(crate) parking: Arc<Parking>,
    /// Set once the worker closed its Domains (it stopped or failed): from then on no NIC
    /// touches registered memory (see `wait_domains_closed`).
    domains_closed: Mutex<bool>,
    domains_closed_cv: std::sync::Condvar,
    /// Set (before `domains_closed`) when a Domain panicked while closing and was abandoned:
    /// its registrations may still be live, so no registered memory is ever said free.
    domains_abandoned: AtomicBool,
    pub(crate) imm: Mutex<ImmCounter<OnDone>>,
    pub(crate) jobs: Sender<Job>,
    pub(crate) recv_handler: OnceLock<(usize, RecvHandler)>,
    closed: AtomicBool,
    /// Mirrors of immediates' totals, and whether there are any (checked per batch).
    pub(crate) mirrors: std::sync::RwLock<std::collections::HashMap<u32, Vec<Arc<Mirror>>>>,
    pub(crate) has_mirrors: AtomicBool,
    /// Transfers and sends accepted and not finished (see the module docs).
    pub(crate) outstanding: AtomicUsize,
    /// Why the worker failed, once it has (then nothing more is accepted).
    pub(crate) failed: OnceLock<String>,
    /// Notifications received and not yet taken (see `TransferEngine::poll_notifications`).
    pub(crate) notifications: Mutex<Inbox>,
    pub(crate) notified: std::sync::Condvar,
    /// Live registrations shared by the `reg_mr`s they cover (`[memory] registration_cache`).
    pub(crate) registrations: Option<Mutex<crate::regcache::RegistrationCache<Vec<Registration>>>>,
    /// `reg_mr`s the cache served without registering.
    pub(crate) registration_cache_hits: std::sync::atomic::AtomicU64,
}

impl Shared {
    pub(crate) fn new(config: Config, backend: String, jobs: Sender<Job>) -> Self {
        let (max_idle_imms, per_peer) = (
            config.worker.max_idle_imms,
            config.worker.max_idle_imms_per_peer,
        );
        let notifications = Mutex::new(Inbox::new(config.worker.max_notifications));
        let registrations = config
            .memory
            .registration_cache
            .then(|| Mutex::new(crate::regcache::RegistrationCache::new()));
        Self {
            registrations,
            registration_cache_hits: std::sync::atomic::AtomicU64::new(0),
            config,
            backend,
            queue: queue::SubmissionQueue::new(),
            parking: Arc::new(Parking::default()),
            domains_closed: Mutex::new(false),
            domains_closed_cv: std::sync::Condvar::new(),
            domains_abandoned: AtomicBool::new(false),
            imm: Mutex::new(ImmCounter::for_peers(max_idle_imms, per_peer)),
            jobs,
            recv_handler: OnceLock::new(),
            closed: AtomicBool::new(false),
            mirrors: std::sync::RwLock::new(std::collections::HashMap::new()),
            has_mirrors: AtomicBool::new(false),
            outstanding: AtomicUsize::new(0),
            failed: OnceLock::new(),
            notifications,
            notified: std::sync::Condvar::new(),
        }
    }

    /// Queues a transfer or send, counting it against `worker.max_outstanding`; the worker
    /// uncounts it when its `OnDone` fires.
    #[inline(always)]
    pub(crate) fn submit_counted(&self, cmd: Command) -> Result<()> {
        self.submit_stamped(|_| cmd)
    }

    /// [`submit_counted`](Self::submit_counted) for a command made with the time it was
    /// submitted: the clock is read here, unless the command is submitted on this engine's
    /// worker, which stamps it with the clock read of the batch it joins.
    #[inline(always)]
    pub(crate) fn submit_stamped(&self, make: impl FnOnce(Stamp) -> Command) -> Result<()> {
        self.take_slot()?;
        self.check_open().inspect_err(|_| self.finished(1))?;
        if let Err(make) = local::push(self, make) {
            self.queue.push(make(Stamp::now()));
            self.wake();
        }
        Ok(())
    }

    /// Takes one slot of `worker.max_outstanding` now for a command queued later (a
    /// notification's send, queued when its transfer finished): the slot is held until the
    /// reservation is used or dropped.
    pub(crate) fn reserve(self: &Arc<Self>) -> Result<Reservation> {
        self.take_slot()?;
        Ok(Reservation {
            shared: Arc::downgrade(self),
        })
    }

    fn take_slot(&self) -> Result<()> {
        let limit = self.config.worker.max_outstanding;
        let before = self.outstanding.fetch_add(1, Ordering::AcqRel);
        if before >= limit {
            self.outstanding.fetch_sub(1, Ordering::AcqRel);
            return Err(Error::Busy {
                outstanding: before,
                limit,
            });
        }
        Ok(())
    }

    /// A snapshot of the worker's counters: one round trip, within `[timeouts] control_ms`.
    pub(crate) fn stats(&self) -> Result<crate::stats::Stats> {
        self.check_not_on_worker("stats")?;
        let (reply, answer) = crossbeam_channel::bounded(1);
        self.submit(Command::Stats { reply })?;
        let timeout = self.config.timeouts.control();
        match answer.recv_timeout(timeout) {
            Ok(stats) => stats.map(|mut s| {
                s.registrations.cache_hits = self.registration_cache_hits.load(Ordering::Relaxed);
                s
            }),
            Err(crossbeam_channel::RecvTimeoutError::Timeout) => Err(Error::Timeout(timeout)),
            // The worker dropped the request: it failed or shut down.
            Err(crossbeam_channel::RecvTimeoutError::Disconnected) => {
                Err(match self.failed.get() {
                    Some(why) => Error::WorkerFailed(why.clone()),
                    None => Error::Shutdown,
                })
            }
        }
    }

    /// Marks `n` counted operations finished.
    pub(crate) fn finished(&self, n: usize) {
        if n > 0 {
            self.outstanding.fetch_sub(n, Ordering::AcqRel);
        }
    }

    /// Queues a command for the worker and wakes it.
    #[inline(always)]
    pub(crate) fn submit(&self, cmd: Command) -> Result<()> {
        self.check_open()?;
        self.queue.push(cmd);
        self.wake();
        Ok(())
    }

    /// Refuses work once the engine is closed or its worker failed.
    #[inline(always)]
    fn check_open(&self) -> Result<()> {
        if self.closed.load(Ordering::Acquire) {
            return Err(Error::Shutdown);
        }
        if let Some(why) = self.failed.get() {
            return Err(Error::WorkerFailed(why.clone()));
        }
        Ok(())
    }

    /// Queues `cmd` whatever state the engine is in, without waking the worker: for what the
    /// worker's own thread leaves for its next pass (see `TransferEngine::dereg_mr_keeping`).
    pub(crate) fn push_for_worker(&self, cmd: Command) {
        self.queue.push(cmd);
    }

    /// Queues the shutdown, whatever state the engine is in (closed, failed).
    pub(crate) fn push_shutdown(&self) {
        self.queue.push(Command::Shutdown);
        self.wake();
        // The worker may be parked without having announced it yet (still opening); it pops
        // the queue first thing when it runs.
        self.parking.unpark();
    }

    /// Refuses further submissions (the engine is being dropped).
    pub(crate) fn close(&self) {
        self.closed.store(true, Ordering::Release);
    }

    /// Whether the engine was shut down.
    pub(crate) fn is_closed(&self) -> bool {
        self.closed.load(Ordering::Acquire)
    }

    /// Keeps this thread busy until `done()` or for at most `worker.wait_poll_us` (and
    /// `limit`), yielding between looks (or spinning, with `worker.yield_when_idle` off):
    /// the worker makes every pass, this thread only looks. Returns `done()`'s last answer.
    pub(crate) fn poll_until(&self, limit: Duration, mut done: impl FnMut() -> bool) -> bool {
        let start = Instant::now();
        let limit = limit.min(Duration::from_micros(self.config.worker.wait_poll_us));
        loop {
            if done() {
                return true;
            }
            if start.elapsed() >= limit {
                return done();
            }
            if self.config.worker.yield_when_idle {
                std::thread::yield_now();
            } else {
                std::hint::spin_loop();
            }
        }
    }

    /// Whether this thread is the worker's: a call that waits for the worker must not be
    /// made here (it would wait for itself), see `Error::OnWorkerThread`.
    pub(crate) fn on_worker_thread(&self) -> bool {
        local::is_worker_of(self)
    }

    /// Refuses a call that waits for the worker when made on the worker's own thread.
    pub(crate) fn check_not_on_worker(&self, call: &'static str) -> Result<()> {
        if self.on_worker_thread() {
            return Err(Error::OnWorkerThread(call));
        }
        Ok(())
    }

    /// The worker closed its Domains: no NIC touches registered memory from here on.
    pub(crate) fn set_domains_closed(&self) {
        *self
            .domains_closed
            .lock()
            .unwrap_or_else(|p| p.into_inner()) = true;
        self.domains_closed_cv.notify_all();
    }

    /// A Domain panicked while closing and was abandoned (called before
    /// [`set_domains_closed`](Self::set_domains_closed)).
    pub(crate) fn abandon_domains(&self) {
        self.domains_abandoned.store(true, Ordering::SeqCst);
    }

    /// Whether a Domain was abandoned while closing: registered memory may then still be in
    /// a NIC's hands, whatever the latch says.
    pub(crate) fn domains_abandoned(&self) -> bool {
        self.domains_abandoned.load(Ordering::SeqCst)
    }

    /// The error a deregistration gets once a Domain was abandoned.
    pub(crate) fn abandoned_error() -> Error {
        Error::WorkerFailed(
            "a Domain panicked while closing: its registrations may still be live, so the \
             memory is kept (leaked) rather than freed"
                .to_owned(),
        )
    }

    /// Whether the worker closed its Domains.
    pub(crate) fn domains_are_closed(&self) -> bool {
        *self
            .domains_closed
            .lock()
            .unwrap_or_else(|p| p.into_inner())
    }

    /// Waits until the worker closed its Domains (it does once the shutdown or a failure is
    /// taken, so this ends: the engine is closed or failed when it is called).
    pub(crate) fn wait_domains_closed(&self) {
        let mut closed = self
            .domains_closed
            .lock()
            .unwrap_or_else(|p| p.into_inner());
        while !*closed {
            closed = self
                .domains_closed_cv
                .wait(closed)
                .unwrap_or_else(|p| p.into_inner());
        }
    }

    /// Wakes the worker if it parked (see [`Parking::wake`]).
    pub(crate) fn wake(&self) {
        self.parking.wake();
    }

    pub(crate) fn lock_imm(&self) -> std::sync::MutexGuard<'_, ImmCounter<OnDone>> {
        // A panic while holding this lock cannot leave the counter half-updated (every
        // method finishes its own bookkeeping before returning), so poisoning is ignored.
        self.imm.lock().unwrap_or_else(|p| p.into_inner())
    }
}

/// One slot of `worker.max_outstanding`, taken by [`Shared::reserve`]; given back on drop
/// unless [`submit`](Self::submit) handed it to a command (the worker frees it then).
pub(crate) struct Reservation {
    shared: std::sync::Weak<Shared>,
}

impl Reservation {
    /// Queues `cmd` in the reserved slot.
    pub(crate) fn submit(self, cmd: Command) -> Result<()> {
        let shared = self.shared.upgrade().ok_or(Error::Shutdown)?;
        shared.submit(cmd)?;
        // The command owns the slot now.
        std::mem::forget(self);
        Ok(())
    }
}

impl Drop for Reservation {
    fn drop(&mut self) {
        if let Some(shared) = self.shared.upgrade() {
            shared.finished(1);
        }
    }
}

/// Whatever is still queued when the last holder lets go was pushed after the worker
/// stopped (a holder of `Shared` — a receive handler's repost, a binding's close — raced the
/// shutdown between its `closed` check and its push): it is refused here, so every accepted
/// operation still completes exactly once, with `Shutdown`.
impl Drop for Shared {
    fn drop(&mut self) {
        while let Some(cmd) = self.queue.pop() {
            match cmd {
                Command::Listed { on_done, .. }
                | Command::Pages { on_done, .. }
                | Command::Send { on_done, .. } => {
                    on_done.complete(Err(Error::Shutdown), &self.jobs);
                }
                Command::Register { reply, .. } => {
                    let _ = reply.send(Err(Error::Shutdown));
                }
                Command::Deregister { reply, .. } => {
                    let _ = reply.send(Ok(()));
                }
                Command::PostRecvs { reply, .. } => {
                    if let Some(reply) = reply {
                        let _ = reply.send(Err(Error::Shutdown));
                    }
                }
                Command::Stats { .. } | Command::Cancel { .. } | Command::Shutdown => {}
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::runtime::completion::DoneFlag;

    /// A command is moved several times from `submit_*` to the core (into the queue, out of
    /// the batch, into the handler): at 128 bytes or less a move is a few register copies,
    /// beyond it a call to memcpy (~30 instructions each, on every single write).
    #[test]
    fn a_command_fits_in_128_bytes() {
        assert!(
            std::mem::size_of::<Command>() <= 128,
            "Command is {} bytes (Ops {}, OnDone {})",
            std::mem::size_of::<Command>(),
            std::mem::size_of::<Ops>(),
            std::mem::size_of::<OnDone>()
        );
    }

    /// Issue 25 §7: a command pushed after the worker drained the queue and stopped (the
    /// window between a submitter's `closed` check and its push) still completes, once.
    #[test]
    fn a_command_stranded_after_the_worker_stopped_completes_with_shutdown() {
        let (jobs, _rx) = crossbeam_channel::unbounded();
        let shared = Shared::new(Config::default(), "mock".into(), jobs);
        let flag = DoneFlag::new();
        let (reply, replies) = crossbeam_channel::unbounded();
        // As if the submitter passed the `closed` check, and the worker then stopped.
        shared.queue.push(Command::Listed {
            ops: Ops::new(),
            on_done: OnDone::Flag(Arc::clone(&flag)),
            submitted: Stamp::now(),
        });
        shared.queue.push(Command::Register {
            region: MemoryRegion {
                ptr: 0,
                len: 0,
                device: crate::domain::Device::Host,
                remote_write: false,
                remote_read: false,
            },
            reply,
        });
        drop(shared);
        assert!(matches!(flag.result(), Some(Err(Error::Shutdown))));
        assert!(matches!(replies.try_recv(), Ok(Err(Error::Shutdown))));
    }
}
