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

mod fixtures;
mod fresh;
mod header;
mod libfabric2;
mod python;
mod rxe;

use std::io::{BufRead, BufReader};
use std::process::{Command, ExitCode, Stdio};

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

/// Builds test target `test` of `package` and returns its executable's path (from cargo's
/// JSON messages; other artifacts, such as binaries the test runs, are skipped).
fn test_executable(package: &str, test: &str) -> Result<String> {
    let program = std::env::var("CARGO").unwrap_or_else(|_| "cargo".into());
    let args = [
        "test",
        "--no-run",
        "--message-format=json",
        "-p",
        package,
        "--test",
        test,
    ];
    let out = Command::new(&program)
        .args(args)
        .stderr(Stdio::inherit())
        .output()
        .map_err(|e| e.to_string())?;
    if !out.status.success() {
        return Err(format!("building test {test} of {package} failed"));
    }
    let wanted = format!("\"kind\":[\"test\"],\"crate_types\":[\"bin\"],\"name\":\"{test}\"");
    String::from_utf8_lossy(&out.stdout)
        .lines()
        .filter(|l| l.contains("\"reason\":\"compiler-artifact\"") && l.contains(&wanted))
        .find_map(|l| {
            let start = l.find("\"executable\":\"")? + "\"executable\":\"".len();
            let end = start + l[start..].find('"')?;
            Some(l[start..end].to_owned())
        })
        .ok_or_else(|| format!("cargo reported no executable for test {test} of {package}"))
}

/// Adds a libtest "test result: ok. N passed; M failed; ..." line to the totals.
fn add_test_result(line: &str, totals: &mut (u64, u64)) {
    let Some(rest) = line.trim().strip_prefix("test result: ") else {
        python::add_pytest_result(line, totals);
        return;
    };
    let count = |word: &str| -> u64 {
        rest.split(';')
            .find_map(|part| {
                part.trim()
                    .strip_suffix(word)?
                    .trim()
                    .rsplit(' ')
                    .next()?
                    .parse()
                    .ok()
            })
            .unwrap_or(0)
    };
    totals.0 += count("passed");
    totals.1 += count("failed");
}

/// The EFA backend's tests (conformance on shm and tcp, and the two-process tests) again,
/// against libfabric 2.x built from Debian 13's source (see `libfabric2.rs`), in a target
/// directory of their own so the 1.17 build is not disturbed.
fn efa_on_libfabric2(totals: &mut (u64, u64)) -> Result {
    let prefix = libfabric2::ensure()?;
    let prefix = prefix.display().to_string();
    let lib = format!("{prefix}/lib");
    let program = std::env::var("CARGO").unwrap_or_else(|_| "cargo".into());
    let envs = [
        ("LIBFABRIC_DIR", prefix.as_str()),
        ("LD_LIBRARY_PATH", lib.as_str()),
        ("XFER_EXPECT_LIBFABRIC", "2."),
        ("CARGO_TARGET_DIR", "target/libfabric2-tests"),
    ];
    counted(&program, &["test", "-p", "backend-efa"], &envs, totals)?;
    counted(
        &program,
        &["test", "-p", "xfer-cli", "--test", "two_process"],
        &envs,
        totals,
    )
}

/// Runs a shell script (`sh -e`) in `dir`.
fn sh_in(dir: &std::path::Path, script: &str) -> Result {
    eprintln!("xtask: (in {}) {script}", dir.display());
    let status = Command::new("sh")
        .args(["-ec", script])
        .current_dir(dir)
        .status()
        .map_err(|e| format!("cannot run sh: {e}"))?;
    if status.success() {
        Ok(())
    } else {
        Err(format!("`{script}` failed with {status}"))
    }
}

/// Where `cargo xtask test` follows docs/plugins.md's C path: an empty directory that gets
/// the header and the example plugin, nothing else from the tree.
const VENDOR_DIR: &str = "target/vendor-from-scratch";

