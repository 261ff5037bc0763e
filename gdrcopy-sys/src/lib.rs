//! GDRCopy, loaded at run time from `libgdrapi.so.2`: a CPU mapping of GPU memory, so the CPU
//! can set a flag that a GPU kernel polls without a copy engine. [`Gdr::open`] fails with the
//! reason (library missing, too old, driver `gdrdrv` not loaded) so callers can fall back.

use std::ffi::{c_int, c_ulong, c_void};

use libloading::Library;

/// The library file (GDRCopy 2.x).
pub const LIBRARY: &str = "libgdrapi.so.2";
/// Oldest runtime version accepted.
pub const MIN_VERSION: (i32, i32) = (2, 0);

/// `gdr_mh_t`: a pinned buffer handle.
#[repr(C)]
#[derive(Debug, Clone, Copy, Default)]
pub struct MemHandle {
    h: c_ulong,
}

type Open = unsafe extern "C" fn() -> *mut c_void;
type Close = unsafe extern "C" fn(*mut c_void) -> c_int;
type Pin = unsafe extern "C" fn(*mut c_void, c_ulong, usize, u64, u32, *mut MemHandle) -> c_int;
type Unpin = unsafe extern "C" fn(*mut c_void, MemHandle) -> c_int;
type Map = unsafe extern "C" fn(*mut c_void, MemHandle, *mut *mut c_void, usize) -> c_int;
type Unmap = unsafe extern "C" fn(*mut c_void, MemHandle, *mut c_void, usize) -> c_int;
type Version = unsafe extern "C" fn(*mut c_int, *mut c_int);
type CopyFrom = unsafe extern "C" fn(MemHandle, *mut c_void, *const c_void, usize) -> c_int;
type CopyTo = unsafe extern "C" fn(MemHandle, *mut c_void, *const c_void, usize) -> c_int;

/// An open GDRCopy handle (library loaded, driver reachable).
pub struct Gdr {
    handle: *mut c_void,
    close: Close,
    pin: Pin,
    unpin: Unpin,
    map: Map,
    unmap: Unmap,
    copy_from: CopyFrom,
    copy_to: CopyTo,
    /// (major, minor) of the runtime.
    pub version: (i32, i32),
    _library: Library,
}

// SAFETY: GDRCopy handles may be used from any thread; calls on one handle are serialised by
// the owners (the mapping is written with plain stores).
unsafe impl Send for Gdr {}
// SAFETY: as above.
unsafe impl Sync for Gdr {}

impl std::fmt::Debug for Gdr {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "Gdr({}.{})", self.version.0, self.version.1)
    }
}

fn symbol<T: Copy>(library: &Library, name: &str) -> Result<T, String> {
    // SAFETY: every T used here is the documented C signature of that GDRCopy 2.x symbol.
    unsafe { library.get::<T>(name.as_bytes()) }
        .map(|s| *s)
        .map_err(|e| format!("{LIBRARY} lacks {name}: {e}"))
}

impl Gdr {
    /// Loads the library, checks its version, and opens the driver.
    pub fn open() -> Result<Self, String> {
        // SAFETY: loading GDRCopy runs its initialisers, the trust decision of using it at all.
        let library = unsafe { Library::new(LIBRARY) }
            .map_err(|e| format!("GDRCopy is not installed ({LIBRARY}: {e})"))?;
        let get_version: Version = symbol(&library, "gdr_runtime_get_version")?;
        let (mut major, mut minor) = (0, 0);
        // SAFETY: valid out-pointers.
        unsafe { get_version(&mut major, &mut minor) };
        if (major, minor) < MIN_VERSION {
            return Err(format!(
                "GDRCopy {major}.{minor} is older than {}.{}",
                MIN_VERSION.0, MIN_VERSION.1
            ));
        }
        let open: Open = symbol(&library, "gdr_open")?;
        // SAFETY: gdr_open takes no arguments; null means the gdrdrv driver is not loaded.
        let handle = unsafe { open() };
        if handle.is_null() {
            return Err(
                "gdr_open failed: is the gdrdrv kernel module loaded (/dev/gdrdrv)?".into(),
            );
        }
        Ok(Self {
            handle,
            close: symbol(&library, "gdr_close")?,
            pin: symbol(&library, "gdr_pin_buffer")?,
            unpin: symbol(&library, "gdr_unpin_buffer")?,
            map: symbol(&library, "gdr_map")?,
            unmap: symbol(&library, "gdr_unmap")?,
            copy_from: symbol(&library, "gdr_copy_from_mapping")?,
            copy_to: symbol(&library, "gdr_copy_to_mapping")?,
            version: (major, minor),
            _library: library,
        })
    }

