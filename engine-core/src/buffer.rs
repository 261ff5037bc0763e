//! [`HostBuffer`]: owned host memory registered with an engine, for callers (tests, benches,
//! CPU-side staging) who do not manage their own allocations.

use std::cell::UnsafeCell;
use std::sync::Arc;

use crate::api::{MrHandle, RemoteAccess, TransferEngine};
use crate::domain::Device;
use crate::error::{Error, Result};
use crate::wire::MrDesc;

/// A heap buffer registered with an engine; deregistered before its memory is freed.
///
/// Peers holding [`desc`](Self::desc) may write into it at any time, and this engine's worker
/// reads it while writes from it are in flight. So the safe API copies in and out
/// ([`read`](Self::read), [`to_vec`](Self::to_vec), [`write`](Self::write)) through raw
/// pointers and never hands out a Rust reference to memory that something else may change
/// underneath it; the bytes read while a write lands are unspecified (a mix of old and new),
/// never undefined behaviour. Read when your protocol says the writes you wait for have landed
/// (an `expect_imm_count`, the writer's own signal). [`bytes`](Self::bytes) and
/// [`bytes_mut`](Self::bytes_mut) borrow the memory in place for callers who can promise
/// that nothing writes it meanwhile.
pub struct HostBuffer {
    engine: Arc<TransferEngine>,
    /// `UnsafeCell`: the memory is changed behind shared references (by NICs, peers, the
    /// worker), which Rust must not assume away.
    data: Box<[UnsafeCell<u8>]>,
    mr: MrHandle,
    desc: MrDesc,
}

// SAFETY: the buffer is plain bytes; every access through `&HostBuffer` is a raw-pointer copy
// (the NIC-style access the type documents), so sharing it between threads adds no data race
// that a NIC does not already cause.
unsafe impl Sync for HostBuffer {}

impl std::fmt::Debug for HostBuffer {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("HostBuffer")
            .field("len", &self.data.len())
            .field("mr", &self.mr)
            .finish()
    }
}

impl HostBuffer {
    /// Allocates `len` zeroed bytes and registers them with `engine`.
    pub fn new(engine: &Arc<TransferEngine>, len: usize) -> Result<Self> {
        Self::from_fn(engine, len, |_| 0)
    }

    /// Allocates `len` bytes filled with `fill(i)` and registers them with `engine` for
    /// peers to write.
    pub fn from_fn(
        engine: &Arc<TransferEngine>,
        len: usize,
        fill: impl Fn(usize) -> u8,
    ) -> Result<Self> {
        Self::with_access(engine, len, fill, RemoteAccess::WRITE)
    }

    /// Allocates `len` bytes filled with `fill(i)` and registers them with `engine` with the
    /// remote access given (e.g. [`RemoteAccess::READ`] for a buffer peers read).
    pub fn with_access(
        engine: &Arc<TransferEngine>,
        len: usize,
        fill: impl Fn(usize) -> u8,
        access: RemoteAccess,
    ) -> Result<Self> {
        let data: Box<[UnsafeCell<u8>]> = (0..len).map(|i| UnsafeCell::new(fill(i))).collect();
        let ptr = UnsafeCell::raw_get(data.as_ptr());
        // SAFETY: `data` is owned by the HostBuffer, never reallocated, and deregistered in
        // Drop before it is freed (dereg_mr guarantees no NIC touches it after it returns).
        let (mr, desc) = unsafe { engine.reg_mr_with(ptr, len, Device::Host, access)? };
        Ok(Self {
            engine: Arc::clone(engine),
            data,
            mr,
            desc,
        })
    }

    /// The local handle, for the source side of writes.
    pub fn mr(&self) -> MrHandle {
        self.mr
    }

    /// The descriptor peers write with.
    pub fn desc(&self) -> &MrDesc {
        &self.desc
    }

    fn base(&self) -> *mut u8 {
        UnsafeCell::raw_get(self.data.as_ptr())
    }

