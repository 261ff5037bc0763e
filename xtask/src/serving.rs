//! The serving connectors' tests — vLLM's (`python/tests/serving_vllm`) and SGLang's
//! (`python/tests/serving_sglang`) — against the frameworks themselves from PyPI, each in a virtual
//! environment of its own (`target/vllm-venv`, `target/sglang-venv`: their pins differ). The
//! directories are not named `vllm`/`sglang`: on pytest's path they would shadow the packages
//! where those are not installed (the main Python suite collects them and skips).
//!
//! Both bring torch with CUDA from PyPI: vLLM 0.33 about 9.4 GB installed, SGLang 0.5.23 about
//! as much; 5.2 GB of wheels together (they share torch). This machine's pip keeps no cache, so
//! the wheels are downloaded once into a directory outside the checkout (`$XFER_WHEEL_CACHE`,
//! default `/var/cache/xfer-wheels`; `cargo xtask fresh` shares it with its clean root, as it
//! shares the `.deb`s) and installed from there with `--no-index`: a clean-root run unpacks
//! them (minutes) instead of downloading gigabytes.

use crate::{counted, run, Result};

/// A serving framework the package has a connector for.
pub(crate) struct Framework {
    /// Its virtual environment.
    pub(crate) venv: &'static str,
    /// What is installed (the connector targets this release).
    requirements: &'static [&'static str],
    /// Installed after them without their dependencies (whose pins would fight the
    /// framework's), from the same wheel cache.
    without_deps: &'static [&'static str],
    /// Its tests.
    tests: &'static str,
    /// Their environment.
    env: &'static [(&'static str, &'static str)],
    /// Tests to run again inside the rxe guest (pytest arguments after the tests' directory),
    /// where soft-RoCE devices exist.
    guest: Option<&'static str>,
}

pub(crate) const VLLM: Framework = Framework {
    venv: "target/vllm-venv",
    // NIXL (the meta package brings its CUDA 12 and 13 builds; vLLM's torch is CUDA 13, so
    // `import nixl` picks nixl_cu13): NixlConnector runs through the scheduler-driven harness
    // as the control. It runs without a GPU on UCX; ~120 MB of wheels.
    //
    // verl's checkpoint engine (xfer.verl's test) shares this venv: vLLM and torch are what it
    // runs beside. verl 0.9.1 itself goes in without its dependencies (it pins transformers
    // below 5.11; vLLM 0.33 brings 5.20), its checkpoint engine's imports with theirs.
    // CuPy: verl's own `nixl` engine (the weight-sync test's control) imports it at load; the
    // CUDA 12 wheel imports without a GPU (~137 MB).
    requirements: &[
        "vllm==0.33.0",
        "nixl==1.5.1",
        "pytest",
        "ray==2.60.0",
        "tensordict==0.15.3",
        "omegaconf==2.4.0",
        "codetiming==1.4.0",
        "cupy-cuda12x==14.2.0",
    ],
    without_deps: &["verl==0.9.1"],
    tests: "python/tests/serving_vllm",
    // The CUDA wheel cannot infer a device on a machine without a GPU.
    env: &[("VLLM_TARGET_DEVICE", "cpu")],
    // The two processes over verbs, reading every block with RDMA READ. Only with
    // `XFER_SERVING_IN_GUEST` set: both import torch and vLLM under the guest's emulation
    // (TCG, the venv read over 9p), 7.5 minutes on 2026-12-02 and more than 15 (the start
    // deadline) in CI's clean root on 2026-12-04. The connector's code is the same over the
    // efa backend, which the host runs; verbs itself is tested in the guest's own suite.
    guest: Some("/test_vllm_two_process.py -k 'verbs and pull'"),
};

pub(crate) const SGLANG: Framework = Framework {
    venv: "target/sglang-venv",
    requirements: &["sglang==0.5.23", "pytest"],
    without_deps: &[],
    tests: "python/tests/serving_sglang",
    env: &[],
    guest: None,
};

/// The peer engines `cargo xtask peer-bench` compares xfer with (issue 29), in a venv beside
/// the package: the releases the issue measured. Not a framework with tests of its own.
pub(crate) const PEERS: Framework = Framework {
    venv: "target/peers-venv",
    requirements: &[
        "dlslime==0.1.23",
        "mooncake-transfer-engine-non-cuda==0.3.13.post1",
    ],
    without_deps: &[],
    tests: "python/benches",
    env: &[],
    guest: None,
};

