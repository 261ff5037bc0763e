//! `xfer.Transfer`: one submitted operation's completion, usable three ways (wait, callback,
//! await) and carrying its telemetry.

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Condvar, Mutex, OnceLock, Weak};
use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};

use engine_core::{DoneFlag, OnDone};
use pyo3::prelude::*;

use crate::errors;

/// Exceptions raised by Python callbacks (reported through `sys.unraisablehook` and counted:
/// `xfer.callback_errors()`).
pub(crate) static CALLBACK_ERRORS: AtomicU64 = AtomicU64::new(0);

/// The longest `wait()` looks without sleeping (the engine's `worker.wait_poll_us` bounds it
/// further).
const LOOK: Duration = Duration::from_millis(2);

fn unix_now() -> f64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map_or(0.0, |d| d.as_secs_f64())
}

#[derive(Default)]
struct State {
    completed_at: Option<(f64, Instant)>,
    /// Waiters asleep on the condition variable: the waker (on the engine's worker) makes
    /// the futex call only when there is one, not once per transfer.
    sleepers: usize,
    /// Python callbacks waiting for the outcome (taken when it comes).
    callbacks: Vec<Py<PyAny>>,
}

/// A transfer's state beside its `DoneFlag`: when it finished and who waits for it.
pub(crate) struct Shared {
    state: Mutex<State>,
    cond: Condvar,
}

impl Shared {
    fn lock(&self) -> std::sync::MutexGuard<'_, State> {
        self.state.lock().unwrap_or_else(|p| p.into_inner())
    }
}

