//! `transfer-bench`: write throughput and latency over any backend, modelled on DLSlime's
//! `transfer_bench`, with a reference measured in the same run (memcpy of the same bytes for
//! the in-process mock).
//!
//! Each *trip* is `--batch-size` writes of `--block-size` bytes, waited for together.
//! `--mode loopback` runs initiator and target engines in one process; `initiator` and
//! `target` run them in two processes that exchange addresses over TCP on `--addr`.
#![forbid(unsafe_code)]

use std::hint::black_box;
use std::io::{BufRead, BufReader, Write};
use std::net::{TcpListener, TcpStream};
use std::path::PathBuf;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use clap::{Parser, ValueEnum};
use engine_core::{Config, DoneCounter, HostBuffer, MrDesc, OnDone, RemoteAccess, TransferEngine};
use serde::Serialize;

mod latency;
mod memory;
mod throughput;
mod two_process;

use latency::*;
use memory::*;
use throughput::*;
use two_process::*;

#[derive(Debug, Clone, Copy, PartialEq, Eq, ValueEnum)]
enum Mode {
    /// Both engines in this process.
    Loopback,
    /// Write to a target process.
    Initiator,
    /// Receive from an initiator process.
    Target,
}

/// What each transfer is.
#[derive(Debug, Clone, Copy, PartialEq, Eq, ValueEnum, Serialize)]
#[serde(rename_all = "lowercase")]
enum Op {
    /// RDMA WRITE from the initiator into the target.
    Write,
    /// RDMA READ by the initiator from the target (loopback mode).
    Read,
}

#[derive(Debug, Parser)]
#[command(about = "xfer write/read throughput benchmark")]
struct Args {
    /// Backend name (overrides the config's).
    #[arg(long)]
    backend: Option<String>,
    /// Config file (else $XFER_CONFIG, else the built-in mock config).
    #[arg(long)]
    config: Option<PathBuf>,
    /// Where the two sides run.
    #[arg(long, value_enum, default_value_t = Mode::Loopback)]
    mode: Mode,
    /// Writes (default) or reads.
    #[arg(long, value_enum, default_value_t = Op::Write)]
    op: Op,
    /// Block sizes in bytes (comma-separated); a sweep from 4 KiB to 4 MiB if none.
    #[arg(long, value_delimiter = ',')]
    block_size: Vec<u64>,
    /// Writes per trip.
    #[arg(long, default_value_t = 1)]
    batch_size: u64,
    /// Seconds per block size.
    #[arg(long, default_value_t = 1.0)]
    duration: f64,
    /// Check every byte on the target after each block size.
    #[arg(long)]
    verify: bool,
    /// Print JSON instead of a table.
    #[arg(long)]
    json: bool,
    /// TCP address for initiator/target mode (stay on 127.0.0.1 in tests), when no
    /// rendezvous is given.
    #[arg(long, default_value = "127.0.0.1:18515")]
    addr: String,
    /// Initiator/target mode: meet through this rendezvous (`xfer://…`, `etcd://…`) instead
    /// of `--addr`: the target publishes `bench-target` with its buffer, the initiator looks
    /// it up, and verification requests go as engine messages.
    #[arg(long)]
    rendezvous: Option<String>,
    /// NICs per engine (rewrites the config's first group for the mock: mock0..mockN-1).
    #[arg(long)]
    nics: Option<usize>,
    /// Loopback: rounds per block size, alternating the reference and xfer (which goes first
    /// alternates too); the row reports the median of each and the median of the per-round
    /// ratios with their spread. One round cannot tell a ratio from noise on a busy machine.
    #[arg(long, default_value_t = 1)]
    rounds: u32,
    /// Skip the 64-byte write-with-immediate rate measurement.
    #[arg(long)]
    no_imm_rate: bool,
    /// Instead of the sweep: queue this many 64-byte writes behind a slow mock NIC and report
    /// the memory each queued operation takes (resident set growth per operation).
    #[arg(long)]
    queue_memory: Option<usize>,
    /// Instead of the sweep: this many 8-byte write-with-immediate ping-pongs between two
    /// engines (loopback; each side waits for the other's arrival, then answers), reporting
    /// the one-way latency (half a round trip) p50/p99 in microseconds — what `ib_write_lat`
    /// reports as t_typical and its 99% percentile.
    #[arg(long)]
    latency: Option<u64>,
    /// With `--latency`: answer each arrival on the engine's worker (the expectation's flag
    /// carries a waker that arms the next expectation and submits the answer) instead of on
    /// an application thread woken by it: the engine's own path, with no thread hand-over
    /// between an arrival and the write it triggers.
    #[arg(long)]
    reactive: bool,
    /// Keep the workers polling while idle (`[worker] idle_poll_us = 0` and a spin without
    /// end), as perftest's latency tools spin on memory. Without it, idle workers park and
    /// rely on the Domain's waker (verbs: its completion channel).
    #[arg(long)]
    busy_poll: bool,
    /// With `--busy-poll`: spin between idle polls instead of yielding the CPU
    /// (`[worker] yield_when_idle = false`), as perftest does; best when each worker has a core.
    #[arg(long, requires = "busy_poll")]
    spin: bool,
    /// With `--latency`: how long an application thread's wait looks without sleeping before
    /// it sleeps (`[worker] wait_poll_us`; the
    /// config's value when not given). perftest's latency tools spin without end.
    #[arg(long)]
    wait_poll_us: Option<u64>,
}

