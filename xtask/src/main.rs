//! `cargo xtask <command>`: the project's own runner. Installs what a command needs (Debian
//! packages) when it is missing, so a fresh Debian 12 machine with Rust runs everything.
//!
//! - `test`: format and lint checks, the whole test suite, the example workloads, and a short
//!   verified run of the bench — what CI runs.
//! - `bench`: the mock benchmark sweep in release mode (extra arguments go to transfer-bench).
//! - `rxe [--nics N] [--timeout S] -- <command>`: runs a command next to N soft-RoCE devices
//!   in a qemu guest (see `rxe.rs`).
//! - `rxe-bench [write|read|lat] [--rounds N] [--sizes A,B,..]`: the verbs backend next to
//!   perftest's `ib_write_bw`, `ib_read_bw` or `ib_write_lat` on the same rxe device.
//! - `gpu-check`: builds the GPU check and a script for a machine with an NVIDIA GPU.
//! - `fresh`: `test` in a clean Debian 12 root built with debootstrap (what CI runs; see
//!   `fresh.rs`), so a missing install step fails here as it would on a new machine.
//! - `fuzz [SECONDS]`: the decoders' fuzz targets (`fuzz/`), with libFuzzer on nightly.
//! - `examples`: the example workloads as separate processes meeting through the rendezvous.
//! - `python`: builds the Python package with its plugins and installs it into
//!   `target/python-venv` (what `test` does before running the pytest suite).
//! - `instructions`: instructions per one-way write and per page of a paged write (callgrind).
//! - `vllm`, `sglang`: install the framework (from a wheel cache outside the checkout) and the
//!   package into `target/<name>-venv` and run its connector's tests (`test` runs both).
//! - `fixtures`: rewrites the sysfs fixture trees of the topology tests.
//! - `efa-libfabric2`: the EFA backend's tests against libfabric 2.x built from Debian 13's
//!   source (part of `test`; see `libfabric2.rs`).
//! - `plugin-kit`: the header is current, the C example plugin builds as docs/plugins.md
//!   says (in an empty directory), and `xfer conformance` passes on it and on the mock's
//!   plugin (part of `test`).
//! - `header [--check]`: writes (or checks) the plugin ABI's C header from the Rust
//!   definitions (see `header.rs`).
//! - `bench-efa [--libfabric2]`: the EFA backend on libfabric's shm provider, next to a raw libfabric write
//!   loop, then initiator and target in two processes.

#![forbid(unsafe_code)]

mod bench;
mod checks;
mod examples;
mod fixtures;
mod fresh;
mod gpu_fakes;
mod header;
mod instructions;
mod libfabric2;
mod python;
mod rxe;
mod serving;

use std::io::{BufRead, BufReader};
use std::process::{Command, ExitCode, Stdio};

use bench::*;
use checks::*;
use examples::*;

type Result<T = ()> = std::result::Result<T, String>;

fn run(program: &str, args: &[&str]) -> Result {
    run_with(program, args, &[])
}

/// [`run`] with extra environment variables.
fn run_with(program: &str, args: &[&str], envs: &[(String, String)]) -> Result {
    eprintln!("xtask: {program} {}", args.join(" "));
    let status = Command::new(program)
        .args(args)
        .envs(envs.iter().map(|(k, v)| (k, v)))
        .status()
        .map_err(|e| format!("cannot run {program}: {e}"))?;
    if status.success() {
        Ok(())
    } else {
        Err(format!(
            "`{program} {}` failed with {status}",
            args.join(" ")
        ))
    }
}

fn cargo(args: &[&str]) -> Result {
    run(
        &std::env::var("CARGO").unwrap_or_else(|_| "cargo".into()),
        args,
    )
}

/// System packages the workspace builds and tests against: libfabric (backend-efa's ofi-sys
/// links it; its shm and tcp providers run the EFA backend's tests) and libibverbs
/// (backend-verbs' verbs-sys links it; soft-RoCE in the qemu guest runs its tests).
const PACKAGES: &[&str] = &[
    "build-essential",
    "pkg-config",
    "libfabric-dev",
    "libfabric-bin",
    "libibverbs-dev",
    // Runs the mock's conformance suite under memcheck.
    "valgrind",
    // The rendezvous' etcd client (etcd-client compiles etcd's protos with protoc, which
    // needs the well-known types), and etcd itself, which its suite starts on 127.0.0.1.
    "protobuf-compiler",
    "libprotobuf-dev",
    "etcd-server",
    // Makes the certificates of the etcd-over-TLS test at test time.
    "openssl",
];

