//! Why one file: it is the `xfer.TransferEngine` class. PyO3 takes one `#[pymethods]` block per
//! class (without its `multiple-pymethods` feature, which needs `inventory` across the extension),
//! so every Python method of the class lives in that one block; the helpers beside it are only
//! the argument conversions those methods share.
//!
//! `xfer.TransferEngine`: the engine, its registrations, peer groups and watchers.

use std::path::Path;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use engine_core::{MrHandle, Pages, ScatterDst};
use pyo3::prelude::*;
use pyo3::types::{PyBytes, PyDict};

use crate::errors::{self, OrRaise};
use crate::memory::{self, desc_of, Keep, MemoryRegion, Registrations};
use crate::transfer::{call_reporting, Transfer};
use crate::values::{self, addr_of, indices_of};

type Engine = Arc<engine_core::TransferEngine>;

/// Point-to-point RDMA transfers (see the package docs for the model: reliable but
/// unordered delivery, completion on the receiver counted by immediates).
///
/// `TransferEngine(config=None)`: `config` is a path to a TOML file, a dict with the same
/// structure, or `None` (`$XFER_CONFIG`, else the built-in mock backend). Close it with
/// `close()` or a `with` block; garbage collection closes it too.
#[pyclass(module = "xfer", frozen)]
pub(crate) struct TransferEngine {
    /// The engine and its registrations' keep-alives, shared with its regions.
    reg: Arc<Registrations>,
}

/// A set of peers from `add_peer_group` (checks that a scatter or barrier stays inside it).
#[pyclass(module = "xfer", frozen)]
pub(crate) struct PeerGroup(engine_core::PeerGroupHandle);

/// A uvm watcher slot: a 64-bit counter in memory a GPU kernel can write
/// (`device_ptr`, or `host_ptr` when it lives in host memory); the callback gets
/// `(old, new)` whenever the value changes, on the watcher thread.
#[pyclass(module = "xfer", frozen)]
pub(crate) struct Watcher(Mutex<Option<engine_core::Watcher>>);

impl TransferEngine {
    fn engine(&self, py: Python<'_>) -> PyResult<Engine> {
        self.reg.engine(py)
    }

    fn register(
        slf: &Bound<'_, Self>,
        exported: memory::Exported,
        access: Option<engine_core::RemoteAccess>,
    ) -> PyResult<MemoryRegion> {
        let py = slf.py();
        let this = slf.get();
        let engine = this.engine(py)?;
        let (ptr, nbytes, device, writable, storage) = (
            exported.ptr,
            exported.nbytes,
            exported.device,
            exported.writable,
            exported.storage,
        );
        // SAFETY: `exported.keep` (the exporter's buffer or capsule, or the caller's keepalive
        // for raw registrations) is stored under the handle below and released only after
        // `dereg_mr` returned or the engine closed.
        let (handle, desc) = py
            .detach(|| unsafe { crate::ffi::register(&engine, ptr, nbytes, device, access) })
            .or_raise(py)?;
        this.reg.keep(handle.id(), exported.keep);
        Ok(MemoryRegion {
            owner: Arc::clone(&this.reg),
            _engine: slf.clone().into_any().unbind(),
            handle,
            desc,
            ptr,
            nbytes,
            device,
            writable,
            storage,
        })
    }

    /// Refuses a region whose memory is read-only as the destination of a read: the NIC would
    /// write into memory its owner promised nobody writes (a `bytes` object is shared and
    /// immutable; a read-only mapping faults).
    fn check_read_destination(&self, py: Python<'_>, region: &Bound<'_, PyAny>) -> PyResult<()> {
        if let Ok(r) = region.cast::<MemoryRegion>() {
            if !r.get().writable {
                return Err(errors::invalid(
                    py,
                    "the region's memory is read-only (a bytes object, a read-only buffer or mapping): it cannot be the destination of a read; register a writable buffer",
                ));
            }
        }
        Ok(())
    }

    /// The region behind a `MemoryRegion` argument, checked to belong to this engine.
    fn local(&self, py: Python<'_>, region: &Bound<'_, PyAny>) -> PyResult<(MrHandle, u64)> {
        let r = region.cast::<MemoryRegion>().map_err(|_| {
            errors::invalid(
                py,
                format!(
                    "expected an xfer.MemoryRegion of this engine, not {}",
                    values::type_name(region)
                ),
            )
        })?;
        let r = r.get();
        if !Arc::ptr_eq(&r.owner, &self.reg) {
            return Err(errors::invalid(
                py,
                "the MemoryRegion belongs to another engine",
            ));
        }
        if let Some(storage) = &r.storage {
            storage.check(py)?;
        }
        Ok((r.handle, r.nbytes))
    }

    fn close_now(&self, py: Python<'_>) {
        // Shut down before the engine is taken out: a `dereg()` on another thread that finds
        // no engine releases its memory at once, so "no engine" must mean "no NIC holds
        // anything" (issue 56: taken first, a dereg racing close released memory the NIC
        // could still write). One that finds it still there waits in `dereg_mr` for the
        // Domains to close.
        let running = self
            .reg
            .engine
            .read()
            .unwrap_or_else(|p| p.into_inner())
            .clone();
        let mut abandoned = false;
        if let Some(engine) = running {
            // Other threads may be inside calls that hold the engine (a clone of it): stop
            // it outright — worker and callback threads joined (they may be waiting for the
            // GIL, so it is released), Domains closed, pending work failed with Shutdown,
            // waiters woken — so that no NIC touches any registered memory before the
            // keep-alives below are released.
            py.detach(|| engine.shutdown());
            abandoned = engine.domains_abandoned();
        }
        let engine = self
            .reg
            .engine
            .write()
            .unwrap_or_else(|p| p.into_inner())
            .take();
        if let Some(engine) = engine {
            py.detach(move || drop(engine));
            // What the close failed has had its callbacks run when close() returns.
            crate::transfer::drain_callbacks(py);
        }
        // Only now: nothing can write into these buffers any more — unless a Domain
        // panicked while closing and was abandoned with its registrations: then they stay.
        let keeps: Vec<Keep> = self.reg.take_all();
        if abandoned {
            std::mem::forget(keeps);
        } else {
            drop(keeps);
        }
    }
}

