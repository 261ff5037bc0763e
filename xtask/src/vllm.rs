//! The vLLM connector's tests (`python/tests/vllm`), against vLLM itself from PyPI, in a
//! virtual environment of its own (`target/vllm-venv`).
//!
//! vLLM 0.33 from PyPI brings torch with CUDA: about 9.4 GB installed, 3 GB of wheels. This
//! machine's pip keeps no cache, so the wheels are downloaded once into a directory outside
//! the checkout (`$XFER_WHEEL_CACHE`, default `/var/cache/xfer-wheels`; `cargo xtask fresh`
//! shares it with its clean root, as it shares the `.deb`s) and installed from there with
//! `--no-index`: a clean-root run unpacks them (minutes) instead of downloading gigabytes.

use crate::{counted, run, Result};

/// The virtual environment vLLM and the package are installed into.
pub(crate) const VENV: &str = "target/vllm-venv";

/// What is installed (the connector targets this vLLM release).
const REQUIREMENTS: &[&str] = &["vllm==0.33.0", "pytest"];

/// Where the wheels are kept between runs.
pub(crate) fn wheel_cache() -> String {
    std::env::var("XFER_WHEEL_CACHE").unwrap_or_else(|_| "/var/cache/xfer-wheels".into())
}

fn pip(args: &[&str]) -> Result {
    run(&format!("{VENV}/bin/pip"), args)
}

/// Creates the venv, installs vLLM from the wheel cache (downloading into it what is
/// missing), and the package (built from `./python`).
pub(crate) fn install() -> Result {
    // The package with its efa and verbs plugins (the two-process tests run over libfabric).
    crate::python::stage_plugins()?;
    if !std::path::Path::new(&format!("{VENV}/bin/python")).exists() {
        run("python3", &["-m", "venv", VENV])?;
    }
    let cache = wheel_cache();
    std::fs::create_dir_all(&cache).map_err(|e| format!("{cache}: {e}"))?;
    let mut offline = vec!["install", "--quiet", "--no-index", "--find-links", &cache];
    offline.extend(REQUIREMENTS);
    if pip(&offline).is_err() {
        eprintln!("xtask vllm: downloading vLLM's wheels into {cache} (once, about 3 GB)");
        let mut download = vec!["download", "--quiet", "--dest", &cache];
        download.extend(REQUIREMENTS);
        pip(&download)?;
        pip(&offline)?;
    }
    pip(&[
        "install",
        "--quiet",
        "--force-reinstall",
        "--no-deps",
        "./python",
    ])
}

/// Installs, then runs the connector's tests (their counts added to `totals`).
pub(crate) fn test(totals: &mut (u64, u64)) -> Result {
    install()?;
    counted(
        &format!("{VENV}/bin/python"),
        &[
            "-m",
            "pytest",
            "-q",
            "-p",
            "no:cacheprovider",
            "python/tests/vllm",
        ],
        // The CUDA wheel cannot infer a device on a machine without a GPU.
        &[("VLLM_TARGET_DEVICE", "cpu")],
        totals,
    )
}
