//! Cost per peer (issue 29): how long one engine takes to reach N peer engines for the first
//! time, and how much memory each connected peer holds.
//!
//! `peers-bench [--config FILE] [--peers N]`: opens one engine and N peer engines (default
//! 1,024, on the mock with its default options), then writes 64 bytes with an immediate to
//! every peer, twice. The first round connects (on verbs that is a handshake per peer; on the
//! mock, the connection objects and the engine's per-peer state); the second round reuses
//! them. Prints both rounds' times against `[timeouts] connect_ms`, and the heap each peer
//! holds after the first round (everything allocated minus everything freed in the process
//! during it, divided by N: the sender's per-peer state, the backend's connection on both
//! sides and what each receiver keeps per sender; the resident set's growth beside it, which
//! counts what a verbs provider maps from the driver) and the least it grew over one of five
//! further rounds (which should be about nothing: no per-operation growth). A third engine writes the same round to every
//! peer before the measured ones, so that the peers' own buffers (queues and event lists that
//! grow on first use) are not counted as the connection's.
#![forbid(unsafe_code)]

use std::alloc::System;
use std::sync::Arc;
use std::time::{Duration, Instant};

use engine_core::{Config, DoneCounter, DoneFlag, HostBuffer, TransferEngine};
use examples::{arg, fail};
use stats_alloc::{Region, StatsAlloc, INSTRUMENTED_SYSTEM};

#[global_allocator]
static HEAP: &StatsAlloc<System> = &INSTRUMENTED_SYSTEM;

const WAIT: Duration = Duration::from_secs(120);

/// The process's resident memory in bytes (what the heap misses: a verbs provider's queues are
/// mapped from the driver, not allocated).
fn resident() -> i64 {
    let statm = std::fs::read_to_string("/proc/self/statm").unwrap_or_default();
    let pages: i64 = statm
        .split_whitespace()
        .nth(1)
        .and_then(|p| p.parse().ok())
        .unwrap_or(0);
    pages * 4096
}

/// Bytes the process's heap grew by over a region.
fn grown(region: &Region<'_, System>) -> i64 {
    let c = region.change();
    c.bytes_allocated as i64 - c.bytes_deallocated as i64 + c.bytes_reallocated as i64
}

fn main() {
    examples::init_logging();
    backend_mock::link();
    #[cfg(feature = "verbs")]
    backend_verbs::link();
    #[cfg(feature = "efa")]
    backend_efa::link();
    let peers: usize = arg("--peers").map_or(1024, |v| {
        v.parse().unwrap_or_else(|e| fail(format!("--peers: {e}")))
    });
    let config = match arg("--config") {
        Some(path) => Config::from_file(std::path::Path::new(&path)),
        None => Config::from_toml(
            "backend = \"mock\"\n[[groups]]\nnics = [\"mock0\"]\n",
            std::path::Path::new("<peers-bench>"),
        ),
    }
    .unwrap_or_else(|e| fail(e));
    let open = || Arc::new(TransferEngine::open(&config).unwrap_or_else(|e| fail(e)));
    let a = open();
    let src = HostBuffer::from_fn(&a, 64, |i| i as u8).unwrap_or_else(|e| fail(e));
    let targets: Vec<_> = (0..peers)
        .map(|_| {
            let engine = open();
            let dst = HostBuffer::new(&engine, 64).unwrap_or_else(|e| fail(e));
            (engine, dst)
        })
        .collect();
    let round = |sender: &TransferEngine, src: &HostBuffer, imm: u32| {
        // From before the expectations, which the round also frees.
        let region = Region::new(HEAP);
        let rss = resident();
        let arrived: Vec<_> = targets
            .iter()
            .map(|(engine, _)| {
                let flag = DoneFlag::new();
                engine
                    .expect_imm_count(imm, 1, flag.clone())
                    .unwrap_or_else(|e| fail(e));
                flag
            })
            .collect();
        let start = Instant::now();
        let sent = DoneCounter::new();
        for (_, dst) in &targets {
            sender
                .submit_single_write(64, Some(imm), (src.mr(), 0), (dst.desc(), 0), sent.clone())
                .unwrap_or_else(|e| fail(e));
        }
        sent.wait_for(peers as u64, WAIT)
            .unwrap_or_else(|e| fail(e));
        for flag in &arrived {
            flag.wait(WAIT).unwrap_or_else(|e| fail(e));
        }
        let took = start.elapsed();
        drop(arrived);
        (took, grown(&region), resident() - rss)
    };
    let warm = open();
    let warm_src = HostBuffer::new(&warm, 64).unwrap_or_else(|e| fail(e));
    round(&warm, &warm_src, 0);
    let (first, first_bytes, first_rss) = round(&a, &src, 1);
    let (second, _, _) = round(&a, &src, 1);
    // A per-operation leak grows the heap every round; amortised growth (a vector doubling,
    // a queue's next block) only in some.
    let steady_bytes = (0..5)
        .map(|_| round(&a, &src, 1).1)
        .min()
        .expect("five rounds");
    let per_peer = |bytes: i64| bytes as f64 / peers as f64;
    println!(
        "peers-bench: {peers} peers: first round (connects) {:.1} ms of connect_ms {} ms, second round {:.1} ms; heap held per peer after the first round {:.0} B (resident {:.0} B), least growth over a further round {:.0} B",
        first.as_secs_f64() * 1e3,
        config.timeouts.connect_ms,
        second.as_secs_f64() * 1e3,
        per_peer(first_bytes),
        per_peer(first_rss),
        per_peer(steady_bytes),
    );
}
