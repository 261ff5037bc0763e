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
use engine_core::{Config, DoneCounter, HostBuffer, MrDesc, OnDone, RemoteAccess, TransferEngine};
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
    if let Some(n) = args.nics {
        config.groups[0].nics = (0..n).map(|i| format!("{}{i}", config.backend)).collect();
    }
    Ok(config)
}

/// Waits until `counter` has `target` completions; errors on a failed write. It spins
/// briefly, then blocks (`DoneCounter::wait_for`): a waiter that kept yielding held a CPU the
/// NIC needs when the NIC is software (soft-RoCE on two vCPUs: its whole data path runs on
/// the CPUs).
fn wait(counter: &DoneCounter, target: u64) -> Result<(), BoxError> {
    counter
        .wait_for(target, Duration::from_secs(30))
        .map_err(|e| match e {
            engine_core::Error::Timeout(_) => "a trip did not finish within 30 s".into(),
            e => format!("a write failed: {e}").into(),
        })
}

/// Runs trips of `batch` writes of `block` bytes into `dst` for `duration`.
/// Trips of `batch` transfers of `block` bytes between the local buffer and the peer's (a
/// write from `local` into `remote`, or a read from `remote` into `local`), for `duration`.
fn run_trips(
    engine: &TransferEngine,
    op: Op,
    local: &HostBuffer,
    remote: &MrDesc,
    block: u64,
    batch: u64,
    duration: Duration,
) -> Result<(u64, Duration), BoxError> {
    let counter = DoneCounter::new();
    let start = Instant::now();
    let mut trips = 0u64;
    while trips == 0 || start.elapsed() < duration {
        for i in 0..batch {
            let (l, r) = ((local.mr(), i * block), (remote, i * block));
            match op {
                Op::Write => engine.submit_single_write(block, None, l, r, counter.clone())?,
                Op::Read => engine.submit_single_read(block, l, r, counter.clone())?,
            }
        }
        trips += 1;
        wait(&counter, trips * batch)?;
    }
    Ok((trips, start.elapsed()))
}

/// memcpy of `bytes` bytes, repeated for `duration`: the mock's reference in MiB/s.
/// memcpy between the same two registered buffers the engine copies between (page-aligned
/// heap allocations of the same size), in the same `block`-sized pieces. Two small `Vec`s
/// allocated back to back would sit 16 bytes apart and hit 4 KiB aliasing, making the
/// reference ~20× too slow below 256 KiB.
fn memcpy_mib_s(
    src: &HostBuffer,
    dst: &HostBuffer,
    bytes: usize,
    block: usize,
    duration: Duration,
) -> f64 {
    let start = Instant::now();
    let mut trips = 0u64;
    while trips == 0 || start.elapsed() < duration {
        let mut at = 0;
        while at < bytes {
            let n = block.min(bytes - at);
            dst.copy_from(at, black_box(src), at, n)
                .expect("the bench's buffers hold every trip");
            at += n;
        }
        black_box(dst);
        trips += 1;
    }
    (trips as f64 * bytes as f64 / (1 << 20) as f64) / start.elapsed().as_secs_f64()
}

/// Bytes of memory the kernel says are available (None where it does not say).
fn available_memory() -> Option<u64> {
    let info = std::fs::read_to_string("/proc/meminfo").ok()?;
    let line = info.lines().find(|l| l.starts_with("MemAvailable:"))?;
    let kib: u64 = line.split_whitespace().nth(1)?.parse().ok()?;
    kib.checked_mul(1024)
}

