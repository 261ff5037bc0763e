//! How a caller learns that something finished: a callback, or a flag or counter to poll.
//!
//! Callbacks run on the engine's callback thread, never on the worker, so a slow or
//! re-submitting callback cannot stall the NICs. Flags and counters are set by the worker
//! directly (no thread hop), which is what the fastest callers use.

use std::fmt;
use std::sync::atomic::{fence, AtomicU64, AtomicU8, AtomicUsize, Ordering};
use std::sync::{Arc, Condvar, Mutex};
use std::time::{Duration, Instant};

use crossbeam_channel::Sender;

use crate::error::{Error, Result};

/// A unit of work for the callback thread; `None` tells it to stop once all before it ran.
pub(crate) type Job = Option<Box<dyn FnOnce() + Send>>;

/// What to do when an operation finishes (exactly once, with its outcome).
pub enum OnDone {
    /// Call this on the callback thread.
    Callback(Box<dyn FnOnce(Result<()>) + Send>),
    /// Set this flag.
    Flag(Arc<DoneFlag>),
    /// Count into this counter (one counter can serve many operations).
    Counter(Arc<DoneCounter>),
    /// Report to a [`TransferHandle`](super::control::TransferHandle), then complete the
    /// inner one (made by `TransferEngine::cancellable`).
    Controlled(Arc<super::control::TransferControl>, Box<OnDone>),
}

impl fmt::Debug for OnDone {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Self::Callback(_) => f.write_str("OnDone::Callback"),
            Self::Flag(flag) => write!(f, "OnDone::Flag({flag:?})"),
            Self::Counter(c) => write!(f, "OnDone::Counter({c:?})"),
            Self::Controlled(_, inner) => write!(f, "OnDone::Controlled({inner:?})"),
        }
    }
}

impl OnDone {
    /// The control of a cancellable transfer's `OnDone`.
    pub(crate) fn control(&self) -> Option<&Arc<super::control::TransferControl>> {
        match self {
            Self::Controlled(c, _) => Some(c),
            _ => None,
        }
    }

    /// A callback.
    pub fn callback(f: impl FnOnce(Result<()>) + Send + 'static) -> Self {
        Self::Callback(Box::new(f))
    }

    /// Delivers the outcome: flags and counters at once, callbacks through `jobs`. If the
    /// callback thread is gone (engine shut down), the callback runs here rather than be lost.
    pub(crate) fn complete(self, result: Result<()>, jobs: &Sender<Job>) {
        match self {
            Self::Controlled(control, inner) => {
                control.finish(&result);
                inner.complete(result, jobs)
            }
            Self::Flag(flag) => flag.set(result),
            Self::Counter(counter) => counter.add(result),
            Self::Callback(cb) => {
                if let Err(returned) = jobs.send(Some(Box::new(move || cb(result)))) {
                    if let Some(job) = returned.into_inner() {
                        job();
                    }
                }
            }
        }
    }
}

/// Callbacks finished in one worker pass, handed to the callback thread as one job.
pub(crate) type CallbackBatch = Vec<Box<dyn FnOnce() + Send>>;

/// Successes of one [`DoneCounter`] in a row, added at once: one increment and one wake-up
/// of its waiters (a lock and a futex call when one sleeps) per run, not per operation — a
/// burst's writes usually share their counter (issue 29).
#[derive(Default)]
pub(crate) struct CounterRun(Option<(Arc<DoneCounter>, u64)>);

impl CounterRun {
    /// Delivers `on_done`'s outcome as [`OnDone::complete_batched`] does, but holds a
    /// counter's success back to add it with the next ones of the same counter. Anything
    /// else first adds what is held, so outcomes keep their order.
    pub(crate) fn complete(
        &mut self,
        on_done: OnDone,
        result: Result<()>,
        batch: &mut CallbackBatch,
    ) {
        match on_done {
            OnDone::Counter(counter) if result.is_ok() => {
                if let Some((kept, n)) = &mut self.0 {
                    if Arc::ptr_eq(kept, &counter) {
                        *n += 1;
                        return;
                    }
                }
                self.flush();
                self.0 = Some((counter, 1));
            }
            other => {
                self.flush();
                other.complete_batched(result, batch);
            }
        }
    }

    /// Adds what is held.
    pub(crate) fn flush(&mut self) {
        if let Some((counter, n)) = self.0.take() {
            counter.add_ok(n);
        }
    }
}

