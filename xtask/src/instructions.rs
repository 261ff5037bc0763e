//! `cargo xtask instructions`: the per-operation cost as instruction counts (issue 29), which
//! this noisy shared machine cannot move, unlike timings.
//!
//! Each figure is the difference between two callgrind runs of the same benchmark with
//! different amounts of work, divided by the difference: start-up, engine opening and
//! registration cancel out.
//!
//! - one-way 8-byte write-with-immediate: `transfer-bench --latency N --reactive` (a ping-pong
//!   answered on the worker) on the mock with `spin_us = 0`, N = 5,000 and 10,000 trips, two
//!   writes per trip. Idle workers poll between trips, and how often moves with scheduling:
//!   successive runs differ by up to ~20 %, so compare it only run against run;
//! - one write-with-immediate in a burst: `page-bench --single` (10,000 single 64 B writes
//!   per call, each counted by the receiver's ImmCounter), 10 and 20 calls: the per-write path
//!   from submit to counted arrival — the per-write figure to track. Since the worker posts a
//!   burst in lists it outruns the submitting thread and polls idle between its commands, as
//!   many times as valgrind's thread scheduling lets it: runs of one binary differ by ~±2 %,
//!   so the figure is the median of three;
//! - one page of a paged write: `page-bench` (10,000 pages of 64 B per call, inline in-order
//!   mock), 10 and 20 calls, the median of three. (With 1,000 pages per call, runs of one
//!   binary gave 134 to 177: what the waiting thread and the idle worker execute between
//!   calls, spread over too few pages; with 10,000 they agree.)
//!
//! All include the mock fabric's own work.
//!
//! Where a ping-pong one-way goes (callgrind_annotate of `--latency 10000 --reactive`, 22,000
//! one-ways, 2026-12-06, after the 128-byte command and the worker-local path for what the
//! worker's own wakers submit; ~5,470 each before the division above, which adds the idle
//! passes' share): the mock NIC ~1,220 (post and landing ~1,000, polls ~220); the
//! benchmark's own flag, waker, clock reads and their freeing ~450; the engine ~3,800 —
//! submission through the API ~430, arming the next expectation ~280, acceptance, tracking
//! and statistics ~320, taking the post to the NIC ~370, handling events ~350, counting the
//! arrival into the ImmCounter ~190, delivery around the waker (tracker, statistics, the
//! flag and counter, drained vectors) ~830, and the worker's passes around them the rest.
//! No single step dominates: 3,000 needs the engine's path roughly halved, not trimmed.

use std::process::Command;

use crate::{cargo, ensure_packages, Result};

/// Instructions callgrind counted for `program args`.
fn instructions(program: &str, args: &[&str], envs: &[(&str, &str)]) -> Result<u64> {
    let out_file = std::env::temp_dir().join(format!("xfer-callgrind-{}.out", std::process::id()));
    let status = Command::new("valgrind")
        .arg("--tool=callgrind")
        .arg(format!("--callgrind-out-file={}", out_file.display()))
        .arg(program)
        .args(args)
        .envs(envs.iter().copied())
        .stdout(std::process::Stdio::null())
        .stderr(std::process::Stdio::null())
        .status()
        .map_err(|e| format!("cannot run valgrind: {e}"))?;
    if !status.success() {
        return Err(format!(
            "callgrind of {program} {args:?} failed with {status}"
        ));
    }
    let text = std::fs::read_to_string(&out_file).map_err(|e| e.to_string())?;
    let _ = std::fs::remove_file(&out_file);
    text.lines()
        .find_map(|l| {
            l.strip_prefix("summary: ")
                .or_else(|| l.strip_prefix("totals: "))
        })
        .and_then(|n| n.split_whitespace().next()?.parse().ok())
        .ok_or_else(|| format!("no instruction total in callgrind's output for {program}"))
}

/// Prints the per-write and per-page instruction counts.
pub(crate) fn report() -> Result {
    ensure_packages(&["valgrind"])?;
    cargo(&[
        "build",
        "--quiet",
        "--release",
        "-p",
        "examples",
        "--bin",
        "transfer-bench",
        "--bin",
        "page-bench",
    ])?;
    let config = std::env::temp_dir().join("xfer-instructions-mock.toml");
    std::fs::write(
        &config,
        "backend = \"mock\"\n[[groups]]\nnics = [\"mock0\"]\n[worker]\nspin_us = 0\n",
    )
    .map_err(|e| e.to_string())?;
    let config = config.display().to_string();
    let env = [("XFER_CONFIG", config.as_str())];
    let bench = "target/release/transfer-bench";
    let trips = |n: &str| instructions(bench, &["--latency", n, "--reactive"], &env);
    // Signed: a run of 5,000 trips whose idle workers polled more than in the run of
    // 10,000 costs more than it (the figure is then meaningless, and said so).
    let per_write = (i128::from(trips("10000")?) - i128::from(trips("5000")?)) / 10_000;
    let pages = |calls: &str, mode: &[&str]| {
        let args: Vec<&str> = ["--calls", calls, "--no-reference"]
            .iter()
            .chain(mode)
            .copied()
            .collect();
        instructions("target/release/page-bench", &args, &[])
    };
    // 10,000 per call, the median of three differences: see the module's notes.
    let per_op = |mode: &[&str]| -> Result<u64> {
        let mode: Vec<&str> = ["--pages", "10000"].iter().chain(mode).copied().collect();
        let mut runs = Vec::new();
        for _ in 0..3 {
            runs.push((pages("20", &mode)? - pages("10", &mode)?) / 100_000);
        }
        runs.sort_unstable();
        Ok(runs[1])
    };
    let per_page = per_op(&[])?;
    let per_single = per_op(&["--single"])?;
    println!(
        "xtask instructions: one-way 8-byte write-with-immediate (ping-pong; moves with scheduling): {per_write}"
    );
    println!(
        "xtask instructions: one 64 B write-with-immediate in a burst (10,000 per call), submit to counted arrival: {per_single}"
    );
    println!(
        "xtask instructions: one page of a paged write (64 B pages, 10,000 per call): {per_page}"
    );
    Ok(())
}
