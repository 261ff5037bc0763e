//! The one primitive both the ABI's tables and its log forwarding use: a borrowed byte string
//! as C sees it (kept apart so that `abi` and `log` do not import each other).

/// A borrowed byte string.
#[repr(C)]
#[derive(Debug, Clone, Copy)]
pub struct RawBytes {
    /// First byte (may dangle when `len` is 0).
    pub ptr: *const u8,
    /// Length.
    pub len: usize,
}

impl RawBytes {
    /// Borrows `bytes`.
    pub fn new(bytes: &[u8]) -> Self {
        Self {
            ptr: bytes.as_ptr(),
            len: bytes.len(),
        }
    }

    /// # Safety
    /// `ptr` must point to `len` readable bytes that outlive `'a`.
    pub unsafe fn as_slice<'a>(self) -> &'a [u8] {
        if self.len == 0 {
            return &[];
        }
        // SAFETY: the caller guarantees ptr/len describe live bytes.
        unsafe { std::slice::from_raw_parts(self.ptr, self.len) }
    }
}
