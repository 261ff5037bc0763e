//! Who makes the engine's passes, through the public API on the mock and on a test NIC
//! (issue 53): the defects found while application threads drove the parked worker, each a
//! test that failed on that design (run against 8d78a63: see the commit). Waits on the
//! worker's park are on readiness (the NIC sees the worker announce it); the bounds on waits
//! only keep a broken engine from hanging the suite, none measures anything.

use std::collections::HashMap;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use crossbeam_channel::{Receiver, Sender};
use engine_core::domain::{
    BackendRegistration, Domain, DomainConfig, DomainError, DomainErrorKind, Event, MemoryRegion,
    PostStatus, RdmaPost, Registration, Waker,
};
use engine_core::{Config, DoneCounter, DoneFlag, Error, HostBuffer, NetAddr, TransferEngine};

const LONG: Duration = Duration::from_secs(60);
const TEST_NIC: &str = "scheduling-test-nic";

/// What a test sees of its NIC, and tells it; one per NIC name (tests run in parallel).
#[derive(Default)]
struct NicState {
    /// Completes what is posted at the next poll (else never: a frozen peer).
    loopback: bool,
    /// Told once a poll sees the worker announce its park.
    parked: Mutex<Option<Sender<()>>>,
    /// The next poll fails for good.
    fail_now: AtomicBool,
    /// Polls after one failed for good.
    polls_after_fatal: AtomicU64,
    /// Told when the NIC starts closing; the close waits for the receiver's message.
    closing: Mutex<Option<(Sender<()>, Receiver<()>)>>,
    /// Deregistrations the NIC carried out.
    deregistered: AtomicU64,
    /// Arms a timer of the NIC's own (`poll_timeout`) in a poll made while the worker is
    /// about to park, and is told at the first poll at or after it.
    timer: Option<Sender<()>>,
}

impl NicState {
    /// A receiver told at the next poll made while the worker is about to park.
    fn parked(&self) -> Receiver<()> {
        let (tx, rx) = crossbeam_channel::bounded(1);
        *self.parked.lock().unwrap() = Some(tx);
        rx
    }
}

static NICS: Mutex<Option<HashMap<String, Arc<NicState>>>> = Mutex::new(None);

fn nic_state(name: &str, make: impl FnOnce() -> NicState) -> Arc<NicState> {
    let mut nics = NICS.lock().unwrap();
    Arc::clone(
        nics.get_or_insert_with(HashMap::new)
            .entry(name.to_owned())
            .or_insert_with(|| Arc::new(make())),
    )
}

/// A NIC the test steers through its [`NicState`].
struct TestNic {
    state: Arc<NicState>,
    waker: Option<Waker>,
    posted: Vec<u64>,
    failed: bool,
    /// When the NIC's own timer is due, and whether it was reported.
    due: Option<Instant>,
    timer_reported: bool,
}

impl Domain for TestNic {
    fn address(&self) -> NetAddr {
        NetAddr::new(b"test nic").expect("a valid address")
    }
    fn register(&mut self, _: &MemoryRegion) -> Result<Registration, DomainError> {
        Ok(Registration {
            local_key: 1,
            remote_key: 1,
        })
    }
    fn deregister(&mut self, _: u64) -> Result<(), DomainError> {
        self.state.deregistered.fetch_add(1, Ordering::Relaxed);
        Ok(())
    }
    fn post_rdma(&mut self, post: RdmaPost<'_>) -> (usize, Result<PostStatus, DomainError>) {
        if self.state.loopback {
            match &post {
                RdmaPost::One(r) => self.posted.push(r.wr_id),
                RdmaPost::Pages { template, shifts } => {
                    self.posted.extend(shifts.iter().map(|_| template.wr_id))
                }
                RdmaPost::List(rs) => self.posted.extend(rs.iter().map(|r| r.wr_id)),
                _ => unreachable!("no other posts"),
            }
        }
        (post.len(), Ok(PostStatus::Posted))
    }
    fn post_send(&mut self, _: u64, _: &NetAddr, _: &[u8]) -> Result<PostStatus, DomainError> {
        Ok(PostStatus::Posted)
    }
    fn post_recvs(&mut self, _: usize, _: usize) -> Result<(), DomainError> {
        Ok(())
    }
    fn poll(&mut self, events: &mut Vec<Event>) -> Result<(), DomainError> {
        if self.failed {
            self.state.polls_after_fatal.fetch_add(1, Ordering::Relaxed);
        }
        if self.state.fail_now.load(Ordering::Relaxed) {
            self.failed = true;
            return Err(DomainError::new(
                DomainErrorKind::Fatal,
                "the NIC went away",
            ));
        }
        events.extend(self.posted.drain(..).map(|wr_id| Event::Done {
            wr_id,
            result: Ok(()),
        }));
        let parking = self.waker.as_ref().is_some_and(|w| w.worker_parking());
        if parking {
            if let Some(tx) = self.state.parked.lock().unwrap().take() {
                let _ = tx.send(());
            }
        }
        if let (Some(tx), false) = (&self.state.timer, self.timer_reported) {
            match self.due {
                Some(due) if Instant::now() >= due => {
                    self.timer_reported = true;
                    let _ = tx.send(());
                }
                Some(_) => {}
                None if parking => self.due = Some(Instant::now() + Duration::from_millis(5)),
                None => {}
            }
        }
        Ok(())
    }
    fn poll_timeout(&self) -> Option<Instant> {
        self.due.filter(|_| !self.timer_reported)
    }
    fn set_waker(&mut self, waker: Waker) -> bool {
        self.waker = Some(waker);
        true
    }
}

