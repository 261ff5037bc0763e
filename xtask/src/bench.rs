//! The benchmarks (`bench`, `bench-efa`, `rxe-bench`) with the parsers of their output, and the
//! runners for the soft-RoCE guest (`rxe`) and a GPU machine (`gpu-check`).

use super::*;

/// The EFA backend's benchmark on shm: loopback next to a raw libfabric loop in the same run,
/// then initiator and target in two processes.
/// `bench-efa [--libfabric2] [transfer-bench args]`: the EFA backend on shm next to a raw
/// libfabric loop (3 alternating rounds per size, batch 1 and 16; the median ratio with its
/// spread), then initiator and target in two processes. `--libfabric2`: against libfabric
/// 2.x built from Debian 13's source (see `libfabric2.rs`) instead of the system's 1.17.
pub(crate) fn bench_efa(args: &[String]) -> Result {
    ensure_packages(PACKAGES)?;
    let (libfabric2, extra) = match args.first().map(String::as_str) {
        Some("--libfabric2") => (true, &args[1..]),
        _ => (false, args),
    };
    let mut envs: Vec<(String, String)> = Vec::new();
    let mut exe = "target/release/transfer-bench".to_owned();
    if libfabric2 {
        let prefix = libfabric2::ensure()?.display().to_string();
        envs.push(("LD_LIBRARY_PATH".into(), format!("{prefix}/lib")));
        envs.push(("LIBFABRIC_DIR".into(), prefix));
        envs.push(("CARGO_TARGET_DIR".into(), "target/libfabric2-tests".into()));
        exe = "target/libfabric2-tests/release/transfer-bench".into();
    }
    // Built once; the loopback runs and both processes use the same executable.
    run_with(
        &std::env::var("CARGO").unwrap_or_else(|_| "cargo".into()),
        &[
            "build",
            "--release",
            "--quiet",
            "-p",
            "examples",
            "--features",
            "efa",
            "--bin",
            "transfer-bench",
        ],
        &envs,
    )?;
    let bench = |args: &[&str]| run_with(&exe, args, &envs);
    let sizes = ["--block-size", "4096,65536,1048576"];
    for batch in ["1", "16"] {
        let mut loopback = vec!["--config", "configs/efa-shm.toml", "--no-imm-rate"];
        loopback.extend(["--rounds", "3", "--batch-size", batch]);
        loopback.extend(sizes);
        loopback.extend(extra.iter().map(String::as_str));
        bench(&loopback)?;
    }
    // Two processes: start the target, run the initiator against it.
    let common = [
        "--config",
        "configs/efa-shm.toml",
        "--addr",
        "127.0.0.1:18517",
    ];
    let mut target = Command::new(&exe)
        .args(common)
        .args(["--mode", "target"])
        .args(sizes)
        .envs(envs.iter().map(|(k, v)| (k, v)))
        .spawn()
        .map_err(|e| format!("cannot start the target: {e}"))?;
    let initiator = bench(
        &[
            &common[..],
            &["--mode", "initiator", "--verify"],
            &sizes[..],
        ]
        .concat(),
    );
    let _ = target.wait();
    initiator
}

/// `rxe [--nics N] [--timeout S] -- command...`
pub(crate) fn rxe_command(args: &[String]) -> Result {
    let mut nics = 1;
    let mut timeout = 600;
    let mut rest = args;
    while let Some(flag) = rest.first() {
        match flag.as_str() {
            "--nics" | "--timeout" => {
                let value: u64 = rest
                    .get(1)
                    .and_then(|v| v.parse().ok())
                    .ok_or(format!("{flag} needs a number"))?;
                if flag == "--nics" {
                    nics = value as u32;
                } else {
                    timeout = value;
                }
                rest = &rest[2..];
            }
            "--" => {
                rest = &rest[1..];
                break;
            }
            _ => break,
        }
    }
    let code = rxe::run(nics, std::time::Duration::from_secs(timeout), rest)?.status;
    if code != 0 {
        eprintln!("xtask: the command exited with status {code} in the rxe guest");
        // The command's own status is ours.
        std::process::exit(code);
    }
    Ok(())
}

