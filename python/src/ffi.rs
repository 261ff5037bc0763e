//! The bindings' only `unsafe`: reading a DLPack capsule, and registering memory the caller
//! vouches for (the exporter's buffer or tensor, kept alive by the registration).

use std::ffi::c_void;

use pyo3::prelude::*;
use pyo3::types::PyCapsule;

/// `DLDevice` (dlpack.h).
#[repr(C)]
#[derive(Clone, Copy)]
struct DlDevice {
    device_type: i32,
    device_id: i32,
}

/// `DLDataType` (dlpack.h).
#[repr(C)]
#[derive(Clone, Copy)]
struct DlDataType {
    code: u8,
    bits: u8,
    lanes: u16,
}

/// `DLTensor` (dlpack.h): the part of `DLManagedTensor` a consumer reads.
#[repr(C)]
struct DlTensor {
    data: *mut c_void,
    device: DlDevice,
    ndim: i32,
    dtype: DlDataType,
    shape: *const i64,
    strides: *const i64,
    byte_offset: u64,
}

/// DLPack device types the engine can register.
pub(crate) const DL_CPU: i32 = 1;
pub(crate) const DL_CUDA: i32 = 2;
pub(crate) const DL_CUDA_HOST: i32 = 3;
pub(crate) const DL_CUDA_MANAGED: i32 = 13;

/// What a DLPack tensor describes, read once from its capsule.
#[derive(Debug, Clone, Copy)]
pub(crate) struct DlView {
    pub(crate) ptr: u64,
    pub(crate) nbytes: u64,
    pub(crate) device_type: i32,
    pub(crate) device_id: i32,
}

/// Reads an unconsumed `dltensor` capsule. The capsule stays unconsumed (its own destructor
/// calls the producer's deleter when the last reference goes), so holding the capsule holds
/// the tensor's memory.
pub(crate) fn read_dlpack(capsule: &Bound<'_, PyCapsule>) -> PyResult<DlView> {
    if !capsule.is_valid_checked(Some(c"dltensor")) {
        return Err(pyo3::exceptions::PyTypeError::new_err(
            "__dlpack__ returned a capsule that is not an unconsumed 'dltensor' (a versioned or used one?)",
        ));
    }
    let raw = capsule.pointer_checked(Some(c"dltensor"))?;
    // SAFETY: a capsule named "dltensor" holds a `DLManagedTensor*` (the DLPack protocol);
    // `DLTensor` is its first field, and the producer keeps it valid while the capsule lives,
    // which outlasts this function (we hold a reference to the capsule).
    let t = unsafe { &*(raw.as_ptr() as *const DlTensor) };
    let ndim = usize::try_from(t.ndim)
        .map_err(|_| pyo3::exceptions::PyValueError::new_err("negative ndim in a DLPack tensor"))?;
    let shape: &[i64] = if ndim == 0 || t.shape.is_null() {
        &[]
    } else {
        // SAFETY: DLPack: `shape` points to `ndim` int64s valid while the tensor lives.
        unsafe { std::slice::from_raw_parts(t.shape, ndim) }
    };
    let strides: Option<&[i64]> = if ndim == 0 || t.strides.is_null() {
        None
    } else {
        // SAFETY: DLPack: non-null `strides` points to `ndim` int64s (in elements).
        Some(unsafe { std::slice::from_raw_parts(t.strides, ndim) })
    };
    check_compact(shape, strides).map_err(|why| crate::errors::invalid(capsule.py(), why))?;
    let elements = shape.iter().try_fold(1u64, |acc, &d| {
        u64::try_from(d).ok().and_then(|d| acc.checked_mul(d))
    });
    let bits = u64::from(t.dtype.bits) * u64::from(t.dtype.lanes);
    let nbytes = elements
        .and_then(|e| e.checked_mul(bits))
        .map(|b| b.div_ceil(8))
        .ok_or_else(|| pyo3::exceptions::PyValueError::new_err("DLPack tensor size overflows"))?;
    Ok(DlView {
        ptr: (t.data as u64).wrapping_add(t.byte_offset),
        nbytes,
        device_type: t.device.device_type,
        device_id: t.device.device_id,
    })
}

/// A registered region must be one contiguous range: C-contiguous strides (or none).
fn check_compact(shape: &[i64], strides: Option<&[i64]>) -> Result<(), &'static str> {
    let Some(strides) = strides else {
        return Ok(());
    };
    let mut expected = 1i64;
    for (&dim, &stride) in shape.iter().zip(strides).rev() {
        if dim > 1 && stride != expected {
            return Err(
                "the tensor is not contiguous: register a contiguous tensor (e.g. .contiguous())",
            );
        }
        expected = expected.saturating_mul(dim.max(1));
    }
    Ok(())
}

/// Registers `nbytes` at `ptr` with `engine`.
///
/// # Safety
/// The caller keeps the memory allocated (and at this address) until the returned handle is
/// deregistered: the bindings do so by holding the exporting object's buffer or capsule in
/// the registration, or, for `reg_mr_raw`, by the Python caller's promise.
pub(crate) unsafe fn register(
    engine: &engine_core::TransferEngine,
    ptr: u64,
    nbytes: u64,
    device: engine_core::Device,
    access: Option<engine_core::RemoteAccess>,
) -> engine_core::Result<(engine_core::MrHandle, Option<engine_core::MrDesc>)> {
    let len = usize::try_from(nbytes)
        .map_err(|_| engine_core::Error::InvalidArgument(format!("{nbytes} bytes")))?;
    let ptr = ptr as *mut u8;
    match access {
        // SAFETY: the caller's contract (above) is reg_mr's.
        None => unsafe { engine.reg_mr_local(ptr, len, device) }.map(|h| (h, None)),
        // SAFETY: as above.
        Some(a) => unsafe { engine.reg_mr_with(ptr, len, device, a) }.map(|(h, d)| (h, Some(d))),
    }
}

/// The elements of a writable, C-contiguous buffer (a numpy array, the numpy view of a host
/// torch tensor) as cells, for the MoE copies of `ep.rs`; `None` for a read-only or strided one.
/// Cells, not `&mut`: Python holds other views of the same memory, and the engine writes into a
/// registered region while the bindings read other rows of it.
pub(crate) fn buffer_cells<T: pyo3::buffer::Element>(
    buf: &pyo3::buffer::PyBuffer<T>,
) -> Option<&[std::cell::Cell<T>]> {
    if buf.readonly() || !buf.is_c_contiguous() {
        return None;
    }
    let ptr = buf.buf_ptr() as *const std::cell::Cell<T>;
    if buf.item_count() == 0 {
        return Some(&[]);
    }
    // SAFETY: `PyBuffer::get` checked that the buffer holds `item_count` aligned elements of
    // `T`'s format; it is C-contiguous and writable (checked above) and stays exported, so
    // allocated at this address, while `buf` lives, which the returned borrow cannot outlive.
    // `Cell<T>` has `T`'s layout and claims no exclusivity. The bindings run these copies
    // holding the GIL, so no Python thread touches the array meanwhile; the rows they read were
    // completed by the engine (counted arrivals) and are not written again before the step
    // two later, which waits for this one.
    Some(unsafe { std::slice::from_raw_parts(ptr, buf.item_count()) })
}