#[derive(Debug, Serialize)]
struct Row {
    batch_size: u64,
    block_size: u64,
    total_trips: u64,
    total_mib: f64,
    duration_s: f64,
    avg_latency_ms: f64,
    throughput_mib_s: f64,
    /// The reference measured in the same run (loopback only): memcpy for the mock, a raw
    /// libfabric write loop for efa.
    reference_mib_s: Option<f64>,
    /// xfer / reference of each round, in round order (loopback with a reference).
    ratios: Vec<f64>,
    verified: Option<bool>,
}

/// The median of `v` (the mean of the middle two for an even count); `None` if empty.
fn median(v: &[f64]) -> Option<f64> {
    let mut v = v.to_vec();
    v.sort_by(f64::total_cmp);
    let n = v.len();
    match n {
        0 => None,
        _ if n % 2 == 1 => Some(v[n / 2]),
        _ => Some((v[n / 2 - 1] + v[n / 2]) / 2.0),
    }
}

#[derive(Debug, Serialize)]
struct ImmRate {
    /// Completed within the measured window.
    ops: u64,
    /// Submitted in total (the window's plus those in flight when it closed).
    submitted: u64,
    duration_s: f64,
    mops_per_s: f64,
    arrivals_counted: u64,
}

#[derive(Debug, Serialize)]
struct Report {
    backend: String,
    /// What `reference_mib_s` measures.
    reference: Option<String>,
    nics: usize,
    mode: String,
    rows: Vec<Row>,
    imm_rate: Option<ImmRate>,
}

type BoxError = Box<dyn std::error::Error>;

fn pattern(seed: u64, i: usize) -> u8 {
    ((i as u64)
        .wrapping_mul(131)
        .wrapping_add(seed.wrapping_mul(7))
        % 253) as u8
}

