//! The worker's loop around the core, driven through a whole engine on test Domains.

use std::sync::Mutex;
use std::time::{Duration, Instant};

use crossbeam_channel::{Receiver, Sender};

use crate::config::Config;
use crate::domain::{
    BackendRegistration, Domain, DomainConfig, DomainError, Event, MemoryRegion, PostStatus,
    RdmaPost, Registration, Waker,
};
use crate::wire::NetAddr;
use crate::TransferEngine;

const TIMER_BACKEND: &str = "worker-test-timer";

/// How soon after a parked poll the timer Domain asks to be polled again.
const TIMER: Duration = Duration::from_millis(5);

/// Where the timer Domain reports that it was polled at or after its `poll_timeout`. One
/// engine uses this backend (the test below), so one slot does.
static DUE_POLLS: Mutex<Option<Sender<()>>> = Mutex::new(None);

/// A Domain with a timer of its own and nothing else: it never receives anything and never
/// wakes the worker (though it says it will), so only `poll_timeout` can bring the worker
/// back to it. It arms the timer in a poll made while the worker is about to park — after
/// that poll the worker reads `poll_timeout` — and reports the first poll at or after it.
struct TimerDomain {
    waker: Option<Waker>,
    due: Option<Instant>,
    reported: bool,
}

impl Domain for TimerDomain {
    fn address(&self) -> NetAddr {
        NetAddr::new(b"timer").expect("a valid address")
    }
    fn register(&mut self, _: &MemoryRegion) -> Result<Registration, DomainError> {
        Ok(Registration {
            local_key: 1,
            remote_key: 1,
        })
    }
    fn deregister(&mut self, _: u64) -> Result<(), DomainError> {
        Ok(())
    }
    fn post_rdma(&mut self, _: RdmaPost<'_>) -> (usize, Result<PostStatus, DomainError>) {
        (0, Ok(PostStatus::Busy))
    }
    fn post_send(&mut self, _: u64, _: &NetAddr, _: &[u8]) -> Result<PostStatus, DomainError> {
        Ok(PostStatus::Busy)
    }
    fn post_recvs(&mut self, _: usize, _: usize) -> Result<(), DomainError> {
        Ok(())
    }
    fn poll(&mut self, _: &mut Vec<Event>) -> Result<(), DomainError> {
        if self.reported {
            return Ok(());
        }
        match self.due {
            Some(due) if Instant::now() >= due => {
                self.reported = true;
                self.due = None;
                if let Some(tx) = &*DUE_POLLS.lock().unwrap() {
                    let _ = tx.send(());
                }
            }
            Some(_) => {}
            None => {
                let parking = self.waker.as_ref().is_some_and(|w| w.worker_parking());
                if parking {
                    self.due = Some(Instant::now() + TIMER);
                }
            }
        }
        Ok(())
    }
    fn poll_timeout(&self) -> Option<Instant> {
        self.due
    }
    fn set_waker(&mut self, waker: Waker) -> bool {
        // Kept to ask whether the worker parks, never called: a timer is all that is left.
        self.waker = Some(waker);
        true
    }
}

fn open_timer(_: &DomainConfig<'_>) -> Result<Box<dyn Domain>, DomainError> {
    Ok(Box::new(TimerDomain {
        waker: None,
        due: None,
        reported: false,
    }))
}

inventory::submit! {
    BackendRegistration {
        name: TIMER_BACKEND,
        open: open_timer,
        check_options: |_| Ok(()),
    }
}

fn timer_engine() -> (TransferEngine, Receiver<()>) {
    let (tx, rx) = crossbeam_channel::unbounded();
    *DUE_POLLS.lock().unwrap() = Some(tx);
    let text = format!(
        "backend = \"{TIMER_BACKEND}\"\n[[groups]]\nnics = [\"t0\"]\n[worker]\nspin_us = 0\n"
    );
    let config = Config::from_toml(&text, std::path::Path::new("<worker test>")).unwrap();
    (TransferEngine::open(&config).unwrap(), rx)
}

