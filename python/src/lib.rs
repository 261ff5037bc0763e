//! `xfer._xfer`: the Python bindings of engine-core (the package `xfer` re-exports them; see
//! `python/xfer/__init__.py` and `_xfer.pyi`).
//!
//! Threads: completion callbacks, receive handlers, mirror sinks and watcher callbacks run on
//! the engine's threads and take the GIL to call Python; so every call that waits on those
//! threads (close, deregistration, blocking waits) releases the GIL first, or it could wait on
//! a thread that waits for the GIL.

mod engine;
mod ep;
mod errors;
mod ffi;
mod memory;
mod rendezvous;
mod transfer;
mod values;
mod weights;

use pyo3::prelude::*;

/// Exceptions raised by Python callbacks (each was also reported to `sys.unraisablehook`).
#[pyfunction]
fn callback_errors() -> u64 {
    transfer::CALLBACK_ERRORS.load(std::sync::atomic::Ordering::Relaxed)
}

/// The names of the built-in backends (plugins are found at open time).
#[pyfunction]
fn builtin_backends() -> Vec<String> {
    engine_core::plugin::Backend::builtin_names()
}

#[pymodule]
fn _xfer(m: &Bound<'_, PyModule>) -> PyResult<()> {
    backend_mock::link();
    m.add("__version__", env!("CARGO_PKG_VERSION"))?;
    m.add_class::<engine::TransferEngine>()?;
    m.add_class::<engine::PeerGroup>()?;
    m.add_class::<engine::Watcher>()?;
    m.add_class::<engine::GpuCounter>()?;
    m.add_class::<memory::MemoryRegion>()?;
    m.add_class::<values::MrDesc>()?;
    m.add_class::<values::NetAddr>()?;
    m.add_class::<transfer::Transfer>()?;
    m.add_class::<rendezvous::Rendezvous>()?;
    m.add_class::<rendezvous::Publication>()?;
    m.add_class::<rendezvous::Server>()?;
    m.add_function(wrap_pyfunction!(values::expected_arrivals, m)?)?;
    m.add_function(wrap_pyfunction!(callback_errors, m)?)?;
    m.add_function(wrap_pyfunction!(builtin_backends, m)?)?;
    m.add_function(wrap_pyfunction!(weights::plan_weights, m)?)?;
    m.add_class::<ep::EpStep>()?;
    m.add_function(wrap_pyfunction!(ep::ep_region_bytes, m)?)?;
    Ok(())
}