impl Drop for TestNic {
    fn drop(&mut self) {
        if let Some((closing, let_go)) = self.state.closing.lock().unwrap().take() {
            let _ = closing.send(());
            let _ = let_go.recv_timeout(LONG);
        }
    }
}

fn open_test_nic(config: &DomainConfig<'_>) -> Result<Box<dyn Domain>, DomainError> {
    Ok(Box::new(TestNic {
        state: nic_state(config.nic, NicState::default),
        waker: None,
        posted: Vec::new(),
        failed: false,
        due: None,
        timer_reported: false,
    }))
}

inventory::submit! {
    BackendRegistration {
        name: TEST_NIC,
        open: open_test_nic,
        check_options: |_| Ok(()),
    }
}

fn engine(text: &str) -> Arc<TransferEngine> {
    backend_mock::link();
    let config = Config::from_toml(text, std::path::Path::new("<scheduling test>")).unwrap();
    Arc::new(TransferEngine::open(&config).unwrap())
}

/// An engine on the test NIC `nic` (made by `make`) whose worker parks as soon as it is
/// idle, a registered buffer, and the NIC's state — returned once the worker parked.
fn parked_engine(
    nic: &str,
    make: impl FnOnce() -> NicState,
    more: &str,
) -> (Arc<TransferEngine>, HostBuffer, Arc<NicState>) {
    let state = nic_state(nic, make);
    let engine = engine(&format!(
        "backend = \"{TEST_NIC}\"\n[[groups]]\nnics = [\"{nic}\"]\n[worker]\nspin_us = 0\n{more}"
    ));
    let parked = state.parked();
    let buf = HostBuffer::new(&engine, 4096).unwrap();
    parked.recv_timeout(LONG).expect("the idle worker parks");
    (engine, buf, state)
}

fn loopback() -> NicState {
    NicState {
        loopback: true,
        ..NicState::default()
    }
}

fn write(engine: &TransferEngine, buf: &HostBuffer, flag: impl Into<engine_core::OnDone>) {
    engine
        .submit_single_write(8, None, (buf.mr(), 0), (buf.desc(), 8), flag)
        .unwrap();
}

/// A waker that shuts its engine down, submitted to a parked worker, 200 times: it runs on
/// the worker (asserted: it says where), `shutdown()` returns there without waiting for the
/// worker, and the message the waker sends after it arrives. On the driving design the
/// submitting thread ran it and then joined the worker, which waited for that thread's lock
/// (it hung about once in 110 runs).
#[test]
fn a_waker_that_shuts_the_engine_down_never_hangs_over_200_rounds() {
    for round in 0..200 {
        let (engine, buf, _) = parked_engine(&format!("shutdown-{round}"), loopback, "");
        let (tx, rx) = crossbeam_channel::bounded(1);
        let weak = Arc::downgrade(&engine);
        let trigger = DoneFlag::with_waker(move || {
            let thread = std::thread::current().name().map(str::to_owned);
            if let Some(me) = weak.upgrade() {
                me.shutdown();
            }
            let _ = tx.send(thread);
        });
        write(&engine, &buf, trigger);
        let ran_on = rx.recv_timeout(LONG).expect("the waker ran to its end");
        assert_eq!(ran_on.as_deref(), Some("xfer-worker-0"));
        let refused =
            engine.submit_single_write(8, None, (buf.mr(), 16), (buf.desc(), 24), DoneFlag::new());
        assert!(matches!(refused, Err(Error::Shutdown)), "{refused:?}");
        drop(buf);
    }
}