/// A parked worker wakes by the time a Domain's `poll_timeout` names, though nothing
/// arrives and nothing of the engine's is due: the verbs Domain frees retired queue pairs
/// and resends handshakes then. (The worker read only its own deadlines and parked for an
/// hour.)
#[test]
fn a_parked_worker_polls_a_domain_by_its_poll_timeout() {
    let (engine, due_polls) = timer_engine();
    // Nothing is submitted: the worker parks, the Domain arms its timer in the last poll
    // before the park, and only the timer can bring the worker back. The bound only keeps a
    // broken worker from hanging the suite; it is no measure of anything.
    let polled = due_polls.recv_timeout(Duration::from_secs(60));
    assert!(
        polled.is_ok(),
        "the worker never polled the Domain at its poll_timeout"
    );
    drop(engine);
}

/// An engine on the mock whose worker parks as soon as it is idle.
fn parking_mock_engine() -> std::sync::Arc<TransferEngine> {
    mock_engine("")
}

/// [`parking_mock_engine`] with more of the config (the mock's options, say).
fn mock_engine(more: &str) -> std::sync::Arc<TransferEngine> {
    backend_mock::link();
    let text = format!(
        "backend = \"mock\"\n[[groups]]\nnics = [\"mock0\"]\n[worker]\nspin_us = 0\n{more}"
    );
    let config = Config::from_toml(&text, std::path::Path::new("<worker test>")).unwrap();
    std::sync::Arc::new(TransferEngine::open(&config).unwrap())
}

/// Writes `left` more links of a chain into the engine's own buffer, each submitted by the
/// previous one's waker (on the worker: kept there, posted in the same pass or the next);
/// the last reports on `end`.
fn chain(
    engine: &std::sync::Weak<TransferEngine>,
    mr: crate::MrHandle,
    desc: &crate::MrDesc,
    left: u64,
    end: Sender<crate::Result<()>>,
) {
    let Some(me) = engine.upgrade() else {
        let _ = end.send(Err(crate::Error::Shutdown));
        return;
    };
    let (next_engine, next_desc, next_end) = (engine.clone(), desc.clone(), end.clone());
    let flag = crate::DoneFlag::with_flag_waker(move |flag| match flag.result() {
        Some(Ok(())) if left > 1 => chain(&next_engine, mr, &next_desc, left - 1, next_end.clone()),
        other => {
            let _ = next_end.send(other.unwrap_or(Err(crate::Error::Shutdown)));
        }
    });
    if let Err(e) = me.submit_single_write(8, Some(7), (mr, 0), (desc, 8), flag) {
        let _ = end.send(Err(e));
    }
}

/// A waker that always submits again (a chain of writes on its own engine, every link
/// submitted on the worker) neither loses a link nor starves other threads: a write from
/// this thread, queued while the chain runs, completes before the chain ends.
#[test]
fn a_chain_submitted_by_wakers_on_the_worker_completes_and_others_still_get_through() {
    let engine = parking_mock_engine();
    let buf = crate::HostBuffer::new(&engine, 64).unwrap();
    let (end_tx, end) = crossbeam_channel::unbounded();
    const LINKS: u64 = 5_000;
    chain(
        &std::sync::Arc::downgrade(&engine),
        buf.mr(),
        buf.desc(),
        LINKS,
        end_tx,
    );
    let outside = crate::DoneFlag::new();
    engine
        .submit_single_write(8, None, (buf.mr(), 16), (buf.desc(), 24), outside.clone())
        .unwrap();
    // The bounds only keep a broken worker from hanging the suite; no measure of anything.
    outside.wait(Duration::from_secs(60)).unwrap();
    assert_eq!(end.recv_timeout(Duration::from_secs(60)).unwrap(), Ok(()));
    let stats = engine.stats().unwrap();
    assert_eq!(stats.outstanding, 0);
    drop(buf);
}

