//! A `DoneFlag` waker runs on the engine's worker, and the low-latency pattern depends on it
//! being allowed to do the two things an answer needs there: expect the next arrival and
//! submit a write on that same engine. Both only queue work for the worker (neither waits for
//! it), so neither may deadlock the worker that runs the waker.

mod common;

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::mpsc;
use std::sync::{Arc, Weak};
use std::time::Duration;

use common::mock_config;
use engine_core::{DoneCounter, DoneFlag, HostBuffer, MrDesc, MrHandle, TransferEngine};

/// A ball passed between two engines: each arrival's waker, on the receiving engine's worker,
/// expects the ball back and throws it to the other side, until `rounds` throws landed.
struct Rally {
    engines: [Weak<TransferEngine>; 2],
    /// Where side `i` throws from (its buffer) and to (the other side's).
    throws: [(MrHandle, MrDesc); 2],
    landed: AtomicU64,
    rounds: u64,
    sent: Arc<DoneCounter>,
    end: mpsc::SyncSender<Result<u64, String>>,
}

const IMM: u32 = 41;

/// Side `thrower` expects the ball back, then throws it.
fn throw(rally: &Arc<Rally>, thrower: usize) {
    let next = Arc::clone(rally);
    let flag = DoneFlag::with_waker(move || {
        let n = next.landed.fetch_add(1, Ordering::SeqCst) + 1;
        if n == next.rounds {
            let _ = next.end.try_send(Ok(n));
        } else {
            // On the worker of the side that caught it.
            throw(&next, 1 - thrower);
        }
    });
    let (Some(me), Some(other)) = (
        rally.engines[thrower].upgrade(),
        rally.engines[1 - thrower].upgrade(),
    ) else {
        let _ = rally.end.try_send(Err("an engine is gone".into()));
        return;
    };
    let (src, dst) = &rally.throws[thrower];
    let posted = other.expect_imm_count(IMM, 1, flag).and_then(|()| {
        me.submit_single_write(16, Some(IMM), (*src, 0), (dst, 0), rally.sent.clone())
    });
    if let Err(e) = posted {
        let _ = rally.end.try_send(Err(e.to_string()));
    }
}

#[test]
fn a_flag_waker_on_the_worker_can_expect_and_submit_the_answer() {
    // Delayed, reordered completions: the wakers run whenever the mock's fabric delivers.
    rally(mock_config(
        1,
        "[backends.mock]\nreorder = true\ndelay_us = 200\njitter_us = 200\n",
    ));
}

#[test]
fn workers_that_spin_instead_of_yielding_still_answer() {
    // `yield_when_idle = false`: idle polls spin (no system call between them) for a
    // millisecond before the worker parks; the rally must not notice the difference.
    rally(mock_config(
        1,
        "[worker]\nyield_when_idle = false\nspin_us = 1000\n[backends.mock]\nreorder = true\ndelay_us = 50\njitter_us = 100\n",
    ));
}

/// 300 throws between two engines opened with `config`, answered only by wakers.
fn rally(config: engine_core::Config) {
    let a = Arc::new(TransferEngine::open(&config).unwrap());
    let b = Arc::new(TransferEngine::open(&config).unwrap());
    let on_a = HostBuffer::from_fn(&a, 64, |i| i as u8).unwrap();
    let on_b = HostBuffer::from_fn(&b, 64, |i| (i * 5) as u8).unwrap();
    let (end, ended) = mpsc::sync_channel(1);
    let rally = Arc::new(Rally {
        engines: [Arc::downgrade(&a), Arc::downgrade(&b)],
        throws: [
            (on_a.mr(), on_b.desc().clone()),
            (on_b.mr(), on_a.desc().clone()),
        ],
        landed: AtomicU64::new(0),
        rounds: 300,
        sent: DoneCounter::new(),
        end,
    });
    throw(&rally, 0);
    let landed = ended
        .recv_timeout(Duration::from_secs(60))
        .expect("the rally stalled: a waker that expects and submits deadlocked or was lost");
    assert_eq!(landed, Ok(300));
    rally.sent.wait_for(300, Duration::from_secs(20)).unwrap();
    for e in [&a, &b] {
        assert_eq!(
            e.imm_count(IMM),
            0,
            "every arrival was consumed by its expectation"
        );
    }
}
