//! Paged reads over a libfabric provider: what a KV decode's load costs per page (issue 54's
//! MLA row: 18 KiB pages, 512 a layer).
//!
//! `paged-reads [--provider shm] [--pages 512] [--page-len 18432] [--calls 200] [--scattered]
//! [--idle-poll-us 1000] [--no-reference]`: C calls, each reading N pages of BYTES from one engine's region into
//! another's, each waited for; prints pages per second and the time per call. Pages are
//! consecutive on both sides (a fresh cache's blocks), or with `--scattered` the remote pages a
//! fixed permutation (no two pages adjacent on both sides). Last, the reference in the same
//! run: libfabric's own read loop (`backend_efa::raw::read_loop`, one `fi_readmsg` a page, 64 in
//! flight) for as long, and the engine's rate as a fraction of it.
#![forbid(unsafe_code)]

use std::path::Path;
use std::sync::Arc;
use std::time::{Duration, Instant};

use engine_core::{Config, DoneFlag, HostBuffer, Pages, RemoteAccess, TransferEngine};

fn arg(flag: &str) -> Option<String> {
    let args: Vec<String> = std::env::args().collect();
    args.iter()
        .position(|a| a == flag)
        .and_then(|i| args.get(i + 1).cloned())
}

fn number(flag: &str, default: usize) -> usize {
    arg(flag).map_or(default, |v| v.parse().expect(flag))
}

fn main() {
    backend_efa::link();
    std::env::set_var("FI_TCP_IFACE", "lo");
    let provider = arg("--provider").unwrap_or_else(|| "shm".into());
    let (pages, page_len, calls) = (
        number("--pages", 512),
        number("--page-len", 18 << 10),
        number("--calls", 200),
    );
    // The engine's default; 0 keeps an idle worker polling (the owner's side of an shm read
    // progresses only while it polls).
    let idle_poll_us = number("--idle-poll-us", 1_000);
    let config = Config::from_toml(
        &format!(
            "backend = \"efa\"\n[[groups]]\nnics = [\"auto\"]\n[worker]\nmax_outstanding = 1048576\n\
             idle_poll_us = {idle_poll_us}\n[backends.efa]\nprovider = \"{provider}\"\n"
        ),
        Path::new("<paged-reads>"),
    )
    .expect("config");
    let reader = Arc::new(TransferEngine::open(&config).expect("an engine"));
    let owner = Arc::new(TransferEngine::open(&config).expect("an engine"));
    let local = HostBuffer::new(&reader, pages * page_len).expect("registering");
    let remote = HostBuffer::with_access(
        &owner,
        pages * page_len,
        |i| (i / 7) as u8,
        RemoteAccess::READ,
    )
    .expect("registering");
    let local_pages = Pages {
        indices: (0..pages as u32).collect(),
        stride: page_len as u64,
        offset: 0,
    };
    let mut remote_indices: Vec<u32> = (0..pages as u32).collect();
    let scattered = std::env::args().any(|a| a == "--scattered");
    if scattered {
        // A fixed permutation with no two neighbours kept neighbours: every page a run.
        let mut x = 0x9e37_79b9_7f4a_7c15u64;
        for i in (1..remote_indices.len()).rev() {
            x ^= x << 13;
            x ^= x >> 7;
            x ^= x << 17;
            remote_indices.swap(i, (x % (i as u64 + 1)) as usize);
        }
    }
    let remote_pages = Pages {
        indices: remote_indices,
        stride: page_len as u64,
        offset: 0,
    };
    let wait = Duration::from_secs(60);
    let mut total = Duration::ZERO;
    for call in 0..=calls {
        let start = Instant::now();
        let done = DoneFlag::new();
        reader
            .submit_paged_reads(
                page_len as u64,
                (local.mr(), &local_pages),
                (remote.desc(), &remote_pages),
                done.clone(),
            )
            .expect("submitting");
        done.wait(wait).expect("the reads");
        // The first call connects: not counted.
        if call > 0 {
            total += start.elapsed();
        }
    }
    let got = local.to_vec();
    for (i, &r) in remote_pages.indices.iter().enumerate() {
        let at = i * page_len;
        let from = r as usize * page_len;
        assert!(
            (0..page_len).all(|k| got[at + k] == ((from + k) / 7) as u8),
            "page {i} read wrong bytes"
        );
    }
    let n = (pages * calls) as f64;
    let rate = n / total.as_secs_f64();
    println!(
        "paged-reads {provider}: {calls} calls x {pages} {} pages of {page_len} B: {:.3} M pages/s, {:.2} GB/s, {:.3} ms/call",
        if scattered { "scattered" } else { "consecutive" },
        rate / 1e6,
        rate * page_len as f64 / 1e9,
        total.as_secs_f64() * 1e3 / calls as f64,
    );
    if std::env::args().any(|a| a == "--no-reference") {
        return;
    }
    drop((reader, owner));
    let (trips, took) =
        backend_efa::raw::read_loop(&provider, page_len, 64, total).expect("the raw read loop");
    let raw = (trips * 64) as f64 / took.as_secs_f64();
    println!(
        "paged-reads {provider}: reference, libfabric's read loop (one fi_readmsg a page, 64 in flight): {:.3} M pages/s; engine/reference {:.2}",
        raw / 1e6,
        rate / raw
    );
}
