//! The suites `cargo xtask test` runs besides `cargo test --workspace`: the plugin kit as a
//! vendor meets it, the EFA backend on libfabric 2, memcheck, AddressSanitizer and fuzzing,
//! and the counting of every runner's results into the closing line CI reads.

use super::*;

/// Builds test target `test` of `package` and returns its executable's path (from cargo's
/// JSON messages; other artifacts, such as binaries the test runs, are skipped).
pub(crate) fn test_executable(package: &str, test: &str) -> Result<String> {
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
pub(crate) fn add_test_result(line: &str, totals: &mut (u64, u64)) {
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
pub(crate) fn efa_on_libfabric2(totals: &mut (u64, u64)) -> Result {
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
pub(crate) fn sh_in(dir: &std::path::Path, script: &str) -> Result {
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
pub(crate) const VENDOR_DIR: &str = "target/vendor-from-scratch";

/// Builds the C example plugin as docs/plugins.md tells a vendor to: copy
/// `xfer_plugin.h` and `loopback.c` into an empty directory and run the guide's `cc` line
/// there (warnings as errors). Returns the library's path.
pub(crate) fn build_c_plugin() -> Result<String> {
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

/// The code block of `lang` that follows the first line starting with `after` in `text`.
fn block_after(text: &str, after: &str, lang: &str) -> Result<String> {
    let rest = text
        .split_once(&format!("\n{after}"))
        .map(|(_, r)| r)
        .ok_or_else(|| format!("docs/plugins.md has no line starting with {after:?}"))?;
    let body = rest
        .split_once(&format!("```{lang}\n"))
        .map(|(_, b)| b)
        .and_then(|b| b.split_once("\n```").map(|(code, _)| code))
        .ok_or_else(|| format!("docs/plugins.md has no ```{lang} block after {after:?}"))?;
    Ok(format!("{body}\n"))
}

/// Follows docs/plugins.md's Rust path from an empty directory, verbatim: its `Cargo.toml`
/// (with the guide's offline recipe — path dependencies on this checkout — for its git
/// ones), `src/lib.rs` and `tests/conformance.rs`; builds the plugin offline and runs the
/// suite both ways the guide shows — the crate's `cargo test` and `xfer conformance` on two
/// NICs — each of which must pass (issue 26: the guide's snippets needed hidden lines to
/// compile, then its plugin refused every transfer).
pub(crate) fn rust_guide_builds(totals: &mut (u64, u64)) -> Result {
    let guide = std::fs::read_to_string("docs/plugins.md").map_err(|e| e.to_string())?;
    let root = std::env::current_dir().map_err(|e| e.to_string())?;
    let dir = root.join(VENDOR_DIR).join("rust");
    let _ = std::fs::remove_dir_all(dir.join("src"));
    std::fs::create_dir_all(dir.join("src")).map_err(|e| e.to_string())?;
    std::fs::create_dir_all(dir.join("tests")).map_err(|e| e.to_string())?;
    let mut manifest = block_after(&guide, "`Cargo.toml`:", "toml")?;
    for (krate, path) in [
        ("xfer-plugin", "xfer-plugin"),
        ("engine-core", "engine-core"),
        ("xfer-conformance", "conformance"),
    ] {
        manifest = manifest.replace(
            &format!("{krate} = {{ path = \"../xfer/{path}\" }}"),
            &format!(
                "{krate} = {{ path = {:?} }}",
                root.join(path).display().to_string()
            ),
        );
    }
    // Inside this checkout's directory tree a package must say it is its own workspace; a
    // vendor's empty directory needs no such line.
    manifest.push_str("\n[workspace]\n");
    let files = [
        ("Cargo.toml", manifest),
        ("src/lib.rs", block_after(&guide, "`src/lib.rs`", "rust")?),
        (
            "tests/conformance.rs",
            block_after(&guide, "`tests/conformance.rs`:", "rust")?,
        ),
    ];
    for (name, text) in &files {
        std::fs::write(dir.join(name), text).map_err(|e| format!("{name}: {e}"))?;
    }
    sh_in(&dir, "cargo build --offline --quiet")
        .map_err(|e| format!("the guide's Rust path does not build: {e}"))?;
    // The guide's two ways to run the suite: the crate's own tests, and the xfer tool.
    let cargo = std::env::var("CARGO").unwrap_or_else(|_| "cargo".into());
    let manifest = dir.join("Cargo.toml");
    let manifest = manifest.to_string_lossy();
    counted(
        &cargo,
        &["test", "--offline", "--quiet", "--manifest-path", &manifest],
        &[],
        totals,
    )
    .map_err(|e| format!("the guide's Rust plugin under its own cargo test: {e}"))?;
    let library = dir.join("target/debug/libxfer_mynic.so");
    counted(
        "target/debug/xfer",
        &[
            "conformance",
            "--plugin",
            &library.to_string_lossy(),
            "--nic",
            "mynic0",
            "--nic",
            "mynic1",
        ],
        &[],
        totals,
    )
    .map_err(|e| format!("the guide's Rust plugin under xfer conformance: {e}"))
}

/// The header in a C++ translation unit, warnings as errors, defining an entry point with
/// `XFER_PLUGIN_ENTRY`: it compiles, and the symbol is exported unmangled (issue 26).
pub(crate) fn header_in_cpp(totals: &mut (u64, u64)) -> Result {
    let dir = std::path::Path::new(VENDOR_DIR).join("cpp");
    std::fs::create_dir_all(&dir).map_err(|e| e.to_string())?;
    std::fs::copy(header::HEADER, dir.join("xfer_plugin.h")).map_err(|e| e.to_string())?;
    std::fs::write(
        dir.join("entry.cpp"),
        "#include \"xfer_plugin.h\"\n\
         static XferPluginTable table{};\n\
         XFER_PLUGIN_ENTRY(cpp) { return &table; }\n",
    )
    .map_err(|e| e.to_string())?;
    let built = sh_in(
        &dir,
        "g++ -std=c++17 -Wall -Wextra -Werror -fPIC -shared -o libentry.so entry.cpp \
         && nm -D --defined-only libentry.so | grep -qw xfer_plugin_entry_cpp",
    );
    match built {
        Ok(()) => {
            totals.0 += 1;
            println!("xtask: the header compiles as C++17 with -Werror; XFER_PLUGIN_ENTRY exports xfer_plugin_entry_cpp");
            Ok(())
        }
        Err(e) => {
            totals.1 += 1;
            Err(format!("the header as C++: {e}"))
        }
    }
}

/// The plugin kit as a vendor uses it: the header is not stale, the C example plugin builds
/// from it in an empty directory with the guide's command, and `xfer conformance` passes on
/// it and on the mock's plugin (both through dlopen); no plugin carries the engine
/// ([`layering`]).
pub(crate) fn plugin_kit(totals: &mut (u64, u64)) -> Result {
    layering(totals)?;
    header::header(true)?;
    // `cargo test` leaves the mock's cdylib in target/debug/deps only; a build of the
    // library puts it where a vendor's path would point (a fresh root had none there).
    cargo(&["build", "--quiet", "-p", "backend-mock", "--lib"])?;
    cargo(&["build", "--quiet", "-p", "xfer-cli", "--bin", "xfer"])?;
    let c_plugin = build_c_plugin()?;
    header_in_cpp(totals)?;
    rust_guide_builds(totals)?;
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
    plugin_logs_reach_stderr(&c_plugin, totals)
}

/// A plugin's log lines reach `xfer conformance`'s stderr at the level `RUST_LOG` asks for
/// (the loopback plugin says at debug level that it opened a NIC); issue 26: the tool gave
/// plugins a maximum level of 0, so their logs never showed.
fn plugin_logs_reach_stderr(plugin: &str, totals: &mut (u64, u64)) -> Result {
    let out = Command::new("target/debug/xfer")
        .args([
            "conformance",
            "--plugin",
            plugin,
            "--nic",
            "lo0",
            "--check",
            "send_recv",
        ])
        .env("RUST_LOG", "debug")
        .output()
        .map_err(|e| e.to_string())?;
    let stderr = String::from_utf8_lossy(&out.stderr);
    if out.status.success() && stderr.contains("loopback NIC lo0 opened") {
        totals.0 += 1;
        println!("xtask: the plugin's debug log reaches stderr with RUST_LOG=debug");
        Ok(())
    } else {
        totals.1 += 1;
        Err(format!(
            "no plugin log line on stderr with RUST_LOG=debug: {stderr}"
        ))
    }
}

/// Runs `cargo test ...`, echoing its output, and adds up its "test result" lines.
pub(crate) fn cargo_test(args: &[&str], totals: &mut (u64, u64)) -> Result {
    let program = std::env::var("CARGO").unwrap_or_else(|_| "cargo".into());
    counted(&program, args, &[], totals)
}

/// Runs a test program (or cargo), echoing its output and adding up its "test result" lines.
pub(crate) fn counted(
    program: &str,
    args: &[&str],
    envs: &[(&str, &str)],
    totals: &mut (u64, u64),
) -> Result {
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

/// The failure schedules CI runs (each a few milliseconds; a failure names its seed).
pub(crate) const CI_SCHEDULES: &str = "3000";

/// The mock's conformance suite (statically linked, and loaded through dlopen) under valgrind
/// memcheck: any error fails. `striping` moves hundreds of megabytes and takes many minutes
/// under memcheck; it runs natively with everything else.
pub(crate) fn memcheck(totals: &mut (u64, u64)) -> Result {
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

/// `xfer_conformance::DEADLINE_ENV` (xtask does not link engine-core): the
/// conformance suite's short deadlines, raised for runs under valgrind or ASan.
pub(crate) const CONFORMANCE_DEADLINE_ENV: &str = "XFER_CONFORMANCE_DEADLINE_MS";

/// Whether `cargo +nightly` works here (sanitizers and fuzzing need it).
pub(crate) fn nightly_available() -> bool {
    Command::new("cargo")
        .args(["+nightly", "--version"])
        .output()
        .is_ok_and(|o| o.status.success())
}

/// Seconds each fuzz target runs in `cargo xtask test`: 15 (20 before the message, record
/// and frame targets came) keeps the step near its former length (7 × 15 s against 4 × 20 s);
/// each decoder is small and sees about a million inputs in that time.
pub(crate) const FUZZ_SECONDS: u32 = 15;

/// The fuzz targets in `fuzz/`, one per decoder of untrusted input (a test checks that
/// every target in `fuzz/Cargo.toml` is here, so none is built and never run).
pub(crate) const FUZZ_TARGETS: [&str; 8] = [
    "netaddr",   // engine-core: NetAddr (binary and hex)
    "mrdesc",    // engine-core: MrDesc (binary and hex)
    "message",   // engine-core: messages between engines (user payload, notification)
    "handshake", // backend-verbs: VerbsAddr and handshake datagrams
    "config",    // engine-core: config files
    "record",    // rendezvous: records in the store
    "frame",     // rendezvous: the embedded service's frames, both directions
    "ep_header", // ep-plan: MoE dispatch and combine headers, immediates
];

/// The fuzz targets (`fuzz/`: every decoder of untrusted input) built with libFuzzer and
/// AddressSanitizer on nightly, each run for a bounded time; any crash fails, and the input
/// that caused it is left in `fuzz/artifacts/<target>/`. Skipped with the reason where nightly
/// is absent. `cargo xtask fuzz [SECONDS]` runs them alone.
pub(crate) fn fuzz(seconds: u32, totals: &mut (u64, u64)) -> Result {
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
    for target in FUZZ_TARGETS {
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
pub(crate) fn address_sanitizer(totals: &mut (u64, u64)) -> Result {
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

/// What each backend links, from `cargo tree`: a plugin `.so` must not carry the engine (or
/// the watcher pool), and one built with `--no-default-features` must not carry CUDA loading.
/// Each rule counts as one test.
pub(crate) fn layering(totals: &mut (u64, u64)) -> Result {
    const RULES: [(&str, &[&str], &[&str]); 7] = [
        (
            "xfer-plugin",
            &[],
            &["engine-core", "uvm-watcher", "cudarc", "toml"],
        ),
        ("backend-mock", &[], &["engine-core", "uvm-watcher"]),
        ("backend-verbs", &[], &["engine-core", "uvm-watcher"]),
        (
            "backend-efa",
            &[],
            &["engine-core", "uvm-watcher", "cudarc"],
        ),
        ("backend-mock", &["--no-default-features"], &["cudarc"]),
        ("backend-verbs", &["--no-default-features"], &["cudarc"]),
        // A vendor's `xfer` needs neither libfabric nor libibverbs (issue 26).
        (
            "xfer-cli",
            &["--no-default-features"],
            &["ofi-sys", "verbs-sys", "backend-efa", "backend-verbs"],
        ),
    ];
    let mut broken = Vec::new();
    for (package, flags, forbidden) in RULES {
        let mut args = vec!["tree", "-e", "normal", "--prefix", "none", "-p", package];
        args.extend_from_slice(flags);
        let out = Command::new("cargo")
            .args(&args)
            .output()
            .map_err(|e| e.to_string())?;
        let tree = String::from_utf8_lossy(&out.stdout);
        let found: Vec<&str> = forbidden
            .iter()
            .copied()
            .filter(|name| tree.lines().any(|l| l.starts_with(&format!("{name} v"))))
            .collect();
        if out.status.success() && found.is_empty() {
            totals.0 += 1;
        } else {
            totals.1 += 1;
            broken.push(format!("{package} {flags:?} links {found:?}"));
        }
    }
    println!(
        "xtask layering: {} rules, {} broken",
        RULES.len(),
        broken.len()
    );
    if broken.is_empty() {
        Ok(())
    } else {
        Err(format!("layering broken: {}", broken.join("; ")))
    }
}

#[cfg(test)]
mod tests {
    use super::FUZZ_TARGETS;

    /// A target added to `fuzz/` but not to the list would be built and never run.
    #[test]
    fn every_fuzz_target_is_run() {
        let manifest = std::fs::read_to_string(
            std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("../fuzz/Cargo.toml"),
        )
        .unwrap();
        let mut built: Vec<&str> = manifest
            .lines()
            .filter_map(|l| l.strip_prefix("name = \""))
            .filter_map(|l| l.strip_suffix('"'))
            .filter(|name| *name != "xfer-fuzz")
            .collect();
        let mut run = FUZZ_TARGETS.to_vec();
        run.sort_unstable();
        built.sort_unstable();
        assert_eq!(run, built);
    }
}