/// The bytes one buffer needs for every block size at this batch, refused with a clear error
/// when it cannot work (zero sizes, overflow, more than the machine has).
fn buffer_span(args: &Args, buffers: u64) -> Result<u64, BoxError> {
    let sizes = sizes(args);
    if args.batch_size == 0 || sizes.contains(&0) {
        return Err("--block-size and --batch-size must be at least 1".into());
    }
    let largest = sizes.iter().max().copied().unwrap_or(1);
    let span = largest
        .checked_mul(args.batch_size)
        .filter(|s| usize::try_from(*s).is_ok())
        .ok_or_else(|| {
            format!(
                "--block-size {largest} × --batch-size {} does not fit in memory addresses",
                args.batch_size
            )
        })?;
    if let Some(available) = available_memory() {
        let needed = span.saturating_mul(buffers);
        if needed > available {
            return Err(format!(
                "--block-size {largest} × --batch-size {} needs {needed} bytes of buffers, more than the {available} bytes available",
                args.batch_size
            )
            .into());
        }
    }
    Ok(span)
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
        "mock" => Some("memcpy between the same registered buffers".into()),
        "efa" if cfg!(feature = "efa") => Some(format!(
            "raw libfabric fi_writemsg (or fi_readmsg) loop on {}",
            efa_provider(config)
        )),
        _ => None,
    }
}