/// A pass that unwinds between `complete` and `flush` (an engine-internal panic, caught by the
/// worker's loop) still adds the successes it held: the operations finished, and a waiter on
/// the counter must see them rather than wait out its timeout. Adding wakes sleepers only
/// (a counter runs no user code), so this cannot panic again while unwinding.
impl Drop for CounterRun {
    fn drop(&mut self) {
        self.flush();
    }
}

impl OnDone {
    /// Delivers the outcome on this thread: for code already running on the callback
    /// thread (a callback that finishes another operation's `OnDone`).
    pub(crate) fn complete_inline(self, result: Result<()>) {
        match self {
            Self::Controlled(control, inner) => {
                control.finish(&result);
                inner.complete_inline(result)
            }
            Self::Flag(flag) => flag.set(result),
            Self::Counter(counter) => counter.add(result),
            Self::Callback(cb) => cb(result),
        }
    }

    /// Like [`complete`](Self::complete), but a callback joins `batch` instead of being sent
    /// alone: one channel message (and at most one wake-up) per worker pass, not per callback.
    pub(crate) fn complete_batched(self, result: Result<()>, batch: &mut CallbackBatch) {
        match self {
            Self::Controlled(control, inner) => {
                control.finish(&result);
                inner.complete_batched(result, batch)
            }
            Self::Flag(flag) => flag.set(result),
            Self::Counter(counter) => counter.add(result),
            Self::Callback(cb) => batch.push(Box::new(move || cb(result))),
        }
    }
}

/// Runs a user callback, logging (not propagating) a panic.
pub(crate) fn run_contained(cb: impl FnOnce()) {
    if let Err(panic) = std::panic::catch_unwind(std::panic::AssertUnwindSafe(cb)) {
        tracing::error!(
            panic = %super::panic_message(&*panic),
            "an xfer callback panicked; continuing with the next one"
        );
    }
}

/// Sends a batch of callbacks to the callback thread (or runs them here if it is gone).
pub(crate) fn send_batch(batch: &mut CallbackBatch, jobs: &Sender<Job>) {
    if batch.is_empty() {
        return;
    }
    let callbacks = std::mem::take(batch);
    // Each callback on its own: one that panics must not drop the others of its batch.
    let job: Box<dyn FnOnce() + Send> = Box::new(move || {
        for cb in callbacks {
            run_contained(cb);
        }
    });
    if let Err(returned) = jobs.send(Some(job)) {
        if let Some(job) = returned.into_inner() {
            job();
        }
    }
}

impl From<Arc<DoneFlag>> for OnDone {
    fn from(flag: Arc<DoneFlag>) -> Self {
        Self::Flag(flag)
    }
}

impl From<Arc<DoneCounter>> for OnDone {
    fn from(counter: Arc<DoneCounter>) -> Self {
        Self::Counter(counter)
    }
}

const PENDING: u8 = 0;
const OK: u8 = 1;
const FAILED: u8 = 2;

/// The threads blocked in a flag's or counter's wait. A waiter spins briefly, yields a while,
/// then blocks on a condition variable that the setter signals: it wakes when the outcome is
/// there, not at the next slice of a sleep loop (the 50 µs sleeps used before added their
/// slice and the timer slack to every wait that outlasted the spin — most of a round trip's
/// latency on a small machine).
#[derive(Debug, Default)]
struct Sleepers {
    /// Waiters that may be blocked; the setter takes the lock only when there are any.
    count: AtomicUsize,
    lock: Mutex<()>,
    cv: Condvar,
}

impl Sleepers {
    /// Waits until `done()` or the deadline; returns `done()`'s last answer.
    fn wait_until(&self, timeout: Duration, mut done: impl FnMut() -> bool) -> bool {
        let start = Instant::now();
        for round in 0..256 {
            if done() {
                return true;
            }
            if start.elapsed() >= timeout {
                return done();
            }
            if round < 64 {
                std::hint::spin_loop();
            } else {
                std::thread::yield_now();
            }
        }
        self.count.fetch_add(1, Ordering::SeqCst);
        // Pairs with the fence in `notify`: either the setter sees this waiter counted, or
        // the `done()` below sees the outcome it stored.
        fence(Ordering::SeqCst);
        let mut guard = self.lock.lock().unwrap_or_else(|p| p.into_inner());
        let finished = loop {
            if done() {
                break true;
            }
            let elapsed = start.elapsed();
            if elapsed >= timeout {
                break done();
            }
            guard = match self.cv.wait_timeout(guard, timeout - elapsed) {
                Ok((g, _)) => g,
                Err(p) => p.into_inner().0,
            };
        };
        drop(guard);
        self.count.fetch_sub(1, Ordering::SeqCst);
        finished
    }