fn load_config(args: &Args) -> Result<Config, BoxError> {
    let mut config = Config::load(args.config.as_deref())?;
    if let Some(b) = &args.backend {
        config.backend = b.clone();
    }
    // The mock is unkind by default (asynchronous, unordered, jittered: for tests). What the
    // bench measures is the engine's own cost next to memcpy, so unless the config says
    // otherwise it runs the mock as an ideal, in-order NIC.
    if config.backend == "mock" {
        let table = config
            .backends
            .entry("mock")
            .or_insert_with(|| toml::Value::Table(toml::Table::new()));
        if let toml::Value::Table(t) = table {
            t.entry("inline").or_insert(toml::Value::Boolean(true));
        }
    }
    if args.busy_poll {
        config.worker.idle_poll_us = 0;
        // A Domain with a waker lets an idle worker park after `spin_us` whatever
        // `idle_poll_us` says: spin for an hour instead.
        config.worker.spin_us = 3_600_000_000;
        config.worker.yield_when_idle = !args.spin;
    }
    if let Some(us) = args.wait_poll_us {
        config.worker.wait_poll_us = us;
    }
    if let Some(n) = args.nics {
        config.groups[0].nics = (0..n).map(|i| format!("{}{i}", config.backend)).collect();
    }
    Ok(config)
}

fn sizes(args: &Args) -> Vec<u64> {
    if args.block_size.is_empty() {
        vec![4 << 10, 16 << 10, 64 << 10, 256 << 10, 1 << 20, 4 << 20]
    } else {
        args.block_size.clone()
    }
}

/// Two engines and their buffers for one loopback round: A's buffer is the local side, B's
/// the remote one (written into, or read from).
struct Pair {
    a: Arc<TransferEngine>,
    b: Arc<TransferEngine>,
    src: HostBuffer,
    dst: HostBuffer,
}

impl Pair {
    fn open(config: &Config, span: u64) -> Result<Self, BoxError> {
        let a = Arc::new(TransferEngine::open(config)?);
        let b = Arc::new(TransferEngine::open(config)?);
        let src = HostBuffer::new(&a, span as usize)?;
        let dst = HostBuffer::with_access(&b, span as usize, |_| 0, RemoteAccess::READ_WRITE)?;
        Ok(Self { a, b, src, dst })
    }
}

fn main() {
    examples::init_logging();
    let args = Args::parse();
    if let Some(n) = args.queue_memory {
        backend_mock::link();
        if let Err(e) = queue_memory(n) {
            eprintln!("transfer-bench: {e}");
            std::process::exit(1);
        }
        return;
    }
    backend_mock::link();
    #[cfg(feature = "efa")]
    backend_efa::link();
    #[cfg(feature = "verbs")]
    backend_verbs::link();
    if let Some(n) = args.latency {
        let result = load_config(&args).and_then(|config| {
            if args.reactive {
                latency_reactive(&config, n.max(1))
            } else {
                latency(&config, n.max(1))
            }
        });
        match result {
            Ok(l) if args.json => println!(
                "{}",
                serde_json::to_string_pretty(&l).expect("a report serializes")
            ),
            Ok(l) => println!(
                "8-byte write with immediate, one way (half a round trip), {} iterations: p50 {:.2} us, p99 {:.2} us, min {:.2} us",
                l.iterations, l.latency_us_p50, l.latency_us_p99, l.latency_us_min
            ),
            Err(e) => {
                eprintln!("transfer-bench: {e}");
                std::process::exit(1);
            }
        }
        return;
    }
    let result = load_config(&args).and_then(|config| {
        if args.op == Op::Read && args.mode != Mode::Loopback {
            return Err("--op read runs in --mode loopback".into());
        }
        if config.backend == "mock" && args.mode != Mode::Loopback {
            return Err("the mock backend is in-process: use --mode loopback".into());
        }
        match args.mode {
            Mode::Loopback => loopback(&args, &config).map(Some),
            Mode::Initiator => initiator(&args, &config).map(Some),
            Mode::Target => target(&args, &config).map(|()| None),
        }
    });
    match result {
        Ok(Some(report)) => {
            if args.json {
                println!(
                    "{}",
                    serde_json::to_string_pretty(&report).expect("a report serializes")
                );
            } else {
                print_table(&report);
            }
            if report.rows.iter().any(|r| r.verified == Some(false)) {
                eprintln!("verification FAILED");
                std::process::exit(1);
            }
        }
        Ok(None) => {}
        Err(e) => {
            eprintln!("transfer-bench: {e}");
            std::process::exit(1);
        }
    }
}