/// Installs the Debian packages that are not installed yet (needs root, as on CI).
fn ensure_packages(packages: &[&str]) -> Result {
    let missing: Vec<&str> = packages
        .iter()
        .copied()
        .filter(|p| {
            !Command::new("dpkg")
                .args(["-s", p])
                .output()
                .is_ok_and(|o| o.status.success())
        })
        .collect();
    if missing.is_empty() {
        return Ok(());
    }
    run("apt-get", &["update", "-q"])?;
    let mut args = vec!["install", "-y", "-q", "--no-install-recommends"];
    args.extend(&missing);
    run("apt-get", &args)
}

/// Removes what libfabric's shm provider left in /dev/shm for processes that are gone (a
/// killed test process keeps its `<pid>:<n>:<n>` regions): a later process that gets the same
/// pid fails to open shm with EBUSY. Only entries of pids that no longer exist are touched.
fn remove_stale_shm_regions() {
    let Ok(entries) = std::fs::read_dir("/dev/shm") else {
        return;
    };
    for entry in entries.flatten() {
        let name = entry.file_name();
        let Some((pid, _)) = name.to_str().and_then(|n| n.split_once(':')) else {
            continue;
        };
        if pid.parse::<u32>().is_ok() && !std::path::Path::new("/proc").join(pid).exists() {
            let _ = std::fs::remove_file(entry.path());
        }
    }
}

fn test() -> Result {
    remove_stale_shm_regions();
    ensure_packages(PACKAGES)?;
    ensure_packages(rxe::PACKAGES)?;
    cargo(&["fmt", "--all", "--", "--check"])?;
    cargo(&[
        "clippy",
        "--workspace",
        "--all-targets",
        "--all-features",
        "--",
        "-D",
        "warnings",
    ])?;
    let mut totals = (0, 0);
    let tests = cargo_test(&["test", "--workspace"], &mut totals).and_then(|()| {
        let program = std::env::var("CARGO").unwrap_or_else(|_| "cargo".into());
        counted(
            &program,
            &["test", "-p", "backend-mock", "--test", "schedules"],
            &[("XFER_SCHEDULES", CI_SCHEDULES)],
            &mut totals,
        )?;
        // The rendezvous suite against a real etcd too (the workspace run covered the
        // embedded service; this one fails if etcd is missing rather than skipping it).
        counted(
            &program,
            &["test", "-p", "xfer-rendezvous", "--features", "etcd"],
            &[("XFER_REQUIRE_ETCD", "1")],
            &mut totals,
        )?;
        plugin_kit(&mut totals)?;
        efa_on_libfabric2(&mut totals)?;
        gpu_fakes::test(&mut totals)?;
        memcheck(&mut totals)?;
        address_sanitizer(&mut totals)?;
        fuzz(FUZZ_SECONDS, &mut totals)?;
        python::test(&mut totals)?;
        serving::VLLM.test(&mut totals)?;
        serving::SGLANG.test(&mut totals)
    });
    // The plain closing line CI readers look for, whatever happens next.
    println!("xtask test: {} passed, {} failed", totals.0, totals.1);
    tests?;
    // Real soft-RoCE devices in a qemu guest: topology and doctor, and the verbs backend's
    // conformance suite, on them — twice: its wake-up path (completion channel, parking
    // workers) depends on timing, and a lost wake-up once passed five runs in a row before
    // failing two of four. The test binary is
    // built here and run there directly (cargo in the guest could decide to rebuild under
    // emulation, with other feature unification than the workspace build).
    let cli_tests = test_executable("xfer-cli", "cli")?;
    let two_process = test_executable("xfer-cli", "two_process")?;
    let verbs_tests = test_executable("backend-verbs", "conformance_rxe")?;
    let gpu_on_rxe = test_executable("backend-verbs", "fake_gpu_rxe")?;
    let fakes = gpu_fakes::build()?.display().to_string();
    multi_process_examples()?;
    let script = format!(
        "{cli_tests} --ignored && {verbs_tests} --ignored --test-threads 1 && {verbs_tests} --ignored --test-threads 1 \
         && {two_process} --ignored --test-threads 1 \
         && LD_LIBRARY_PATH={fakes} XFER_GPU_FAKES={fakes} {gpu_on_rxe} --ignored \
         && {venv}/bin/python -m pytest -q -p no:cacheprovider python/tests/test_two_process.py -k verbs \
         && {serve} \
         && {{ XFER_PLUGIN_PATH=$PWD/target/debug target/debug/kv_cache --role decode --rendezvous xfer://127.0.0.1:7421 --config configs/verbs-rxe0.toml & d=$!; }} \
         && XFER_PLUGIN_PATH=$PWD/target/debug target/debug/kv_cache --role prefill --rendezvous xfer://127.0.0.1:7421 --config configs/verbs-rxe0.toml && wait $d",
        venv = python::VENV,
        serve = serve_in_guest("127.0.0.1:7421"),
    );
    let guest = rxe::run(
        2,
        std::time::Duration::from_secs(1200),
        &["bash".into(), "-c".into(), script],
    )?;
    guest
        .output
        .iter()
        .for_each(|l| add_test_result(l, &mut totals));
    if guest.status != 0 {
        return Err(format!(
            "the tests in the rxe guest failed with status {}",
            guest.status
        ));
    }
    cargo(&["doc", "--workspace", "--no-deps", "--quiet"])?;
    for example in ["kv_cache", "rl_weight_sync", "moe_dispatch"] {
        cargo(&["run", "--quiet", "-p", "examples", "--bin", example])?;
    }
    cargo(&[
        "run", "--quiet", "-p", "examples", "--bin", "kv_cache", "--", "--pull",
    ])?;
    cargo(&[
        "run",
        "--quiet",
        "-p",
        "examples",
        "--bin",
        "transfer-bench",
        "--",
        "--op",
        "read",
        "--verify",
        "--duration",
        "0.2",
        "--no-imm-rate",
    ])?;
    cargo(&[
        "run",
        "--quiet",
        "-p",
        "examples",
        "--bin",
        "transfer-bench",
        "--",
        "--verify",
        "--duration",
        "0.2",
    ])?;
    println!("xtask test: {} passed, {} failed", totals.0, totals.1);
    Ok(())
}

