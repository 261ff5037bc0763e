//! `xfer.Rendezvous`: peers find each other by name (the `xfer-rendezvous` crate: the
//! embedded service `xfer://host:port`, or etcd where the package was built with it).

use std::time::Duration;

use pyo3::prelude::*;
use pyo3::types::{PyBytes, PyDict};

use crate::errors;
use crate::memory::desc_of;
use crate::values::{addr_of, MrDesc};

fn to_py(py: Python<'_>, e: xfer_rendezvous::Error) -> PyErr {
    let class = match &e {
        xfer_rendezvous::Error::NotFound { .. } => "TimeoutError",
        xfer_rendezvous::Error::BadUrl { .. } | xfer_rendezvous::Error::InvalidName { .. } => {
            "InvalidArgumentError"
        }
        xfer_rendezvous::Error::BadRecord { .. } => "DecodeError",
        xfer_rendezvous::Error::NoEtcd => "NotAvailableError",
        _ => "RendezvousError",
    };
    errors::raise(py, class, e.to_string())
}

fn seconds(py: Python<'_>, what: &str, s: f64) -> PyResult<Duration> {
    Duration::try_from_secs_f64(s)
        .map_err(|_| errors::invalid(py, format!("{what} {s} is not a number of seconds")))
}

/// A published peer: `name`, `incarnation`, `addr` (bytes) and `regions` (name → MrDesc).
fn record<'py>(py: Python<'py>, r: &xfer_rendezvous::Record) -> PyResult<Bound<'py, PyDict>> {
    let d = PyDict::new(py);
    d.set_item("name", &r.name)?;
    d.set_item("incarnation", r.incarnation)?;
    d.set_item("addr", PyBytes::new(py, &r.addr.to_bytes()))?;
    let regions = PyDict::new(py);
    for (n, desc) in &r.regions {
        regions.set_item(n, MrDesc(desc.clone()))?;
    }
    d.set_item("regions", regions)?;
    Ok(d)
}

/// A connection to a rendezvous: `Rendezvous("xfer://127.0.0.1:7420")` (the embedded
/// service, `xfer serve`) or `etcd://host:port/prefix`.
#[pyclass(module = "xfer", frozen)]
pub(crate) struct Rendezvous(xfer_rendezvous::Rendezvous);

/// A published name; `unpublish()` (or garbage collection) removes it.
#[pyclass(module = "xfer", frozen)]
pub(crate) struct Publication(std::sync::Mutex<Option<xfer_rendezvous::Publication>>);