/// A waker that submits a write and then shuts its engine down, both on the worker: the
/// write kept on the worker's thread still completes, once (it was accepted before the
/// shutdown, so it runs or fails with `Shutdown`), and nothing hangs.
#[test]
fn a_write_kept_on_the_worker_completes_when_the_worker_shuts_down() {
    let engine = parking_mock_engine();
    let buf = crate::HostBuffer::new(&engine, 64).unwrap();
    let (mr, desc) = (buf.mr(), buf.desc().clone());
    let kept = crate::DoneFlag::new();
    let weak = std::sync::Arc::downgrade(&engine);
    let kept_in_waker = kept.clone();
    let trigger = crate::DoneFlag::with_waker(move || {
        if let Some(me) = weak.upgrade() {
            me.submit_single_write(8, None, (mr, 0), (&desc, 8), kept_in_waker.clone())
                .unwrap();
            me.shutdown();
        }
    });
    engine
        .submit_single_write(8, None, (buf.mr(), 16), (buf.desc(), 24), trigger.clone())
        .unwrap();
    trigger.wait(Duration::from_secs(60)).unwrap();
    let outcome = kept.wait(Duration::from_secs(60));
    assert!(
        matches!(outcome, Ok(()) | Err(crate::Error::Shutdown)),
        "{outcome:?}"
    );
    drop(buf);
}

/// Waits (bounded, on what the worker publishes) until the worker has parked: announced,
/// its wake-up time published and its state let go.
fn until_parked(engine: &TransferEngine) {
    let start = Instant::now();
    while !(engine.shared.parking.settled() && engine.shared.driver.try_lock().is_ok()) {
        assert!(
            start.elapsed() < Duration::from_secs(60),
            "the idle worker never parked"
        );
        std::thread::yield_now();
    }
}

/// Submissions and waits on other threads while the worker is parked are carried out on
/// those threads (posted, polled, delivered, expectations met) and, on a NIC where a post
/// lands at once (the inline mock), wake the worker once in all — to doze rather than park
/// while threads wait — not once a round: a wake-up and a hop between threads are most of a
/// one-way's latency on a small machine.
#[test]
fn a_parked_worker_is_driven_by_the_threads_that_submit_and_wait_without_waking_it() {
    let engine = mock_engine("[backends.mock]\ninline = true\n");
    let buf = crate::HostBuffer::new(&engine, 64).unwrap();
    until_parked(&engine);
    let unparks = engine.shared.parking.unparks();
    for _ in 0..200u64 {
        let arrived = crate::DoneFlag::new();
        engine.expect_imm_count(9, 1, arrived.clone()).unwrap();
        let written = crate::DoneFlag::new();
        engine
            .submit_single_write(8, Some(9), (buf.mr(), 0), (buf.desc(), 8), written.clone())
            .unwrap();
        // The bounds only keep a broken engine from hanging the suite.
        engine.wait(&written, Duration::from_secs(60)).unwrap();
        engine.wait(&arrived, Duration::from_secs(60)).unwrap();
    }
    let woken = engine.shared.parking.unparks() - unparks;
    assert!(
        woken <= 1,
        "the parked worker was woken {woken} times for work its submitters and waiters carried out"
    );
    drop(buf);
}

/// Submissions alone (no thread waits in `TransferEngine::wait`) leave the worker parked,
/// not dozing: its Domains' wake-ups stay armed, so what completes later wakes it at once.
#[test]
fn submissions_alone_leave_the_worker_parked_with_its_wake_ups_armed() {
    let engine = mock_engine("[backends.mock]\ninline = true\n");
    let buf = crate::HostBuffer::new(&engine, 64).unwrap();
    until_parked(&engine);
    let unparks = engine.shared.parking.unparks();
    for _ in 0..50u64 {
        let written = crate::DoneFlag::new();
        engine
            .submit_single_write(8, None, (buf.mr(), 0), (buf.desc(), 8), written.clone())
            .unwrap();
        assert!(
            written.is_done(),
            "the inline mock lands a write as it is posted"
        );
        assert!(!engine.shared.parking.is_dozing());
    }
    assert_eq!(engine.shared.parking.unparks(), unparks);
    drop(buf);
}

