//! Registering Python objects: the buffer protocol (bytearray, memoryview, mmap, numpy) and
//! DLPack (numpy, torch; CPU or CUDA). The registration holds the exporter, so the memory
//! stays where it is until deregistration.

use std::collections::HashMap;
use std::sync::{Arc, Mutex, RwLock};

use engine_core::{Device, MrHandle, RemoteAccess};
use pyo3::buffer::PyUntypedBuffer;
use pyo3::prelude::*;
use pyo3::types::{PyBytes, PyCapsule};

use crate::errors::{self, OrRaise};
use crate::ffi::{self, DL_CPU, DL_CUDA, DL_CUDA_HOST, DL_CUDA_MANAGED};
use crate::values::{type_name, MrDesc};

/// An engine and what keeps its registrations' memory alive, shared by the
/// `xfer.TransferEngine` and each of its `MemoryRegion`s (so a region deregisters itself
/// without knowing the engine's Python class).
pub(crate) struct Registrations {
    /// `None` once closed.
    pub(crate) engine: RwLock<Option<Arc<engine_core::TransferEngine>>>,
    /// What keeps each registration's memory alive, by handle id.
    keeps: Mutex<HashMap<u64, Keep>>,
}

impl Registrations {
    pub(crate) fn new(engine: engine_core::TransferEngine) -> Self {
        Self {
            engine: RwLock::new(Some(Arc::new(engine))),
            keeps: Mutex::new(HashMap::new()),
        }
    }

    /// The engine, or `ShutdownError` once closed.
    pub(crate) fn engine(&self, py: Python<'_>) -> PyResult<Arc<engine_core::TransferEngine>> {
        self.engine
            .read()
            .unwrap_or_else(|p| p.into_inner())
            .clone()
            .ok_or_else(|| errors::closed(py))
    }

    fn keeps(&self) -> std::sync::MutexGuard<'_, HashMap<u64, Keep>> {
        self.keeps.lock().unwrap_or_else(|p| p.into_inner())
    }

    pub(crate) fn is_registered(&self, id: u64) -> bool {
        self.keeps().contains_key(&id)
    }

    /// Keeps `keep` until registration `id` is deregistered or the engine closes.
    pub(crate) fn keep(&self, id: u64, keep: Keep) {
        self.keeps().insert(id, keep);
    }

    /// Every keep-alive, for release once nothing can touch the memory (the engine shut down).
    pub(crate) fn take_all(&self) -> Vec<Keep> {
        self.keeps().drain().map(|(_, k)| k).collect()
    }

    pub(crate) fn dereg_handle(&self, py: Python<'_>, handle: MrHandle) -> PyResult<()> {
        self.dereg_claimed(py, handle, false)
    }

    /// [`dereg_handle`](Self::dereg_handle); `gone_ok`: a region deregistered already (by
    /// another thread, meanwhile) is not an error (`__exit__`).
    fn dereg_claimed(&self, py: Python<'_>, handle: MrHandle, gone_ok: bool) -> PyResult<()> {
        // Claimed before deregistering: a second caller (another thread's `dereg`, or
        // `__exit__` after one) finds nothing and is refused, instead of releasing the memory
        // while this deregistration still runs and the NIC may still write into it.
        let Some(keep) = self.keeps().remove(&handle.id()) else {
            if gone_ok {
                return Ok(());
            }
            // Closed: every registration went with the engine.
            self.engine(py)?;
            return Err(errors::invalid(
                py,
                "the region is not registered (deregistered already?)",
            ));
        };
        // Closed meanwhile: the engine is taken out only after its shutdown, so it touches
        // no memory and `keep` may go.
        let engine = self.engine(py)?;
        let result = py.detach(|| engine.dereg_mr(handle));
        // Whatever it returned, no NIC touches the memory any more: release the exporter.
        drop(keep);
        result.or_raise(py)
    }
}