/// Prepares the GPU check: builds the binaries here (release), copies them into
/// `.gpu-check/` (git-ignored) with a script, for a machine with an NVIDIA GPU to run:
/// `bash .gpu-check/run.sh` (under 5 minutes).
pub(crate) fn gpu_check() -> Result {
    cargo(&[
        "build",
        "--release",
        "--quiet",
        "-p",
        "examples",
        "--bin",
        "gpu-check",
        "--bin",
        "watcher-latency",
    ])?;
    let dir = std::path::Path::new(".gpu-check");
    std::fs::create_dir_all(dir).map_err(|e| e.to_string())?;
    for bin in ["gpu-check", "watcher-latency", "kv_cache"] {
        std::fs::copy(format!("target/release/{bin}"), dir.join(bin))
            .map_err(|e| format!("{bin}: {e}"))?;
    }
    // xfer.ep's GPU path (python -m xfer.ep.gpu_check): the package's wheel and numpy's, for a
    // python3.11 there (the machine has no index to install from).
    let wheel = crate::python::wheel()?;
    let name = std::path::Path::new(&wheel).file_name().unwrap_or_default();
    std::fs::copy(&wheel, dir.join(name)).map_err(|e| format!("{wheel}: {e}"))?;
    let cache = crate::serving::wheel_cache();
    let numpy = std::fs::read_dir(&cache)
        .map_err(|e| format!("{cache}: {e}"))?
        .filter_map(|e| e.ok().map(|e| e.path()))
        .find(|p| {
            p.file_name()
                .and_then(|n| n.to_str())
                .is_some_and(|n| n.starts_with("numpy-") && n.contains("cp311"))
        })
        .ok_or_else(|| format!("no numpy cp311 wheel in {cache} (cargo xtask python fills it)"))?;
    std::fs::copy(&numpy, dir.join(numpy.file_name().unwrap_or_default()))
        .map_err(|e| format!("{}: {e}", numpy.display()))?;
    let script = "#!/usr/bin/env bash\n\
        # uvm-watcher on a GPU: device-mapped slots bumped by a kernel, then by a CPU producer.\n\
        set -u\n\
        cd \"$(dirname \"$0\")\"\n\
        nvidia-smi -L || true\n\
        timeout 120 ./gpu-check --memory device_mapped --events 20000 --cpu 2; s1=$?\n\
        timeout 120 ./gpu-check --memory gpu_gdrcopy --events 20000 --cpu 2; s4=$?\n\
        timeout 60 ./gpu-check --memory device_mapped --pass-cost --cpu 2; s5=$?\n\
        timeout 60 ./gpu-check --memory gpu_gdrcopy --pass-cost --cpu 2; s6=$?\n\
        timeout 60 ./watcher-latency --cpu 2 --producer-cpu 3; s2=$?\n\
        timeout 60 ./kv_cache --gpu; s3=$?\n\
        # xfer.ep's GPU path: streams, watcher slot, GPU counter on the real driver (2 ranks as\n\
        # threads on the mock backend; steps checked against the oracle).\n\
        if python3 -c 'import sys; sys.exit(sys.version_info[:2] != (3, 11))' 2>/dev/null; then\n\
          python3 -m pip install --quiet --no-index --find-links . --target py xfer numpy \\\n\
            && PYTHONPATH=py timeout 180 python3 -m xfer.ep.gpu_check --steps 50; s7=$?\n\
        else echo 'EP case skipped: it needs python3.11'; s7=0; fi\n\
        echo \"gpu-check exit $s1 (device_mapped) $s4 (gpu_gdrcopy; fails where GDRCopy is not installed), pass cost exit $s5 $s6, watcher-latency exit $s2, kv_cache --gpu exit $s3, EP exit $s7\"\n\
        exit $(( s1 | s2 | s3 | s5 | s7 ))\n";
    std::fs::write(dir.join("run.sh"), script).map_err(|e| e.to_string())?;
    println!(
        "prepared {}: run `bash .gpu-check/run.sh` on the GPU machine (carry `.gpu-check`)",
        dir.display()
    );
    Ok(())
}

