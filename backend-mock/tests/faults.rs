//! Fault injection: reordering, delays, failures, backpressure, dropped peers, late
//! completions, and a soak of 10,000 transfers under all of them at once.

mod common;

use std::sync::Arc;
use std::time::{Duration, Instant};

use common::mock_config;
use engine_core::{expected_arrivals, DoneCounter, DoneFlag, Error, TransferEngine, TransferShape};
use proptest::prelude::*;
use xfer_conformance::{buffer, pattern};

const WAIT: Duration = Duration::from_secs(20);

fn open(config: &engine_core::Config) -> Arc<TransferEngine> {
    Arc::new(TransferEngine::open(config).unwrap())
}

#[test]
fn the_nth_operation_fails_with_the_backends_message_and_later_ones_succeed() {
    let config = mock_config(1, "[backends.mock]\nfail_nth = 3\n");
    let (a, b) = (open(&config), open(&config));
    let src = buffer(&a, 64, pattern(1));
    let dst = buffer(&b, 64, |_| 0);
    // One at a time: operations outstanding beside a failed one are flushed with it (RC);
    // those posted after it go out on a fresh connection.
    let results: Vec<_> = (0..5)
        .map(|_| {
            let f = DoneFlag::new();
            a.submit_single_write(8, Some(1), (src.mr(), 0), (dst.desc(), 0), f.clone())
                .unwrap();
            f.wait(WAIT)
        })
        .collect();
    for (i, r) in results.iter().enumerate() {
        if i == 2 {
            assert!(
                matches!(r, Err(Error::Backend { backend, source }) if backend == "mock" && source.message.contains("operation 3")),
                "{r:?}"
            );
        } else {
            assert_eq!(r, &Ok(()), "operation {}", i + 1);
        }
    }
}

#[test]
fn a_full_queue_is_backpressure_not_an_error() {
    let config = mock_config(2, "[backends.mock]\nqueue_depth = 2\njitter_us = 200\n");
    let (a, b) = (open(&config), open(&config));
    let src = buffer(&a, 1 << 16, pattern(2));
    let dst = buffer(&b, 1 << 16, |_| 0);
    let done = DoneCounter::new();
    for i in 0..200u64 {
        let off = (i * 256) % (1 << 16);
        a.submit_single_write(
            256,
            Some(2),
            (src.mr(), off),
            (dst.desc(), off),
            done.clone(),
        )
        .unwrap();
    }
    done.wait_for(200, WAIT).unwrap();
    assert_eq!(done.ok(), 200);
    assert!(src.to_vec()[..200 * 256] == dst.to_vec()[..200 * 256]);
}

#[test]
fn a_killed_peer_fails_what_is_aimed_at_it_and_its_own_pending_work() {
    let config = mock_config(1, "[backends.mock]\ndelay_us = 1000000\n");
    let (a, b, c) = (open(&config), open(&config), open(&config));
    let src = buffer(&a, 64, pattern(3));
    let db = buffer(&b, 64, |_| 0);
    let bsrc = buffer(&b, 64, |_| 5);
    let dc = buffer(&c, 64, |_| 0);
    // B's own write is delayed, then B dies.
    let b_pending = DoneFlag::new();
    // (B's write waits a second in the mock before landing.)
    b.submit_single_write(8, None, (bsrc.mr(), 0), (dc.desc(), 0), b_pending.clone())
        .unwrap();
    std::thread::sleep(Duration::from_millis(10));
    assert!(backend_mock::kill(&b.main_address()));
    assert!(matches!(
        b_pending.wait(WAIT),
        Err(Error::PeerUnreachable(_))
    ));
    let to_b = DoneFlag::new();
    a.submit_single_write(8, Some(1), (src.mr(), 0), (db.desc(), 0), to_b.clone())
        .unwrap();
    assert!(matches!(to_b.wait(WAIT), Err(Error::PeerUnreachable(_))));
    // A still serves C.
    let to_c = DoneFlag::new();
    a.submit_single_write(64, None, (src.mr(), 0), (dc.desc(), 0), to_c.clone())
        .unwrap();
    to_c.wait(WAIT).unwrap();
    assert!(dc.to_vec() == src.to_vec());
}

