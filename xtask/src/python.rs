//! The Python package (`python/`): built by maturin through `pip install ./python` into a
//! virtual environment under `target/` (Debian's own Python refuses `pip install`), with the
//! efa and verbs plugins inside it; then its pytest suite, examples and bench.

use crate::{counted, run, Result};

/// The virtual environment the package is installed into (kept between runs: pip is fast
/// when nothing changed).
pub(crate) const VENV: &str = "target/python-venv";

/// What the package needs from Debian besides Python itself: `venv` (with ensurepip).
pub(crate) const PACKAGES: &[&str] = &["python3", "python3-venv"];

fn venv_bin(tool: &str) -> String {
    format!("{VENV}/bin/{tool}")
}

/// Builds the efa and verbs plugins into `python/xfer/plugins`, where `pip install ./python`
/// ships them inside the package (loaded only when a config selects them).
pub(crate) fn stage_plugins() -> Result {
    crate::ensure_packages(PACKAGES)?;
    crate::ensure_packages(crate::PACKAGES)?;
    crate::build_plugins(true)?;
    let plugins = std::path::Path::new("python/xfer/plugins");
    std::fs::create_dir_all(plugins).map_err(|e| format!("{}: {e}", plugins.display()))?;
    for name in ["efa", "verbs"] {
        let file = format!("libbackend_{name}.so");
        std::fs::copy(format!("target/release/{file}"), plugins.join(&file))
            .map_err(|e| format!("{file}: {e}"))?;
    }
    Ok(())
}

fn ensure_venv() -> Result {
    crate::ensure_packages(PACKAGES)?;
    if !std::path::Path::new(&venv_bin("python")).exists() {
        run("python3", &["-m", "venv", VENV])?;
    }
    Ok(())
}

/// The package's wheel, with its plugins: built once per run of xtask — maturin through
/// `pip wheel ./python`, what the README's `pip install ./python` builds — and installed into
/// every venv (this one, vLLM's, SGLang's), so the extension is compiled in release once, not
/// once per venv (each took minutes).
pub(crate) fn wheel() -> Result<String> {
    static BUILT: std::sync::OnceLock<String> = std::sync::OnceLock::new();
    if let Some(path) = BUILT.get() {
        return Ok(path.clone());
    }
    stage_plugins()?;
    ensure_venv()?;
    let dir = std::path::Path::new("target/xfer-wheel");
    let _ = std::fs::remove_dir_all(dir);
    std::fs::create_dir_all(dir).map_err(|e| format!("{}: {e}", dir.display()))?;
    run(
        &venv_bin("pip"),
        &[
            "wheel",
            "--quiet",
            "--no-deps",
            "./python",
            "--wheel-dir",
            "target/xfer-wheel",
        ],
    )?;
    let built = std::fs::read_dir(dir)
        .map_err(|e| format!("{}: {e}", dir.display()))?
        .filter_map(|e| e.ok().map(|e| e.path()))
        .find(|p| p.extension().is_some_and(|x| x == "whl"))
        .ok_or("pip wheel ./python left no wheel in target/xfer-wheel")?;
    let path = built.display().to_string();
    Ok(BUILT.get_or_init(|| path).clone())
}

/// Installs the package's wheel into the venv whose pip is `pip`, replacing what was there
/// (so the tests never run a stale build).
pub(crate) fn install_wheel(pip: &str) -> Result {
    run(
        pip,
        &[
            "install",
            "--quiet",
            "--force-reinstall",
            "--no-deps",
            &wheel()?,
        ],
    )
}

/// Builds the plugins, creates the venv, installs pytest, numpy, hypothesis (the fuzz tests of
/// the Python decoders) and the package.
pub(crate) fn install() -> Result {
    ensure_venv()?;
    run(
        &venv_bin("pip"),
        &["install", "--quiet", "pytest", "numpy>=1.22", "hypothesis"],
    )?;
    install_wheel(&venv_bin("pip"))
}

/// The pytest suite (numbers added to `totals`), the examples and a short bench.
pub(crate) fn test(totals: &mut (u64, u64)) -> Result {
    install()?;
    let python = venv_bin("python");
    let pytest = |target: &str, envs: &[(&str, &str)], totals: &mut (u64, u64)| {
        counted(
            &python,
            &["-m", "pytest", "-q", "-p", "no:cacheprovider", target],
            envs,
            totals,
        )
    };
    pytest("python/tests", &[], totals)?;
    // The "CUDA" DLPack tensor end to end, against the GPU fakes (skipped in the run above);
    let fakes = crate::gpu_fakes::build()?.display().to_string();
    // xfer.ep's GPU path (streams, watcher slot, GPU counter) likewise.
    for file in [
        "python/tests/test_fake_gpu.py",
        "python/tests/test_ep_gpu.py",
    ] {
        pytest(
            file,
            &[("LD_LIBRARY_PATH", &fakes), ("XFER_GPU_FAKES", &fakes)],
            totals,
        )?;
    }
    for example in ["kv_cache.py", "weight_sync.py", "weight_sync_plan.py"] {
        run(&python, &[&format!("python/examples/{example}")])?;
    }
    run(&python, &["-m", "xfer.bench", "--duration", "0.2"])?;
    run(&python, &["-m", "xfer.bench_kv", "--sizes", "1000"])
}

/// pytest's closing line ("3 passed, 1 skipped in 2.0s", "1 failed, 2 passed in …"), in the
/// totals like cargo's "test result" lines.
pub(crate) fn add_pytest_result(line: &str, totals: &mut (u64, u64)) {
    let line = line.trim().trim_matches('=').trim();
    let outcomes = [" passed", " failed", " error"];
    if !line.contains(" in ") || !outcomes.iter().any(|o| line.contains(o)) {
        return;
    }
    let count = |word: &str| -> u64 {
        line.split(" in ")
            .next()
            .unwrap_or("")
            .split(',')
            .find_map(|part| part.trim().strip_suffix(word)?.trim().parse().ok())
            .unwrap_or(0)
    };
    totals.0 += count("passed");
    totals.1 += count("failed") + count("error") + count("errors");
}

#[cfg(test)]
mod tests {
    #[test]
    fn pytest_summaries_are_counted() {
        let mut t = (0, 0);
        super::add_pytest_result("27 passed in 5.71s", &mut t);
        super::add_pytest_result("==== 1 failed, 3 passed, 2 skipped in 2.00s ====", &mut t);
        super::add_pytest_result("2 errors in 0.1s", &mut t);
        super::add_pytest_result("test_x.py::test_y PASSED", &mut t);
        assert_eq!(t, (30, 3));
        // cargo's lines are not pytest's.
        crate::add_test_result("test result: ok. 4 passed; 0 failed", &mut t);
        assert_eq!(t, (34, 3));
    }
}