/// Builds the C example plugin as docs/plugins.md tells a vendor to: copy
/// `xfer_plugin.h` and `loopback.c` into an empty directory and run the guide's `cc` line
/// there (warnings as errors). Returns the library's path.
fn build_c_plugin() -> Result<String> {
    let dir = std::path::Path::new(VENDOR_DIR);
    let _ = std::fs::remove_dir_all(dir);
    std::fs::create_dir_all(dir).map_err(|e| e.to_string())?;
    for (from, to) in [
        (header::HEADER, "xfer_plugin.h"),
        ("xfer-plugin/c-example/loopback.c", "loopback.c"),
    ] {
        std::fs::copy(from, dir.join(to)).map_err(|e| format!("copying {from}: {e}"))?;
    }
    // The guide's command, word for word (docs/plugins.md, "C: from an empty directory").
    let guide = std::fs::read_to_string("docs/plugins.md").map_err(|e| e.to_string())?;
    let command = guide
        .lines()
        .skip_while(|l| !l.starts_with("cc "))
        .take_while(|l| !l.starts_with("```"))
        .map(|l| l.trim_end_matches('\\').trim())
        .collect::<Vec<_>>()
        .join(" ");
    if command.is_empty() {
        return Err("docs/plugins.md has no `cc ...` line to build the C plugin with".into());
    }
    sh_in(dir, &command)?;
    Ok(format!("{VENDOR_DIR}/libxfer_loopback.so"))
}

/// The plugin kit as a vendor uses it: the header is not stale, the C example plugin builds
/// from it in an empty directory with the guide's command, and `xfer conformance` passes on
/// it and on the mock's plugin (both through dlopen).
fn plugin_kit(totals: &mut (u64, u64)) -> Result {
    header::header(true)?;
    // `cargo test` leaves the mock's cdylib in target/debug/deps only; a build of the
    // library puts it where a vendor's path would point (a fresh root had none there).
    cargo(&["build", "--quiet", "-p", "backend-mock", "--lib"])?;
    cargo(&["build", "--quiet", "-p", "xfer-cli", "--bin", "xfer"])?;
    let c_plugin = build_c_plugin()?;
    for (plugin, nics) in [
        (c_plugin.as_str(), ["lo0", "lo1", "lo2", "lo3"]),
        (
            "target/debug/libbackend_mock.so",
            ["mock0", "mock1", "mock2", "mock3"],
        ),
    ] {
        let mut args = vec!["conformance", "--plugin", plugin];
        for nic in &nics {
            args.extend(["--nic", nic]);
        }
        counted("target/debug/xfer", &args, &[], totals)?;
    }
    Ok(())
}

/// Runs `cargo test ...`, echoing its output, and adds up its "test result" lines.
fn cargo_test(args: &[&str], totals: &mut (u64, u64)) -> Result {
    let program = std::env::var("CARGO").unwrap_or_else(|_| "cargo".into());
    counted(&program, args, &[], totals)
}

/// Runs a test program (or cargo), echoing its output and adding up its "test result" lines.
fn counted(program: &str, args: &[&str], envs: &[(&str, &str)], totals: &mut (u64, u64)) -> Result {
    let shown: Vec<String> = envs.iter().map(|(k, v)| format!("{k}={v}")).collect();
    eprintln!("xtask: {} {program} {}", shown.join(" "), args.join(" "));
    let mut child = Command::new(program)
        .args(args)
        .envs(envs.iter().copied())
        .stdout(Stdio::piped())
        .spawn()
        .map_err(|e| format!("cannot run {program}: {e}"))?;
    let stdout = child.stdout.take().expect("stdout is piped");
    for line in BufReader::new(stdout).lines() {
        let line = line.map_err(|e| e.to_string())?;
        println!("{line}");
        add_test_result(&line, totals);
    }
    let status = child.wait().map_err(|e| e.to_string())?;
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
];

/// The failure schedules CI runs (each a few milliseconds; a failure names its seed).
const CI_SCHEDULES: &str = "3000";

