//! The worker's loop around the core, driven through a whole engine on the mock (tests on
//! NICs of their own, through the public API: `engine-core/tests/scheduling.rs`).

use std::time::{Duration, Instant};

use crate::config::Config;
use crate::TransferEngine;

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

/// What a deregistration frees, telling the test when it is freed.
struct Freed(std::sync::mpsc::Sender<()>);

impl Drop for Freed {
    fn drop(&mut self) {
        let _ = self.0.send(());
    }
}

/// A Domain that panics while it is closed is abandoned, and may still hold registrations:
/// from then on a deregistration keeps (leaks) the memory it was to free and fails, rather
/// than telling its caller the memory is free (review of issue 53: the "Domains closed"
/// latch was set as if the Domain had closed). A Domain that closes cleanly frees it.
#[test]
fn deregistrations_after_a_domain_was_abandoned_keep_the_memory_and_fail() {
    for panics in [false, true] {
        let engine = mock_engine(&format!("[backends.mock]\npanic_on_close = {panics}\n"));
        let (a, b) = (
            crate::HostBuffer::new(&engine, 64).unwrap(),
            crate::HostBuffer::new(&engine, 64).unwrap(),
        );
        let (a_mr, b_mr) = (a.mr(), b.mr());
        // Deregistered by hand below (their memory leaks with the test), `a` with a keep
        // the test watches.
        std::mem::forget(a);
        std::mem::forget(b);
        engine.shutdown();
        assert_eq!(engine.domains_abandoned(), panics);
        let (tx, freed) = std::sync::mpsc::channel();
        let kept = engine.dereg_mr_keeping(a_mr, Box::new(Freed(tx)));
        let plain = engine.dereg_mr(b_mr);
        if panics {
            assert!(
                matches!(kept, Err(crate::Error::WorkerFailed(_))),
                "{kept:?}"
            );
            assert!(
                matches!(plain, Err(crate::Error::WorkerFailed(_))),
                "{plain:?}"
            );
            assert!(freed.try_recv().is_err(), "the kept memory was freed");
        } else {
            assert!(kept.is_ok() && plain.is_ok(), "{kept:?} {plain:?}");
            freed
                .recv_timeout(Duration::from_secs(60))
                .expect("freed once deregistered");
        }
        drop(engine);
        if panics {
            assert!(freed.try_recv().is_err(), "freed with the engine");
        }
    }
}

/// A backend that panics while opening its NIC is reported as failing, with its panic, not
/// as a timeout that never elapsed (review of issue 53).
#[test]
fn a_panic_while_opening_the_nics_is_reported_as_such() {
    backend_mock::link();
    let text = "backend = \"mock\"\n[[groups]]\nnics = [\"mock0\"]\n[backends.mock]\npanic_on_open = true\n";
    let config = Config::from_toml(text, std::path::Path::new("<worker test>")).unwrap();
    match TransferEngine::open(&config) {
        Err(crate::Error::WorkerFailed(why)) => assert!(why.contains("panic_on_open"), "{why}"),
        other => panic!("expected WorkerFailed, got {:?}", other.err()),
    }
}
