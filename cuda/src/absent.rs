//! Built without the `driver` feature (a plugin that must not carry CUDA loading): no driver
//! is ever loaded, and every GPU request is refused naming the feature. [`Cuda`] has no values,
//! so its methods cannot be reached.

const ABSENT: &str = "built without CUDA support (xfer-cuda's feature `driver` is off)";

/// Never: this build has no driver.
pub fn driver_present() -> bool {
    false
}

/// A CUDA context; none can exist in this build.
#[derive(Debug)]
pub enum Cuda {}

#[allow(clippy::missing_safety_doc, missing_docs)]
impl Cuda {
    /// Refused: this build has no driver.
    pub fn open(_device: i32) -> Result<Self, String> {
        Err(ABSENT.into())
    }
    pub fn alloc_mapped(&self, _len: usize) -> Result<(*mut u8, u64), String> {
        match *self {}
    }
    pub unsafe fn free_mapped(&self, _host: *mut u8) {
        match *self {}
    }
    pub fn check_device_range(&self, _ptr: u64, _len: u64, _device: i32) -> Result<(), String> {
        match *self {}
    }
    pub fn check_host_range(&self, _ptr: u64) -> Result<(), String> {
        match *self {}
    }
    pub unsafe fn copy(&self, _dst: u64, _src: u64, _len: usize) -> Result<(), String> {
        match *self {}
    }
    pub fn alloc_device(&self, _len: usize) -> Result<u64, String> {
        match *self {}
    }
    pub unsafe fn free_device(&self, _ptr: u64) {
        match *self {}
    }
    pub unsafe fn upload(&self, _dst: u64, _src: &[u8]) -> Result<(), String> {
        match *self {}
    }
    pub unsafe fn download(&self, _dst: &mut [u8], _src: u64) -> Result<(), String> {
        match *self {}
    }
    pub fn dmabuf_fd(&self, _base: u64, _len: u64) -> Result<i32, String> {
        match *self {}
    }
    pub fn device_count(&self) -> Result<i32, String> {
        match *self {}
    }
    pub fn name(&self, _ordinal: i32) -> Result<String, String> {
        match *self {}
    }
}