    /// Wakes the blocked waiters; called after the outcome is stored.
    fn notify(&self) {
        fence(Ordering::SeqCst);
        if self.count.load(Ordering::SeqCst) > 0 {
            // Taking the lock orders this after a waiter's check of `done()`: it is either
            // blocked in `wait_timeout` (and woken) or has not checked yet (and will see it).
            drop(self.lock.lock().unwrap_or_else(|p| p.into_inner()));
            self.cv.notify_all();
        }
    }
}

/// What a flag calls right after it is set, with the flag (see [`DoneFlag::with_waker`]).
type Waker = Box<dyn Fn(&DoneFlag) + Send + Sync>;

/// A one-shot completion flag.
#[derive(Default)]
pub struct DoneFlag {
    state: AtomicU8,
    error: Mutex<Option<Error>>,
    waker: Option<Waker>,
    sleepers: Sleepers,
}

impl fmt::Debug for DoneFlag {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("DoneFlag")
            .field("state", &self.state)
            .field("waker", &self.waker.is_some())
            .finish_non_exhaustive()
    }
}

impl DoneFlag {
    /// A new, unset flag.
    pub fn new() -> Arc<Self> {
        Arc::new(Self::default())
    }

    /// A flag that calls `waker` right after it is set, **on the thread that sets it**: the
    /// engine's worker for every outcome a pass delivers, or the calling thread for an
    /// outcome known when the call is made (an expectation its arrivals already met). Never
    /// on a thread that only submits or waits. It must be quick and must not block (wake a
    /// waiter, hand work to another thread); engine calls that wait for the worker fail
    /// there with `Error::OnWorkerThread` rather than wait for themselves, and
    /// `TransferEngine::shutdown` returns at once (the Domains close when the pass ends). It
    /// saves the hop through the callback thread that an [`OnDone::Callback`] takes — for
    /// bindings whose waiters spin on the flag and only sometimes need a callback (Python's
    /// `Transfer`), and for answering an arrival at once: the waker may call
    /// `expect_imm_count` and submit transfers (both only queue work for the worker; see
    /// `transfer-bench --latency --reactive`). A panic in it is caught and logged.
    pub fn with_waker(waker: impl Fn() + Send + Sync + 'static) -> Arc<Self> {
        Self::with_flag_waker(move |_| waker())
    }

    /// Like [`with_waker`](Self::with_waker), but the waker is handed the flag it wakes for,
    /// to read its [`result`](Self::result): a waker that needs the outcome holds no
    /// reference back to its flag (a cell filled after construction, one more allocation
    /// and initialisation per flag).
    pub fn with_flag_waker(waker: impl Fn(&DoneFlag) + Send + Sync + 'static) -> Arc<Self> {
        Arc::new(Self {
            waker: Some(Box::new(waker)),
            ..Self::default()
        })
    }

    fn set(&self, result: Result<()>) {
        match result {
            Ok(()) => self.state.store(OK, Ordering::Release),
            Err(e) => {
                *self.error.lock().unwrap_or_else(|p| p.into_inner()) = Some(e);
                self.state.store(FAILED, Ordering::Release);
            }
        }
        self.sleepers.notify();
        if let Some(waker) = &self.waker {
            if std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| waker(self))).is_err() {
                tracing::error!("a DoneFlag waker panicked");
            }
        }
    }

    /// Whether the operation has finished.
    pub fn is_done(&self) -> bool {
        self.state.load(Ordering::Acquire) != PENDING
    }

    /// The outcome, once finished.
    pub fn result(&self) -> Option<Result<()>> {
        match self.state.load(Ordering::Acquire) {
            PENDING => None,
            OK => Some(Ok(())),
            _ => Some(Err(self
                .error
                .lock()
                .unwrap_or_else(|p| p.into_inner())
                .clone()
                .unwrap_or(Error::Shutdown))),
        }
    }

    /// Waits up to `timeout` for the outcome; `Err(Timeout)` if it is not there by then.
    pub fn wait(&self, timeout: Duration) -> Result<()> {
        self.sleepers.wait_until(timeout, || self.is_done());
        self.result().unwrap_or(Err(Error::Timeout(timeout)))
    }
}