    /// Pins `len` bytes of GPU memory at `device_ptr` (64 KiB aligned) and maps them for the
    /// CPU; returns the handle and the CPU address.
    ///
    /// # Safety
    /// The GPU memory must stay allocated until [`unmap`](Self::unmap).
    pub unsafe fn pin_and_map(
        &self,
        device_ptr: u64,
        len: usize,
    ) -> Result<(MemHandle, *mut u8), String> {
        let mut mh = MemHandle::default();
        // SAFETY: per this function's contract; valid out-pointer.
        let rc = unsafe { (self.pin)(self.handle, device_ptr as c_ulong, len, 0, 0, &mut mh) };
        if rc != 0 {
            return Err(format!("gdr_pin_buffer failed ({rc})"));
        }
        let mut va = std::ptr::null_mut();
        // SAFETY: mh was just pinned; valid out-pointer.
        let rc = unsafe { (self.map)(self.handle, mh, &mut va, len) };
        if rc != 0 {
            // SAFETY: undoing the pin above.
            unsafe { (self.unpin)(self.handle, mh) };
            return Err(format!("gdr_map failed ({rc})"));
        }
        Ok((mh, va as *mut u8))
    }

    /// Reads `dst.len()` bytes of a mapping at `src` with GDRCopy's BAR-read routine (one bulk
    /// read: BAR reads are uncached and cost about a microsecond each, so batch them).
    ///
    /// # Safety
    /// `src..src + dst.len()` lies inside the live mapping `mh`.
    pub unsafe fn copy_from_mapping(&self, mh: MemHandle, dst: &mut [u8], src: *const u8) {
        // SAFETY: per this function's contract; `dst` is ours.
        unsafe { (self.copy_from)(mh, dst.as_mut_ptr().cast(), src.cast(), dst.len()) };
    }

    /// Writes `src` into a mapping at `dst` (write-combined; visible to the GPU after the
    /// fence GDRCopy's routine ends with).
    ///
    /// # Safety
    /// `dst..dst + src.len()` lies inside the live mapping `mh`.
    pub unsafe fn copy_to_mapping(&self, mh: MemHandle, dst: *mut u8, src: &[u8]) {
        // SAFETY: per this function's contract.
        unsafe { (self.copy_to)(mh, dst.cast(), src.as_ptr().cast(), src.len()) };
    }

    /// Undoes [`pin_and_map`](Self::pin_and_map).
    ///
    /// # Safety
    /// `mh`/`va`/`len` come from one `pin_and_map`, and the mapping is no longer used.
    pub unsafe fn unmap(&self, mh: MemHandle, va: *mut u8, len: usize) {
        // SAFETY: per this function's contract.
        unsafe {
            (self.unmap)(self.handle, mh, va.cast(), len);
            (self.unpin)(self.handle, mh);
        }
    }
}

impl Drop for Gdr {
    fn drop(&mut self) {
        // SAFETY: opened once, closed once.
        unsafe { (self.close)(self.handle) };
    }
}

#[cfg(test)]
mod tests {
    #[test]
    fn a_missing_library_is_a_reason_not_a_crash() {
        if std::path::Path::new("/dev/gdrdrv").exists() {
            return; // a GDRCopy machine: the GPU check exercises the real path
        }
        let err = super::Gdr::open().unwrap_err();
        assert!(err.contains("GDRCopy") || err.contains("gdrdrv"), "{err}");
    }
}
