//! `cargo xtask gpu-fakes`: builds the fake CUDA driver and GDRCopy (gpu-fakes/*.c) and runs
//! every GPU path's tests against them — the GPU code that no machine here can otherwise run.

use std::path::PathBuf;

use crate::{counted, Result};

/// Where the fakes are built (absolute: the tests find them through the environment).
fn directory() -> Result<PathBuf> {
    let here = std::env::current_dir().map_err(|e| e.to_string())?;
    Ok(here.join("target/gpu-fakes"))
}

/// Compiles `libcuda.so.1` (+ the `libcuda.so` name cudarc asks for) and `libgdrapi.so.2`.
pub(crate) fn build() -> Result<PathBuf> {
    let dir = directory()?;
    std::fs::create_dir_all(&dir).map_err(|e| e.to_string())?;
    let flags = [
        "-O1", "-g", "-Wall", "-Wextra", "-Werror", "-fPIC", "-shared",
    ];
    let cuda = dir.join("libcuda.so.1");
    let mut args: Vec<String> = flags.iter().map(|f| f.to_string()).collect();
    args.extend([
        "-Wl,-soname,libcuda.so.1".into(),
        "-o".into(),
        cuda.display().to_string(),
        "gpu-fakes/cuda.c".into(),
        "-lpthread".into(),
    ]);
    crate::run("cc", &args.iter().map(String::as_str).collect::<Vec<_>>())?;
    let link = dir.join("libcuda.so");
    let _ = std::fs::remove_file(&link);
    std::os::unix::fs::symlink("libcuda.so.1", &link).map_err(|e| e.to_string())?;
    let mut args: Vec<String> = flags.iter().map(|f| f.to_string()).collect();
    args.extend([
        "-Wl,-soname,libgdrapi.so.2".into(),
        "-o".into(),
        dir.join("libgdrapi.so.2").display().to_string(),
        "gpu-fakes/gdrapi.c".into(),
        format!("-L{}", dir.display()),
        "-l:libcuda.so.1".into(),
        "-Wl,-rpath,$ORIGIN".into(),
    ]);
    crate::run("cc", &args.iter().map(String::as_str).collect::<Vec<_>>())?;
    Ok(dir)
}

/// The crates whose `fake_gpu` tests run against the fakes.
const SUITES: &[&str] = &[
    "xfer-cuda",
    "uvm-watcher",
    "backend-mock",
    "backend-efa",
    "xfer-cli",
];

/// `cargo <start> -p … --test fake_gpu -- --ignored --test-threads 1` over every suite (one
/// test at a time: faults and counts are per process).
fn suites_command<'a>(start: &[&'a str]) -> Vec<&'a str> {
    let mut args = start.to_vec();
    for suite in SUITES {
        args.extend(["-p", suite]);
    }
    args.extend([
        "--test",
        "fake_gpu",
        "--",
        "--ignored",
        "--test-threads",
        "1",
    ]);
    args
}

/// Builds the fakes and runs the fake-GPU suites (one test at a time: faults and counts are
/// per process).
pub(crate) fn test(totals: &mut (u64, u64)) -> Result {
    let dir = build()?;
    let dir = dir.display().to_string();
    let program = std::env::var("CARGO").unwrap_or_else(|_| "cargo".into());
    let args = suites_command(&["test"]);
    counted(
        &program,
        &args,
        // XFER_GPU_FAKES is `xfer_gpu_fakes::DIRECTORY` (xtask does not link test support).
        &[("LD_LIBRARY_PATH", &dir), ("XFER_GPU_FAKES", &dir)],
        totals,
    )
}

/// The files of the GPU paths whose coverage `coverage` reports.
const COVERED: &[&str] = &["uvm-watcher/src/", "cuda/src/", "gdrcopy-sys/src/"];