/// Counts the outcomes of many operations.
#[derive(Debug, Default)]
pub struct DoneCounter {
    ok: AtomicU64,
    failed: AtomicU64,
    first_error: Mutex<Option<Error>>,
    sleepers: Sleepers,
}

impl DoneCounter {
    /// A new counter at zero.
    pub fn new() -> Arc<Self> {
        Arc::new(Self::default())
    }

    fn add(&self, result: Result<()>) {
        match result {
            Ok(()) => return self.add_ok(1),
            Err(e) => {
                self.first_error
                    .lock()
                    .unwrap_or_else(|p| p.into_inner())
                    .get_or_insert(e);
                self.failed.fetch_add(1, Ordering::Release);
            }
        }
        self.sleepers.notify();
    }

    /// `n` operations that succeeded, with one wake-up.
    fn add_ok(&self, n: u64) {
        self.ok.fetch_add(n, Ordering::Release);
        self.sleepers.notify();
    }

    /// Operations that succeeded.
    pub fn ok(&self) -> u64 {
        self.ok.load(Ordering::Acquire)
    }

    /// Operations that failed.
    pub fn failed(&self) -> u64 {
        self.failed.load(Ordering::Acquire)
    }

    /// Operations finished either way.
    pub fn finished(&self) -> u64 {
        self.ok() + self.failed()
    }

    /// The first error counted, if any.
    pub fn first_error(&self) -> Option<Error> {
        self.first_error
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .clone()
    }