/// What both rxe benchmarks need: the guest's packages and transfer-bench with verbs.
pub(crate) fn build_rxe_bench() -> Result {
    ensure_packages(PACKAGES)?;
    ensure_packages(rxe::PACKAGES)?;
    cargo(&[
        "build",
        "--release",
        "--quiet",
        "-p",
        "examples",
        "--features",
        "verbs",
        "--bin",
        "transfer-bench",
    ])
}

/// A number field of transfer-bench's pretty JSON on its own line (`"name": 1.5,`).
pub(crate) fn json_number(line: &str, name: &str) -> Option<f64> {
    line.trim()
        .strip_prefix(&format!("\"{name}\": "))?
        .trim_end_matches(',')
        .parse::<f64>()
        .ok()
}

/// `rxe-bench lat`: 8-byte write-with-immediate latency next to `ib_write_lat` on the same rxe
/// device, three alternating rounds in one boot; one-way (half a round trip) p50 and p99.
/// xfer runs five times per round: with parked workers woken by the completion channel (the
/// default configuration) and with busy-polling workers (`--busy-poll`, as `ib_write_lat`
/// spins on memory), each with application threads answering arrivals and with the answers
/// submitted from the workers themselves (`--reactive`); and a fifth time answering on
/// workers that spin without yielding between polls (`--spin`), as perftest's loops do.
pub(crate) fn rxe_latency() -> Result {
    build_rxe_bench()?;
    // ib_write_lat prints `#bytes #iterations t_min t_max t_typical t_avg t_stdev 99% 99.9%`.
    // Each perftest run gets its own TCP port: the third round's ib_write_lat failed in
    // every boot when all rounds shared perftest's default one.
    let script = "for round in 1 2 3; do echo ROUND $round; \
           port=$((18600 + 2 * round)); \
           ib_write_lat -d rxe0 -x 0 -F -s 8 -n 2000 -p $port >/dev/null 2>&1 & \
           for try in $(seq 30); do \
             out=$(ib_write_lat -d rxe0 -x 0 -F -s 8 -n 2000 -p $port localhost 2>/dev/null | awk '$1==8 {print \"PERFTEST\", $5, $8}'); \
             [ -n \"$out\" ] && break; sleep 1; \
           done; echo \"${out:-PERFTEST failed}\"; wait; \
           ib_send_lat -d rxe0 -x 0 -F -s 8 -n 2000 -p $((port + 1)) >/dev/null 2>&1 & \
           for try in $(seq 30); do \
             out=$(ib_send_lat -d rxe0 -x 0 -F -s 8 -n 2000 -p $((port + 1)) localhost 2>/dev/null | awk '$1==8 {print \"SENDLAT\", $5, $8}'); \
             [ -n \"$out\" ] && break; sleep 1; \
           done; echo \"${out:-SENDLAT failed}\"; wait; \
           echo MODE parked; target/release/transfer-bench --config configs/verbs-rxe0.toml --latency 2000 --json; \
           echo MODE busy; target/release/transfer-bench --config configs/verbs-rxe0.toml --latency 2000 --busy-poll --json; \
           echo MODE looking; target/release/transfer-bench --config configs/verbs-rxe0.toml --latency 2000 --wait-poll-us 1000000 --json; \
           echo MODE reactive; target/release/transfer-bench --config configs/verbs-rxe0.toml --latency 2000 --reactive --json; \
           echo MODE reactive-busy; target/release/transfer-bench --config configs/verbs-rxe0.toml --latency 2000 --reactive --busy-poll --json; \
           echo MODE reactive-spin; target/release/transfer-bench --config configs/verbs-rxe0.toml --latency 2000 --reactive --busy-poll --spin --json; \
         done";
    let run = rxe::run(
        1,
        std::time::Duration::from_secs(900),
        &["bash".into(), "-c".into(), script.into()],
    )?;
    if run.status != 0 {
        return Err(format!(
            "the latency benchmark failed in the guest (status {})",
            run.status
        ));
    }
    let rounds = latency_rounds(&run.output);
    println!("\nverbs 8-byte write with immediate on soft-RoCE (TCG guest), one way (half a round trip), 2000 iterations, 3 alternating rounds; perftest: ib_write_lat and ib_send_lat -x 0 -F -s 8 (t_typical, 99%)");
    let show = |p: &Option<(f64, f64)>| match p {
        Some((t, q)) => format!("{t:>9.2} / {q:>8.2}"),
        None => format!("{:>20}", "failed"),
    };
    let median = |mut v: Vec<f64>| {
        v.sort_by(f64::total_cmp);
        v.get(v.len() / 2)
            .map_or_else(|| "no complete round".to_owned(), |m| format!("{m:.3}"))
    };
    for wanted in [
        "parked",
        "busy",
        "looking",
        "reactive",
        "reactive-busy",
        "reactive-spin",
    ] {
        println!(
            "\nxfer workers {wanted}\n{:>6} | {:>20} | {:>20} | {:>8} | {:>20} | {:>8}",
            "round",
            "xfer p50 / p99 (us)",
            "ib_write_lat (us)",
            "ratio",
            "ib_send_lat (us)",
            "ratio"
        );
        let (mut vs_write, mut vs_send) = (Vec::new(), Vec::new());
        for (i, round) in rounds.iter().enumerate() {
            let Some(&(_, e50, e99)) = round.engine.iter().find(|(m, ..)| m == wanted) else {
                continue;
            };
            let (w, sl) = (round.write_lat, round.send_lat);
            let ratio = |r: Option<(f64, f64)>, into: &mut Vec<f64>| match r {
                Some((t, _)) => {
                    into.push(e50 / t);
                    format!("{:>8.3}", e50 / t)
                }
                None => format!("{:>8}", "-"),
            };
            println!(
                "{:>6} | {:>9.2} / {:>8.2} | {} | {} | {} | {}",
                i + 1,
                e50,
                e99,
                show(&w),
                ratio(w, &mut vs_write),
                show(&sl),
                ratio(sl, &mut vs_send)
            );
        }
        println!(
            "median p50 ratio ({wanted}): {} vs ib_write_lat (goal <= 1.1), {} vs ib_send_lat",
            median(vs_write),
            median(vs_send)
        );
    }
    Ok(())
}