#[test]
fn a_completion_after_the_deadline_is_ignored_safely() {
    let config = mock_config(
        1,
        "[backends.mock]\njitter_us = 300000\nseed = 4\n[timeouts]\ntransfer_ms = 30\n",
    );
    let (a, b) = (open(&config), open(&config));
    let src = buffer(&a, 64, pattern(3));
    let dst = buffer(&b, 64, |_| 0);
    let counter = DoneCounter::new();
    // With delays drawn up to 300 ms and a 30 ms deadline, most of these time out and their
    // completions come late; each must still be counted exactly once.
    for _ in 0..20 {
        a.submit_single_write(8, None, (src.mr(), 0), (dst.desc(), 0), counter.clone())
            .unwrap();
    }
    let _ = counter.wait_for(20, WAIT);
    assert!(counter.failed() > 0, "some transfers must time out");
    assert!(matches!(counter.first_error(), Some(Error::Timeout(_))));
    std::thread::sleep(Duration::from_millis(400));
    assert_eq!(
        counter.finished(),
        20,
        "late completions must not finish anything twice"
    );
}

#[test]
fn unknown_mock_options_are_named() {
    // Refused when the file is loaded...
    let text = "backend = \"mock\"\n[[groups]]\nnics = [\"m\"]\n[backends.mock]\nreorderr = true\n";
    let err = engine_core::Config::from_toml(text, std::path::Path::new("t.toml")).unwrap_err();
    assert!(err.to_string().contains("reorderr"), "{err}");
    // ...and when a config built in code carries it to open.
    let mut config = mock_config(1, "");
    config.backends = toml::from_str("[mock]\nreorderr = true\n").unwrap();
    let err = TransferEngine::open(&config).unwrap_err();
    assert!(err.to_string().contains("reorderr"), "{err}");
}

/// 10,000 transfers of mixed shapes over 2 NICs with reordering, delays and every 97th
/// operation failing: each finishes exactly once, counts are exact, data byte for byte.
#[test]
fn soak_ten_thousand_transfers_under_faults() {
    const N: usize = 10_000;
    const SLOT: usize = 256 << 10;
    const SLOTS: usize = 16;
    // Every transfer has its own immediate and nobody expects them (the counts are read), so
    // one peer keeps 10,000 idle immediates: its share is raised past them (each NIC address
    // gets a quarter of it).
    let config = mock_config(
        2,
        "[backends.mock]\nseed = 42\nreorder = true\njitter_us = 300\nfail_every = 97\n\
         [worker]\nmax_idle_imms_per_peer = 65536\n",
    );
    let (a, b) = (open(&config), open(&config));
    let src = buffer(&a, SLOT * SLOTS, pattern(9));
    let dst = buffer(&b, SLOT * SLOTS, |_| 0);
    let mut rng = fastrand::Rng::with_seed(7);
    let mut flags = Vec::with_capacity(N);
    let mut lens = Vec::with_capacity(N);
    for i in 0..N {
        // Sizes from tiny to striped (above min_stripe_len); distinct slots in each batch.
        let len = match rng.u8(0..4) {
            0 => rng.u64(1..64),
            1 => rng.u64(64..8192),
            2 => rng.u64(8192..65_536),
            _ => rng.u64(65_536..SLOT as u64),
        };
        let slot = (i % SLOTS * SLOT) as u64;
        let f = DoneFlag::new();
        a.submit_single_write(
            len,
            Some(i as u32),
            (src.mr(), slot),
            (dst.desc(), slot),
            f.clone(),
        )
        .unwrap();
        flags.push(f);
        lens.push(len);
        if i % SLOTS == SLOTS - 1 {
            // Wait for the batch so slots are not rewritten while checked.
            for j in i + 1 - SLOTS..=i {
                let r = flags[j].wait(WAIT);
                // Injected failures are the backend's words; what they flushed is unreachable.
                assert!(
                    matches!(&r, Ok(()) | Err(Error::Backend { .. }))
                        || matches!(&r, Err(Error::PeerUnreachable(m)) if m.message.contains("flushed")),
                    "transfer {j}: {r:?}"
                );
                let s = (j % SLOTS) * SLOT;
                let want =
                    expected_arrivals(TransferShape::Single { len: lens[j] }, 2, &config.stripe);
                if r.is_ok() {
                    let deadline = Instant::now() + WAIT;
                    while b.imm_count(j as u32) < want && Instant::now() < deadline {
                        std::thread::yield_now();
                    }
                    assert_eq!(b.imm_count(j as u32), want, "transfer {j}: arrivals");
                    let n = lens[j] as usize;
                    assert!(
                        dst.to_vec()[s..s + n] == src.to_vec()[s..s + n],
                        "transfer {j}: data"
                    );
                } else {
                    assert!(
                        b.imm_count(j as u32) < want,
                        "a failed transfer lost at least one arrival"
                    );
                }
            }
        }
    }
    let failed = flags
        .iter()
        .filter(|f| f.result().is_some_and(|r| r.is_err()))
        .count();
    assert!(flags.iter().all(|f| f.is_done()));
    // Every 97th operation fails, and (RC) flushes what was outstanding on its connection.
    assert!(
        failed > 0 && failed < N / 5,
        "{failed} failures from every 97th operation"
    );
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 24, ..ProptestConfig::default() })]

    /// What `expected_arrivals` predicts is exactly what the mock delivers, for random shapes,
    /// NIC counts and striping policies.
    #[test]
    fn predicted_arrivals_match_what_the_mock_delivers(
        nics in 1usize..=4,
        len in 1u64..600_000,
        pages in 1u32..8,
        align_log in 6u32..13,
        min_stripe in 0u64..200_000,
        chunk_mul in 1u64..64,
    ) {
        let align = 1u64 << align_log;
        let extra = format!(
            "[stripe]\nalign = {align}\nmin_stripe_len = {min_stripe}\nmax_chunk = {}\n[backends.mock]\nreorder = true\n",
            align * chunk_mul
        );
        let config = mock_config(nics, &extra);
        let (a, b) = (open(&config), open(&config));
        let total = (len * u64::from(pages)) as usize;
        let src = buffer(&a, total, pattern(len));
        let dst = buffer(&b, total, |_| 0);
        let done = DoneFlag::new();
        a.submit_single_write(len, Some(1), (src.mr(), 0), (dst.desc(), 0), done.clone()).unwrap();
        done.wait(WAIT).unwrap();
        let pages_of = engine_core::Pages { indices: (0..pages).rev().collect(), stride: len, offset: 0 };
        let done = DoneFlag::new();
        a.submit_paged_writes(len, Some(2), (src.mr(), &pages_of), (dst.desc(), &pages_of), done.clone()).unwrap();
        done.wait(WAIT).unwrap();
        let deadline = Instant::now() + Duration::from_millis(200);
        while Instant::now() < deadline {
            std::thread::yield_now();
        }
        let single = expected_arrivals(TransferShape::Single { len }, nics, &config.stripe);
        let paged = expected_arrivals(TransferShape::Paged { page_len: len, pages: u64::from(pages) }, nics, &config.stripe);
        prop_assert_eq!(b.imm_count(1), single);
        prop_assert_eq!(b.imm_count(2), paged);
        prop_assert!(dst.to_vec() == src.to_vec());
    }
}

