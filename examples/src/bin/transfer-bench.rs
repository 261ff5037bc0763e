//! `transfer-bench`: write throughput and latency over any backend, modelled on DLSlime's
//! `transfer_bench`, with a reference measured in the same run (memcpy of the same bytes for
//! the in-process mock).
//!
//! Each *trip* is `--batch-size` writes of `--block-size` bytes, waited for together.
//! `--mode loopback` runs initiator and target engines in one process; `initiator` and
//! `target` run them in two processes that exchange addresses over TCP on `--addr`.

use std::hint::black_box;
use std::io::{BufRead, BufReader, Write};
use std::net::{TcpListener, TcpStream};
use std::path::PathBuf;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use clap::{Parser, ValueEnum};
use engine_core::{Config, DoneCounter, HostBuffer, MrDesc, OnDone, TransferEngine};
use serde::Serialize;

#[derive(Debug, Clone, Copy, PartialEq, Eq, ValueEnum)]
enum Mode {
    /// Both engines in this process.
    Loopback,
    /// Write to a target process.
    Initiator,
    /// Receive from an initiator process.
    Target,
}

#[derive(Debug, Parser)]
#[command(about = "xfer write throughput/latency benchmark")]
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
    /// TCP address for initiator/target mode (stay on 127.0.0.1 in tests).
    #[arg(long, default_value = "127.0.0.1:18515")]
    addr: String,
    /// NICs per engine (rewrites the config's first group for the mock: mock0..mockN-1).
    #[arg(long)]
    nics: Option<usize>,
    /// Skip the 64-byte write-with-immediate rate measurement.
    #[arg(long)]
    no_imm_rate: bool,
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
    verified: Option<bool>,
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
    if let Some(n) = args.nics {
        config.groups[0].nics = (0..n).map(|i| format!("{}{i}", config.backend)).collect();
    }
    Ok(config)
}

/// Spins (yielding) until `counter` has `target` completions; errors on a failed write.
fn wait(counter: &DoneCounter, target: u64) -> Result<(), BoxError> {
    let deadline = Instant::now() + Duration::from_secs(30);
    while counter.finished() < target {
        if Instant::now() > deadline {
            return Err("a trip did not finish within 30 s".into());
        }
        std::thread::yield_now();
    }
    match counter.first_error() {
        Some(e) => Err(format!("a write failed: {e}").into()),
        None => Ok(()),
    }
}

/// Runs trips of `batch` writes of `block` bytes into `dst` for `duration`.
fn run_trips(
    engine: &TransferEngine,
    src: &HostBuffer,
    dst: &MrDesc,
    block: u64,
    batch: u64,
    duration: Duration,
) -> Result<(u64, Duration), BoxError> {
    let counter = DoneCounter::new();
    let start = Instant::now();
    let mut trips = 0u64;
    while trips == 0 || start.elapsed() < duration {
        for i in 0..batch {
            engine.submit_single_write(
                block,
                None,
                (src.mr(), i * block),
                (dst, i * block),
                counter.clone(),
            )?;
        }
        trips += 1;
        wait(&counter, trips * batch)?;
    }
    Ok((trips, start.elapsed()))
}

/// memcpy of `bytes` bytes, repeated for `duration`: the mock's reference in MiB/s.
fn memcpy_mib_s(bytes: usize, block: usize, duration: Duration) -> f64 {
    let src: Vec<u8> = (0..bytes).map(|i| pattern(1, i)).collect();
    let mut dst = vec![0u8; bytes];
    let start = Instant::now();
    let mut trips = 0u64;
    while trips == 0 || start.elapsed() < duration {
        for (d, s) in dst.chunks_mut(block).zip(src.chunks(block)) {
            d.copy_from_slice(black_box(s));
        }
        black_box(&mut dst);
        trips += 1;
    }
    (trips as f64 * bytes as f64 / (1 << 20) as f64) / start.elapsed().as_secs_f64()
}