/// One round of `rxe-bench lat` as the guest printed it.
#[derive(Debug, Default, PartialEq)]
pub(crate) struct LatencyRound {
    /// ib_write_lat's (t_typical, 99 %) in µs; None when it printed nothing usable.
    write_lat: Option<(f64, f64)>,
    /// ib_send_lat's, whose receiver, like a write with immediate's, consumes a posted
    /// receive and polls a completion (ib_write_lat spins on memory).
    send_lat: Option<(f64, f64)>,
    /// xfer's (mode, p50, p99) per run.
    engine: Vec<(String, f64, f64)>,
}

/// Splits the guest's output at its `ROUND n` lines, so a figure missing from one round
/// leaves a gap there instead of shifting every later round against the wrong perftest run.
pub(crate) fn latency_rounds(output: &[String]) -> Vec<LatencyRound> {
    let figures = |typical: &str, p99: &str| {
        typical
            .parse::<f64>()
            .ok()
            .zip(p99.parse::<f64>().ok())
            .filter(|(t, p)| t.is_finite() && p.is_finite() && *t > 0.0)
    };
    let mut rounds: Vec<LatencyRound> = Vec::new();
    let (mut mode, mut p50) = (String::new(), None);
    for line in output {
        let words: Vec<&str> = line.split_whitespace().collect();
        if let ["ROUND", _] = words.as_slice() {
            rounds.push(LatencyRound::default());
            continue;
        }
        let Some(round) = rounds.last_mut() else {
            continue;
        };
        match words.as_slice() {
            ["PERFTEST", typical, p99] => round.write_lat = figures(typical, p99),
            ["SENDLAT", typical, p99] => round.send_lat = figures(typical, p99),
            ["MODE", m] => mode = (*m).to_owned(),
            _ => {}
        }
        if let Some(v) = json_number(line, "latency_us_p50") {
            p50 = Some(v);
        }
        if let (Some(m), Some(p)) = (p50, json_number(line, "latency_us_p99")) {
            round.engine.push((mode.clone(), m, p));
            p50 = None;
        }
    }
    rounds
}

