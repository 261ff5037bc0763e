//! Status and cancel of a transfer at every stage (issue 27): queued behind a slow worker,
//! parked because the NIC's queue was full, in flight on a slow NIC, and already done —
//! exactly one completion each time, and `cancel` returns only once no NIC touches the
//! transfer's memory.

mod common;

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::Duration;

use engine_core::{
    DoneFlag, Error, HostBuffer, OnDone, TransferEngine, TransferHandle, TransferStatus,
};

const WAIT: Duration = Duration::from_secs(20);

fn pair(extra: &str) -> (Arc<TransferEngine>, Arc<TransferEngine>) {
    let config = common::mock_config(1, extra);
    (
        Arc::new(TransferEngine::open(&config).unwrap()),
        Arc::new(TransferEngine::open(&config).unwrap()),
    )
}

/// An `OnDone` that counts its completions and keeps the last result.
/// The last result an `OnDone` delivered.
type LastResult = Arc<std::sync::Mutex<Option<Result<(), Error>>>>;

fn counted() -> (OnDone, Arc<AtomicU64>, LastResult) {
    let calls = Arc::new(AtomicU64::new(0));
    let last = Arc::new(std::sync::Mutex::new(None));
    let (c, l) = (Arc::clone(&calls), Arc::clone(&last));
    let on_done = OnDone::callback(move |r| {
        // The result first: `wait_calls` polls the count, and a waiter that sees the count
        // must find the result it counts (the other order failed CI once).
        *l.lock().unwrap() = Some(r);
        c.fetch_add(1, Ordering::SeqCst);
    });
    (on_done, calls, last)
}

fn wait_calls(calls: &AtomicU64, n: u64) {
    let deadline = std::time::Instant::now() + WAIT;
    while calls.load(Ordering::SeqCst) < n {
        assert!(std::time::Instant::now() < deadline, "no completion");
        std::thread::yield_now();
    }
}

#[test]
fn a_transfer_in_flight_is_cancelled_once_the_nic_is_done_with_it() {
    // Every write takes 300 ms to land: the cancel comes while it is on the NIC.
    let (a, b) = pair("[backends.mock]\ndelay_us = 300000\n");
    let src = HostBuffer::from_fn(&a, 4096, |i| i as u8).unwrap();
    let dst = HostBuffer::new(&b, 4096).unwrap();
    let (on_done, calls, last) = counted();
    let (handle, on_done) = a.cancellable(on_done);
    a.submit_single_write(4096, None, (src.mr(), 0), (dst.desc(), 0), on_done)
        .unwrap();
    let deadline = std::time::Instant::now() + WAIT;
    while handle.status() == TransferStatus::Queued {
        assert!(std::time::Instant::now() < deadline);
        std::thread::yield_now();
    }
    assert_eq!(handle.status(), TransferStatus::Posted { requests: 1 });
    assert_eq!(handle.cancel().unwrap(), TransferStatus::Cancelled);
    // Returned only after the NIC finished with it: the completion has fired, once.
    wait_calls(&calls, 1);
    assert!(matches!(*last.lock().unwrap(), Some(Err(Error::Cancelled))));
    std::thread::sleep(Duration::from_millis(50));
    assert_eq!(calls.load(Ordering::SeqCst), 1, "exactly one completion");
    assert_eq!(a.stats().unwrap().stale_completions, 0);
}

#[test]
fn a_transfer_parked_behind_a_full_queue_is_cancelled_without_reaching_the_nic() {
    // One operation at a time per connection, each taking 300 ms: the second transfer's
    // request waits in the worker (Busy), never handed to the NIC.
    let (a, b) = pair("[backends.mock]\nqueue_depth = 1\ndelay_us = 300000\n");
    let src = HostBuffer::from_fn(&a, 8192, |_| 7).unwrap();
    let dst = HostBuffer::new(&b, 8192).unwrap();
    let first = DoneFlag::new();
    a.submit_single_write(4096, None, (src.mr(), 0), (dst.desc(), 0), first.clone())
        .unwrap();
    let (on_done, calls, last) = counted();
    let (handle, on_done) = a.cancellable(on_done);
    a.submit_single_write(4096, None, (src.mr(), 4096), (dst.desc(), 4096), on_done)
        .unwrap();
    assert_eq!(handle.cancel().unwrap(), TransferStatus::Cancelled);
    wait_calls(&calls, 1);
    assert!(matches!(*last.lock().unwrap(), Some(Err(Error::Cancelled))));
    first.wait(WAIT).unwrap();
    std::thread::sleep(Duration::from_millis(400));
    assert!(
        dst.to_vec()[4096..].iter().all(|&b| b == 0),
        "the cancelled write never reached the NIC"
    );
    assert_eq!(calls.load(Ordering::SeqCst), 1);
}