/// The mock's conformance suite (statically linked, and loaded through dlopen) under valgrind
/// memcheck: any error fails. `striping` moves hundreds of megabytes and takes many minutes
/// under memcheck; it runs natively with everything else.
fn memcheck(totals: &mut (u64, u64)) -> Result {
    for test in ["conformance", "plugin_conformance"] {
        let exe = test_executable("backend-mock", test)?;
        counted(
            "valgrind",
            &[
                "--error-exitcode=99",
                "--leak-check=no",
                "-q",
                &exe,
                "--test-threads",
                "2",
                "--skip",
                "striping",
            ],
            // Memcheck runs the code tens of times slower: deadlines for that, not 2 s.
            &[(CONFORMANCE_DEADLINE_ENV, "20000")],
            totals,
        )?;
    }
    Ok(())
}

/// `engine_core::conformance::DEADLINE_ENV` (xtask does not link engine-core): the
/// conformance suite's short deadlines, raised for runs under valgrind or ASan.
const CONFORMANCE_DEADLINE_ENV: &str = "XFER_CONFORMANCE_DEADLINE_MS";

/// Whether `cargo +nightly` works here (sanitizers and fuzzing need it).
fn nightly_available() -> bool {
    Command::new("cargo")
        .args(["+nightly", "--version"])
        .output()
        .is_ok_and(|o| o.status.success())
}

/// Seconds each fuzz target runs in `cargo xtask test`.
const FUZZ_SECONDS: u32 = 20;

/// The fuzz targets (`fuzz/`: every decoder of untrusted input) built with libFuzzer and
/// AddressSanitizer on nightly, each run for a bounded time; any crash fails, and the input
/// that caused it is left in `fuzz/artifacts/<target>/`. Skipped with the reason where nightly
/// is absent. `cargo xtask fuzz [SECONDS]` runs them alone.
fn fuzz(seconds: u32, totals: &mut (u64, u64)) -> Result {
    if !nightly_available() {
        println!("xtask: fuzzing skipped: no nightly toolchain (`cargo +nightly` fails)");
        return Ok(());
    }
    // What cargo-fuzz passes, without needing cargo-fuzz installed.
    let flags = [
        "-Cpasses=sancov-module",
        "-Cllvm-args=-sanitizer-coverage-level=4",
        "-Cllvm-args=-sanitizer-coverage-inline-8bit-counters",
        "-Cllvm-args=-sanitizer-coverage-pc-table",
        "-Cllvm-args=-sanitizer-coverage-trace-compares",
        "--cfg",
        "fuzzing",
        "-Zsanitizer=address",
        "-Cdebug-assertions",
        "-Coverflow-checks",
    ]
    .join(" ");
    let status = Command::new("cargo")
        .args([
            "+nightly",
            "build",
            "--release",
            "--quiet",
            "--manifest-path",
            "fuzz/Cargo.toml",
            "--target",
            "x86_64-unknown-linux-gnu",
            "--target-dir",
            "target/fuzz",
        ])
        .env("RUSTFLAGS", flags)
        .status()
        .map_err(|e| format!("cannot run cargo +nightly: {e}"))?;
    if !status.success() {
        return Err("building the fuzz targets failed".into());
    }
    for target in ["netaddr", "mrdesc", "handshake", "config"] {
        let corpus = format!("fuzz/corpus/{target}");
        let artifacts = format!("fuzz/artifacts/{target}/");
        std::fs::create_dir_all(&corpus).map_err(|e| e.to_string())?;
        std::fs::create_dir_all(&artifacts).map_err(|e| e.to_string())?;
        let exe = format!("target/fuzz/x86_64-unknown-linux-gnu/release/{target}");
        eprintln!("xtask: {exe} -max_total_time={seconds} {corpus}");
        // libFuzzer is chatty: keep its output, show the summary (all of it on a crash).
        let out = Command::new(&exe)
            .args([
                &format!("-max_total_time={seconds}"),
                &format!("-artifact_prefix={artifacts}"),
                &corpus,
            ])
            .output()
            .map_err(|e| format!("cannot run {exe}: {e}"))?;
        let log = String::from_utf8_lossy(&out.stderr);
        if out.status.success() {
            totals.0 += 1;
            let runs = log
                .lines()
                .rev()
                .find(|l| l.starts_with("Done "))
                .unwrap_or("done");
            println!("xtask: fuzz target {target}: no crash ({runs})");
        } else {
            totals.1 += 1;
            let tail: Vec<&str> = log.lines().rev().take(60).collect();
            for line in tail.into_iter().rev() {
                eprintln!("{line}");
            }
            return Err(format!(
                "fuzz target {target} crashed ({}); the input is in {artifacts}",
                out.status
            ));
        }
    }
    Ok(())
}