/// `rxe-bench write|read`'s output per block size: one (xfer, perftest) MiB/s pair per
/// `ROUND n` line, either `None` where that run printed nothing usable — so a run missing
/// from one round does not pair every later round with the wrong run of the other.
pub(crate) fn throughput_rounds(
    output: &[String],
) -> std::collections::BTreeMap<u64, Vec<PairMibS>> {
    let mut rounds: std::collections::BTreeMap<u64, Vec<PairMibS>> = Default::default();
    let (mut round, mut block) = (None, None);
    for line in output {
        let words: Vec<&str> = line.split_whitespace().collect();
        if let ["ROUND", _] = words.as_slice() {
            round = Some(round.map_or(0, |r| r + 1));
            continue;
        }
        let Some(round) = round else {
            continue;
        };
        if let ["PERFTEST", size, mib_s] = words.as_slice() {
            // perftest 4.5 reports MiB/s (2^20 bytes; its --help says so): taken as is.
            if let (Ok(size), Ok(mib_s)) = (size.parse::<u64>(), mib_s.parse::<f64>()) {
                slot(&mut rounds, size, round).1 = Some(mib_s);
            }
        }
        if let Some(b) = json_number(line, "block_size") {
            block = Some(b as u64);
        }
        if let (Some(b), Some(t)) = (block, json_number(line, "throughput_mib_s")) {
            slot(&mut rounds, b, round).0 = Some(t);
        }
    }
    rounds
}

/// xfer's and perftest's MiB/s in one round at one block size.
type PairMibS = (Option<f64>, Option<f64>);

/// `round`'s pair at block size `size`, the rounds before it filled with empty pairs.
pub(crate) fn slot(
    rounds: &mut std::collections::BTreeMap<u64, Vec<PairMibS>>,
    size: u64,
    round: usize,
) -> &mut PairMibS {
    let pairs = rounds.entry(size).or_default();
    if pairs.len() <= round {
        pairs.resize(round + 1, (None, None));
    }
    &mut pairs[round]
}

/// What `rxe-bench write|read` measures: how many alternating rounds, at which block sizes.
#[derive(Debug, PartialEq)]
pub(crate) struct BenchPlan {
    rounds: u32,
    sizes: Vec<u64>,
}

/// Parses `[--rounds N] [--sizes A,B,...]` (defaults: five rounds at 4 KiB, 64 KiB and 1 MiB).
/// More rounds narrow the median where one round's ratio swings ±30 % under emulation.
pub(crate) fn parse_bench_plan(args: &[String]) -> Result<BenchPlan> {
    let mut plan = BenchPlan {
        rounds: 5,
        sizes: vec![4096, 65536, 1 << 20],
    };
    let mut rest = args;
    while let Some(flag) = rest.first() {
        let value = rest
            .get(1)
            .ok_or(format!("rxe-bench: {flag} needs a value"))?;
        match flag.as_str() {
            "--rounds" => {
                plan.rounds = value
                    .parse()
                    .ok()
                    .filter(|&n: &u32| (1..=100).contains(&n))
                    .ok_or(format!("rxe-bench: --rounds {value:?} is not 1..=100"))?;
            }
            "--sizes" => {
                plan.sizes = value
                    .split(',')
                    .map(|s| {
                        s.parse()
                            .ok()
                            .filter(|&n: &u64| (1..=1 << 30).contains(&n))
                            .ok_or(format!(
                                "rxe-bench: block size {s:?} is not a byte count in 1..=1 GiB"
                            ))
                    })
                    .collect::<Result<_>>()?;
            }
            other => {
                return Err(format!(
                    "rxe-bench: unknown option {other:?} (--rounds, --sizes)"
                ))
            }
        }
        rest = &rest[2..];
    }
    Ok(plan)
}

