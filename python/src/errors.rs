//! Engine errors as the exception hierarchy of `xfer/_errors.py` (defined in Python, so the
//! classes can inherit from builtins such as `TimeoutError` and `ValueError`).

use engine_core::domain::DomainErrorKind;
use engine_core::Error;
use pyo3::prelude::*;

/// The `xfer._errors` class an engine error is raised as.
fn class_of(e: &Error) -> &'static str {
    match e {
        Error::InvalidArgument(_) | Error::UnknownHandle(_) | Error::UnknownPeerGroup(_) => {
            "InvalidArgumentError"
        }
        // The backend refusing what the caller asked is the caller's mistake, as in Rust.
        Error::ForeignHandle { .. } | Error::Refused { .. } => "InvalidArgumentError",
        // A blocking call from inside the engine's own pass: the caller's mistake.
        Error::OnWorkerThread(_) => "InvalidArgumentError",
        Error::OutOfBounds { .. } => "OutOfBoundsError",
        Error::Busy { .. } => "BusyError",
        Error::ArrivalsDropped { .. } | Error::Timeout(_) => "TimeoutError",
        Error::NotListening { .. } => "NotListeningError",
        Error::WorkerFailed(_) => "WorkerFailedError",
        Error::Decode { .. } => "DecodeError",
        Error::Config(_) => "ConfigError",
        Error::Plugin(_) => "PluginError",
        Error::RemoteAccess(_) => "RemoteAccessError",
        Error::PeerUnreachable(_) => "PeerUnreachableError",
        // A backend that timed out without saying after how long is still a timeout.
        Error::Backend { source, .. } if source.kind == DomainErrorKind::Timeout => "TimeoutError",
        Error::Backend { .. } => "BackendError",
        Error::Watcher(_) => "WatcherError",
        Error::NotAvailable(_) => "NotAvailableError",
        Error::Shutdown => "ShutdownError",
        Error::Cancelled => "CancelledError",
        _ => "Error",
    }
}

/// An exception of class `name` (from `xfer._errors`) with `message`.
pub(crate) fn raise(py: Python<'_>, name: &str, message: String) -> PyErr {
    let made = py
        .import("xfer._errors")
        .and_then(|m| m.getattr(name))
        .and_then(|cls| cls.call1((message.clone(),)));
    match made {
        Ok(exc) => PyErr::from_value(exc),
        // The package is broken (the module was imported without its Python part): still
        // raise something that carries the message.
        Err(_) => pyo3::exceptions::PyRuntimeError::new_err(message),
    }
}

/// Converts an engine error into its exception.
pub(crate) fn to_py(py: Python<'_>, e: Error) -> PyErr {
    raise(py, class_of(&e), e.to_string())
}

/// `Result<T, engine_core::Error>` → `PyResult<T>`.
pub(crate) trait OrRaise<T> {
    fn or_raise(self, py: Python<'_>) -> PyResult<T>;
}

impl<T> OrRaise<T> for engine_core::Result<T> {
    fn or_raise(self, py: Python<'_>) -> PyResult<T> {
        self.map_err(|e| to_py(py, e))
    }
}

/// A closed engine (or a region of one).
pub(crate) fn closed(py: Python<'_>) -> PyErr {
    raise(py, "ShutdownError", "the engine is closed".into())
}

/// Bad input caught by the bindings themselves.
pub(crate) fn invalid(py: Python<'_>, message: impl Into<String>) -> PyErr {
    raise(py, "InvalidArgumentError", message.into())
}

/// A timeout in seconds from Python: NaN or negative is refused; a finite value too large for
/// the clock (or infinity) means without end (`Duration::MAX`, which every wait in the engine
/// reads as no deadline) rather than a clock overflow.
pub(crate) fn timeout_of(
    py: Python<'_>,
    what: &str,
    seconds: f64,
) -> PyResult<std::time::Duration> {
    if seconds.is_nan() || seconds < 0.0 {
        return Err(invalid(
            py,
            format!("{what} {seconds} is not a non-negative number of seconds"),
        ));
    }
    Ok(std::time::Duration::try_from_secs_f64(seconds).unwrap_or(std::time::Duration::MAX))
}