/// The reference throughput for this backend, measured now with the same sizes.
fn reference_mib_s(
    config: &Config,
    op: Op,
    buffers: Option<(&HostBuffer, &HostBuffer)>,
    bytes: usize,
    block: u64,
    batch: u64,
    duration: Duration,
) -> Result<Option<f64>, BoxError> {
    match config.backend.as_str() {
        "mock" => {
            let (src, dst) =
                buffers.ok_or("the mock's reference copies between the pair's buffers")?;
            Ok(Some(memcpy_mib_s(
                src,
                dst,
                bytes,
                block as usize,
                duration,
            )))
        }
        #[cfg(feature = "efa")]
        "efa" => {
            let raw = match op {
                Op::Write => backend_efa::raw::write_loop,
                Op::Read => backend_efa::raw::read_loop,
            };
            let (trips, elapsed) = raw(
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
            let _ = (op, buffers, bytes, batch);
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
        ratios: Vec::new(),
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

fn loopback(args: &Args, config: &Config) -> Result<Report, BoxError> {
    let sizes = sizes(args);
    let span = buffer_span(args, 2)?;
    let duration = Duration::from_secs_f64(args.duration);
    // The mock's reference (memcpy) runs between the pair's buffers; the efa reference (a raw
    // libfabric loop) needs no engine, and runs with none open: engines whose workers poll
    // without parking (shm, EFA) would otherwise take its CPU on a small machine.
    let reference_uses_pair = config.backend == "mock";
    let mut rows = Vec::new();
    for (k, &block) in sizes.iter().enumerate() {
        let bytes = (block * args.batch_size) as usize;
        let fill: Vec<u8> = (0..bytes).map(|i| pattern(k as u64 + 2, i)).collect();
        let reference = |pair: Option<&Pair>| {
            reference_mib_s(
                config,
                args.op,
                pair.map(|p| (&p.src, &p.dst)),
                bytes,
                block,
                args.batch_size,
                duration,
            )
        };
        // Rounds alternate which of the two runs first, so a machine that speeds up or slows
        // down during the sweep does not favour either side.
        let mut runs = Vec::new();
        let mut references = Vec::new();
        let mut verified = None;
        for round in 0..args.rounds.max(1) {
            let reference_first = round % 2 == 1;
            if reference_first && !reference_uses_pair {
                references.extend(reference(None)?);
            }
            let pair = Pair::open(config, span)?;
            // The bytes start on the side that sends them: A for writes, B for reads.
            match args.op {
                Op::Write => pair.src.write(0, &fill)?,
                Op::Read => pair.dst.write(0, &fill)?,
            }
            if reference_first && reference_uses_pair {
                references.extend(reference(Some(&pair))?);
            }
            let (trips, elapsed) = run_trips(
                &pair.a,
                args.op,
                &pair.src,
                pair.dst.desc(),
                block,
                args.batch_size,
                duration,
            )?;
            runs.push(row(block, args.batch_size, trips, elapsed));
            if !reference_first && reference_uses_pair {
                references.extend(reference(Some(&pair))?);
            }
            if args.verify {
                verified = Some(pair.dst.to_vec()[..bytes] == pair.src.to_vec()[..bytes]);
            }
            drop(pair);
            if !reference_first && !reference_uses_pair {
                references.extend(reference(None)?);
            }
        }
        let ratios: Vec<f64> = runs
            .iter()
            .zip(&references)
            .map(|(x, reference)| x.throughput_mib_s / reference)
            .collect();
        // The row is xfer's median round; the reference its median too.
        runs.sort_by(|x, y| x.throughput_mib_s.total_cmp(&y.throughput_mib_s));
        let mut r = runs.swap_remove(runs.len() / 2);
        r.reference_mib_s = median(&references);
        r.ratios = ratios;
        r.verified = verified;
        rows.push(r);
    }
    let pair = Pair::open(config, span.max(64 * 1024))?;
    let imm_rate = if args.no_imm_rate {
        None
    } else {
        Some(imm_rate(&pair.a, &pair.b, &pair.src, &pair.dst, duration)?)
    };
    Ok(Report {
        backend: pair.a.backend().to_owned(),
        reference: reference_name(config),
        nics: pair.a.nic_count(),
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

/// How initiator and target talk besides RDMA: lines over a TCP socket (`--addr`), or engine
/// messages between peers found through the rendezvous (`--rendezvous`).
enum Control {
    Tcp {
        reader: BufReader<TcpStream>,
        out: TcpStream,
    },
    Engine {
        engine: Arc<TransferEngine>,
        peer: engine_core::NetAddr,
        lines: std::sync::mpsc::Receiver<String>,
        /// Keeps this side published.
        _published: xfer_rendezvous::Publication,
    },
}

impl Control {
    /// Engine messages into a channel of lines.
    fn listen(engine: &Arc<TransferEngine>) -> Result<std::sync::mpsc::Receiver<String>, BoxError> {
        let (tx, rx) = std::sync::mpsc::channel();
        let tx = std::sync::Mutex::new(tx);
        engine.submit_recvs(256, 8, move |m| {
            let _ = tx
                .lock()
                .unwrap()
                .send(String::from_utf8_lossy(m).into_owned());
        })?;
        Ok(rx)
    }

    fn send(&mut self, line: &str) -> Result<(), BoxError> {
        match self {
            Control::Tcp { out, .. } => Ok(writeln!(out, "{line}")?),
            Control::Engine { engine, peer, .. } => {
                let sent = engine_core::DoneFlag::new();
                engine.submit_send(peer, line.as_bytes(), sent.clone())?;
                Ok(sent.wait(Duration::from_secs(30))?)
            }
        }
    }

    fn recv(&mut self) -> Result<String, BoxError> {
        match self {
            Control::Tcp { reader, .. } => read_line(reader),
            Control::Engine { lines, .. } => Ok(lines.recv_timeout(Duration::from_secs(300))?),
        }
    }
}

/// Target: registers a buffer, hands its descriptor over (TCP or the rendezvous), verifies
/// on request.
fn target(args: &Args, config: &Config) -> Result<(), BoxError> {
    let engine = Arc::new(TransferEngine::open(config)?);
    let span = buffer_span(args, 1)?;
    let dst = HostBuffer::new(&engine, span as usize)?;
    let mut control = match &args.rendezvous {
        Some(url) => {
            let lines = Control::listen(&engine)?;
            let rdv = xfer_rendezvous::Rendezvous::connect_within(
                url,
                xfer_rendezvous::connect_wait(config),
            )?;
            let published = rdv.publish(
                "bench-target",
                &engine.main_address(),
                &[("dst", dst.desc())],
                Duration::from_secs(5),
            )?;
            eprintln!(
                "target: {} NICs on {}, published on {url}",
                engine.nic_count(),
                engine.backend()
            );
            let peer = rdv.lookup("bench-initiator", Duration::from_secs(60))?.addr;
            Control::Engine {
                engine: Arc::clone(&engine),
                peer,
                lines,
                _published: published,
            }
        }
        None => {
            let listener = TcpListener::bind(&args.addr)?;
            eprintln!(
                "target: {} NICs on {}, listening on {}",
                engine.nic_count(),
                engine.backend(),
                args.addr
            );
            let (stream, _) = listener.accept()?;
            let reader = BufReader::new(stream.try_clone()?);
            let mut out = stream;
            writeln!(out, "{}", dst.desc())?;
            Control::Tcp { reader, out }
        }
    };
    loop {
        let line = control.recv()?;
        let words: Vec<&str> = line.split_whitespace().collect();
        match words.as_slice() {
            ["check", bytes, seed] => {
                let (bytes, seed): (usize, u64) = (bytes.parse()?, seed.parse()?);
                let bad = dst.to_vec()[..bytes]
                    .iter()
                    .enumerate()
                    .position(|(i, &x)| x != pattern(seed, i));
                match bad {
                    None => control.send("ok")?,
                    Some(at) => control.send(&format!("bad {at}"))?,
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
    let (desc, mut control) = match &args.rendezvous {
        Some(url) => {
            let lines = Control::listen(&engine)?;
            let rdv = xfer_rendezvous::Rendezvous::connect_within(
                url,
                xfer_rendezvous::connect_wait(config),
            )?;
            let published = rdv.publish(
                "bench-initiator",
                &engine.main_address(),
                &[],
                Duration::from_secs(5),
            )?;
            let target = rdv.lookup("bench-target", Duration::from_secs(60))?;
            let desc = target
                .region("dst")
                .ok_or("bench-target published no dst region")?
                .clone();
            let control = Control::Engine {
                engine: Arc::clone(&engine),
                peer: target.addr,
                lines,
                _published: published,
            };
            (desc, control)
        }
        None => {
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
            let desc: MrDesc = read_line(&mut reader)?.parse()?;
            (
                desc,
                Control::Tcp {
                    reader,
                    out: stream,
                },
            )
        }
    };
    let sizes = sizes(args);
    let span = buffer_span(args, 1)?;
    let src = HostBuffer::new(&engine, span as usize)?;
    let duration = Duration::from_secs_f64(args.duration);
    let mut rows = Vec::new();
    for (k, &block) in sizes.iter().enumerate() {
        let bytes = (block * args.batch_size) as usize;
        let seed = k as u64 + 2;
        let fill: Vec<u8> = (0..bytes).map(|i| pattern(seed, i)).collect();
        src.write(0, &fill)?;
        let (trips, elapsed) = run_trips(
            &engine,
            Op::Write,
            &src,
            &desc,
            block,
            args.batch_size,
            duration,
        )?;
        let mut r = row(block, args.batch_size, trips, elapsed);
        if args.verify {
            control.send(&format!("check {bytes} {seed}"))?;
            r.verified = Some(control.recv()? == "ok");
        }
        rows.push(r);
    }
    control.send("bye")?;
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
        "{:>10} | {:>18} | {:>11} | {:>25} | {:>12} | {:>26} | {:>19} | {:>17} | {:>20} | {:>8}",
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
        let (reference, ratio) = match (r.reference_mib_s, median(&r.ratios)) {
            (Some(m), Some(median)) if r.ratios.len() > 1 => {
                let lo = r.ratios.iter().copied().fold(f64::INFINITY, f64::min);
                let hi = r.ratios.iter().copied().fold(0.0, f64::max);
                (format!("{m:.1}"), format!("{median:.3} ({lo:.2}-{hi:.2})"))
            }
            (Some(m), _) => (format!("{m:.1}"), format!("{:.3}", r.throughput_mib_s / m)),
            _ => ("-".into(), "-".into()),
        };
        let verified =
            r.verified.map_or(
                "-".to_owned(),
                |v| if v { "yes".into() } else { "NO".into() },
            );
        println!(
            "{:>10} | {:>18} | {:>11} | {:>25.1} | {:>12.3} | {:>26.4} | {:>19.1} | {:>17} | {:>20} | {:>8}",
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

/// Which side of the `--reactive` ping-pong an arrival is for.
#[derive(Debug, Clone, Copy)]
enum Side {
    /// The pinger: a PONG arrived.
    A,
    /// The answerer: a PING arrived.
    B,
}

/// What the wakers of `--latency --reactive` share. Engines are held weakly and buffers by
/// handle: a waker runs on a worker and may hold the last reference to this, and dropping an
/// engine or a buffer there would wait for that same worker.
struct Reactive {
    a: std::sync::Weak<TransferEngine>,
    b: std::sync::Weak<TransferEngine>,
    /// A's source and B's target of each PING; B's source and A's target of each PONG.
    ping: (engine_core::MrHandle, MrDesc),
    pong: (engine_core::MrHandle, MrDesc),
    warmup: u64,
    total: u64,
    answered: AtomicU64,
    received: AtomicU64,
    started: std::sync::Mutex<Instant>,
    samples: std::sync::Mutex<Vec<f64>>,
    sent: Arc<DoneCounter>,
    end: std::sync::mpsc::SyncSender<Result<(), String>>,
}

const PING: u32 = 0x7a11;
const PONG: u32 = 0x7a12;

impl Reactive {
    /// Expects the next arrival for `side`; its flag's waker calls [`arrived`](Self::arrived).
    fn arm(self: &Arc<Self>, side: Side) {
        let slot: Arc<std::sync::OnceLock<std::sync::Weak<engine_core::DoneFlag>>> = Arc::default();
        let (inner, state) = (Arc::clone(&slot), Arc::clone(self));
        let flag = engine_core::DoneFlag::with_waker(move || {
            let outcome = inner
                .get()
                .and_then(std::sync::Weak::upgrade)
                .and_then(|f| f.result());
            match outcome {
                Some(Ok(())) => state.arrived(side),
                other => state.finish(Err(format!("{side:?}'s expectation ended: {other:?}"))),
            }
        });
        let _ = slot.set(Arc::downgrade(&flag));
        let (engine, imm) = match side {
            Side::A => (&self.a, PONG),
            Side::B => (&self.b, PING),
        };
        let armed = engine
            .upgrade()
            .ok_or_else(|| "the engine is gone".to_owned())
            .and_then(|e| e.expect_imm_count(imm, 1, flag).map_err(|e| e.to_string()));
        if let Err(e) = armed {
            self.finish(Err(format!("arming {side:?}: {e}")));
        }
    }

    fn arrived(self: &Arc<Self>, side: Side) {
        match side {
            Side::B => {
                if self.answered.fetch_add(1, Ordering::SeqCst) + 1 < self.total {
                    self.arm(Side::B);
                }
                self.write(&self.b, PONG, &self.pong);
            }
            Side::A => {
                let elapsed = self
                    .started
                    .lock()
                    .unwrap_or_else(|p| p.into_inner())
                    .elapsed();
                let n = self.received.fetch_add(1, Ordering::SeqCst) + 1;
                if n > self.warmup {
                    self.samples
                        .lock()
                        .unwrap_or_else(|p| p.into_inner())
                        .push(elapsed.as_secs_f64() * 1e6 / 2.0);
                }
                if n == self.total {
                    self.finish(Ok(()));
                } else {
                    self.ping();
                }
            }
        }
    }

    fn ping(self: &Arc<Self>) {
        self.arm(Side::A);
        *self.started.lock().unwrap_or_else(|p| p.into_inner()) = Instant::now();
        self.write(&self.a, PING, &self.ping);
    }

    fn write(
        &self,
        engine: &std::sync::Weak<TransferEngine>,
        imm: u32,
        (src, dst): &(engine_core::MrHandle, MrDesc),
    ) {
        let submitted = engine
            .upgrade()
            .ok_or_else(|| "the engine is gone".to_owned())
            .and_then(|e| {
                e.submit_single_write(8, Some(imm), (*src, 0), (dst, 0), self.sent.clone())
                    .map_err(|e| e.to_string())
            });
        if let Err(e) = submitted {
            self.finish(Err(format!("submitting {imm:#x}: {e}")));
        }
    }

    fn finish(&self, outcome: Result<(), String>) {
        let _ = self.end.try_send(outcome);
    }
}

/// `--latency N --reactive`: the ping-pong of [`latency`], answered on the workers.
fn latency_reactive(config: &Config, iterations: u64) -> Result<Latency, BoxError> {
    let pair = Pair::open(config, 64)?;
    let back = HostBuffer::with_access(&pair.a, 64, |_| 0, RemoteAccess::READ_WRITE)?;
    let b_src = HostBuffer::new(&pair.b, 64)?;
    let warmup = (iterations / 10).max(10);
    let (end, ended) = std::sync::mpsc::sync_channel(1);
    let state = Arc::new(Reactive {
        a: Arc::downgrade(&pair.a),
        b: Arc::downgrade(&pair.b),
        ping: (pair.src.mr(), pair.dst.desc().clone()),
        pong: (b_src.mr(), back.desc().clone()),
        warmup,
        total: warmup + iterations,
        answered: AtomicU64::new(0),
        received: AtomicU64::new(0),
        started: std::sync::Mutex::new(Instant::now()),
        samples: std::sync::Mutex::new(Vec::with_capacity(iterations as usize)),
        sent: DoneCounter::new(),
        end,
    });
    state.arm(Side::B);
    state.ping();
    let outcome = ended
        .recv_timeout(Duration::from_secs(60))
        .map_err(|_| "the ping-pong did not finish within 60 s".to_owned())?;
    outcome?;
    if let Some(e) = state.sent.first_error() {
        return Err(format!("a ping-pong write failed: {e}").into());
    }
    let mut samples = std::mem::take(&mut *state.samples.lock().unwrap_or_else(|p| p.into_inner()));
    latency_figures(iterations, &mut samples)
}

/// p50, p99 and the minimum of one-way samples.
fn latency_figures(iterations: u64, samples: &mut [f64]) -> Result<Latency, BoxError> {
    if samples.is_empty() {
        return Err("no latency samples".into());
    }
    samples.sort_by(f64::total_cmp);
    let at = |q: f64| samples[((samples.len() - 1) as f64 * q).round() as usize];
    Ok(Latency {
        iterations,
        latency_us_p50: at(0.5),
        latency_us_p99: at(0.99),
        latency_us_min: samples[0],
    })
}

/// One-way latency figures of `--latency`, in microseconds.
#[derive(Debug, Serialize)]
struct Latency {
    iterations: u64,
    latency_us_p50: f64,
    latency_us_p99: f64,
    latency_us_min: f64,
}

/// `--latency N`: 8-byte write-with-immediate ping-pongs. B waits for A's next arrival (an
/// `expect_imm_count` of one) and answers; A times each round trip until B's answer arrives,
/// as an application would wait for arrivals.
fn latency(config: &Config, iterations: u64) -> Result<Latency, BoxError> {
    let pair = Pair::open(config, 64)?;
    let back = HostBuffer::with_access(&pair.a, 64, |_| 0, RemoteAccess::READ_WRITE)?;
    let b_src = HostBuffer::new(&pair.b, 64)?;
    let warmup = (iterations / 10).max(10);
    let total = warmup + iterations;
    let stop = std::sync::atomic::AtomicBool::new(false);
    // Each side waits for the next arrival with an expectation (it consumes one arrival),
    // blocking rather than spinning: the spinning is the workers' job (`--busy-poll`), and on
    // a small machine more spinning threads only take CPU from the NIC (soft-RoCE runs in
    // the kernel here).
    let wait_one = |engine: &TransferEngine, imm: u32| -> Result<(), BoxError> {
        if stop.load(std::sync::atomic::Ordering::Relaxed) {
            return Err("the other side stopped".into());
        }
        let arrived = engine_core::DoneFlag::new();
        engine.expect_imm_count(imm, 1, arrived.clone())?;
        arrived.wait(Duration::from_secs(10))?;
        Ok(())
    };
    let (a_sent, b_sent) = (DoneCounter::new(), DoneCounter::new());
    let mut samples = Vec::with_capacity(iterations as usize);
    std::thread::scope(|scope| -> Result<(), BoxError> {
        let answerer = scope.spawn(|| -> Result<(), String> {
            for _ in 1..=total {
                wait_one(&pair.b, PING).map_err(|e| e.to_string())?;
                pair.b
                    .submit_single_write(
                        8,
                        Some(PONG),
                        (b_src.mr(), 0),
                        (back.desc(), 0),
                        b_sent.clone(),
                    )
                    .map_err(|e| e.to_string())?;
            }
            Ok(())
        });
        let pinged = (|| -> Result<(), BoxError> {
            for i in 1..=total {
                let start = Instant::now();
                pair.a.submit_single_write(
                    8,
                    Some(PING),
                    (pair.src.mr(), 0),
                    (pair.dst.desc(), 0),
                    a_sent.clone(),
                )?;
                wait_one(&pair.a, PONG)?;
                if i > warmup {
                    samples.push(start.elapsed().as_secs_f64() * 1e6 / 2.0);
                }
            }
            Ok(())
        })();
        if pinged.is_err() {
            stop.store(true, std::sync::atomic::Ordering::Relaxed);
        }
        let answered = answerer
            .join()
            .map_err(|_| "the answering thread panicked")?;
        pinged?;
        answered.map_err(Into::into)
    })?;
    if let Some(e) = a_sent.first_error().or_else(|| b_sent.first_error()) {
        return Err(format!("a ping-pong write failed: {e}").into());
    }
    latency_figures(iterations, &mut samples)
}

/// Resident memory of this process, in bytes.
fn resident_bytes() -> Option<u64> {
    let status = std::fs::read_to_string("/proc/self/status").ok()?;
    let line = status.lines().find(|l| l.starts_with("VmRSS:"))?;
    let kib: u64 = line.split_whitespace().nth(1)?.parse().ok()?;
    Some(kib * 1024)
}

/// `--queue-memory N`: what N outstanding operations cost, held by a mock NIC that lands
/// nothing for two seconds (so they stay queued in the engine and the fabric).
fn queue_memory(n: usize) -> Result<(), BoxError> {
    let text = format!(
        "backend = \"mock\"\n[[groups]]\nnics = [\"mock0\"]\n[worker]\nmax_outstanding = {}\n[timeouts]\ntransfer_ms = 60000\n[backends.mock]\ndelay_us = 2000000\njitter_us = 0\n",
        n.max(1)
    );
    let config = Config::from_toml(&text, std::path::Path::new("<queue-memory>"))?;
    let a = Arc::new(TransferEngine::open(&config)?);
    let b = Arc::new(TransferEngine::open(&config)?);
    let src = HostBuffer::new(&a, 64)?;
    let dst = HostBuffer::new(&b, 64)?;
    let done = DoneCounter::new();
    let before = resident_bytes().ok_or("no /proc/self/status")?;
    for _ in 0..n {
        a.submit_single_write(64, Some(1), (src.mr(), 0), (dst.desc(), 0), done.clone())?;
    }
    // Let the worker take them all off the submission queue and post them.
    std::thread::sleep(Duration::from_millis(500));
    let after = resident_bytes().ok_or("no /proc/self/status")?;
    println!(
        "{n} queued 64-byte writes: resident memory grew {} KiB, {:.0} bytes per queued operation (engine + mock fabric)",
        after.saturating_sub(before) / 1024,
        after.saturating_sub(before) as f64 / n.max(1) as f64
    );
    wait(&done, n as u64)?;
    Ok(())
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