impl Drop for TransferEngine {
    fn drop(&mut self) {
        // As in `close`: shut down before the engine is taken out (a region's `dereg()` that
        // finds none releases its memory at once).
        let running = self
            .reg
            .engine
            .read()
            .unwrap_or_else(|p| p.into_inner())
            .clone();
        if let Some(engine) = running {
            // Collected without close(): the engine's threads may want the GIL to finish
            // their callbacks, so it is released while they are joined.
            Python::attach(|py| py.detach(move || engine.shutdown()));
        }
        let engine = self
            .reg
            .engine
            .write()
            .unwrap_or_else(|p| p.into_inner())
            .take();
        if let Some(engine) = engine {
            Python::attach(|py| py.detach(move || drop(engine)));
        }
    }
}

/// The completion of a transfer, with its notification (`notify=`) to `peer` attached.
fn completion(
    py: Python<'_>,
    engine: &Engine,
    (kind, nbytes): (&'static str, u64),
    on_done: Option<Py<PyAny>>,
    notify: Option<(&engine_core::NetAddr, &Bound<'_, PyAny>)>,
) -> PyResult<(Transfer, engine_core::OnDone)> {
    let (t, done) = Transfer::new(kind, nbytes, on_done);
    let (t, done) = match notify {
        Some((peer, id)) => {
            let id = values::bytes_of(id)?;
            (
                t.notifying(),
                engine.notify_when_done(peer, &id, done).or_raise(py)?,
            )
        }
        None => (t, done),
    };
    Ok(t.cancellable(engine, done))
}

/// Offsets of a paged transfer: pages from any int sequence or integer array.
fn pages(indices: &Bound<'_, PyAny>, stride: u64, offset: u64) -> PyResult<Pages> {
    Ok(Pages {
        indices: indices_of(indices)?,
        stride,
        offset,
    })
}

/// The arguments a paged write and a paged read share: the local region and its pages, the
/// peer's region and its pages (page `n` at `offset + n * stride`, stride defaulting to the
/// page length), the notification and the callback.
struct PagedArgs<'a, 'py> {
    page_len: u64,
    local: (
        &'a Bound<'py, PyAny>,
        &'a Bound<'py, PyAny>,
        Option<u64>,
        u64,
    ),
    remote: (
        &'a Bound<'py, PyAny>,
        &'a Bound<'py, PyAny>,
        Option<u64>,
        u64,
    ),
    notify: Option<&'a Bound<'py, PyAny>>,
    on_done: Option<Py<PyAny>>,
}

/// What a paged transfer is submitted with, once its arguments are checked.
struct Paged {
    engine: Engine,
    handle: MrHandle,
    remote: engine_core::MrDesc,
    local_pages: Pages,
    remote_pages: Pages,
    transfer: Transfer,
    done: engine_core::OnDone,
}

impl TransferEngine {
    fn paged(&self, py: Python<'_>, kind: &'static str, a: PagedArgs<'_, '_>) -> PyResult<Paged> {
        let engine = self.engine(py)?;
        let (handle, _) = self.local(py, a.local.0)?;
        let remote = desc_of(a.remote.0)?;
        let local_pages = pages(a.local.1, a.local.2.unwrap_or(a.page_len), a.local.3)?;
        let remote_pages = pages(a.remote.1, a.remote.2.unwrap_or(a.page_len), a.remote.3)?;
        let nbytes = a.page_len.saturating_mul(local_pages.indices.len() as u64);
        let notify = a.notify.map(|id| (remote.owner(), id));
        let (transfer, done) = completion(py, &engine, (kind, nbytes), a.on_done, notify)?;
        Ok(Paged {
            engine,
            handle,
            remote,
            local_pages,
            remote_pages,
            transfer,
            done,
        })
    }
}

#[pymethods]
impl TransferEngine {
    #[new]
    #[pyo3(signature = (config=None))]
    fn new(py: Python<'_>, config: Option<&Bound<'_, PyAny>>) -> PyResult<Self> {
        let config = match config {
            None => engine_core::Config::load(None),
            Some(c) => {
                if let Ok(d) = c.cast::<PyDict>() {
                    let text = values::toml_of_dict(d)?;
                    engine_core::Config::from_toml(&text, Path::new("<dict>"))
                } else {
                    let path: std::path::PathBuf = c.extract().map_err(|_| {
                        errors::raise(
                            py,
                            "ConfigError",
                            format!(
                                "config must be a path, a dict or None, not {}",
                                values::type_name(c)
                            ),
                        )
                    })?;
                    engine_core::Config::from_file(&path)
                }
            }
        }
        .map_err(|e| errors::to_py(py, e.into()))?;
        let engine = py
            .detach(|| engine_core::TransferEngine::open(&config))
            .or_raise(py)?;
        Ok(Self {
            reg: Arc::new(Registrations::new(engine)),
        })
    }

    /// This engine's address (its first NIC's), as bytes: what peers need to reach it.
    #[getter]
    fn main_address<'py>(&self, py: Python<'py>) -> PyResult<Bound<'py, PyBytes>> {
        Ok(PyBytes::new(
            py,
            &self.engine(py)?.main_address().to_bytes(),
        ))
    }

    /// The file of the cluster secret the backend was given (`[security] secret_file`, else
    /// `$XFER_SECRET_FILE` when the engine opened), or `None`. A component whose rendezvous
    /// uses a secret compares it with its own, so a half-secured set-up is refused by name.
    #[getter]
    fn secret_file(&self, py: Python<'_>) -> PyResult<Option<std::path::PathBuf>> {
        Ok(self
            .engine(py)?
            .secret_file()
            .map(std::path::Path::to_path_buf))
    }

    /// Every NIC's address, in NIC order.
    #[getter]
    fn nic_addresses<'py>(&self, py: Python<'py>) -> PyResult<Vec<Bound<'py, PyBytes>>> {
        let e = self.engine(py)?;
        Ok(e.nic_addresses()
            .iter()
            .map(|a| PyBytes::new(py, &a.to_bytes()))
            .collect())
    }

    /// How many NICs the engine stripes over.
    #[getter]
    fn nic_count(&self, py: Python<'_>) -> PyResult<usize> {
        Ok(self.engine(py)?.nic_count())
    }

    /// The backend's name (`mock`, `verbs`, `efa`, or a plugin's).
    #[getter]
    fn backend(&self, py: Python<'_>) -> PyResult<String> {
        Ok(self.engine(py)?.backend().to_owned())
    }

    /// Whether `close()` ran.
    #[getter]
    fn closed(&self) -> bool {
        self.reg
            .engine
            .read()
            .unwrap_or_else(|p| p.into_inner())
            .is_none()
    }

    /// Registers an object's memory: anything exporting DLPack (numpy, torch; CPU or CUDA,
    /// the device taken from DLPack) or the buffer protocol (bytearray, memoryview, mmap).
    /// `access`: what peers may do — `"write"` (default), `"read"`, `"read_write"`, or
    /// `"local"` (a source of writes / destination of reads only; no descriptor). The region
    /// holds the object until it is deregistered.
    #[pyo3(signature = (obj, *, access="write"))]
    fn reg_mr(
        slf: &Bound<'_, Self>,
        obj: &Bound<'_, PyAny>,
        access: &str,
    ) -> PyResult<MemoryRegion> {
        let access = memory::parse_access(slf.py(), access)?;
        let exported = memory::export(obj, access.is_some_and(|a| a.write))?;
        Self::register(slf, exported, access)
    }

    /// Registers `nbytes` at address `ptr` on `device` (`"cpu"`, `"cuda:N"`). The caller
    /// keeps that memory allocated until the region is deregistered (`keepalive` is held
    /// until then, e.g. the object owning it).
    #[pyo3(signature = (ptr, nbytes, device=None, *, access="write", keepalive=None))]
    fn reg_mr_raw(
        slf: &Bound<'_, Self>,
        py: Python<'_>,
        ptr: u64,
        nbytes: u64,
        device: Option<Bound<'_, PyAny>>,
        access: &str,
        keepalive: Option<Py<PyAny>>,
    ) -> PyResult<MemoryRegion> {
        let access = memory::parse_access(py, access)?;
        let device = match device {
            Some(d) => memory::parse_device(&d)?,
            None => engine_core::Device::Host,
        };
        let exported = memory::Exported {
            ptr,
            nbytes,
            device,
            keep: Keep::Raw(keepalive),
            // Raw memory: the caller vouches for it (as for its lifetime).
            writable: true,
            storage: None,
        };
        Self::register(slf, exported, access)
    }

    /// Deregisters a region (same as `region.dereg()`).
    fn dereg_mr(&self, py: Python<'_>, region: &Bound<'_, PyAny>) -> PyResult<()> {
        let (handle, _) = self.local(py, region)?;
        self.reg.dereg_handle(py, handle)
    }

    /// Writes `nbytes` (default: the rest of `src` after `src_offset`) from the local region
    /// `src` to `dst` (an `MrDesc`, its bytes, or a local region). With `imm`, every write
    /// carries it: the receiver counts `expected_arrivals(nbytes)` of them.
    #[pyo3(signature = (src, dst, nbytes=None, *, src_offset=0, dst_offset=0, imm=None, notify=None, on_done=None))]
    #[allow(clippy::too_many_arguments)]
    fn submit_single_write(
        &self,
        py: Python<'_>,
        src: &Bound<'_, PyAny>,
        dst: &Bound<'_, PyAny>,
        nbytes: Option<u64>,
        src_offset: u64,
        dst_offset: u64,
        imm: Option<u32>,
        notify: Option<&Bound<'_, PyAny>>,
        on_done: Option<Py<PyAny>>,
    ) -> PyResult<Transfer> {
        let engine = self.engine(py)?;
        let (handle, len) = self.local(py, src)?;
        let dst = desc_of(dst)?;
        let nbytes = nbytes.unwrap_or_else(|| len.saturating_sub(src_offset));
        let notify = notify.map(|id| (dst.owner(), id));
        let (t, done) = completion(py, &engine, ("write", nbytes), on_done, notify)?;
        engine
            .submit_single_write(nbytes, imm, (handle, src_offset), (&dst, dst_offset), done)
            .or_raise(py)?;
        Ok(t)
    }

    /// Writes pages of `page_len` bytes: source page `src_pages[i]` to destination page
    /// `dst_pages[i]` (indices as any int sequence or integer numpy array). Page `n` starts
    /// at `offset + n * stride` (stride defaults to `page_len`).
    #[pyo3(signature = (page_len, src, src_pages, dst, dst_pages, *, src_stride=None, dst_stride=None, src_offset=0, dst_offset=0, imm=None, notify=None, on_done=None))]
    #[allow(clippy::too_many_arguments)]
    fn submit_paged_writes(
        &self,
        py: Python<'_>,
        page_len: u64,
        src: &Bound<'_, PyAny>,
        src_pages: &Bound<'_, PyAny>,
        dst: &Bound<'_, PyAny>,
        dst_pages: &Bound<'_, PyAny>,
        src_stride: Option<u64>,
        dst_stride: Option<u64>,
        src_offset: u64,
        dst_offset: u64,
        imm: Option<u32>,
        notify: Option<&Bound<'_, PyAny>>,
        on_done: Option<Py<PyAny>>,
    ) -> PyResult<Transfer> {
        let p = self.paged(
            py,
            "paged write",
            PagedArgs {
                page_len,
                local: (src, src_pages, src_stride, src_offset),
                remote: (dst, dst_pages, dst_stride, dst_offset),
                notify,
                on_done,
            },
        )?;
        p.engine
            .submit_paged_writes(
                page_len,
                imm,
                (p.handle, &p.local_pages),
                (&p.remote, &p.remote_pages),
                p.done,
            )
            .or_raise(py)?;
        Ok(p.transfer)
    }

    /// Reads `nbytes` (default: the rest of `local`) of a peer's region `remote` (an
    /// `MrDesc` registered readable) into the local region `local`.
    #[pyo3(signature = (local, remote, nbytes=None, *, local_offset=0, remote_offset=0, notify=None, on_done=None))]
    #[allow(clippy::too_many_arguments)]
    fn submit_single_read(
        &self,
        py: Python<'_>,
        local: &Bound<'_, PyAny>,
        remote: &Bound<'_, PyAny>,
        nbytes: Option<u64>,
        local_offset: u64,
        remote_offset: u64,
        notify: Option<&Bound<'_, PyAny>>,
        on_done: Option<Py<PyAny>>,
    ) -> PyResult<Transfer> {
        let engine = self.engine(py)?;
        let (handle, len) = self.local(py, local)?;
        self.check_read_destination(py, local)?;
        let remote = desc_of(remote)?;
        let nbytes = nbytes.unwrap_or_else(|| len.saturating_sub(local_offset));
        let notify = notify.map(|id| (remote.owner(), id));
        let (t, done) = completion(py, &engine, ("read", nbytes), on_done, notify)?;
        engine
            .submit_single_read(
                nbytes,
                (handle, local_offset),
                (&remote, remote_offset),
                done,
            )
            .or_raise(py)?;
        Ok(t)
    }

    /// Reads pages: remote page `remote_pages[i]` into local page `local_pages[i]`.
    #[pyo3(signature = (page_len, local, local_pages, remote, remote_pages, *, local_stride=None, remote_stride=None, local_offset=0, remote_offset=0, notify=None, on_done=None))]
    #[allow(clippy::too_many_arguments)]
    fn submit_paged_reads(
        &self,
        py: Python<'_>,
        page_len: u64,
        local: &Bound<'_, PyAny>,
        local_pages: &Bound<'_, PyAny>,
        remote: &Bound<'_, PyAny>,
        remote_pages: &Bound<'_, PyAny>,
        local_stride: Option<u64>,
        remote_stride: Option<u64>,
        local_offset: u64,
        remote_offset: u64,
        notify: Option<&Bound<'_, PyAny>>,
        on_done: Option<Py<PyAny>>,
    ) -> PyResult<Transfer> {
        self.check_read_destination(py, local)?;
        let p = self.paged(
            py,
            "paged read",
            PagedArgs {
                page_len,
                local: (local, local_pages, local_stride, local_offset),
                remote: (remote, remote_pages, remote_stride, remote_offset),
                notify,
                on_done,
            },
        )?;
        p.engine
            .submit_paged_reads(
                page_len,
                (p.handle, &p.local_pages),
                (&p.remote, &p.remote_pages),
                p.done,
            )
            .or_raise(py)?;
        Ok(p.transfer)
    }

    /// A batch of writes from `src` into one peer region `dst`, as NIXL-style descriptor
    /// lists: entry `i` writes `nbytes[i]` bytes from `src_offsets[i]` to `dst_offsets[i]`.
    /// Each list is a numpy integer array or any int sequence; `nbytes` may be one int for
    /// all. One `Transfer` for the batch; with `imm`, the receiver counts
    /// `expected_arrivals(scatter_lens=nbytes)` arrivals.
    #[pyo3(signature = (src, dst, src_offsets, dst_offsets, nbytes, *, imm=None, notify=None, on_done=None))]
    #[allow(clippy::too_many_arguments)]
    fn submit_writes(
        &self,
        py: Python<'_>,
        src: &Bound<'_, PyAny>,
        dst: &Bound<'_, PyAny>,
        src_offsets: &Bound<'_, PyAny>,
        dst_offsets: &Bound<'_, PyAny>,
        nbytes: &Bound<'_, PyAny>,
        imm: Option<u32>,
        notify: Option<&Bound<'_, PyAny>>,
        on_done: Option<Py<PyAny>>,
    ) -> PyResult<Transfer> {
        let engine = self.engine(py)?;
        let (handle, _) = self.local(py, src)?;
        let dst = desc_of(dst)?;
        let so = values::u64s_of(src_offsets, "src_offsets", None)?;
        let dof = values::u64s_of(dst_offsets, "dst_offsets", None)?;
        let lens = values::u64s_of(nbytes, "nbytes", Some(so.len()))?;
        if so.len() != dof.len() || so.len() != lens.len() {
            return Err(errors::invalid(
                py,
                format!(
                    "descriptor lists of different lengths: {} src_offsets, {} dst_offsets, {} nbytes",
                    so.len(),
                    dof.len(),
                    lens.len()
                ),
            ));
        }
        let list: Vec<ScatterDst> = so
            .iter()
            .zip(&dof)
            .zip(&lens)
            .map(|((&src_offset, &dst_offset), &len)| ScatterDst {
                len,
                src_offset,
                dst: dst.clone(),
                dst_offset,
            })
            .collect();
        let total = lens.iter().sum();
        let notify = notify.map(|id| (dst.owner(), id));
        let (t, done) = completion(py, &engine, ("batch of writes", total), on_done, notify)?;
        engine
            .submit_scatter(None, done, imm, handle, &list)
            .or_raise(py)?;
        Ok(t)
    }

    /// Registers a set of peers (addresses as bytes or `NetAddr`): scatters and barriers
    /// given the group must stay inside it.
    fn add_peer_group(&self, py: Python<'_>, peers: &Bound<'_, PyAny>) -> PyResult<PeerGroup> {
        let engine = self.engine(py)?;
        let addrs = peers
            .try_iter()?
            .map(|p| addr_of(&p?))
            .collect::<PyResult<Vec<_>>>()?;
        engine.add_peer_group(addrs).map(PeerGroup).or_raise(py)
    }

    /// Writes pieces of `src` to many destinations: `dsts` is a list of
    /// `(nbytes, src_offset, dst, dst_offset)` tuples (`dst` an `MrDesc`).
    #[pyo3(signature = (src, dsts, *, imm=None, group=None, on_done=None))]
    fn submit_scatter(
        &self,
        py: Python<'_>,
        src: &Bound<'_, PyAny>,
        dsts: &Bound<'_, PyAny>,
        imm: Option<u32>,
        group: Option<&Bound<'_, PeerGroup>>,
        on_done: Option<Py<PyAny>>,
    ) -> PyResult<Transfer> {
        let engine = self.engine(py)?;
        let (handle, _) = self.local(py, src)?;
        let mut list = Vec::new();
        for item in dsts.try_iter()? {
            let item = item?;
            let (len, src_offset, dst, dst_offset): (u64, u64, Bound<'_, PyAny>, u64) =
                item.extract().map_err(|_| {
                    errors::invalid(
                        py,
                        "each scatter destination is a tuple (nbytes, src_offset, dst, dst_offset)",
                    )
                })?;
            list.push(ScatterDst {
                len,
                src_offset,
                dst: desc_of(&dst)?,
                dst_offset,
            });
        }
        let nbytes = list.iter().map(|d| d.len).sum();
        let (t, done) = Transfer::new("scatter", nbytes, on_done);
        let (t, done) = t.cancellable(&engine, done);
        engine
            .submit_scatter(group.map(|g| g.get().0), done, imm, handle, &list)
            .or_raise(py)?;
        Ok(t)
    }

    /// A zero-byte write carrying `imm` to the owner of each descriptor in `dsts`.
    #[pyo3(signature = (imm, dsts, *, group=None, on_done=None))]
    fn submit_barrier(
        &self,
        py: Python<'_>,
        imm: u32,
        dsts: &Bound<'_, PyAny>,
        group: Option<&Bound<'_, PeerGroup>>,
        on_done: Option<Py<PyAny>>,
    ) -> PyResult<Transfer> {
        let engine = self.engine(py)?;
        let list = dsts
            .try_iter()?
            .map(|d| desc_of(&d?))
            .collect::<PyResult<Vec<_>>>()?;
        let (t, done) = Transfer::new("barrier", 0, on_done);
        let (t, done) = t.cancellable(&engine, done);
        engine
            .submit_barrier(group.map(|g| g.get().0), done, imm, &list)
            .or_raise(py)?;
        Ok(t)
    }

    /// Sends a message (bytes-like, at most `worker.max_message` bytes) to `peer`; it lands
    /// in the peer's `submit_recvs` handler.
    #[pyo3(signature = (peer, data, *, on_done=None))]
    fn submit_send(
        &self,
        py: Python<'_>,
        peer: &Bound<'_, PyAny>,
        data: &Bound<'_, PyAny>,
        on_done: Option<Py<PyAny>>,
    ) -> PyResult<Transfer> {
        let engine = self.engine(py)?;
        let peer = addr_of(peer)?;
        let data = values::bytes_of(data)?;
        let (t, done) = Transfer::new("send", data.len() as u64, on_done);
        let (t, done) = t.cancellable(&engine, done);
        engine.submit_send(&peer, &data, done).or_raise(py)?;
        Ok(t)
    }

    /// Posts `count` receive buffers of `nbytes`; `handler(message: bytes)` is called on the
    /// callback thread for each message (an exception it raises is reported, and the buffer
    /// is reposted regardless). One receive pool per engine. With `with_sender=True` it is
    /// called `handler(message, sender)`: `sender` is the sender as the transport proved it
    /// (its engine's `main_address` bytes; never read from the message), or `b""` where the
    /// backend cannot tell (EFA/libfabric today).
    #[pyo3(signature = (nbytes, count, handler, *, with_sender=false))]
    fn submit_recvs(
        &self,
        py: Python<'_>,
        nbytes: usize,
        count: usize,
        handler: Py<PyAny>,
        with_sender: bool,
    ) -> PyResult<()> {
        let engine = self.engine(py)?;
        engine
            .submit_recvs_with_sender(
                nbytes,
                count,
                move |msg: &[u8], from: Option<&engine_core::NetAddr>| {
                    Python::attach(|py| {
                        if with_sender {
                            let sender =
                                from.map(engine_core::NetAddr::to_bytes).unwrap_or_default();
                            call_reporting(py, &handler, (msg.to_vec(), sender))
                        } else {
                            call_reporting(py, &handler, msg.to_vec())
                        }
                    });
                },
            )
            .or_raise(py)
    }

    /// Completes once `count` writes carrying `imm` have landed here (counting earlier
    /// arrivals), consuming them; fails with `TimeoutError` after `timeouts.expect_ms`.
    #[pyo3(signature = (imm, count, *, on_done=None))]
    fn expect_imm_count(
        &self,
        py: Python<'_>,
        imm: u32,
        count: u64,
        on_done: Option<Py<PyAny>>,
    ) -> PyResult<Transfer> {
        let engine = self.engine(py)?;
        let (t, done) = Transfer::new("expectation", 0, on_done);
        // Cancellable too: its arrivals are then owed, as after a timeout.
        let (t, done) = t.cancellable(&engine, done);
        engine.expect_imm_count(imm, count, done).or_raise(py)?;
        Ok(t)
    }

    /// From now on an arrival of an immediate `imm` with `imm & mask == value` counts only
    /// from `senders` (NIC addresses as bytes or `NetAddr`, e.g. a peer's `MrDesc.nics`) or
    /// from a sender the transport does not name; others are refused (`imm_refused`). `None`
    /// lifts it.
    #[pyo3(signature = (mask, value, senders))]
    fn restrict_imm_senders(
        &self,
        py: Python<'_>,
        mask: u32,
        value: u32,
        senders: Option<&Bound<'_, PyAny>>,
    ) -> PyResult<()> {
        let engine = self.engine(py)?;
        engine.restrict_imm_senders(mask, value, values::addrs_of(senders)?);
        Ok(())
    }

    /// Arrivals refused by `restrict_imm_senders` so far.
    #[getter]
    fn imm_refused(&self, py: Python<'_>) -> PyResult<u64> {
        Ok(self.engine(py)?.imm_refused())
    }

    /// Calls `sink(total)` with the running total of `imm`'s arrivals (every arrival, never
    /// consumed), on the worker's side; an exception it raises is reported.
    /// A `GpuCounter` sink is set on the worker itself (a store, no GIL): the GPU path's
    /// stream waits on it.
    fn mirror_imm_count(&self, py: Python<'_>, imm: u32, sink: Py<PyAny>) -> PyResult<()> {
        let engine = self.engine(py)?;
        if let Ok(counter) = sink.bind(py).cast::<GpuCounter>() {
            let counter = Arc::clone(&counter.get().0);
            return engine
                .mirror_imm_count(imm, move |total| counter.set(total))
                .or_raise(py);
        }
        // The engine calls the mirror on its worker, which must never wait for the GIL: the
        // Python sink runs on the bindings' callback thread, in arrival order.
        let sink = Arc::new(sink);
        engine
            .mirror_imm_count(imm, move |total| {
                let sink = Arc::clone(&sink);
                crate::transfer::dispatch(Box::new(move |py| {
                    crate::transfer::call_reporting(py, &sink, (total,));
                }));
            })
            .or_raise(py)
    }

    /// Lets notifications arrive (posts `count` receive buffers for them unless
    /// `submit_recvs` made a pool). Call it before peers send `notify=` transfers here.
    #[pyo3(signature = (count=64))]
    fn listen_notifications(&self, py: Python<'_>, count: usize) -> PyResult<()> {
        let engine = self.engine(py)?;
        py.detach(|| engine.listen_notifications(count))
            .or_raise(py)
    }

    /// Every notification that arrived so far, in arrival order: their ids as bytes, or with
    /// `with_sender=True` `(id, sender)` pairs (`sender` is the peer's `main_address` bytes as
    /// the transport proved it, never the message's claim; `b""` where the backend cannot
    /// tell). A notification is seen only after every byte of the transfer it was attached to
    /// (`notify=` on a write or read) has landed here.
    #[pyo3(signature = (*, with_sender=false))]
    fn poll_notifications<'py>(
        &self,
        py: Python<'py>,
        with_sender: bool,
    ) -> PyResult<Vec<Bound<'py, PyAny>>> {
        let engine = self.engine(py)?;
        engine
            .poll_notifications()
            .iter()
            .map(|note| notification_value(py, note, with_sender))
            .collect()
    }

    /// The next notification, waiting up to `timeout` seconds (GIL released);
    /// `TimeoutError` if none comes. Its id as bytes, or `(id, sender)` with
    /// `with_sender=True`.
    #[pyo3(signature = (timeout, *, with_sender=false))]
    fn wait_notification<'py>(
        &self,
        py: Python<'py>,
        timeout: f64,
        with_sender: bool,
    ) -> PyResult<Bound<'py, PyAny>> {
        let engine = self.engine(py)?;
        let timeout = errors::timeout_of(py, "timeout", timeout)?;
        let note = py
            .detach(|| engine.wait_notification(timeout))
            .or_raise(py)?;
        notification_value(py, &note, with_sender)
    }

    /// Only notifications from `peers` (addresses as bytes or `NetAddr`) are kept from now
    /// on; others are dropped and counted in `notifications_dropped`. `None` accepts all.
    #[pyo3(signature = (peers))]
    fn restrict_notifications(
        &self,
        py: Python<'_>,
        peers: Option<&Bound<'_, PyAny>>,
    ) -> PyResult<()> {
        let engine = self.engine(py)?;
        engine.restrict_notifications(values::addrs_of(peers)?);
        Ok(())
    }

    /// Notifications dropped so far: claiming a sender other than the proven one, refused
    /// senders, or past `worker.max_notifications` queued and not taken.
    #[getter]
    fn notifications_dropped(&self, py: Python<'_>) -> PyResult<u64> {
        Ok(self.engine(py)?.notifications_dropped())
    }

    /// `async for note in engine.notifications():` the notifications as they arrive.
    fn notifications<'py>(slf: &Bound<'py, Self>) -> PyResult<Bound<'py, PyAny>> {
        slf.py()
            .import("xfer._glue")?
            .call_method1("notification_stream", (slf,))
    }

    /// A snapshot of the engine's counters as a dict (what `TransferEngine::stats` returns
    /// in Rust: `ops` per kind with `started`, `completed`, `failed` by error kind, `bytes`,
    /// `requests` and a `latency` histogram; `peers` keyed by address hex; stale
    /// completions, immediates, notifications and registrations).
    fn stats<'py>(&self, py: Python<'py>) -> PyResult<Bound<'py, PyAny>> {
        let engine = self.engine(py)?;
        let stats = py.detach(|| engine.stats()).or_raise(py)?;
        let text = serde_json::to_string(&stats)
            .map_err(|e| errors::invalid(py, format!("stats do not serialize: {e}")))?;
        py.import("json")?.call_method1("loads", (text,))
    }

    /// The peers this engine sent work to, each a dict: `address` (hex), `healthy` (false
    /// while its last finished operation failed; `last_error` says why), `ms_since_activity`,
    /// `requests`, `bytes`, `failed`.
    fn peers<'py>(&self, py: Python<'py>) -> PyResult<Bound<'py, PyAny>> {
        let engine = self.engine(py)?;
        let peers = py.detach(|| engine.peers()).or_raise(py)?;
        let listed: Vec<serde_json::Value> = peers
            .into_iter()
            .map(|(address, p)| {
                let mut v = serde_json::to_value(&p).unwrap_or_default();
                if let Some(map) = v.as_object_mut() {
                    map.insert("address".into(), address.to_string().into());
                }
                v
            })
            .collect();
        let text = serde_json::to_string(&listed)
            .map_err(|e| errors::invalid(py, format!("peers do not serialize: {e}")))?;
        py.import("json")?.call_method1("loads", (text,))
    }

    /// Arrivals of `imm` not yet consumed by an expectation.
    fn imm_count(&self, py: Python<'_>, imm: u32) -> PyResult<u64> {
        Ok(self.engine(py)?.imm_count(imm))
    }

    /// Arrivals of `imm` still owed to expectations that timed out.
    fn imm_owed(&self, py: Python<'_>, imm: u32) -> PyResult<u64> {
        Ok(self.engine(py)?.imm_owed(imm))
    }

    /// Forgets `imm`'s unconsumed arrivals and debts (see the Rust docs of `reset_imm`);
    /// returns what was cleared as a dict.
    fn reset_imm<'py>(&self, py: Python<'py>, imm: u32) -> PyResult<Bound<'py, PyDict>> {
        let report = self.engine(py)?.reset_imm(imm);
        let d = PyDict::new(py);
        d.set_item("report", format!("{report:?}"))?;
        Ok(d)
    }

    /// Operations accepted and not yet finished.
    #[getter]
    fn outstanding(&self, py: Python<'_>) -> PyResult<usize> {
        Ok(self.engine(py)?.outstanding())
    }

    /// Waits (GIL released) until fewer than `worker.max_outstanding` are outstanding.
    fn wait_for_capacity(&self, py: Python<'_>, timeout: f64) -> PyResult<()> {
        let engine = self.engine(py)?;
        let timeout = Duration::try_from_secs_f64(timeout).map_err(|_| {
            errors::invalid(py, format!("timeout {timeout} is not a number of seconds"))
        })?;
        py.detach(|| engine.wait_for_capacity(timeout)).or_raise(py)
    }

    /// `expected_arrivals` as this engine's DomainGroup plans them (its NIC count and spread
    /// policy; peers with the same config send the same shapes).
    #[pyo3(signature = (nbytes=None, *, page_len=None, pages=None, scatter_lens=None, barrier=false))]
    fn expected_arrivals(
        &self,
        py: Python<'_>,
        nbytes: Option<u64>,
        page_len: Option<u64>,
        pages: Option<u64>,
        scatter_lens: Option<Vec<u64>>,
        barrier: bool,
    ) -> PyResult<u64> {
        let engine = self.engine(py)?;
        values::arrivals(
            py,
            (nbytes, page_len, pages, scatter_lens.as_deref(), barrier),
            |shape| engine.expected_arrivals(shape),
        )
    }

    /// A watcher slot whose `callback(old, new)` runs when its value changes; return
    /// `False` to stop watching (anything else keeps it).
    fn alloc_uvm_watcher(&self, py: Python<'_>, callback: Py<PyAny>) -> PyResult<Watcher> {
        let engine = self.engine(py)?;
        let w = py
            .detach(|| {
                engine.alloc_uvm_watcher(move |old, new| {
                    Python::attach(|py| match callback.call1(py, (old, new)) {
                        Ok(r) if r.bind(py).is(pyo3::types::PyBool::new(py, false)) => {
                            engine_core::WatchControl::Stop
                        }
                        Ok(_) => engine_core::WatchControl::Continue,
                        Err(e) => {
                            crate::transfer::CALLBACK_ERRORS
                                .fetch_add(1, std::sync::atomic::Ordering::Relaxed);
                            e.write_unraisable(py, Some(callback.bind(py)));
                            engine_core::WatchControl::Continue
                        }
                    })
                })
            })
            .or_raise(py)?;
        Ok(Watcher(Mutex::new(Some(w))))
    }

    /// Closes the engine: fails what is in flight (each callback still runs once),
    /// deregisters every region and releases the objects they held. Idempotent.
    fn close(&self, py: Python<'_>) {
        self.close_now(py);
    }

    fn __enter__(slf: Py<Self>) -> Py<Self> {
        slf
    }

    #[pyo3(signature = (*_args))]
    fn __exit__(&self, py: Python<'_>, _args: &Bound<'_, pyo3::types::PyTuple>) -> bool {
        self.close_now(py);
        false
    }

    fn __repr__(&self) -> String {
        match &*self.reg.engine.read().unwrap_or_else(|p| p.into_inner()) {
            Some(e) => format!(
                "<xfer.TransferEngine {} with {} NIC(s) at {}>",
                e.backend(),
                e.nic_count(),
                e.main_address()
            ),
            None => "<xfer.TransferEngine (closed)>".into(),
        }
    }
}