/// The mock's conformance and failure-path suites under AddressSanitizer, where the nightly
/// toolchain is installed (built in its own target directory); skipped with the reason where
/// it is not.
fn address_sanitizer(totals: &mut (u64, u64)) -> Result {
    if !nightly_available() {
        println!(
            "xtask: AddressSanitizer run skipped: no nightly toolchain (`cargo +nightly` fails)"
        );
        return Ok(());
    }
    counted(
        "cargo",
        &[
            "+nightly",
            "test",
            "-p",
            "backend-mock",
            "--test",
            "conformance",
            "--test",
            "failure_paths",
            "--target",
            "x86_64-unknown-linux-gnu",
            "--target-dir",
            "target/asan",
        ],
        &[
            ("RUSTFLAGS", "-Zsanitizer=address"),
            (CONFORMANCE_DEADLINE_ENV, "20000"),
            ("ASAN_OPTIONS", "detect_leaks=0"),
        ],
        totals,
    )
}

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

fn test() -> Result {
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
        memcheck(&mut totals)?;
        address_sanitizer(&mut totals)?;
        fuzz(FUZZ_SECONDS, &mut totals)?;
        python::test(&mut totals)
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
    multi_process_examples()?;
    let script = format!(
        "{cli_tests} --ignored && {verbs_tests} --ignored --test-threads 1 && {verbs_tests} --ignored --test-threads 1 \
         && {two_process} --ignored --test-threads 1 \
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

/// Shell that starts `xfer serve` on `listen` in the background and returns once it says it
/// listens (its ready file), failing after two minutes: a client must never find it not up
/// yet because a fixed pause was too short. The service is slowed by 3 s on purpose, so the
/// wait is exercised on every run (the clients also ride out a service that is not up yet,
/// but the harness must not depend on that).
fn serve_in_guest(listen: &str) -> String {
    format!(
        "{{ ready=$(mktemp -u /tmp/xfer-serve-ready.XXXXXX); \
           target/debug/xfer serve --listen {listen} --delay-listen-ms 3000 --ready-file $ready >/dev/null & \
           for i in $(seq 1200); do [ -s $ready ] && break; sleep 0.1; done; \
           [ -s $ready ] && echo \"xfer serve is up: $(cat $ready)\" || {{ echo 'xfer serve did not become ready within 120 s'; false; }}; }}"
    )
}

/// The examples as separate processes meeting through a rendezvous: through `xfer serve`
/// transfer-bench's initiator and target (shm), the KV cache (shm, tcp; over verbs the rxe
/// guest runs it) and weight sync (shm); through etcd the KV cache (shm) and MoE
/// dispatch/combine (tcp). `cargo xtask examples`; `test` runs it too.
fn multi_process_examples() -> Result {
    ensure_packages(PACKAGES)?;
    let bins = [
        "kv_cache",
        "rl_weight_sync",
        "moe_dispatch",
        "transfer-bench",
    ];
    // With the etcd client (its build needs protoc, from PACKAGES).
    let mut args = vec!["build", "--quiet", "-p", "examples", "--features", "etcd"];
    for bin in &bins {
        args.extend(["--bin", bin]);
    }
    args.extend(["-p", "xfer-cli", "--bin", "xfer"]);
    cargo(&args)?;
    // The backends the configs name, as the plugins the examples load: their cdylibs, built
    // by a command of their own (with `--bin` filters cargo builds only binaries, and cargo
    // test builds these crates only as rlibs: a fresh root had no libbackend_efa.so).
    build_plugins(false)?;
    example_processes(
        "transfer-bench",
        &[
            &["--mode", "target", "--block-size", "4096,65536"],
            &[
                "--mode",
                "initiator",
                "--block-size",
                "4096,65536",
                "--verify",
                "--duration",
                "0.2",
            ],
        ],
        "configs/efa-shm.toml",
        false,
    )?;
    let roles: [&[&str]; 2] = [&["--role", "decode"], &["--role", "prefill"]];
    for config in ["configs/efa-shm.toml", "configs/efa-tcp.toml"] {
        example_processes("kv_cache", &roles, config, false)?;
    }
    // The same through etcd.
    example_processes("kv_cache", &roles, "configs/efa-shm.toml", true)?;
    let three = |r: &'static str| -> [&'static str; 4] { ["--rank", r, "--world", "3"] };
    let (r1, r2, r0) = (three("1"), three("2"), three("0"));
    example_processes(
        "moe_dispatch",
        &[&r1, &r2, &r0],
        "configs/efa-tcp.toml",
        true,
    )?;
    example_processes(
        "rl_weight_sync",
        &[&r1, &r2, &r0],
        "configs/efa-shm.toml",
        false,
    )
}

/// Builds the efa and verbs backends' plugin libraries (cdylibs) in `target/debug` or
/// `target/release`.
pub(crate) fn build_plugins(release: bool) -> Result {
    let mut args = vec![
        "build",
        "--quiet",
        "-p",
        "backend-efa",
        "-p",
        "backend-verbs",
    ];
    if release {
        args.push("--release");
    }
    cargo(&args)
}

/// A rendezvous service for the multi-process examples on 127.0.0.1, stopped (and its data
/// removed) when dropped: the embedded one (`xfer serve` on a free port) or etcd (free ports,
/// a temporary data directory).
struct RendezvousService {
    child: std::process::Child,
    url: String,
    data: Option<std::path::PathBuf>,
}

fn free_port() -> Result<u16> {
    std::net::TcpListener::bind("127.0.0.1:0")
        .and_then(|l| l.local_addr())
        .map(|a| a.port())
        .map_err(|e| format!("no free port: {e}"))
}

impl RendezvousService {
    fn embedded() -> Result<Self> {
        let mut child = Command::new("target/debug/xfer")
            .args(["serve", "--listen", "127.0.0.1:0"])
            .stdout(Stdio::piped())
            .spawn()
            .map_err(|e| format!("cannot start xfer serve: {e}"))?;
        let mut url = String::new();
        BufReader::new(child.stdout.take().expect("piped"))
            .read_line(&mut url)
            .map_err(|e| e.to_string())?;
        Ok(Self {
            child,
            url: url.trim().to_owned(),
            data: None,
        })
    }

    fn etcd() -> Result<Self> {
        let (client, peer) = (free_port()?, free_port()?);
        let data = std::env::temp_dir().join(format!("xtask-etcd-{}", std::process::id()));
        let client_url = format!("http://127.0.0.1:{client}");
        let peer_url = format!("http://127.0.0.1:{peer}");
        let child = Command::new("etcd")
            .args(["--name", "xtask", "--log-level", "error", "--data-dir"])
            .arg(&data)
            .args([
                "--listen-client-urls",
                &client_url,
                "--advertise-client-urls",
                &client_url,
            ])
            .args([
                "--listen-peer-urls",
                &peer_url,
                "--initial-advertise-peer-urls",
                &peer_url,
            ])
            .args(["--initial-cluster", &format!("xtask={peer_url}")])
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .spawn()
            .map_err(|e| format!("cannot start etcd (Debian package etcd-server): {e}"))?;
        let service = Self {
            child,
            url: format!("etcd://127.0.0.1:{client}/xtask"),
            data: Some(data),
        };
        // Ready when etcd says it is healthy (a member that listens may not have elected
        // itself leader yet), not when its port accepts.
        let deadline = std::time::Instant::now() + std::time::Duration::from_secs(60);
        while !etcd_healthy(client) {
            if std::time::Instant::now() > deadline {
                return Err(format!("etcd on {client_url} was not healthy within 60 s"));
            }
            std::thread::sleep(std::time::Duration::from_millis(100));
        }
        Ok(service)
    }
}

/// Whether etcd on 127.0.0.1:`port` answers its `/health` endpoint with health "true".
fn etcd_healthy(port: u16) -> bool {
    use std::io::{Read, Write};
    let Ok(mut conn) = std::net::TcpStream::connect(("127.0.0.1", port)) else {
        return false;
    };
    let _ = conn.set_read_timeout(Some(std::time::Duration::from_secs(2)));
    let mut answer = String::new();
    conn.write_all(b"GET /health HTTP/1.0\r\nHost: 127.0.0.1\r\n\r\n")
        .and_then(|()| conn.read_to_string(&mut answer))
        .is_ok()
        && is_healthy(&answer)
}

/// Whether an HTTP answer from etcd's `/health` says healthy (`{"health":"true",…}`).
fn is_healthy(answer: &str) -> bool {
    answer.starts_with("HTTP/1.") && answer.contains("200") && answer.contains(r#""health":"true""#)
}

impl Drop for RendezvousService {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
        if let Some(d) = &self.data {
            let _ = std::fs::remove_dir_all(d);
        }
    }
}

/// An example as several processes that find each other through a rendezvous (`etcd`, or
/// the embedded service), with backend `config`: one process per argument list, the last run
/// in the foreground once the others are started.
fn example_processes(example: &str, members: &[&[&str]], config: &str, etcd: bool) -> Result {
    let service = if etcd {
        RendezvousService::etcd()?
    } else {
        RendezvousService::embedded()?
    };
    let url = service.url.clone();
    let plugins = std::env::current_dir()
        .map_err(|e| e.to_string())?
        .join("target/debug");
    let member = |args: &[&str]| {
        let mut c = Command::new(format!("target/debug/{example}"));
        c.args(args)
            .args(["--rendezvous", &url, "--config", config])
            .env("XFER_PLUGIN_PATH", &plugins);
        c
    };
    eprintln!(
        "xtask: {example} as {} processes over {config}, rendezvous {url}",
        members.len()
    );
    let result = (|| {
        let (last, others) = members.split_last().ok_or("no members")?;
        let mut background = Vec::new();
        for args in others {
            background.push(
                member(args)
                    .spawn()
                    .map_err(|e| format!("cannot start {example}: {e}"))?,
            );
        }
        let mut failed = Vec::new();
        let status = member(last).status().map_err(|e| e.to_string())?;
        if !status.success() {
            failed.push(format!("{last:?}: {status}"));
        }
        for (args, mut child) in others.iter().zip(background) {
            let status = child.wait().map_err(|e| e.to_string())?;
            if !status.success() {
                failed.push(format!("{args:?}: {status}"));
            }
        }
        if failed.is_empty() {
            Ok(())
        } else {
            Err(format!("{example} over {config}: {}", failed.join(", ")))
        }
    })();
    drop(service);
    result
}

/// The EFA backend's benchmark on shm: loopback next to a raw libfabric loop in the same run,
/// then initiator and target in two processes.
/// `bench-efa [--libfabric2] [transfer-bench args]`: the EFA backend on shm next to a raw
/// libfabric loop (3 alternating rounds per size, batch 1 and 16; the median ratio with its
/// spread), then initiator and target in two processes. `--libfabric2`: against libfabric
/// 2.x built from Debian 13's source (see `libfabric2.rs`) instead of the system's 1.17.
fn bench_efa(args: &[String]) -> Result {
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
fn rxe_command(args: &[String]) -> Result {
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
fn gpu_check() -> Result {
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
        echo \"gpu-check exit $s1 (device_mapped) $s4 (gpu_gdrcopy; fails where GDRCopy is not installed), pass cost exit $s5 $s6, watcher-latency exit $s2, kv_cache --gpu exit $s3\"\n\
        exit $(( s1 | s2 | s3 | s5 ))\n";
    std::fs::write(dir.join("run.sh"), script).map_err(|e| e.to_string())?;
    println!(
        "prepared {}: run `bash .gpu-check/run.sh` on the GPU machine (carry `.gpu-check`)",
        dir.display()
    );
    Ok(())
}

/// What both rxe benchmarks need: the guest's packages and transfer-bench with verbs.
fn build_rxe_bench() -> Result {
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
fn json_number(line: &str, name: &str) -> Option<f64> {
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
fn rxe_latency() -> Result {
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
struct LatencyRound {
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
fn latency_rounds(output: &[String]) -> Vec<LatencyRound> {
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
fn throughput_rounds(output: &[String]) -> std::collections::BTreeMap<u64, Vec<PairMibS>> {
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
fn slot(
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
struct BenchPlan {
    rounds: u32,
    sizes: Vec<u64>,
}

/// Parses `[--rounds N] [--sizes A,B,...]` (defaults: five rounds at 4 KiB, 64 KiB and 1 MiB).
/// More rounds narrow the median where one round's ratio swings ±30 % under emulation.
fn parse_bench_plan(args: &[String]) -> Result<BenchPlan> {
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
fn rxe_bench(op: &str, options: &[String]) -> Result {
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

fn bench(extra: &[String]) -> Result {
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
        Some("python") => python::install(),
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
        Some("fixtures") => fixtures::write_all(std::path::Path::new("engine-core/tests/fixtures/sysfs")).map_err(|e| e.to_string()),
        _ => Err("usage: cargo xtask test | fresh | bench [transfer-bench args] | bench-efa [transfer-bench args]".into()),
    };
    match result {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("xtask: {e}");
            ExitCode::FAILURE
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn args(list: &[&str]) -> Vec<String> {
        list.iter().map(|s| s.to_string()).collect()
    }

    #[test]
    fn etcd_health_is_read_from_its_answer() {
        let ok = "HTTP/1.0 200 OK\r\nContent-Type: text/plain\r\n\r\n{\"health\":\"true\",\"reason\":\"\"}";
        assert!(is_healthy(ok));
        let no_leader = "HTTP/1.0 503 Service Unavailable\r\n\r\n{\"health\":\"false\",\"reason\":\"RAFT NO LEADER\"}";
        assert!(!is_healthy(no_leader));
        assert!(!is_healthy(""));
    }

    /// Issue 23: a service started in the background is waited for by what it says, never
    /// by a fixed pause; this keeps the pattern from coming back to the harness, CI or the
    /// examples.
    #[test]
    fn no_fixed_pause_follows_a_background_start() {
        let root = std::path::Path::new(env!("CARGO_MANIFEST_DIR"))
            .parent()
            .unwrap();
        let mut files = vec![root.join(".ci/run")];
        for dir in ["xtask/src", "examples/src", "examples/src/bin"] {
            for entry in std::fs::read_dir(root.join(dir)).unwrap() {
                let path = entry.unwrap().path();
                if path.extension().is_some_and(|e| e == "rs" || e == "sh") {
                    files.push(path);
                }
            }
        }
        let needle = ["&", "sleep"];
        for file in files {
            let text = std::fs::read_to_string(&file).unwrap();
            for (n, line) in text.lines().enumerate() {
                let squeezed: String = line.split_whitespace().collect::<Vec<_>>().join(" ");
                assert!(
                    !squeezed.contains(&needle.join(" ")),
                    "{}:{}: a background start followed by a fixed pause: {line}",
                    file.display(),
                    n + 1
                );
            }
        }
        let script = serve_in_guest("127.0.0.1:7421");
        assert!(script.contains("--ready-file $ready") && script.contains("[ -s $ready ]"));
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