/// The libfabric provider an efa config selects.
fn efa_provider(config: &Config) -> String {
    toml::from_str::<toml::Table>(&config.backend_options())
        .ok()
        .and_then(|t| t.get("provider")?.as_str().map(str::to_owned))
        .unwrap_or_else(|| "efa".into())
}

fn reference_name(config: &Config) -> Option<String> {
    match config.backend.as_str() {
        "mock" => Some("memcpy of the same bytes".into()),
        "efa" if cfg!(feature = "efa") => Some(format!(
            "raw libfabric fi_writemsg loop on {}",
            efa_provider(config)
        )),
        _ => None,
    }
}

/// The reference throughput for this backend, measured now with the same sizes.
fn reference_mib_s(
    config: &Config,
    bytes: usize,
    block: u64,
    batch: u64,
    duration: Duration,
) -> Result<Option<f64>, BoxError> {
    match config.backend.as_str() {
        "mock" => Ok(Some(memcpy_mib_s(bytes, block as usize, duration))),
        #[cfg(feature = "efa")]
        "efa" => {
            let (trips, elapsed) = backend_efa::raw::write_loop(
                &efa_provider(config),
                block as usize,
                batch as usize,
                duration,
            )?;
            Ok(Some(
                (trips * batch * block) as f64 / (1 << 20) as f64 / elapsed.as_secs_f64(),
            ))
        }
        _ => {
            let _ = (bytes, batch);
            Ok(None)
        }
    }
}

fn row(block: u64, batch: u64, trips: u64, elapsed: Duration) -> Row {
    let mib = (trips * batch * block) as f64 / (1 << 20) as f64;
    let secs = elapsed.as_secs_f64();
    Row {
        batch_size: batch,
        block_size: block,
        total_trips: trips,
        total_mib: mib,
        duration_s: secs,
        avg_latency_ms: secs * 1e3 / trips as f64,
        throughput_mib_s: mib / secs,
        reference_mib_s: None,
        verified: None,
    }
}

/// 64-byte writes with an immediate, submit to callback, with up to 4096 in flight.
fn imm_rate(
    a: &TransferEngine,
    b: &TransferEngine,
    src: &HostBuffer,
    dst: &HostBuffer,
    duration: Duration,
) -> Result<ImmRate, BoxError> {
    const WINDOW: u64 = 4096;
    let done = Arc::new(AtomicU64::new(0));
    let failed = Arc::new(AtomicU64::new(0));
    let start = Instant::now();
    let mut submitted = 0u64;
    while start.elapsed() < duration {
        while submitted - done.load(Ordering::Acquire) < WINDOW {
            let (d, f) = (Arc::clone(&done), Arc::clone(&failed));
            let slot = (submitted % 1024) * 64;
            a.submit_single_write(
                64,
                Some(1),
                (src.mr(), slot),
                (dst.desc(), slot),
                OnDone::callback(move |r| {
                    if r.is_err() {
                        f.fetch_add(1, Ordering::Relaxed);
                    }
                    d.fetch_add(1, Ordering::Release);
                }),
            )?;
            submitted += 1;
        }
        std::thread::yield_now();
    }
    let ops = done.load(Ordering::Acquire);
    let elapsed = start.elapsed();
    let deadline = Instant::now() + Duration::from_secs(30);
    while done.load(Ordering::Acquire) < submitted && Instant::now() < deadline {
        std::thread::yield_now();
    }
    if failed.load(Ordering::Relaxed) > 0 || done.load(Ordering::Acquire) < submitted {
        let (failed, missing) = (
            failed.load(Ordering::Relaxed),
            submitted - done.load(Ordering::Acquire),
        );
        return Err(format!(
            "of the 64-byte writes, {failed} failed and {missing} never completed"
        )
        .into());
    }
    let counted = wait_count(b, 1, submitted);
    Ok(ImmRate {
        ops,
        submitted,
        duration_s: elapsed.as_secs_f64(),
        mops_per_s: ops as f64 / elapsed.as_secs_f64() / 1e6,
        arrivals_counted: counted,
    })
}

