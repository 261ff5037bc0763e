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

/// Waits (bounded, on what the worker publishes) until the worker has announced its park.
fn until_parked(engine: &TransferEngine) {
    let start = Instant::now();
    while !engine.shared.parking.is_parked() {
        assert!(
            start.elapsed() < Duration::from_secs(60),
            "the idle worker never parked"
        );
        std::thread::yield_now();
    }
}

/// A submission to a parked worker wakes it (nothing else makes passes).
#[test]
fn a_submission_wakes_a_parked_worker() {
    let engine = mock_engine("[backends.mock]\ninline = true\n");
    let buf = crate::HostBuffer::new(&engine, 64).unwrap();
    until_parked(&engine);
    let unparks = engine.shared.parking.unparks();
    let written = crate::DoneFlag::new();
    engine
        .submit_single_write(8, None, (buf.mr(), 0), (buf.desc(), 8), written.clone())
        .unwrap();
    written.wait(Duration::from_secs(60)).unwrap();
    assert!(engine.shared.parking.unparks() > unparks);
    drop(buf);
}

/// On the unkind mock (operations land later, on the fabric's thread, shuffled), threads that
/// submit and wait while the worker parks and wakes between them lose nothing: every write
/// completes once and every arrival meets its expectation, from several threads at once.
#[test]
fn threads_waiting_on_a_worker_that_parks_between_them_lose_nothing() {
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