/// Resident memory of this process, in bytes.
fn resident_bytes() -> u64 {
    let status = std::fs::read_to_string("/proc/self/status").unwrap();
    let line = status.lines().find(|l| l.starts_with("VmRSS:")).unwrap();
    line.split_whitespace()
        .nth(1)
        .unwrap()
        .parse::<u64>()
        .unwrap()
        * 1024
}

/// 100,000 operations under faults (reordering, jitter, every 101st failing and flushing its
/// connection, a bounded send queue): each finishes exactly once, and memory stays flat —
/// nothing in the engine or the fabric grows with the number of operations done.
#[test]
fn soak_hundred_thousand_operations_with_flat_memory() {
    const N: u64 = 100_000;
    const WINDOW: u64 = 512;
    let config = mock_config(
        2,
        "[backends.mock]\nseed = 9\njitter_us = 50\nfail_every = 101\nqueue_depth = 64\n",
    );
    let (a, b) = (open(&config), open(&config));
    let src = buffer(&a, 1 << 16, pattern(5));
    let dst = buffer(&b, 1 << 16, |_| 0);
    let done = DoneCounter::new();
    let mut baseline = None;
    for i in 0..N {
        while i >= WINDOW && done.finished() < i - WINDOW {
            std::thread::yield_now();
        }
        if i == N / 10 {
            baseline = Some(resident_bytes());
        }
        let off = (i * 64) % (1 << 16);
        a.submit_single_write(
            64,
            Some((i % 8) as u32),
            (src.mr(), off),
            (dst.desc(), off),
            done.clone(),
        )
        .unwrap();
    }
    let _ = done.wait_for(N, Duration::from_secs(120));
    assert_eq!(done.finished(), N, "every operation finished");
    // Each injected failure flushes what is in flight on its connection, and how much that
    // is depends on the machine's load: 68 % ok here idle or with two busy loops, under half
    // once in a CI run building on the same 2 cores. Both kinds must occur; the share is not
    // the property under test.
    assert!(
        done.failed() > 0 && done.ok() > N / 10,
        "{} ok, {} failed",
        done.ok(),
        done.failed()
    );
    for imm in 0..8 {
        b.reset_imm(imm);
    }
    let growth = resident_bytes().saturating_sub(baseline.unwrap());
    assert!(
        growth < 16 << 20,
        "resident memory grew {growth} bytes over 90,000 operations"
    );
}
