//! Paged writes: the page rate of `submit_paged_writes` and what one page costs (issue 29).
//!
//! `page-bench [--config FILE] [--pages N] [--page-len BYTES] [--calls C] [--single] [--no-reference]`: C calls,
//! each writing N pages of BYTES (a permutation, as a KV-cache request scatters its blocks)
//! from one engine into another's region, each waited for; prints pages per second, the time to
//! post one call (the submit returning) and to its completion. Default: the ideal in-order mock
//! (`inline = true`), 1,000 pages of 64 B, 200 calls. With `--single`, a call is a burst of N
//! single writes, each carrying an immediate the receiver counts (a call's immediate is its
//! number), waited for on both sides: the per-write path, submit to counted arrival. For
//! instructions per page or per write, run it twice under callgrind with different `--calls`
//! and divide the difference (`cargo xtask instructions` does): the worker is busy for the
//! whole burst, so no idle polling is counted (a ping-pong's count moves with scheduling).
//! Last, the reference: the same page copies, in the same order, between two plain buffers on
//! one thread, and the engine's rate as a fraction of it (`--no-reference` leaves it out, as
//! the instruction counts must).
#![forbid(unsafe_code)]

use std::time::{Duration, Instant};

use engine_core::{Config, DoneCounter, DoneFlag, HostBuffer, Pages, TransferEngine};
use examples::{arg, fail};

fn main() {
    examples::init_logging();
    backend_mock::link();
    let number = |flag: &str, default: usize| {
        arg(flag).map_or(default, |v| {
            v.parse().unwrap_or_else(|e| fail(format!("{flag}: {e}")))
        })
    };
    let (pages, page_len, calls) = (
        number("--pages", 1000),
        number("--page-len", 64),
        number("--calls", 200),
    );
    let config = match arg("--config") {
        Some(path) => Config::from_file(std::path::Path::new(&path)),
        None => Config::from_toml(
            "backend = \"mock\"\n[[groups]]\nnics = [\"mock0\"]\n[worker]\nmax_outstanding = 1048576\n\
             [backends.mock]\ninline = true\nreorder = false\njitter_us = 0\n",
            std::path::Path::new("<page-bench>"),
        ),
    }
    .unwrap_or_else(|e| fail(e));
    let a = std::sync::Arc::new(TransferEngine::open(&config).unwrap_or_else(|e| fail(e)));
    let b = std::sync::Arc::new(TransferEngine::open(&config).unwrap_or_else(|e| fail(e)));
    let src = HostBuffer::from_fn(&a, pages * page_len, |i| i as u8).unwrap_or_else(|e| fail(e));
    let dst = HostBuffer::new(&b, pages * page_len).unwrap_or_else(|e| fail(e));
    let indices: Vec<u32> = (0..pages as u32).collect();
    // A fixed permutation: pages land scattered, as a request's blocks do.
    let mut shuffled = indices.clone();
    fastrand::Rng::with_seed(7).shuffle(&mut shuffled);
    let pages_of = |indices: Vec<u32>| Pages {
        indices,
        stride: page_len as u64,
        offset: 0,
    };
    let (src_pages, dst_pages) = (pages_of(indices), pages_of(shuffled));
    let single = std::env::args().any(|a| a == "--single");
    let wait = Duration::from_secs(60);
    let (mut posting, mut total) = (Duration::ZERO, Duration::ZERO);
    for call in 0..calls {
        let start = Instant::now();
        if single {
            let imm = call as u32;
            let arrived = DoneFlag::new();
            b.expect_imm_count(imm, pages as u64, arrived.clone())
                .unwrap_or_else(|e| fail(e));
            let done = DoneCounter::new();
            for (&s, &d) in src_pages.indices.iter().zip(&dst_pages.indices) {
                let (s, d) = (
                    u64::from(s) * page_len as u64,
                    u64::from(d) * page_len as u64,
                );
                a.submit_single_write(
                    page_len as u64,
                    Some(imm),
                    (src.mr(), s),
                    (dst.desc(), d),
                    done.clone(),
                )
                .unwrap_or_else(|e| fail(e));
            }
            posting += start.elapsed();
            done.wait_for(pages as u64, wait)
                .unwrap_or_else(|e| fail(e));
            arrived.wait(wait).unwrap_or_else(|e| fail(e));
        } else {
            let done = DoneFlag::new();
            a.submit_paged_writes(
                page_len as u64,
                None,
                (src.mr(), &src_pages),
                (dst.desc(), &dst_pages),
                done.clone(),
            )
            .unwrap_or_else(|e| fail(e));
            posting += start.elapsed();
            done.wait(wait).unwrap_or_else(|e| fail(e));
        }
        total += start.elapsed();
    }
    let n = (pages * calls) as f64;
    let what = if single {
        "single writes with an immediate"
    } else {
        "pages"
    };
    println!(
        "page-bench: {calls} calls x {pages} {what} of {page_len} B: {:.2} M/s, post {:.3} ms/call, done {:.3} ms/call",
        n / total.as_secs_f64() / 1e6,
        posting.as_secs_f64() * 1e3 / calls as f64,
        total.as_secs_f64() * 1e3 / calls as f64,
    );
    if std::env::args().any(|a| a == "--no-reference") {
        return;
    }
    // The reference, in the same run: copying the same pages, in the same scattered order,
    // between two plain buffers of the same size on this thread — what the mock's inline
    // copies cost without any engine around them.
    let from: Vec<u8> = (0..pages * page_len).map(|i| i as u8).collect();
    let mut to = vec![0u8; pages * page_len];
    let start = Instant::now();
    for _ in 0..calls {
        for (&s, &d) in src_pages.indices.iter().zip(&dst_pages.indices) {
            let (s, d) = (s as usize * page_len, d as usize * page_len);
            to[d..d + page_len].copy_from_slice(&from[s..s + page_len]);
        }
        std::hint::black_box(&mut to);
    }
    let copying = start.elapsed();
    println!(
        "page-bench: reference, the same page copies between plain buffers: {:.2} M/s, {:.3} ms/call; engine/reference {:.2}",
        n / copying.as_secs_f64() / 1e6,
        copying.as_secs_f64() * 1e3 / calls as f64,
        copying.as_secs_f64() / total.as_secs_f64(),
    );
}
