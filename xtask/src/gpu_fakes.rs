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

/// Builds the fakes and runs the fake-GPU suites (one test at a time: faults and counts are
/// per process).
pub(crate) fn test(totals: &mut (u64, u64)) -> Result {
    let dir = build()?;
    let dir = dir.display().to_string();
    let program = std::env::var("CARGO").unwrap_or_else(|_| "cargo".into());
    let mut args = vec!["test"];
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
    counted(
        &program,
        &args,
        // XFER_GPU_FAKES is `xfer_gpu_fakes::DIRECTORY` (xtask does not link test support).
        &[("LD_LIBRARY_PATH", &dir), ("XFER_GPU_FAKES", &dir)],
        totals,
    )
}