/// `cargo xtask gpu-coverage`: line coverage of the GPU paths by the suites a plain
/// `cargo test` ran before the fakes existed ("before"), and with the fake-GPU suites added
/// ("after"). A figure for the record, not a gate; needs rustup's llvm-tools (added here).
pub(crate) fn coverage() -> Result {
    let dir = build()?.display().to_string();
    crate::run("rustup", &["component", "add", "llvm-tools"])?;
    let sysroot = std::process::Command::new("rustc")
        .args(["--print", "sysroot"])
        .output()
        .map_err(|e| e.to_string())?;
    let tools = format!(
        "{}/lib/rustlib/x86_64-unknown-linux-gnu/bin",
        String::from_utf8_lossy(&sysroot.stdout).trim()
    );
    let target = directory()?.with_file_name("coverage");
    let profiles = target.join("profiles");
    let _ = std::fs::remove_dir_all(&profiles);
    std::fs::create_dir_all(&profiles).map_err(|e| e.to_string())?;
    let program = std::env::var("CARGO").unwrap_or_else(|_| "cargo".into());
    let env = |phase: &str, extra: &[(&str, &str)]| -> Vec<(String, String)> {
        let mut env = vec![
            ("CARGO_TARGET_DIR".into(), target.display().to_string()),
            ("RUSTFLAGS".into(), "-C instrument-coverage".into()),
            (
                "LLVM_PROFILE_FILE".into(),
                format!("{}/{phase}-%p-%m.profraw", profiles.display()),
            ),
        ];
        env.extend(extra.iter().map(|(k, v)| (k.to_string(), v.to_string())));
        env
    };
    let before = [
        "test",
        "-q",
        "-p",
        "uvm-watcher",
        "-p",
        "xfer-cuda",
        "-p",
        "gdrcopy-sys",
    ];
    crate::run_with(&program, &before, &env("before", &[]))?;
    crate::run_with(
        &program,
        &["test", "-q", "-p", "backend-mock", "--test", "watcher"],
        &env("before", &[]),
    )?;
    let after = suites_command(&["test", "-q"]);
    let fakes = [
        ("LD_LIBRARY_PATH", dir.as_str()),
        ("XFER_GPU_FAKES", dir.as_str()),
    ];
    crate::run_with(&program, &after, &env("after", &fakes))?;
    let objects: Vec<String> = std::fs::read_dir(target.join("debug/deps"))
        .map_err(|e| e.to_string())?
        .filter_map(|e| e.ok().map(|e| e.path()))
        .filter(|p| p.extension().is_none() && p.is_file())
        .flat_map(|p| ["-object".to_owned(), p.display().to_string()])
        .collect();
    for phase in ["before", "after"] {
        let inputs: Vec<String> = std::fs::read_dir(&profiles)
            .map_err(|e| e.to_string())?
            .filter_map(|e| e.ok().map(|e| e.path().display().to_string()))
            .filter(|p| phase == "after" || p.contains("/before-"))
            .collect();
        let merged = target
            .join(format!("{phase}.profdata"))
            .display()
            .to_string();
        let mut args = vec!["merge", "-sparse", "-o", merged.as_str()];
        args.extend(inputs.iter().map(String::as_str));
        crate::run(&format!("{tools}/llvm-profdata"), &args)?;
        let mut args = vec!["report".to_owned(), format!("--instr-profile={merged}")];
        args.extend(objects.iter().cloned());
        let report = std::process::Command::new(format!("{tools}/llvm-cov"))
            .args(&args)
            .output()
            .map_err(|e| e.to_string())?;
        println!("{phase} (file: functions executed/total, lines executed/total)");
        for line in String::from_utf8_lossy(&report.stdout).lines() {
            let f: Vec<&str> = line.split_whitespace().collect();
            if f.len() > 9 && COVERED.iter().any(|c| f[0].contains(c)) {
                let count = |total: &str, missed: &str| -> String {
                    let (t, m) = (
                        total.parse::<u64>().unwrap_or(0),
                        missed.parse::<u64>().unwrap_or(0),
                    );
                    format!("{}/{t}", t - m)
                };
                println!(
                    "  {}: functions {}, lines {}",
                    f[0],
                    count(f[4], f[5]),
                    count(f[7], f[8])
                );
            }
        }
    }
    Ok(())
}