/// On the unkind mock (operations land later, on the fabric's thread, shuffled), waits that
/// drive the parked worker and the worker woken between them share the work: every write
/// completes once and every arrival meets its expectation, from several threads at once.
#[test]
fn threads_driving_a_parked_worker_and_the_worker_lose_nothing_between_them() {
    let engine = mock_engine("[backends.mock]\nreorder = true\njitter_us = 20\n");
    let buf = crate::HostBuffer::new(&engine, 4096).unwrap();
    std::thread::scope(|scope| {
        for thread in 0..4u32 {
            let (engine, buf) = (&engine, &buf);
            scope.spawn(move || {
                let imm = 100 + thread;
                let sent = crate::DoneCounter::new();
                for round in 0..300u64 {
                    let arrived = crate::DoneFlag::new();
                    engine.expect_imm_count(imm, 1, arrived.clone()).unwrap();
                    let at = u64::from(thread) * 64;
                    engine
                        .submit_single_write(
                            8,
                            Some(imm),
                            (buf.mr(), at),
                            (buf.desc(), at + 8),
                            sent.clone(),
                        )
                        .unwrap();
                    // The bounds only keep a broken engine from hanging the suite.
                    engine.wait(&arrived, Duration::from_secs(60)).unwrap();
                    engine
                        .wait_for(&sent, round + 1, Duration::from_secs(60))
                        .unwrap();
                }
                assert_eq!(sent.finished(), 300);
                assert!(sent.first_error().is_none());
            });
        }
    });
    assert_eq!(engine.stats().unwrap().outstanding, 0);
    drop(buf);
}

const BLACK_HOLE_BACKEND: &str = "worker-test-black-hole";

/// A Domain that takes every request and never completes one.
struct BlackHoleDomain;

impl Domain for BlackHoleDomain {
    fn address(&self) -> NetAddr {
        NetAddr::new(b"black hole").expect("a valid address")
    }
    fn register(&mut self, _: &MemoryRegion) -> Result<Registration, DomainError> {
        Ok(Registration {
            local_key: 1,
            remote_key: 1,
        })
    }
    fn deregister(&mut self, _: u64) -> Result<(), DomainError> {
        Ok(())
    }
    fn post_rdma(&mut self, post: RdmaPost<'_>) -> (usize, Result<PostStatus, DomainError>) {
        (post.len(), Ok(PostStatus::Posted))
    }
    fn post_send(&mut self, _: u64, _: &NetAddr, _: &[u8]) -> Result<PostStatus, DomainError> {
        Ok(PostStatus::Posted)
    }
    fn post_recvs(&mut self, _: usize, _: usize) -> Result<(), DomainError> {
        Ok(())
    }
    fn poll(&mut self, _: &mut Vec<Event>) -> Result<(), DomainError> {
        Ok(())
    }
    fn set_waker(&mut self, _: Waker) -> bool {
        true
    }
}

inventory::submit! {
    BackendRegistration {
        name: BLACK_HOLE_BACKEND,
        open: |_| Ok(Box::new(BlackHoleDomain)),
        check_options: |_| Ok(()),
    }
}

/// A write posted by a submitting thread while the worker is parked, whose completion never
/// comes, still times out at its deadline: the worker parks no longer than a new transfer's
/// timeout, so it is awake by then though nothing woke it.
#[test]
fn a_write_posted_while_the_worker_is_parked_still_times_out() {
    let text = format!(
        "backend = \"{BLACK_HOLE_BACKEND}\"\n[[groups]]\nnics = [\"b0\"]\n[worker]\nspin_us = 0\n[timeouts]\ntransfer_ms = 300\n"
    );
    let config = Config::from_toml(&text, std::path::Path::new("<worker test>")).unwrap();
    let engine = std::sync::Arc::new(TransferEngine::open(&config).unwrap());
    let buf = crate::HostBuffer::new(&engine, 64).unwrap();
    until_parked(&engine);
    let unparks = engine.shared.parking.unparks();
    let written = crate::DoneFlag::new();
    engine
        .submit_single_write(8, None, (buf.mr(), 0), (buf.desc(), 8), written.clone())
        .unwrap();
    assert_eq!(
        engine.shared.parking.unparks(),
        unparks,
        "posting woke the worker"
    );
    // The bound only keeps a broken worker from hanging the suite (it parked for an hour).
    let outcome = written.wait(Duration::from_secs(60));
    assert!(
        matches!(outcome, Err(crate::Error::Timeout(t)) if t == Duration::from_millis(300)),
        "{outcome:?}"
    );
    drop(buf);
}