    /// Waits up to `timeout` until `n` operations have finished; then `Ok` if none failed,
    /// else the first error; `Err(Timeout)` if fewer than `n` finished in time.
    pub fn wait_for(&self, n: u64, timeout: Duration) -> Result<()> {
        if !self.sleepers.wait_until(timeout, || self.finished() >= n) {
            return Err(Error::Timeout(timeout));
        }
        match self.first_error() {
            Some(e) => Err(e),
            None => Ok(()),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::panic::AssertUnwindSafe;
    use std::sync::atomic::AtomicUsize;

    #[test]
    fn successes_held_by_a_run_are_added_when_the_pass_unwinds() {
        let counter = DoneCounter::new();
        let unwound = std::panic::catch_unwind(AssertUnwindSafe(|| {
            let mut batch = CallbackBatch::new();
            let mut run = CounterRun::default();
            run.complete(OnDone::Counter(Arc::clone(&counter)), Ok(()), &mut batch);
            run.complete(OnDone::Counter(Arc::clone(&counter)), Ok(()), &mut batch);
            panic!("an engine-internal panic before the flush");
        }));
        assert!(unwound.is_err());
        assert_eq!(counter.ok(), 2, "both successes reach the counter");
    }

    /// Successes of one counter in a row are added at once, and nothing reorders around
    /// them: an error on the same counter, another counter or a flag first adds what was
    /// held; a waiter blocked on the counter is woken by the held successes' flush.
    #[test]
    fn a_counters_run_of_successes_is_added_once_in_order() {
        let (a, b, flag) = (DoneCounter::new(), DoneCounter::new(), DoneFlag::new());
        let mut batch = CallbackBatch::new();
        let mut run = CounterRun::default();
        std::thread::scope(|s| {
            let waiter = s.spawn(|| a.wait_for(5, Duration::from_secs(60)));
            for _ in 0..3 {
                run.complete(OnDone::Counter(Arc::clone(&a)), Ok(()), &mut batch);
            }
            assert_eq!(a.ok(), 0, "held until the run ends");
            run.complete(
                OnDone::Counter(Arc::clone(&a)),
                Err(Error::Cancelled),
                &mut batch,
            );
            assert_eq!(
                (a.ok(), a.failed()),
                (3, 1),
                "the run first, then the error"
            );
            run.complete(OnDone::Counter(Arc::clone(&b)), Ok(()), &mut batch);
            run.complete(OnDone::Counter(Arc::clone(&a)), Ok(()), &mut batch);
            assert_eq!(b.ok(), 1, "another counter ends b's run");
            run.complete(OnDone::Flag(Arc::clone(&flag)), Ok(()), &mut batch);
            assert_eq!(a.ok(), 4, "a flag ends a's run");
            run.complete(OnDone::Counter(Arc::clone(&a)), Ok(()), &mut batch);
            run.flush();
            assert_eq!((a.ok(), a.failed(), b.ok()), (5, 1, 1));
            assert!(flag.is_done());
            assert!(matches!(waiter.join().unwrap(), Err(Error::Cancelled)));
        });
        assert!(batch.is_empty(), "no callbacks were involved");
    }

    #[test]
    fn blocked_waiters_are_woken_by_the_outcome_and_time_out_without_it() {
        // Several threads block (past the spin) on one flag and one counter; each returns
        // with the outcome set from another thread. A deadline long enough that only a
        // lost wake-up could reach it; proves no timing.
        let flag = DoneFlag::new();
        let counter = DoneCounter::new();
        std::thread::scope(|s| {
            let waiters: Vec<_> = (0..4)
                .map(|_| {
                    s.spawn(|| {
                        (
                            flag.wait(Duration::from_secs(60)),
                            counter.wait_for(3, Duration::from_secs(60)),
                        )
                    })
                })
                .collect();
            std::thread::sleep(Duration::from_millis(20));
            OnDone::Flag(Arc::clone(&flag)).complete_inline(Ok(()));
            for _ in 0..2 {
                OnDone::Counter(Arc::clone(&counter)).complete_inline(Ok(()));
            }
            OnDone::Counter(Arc::clone(&counter))
                .complete_inline(Err(Error::Timeout(Duration::ZERO)));
            for w in waiters {
                let (f, c) = w.join().unwrap();
                assert!(f.is_ok());
                assert!(matches!(c, Err(Error::Timeout(d)) if d.is_zero()), "{c:?}");
            }
        });
        assert_eq!(flag.sleepers.count.load(Ordering::SeqCst), 0);
        let never = DoneFlag::new();
        assert!(matches!(
            never.wait(Duration::from_millis(5)),
            Err(Error::Timeout(_))
        ));
        assert_eq!(
            DoneCounter::new().wait_for(1, Duration::from_millis(5)),
            Err(Error::Timeout(Duration::from_millis(5)))
        );
    }

    #[test]
    fn a_flags_waker_runs_once_after_the_outcome_is_visible() {
        let calls = Arc::new(AtomicUsize::new(0));
        let seen = Arc::new(Mutex::new(None));
        let flag = {
            let (calls, seen) = (Arc::clone(&calls), Arc::clone(&seen));
            let slot: Arc<std::sync::OnceLock<std::sync::Weak<DoneFlag>>> = Arc::default();
            let inner = Arc::clone(&slot);
            let flag = DoneFlag::with_waker(move || {
                calls.fetch_add(1, Ordering::SeqCst);
                let f = inner.get().and_then(std::sync::Weak::upgrade).unwrap();
                *seen.lock().unwrap() = Some(f.result().map(|r| r.is_err()));
            });
            slot.set(Arc::downgrade(&flag)).unwrap();
            flag
        };
        OnDone::Flag(Arc::clone(&flag)).complete_inline(Err(Error::Shutdown));
        assert_eq!(calls.load(Ordering::SeqCst), 1);
        assert_eq!(*seen.lock().unwrap(), Some(Some(true)));
        // A panicking waker is contained.
        let bad = DoneFlag::with_waker(|| panic!("waker"));
        OnDone::Flag(Arc::clone(&bad)).complete_inline(Ok(()));
        assert!(bad.is_done());
    }

    #[test]
    fn a_flag_waker_is_handed_its_own_flag_with_the_outcome_set() {
        let seen = Arc::new(Mutex::new(Vec::new()));
        let flag = {
            let seen = Arc::clone(&seen);
            DoneFlag::with_flag_waker(move |flag| {
                seen.lock()
                    .unwrap()
                    .push((flag as *const DoneFlag as usize, flag.result()));
            })
        };
        OnDone::Flag(Arc::clone(&flag)).complete_inline(Err(Error::Shutdown));
        assert_eq!(
            *seen.lock().unwrap(),
            vec![(Arc::as_ptr(&flag) as usize, Some(Err(Error::Shutdown)))]
        );
        let bad = DoneFlag::with_flag_waker(|_| panic!("waker"));
        OnDone::Flag(Arc::clone(&bad)).complete_inline(Ok(()));
        assert_eq!(bad.result(), Some(Ok(())));
    }
}