/// A 100 ms transfer deadline to a frozen peer, submitted to a parked worker, fires while
/// the submitting thread loops on `drive_until` for as long as it may (a minute): the worker
/// ends deadlines, whoever waits. On the driving design the deadline waited for the driver
/// (1.77 s with a loop of short waits; the whole `wait_poll_us` here).
#[test]
fn a_deadline_fires_while_a_thread_loops_on_drive_until() {
    let (engine, buf, _) = parked_engine(
        "deadline",
        NicState::default,
        "wait_poll_us = 60000000\n[timeouts]\ntransfer_ms = 100\n",
    );
    let written = DoneFlag::new();
    let start = Instant::now();
    write(&engine, &buf, written.clone());
    let done = engine.drive_until(LONG, || written.is_done());
    let took = start.elapsed();
    assert!(done, "the deadline never fired while this thread looked");
    assert!(
        took < Duration::from_secs(30),
        "the deadline fired only after {took:?}"
    );
    assert!(
        matches!(written.result(), Some(Err(Error::Timeout(t))) if t == Duration::from_millis(100)),
        "{:?} after {took:?}",
        written.result()
    );
    drop(buf);
}

/// A `done` closure that panics inside `drive_until` on a parked engine unwinds into its
/// caller only: the engine goes on (on the driving design it was counted as the worker's
/// failure: every Domain closed, everything in flight failed).
#[test]
fn a_panicking_drive_until_closure_leaves_the_engine_working() {
    let (engine, buf, _) = parked_engine("panicking-closure", loopback, "");
    let pending = DoneFlag::new();
    write(&engine, &buf, pending.clone());
    engine.wait(&pending, LONG).unwrap();
    assert!(panics_in_drive_until(&engine));
    let after = DoneFlag::new();
    write(&engine, &buf, after.clone());
    engine.wait(&after, LONG).unwrap();
    assert_eq!(engine.stats().unwrap().outstanding, 0);
    drop(buf);
}

/// Calls `drive_until` with a `done` that says no once, then panics (the second look is the
/// one the driving design made inside the parked worker's pass); whether it panicked.
fn panics_in_drive_until(engine: &TransferEngine) -> bool {
    let mut looks = 0;
    std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| {
        engine.drive_until(LONG, || {
            looks += 1;
            assert!(looks < 2, "the caller's own bug");
            false
        })
    }))
    .is_err()
}

/// Writes `left` more links of a chain, each submitted by the previous one's waker; counts
/// every waker call, and reports the end on `end`.
fn chain(
    engine: &std::sync::Weak<TransferEngine>,
    buf: (engine_core::MrHandle, engine_core::MrDesc),
    left: u64,
    calls: Arc<AtomicU64>,
    end: Sender<engine_core::Result<()>>,
) {
    let Some(me) = engine.upgrade() else {
        let _ = end.send(Err(Error::Shutdown));
        return;
    };
    let (next_engine, next_buf, next_calls, next_end) =
        (engine.clone(), buf.clone(), Arc::clone(&calls), end.clone());
    let flag = DoneFlag::with_flag_waker(move |flag| {
        next_calls.fetch_add(1, Ordering::Relaxed);
        match flag.result() {
            Some(Ok(())) if left > 1 => chain(
                &next_engine,
                next_buf.clone(),
                left - 1,
                Arc::clone(&next_calls),
                next_end.clone(),
            ),
            other => {
                let _ = next_end.send(other.unwrap_or(Err(Error::Shutdown)));
            }
        }
    });
    if let Err(e) = me.submit_single_write(8, Some(7), (buf.0, 0), (&buf.1, 8), flag) {
        let _ = end.send(Err(e));
    }
}