/// What keeps a registered object's memory allocated and in place.
pub(crate) enum Keep {
    /// An exported buffer (the exporter cannot resize or free it while exported).
    Buffer(#[allow(dead_code)] PyUntypedBuffer),
    /// An unconsumed DLPack capsule (its destructor frees the tensor view) and the tensor.
    DlPack(#[allow(dead_code)] Py<PyAny>, #[allow(dead_code)] Py<PyAny>),
    /// `reg_mr_raw`: whatever the caller passed as `keepalive`.
    Raw(#[allow(dead_code)] Option<Py<PyAny>>),
}

/// A registered range, as found in an object.
pub(crate) struct Exported {
    pub(crate) ptr: u64,
    pub(crate) nbytes: u64,
    pub(crate) device: Device,
    pub(crate) keep: Keep,
    /// Whether the exporter lets its memory be written (a `bytes` object or a read-only mmap
    /// does not): only such memory may be the destination of a read.
    pub(crate) writable: bool,
    /// For exporters whose storage can move under the registration (a torch tensor's
    /// `resize_` or `set_` reallocates it): the storage's address when registered.
    pub(crate) storage: Option<StorageWitness>,
}

/// Where a torch-like exporter's storage was when it was registered (`untyped_storage()
/// .data_ptr()`): if it is elsewhere later, the registered memory was freed or abandoned.
/// Checked whenever the region is used locally; a peer writing into it cannot be stopped,
/// which is why the contract (docs/python.md) is to deregister before resizing.
pub(crate) struct StorageWitness {
    exporter: Py<PyAny>,
    registered_at: u64,
}

impl StorageWitness {
    /// The witness of `obj`, if it has a torch-style `untyped_storage()`.
    fn of(obj: &Bound<'_, PyAny>) -> PyResult<Option<Self>> {
        if !obj.hasattr("untyped_storage")? {
            return Ok(None);
        }
        Ok(Some(Self {
            exporter: obj.clone().unbind(),
            registered_at: storage_ptr(obj)?,
        }))
    }

    /// `InvalidArgumentError` if the storage moved since registration.
    pub(crate) fn check(&self, py: Python<'_>) -> PyResult<()> {
        let now = storage_ptr(self.exporter.bind(py))?;
        if now == self.registered_at {
            return Ok(());
        }
        Err(errors::invalid(
            py,
            format!(
                "the {} registered here was resized or re-pointed after registration (its storage moved from {:#x} to {:#x}): the registered memory may be freed; deregister the region before resizing, and register the tensor again",
                type_name(self.exporter.bind(py)),
                self.registered_at,
                now
            ),
        ))
    }
}

fn storage_ptr(obj: &Bound<'_, PyAny>) -> PyResult<u64> {
    obj.call_method0("untyped_storage")?
        .call_method0("data_ptr")?
        .extract()
}

/// The `access=` argument: what peers may do.
pub(crate) fn parse_access(py: Python<'_>, access: &str) -> PyResult<Option<RemoteAccess>> {
    match access {
        "write" => Ok(Some(RemoteAccess::WRITE)),
        "read" => Ok(Some(RemoteAccess::READ)),
        "read_write" | "rw" => Ok(Some(RemoteAccess::READ_WRITE)),
        "local" | "none" => Ok(None),
        other => Err(errors::invalid(
            py,
            format!("access {other:?}: expected \"write\", \"read\", \"read_write\" or \"local\""),
        )),
    }
}

/// `"cpu"`, `"cuda"`, `"cuda:N"` (or an `int` N for CUDA device N).
pub(crate) fn parse_device(obj: &Bound<'_, PyAny>) -> PyResult<Device> {
    let py = obj.py();
    if let Ok(n) = obj.extract::<u32>() {
        return Ok(Device::Cuda(n));
    }
    let text: String = obj.extract().map_err(|_| {
        errors::invalid(
            py,
            format!(
                "device must be \"cpu\", \"cuda:N\" or an int, not {}",
                type_name(obj)
            ),
        )
    })?;
    match text.as_str() {
        "cpu" | "host" => Ok(Device::Host),
        "cuda" => Ok(Device::Cuda(0)),
        t => t
            .strip_prefix("cuda:")
            .and_then(|n| n.parse().ok())
            .map(Device::Cuda)
            .ok_or_else(|| {
                errors::invalid(py, format!("device {t:?}: expected \"cpu\" or \"cuda:N\""))
            }),
    }
}

fn device_name(d: Device) -> String {
    match d {
        Device::Host => "cpu".into(),
        Device::Cuda(n) => format!("cuda:{n}"),
    }
}

/// The memory of `obj`: DLPack for device memory (and for objects without the buffer
/// protocol, such as torch tensors), else the buffer protocol. A region peers may write
/// must be writable.
pub(crate) fn export(obj: &Bound<'_, PyAny>, peers_write: bool) -> PyResult<Exported> {
    let py = obj.py();
    let dl_device: Option<(i32, i32)> = if obj.hasattr("__dlpack_device__")? {
        Some(obj.call_method0("__dlpack_device__")?.extract()?)
    } else {
        None
    };
    let on_cpu = dl_device.is_none_or(|(t, _)| t == DL_CPU || t == DL_CUDA_HOST);
    if on_cpu {
        if let Ok(buf) = PyUntypedBuffer::get(obj) {
            if !buf.is_c_contiguous() {
                return Err(errors::invalid(
                    py,
                    format!(
                        "the {} is not contiguous: register a contiguous buffer",
                        type_name(obj)
                    ),
                ));
            }
            if peers_write && buf.readonly() {
                return Err(errors::invalid(
                    py,
                    format!("the {} is read-only, and peers may write into this region: register it with access=\"read\" or \"local\", or pass a writable buffer", type_name(obj)),
                ));
            }
            let writable = !buf.readonly();
            return Ok(Exported {
                ptr: buf.buf_ptr() as u64,
                nbytes: buf.len_bytes() as u64,
                device: Device::Host,
                keep: Keep::Buffer(buf),
                writable,
                storage: None,
            });
        }
    }
    if dl_device.is_none() && !obj.hasattr("__dlpack__")? {
        return Err(errors::invalid(
            py,
            format!("cannot register a {}: it exports neither DLPack (__dlpack__) nor the buffer protocol", type_name(obj)),
        ));
    }
    let capsule = obj.call_method0("__dlpack__")?;
    let cap = capsule.cast::<PyCapsule>().map_err(|_| {
        errors::invalid(
            py,
            format!("{}.__dlpack__() did not return a capsule", type_name(obj)),
        )
    })?;
    let view = ffi::read_dlpack(cap)?;
    let device = match view.device_type {
        DL_CPU | DL_CUDA_HOST => Device::Host,
        DL_CUDA | DL_CUDA_MANAGED => Device::Cuda(u32::try_from(view.device_id).unwrap_or(0)),
        other => {
            return Err(errors::raise(
                py,
                "NotAvailableError",
                format!("DLPack device type {other} cannot be registered (CPU, CUDA, CUDA host and managed memory can)"),
            ))
        }
    };
    Ok(Exported {
        ptr: view.ptr,
        nbytes: view.nbytes,
        device,
        keep: Keep::DlPack(capsule.unbind(), obj.clone().unbind()),
        // An unversioned DLPack tensor carries no read-only flag: its producer's tensors are
        // writable (torch, numpy arrays that are not read-only take the buffer path above).
        writable: true,
        storage: StorageWitness::of(obj)?,
    })
}

/// A registered region. `desc` is what peers need to write into (or read) it; pass the
/// region itself as the local side of a transfer. Deregister with `dereg()` (or use it as a
/// context manager); the engine deregisters what is left when it closes.
#[pyclass(module = "xfer", frozen)]
pub(crate) struct MemoryRegion {
    /// Its engine's registrations (for `dereg`, and to tell its engine from others).
    pub(crate) owner: Arc<Registrations>,
    /// The engine object, kept alive as long as the region (as a Python reference would).
    pub(crate) _engine: Py<PyAny>,
    pub(crate) handle: engine_core::MrHandle,
    pub(crate) desc: Option<engine_core::MrDesc>,
    pub(crate) ptr: u64,
    pub(crate) nbytes: u64,
    pub(crate) device: Device,
    /// Whether its memory may be written (the destination of a read).
    pub(crate) writable: bool,
    /// Where a torch tensor's storage was at registration (checked at each local use).
    pub(crate) storage: Option<StorageWitness>,
}

impl MemoryRegion {
    pub(crate) fn desc_or_err(&self, py: Python<'_>) -> PyResult<engine_core::MrDesc> {
        self.desc.clone().ok_or_else(|| {
            errors::invalid(
                py,
                "this region was registered with access=\"local\": peers have no descriptor of it",
            )
        })
    }
}

#[pymethods]
impl MemoryRegion {
    /// The descriptor to send to peers (`bytes(region.desc)`).
    #[getter]
    fn desc(&self, py: Python<'_>) -> PyResult<MrDesc> {
        self.desc_or_err(py).map(MrDesc)
    }

    /// The first byte's address.
    #[getter]
    fn ptr(&self) -> u64 {
        self.ptr
    }

    /// Length in bytes.
    #[getter]
    fn nbytes(&self) -> u64 {
        self.nbytes
    }

    /// `"cpu"` or `"cuda:N"`.
    #[getter]
    fn device(&self) -> String {
        device_name(self.device)
    }

    /// Whether it is still registered.
    #[getter]
    fn registered(&self) -> bool {
        self.owner.is_registered(self.handle.id())
    }

    /// Deregisters it (waits until no NIC touches the memory; releases the GIL meanwhile),
    /// then releases the exporting object.
    fn dereg(&self, py: Python<'_>) -> PyResult<()> {
        self.owner.dereg_handle(py, self.handle)
    }

    fn __enter__(slf: Py<Self>) -> Py<Self> {
        slf
    }

    #[pyo3(signature = (*_args))]
    fn __exit__(&self, py: Python<'_>, _args: &Bound<'_, pyo3::types::PyTuple>) -> PyResult<bool> {
        self.owner.dereg_claimed(py, self.handle, true)?;
        Ok(false)
    }

    fn __repr__(&self) -> String {
        format!(
            "<xfer.MemoryRegion {} bytes at {:#x} on {}>",
            self.nbytes,
            self.ptr,
            device_name(self.device)
        )
    }
}

/// An `MrDesc` from an `MrDesc`, a `MemoryRegion` (its descriptor) or bytes.
pub(crate) fn desc_of(obj: &Bound<'_, PyAny>) -> PyResult<engine_core::MrDesc> {
    let py = obj.py();
    if let Ok(d) = obj.cast::<MrDesc>() {
        return Ok(d.get().0.clone());
    }
    if let Ok(r) = obj.cast::<MemoryRegion>() {
        return r.get().desc_or_err(py);
    }
    if obj.is_instance_of::<PyBytes>() {
        return MrDesc::new(py, obj).map(|d| d.0);
    }
    Err(errors::invalid(
        py,
        format!(
            "expected an xfer.MrDesc (or its bytes, or a MemoryRegion), not {}",
            type_name(obj)
        ),
    ))
}