fn main() -> ExitCode {
    let args: Vec<String> = std::env::args().skip(1).collect();
    let result = match args.first().map(String::as_str) {
        Some("test") => test(),
        Some("fresh") => fresh::fresh(),
        Some("fuzz") => {
            let seconds = args.get(1).and_then(|s| s.parse().ok()).unwrap_or(60);
            fuzz(seconds, &mut (0, 0))
        }
        Some("bench") => bench(&args[1..]),
        Some("bench-efa") => bench_efa(&args[1..]),
        Some("rxe") => rxe_command(&args[1..]),
        Some("rxe-bench") => rxe_bench(
            args.get(1).map_or("write", String::as_str),
            args.get(2..).unwrap_or_default(),
        ),
        Some("gpu-check") => gpu_check(),
        Some("gpu-coverage") => gpu_fakes::coverage(),
        Some("gpu-fakes") => {
            let mut totals = (0, 0);
            let r = gpu_fakes::test(&mut totals);
            println!("gpu-fakes: {} passed, {} failed", totals.0, totals.1);
            r
        }
        Some("python") => python::install(),
        Some("instructions") => instructions::report(),
        Some("peer-bench") => bench::peer_bench(&args[1..]),
        Some(name @ ("vllm" | "sglang")) => {
            let framework = if name == "vllm" { serving::VLLM } else { serving::SGLANG };
            let mut totals = (0, 0);
            let result = framework.test(&mut totals);
            println!("xtask {name}: {} passed, {} failed", totals.0, totals.1);
            result
        }
        Some("examples") => multi_process_examples(),
        Some("efa-libfabric2") => {
            let mut totals = (0, 0);
            let result = efa_on_libfabric2(&mut totals);
            println!("xtask efa-libfabric2: {} passed, {} failed", totals.0, totals.1);
            result
        }
        Some("plugin-kit") => {
            let mut totals = (0, 0);
            let result = plugin_kit(&mut totals);
            println!("xtask plugin-kit: {} passed, {} failed", totals.0, totals.1);
            result
        }
        Some("header") => header::header(args.get(1).is_some_and(|a| a == "--check")),
        Some("fixtures") => fixtures::write_all(std::path::Path::new("topology/tests/fixtures/sysfs")).map_err(|e| e.to_string()),
        _ => Err("usage: cargo xtask test | fresh | bench [transfer-bench args] | bench-efa [transfer-bench args] | peer-bench [peer_bench.py args]".into()),
    };
    match result {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("xtask: {e}");
            ExitCode::FAILURE
        }
    }
}
