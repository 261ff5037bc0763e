//! Seeded failure schedules: random interleavings of every kind of submission, expectations
//! (before and after their arrivals), timeouts, deregistrations, peer deaths, panicking
//! callbacks and sinks, and engine drops — on the mock, which lands operations on its own
//! clock, unordered, and fails them as RC does. After each schedule:
//!
//! - every accepted operation and expectation finished exactly once;
//! - no byte changed outside live registered memory (guard bytes around every region, and a
//!   sentinel written into each region after it was deregistered);
//! - no expectation was met by more arrivals of its immediate than were ever sent.
//!
//! `XFER_SCHEDULES=N` sets how many schedules run (CI runs thousands through `cargo xtask
//! test`); a failure names its seed, and `XFER_SCHEDULE_SEED=S` replays that one.

mod common;

use std::collections::HashMap;
use std::sync::atomic::{AtomicU32, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use common::mock_config;
use engine_core::{
    expected_arrivals, Device, Error, MrDesc, MrHandle, OnDone, Pages, ScatterDst, TransferEngine,
    TransferShape,
};

const GUARD: usize = 256;
const GUARD_BYTE: u8 = 0xee;
const SENTINEL: u8 = 0x5a;
const REGION: usize = 64 << 10;
const IMMS: u32 = 4;

/// A region of raw memory with guard bytes on both sides; only the middle is registered.
struct Guarded {
    memory: Vec<u8>,
    registration: Option<(MrHandle, MrDesc)>,
    /// Deregistered: its middle holds the sentinel, which nothing may change any more.
    retired: bool,
}

impl Guarded {
    fn new(engine: &TransferEngine) -> Self {
        let mut memory = vec![GUARD_BYTE; REGION + 2 * GUARD];
        memory[GUARD..GUARD + REGION].fill(0);
        let ptr = memory[GUARD..].as_mut_ptr();
        // SAFETY: `memory` is deregistered (or its engine dropped) before it is freed: the
        // schedule drops every engine before its regions.
        let registration = unsafe { engine.reg_mr(ptr, REGION, Device::Host) }.ok();
        Self {
            memory,
            registration,
            retired: false,
        }
    }

    fn retire(&mut self, engine: &TransferEngine) {
        if let Some((mr, _)) = self.registration.take() {
            // Whatever it returns, nothing writes the memory afterwards.
            let _ = engine.dereg_mr(mr);
            self.memory[GUARD..GUARD + REGION].fill(SENTINEL);
            self.retired = true;
        }
    }

    fn check(&self, seed: u64, what: &str) {
        let (head, rest) = self.memory.split_at(GUARD);
        let (middle, tail) = rest.split_at(REGION);
        assert!(
            head.iter().chain(tail).all(|&b| b == GUARD_BYTE),
            "seed {seed}: a write landed outside {what}"
        );
        if self.retired {
            assert!(
                middle.iter().all(|&b| b == SENTINEL),
                "seed {seed}: a write landed in {what} after dereg_mr returned"
            );
        }
    }
}

/// Counts how often each operation finished.
#[derive(Default)]
struct Ledger {
    finished: Mutex<Vec<u32>>,
    /// Per immediate: expectations met, and their needs.
    met: Mutex<HashMap<u32, u64>>,
}

impl Ledger {
    fn on_done(self: &Arc<Self>, panics: bool) -> OnDone {
        let index = {
            let mut f = self.finished.lock().unwrap();
            f.push(0);
            f.len() - 1
        };
        let ledger = Arc::clone(self);
        OnDone::callback(move |_| {
            ledger.finished.lock().unwrap()[index] += 1;
            if panics {
                panic!("schedule panic: a callback panics");
            }
        })
    }

    fn on_expect(self: &Arc<Self>, imm: u32, need: u64) -> OnDone {
        let index = {
            let mut f = self.finished.lock().unwrap();
            f.push(0);
            f.len() - 1
        };
        let ledger = Arc::clone(self);
        OnDone::callback(move |r| {
            ledger.finished.lock().unwrap()[index] += 1;
            if r.is_ok() {
                *ledger.met.lock().unwrap().entry(imm).or_default() += need;
            }
        })
    }

    /// An operation refused at submission never finishes.
    fn refused(&self) {
        let mut f = self.finished.lock().unwrap();
        let last = f.len() - 1;
        f[last] = 1;
    }
}

fn run_schedule(seed: u64) {
    let mut rng = fastrand::Rng::with_seed(seed);
    let nics = rng.usize(1..=2);
    let extra = format!(
        "[timeouts]\ntransfer_ms = {}\nexpect_ms = {}\ncontrol_ms = 2000\n[worker]\nmax_outstanding = {}\n[stripe]\nmin_stripe_len = 4096\nalign = 64\n[backends.mock]\nseed = {seed}\njitter_us = {}\nfail_every = {}\nqueue_depth = {}\n",
        rng.u64(20..300),
        rng.u64(10..200),
        rng.usize(4..64),
        rng.u64(0..300),
        [0, 0, 7, 13, 29][rng.usize(0..5)],
        rng.usize(0..4),
    );
    let config = mock_config(nics, &extra);
    let ledger = Arc::new(Ledger::default());
    let sent: Arc<Mutex<HashMap<u32, u64>>> = Arc::default();
    let mirror_panics = Arc::new(AtomicU32::new(0));
    let a = Arc::new(TransferEngine::open(&config).unwrap());
    let b = Arc::new(TransferEngine::open(&config).unwrap());
    let c = Arc::new(TransferEngine::open(&config).unwrap());
    let src = Guarded::new(&a);
    let mut on_b = vec![Guarded::new(&b), Guarded::new(&b)];
    let mut on_c = Guarded::new(&c);
    if rng.bool() {
        let p = Arc::clone(&mirror_panics);
        b.mirror_imm_count(0, move |n| {
            if n > 2 {
                p.fetch_add(1, Ordering::Relaxed);
                panic!("schedule panic: a mirror sink panics");
            }
        })
        .unwrap();
    }
    let mut c_alive = true;
    let count = |shape| expected_arrivals(shape, nics, &config.stripe);
    for _ in 0..rng.usize(10..40) {
        let Some((src_mr, _)) = src.registration else {
            break;
        };
        let live: Vec<MrDesc> = on_b
            .iter()
            .filter_map(|g| g.registration.as_ref().map(|r| r.1.clone()))
            .collect();
        let dst = live
            .get(rng.usize(0..live.len().max(1)))
            .cloned()
            .or_else(|| on_c.registration.as_ref().map(|r| r.1.clone()));
        let imm = rng.u32(0..IMMS);
        let panics = rng.u8(0..10) == 0;
        match rng.u8(0..11) {
            0..=2 => {
                let Some(dst) = dst else { continue };
                let len = rng.u64(0..REGION as u64 / 2);
                let off = rng.u64(0..REGION as u64 - len);
                let r = a.submit_single_write(
                    len,
                    Some(imm),
                    (src_mr, off),
                    (&dst, rng.u64(0..REGION as u64 - len)),
                    ledger.on_done(panics),
                );
                match r {
                    Ok(()) => {
                        *sent.lock().unwrap().entry(imm).or_default() +=
                            count(TransferShape::Single { len })
                    }
                    Err(_) => ledger.refused(),
                }
            }
            3 => {
                let Some(dst) = dst else { continue };
                let n = rng.usize(1..8);
                let page_len = 1024;
                let indices: Vec<u32> = (0..n as u32).map(|_| rng.u32(0..32)).collect();
                let pages = Pages {
                    indices,
                    stride: 1024,
                    offset: 0,
                };
                let r = a.submit_paged_writes(
                    page_len,
                    Some(imm),
                    (src_mr, &pages),
                    (&dst, &pages),
                    ledger.on_done(panics),
                );
                match r {
                    Ok(()) => {
                        *sent.lock().unwrap().entry(imm).or_default() +=
                            count(TransferShape::Paged {
                                page_len,
                                pages: n as u64,
                            })
                    }
                    Err(_) => ledger.refused(),
                }
            }
            4 => {
                let targets: Vec<MrDesc> = live
                    .iter()
                    .cloned()
                    .chain(on_c.registration.as_ref().map(|r| r.1.clone()))
                    .collect();
                if targets.is_empty() {
                    continue;
                }
                let dsts: Vec<ScatterDst> = targets
                    .iter()
                    .map(|d| ScatterDst {
                        len: 100,
                        src_offset: rng.u64(0..1000),
                        dst: d.clone(),
                        dst_offset: rng.u64(0..1000),
                    })
                    .collect();
                let r = a.submit_scatter(None, ledger.on_done(panics), Some(imm), src_mr, &dsts);
                match r {
                    Ok(()) => {
                        // Arrivals only count on B's regions (C's are another receiver).
                        let on_b_count = dsts.len() - usize::from(on_c.registration.is_some());
                        *sent.lock().unwrap().entry(imm).or_default() += on_b_count as u64
                    }
                    Err(_) => ledger.refused(),
                }
            }
            5 => {
                let Some(dst) = dst else { continue };
                let r = a.submit_barrier(None, ledger.on_done(panics), imm, &[dst]);
                match r {
                    Ok(()) => *sent.lock().unwrap().entry(imm).or_default() += 1,
                    Err(_) => ledger.refused(),
                }
            }
            6 => {
                let r = a.submit_send(&b.main_address(), b"hello", ledger.on_done(panics));
                if r.is_err() {
                    ledger.refused();
                }
            }
            7 => {
                let need = rng.u64(1..4);
                let r = b.expect_imm_count(imm, need, ledger.on_expect(imm, need));
                if r.is_err() {
                    ledger.refused();
                }
            }
            8 => {
                // Deregister one of B's regions while writes may target it; register anew.
                let i = rng.usize(0..on_b.len());
                on_b[i].retire(&b);
                on_b.push(Guarded::new(&b));
            }
            9 => {
                if c_alive && rng.bool() {
                    backend_mock::kill(&c.main_address());
                    c_alive = false;
                } else {
                    on_c.retire(&c);
                }
            }
            _ => std::thread::sleep(Duration::from_micros(rng.u64(0..2000))),
        }
    }
    // Drop the engines in a random order; each fires whatever it still holds, once.
    let mut engines = vec![a.clone(), b.clone(), c.clone()];
    rng.shuffle(&mut engines);
    drop((a, b, c));
    for e in engines {
        drop(e);
    }
    // Callbacks of the last drops run on their own threads, which the drops joined.
    let finished = ledger.finished.lock().unwrap().clone();
    if std::env::var_os("XFER_SCHEDULE_STATS").is_some() {
        eprintln!(
            "seed {seed}: {} operations, met {:?}, sent {:?}",
            finished.len(),
            ledger.met.lock().unwrap(),
            sent.lock().unwrap()
        );
    }
    for (i, n) in finished.iter().enumerate() {
        assert_eq!(*n, 1, "seed {seed}: operation {i} finished {n} times");
    }
    let sent = sent.lock().unwrap();
    for (imm, met) in ledger.met.lock().unwrap().iter() {
        let arrived_at_most = sent.get(imm).copied().unwrap_or(0);
        assert!(
            *met <= arrived_at_most,
            "seed {seed}: expectations on {imm} met by {met} arrivals, but only {arrived_at_most} were sent"
        );
    }
    src.check(seed, "the source region");
    for (i, g) in on_b.iter().enumerate() {
        g.check(seed, &format!("B's region {i}"));
    }
    on_c.check(seed, "C's region");
    let _ = Error::Shutdown;
}

#[test]
fn seeded_failure_schedules_keep_every_promise() {
    // Panics are part of the schedules; keep their messages out of the output.
    let default_hook = std::panic::take_hook();
    std::panic::set_hook(Box::new(move |info| {
        let text = info.to_string();
        if !text.contains("schedule panic") {
            default_hook(info);
        }
    }));
    if let Some(seed) = std::env::var("XFER_SCHEDULE_SEED")
        .ok()
        .and_then(|s| s.parse().ok())
    {
        run_schedule(seed);
        return;
    }
    let n: u64 = std::env::var("XFER_SCHEDULES")
        .ok()
        .and_then(|s| s.parse().ok())
        .unwrap_or(100);
    for seed in 0..n {
        run_schedule(seed);
    }
    println!("{n} failure schedules kept every promise");
}