/// A u64 the host sets and a GPU reads in its own memory (GDRCopy-mapped device memory, else
/// device-mapped host memory, else host memory): the opposite direction of a watcher slot.
/// `xfer.ep.gpu`'s stream waits on one; `mirror_imm_count(imm, counter)` keeps one equal to
/// an immediate's arrivals.
#[pyclass(frozen, module = "xfer._xfer")]
pub(crate) struct GpuCounter(Arc<engine_core::GpuCounter>);

#[pymethods]
impl GpuCounter {
    /// A counter for CUDA device `device`, in the best memory available.
    #[new]
    #[pyo3(signature = (device=0))]
    fn new(py: Python<'_>, device: u32) -> Self {
        Self(py.detach(|| engine_core::GpuCounter::new(device)))
    }

    /// The address a GPU polls, or `None` in host memory.
    #[getter]
    fn device_ptr(&self) -> Option<u64> {
        self.0.device_ptr()
    }

    /// Where it lives: `"gdr"`, `"device_mapped"` or `"host"`.
    #[getter]
    fn memory(&self) -> &'static str {
        match self.0.memory() {
            engine_core::CounterMemory::Gdr => "gdr",
            engine_core::CounterMemory::DeviceMapped => "device_mapped",
            engine_core::CounterMemory::Host => "host",
        }
    }

    /// The value last set.
    #[getter]
    fn value(&self) -> u64 {
        self.0.value()
    }

    /// Sets the value (ordered after the caller's earlier stores).
    fn set(&self, value: u64) {
        self.0.set(value)
    }

    fn __repr__(&self) -> String {
        format!("<xfer.GpuCounter {} = {}>", self.memory(), self.0.value())
    }
}