#[test]
fn a_transfer_still_queued_is_cancelled_before_it_is_posted() {
    // The worker is busy registering (300 ms): a write submitted meanwhile stays queued.
    let (a, b) = pair("[backends.mock]\nregister_delay_us = 300000\n");
    let src = HostBuffer::from_fn(&a, 4096, |_| 9).unwrap();
    let dst = HostBuffer::new(&b, 4096).unwrap();
    for _attempt in 0..5 {
        let (started, registration_started) = std::sync::mpsc::channel();
        let registering = {
            let a = Arc::clone(&a);
            std::thread::spawn(move || {
                started.send(()).unwrap();
                HostBuffer::new(&a, 64).map(drop)
            })
        };
        // The registration is on its way to the worker; if the write still gets there first,
        // the attempt is repeated (what is asserted holds either way).
        registration_started.recv().unwrap();
        std::thread::yield_now();
        let (on_done, calls, last) = counted();
        let (handle, on_done) = a.cancellable(on_done);
        a.submit_single_write(4096, None, (src.mr(), 0), (dst.desc(), 0), on_done)
            .unwrap();
        let queued = handle.status() == TransferStatus::Queued;
        let status = handle.cancel().unwrap();
        registering.join().unwrap().unwrap();
        wait_calls(&calls, 1);
        assert_eq!(calls.load(Ordering::SeqCst), 1, "exactly one completion");
        if queued && status == TransferStatus::Cancelled {
            assert!(matches!(*last.lock().unwrap(), Some(Err(Error::Cancelled))));
            assert!(dst.to_vec().iter().all(|&b| b == 0), "never posted");
            return;
        }
    }
    panic!("the write was never caught queued in 5 attempts");
}

#[test]
fn cancelling_a_finished_transfer_changes_nothing() {
    let (a, b) = pair("");
    let src = HostBuffer::from_fn(&a, 64, |_| 1).unwrap();
    let dst = HostBuffer::new(&b, 64).unwrap();
    let (on_done, calls, _) = counted();
    let (handle, on_done): (TransferHandle, OnDone) = a.cancellable(on_done);
    a.submit_single_write(64, None, (src.mr(), 0), (dst.desc(), 0), on_done)
        .unwrap();
    wait_calls(&calls, 1);
    assert_eq!(handle.cancel().unwrap(), TransferStatus::Done);
    assert_eq!(handle.status(), TransferStatus::Done);
    assert_eq!(calls.load(Ordering::SeqCst), 1);
}

/// Per-transfer telemetry (issue 27): when a transfer was submitted, posted and completed,
/// what it moved and over which NICs, as the Python completion reports it.
#[test]
fn a_transfer_reports_when_it_was_submitted_posted_and_completed() {
    let config = common::mock_config(2, "[stripe]\nmin_stripe_len = 4096\n");
    let a = Arc::new(TransferEngine::open(&config).unwrap());
    let b = Arc::new(TransferEngine::open(&config).unwrap());
    let src = HostBuffer::from_fn(&a, 1 << 16, |i| i as u8).unwrap();
    let dst = HostBuffer::new(&b, 1 << 16).unwrap();
    let (on_done, calls, _) = counted();
    let (handle, on_done) = a.cancellable(on_done);
    assert_eq!(
        handle.telemetry(),
        engine_core::Telemetry::default(),
        "nothing before"
    );
    let before = std::time::Instant::now();
    a.submit_single_write(1 << 16, None, (src.mr(), 0), (dst.desc(), 0), on_done)
        .unwrap();
    wait_calls(&calls, 1);
    let t = handle.telemetry();
    assert_eq!(t.bytes, 1 << 16);
    assert_eq!(t.nics, vec![0, 1], "striped over both NICs: {t:?}");
    assert!(t.requests >= 2, "{t:?}");
    let (submitted, posted, completed) = (
        t.submitted.unwrap(),
        t.posted.unwrap(),
        t.completed.unwrap(),
    );
    assert!(
        before <= submitted && submitted <= posted && posted <= completed,
        "{t:?}"
    );
    assert_eq!(t.duration(), Some(completed - submitted));
}

/// Issue 27: expectations can be cancelled too. The cancelled one completes once with
/// `Cancelled`, and its arrivals are owed as after a timeout (never counted for the next
/// expectation on the immediate).
#[test]
fn an_expectation_is_cancelled_and_its_arrivals_stay_owed() {
    let (a, b) = pair("");
    let (on_done, calls, last) = counted();
    let (handle, on_done) = b.cancellable(on_done);
    b.expect_imm_count(40, 2, on_done).unwrap();
    assert_eq!(handle.status(), TransferStatus::Queued);
    assert_eq!(handle.cancel().unwrap(), TransferStatus::Cancelled);
    wait_calls(&calls, 1);
    assert!(matches!(*last.lock().unwrap(), Some(Err(Error::Cancelled))));
    assert_eq!(b.imm_owed(40), 2);
    assert_eq!(b.stats().unwrap().imm_owed, 2, "the debt shows in stats()");
    // The next expectation on 40 counts only what lands after the cancelled one's share.
    let next = DoneFlag::new();
    b.expect_imm_count(40, 1, next.clone()).unwrap();
    let src = HostBuffer::from_fn(&a, 64, |_| 1).unwrap();
    let dst = HostBuffer::new(&b, 64).unwrap();
    let sent = engine_core::DoneCounter::new();
    for _ in 0..2 {
        a.submit_single_write(8, Some(40), (src.mr(), 0), (dst.desc(), 0), sent.clone())
            .unwrap();
    }
    sent.wait_for(2, WAIT).unwrap();
    let deadline = std::time::Instant::now() + WAIT;
    while b.imm_owed(40) > 0 {
        assert!(
            std::time::Instant::now() < deadline,
            "the owed arrivals never landed"
        );
        std::thread::yield_now();
    }
    assert!(
        next.result().is_none(),
        "the owed arrivals met the next expectation"
    );
    a.submit_single_write(8, Some(40), (src.mr(), 0), (dst.desc(), 0), sent.clone())
        .unwrap();
    next.wait(WAIT).unwrap();
    assert_eq!(calls.load(Ordering::SeqCst), 1, "exactly one completion");
}