    fn check(&self, offset: usize, len: usize) -> Result<()> {
        match offset.checked_add(len) {
            Some(end) if end <= self.data.len() => Ok(()),
            _ => Err(Error::OutOfBounds {
                side: "buffer",
                offset: offset as u64,
                len: len as u64,
                region_len: self.data.len() as u64,
            }),
        }
    }

    /// Copies `dst.len()` bytes starting at `offset` out of the buffer.
    pub fn read(&self, offset: usize, dst: &mut [u8]) -> Result<()> {
        self.check(offset, dst.len())?;
        // SAFETY: the range is inside the allocation (checked); `dst` is the caller's own
        // memory, distinct from ours (we never hand out references into it in safe code).
        unsafe {
            std::ptr::copy_nonoverlapping(self.base().add(offset), dst.as_mut_ptr(), dst.len())
        };
        Ok(())
    }

    /// Copies `src` into the buffer at `offset` (e.g. to fill a source before sending).
    pub fn write(&self, offset: usize, src: &[u8]) -> Result<()> {
        self.check(offset, src.len())?;
        // SAFETY: as in `read`, in the other direction; the cells permit writes through `&self`.
        unsafe { std::ptr::copy_nonoverlapping(src.as_ptr(), self.base().add(offset), src.len()) };
        Ok(())
    }

    /// Copies `len` bytes from `src` at `src_offset` into this buffer at `offset`: a local
    /// memcpy between two registered buffers (what a benchmark compares the engine against).
    pub fn copy_from(
        &self,
        offset: usize,
        src: &HostBuffer,
        src_offset: usize,
        len: usize,
    ) -> Result<()> {
        self.check(offset, len)?;
        src.check(src_offset, len)?;
        // SAFETY: both ranges are in bounds (checked); `copy` allows them to overlap (the
        // same buffer passed as both).
        unsafe { std::ptr::copy(src.base().add(src_offset), self.base().add(offset), len) };
        Ok(())
    }

    /// A copy of the whole buffer.
    pub fn to_vec(&self) -> Vec<u8> {
        let mut out = vec![0; self.data.len()];
        self.read(0, &mut out)
            .expect("the whole buffer is in bounds");
        out
    }

    /// The bytes, borrowed in place.
    ///
    /// # Safety
    /// Nothing may write the buffer while the slice lives: no peer write may land in it and
    /// no local write may be posted into it (e.g. all writes you expect have been counted and
    /// your protocol sends no more until you are done).
    pub unsafe fn bytes(&self) -> &[u8] {
        // SAFETY: in bounds and initialised; the caller promises no concurrent writer.
        unsafe { std::slice::from_raw_parts(self.base(), self.data.len()) }
    }

    /// The bytes, borrowed mutably in place.
    ///
    /// # Safety
    /// Nothing may read or write the buffer meanwhile: no peer write may land in it and no
    /// write from it may be in flight.
    pub unsafe fn bytes_mut(&mut self) -> &mut [u8] {
        // SAFETY: as for `bytes`, and `&mut self` excludes other local borrows.
        unsafe { std::slice::from_raw_parts_mut(self.base(), self.data.len()) }
    }

    /// Length in bytes.
    pub fn len(&self) -> usize {
        self.data.len()
    }

    /// Whether it is empty (never: registration needs at least one byte).
    pub fn is_empty(&self) -> bool {
        self.data.is_empty()
    }
}

impl Drop for HostBuffer {
    fn drop(&mut self) {
        // The memory goes with the deregistration: freed once no NIC touches it (at once,
        // or — dropped inside a waker, on the worker — after the worker's next pass).
        let data = std::mem::take(&mut self.data);
        if let Err(e) = self.engine.dereg_mr_keeping(self.mr, Box::new(data)) {
            tracing::warn!(error = %e, "deregistering a HostBuffer failed");
        }
    }
}