/// Where the wheels are kept between runs.
pub(crate) fn wheel_cache() -> String {
    std::env::var("XFER_WHEEL_CACHE").unwrap_or_else(|_| "/var/cache/xfer-wheels".into())
}

impl Framework {
    fn pip(&self, args: &[&str]) -> Result {
        run(&format!("{}/bin/pip", self.venv), args)
    }

    /// Creates the venv, installs the framework from the wheel cache (downloading into it
    /// what is missing), and the package's wheel (with its efa and verbs plugins: two-process
    /// tests run over libfabric).
    pub(crate) fn install(&self) -> Result {
        if !std::path::Path::new(&format!("{}/bin/python", self.venv)).exists() {
            run("python3", &["-m", "venv", self.venv])?;
        }
        let cache = wheel_cache();
        std::fs::create_dir_all(&cache).map_err(|e| format!("{cache}: {e}"))?;
        self.install_cached(&cache, self.requirements, &[])?;
        if !self.without_deps.is_empty() {
            self.install_cached(&cache, self.without_deps, &["--no-deps"])?;
        }
        crate::python::install_wheel(&format!("{}/bin/pip", self.venv))
    }

    /// Installs `packages` (pip `flags` added) from the wheel cache, downloading into it
    /// first what it lacks.
    fn install_cached(&self, cache: &str, packages: &[&str], flags: &[&str]) -> Result {
        let mut offline = vec!["install", "--quiet", "--no-index", "--find-links", cache];
        offline.extend(flags);
        offline.extend(packages);
        if self.pip(&offline).is_err() {
            eprintln!("xtask: downloading {packages:?} into {cache} (once)");
            let mut download = vec!["download", "--quiet", "--dest", cache];
            download.extend(flags);
            download.extend(packages);
            self.pip(&download)?;
            self.pip(&offline)?;
        }
        Ok(())
    }

    /// Installs, then runs the tests (their counts added to `totals`).
    /// With `XFER_DROP_SERVING_VENVS` set (`cargo xtask fresh` sets it), the venv is removed
    /// afterwards, so a clean root never holds both frameworks' 10 GB at once.
    pub(crate) fn test(&self, totals: &mut (u64, u64)) -> Result {
        let result = self
            .install()
            .and_then(|()| {
                counted(
                    &format!("{}/bin/python", self.venv),
                    &["-m", "pytest", "-q", "-p", "no:cacheprovider", self.tests],
                    self.env,
                    totals,
                )
            })
            .and_then(|()| self.test_in_guest(totals));
        if std::env::var_os("XFER_DROP_SERVING_VENVS").is_some() {
            let _ = std::fs::remove_dir_all(self.venv);
        }
        result
    }

    /// Runs [`guest`](Self::guest) in the rxe guest, counting its results, where
    /// `XFER_SERVING_IN_GUEST` asks for it.
    fn test_in_guest(&self, totals: &mut (u64, u64)) -> Result {
        let Some(selection) = self.guest else {
            return Ok(());
        };
        if std::env::var_os("XFER_SERVING_IN_GUEST").is_none() {
            eprintln!(
                "xtask: {} in the rxe guest left out (set XFER_SERVING_IN_GUEST=1 to run it)",
                self.tests
            );
            return Ok(());
        }
        let env: Vec<String> = self.env.iter().map(|(k, v)| format!("{k}={v}")).collect();
        // `-s`: with pytest's output capture the guest run ended in a FileNotFoundError from
        // the capture's own teardown after the test's body (2 runs of 2; 0 of 2 with `-s`).
        let script = format!(
            "{} {}/bin/python -m pytest -q -s -p no:cacheprovider {}{selection}",
            env.join(" "),
            self.venv,
            self.tests
        );
        eprintln!("xtask: in the rxe guest: {script}");
        let guest = crate::rxe::run(
            1,
            std::time::Duration::from_secs(2400),
            &["bash".into(), "-c".into(), script],
        )?;
        guest
            .output
            .iter()
            .for_each(|l| crate::checks::add_test_result(l, totals));
        if guest.status != 0 {
            return Err(format!(
                "{} in the rxe guest failed with status {}",
                self.tests, guest.status
            ));
        }
        Ok(())
    }
}