fn wait_count(engine: &TransferEngine, imm: u32, want: u64) -> u64 {
    let deadline = Instant::now() + Duration::from_secs(10);
    while engine.imm_count(imm) < want && Instant::now() < deadline {
        std::thread::yield_now();
    }
    engine.imm_count(imm)
}

fn sizes(args: &Args) -> Vec<u64> {
    if args.block_size.is_empty() {
        vec![4 << 10, 16 << 10, 64 << 10, 256 << 10, 1 << 20, 4 << 20]
    } else {
        args.block_size.clone()
    }
}

fn loopback(args: &Args, config: &Config) -> Result<Report, BoxError> {
    let a = Arc::new(TransferEngine::open(config)?);
    let b = Arc::new(TransferEngine::open(config)?);
    let sizes = sizes(args);
    let span = sizes.iter().max().copied().unwrap_or(1) * args.batch_size;
    let src = HostBuffer::new(&a, span as usize)?;
    let dst = HostBuffer::new(&b, span as usize)?;
    let duration = Duration::from_secs_f64(args.duration);
    let mut rows = Vec::new();
    for (k, &block) in sizes.iter().enumerate() {
        let bytes = (block * args.batch_size) as usize;
        let fill: Vec<u8> = (0..bytes).map(|i| pattern(k as u64 + 2, i)).collect();
        src.write(0, &fill)?;
        let (trips, elapsed) = run_trips(&a, &src, dst.desc(), block, args.batch_size, duration)?;
        let mut r = row(block, args.batch_size, trips, elapsed);
        r.reference_mib_s = reference_mib_s(config, bytes, block, args.batch_size, duration)?;
        if args.verify {
            r.verified = Some(dst.to_vec()[..bytes] == src.to_vec()[..bytes]);
        }
        rows.push(r);
    }
    let imm_rate = if args.no_imm_rate {
        None
    } else {
        let s = HostBuffer::new(&a, 64 * 1024)?;
        let d = HostBuffer::new(&b, 64 * 1024)?;
        Some(imm_rate(&a, &b, &s, &d, duration)?)
    };
    Ok(Report {
        backend: a.backend().to_owned(),
        reference: reference_name(config),
        nics: a.nic_count(),
        mode: "loopback".into(),
        rows,
        imm_rate,
    })
}

fn read_line(reader: &mut impl BufRead) -> Result<String, BoxError> {
    let mut line = String::new();
    if reader.read_line(&mut line)? == 0 {
        return Err("the peer closed the connection".into());
    }
    Ok(line.trim().to_owned())
}

/// Target: registers a buffer, hands its descriptor over TCP, verifies on request.
fn target(args: &Args, config: &Config) -> Result<(), BoxError> {
    let engine = Arc::new(TransferEngine::open(config)?);
    let span = sizes(args).iter().max().copied().unwrap_or(1) * args.batch_size;
    let dst = HostBuffer::new(&engine, span as usize)?;
    let listener = TcpListener::bind(&args.addr)?;
    eprintln!(
        "target: {} NICs on {}, listening on {}",
        engine.nic_count(),
        engine.backend(),
        args.addr
    );
    let (stream, _) = listener.accept()?;
    let mut reader = BufReader::new(stream.try_clone()?);
    let mut out = stream;
    writeln!(out, "{}", dst.desc())?;
    loop {
        let line = read_line(&mut reader)?;
        let words: Vec<&str> = line.split_whitespace().collect();
        match words.as_slice() {
            ["check", bytes, seed] => {
                let (bytes, seed): (usize, u64) = (bytes.parse()?, seed.parse()?);
                let bad = dst.to_vec()[..bytes]
                    .iter()
                    .enumerate()
                    .position(|(i, &x)| x != pattern(seed, i));
                match bad {
                    None => writeln!(out, "ok")?,
                    Some(at) => writeln!(out, "bad {at}")?,
                }
            }
            ["bye"] => return Ok(()),
            _ => return Err(format!("unexpected request {line:?}").into()),
        }
    }
}