#[pymethods]
impl Watcher {
    /// The counter's device address (for a GPU kernel), or `None` in host memory.
    #[getter]
    fn device_ptr(&self, py: Python<'_>) -> PyResult<Option<u64>> {
        self.with(py, |w| w.device_ptr())
    }

    /// The counter's host address.
    #[getter]
    fn host_ptr(&self, py: Python<'_>) -> PyResult<u64> {
        self.with(py, |w| w.host_ptr() as u64)
    }

    /// The counter's current value.
    #[getter]
    fn value(&self, py: Python<'_>) -> PyResult<u64> {
        self.with(py, |w| w.value())
    }

    /// Stores a value (from the host), as a kernel would.
    fn store(&self, py: Python<'_>, value: u64) -> PyResult<()> {
        self.with(py, |w| w.store(value))
    }

    /// Frees the slot (the callback is not called again).
    fn close(&self, py: Python<'_>) {
        let w = self.0.lock().unwrap_or_else(|p| p.into_inner()).take();
        py.detach(move || drop(w));
    }
}

impl Watcher {
    fn with<T>(&self, py: Python<'_>, f: impl FnOnce(&engine_core::Watcher) -> T) -> PyResult<T> {
        self.0
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .as_ref()
            .map(f)
            .ok_or_else(|| errors::invalid(py, "the watcher is closed"))
    }
}

#[pymethods]
impl PeerGroup {
    fn __repr__(&self) -> String {
        format!("<xfer.PeerGroup {:?}>", self.0)
    }
}

/// A notification as Python sees it: its id, or `(id, sender)` with the sender the transport
/// proved (`b""` when it cannot tell), never the message's claim.
fn notification_value<'py>(
    py: Python<'py>,
    note: &engine_core::Notification,
    with_sender: bool,
) -> PyResult<Bound<'py, PyAny>> {
    let id = PyBytes::new(py, &note.id);
    if with_sender {
        let sender = note
            .sender
            .as_ref()
            .map(engine_core::NetAddr::to_bytes)
            .unwrap_or_default();
        let from = PyBytes::new(py, &sender);
        Ok((id, from).into_pyobject(py)?.into_any())
    } else {
        Ok(id.into_any())
    }
}