/// Work for the thread that runs Python callbacks (never the engine's worker, which must
/// not wait for the GIL).
type Job = Box<dyn FnOnce(Python<'_>) + Send>;

/// Waits (GIL released) until every callback handed to the bindings' callback thread so
/// far has run: `close()` returns only after the callbacks of what it failed.
pub(crate) fn drain_callbacks(py: Python<'_>) {
    if ON_CALLBACK_THREAD.with(|on| on.get()) {
        // Called from a callback (close() inside on_done): the barrier would queue behind
        // the callback that waits for it. The callbacks of what this close failed run right
        // after the current one returns.
        return;
    }
    let (tx, rx) = std::sync::mpsc::channel();
    dispatch(Box::new(move |_| {
        let _ = tx.send(());
    }));
    py.detach(move || {
        let _ = rx.recv_timeout(std::time::Duration::from_secs(60));
    });
}

thread_local! {
    /// Whether this thread is the bindings' callback thread.
    static ON_CALLBACK_THREAD: std::cell::Cell<bool> = const { std::cell::Cell::new(false) };
}

/// The bindings' callback thread, started on first use.
pub(crate) fn dispatch(job: Job) {
    static JOBS: OnceLock<Mutex<std::sync::mpsc::Sender<Job>>> = OnceLock::new();
    let jobs = JOBS.get_or_init(|| {
        let (tx, rx) = std::sync::mpsc::channel::<Job>();
        std::thread::Builder::new()
            .name("xfer-py-callbacks".into())
            .spawn(move || {
                ON_CALLBACK_THREAD.with(|on| on.set(true));
                while let Ok(job) = rx.recv() {
                    Python::attach(job);
                }
            })
            .expect("spawning the Python callback thread");
        Mutex::new(tx)
    });
    let _ = jobs.lock().unwrap_or_else(|p| p.into_inner()).send(job);
}

/// Calls a Python callback with `None` or the exception; an exception it raises is reported,
/// never propagated into the engine's threads.
pub(crate) fn call_reporting(py: Python<'_>, cb: &Py<PyAny>, args: impl IntoPyObjectTuple) {
    if let Err(e) = args.call(py, cb) {
        CALLBACK_ERRORS.fetch_add(1, Ordering::Relaxed);
        e.write_unraisable(py, Some(cb.bind(py)));
    }
}

/// Argument tuples [`call_reporting`] takes (a small seam so callbacks of different shapes
/// share one reporting path).
pub(crate) trait IntoPyObjectTuple {
    fn call(self, py: Python<'_>, cb: &Py<PyAny>) -> PyResult<()>;
}

impl IntoPyObjectTuple for Option<PyErr> {
    fn call(self, py: Python<'_>, cb: &Py<PyAny>) -> PyResult<()> {
        let arg = self.map(|e| e.into_value(py));
        cb.call1(py, (arg,)).map(drop)
    }
}

impl IntoPyObjectTuple for (u64, u64) {
    fn call(self, py: Python<'_>, cb: &Py<PyAny>) -> PyResult<()> {
        cb.call1(py, self).map(drop)
    }
}

impl IntoPyObjectTuple for (u64,) {
    fn call(self, py: Python<'_>, cb: &Py<PyAny>) -> PyResult<()> {
        cb.call1(py, self).map(drop)
    }
}

impl IntoPyObjectTuple for Vec<u8> {
    fn call(self, py: Python<'_>, cb: &Py<PyAny>) -> PyResult<()> {
        let bytes = pyo3::types::PyBytes::new(py, &self);
        cb.call1(py, (bytes,)).map(drop)
    }
}

/// A message and its sender's address bytes (empty when unproven).
impl IntoPyObjectTuple for (Vec<u8>, Vec<u8>) {
    fn call(self, py: Python<'_>, cb: &Py<PyAny>) -> PyResult<()> {
        let data = pyo3::types::PyBytes::new(py, &self.0);
        let sender = pyo3::types::PyBytes::new(py, &self.1);
        cb.call1(py, (data, sender)).map(drop)
    }
}

/// The outcome of one operation (`submit_*` and `expect_imm_count` return it).
///
/// Wait for it with `wait(timeout)` (releases the GIL), poll it with `done()`, `await` it
/// from asyncio, or pass `on_done=` / call `add_done_callback(fn)`: `fn(None)` on success,
/// `fn(exc)` with the `xfer.Error` on failure, called on the engine's callback thread.
#[pyclass(module = "xfer", frozen)]
pub(crate) struct Transfer {
    shared: Arc<Shared>,
    /// Set by the engine's worker; its waker records the time, wakes sleeping waiters and
    /// hands callbacks to the Python callback thread — no hop through the engine's callback
    /// thread, so `wait()` on a short transfer costs little more than the transfer.
    flag: Arc<DoneFlag>,
    kind: &'static str,
    nbytes: u64,
    posted_at: f64,
    posted: Instant,
    /// Status and cancel (transfers and expectations).
    handle: Option<engine_core::TransferHandle>,
    /// Whether it finishes only once its peer took its notification (`notify=`).
    notifies: bool,
    /// The engine it was submitted to: `wait()` looks through it without sleeping first
    /// (weak: a pending transfer does not keep a closed engine alive).
    engine: std::sync::Weak<engine_core::TransferEngine>,
}

impl Transfer {
    /// A pending transfer and the `OnDone` that completes it.
    pub(crate) fn new(
        kind: &'static str,
        nbytes: u64,
        on_done: Option<Py<PyAny>>,
    ) -> (Self, OnDone) {
        let shared = Arc::new(Shared {
            state: Mutex::new(State {
                callbacks: on_done.into_iter().collect(),
                ..State::default()
            }),
            cond: Condvar::new(),
        });
        // The waker holds the state (and so the callbacks) until the outcome comes, also
        // when the Python object was dropped meanwhile; the flag is reached through a weak
        // reference (the flag owns the waker: a strong one would be a cycle).
        let pinned = Mutex::new(Some(Arc::clone(&shared)));
        let me: Arc<OnceLock<Weak<DoneFlag>>> = Arc::default();
        let flag_ref = Arc::clone(&me);
        let flag = DoneFlag::with_waker(move || {
            let Some(shared) = pinned.lock().unwrap_or_else(|p| p.into_inner()).take() else {
                return;
            };
            let callbacks = {
                let mut s = shared.lock();
                s.completed_at = Some((unix_now(), Instant::now()));
                if s.sleepers > 0 {
                    shared.cond.notify_all();
                }
                std::mem::take(&mut s.callbacks)
            };
            let result = flag_ref
                .get()
                .and_then(Weak::upgrade)
                .and_then(|f| f.result());
            if let (false, Some(result)) = (callbacks.is_empty(), result) {
                dispatch(Box::new(move |py| {
                    for cb in &callbacks {
                        let exc = result.clone().err().map(|e| errors::to_py(py, e));
                        call_reporting(py, cb, exc);
                    }
                }));
            }
        });
        let _ = me.set(Arc::downgrade(&flag));
        (
            Self {
                shared,
                flag: Arc::clone(&flag),
                kind,
                nbytes,
                posted_at: unix_now(),
                posted: Instant::now(),
                handle: None,
                notifies: false,
                engine: std::sync::Weak::new(),
            },
            OnDone::Flag(flag),
        )
    }

    /// The same transfer, cancellable through `engine`: returns the `OnDone` to submit.
    /// Marks a transfer that finishes only once its peer took its notification.
    pub(crate) fn notifying(mut self) -> Self {
        self.notifies = true;
        self
    }

    pub(crate) fn cancellable(
        mut self,
        engine: &Arc<engine_core::TransferEngine>,
        done: OnDone,
    ) -> (Self, OnDone) {
        let (handle, done) = engine.cancellable(done);
        self.handle = Some(handle);
        self.engine = Arc::downgrade(engine);
        (self, done)
    }

    fn outcome(&self, py: Python<'_>) -> Option<PyResult<()>> {
        self.flag
            .result()
            .map(|r| r.map_err(|e| errors::to_py(py, e)))
    }
}

fn status_name(s: &engine_core::TransferStatus) -> &'static str {
    match s {
        engine_core::TransferStatus::Queued => "queued",
        engine_core::TransferStatus::Posted { .. } => "posted",
        engine_core::TransferStatus::Done => "done",
        engine_core::TransferStatus::Failed(_) => "failed",
        engine_core::TransferStatus::Cancelled => "cancelled",
    }
}

#[pymethods]
impl Transfer {
    /// Where it is: "queued", "posted", "done", "failed" or "cancelled" ("pending" for an
    /// expectation not yet met).
    #[getter]
    fn status(&self) -> &'static str {
        match (&self.handle, self.flag.result()) {
            (Some(h), _) => status_name(&h.status()),
            (None, None) => "pending",
            (None, Some(Ok(()))) => "done",
            (None, Some(Err(engine_core::Error::Cancelled))) => "cancelled",
            (None, Some(Err(_))) => "failed",
        }
    }

    /// Cancels it (GIL released): one not yet posted fails at once with `CancelledError`;
    /// a posted one returns once no NIC touches its memory, completed as cancelled unless
    /// it had completed. Returns the final status. Expectations cannot be cancelled.
    fn cancel(&self, py: Python<'_>) -> PyResult<&'static str> {
        let Some(handle) = &self.handle else {
            return Err(errors::raise(
                py,
                "NotAvailableError",
                format!("a {} cannot be cancelled", self.kind),
            ));
        };
        let status = errors::OrRaise::or_raise(py.detach(|| handle.cancel()), py)?;
        Ok(status_name(&status))
    }

    /// Whether the operation has finished (successfully or not).
    fn done(&self) -> bool {
        self.flag.is_done()
    }

    /// Waits until it finishes (at most `timeout` seconds; `None` waits as long as the
    /// engine's own timeouts allow) and raises its error, if any. Releases the GIL.
    #[pyo3(signature = (timeout=None))]
    fn wait(&self, py: Python<'_>, timeout: Option<f64>) -> PyResult<()> {
        let limit = timeout
            .map(|t| errors::timeout_of(py, "timeout", t))
            .transpose()?;
        let (shared, flag) = (Arc::clone(&self.shared), Arc::clone(&self.flag));
        let engine = self.engine.clone();
        let finished = py.detach(move || {
            let start = Instant::now();
            // Look without sleeping first, as `TransferEngine::wait` does, for as long as
            // the engine's `worker.wait_poll_us` says (0 on a machine with few CPUs, where
            // the look would take the CPU from the worker). Then sleep on the condition
            // variable the flag's waker notifies.
            let look = limit.map_or(LOOK, |l| l.min(LOOK));
            if let Some(engine) = engine.upgrade() {
                if engine.drive_until(look, || flag.is_done()) {
                    return true;
                }
            }
            let mut s = shared.lock();
            while !flag.is_done() {
                let left = match limit {
                    Some(l) => match l.checked_sub(start.elapsed()) {
                        Some(left) if !left.is_zero() => left,
                        _ => return false,
                    },
                    None => Duration::from_millis(100),
                };
                s.sleepers += 1;
                s = shared
                    .cond
                    .wait_timeout(s, left.min(Duration::from_millis(100)))
                    .unwrap_or_else(|p| p.into_inner())
                    .0;
                s.sleepers -= 1;
                if limit.is_none() && !flag.is_done() {
                    // Wake now and then so Ctrl-C is seen.
                    drop(s);
                    if Python::attach(|py| py.check_signals()).is_err() {
                        return false;
                    }
                    s = shared.lock();
                }
            }
            true
        });
        py.check_signals()?;
        if !finished {
            let t = timeout.unwrap_or(0.0);
            return Err(errors::raise(
                py,
                "TimeoutError",
                if self.notifies {
                    // Its data may have landed long ago: say what else it waits for.
                    format!(
                        "the {} did not finish within {t} s: it finishes once its peer took its \
                         notification, and a peer takes none before it calls \
                         listen_notifications or submit_recvs",
                        self.kind
                    )
                } else {
                    format!("the {} did not finish within {t} s", self.kind)
                },
            ));
        }
        self.outcome(py).unwrap_or(Ok(()))
    }

    /// The error if it failed (as an exception object), `None` if it succeeded; raises
    /// `InvalidArgumentError` while it is still running.
    fn exception(&self, py: Python<'_>) -> PyResult<Option<Py<PyAny>>> {
        match self.outcome(py) {
            None => Err(errors::invalid(
                py,
                format!("the {} has not finished", self.kind),
            )),
            Some(Ok(())) => Ok(None),
            Some(Err(e)) => Ok(Some(e.into_value(py).into_any())),
        }
    }

    /// Calls `fn(None)` or `fn(exc)` when it finishes (at once, on this thread, if it has).
    fn add_done_callback(&self, py: Python<'_>, callback: Py<PyAny>) -> PyResult<()> {
        {
            let mut s = self.shared.lock();
            // Under the lock the waker takes the callbacks in: either it has not run yet
            // (the callback is taken with the others) or it has (`completed_at` is set).
            if s.completed_at.is_none() {
                s.callbacks.push(callback);
                return Ok(());
            }
        }
        let exc = self
            .flag
            .result()
            .and_then(|r| r.err())
            .map(|e| errors::to_py(py, e));
        call_reporting(py, &callback, exc);
        Ok(())
    }

    /// `await transfer`: resolves on the running loop (through `call_soon_threadsafe`).
    fn __await__<'py>(slf: Bound<'py, Self>) -> PyResult<Bound<'py, PyAny>> {
        let py = slf.py();
        let fut = py.import("xfer._glue")?.call_method1("future_of", (slf,))?;
        fut.call_method0("__await__")
    }

    /// What it is: "write", "paged write", "read", "send", "expectation", …
    #[getter]
    fn kind(&self) -> &'static str {
        self.kind
    }

    /// Bytes it moves (0 for sends of nothing, barriers and expectations).
    #[getter]
    fn nbytes(&self) -> u64 {
        self.nbytes
    }

    /// When it was submitted (seconds since the epoch, like `time.time()`).
    #[getter]
    fn posted_at(&self) -> f64 {
        self.posted_at
    }

    /// When it finished (seconds since the epoch), or `None`.
    #[getter]
    fn completed_at(&self) -> Option<f64> {
        self.shared.lock().completed_at.map(|c| c.0)
    }

    /// Seconds from submission to completion (monotonic clock), or `None`.
    #[getter]
    fn duration(&self) -> Option<f64> {
        self.shared
            .lock()
            .completed_at
            .map(|c| c.1.duration_since(self.posted).as_secs_f64())
    }

    fn __repr__(&self) -> String {
        let state = match self.flag.result() {
            None => "pending".to_owned(),
            Some(Ok(())) => "done".to_owned(),
            Some(Err(e)) => format!("failed: {e}"),
        };
        format!(
            "<xfer.Transfer {} of {} bytes, {state}>",
            self.kind, self.nbytes
        )
    }
}