/// The verbs backend next to perftest's `ib_write_bw` on the same soft-RoCE device, in one
/// guest run: engine throughput (two engines on rxe0, loopback mode) over perftest's.
pub(crate) fn rxe_bench(op: &str, options: &[String]) -> Result {
    if op == "lat" {
        return rxe_latency();
    }
    let plan = parse_bench_plan(options)?;
    let (tool, op_flag) = match op {
        "write" => ("ib_write_bw", "write"),
        "read" => ("ib_read_bw", "read"),
        other => {
            return Err(format!(
                "rxe-bench: unknown operation {other:?} (write, read or lat)"
            ))
        }
    };
    build_rxe_bench()?;
    let sizes = &plan.sizes;
    // Rounds in one boot (five by default), perftest and xfer alternating per size, so a
    // ratio is not one sample of TCG noise (the same command varies ±30 % between rounds). perftest's
    // duration mode reports 0 iterations for 1 MiB under emulation: it counts iterations
    // instead (64 MiB per size, at most 5000). The client retries while the server is still
    // starting (slow under emulation).
    let script = format!(
        "for round in $(seq {rounds}); do echo ROUND $round; for s in {list}; do n=$(( 67108864 / s )); [ $n -gt 5000 ] && n=5000; \
           {tool} -d rxe0 -x 0 -F -s $s -n $n >/dev/null 2>&1 & \
           for try in $(seq 30); do \
             out=$({tool} -d rxe0 -x 0 -F -s $s -n $n localhost 2>/dev/null | awk -v s=$s '$1==s {{print \"PERFTEST\", s, $4}}'); \
             [ -n \"$out\" ] && break; sleep 1; \
           done; echo \"$out\"; wait; \
           target/release/transfer-bench --config configs/verbs-rxe0.toml --op {op_flag} --block-size $s --batch-size 128 --duration 3 --no-imm-rate --json; \
         done; done",
        rounds = plan.rounds,
        list = sizes.iter().map(u64::to_string).collect::<Vec<_>>().join(" ")
    );
    // About 15 s per pair (a perftest server's start, both runs, the engines' set-up); twice
    // that, for a slow boot.
    let pairs = u64::from(plan.rounds) * sizes.len() as u64;
    let run = rxe::run(
        1,
        std::time::Duration::from_secs(300 + 30 * pairs),
        &["bash".into(), "-c".into(), script],
    )?;
    if run.status != 0 {
        return Err(format!(
            "the benchmark failed in the guest (status {})",
            run.status
        ));
    }
    let rounds = throughput_rounds(&run.output);
    println!("\nverbs {op} on soft-RoCE (TCG guest), batch 128 (= perftest's TX depth), 3 s per size, {} alternating rounds; perftest: {tool} -x 0 -F -n (MiB/s)", plan.rounds);
    println!(
        "{:>10} | {:>24} | {:>24} | {:>6} | {:>13}",
        "block", "xfer MiB/s (per round)", "perftest MiB/s", "median", "ratio spread"
    );
    for &size in sizes {
        let pairs = rounds.get(&size).map_or(&[][..], Vec::as_slice);
        let (e, p): (Vec<_>, Vec<_>) = pairs.iter().copied().unzip();
        let mut ratios: Vec<f64> = pairs.iter().filter_map(|&(e, p)| Some(e? / p?)).collect();
        ratios.sort_by(f64::total_cmp);
        // A round either side missed shows as "-", so the columns stay round by round.
        let list = |v: &[Option<f64>]| {
            v.iter()
                .map(|x| x.map_or_else(|| "-".to_owned(), |x| format!("{x:.0}")))
                .collect::<Vec<_>>()
                .join(" ")
        };
        match (ratios.first(), ratios.last()) {
            (Some(lo), Some(hi)) => println!(
                "{size:>10} | {:>24} | {:>24} | {:>6.3} | {lo:.3}–{hi:.3}",
                list(&e),
                list(&p),
                ratios[ratios.len() / 2]
            ),
            _ => println!(
                "{size:>10} | {:>24} | {:>24} |      - | missing rounds",
                list(&e),
                list(&p)
            ),
        }
    }
    Ok(())
}

pub(crate) fn bench(extra: &[String]) -> Result {
    let mut args = vec![
        "run",
        "--release",
        "--quiet",
        "-p",
        "examples",
        "--bin",
        "transfer-bench",
        "--",
    ];
    args.extend(extra.iter().map(String::as_str));
    cargo(&args)
}