/// A waker that shuts its engine down while running on a thread that drives the parked
/// worker does not wait for the worker (which waits for that thread): nothing hangs, and
/// the engine refuses new work at once.
#[test]
fn a_waker_on_a_driving_thread_can_shut_the_engine_down() {
    let engine = parking_mock_engine();
    let buf = crate::HostBuffer::new(&engine, 64).unwrap();
    until_parked(&engine);
    let weak = std::sync::Arc::downgrade(&engine);
    let trigger = crate::DoneFlag::with_waker(move || {
        if let Some(me) = weak.upgrade() {
            me.shutdown();
        }
    });
    engine
        .submit_single_write(8, None, (buf.mr(), 16), (buf.desc(), 24), trigger.clone())
        .unwrap();
    trigger.wait(Duration::from_secs(60)).unwrap();
    let refused = engine.submit_single_write(
        8,
        None,
        (buf.mr(), 16),
        (buf.desc(), 24),
        crate::DoneFlag::new(),
    );
    assert!(
        matches!(refused, Err(crate::Error::Shutdown)),
        "{refused:?}"
    );
    drop(buf);
}

/// A wait that answered leaves the worker dozing (its Domains' wake-ups unarmed: waiters
/// poll); a wait that gives up polling and sleeps on its flag leaves it parked with them
/// armed — else what it sleeps for would be seen only when the doze ends.
#[test]
fn a_wait_that_sleeps_leaves_the_worker_armed_and_one_that_answered_leaves_it_dozing() {
    // A doze follows a wait within `idle_poll_us`: long here, so that a loaded machine's
    // delays do not end it before the worker parks.
    let engine = mock_engine(
        "wait_poll_us = 60000000\nidle_poll_us = 60000000\n[backends.mock]\ndelay_us = 5000\n",
    );
    let buf = crate::HostBuffer::new(&engine, 64).unwrap();
    let write = |imm: u32| {
        let arrived = crate::DoneFlag::new();
        engine.expect_imm_count(imm, 1, arrived.clone()).unwrap();
        engine
            .submit_single_write(
                8,
                Some(imm),
                (buf.mr(), 0),
                (buf.desc(), 8),
                crate::DoneFlag::new(),
            )
            .unwrap();
        arrived
    };
    // Polled here until it arrives (the bound only keeps a broken engine from hanging).
    until_parked(&engine);
    let answered = write(1);
    assert!(engine
        .shared
        .poll_until(Duration::from_secs(60), || answered.is_done()));
    // Woken once to doze (it was parked): readiness is the doze itself, bounded.
    let start = Instant::now();
    while !(engine.shared.parking.is_dozing() && engine.shared.parking.settled()) {
        assert!(
            start.elapsed() < Duration::from_secs(60),
            "waiters poll, yet the worker never dozed"
        );
        std::thread::yield_now();
    }
    // Polled for no time at all: the wait sleeps on the flag, and the worker must wake for it.
    let slept = write(2);
    assert!(!engine.shared.poll_until(Duration::ZERO, || slept.is_done()));
    assert!(
        !engine.shared.parking.is_dozing(),
        "a sleeper needs the wake-ups armed"
    );
    slept.wait(Duration::from_secs(60)).unwrap();
    drop(buf);
}