/// A chain of 1,000 writes submitted by wakers, while four threads submit and wait on their
/// own and one of them panics inside its wait now and then: every link's waker runs exactly
/// once and the chain ends once (on the driving design a waker's work kept on a driving
/// thread was dropped when that thread's pass panicked — never completed, its slot leaked).
#[test]
fn a_chain_of_1000_writes_by_wakers_with_four_waiting_threads_finishes_exactly_once() {
    let (engine, buf, _) = parked_engine("chain", loopback, "");
    let calls = Arc::new(AtomicU64::new(0));
    let (end_tx, end) = crossbeam_channel::unbounded();
    chain(
        &Arc::downgrade(&engine),
        (buf.mr(), buf.desc().clone()),
        1_000,
        Arc::clone(&calls),
        end_tx,
    );
    std::thread::scope(|scope| {
        for thread in 0..4u64 {
            let (engine, buf) = (&engine, &buf);
            scope.spawn(move || {
                let sent = DoneCounter::new();
                for round in 0..200u64 {
                    let at = 64 + thread * 64;
                    engine
                        .submit_single_write(
                            8,
                            None,
                            (buf.mr(), at),
                            (buf.desc(), at + 8),
                            sent.clone(),
                        )
                        .unwrap();
                    if thread == 0 && round % 10 == 0 {
                        assert!(panics_in_drive_until(engine));
                    }
                    engine.wait_for(&sent, round + 1, LONG).unwrap();
                }
                assert!(sent.first_error().is_none());
            });
        }
    });
    assert_eq!(end.recv_timeout(LONG).unwrap(), Ok(()));
    assert!(end.try_recv().is_err(), "the chain ended twice");
    assert_eq!(calls.load(Ordering::Relaxed), 1_000);
    assert_eq!(engine.stats().unwrap().outstanding, 0);
    drop(buf);
}

/// Once a Domain's poll said `Fatal`, nothing polls it again, whoever waits on the engine
/// (on the driving design, four waiting threads polled it 1.3 M times in 200 ms), and what
/// was in flight fails with the reason.
#[test]
fn a_domain_that_failed_for_good_is_not_polled_again() {
    let (engine, buf, state) = parked_engine("failing", NicState::default, "");
    let written = DoneFlag::new();
    state.fail_now.store(true, Ordering::Relaxed);
    write(&engine, &buf, written.clone());
    std::thread::scope(|scope| {
        for _ in 0..4 {
            let (engine, written) = (&engine, &written);
            scope.spawn(move || {
                let _ = engine.wait(written, LONG);
                // Keep waiting on the failed engine a while, as a caller that retries would.
                let never = DoneFlag::new();
                let _ = engine.drive_until(Duration::from_millis(200), || never.is_done());
            });
        }
    });
    assert!(
        matches!(written.result(), Some(Err(Error::WorkerFailed(_)))),
        "{:?}",
        written.result()
    );
    assert_eq!(state.polls_after_fatal.load(Ordering::Relaxed), 0);
    drop(buf);
}

/// `dereg_mr` while the engine shuts down returns only once the Domains are closed — no NIC
/// can touch the region then (it returned `Ok` at once, and a write in flight landed in the
/// freed region ~70 ms later).
#[test]
fn dereg_mr_during_a_shutdown_returns_only_once_the_domains_are_closed() {
    let (engine, buf, state) = parked_engine("slow-close", NicState::default, "");
    let (closing_tx, closing) = crossbeam_channel::bounded(1);
    let (let_go, let_go_rx) = crossbeam_channel::bounded(1);
    *state.closing.lock().unwrap() = Some((closing_tx, let_go_rx));
    let stopper = Arc::clone(&engine);
    let shutting = std::thread::spawn(move || stopper.shutdown());
    closing
        .recv_timeout(LONG)
        .expect("the worker closes its Domain");
    let (returned_tx, returned) = crossbeam_channel::bounded(1);
    let dereg = std::thread::spawn(move || {
        drop(buf);
        let _ = returned_tx.send(());
    });
    // While the Domain is still closing, the deregistration has not returned. (A bounded
    // look: a slow machine can only make this pass, never fail.)
    assert!(
        returned.recv_timeout(Duration::from_millis(300)).is_err(),
        "dereg_mr returned while the Domain was still open"
    );
    let_go.send(()).unwrap();
    returned
        .recv_timeout(LONG)
        .expect("dereg_mr returns once closed");
    dereg.join().unwrap();
    shutting.join().unwrap();
}

/// Wakers run on the worker, never on a thread that submits to the parked worker: a waker
/// taking a lock its submitter holds around `submit` waits for that submitter to let go,
/// instead of deadlocking it (and then the worker, and the engine's drop).
#[test]
fn a_waker_taking_a_lock_held_around_submit_does_not_deadlock() {
    let component = Arc::new(Mutex::new(0u32));
    for round in 0..50 {
        let (engine, buf, _) = parked_engine(&format!("lock-{round}"), loopback, "");
        let (lock, (tx, rx)) = (Arc::clone(&component), crossbeam_channel::bounded(1));
        let flag = DoneFlag::with_waker(move || {
            *lock.lock().unwrap() += 1;
            let _ = tx.send(std::thread::current().name().map(str::to_owned));
        });
        {
            let _held = component.lock().unwrap();
            write(&engine, &buf, flag);
        }
        let ran_on = rx.recv_timeout(LONG).expect("the waker ran");
        assert_eq!(ran_on.as_deref(), Some("xfer-worker-0"));
        drop(buf);
    }
    assert_eq!(*component.lock().unwrap(), 50);
}