#[pymethods]
impl Rendezvous {
    /// Waits up to `connect_timeout` seconds for a service that is not up yet (or is
    /// restarting), in this call and in later publish/list calls; then `RendezvousError`
    /// naming the URL. `secret_file` (else `$XFER_SECRET_FILE`) holds the cluster secret
    /// the embedded service asks for; the `etcd_*` files give etcd TLS (a CA, and a client
    /// certificate and key for `--client-cert-auth`) and a user (its password in a file).
    #[new]
    #[pyo3(signature = (url, *, connect_timeout=30.0, secret_file=None, etcd_ca_file=None,
        etcd_cert_file=None, etcd_key_file=None, etcd_domain=None, etcd_user=None,
        etcd_password_file=None))]
    #[allow(clippy::too_many_arguments)]
    fn new(
        py: Python<'_>,
        url: &str,
        connect_timeout: f64,
        secret_file: Option<std::path::PathBuf>,
        etcd_ca_file: Option<std::path::PathBuf>,
        etcd_cert_file: Option<std::path::PathBuf>,
        etcd_key_file: Option<std::path::PathBuf>,
        etcd_domain: Option<String>,
        etcd_user: Option<String>,
        etcd_password_file: Option<std::path::PathBuf>,
    ) -> PyResult<Self> {
        let wait = errors::timeout_of(py, "connect_timeout", connect_timeout)?;
        py.detach(|| {
            let options = xfer_rendezvous::ConnectOptions {
                wait,
                secret: xfer_rendezvous::Secret::from_file_or_env(secret_file.as_deref())?,
                etcd: xfer_rendezvous::EtcdSecurity {
                    ca_file: etcd_ca_file,
                    cert_file: etcd_cert_file,
                    key_file: etcd_key_file,
                    domain: etcd_domain,
                    user: etcd_user,
                    password_file: etcd_password_file,
                },
            };
            xfer_rendezvous::Rendezvous::connect_with(url, &options)
        })
        .map(Self)
        .map_err(|e| to_py(py, e))
    }

    /// Publishes `name` → (`addr`, `regions`: a dict of name → MrDesc or MemoryRegion)
    /// under a lease of `ttl` seconds, kept alive in the background.
    #[pyo3(signature = (name, addr, regions=None, *, ttl=5.0))]
    fn publish(
        &self,
        py: Python<'_>,
        name: &str,
        addr: &Bound<'_, PyAny>,
        regions: Option<&Bound<'_, PyDict>>,
        ttl: f64,
    ) -> PyResult<Publication> {
        let addr = addr_of(addr)?;
        let mut named = Vec::new();
        if let Some(regions) = regions {
            for (k, v) in regions.iter() {
                named.push((k.extract::<String>()?, desc_of(&v)?));
            }
        }
        let ttl = seconds(py, "ttl", ttl)?;
        let refs: Vec<(&str, &engine_core::MrDesc)> =
            named.iter().map(|(n, d)| (n.as_str(), d)).collect();
        py.detach(|| self.0.publish(name, &addr, &refs, ttl))
            .map(|p| Publication(std::sync::Mutex::new(Some(p))))
            .map_err(|e| to_py(py, e))
    }

    /// The record published under `name`, waiting up to `timeout` seconds for it
    /// (`TimeoutError` if it does not appear).
    #[pyo3(signature = (name, timeout=30.0))]
    fn lookup<'py>(
        &self,
        py: Python<'py>,
        name: &str,
        timeout: f64,
    ) -> PyResult<Bound<'py, PyDict>> {
        let timeout = errors::timeout_of(py, "timeout", timeout)?;
        let r = py
            .detach(|| self.0.lookup(name, timeout))
            .map_err(|e| to_py(py, e))?;
        record(py, &r)
    }

    /// Everyone published now (records as dicts, by name).
    fn list<'py>(&self, py: Python<'py>) -> PyResult<Vec<Bound<'py, PyDict>>> {
        let all = py.detach(|| self.0.list()).map_err(|e| to_py(py, e))?;
        all.iter().map(|r| record(py, r)).collect()
    }

    fn __repr__(&self) -> String {
        format!("xfer.Rendezvous({:?})", self.0.url())
    }
}

#[pymethods]
impl Publication {
    /// Removes the name now.
    fn unpublish(&self, py: Python<'_>) {
        let p = self.0.lock().unwrap_or_else(|p| p.into_inner()).take();
        py.detach(move || drop(p));
    }

    /// The incarnation this publication carries.
    #[getter]
    fn incarnation(&self) -> Option<u64> {
        self.0
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .as_ref()
            .map(|p| p.record().incarnation)
    }

    fn __enter__(slf: Py<Self>) -> Py<Self> {
        slf
    }

    #[pyo3(signature = (*_args))]
    fn __exit__(&self, py: Python<'_>, _args: &Bound<'_, pyo3::types::PyTuple>) -> bool {
        self.unpublish(py);
        false
    }
}

/// An embedded rendezvous service in this process (`xfer serve` without the CLI), for
/// tests and single-machine set-ups: `Server("127.0.0.1:0").url`. With `secret_file` (else
/// `$XFER_SECRET_FILE`) clients must prove the secret; without one, loopback only.
#[pyclass(module = "xfer", frozen)]
pub(crate) struct Server(std::sync::Mutex<Option<xfer_rendezvous::Server>>, String);

#[pymethods]
impl Server {
    #[new]
    #[pyo3(signature = (listen="127.0.0.1:0", *, secret_file=None))]
    fn new(
        py: Python<'_>,
        listen: &str,
        secret_file: Option<std::path::PathBuf>,
    ) -> PyResult<Self> {
        let s = xfer_rendezvous::Secret::from_file_or_env(secret_file.as_deref())
            .and_then(|secret| {
                xfer_rendezvous::Server::start_with(
                    listen,
                    xfer_rendezvous::embedded::Limits::default(),
                    secret,
                )
            })
            .map_err(|e| to_py(py, e))?;
        let url = s.url();
        Ok(Self(std::sync::Mutex::new(Some(s)), url))
    }

    /// `xfer://host:port`.
    #[getter]
    fn url(&self) -> String {
        self.1.clone()
    }

    /// Stops the service.
    fn close(&self, py: Python<'_>) {
        let s = self.0.lock().unwrap_or_else(|p| p.into_inner()).take();
        py.detach(move || drop(s));
    }
}
