//! Shared set-up for the example workloads: engines on the configured backend (the in-process
//! mock by default) with a chosen NIC count.

use std::sync::Arc;

use engine_core::{Config, TransferEngine};

/// Engines on `$XFER_CONFIG` (default: the mock), with the first group's NIC count set to
/// `nics` when the backend is the mock.
pub fn open_engines(
    count: usize,
    nics: usize,
) -> Result<Vec<Arc<TransferEngine>>, engine_core::Error> {
    backend_mock::link();
    let mut config = Config::load(None)?;
    if config.backend == "mock" {
        config.groups[0].nics = (0..nics).map(|i| format!("mock{i}")).collect();
    }
    (0..count)
        .map(|_| TransferEngine::open(&config).map(Arc::new))
        .collect()
}

/// A byte that depends on every index it is given, to tell any two pages or tensors apart.
pub fn byte(a: usize, b: usize, c: usize) -> u8 {
    (a.wrapping_mul(131) ^ b.wrapping_mul(31) ^ c.wrapping_mul(7)) as u8
}

/// Exits non-zero with a message: the examples check their own results.
pub fn fail(message: impl std::fmt::Display) -> ! {
    eprintln!("FAILED: {message}");
    std::process::exit(1)
}
