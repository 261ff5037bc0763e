//! Producer-write to callback latency of uvm-watcher slots (host-memory fallback: a CPU
//! thread is the producer). One event in flight at a time, so every event is timed alone.
//! Prints p50/p99 (and `--json`).
#![forbid(unsafe_code)]

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use clap::Parser;
use uvm_watcher::{Control, PoolConfig, WatcherPool};

#[derive(Parser)]
#[command(about = "uvm-watcher latency: producer write to callback")]
struct Args {
    /// Events to time.
    #[arg(long, default_value_t = 20_000)]
    events: u64,
    /// CPU to pin the watcher thread to.
    #[arg(long)]
    cpu: Option<usize>,
    /// CPU to pin the producer to.
    #[arg(long)]
    producer_cpu: Option<usize>,
    /// Print JSON.
    #[arg(long)]
    json: bool,
}

fn main() {
    let args = Args::parse();
    let pool = WatcherPool::new(PoolConfig {
        cpu: args.cpu,
        ..PoolConfig::default()
    })
    .unwrap_or_else(|e| {
        eprintln!("watcher-latency: {e}");
        std::process::exit(1)
    });
    let base = Instant::now();
    let written_at = Arc::new(AtomicU64::new(0));
    let seen = Arc::new(AtomicU64::new(0));
    let latencies = Arc::new(std::sync::Mutex::new(Vec::with_capacity(
        args.events as usize,
    )));
    let (w, s, l) = (
        Arc::clone(&written_at),
        Arc::clone(&seen),
        Arc::clone(&latencies),
    );
    let watcher = pool
        .watch(move |_, new| {
            let now = base.elapsed().as_nanos() as u64;
            l.lock()
                .unwrap()
                .push(now.saturating_sub(w.load(Ordering::Acquire)));
            s.store(new, Ordering::Release);
            Control::Continue
        })
        .expect("a slot");
    if let Some(cpu) = args.producer_cpu {
        if !core_affinity::set_for_current(core_affinity::CoreId { id: cpu }) {
            eprintln!("watcher-latency: cannot pin the producer to CPU {cpu}");
            std::process::exit(1);
        }
    }
    for i in 1..=args.events {
        written_at.store(base.elapsed().as_nanos() as u64, Ordering::Release);
        watcher.store(i);
        let deadline = Instant::now() + Duration::from_secs(5);
        while seen.load(Ordering::Acquire) != i {
            if Instant::now() > deadline {
                eprintln!("watcher-latency: event {i} was not seen within 5 s");
                std::process::exit(1);
            }
            std::hint::spin_loop();
        }
    }
    let mut lat = latencies.lock().unwrap().clone();
    lat.sort_unstable();
    let pct = |p: f64| lat[((lat.len() as f64 * p) as usize).min(lat.len() - 1)] as f64 / 1e3;
    let (p50, p99, max) = (pct(0.50), pct(0.99), *lat.last().unwrap() as f64 / 1e3);
    if args.json {
        println!("{{\"events\": {}, \"memory\": \"{:?}\", \"p50_us\": {p50:.3}, \"p99_us\": {p99:.3}, \"max_us\": {max:.3}}}", lat.len(), watcher.memory());
    } else {
        println!("uvm-watcher ({:?} memory): {} events, producer write -> callback p50 {p50:.2} us, p99 {p99:.2} us, max {max:.1} us", watcher.memory(), lat.len());
    }
}
