//! # xfer-gpu-fakes: the test side of the fake CUDA driver and GDRCopy
//!
//! `cargo xtask gpu-fakes` builds `cuda.c` and `gdrapi.c` (in this directory) into
//! `target/gpu-fakes` as `libcuda.so.1` and `libgdrapi.so.2`, and runs the fake-GPU tests
//! with that directory on `LD_LIBRARY_PATH` and in `$XFER_GPU_FAKES`. xfer loads them as it
//! loads the real ones; only the tests use this crate, to inject faults, make "kernel" stores,
//! and count what is still allocated or pinned. Those tests are `#[ignore]`d so a plain
//! `cargo test` (with no fakes on the library path) skips them by name.

mod ffi;

pub use ffi::Fakes;

/// The environment variable naming the directory the fakes were built into.
pub const DIRECTORY: &str = "XFER_GPU_FAKES";

/// The loaded fakes (the same objects the CUDA and GDRCopy loaders of the product found).
/// Panics with how to run the test when the fakes are not on the library path.
pub fn fakes() -> &'static Fakes {
    static FAKES: std::sync::OnceLock<Fakes> = std::sync::OnceLock::new();
    FAKES.get_or_init(|| {
        let dir = std::env::var(DIRECTORY).unwrap_or_else(|_| {
            panic!("${DIRECTORY} is not set: run the fake-GPU tests with `cargo xtask gpu-fakes`")
        });
        Fakes::load(std::path::Path::new(&dir)).unwrap_or_else(|e| panic!("{e}"))
    })
}

/// Runs this test binary again as a child process that runs only `test` with `env` set, and
/// returns how it ended: for behaviour that is per process (a driver that fails `cuInit`) or
/// that kills the process (a CPU touching device memory).
pub fn run_child(test: &str, env: &[(&str, &str)]) -> std::process::Output {
    let exe = std::env::current_exe().expect("the test binary's path");
    let mut command = std::process::Command::new(exe);
    command.args([
        test,
        "--exact",
        "--ignored",
        "--nocapture",
        "--test-threads",
        "1",
    ]);
    command.env("XFER_FAKE_GPU_CHILD", "1");
    for (k, v) in env {
        command.env(k, v);
    }
    command.output().expect("starting the child test process")
}

/// Whether this process is a child started by [`run_child`].
pub fn is_child() -> bool {
    std::env::var_os("XFER_FAKE_GPU_CHILD").is_some()
}
