//! The in-process sweep: loopback trips of each block size and batch, the reference measured
//! in the same run (memcpy, or a raw libfabric loop), the rate of small writes with
//! immediates, and the table printed from them.

use super::*;

/// Waits until `counter` has `target` completions; errors on a failed write. It spins
/// briefly, then blocks (`DoneCounter::wait_for`): a waiter that kept yielding held a CPU the
/// NIC needs when the NIC is software (soft-RoCE on two vCPUs: its whole data path runs on
/// the CPUs).
pub(crate) fn wait(counter: &DoneCounter, target: u64) -> Result<(), BoxError> {
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
pub(crate) fn run_trips(
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
pub(crate) fn memcpy_mib_s(
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
pub(crate) fn available_memory() -> Option<u64> {
    let info = std::fs::read_to_string("/proc/meminfo").ok()?;
    let line = info.lines().find(|l| l.starts_with("MemAvailable:"))?;
    let kib: u64 = line.split_whitespace().nth(1)?.parse().ok()?;
    kib.checked_mul(1024)
}

/// The bytes one buffer needs for every block size at this batch, refused with a clear error
/// when it cannot work (zero sizes, overflow, more than the machine has).
pub(crate) fn buffer_span(args: &Args, buffers: u64) -> Result<u64, BoxError> {
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
pub(crate) fn efa_provider(config: &Config) -> String {
    toml::from_str::<toml::Table>(&config.backend_options())
        .ok()
        .and_then(|t| t.get("provider")?.as_str().map(str::to_owned))
        .unwrap_or_else(|| "efa".into())
}

pub(crate) fn reference_name(config: &Config) -> Option<String> {
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
pub(crate) fn reference_mib_s(
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

pub(crate) fn row(block: u64, batch: u64, trips: u64, elapsed: Duration) -> Row {
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
pub(crate) fn imm_rate(
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

pub(crate) fn wait_count(engine: &TransferEngine, imm: u32, want: u64) -> u64 {
    let deadline = Instant::now() + Duration::from_secs(10);
    while engine.imm_count(imm) < want && Instant::now() < deadline {
        std::thread::yield_now();
    }
    engine.imm_count(imm)
}

pub(crate) fn loopback(args: &Args, config: &Config) -> Result<Report, BoxError> {
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

pub(crate) fn print_table(report: &Report) {
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