/// Initiator: fetches the target's descriptor, runs the sweep, asks the target to verify.
fn initiator(args: &Args, config: &Config) -> Result<Report, BoxError> {
    let engine = Arc::new(TransferEngine::open(config)?);
    let deadline = Instant::now() + Duration::from_secs(30);
    let stream = loop {
        match TcpStream::connect(&args.addr) {
            Ok(s) => break s,
            Err(e) if Instant::now() > deadline => {
                return Err(format!("cannot reach the target at {}: {e}", args.addr).into())
            }
            Err(_) => std::thread::sleep(Duration::from_millis(100)),
        }
    };
    let mut reader = BufReader::new(stream.try_clone()?);
    let mut out = stream;
    let desc: MrDesc = read_line(&mut reader)?.parse()?;
    let sizes = sizes(args);
    let span = sizes.iter().max().copied().unwrap_or(1) * args.batch_size;
    let src = HostBuffer::new(&engine, span as usize)?;
    let duration = Duration::from_secs_f64(args.duration);
    let mut rows = Vec::new();
    for (k, &block) in sizes.iter().enumerate() {
        let bytes = (block * args.batch_size) as usize;
        let seed = k as u64 + 2;
        let fill: Vec<u8> = (0..bytes).map(|i| pattern(seed, i)).collect();
        src.write(0, &fill)?;
        let (trips, elapsed) = run_trips(&engine, &src, &desc, block, args.batch_size, duration)?;
        let mut r = row(block, args.batch_size, trips, elapsed);
        if args.verify {
            writeln!(out, "check {bytes} {seed}")?;
            r.verified = Some(read_line(&mut reader)? == "ok");
        }
        rows.push(r);
    }
    writeln!(out, "bye")?;
    Ok(Report {
        backend: engine.backend().to_owned(),
        reference: None,
        nics: engine.nic_count(),
        mode: "initiator".into(),
        rows,
        imm_rate: None,
    })
}

fn print_table(report: &Report) {
    println!(
        "backend: {}, NICs: {}, mode: {}, reference: {}",
        report.backend,
        report.nics,
        report.mode,
        report.reference.as_deref().unwrap_or("none")
    );
    println!(
        "{:>10} | {:>18} | {:>11} | {:>25} | {:>12} | {:>26} | {:>19} | {:>17} | {:>12} | {:>8}",
        "Batch Size",
        "Block Size (Bytes)",
        "Total Trips",
        "Total Transferred (MiB)",
        "Duration (s)",
        "Average Latency (ms/trip)",
        "Throughput (MiB/s)",
        "Reference (MiB/s)",
        "vs reference",
        "Verified"
    );
    for r in &report.rows {
        let (reference, ratio) = match r.reference_mib_s {
            Some(m) => (format!("{m:.1}"), format!("{:.3}", r.throughput_mib_s / m)),
            None => ("-".into(), "-".into()),
        };
        let verified =
            r.verified.map_or(
                "-".to_owned(),
                |v| if v { "yes".into() } else { "NO".into() },
            );
        println!(
            "{:>10} | {:>18} | {:>11} | {:>25.1} | {:>12.3} | {:>26.4} | {:>19.1} | {:>17} | {:>12} | {:>8}",
            r.batch_size, r.block_size, r.total_trips, r.total_mib, r.duration_s, r.avg_latency_ms, r.throughput_mib_s, reference, ratio, verified
        );
    }
    if let Some(i) = &report.imm_rate {
        println!(
            "64-byte write with imm, submit to callback: {:.3} M ops/s ({} ops in {:.2} s; {} of {} submitted counted at the target)",
            i.mops_per_s, i.ops, i.duration_s, i.arrivals_counted, i.submitted
        );
    }
}

fn main() {
    let args = Args::parse();
    backend_mock::link();
    #[cfg(feature = "efa")]
    backend_efa::link();
    #[cfg(feature = "verbs")]
    backend_verbs::link();
    let result = load_config(&args).and_then(|config| {
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