/// Calls that wait for the worker, made inside a waker (on the worker's thread), fail with
/// `OnWorkerThread` at once instead of waiting for themselves.
#[test]
fn calls_that_wait_for_the_worker_fail_by_name_inside_a_waker() {
    let (engine, buf, _) = parked_engine("inside-waker", loopback, "");
    let (tx, rx) = crossbeam_channel::bounded(1);
    let weak = Arc::downgrade(&engine);
    let flag = DoneFlag::with_waker(move || {
        let me = weak.upgrade().expect("alive");
        let stats = me.stats().map(|_| ());
        let pending = DoneFlag::new();
        let waited = me.wait(&pending, LONG);
        let registered = HostBuffer::new(&me, 64).map(|_| ());
        let _ = tx.send((stats, waited, registered));
    });
    write(&engine, &buf, flag);
    let (stats, waited, registered) = rx.recv_timeout(LONG).expect("the waker ran");
    for outcome in [stats, waited, registered] {
        assert!(
            matches!(outcome, Err(Error::OnWorkerThread(_))),
            "{outcome:?}"
        );
    }
    assert_eq!(engine.stats().unwrap().outstanding, 0);
    drop(buf);
}

/// A parked worker wakes by the time a Domain's `poll_timeout` names, though nothing arrives
/// and nothing of the engine's is due: the verbs Domain frees retired queue pairs and resends
/// handshakes then. The NIC never wakes the worker (though it says it will), so only the
/// timer it arms in the last poll before the park can bring the worker back to it.
#[test]
fn a_parked_worker_polls_a_domain_by_its_poll_timeout() {
    let (tx, due_polls) = crossbeam_channel::bounded(1);
    let (_engine, _buf, _) = parked_engine(
        "timer",
        || NicState {
            timer: Some(tx),
            ..NicState::default()
        },
        "",
    );
    assert!(
        due_polls.recv_timeout(LONG).is_ok(),
        "the worker never polled the Domain at its poll_timeout"
    );
}

/// A `HostBuffer` dropped inside a waker (on the worker) is deregistered by the worker
/// before its memory is freed (the deregistration is queued behind the pass; the memory goes
/// with it). Before: `dereg_mr` refused there and the buffer was freed while still
/// registered.
#[test]
fn a_host_buffer_dropped_inside_a_waker_is_deregistered_before_it_is_freed() {
    let (engine, buf, state) = parked_engine("buffer-in-waker", loopback, "");
    let inner = HostBuffer::new(&engine, 64).unwrap();
    let before = state.deregistered.load(Ordering::Relaxed);
    let (tx, rx) = crossbeam_channel::bounded(1);
    let held = Mutex::new(Some(inner));
    let flag = DoneFlag::with_waker(move || {
        drop(held.lock().unwrap().take());
        let _ = tx.send(());
    });
    write(&engine, &buf, flag);
    rx.recv_timeout(LONG).expect("the waker ran");
    // The queued deregistration is served by the worker's next pass; a stats round trip
    // comes after it in the queue.
    engine.stats().unwrap();
    assert_eq!(state.deregistered.load(Ordering::Relaxed), before + 1);
    drop(buf);
}

/// `shutdown()` inside a waker while a callback deregisters memory: the callback's
/// `dereg_mr` waits for the Domains to close, which they do once the waker's pass ends —
/// nothing joins the callback thread from the worker (that deadlocked).
#[test]
fn a_waker_shutting_down_while_a_callback_deregisters_does_not_deadlock() {
    let (engine, buf, _) = parked_engine("shutdown-and-callback", loopback, "");
    let other = HostBuffer::new(&engine, 64).unwrap();
    let (go, go_rx) = crossbeam_channel::bounded::<()>(1);
    let (done_tx, done) = crossbeam_channel::bounded(1);
    let callback = engine_core::OnDone::callback(move |_| {
        let _ = go_rx.recv_timeout(LONG);
        drop(other);
        let _ = done_tx.send(());
    });
    write(&engine, &buf, callback);
    let weak = Arc::downgrade(&engine);
    let stopper = DoneFlag::with_waker(move || {
        if let Some(me) = weak.upgrade() {
            me.shutdown();
        }
        let _ = go.send(());
    });
    write(&engine, &buf, stopper);
    done.recv_timeout(LONG)
        .expect("the callback's deregistration returned");
    drop(buf);
}