/// `cargo xtask peer-bench [args]`: xfer against DLSlime and Mooncake Transfer Engine on the
/// same soft-RoCE device in one guest boot (`python/benches/peer_bench.py`, which takes the
/// args: sizes, batch, seconds, rounds, engines). The peers come from PyPI into
/// `target/peers-venv` with the xfer package and its verbs plugin; the guest sees this
/// machine's files. DLSlime picks an IPv4-mapped RoCE v2 GID, so the guest's netdev gets
/// 127.0.1.1/32 (an address of the loopback range, on the guest's own dummy device).
pub(crate) fn peer_bench(args: &[String]) -> Result {
    crate::serving::PEERS.install()?;
    let quoted: Vec<String> = args.iter().map(|a| format!("'{a}'")).collect();
    let script = format!(
        "ulimit -n 65536; ip addr add 127.0.1.1/32 dev rxenet0 && {}/bin/python python/benches/peer_bench.py {}",
        crate::serving::PEERS.venv,
        quoted.join(" ")
    );
    // The guest's console (the script's figures and summary last) is printed as it runs.
    let run = rxe::run(
        1,
        std::time::Duration::from_secs(3600),
        &["bash".into(), "-c".into(), script],
    )?;
    if run.status != 0 {
        return Err(format!(
            "peer-bench failed in the guest with status {}",
            run.status
        ));
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    fn args(list: &[&str]) -> Vec<String> {
        list.iter().map(|s| s.to_string()).collect()
    }

    #[test]
    fn bench_plan_defaults_to_five_rounds_at_three_sizes() {
        let plan = parse_bench_plan(&[]).unwrap();
        assert_eq!(plan.rounds, 5);
        assert_eq!(plan.sizes, [4096, 65536, 1 << 20]);
    }

    #[test]
    fn bench_plan_takes_rounds_and_sizes() {
        let plan =
            parse_bench_plan(&args(&["--sizes", "65536,1048576", "--rounds", "15"])).unwrap();
        assert_eq!(
            plan,
            BenchPlan {
                rounds: 15,
                sizes: vec![65536, 1 << 20]
            }
        );
    }

    #[test]
    fn bench_plan_names_what_is_wrong() {
        for (bad, names) in [
            (&["--rounds", "0"][..], "--rounds \"0\""),
            (&["--rounds"][..], "--rounds needs a value"),
            (&["--sizes", "64k"][..], "block size \"64k\""),
            (&["--sizes", "0"][..], "block size \"0\""),
            (&["--duration", "3"][..], "unknown option \"--duration\""),
        ] {
            let e = parse_bench_plan(&args(bad)).unwrap_err();
            assert!(e.contains(names), "{bad:?}: {e}");
        }
    }

    #[test]
    fn a_missing_perftest_figure_leaves_its_round_empty() {
        let output = args(&[
            "ROUND 1",
            "SENDLAT 20.5 40.0",
            "MODE reactive",
            "  \"latency_us_p50\": 41.0,",
            "  \"latency_us_p99\": 90.0,",
            "ROUND 2",
            "PERFTEST 18.0 30.0",
            "SENDLAT failed",
            "MODE reactive",
            "  \"latency_us_p50\": 44.0,",
            "  \"latency_us_p99\": 95.0,",
        ]);
        let rounds = latency_rounds(&output);
        assert_eq!(rounds.len(), 2);
        assert_eq!(rounds[0].write_lat, None);
        assert_eq!(rounds[0].send_lat, Some((20.5, 40.0)));
        assert_eq!(rounds[0].engine, [("reactive".to_owned(), 41.0, 90.0)]);
        assert_eq!(rounds[1].write_lat, Some((18.0, 30.0)));
        assert_eq!(rounds[1].send_lat, None);
        assert_eq!(rounds[1].engine, [("reactive".to_owned(), 44.0, 95.0)]);
    }

    #[test]
    fn a_missing_throughput_run_leaves_its_round_empty() {
        let output = args(&[
            "ROUND 1",
            "  \"block_size\": 4096,",
            "  \"throughput_mib_s\": 20.0,",
            "ROUND 2",
            "PERFTEST 4096 25.0",
            "  \"block_size\": 4096,",
            "  \"throughput_mib_s\": 24.0,",
            "PERFTEST 65536 30.0",
        ]);
        let rounds = throughput_rounds(&output);
        assert_eq!(
            rounds[&4096],
            [(Some(20.0), None), (Some(24.0), Some(25.0))]
        );
        assert_eq!(rounds[&65536], [(None, None), (None, Some(30.0))]);
    }
}
