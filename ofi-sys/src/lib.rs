//! Raw bindings to xfer's libfabric shim (`csrc/shim.c`). Everything here is `unsafe` to call;
//! `backend-efa`'s `ffi` module wraps it. The shim requests libfabric API 1.17.
#![allow(missing_docs)]

use std::ffi::{c_char, c_int, c_long, c_void};

/// The shim's endpoint bundle (fabric, domain, endpoint, AV, CQ); opaque here.
#[repr(C)]
pub struct XferOfiEp {
    _opaque: [u8; 0],
}

/// A libfabric memory region; opaque here.
#[repr(C)]
pub struct FidMr {
    _opaque: [u8; 0],
}

/// Provider properties the Rust side must honour.
#[repr(C)]
#[derive(Debug, Clone, Copy, Default)]
pub struct XferOfiAttr {
    pub mr_local: c_int,
    pub mr_virt_addr: c_int,
    pub mr_prov_key: c_int,
    pub mr_endpoint: c_int,
    pub mr_mode: u64,
    pub cq_data_size: usize,
    pub max_msg_size: usize,
    /// Whether RDMA reads were granted (`FI_READ | FI_REMOTE_READ`).
    pub rma_read: c_int,
    /// Whether `FI_HMEM` was granted (device memory registered as device memory).
    pub hmem: c_int,
    /// 1 if `FI_OPT_CUDA_API_PERMITTED = false` took (the provider makes no CUDA calls).
    pub cuda_api_forbidden: c_int,
    /// `FI_OPT_SHARED_MEMORY_PERMITTED` as set (0/1), or -1 if left at the default.
    pub shared_memory: c_int,
    /// `FI_OPT_EFA_EMULATED_WRITE`: 1 emulated, 0 native, -1 unknown.
    pub emulated_write: c_int,
    /// Whether `FI_SOURCE` was granted: received messages and remote CQ data name their
    /// sender's address-vector entry.
    pub source: c_int,
    /// The most local iovec entries one post takes.
    pub iov_limit: usize,
    /// The most remote iovec entries one RMA post takes.
    pub rma_iov_limit: usize,
}

/// A classified completion.
#[repr(C)]
#[derive(Debug, Clone, Copy)]
pub struct XferOfiCompletion {
    pub context: *mut c_void,
    /// 0: own operation done; 1: remote write with CQ data; 2: message received.
    pub kind: c_int,
    pub len: usize,
    pub data: u64,
    /// The sender's `fi_addr_t` (kinds 1 and 2), or [`ADDR_NOTAVAIL`].
    pub src: u64,
}

impl Default for XferOfiCompletion {
    fn default() -> Self {
        Self {
            context: std::ptr::null_mut(),
            kind: 0,
            len: 0,
            data: 0,
            src: ADDR_NOTAVAIL,
        }
    }
}

/// libfabric's `FI_ADDR_NOTAVAIL`: no address-vector entry.
pub const ADDR_NOTAVAIL: u64 = u64::MAX;

/// Completion kinds.
pub const KIND_DONE: c_int = 0;
pub const KIND_REMOTE_DATA: c_int = 1;
pub const KIND_RECV: c_int = 2;
/// Post status: the provider asked to retry later.
pub const POST_AGAIN: c_int = 1;
/// cq_read: an error completion is waiting.
pub const CQ_ERROR_AVAILABLE: c_long = -1;

extern "C" {
    pub fn xfer_ofi_list(prov: *const c_char, buf: *mut c_char, cap: usize) -> c_int;
    pub fn xfer_ofi_open(
        prov: *const c_char,
        fabric: *const c_char,
        domain_name: *const c_char,
        shared_memory: c_int,
        out: *mut *mut XferOfiEp,
        attr: *mut XferOfiAttr,
        err: *mut c_char,
        errcap: usize,
    ) -> c_int;
    pub fn xfer_ofi_close_ep(e: *mut XferOfiEp);
    pub fn xfer_ofi_close(e: *mut XferOfiEp);
    pub fn xfer_ofi_provider(e: *const XferOfiEp) -> *const c_char;
    /// The libfabric API version the shim requests (`FI_VERSION(major, minor)`).
    pub fn xfer_ofi_api_version() -> u32;
    pub fn xfer_ofi_domain_name(e: *const XferOfiEp) -> *const c_char;
    pub fn xfer_ofi_getname(e: *mut XferOfiEp, buf: *mut c_void, len: *mut usize) -> c_int;
    pub fn xfer_ofi_av_insert(e: *mut XferOfiEp, addr: *const c_void, fi_addr: *mut u64) -> c_int;
    pub fn xfer_ofi_av_remove(e: *mut XferOfiEp, fi_addr: u64) -> c_int;
    pub fn xfer_ofi_mr_reg(
        e: *mut XferOfiEp,
        buf: *const c_void,
        len: usize,
        cuda_device: c_int,
        requested_key: u64,
        remote: c_int,
        mr: *mut *mut FidMr,
        key: *mut u64,
        desc: *mut *mut c_void,
    ) -> c_int;
    pub fn xfer_ofi_mr_close(mr: *mut FidMr) -> c_int;
    pub fn xfer_ofi_write(
        e: *mut XferOfiEp,
        buf: *const c_void,
        len: usize,
        desc: *mut c_void,
        dest: u64,
        raddr: u64,
        rkey: u64,
        has_data: c_int,
        data: u64,
        context: *mut c_void,
    ) -> c_int;
    pub fn xfer_ofi_read(
        e: *mut XferOfiEp,
        buf: *mut c_void,
        len: usize,
        desc: *mut c_void,
        dest: u64,
        raddr: u64,
        rkey: u64,
        context: *mut c_void,
    ) -> c_int;
    pub fn xfer_ofi_readv(
        e: *mut XferOfiEp,
        count: usize,
        bufs: *const *mut c_void,
        lens: *const usize,
        descs: *mut *mut c_void,
        dest: u64,
        raddrs: *const u64,
        rkey: u64,
        context: *mut c_void,
    ) -> c_int;
    pub fn xfer_ofi_send(
        e: *mut XferOfiEp,
        buf: *const c_void,
        len: usize,
        desc: *mut c_void,
        dest: u64,
        context: *mut c_void,
    ) -> c_int;
    pub fn xfer_ofi_recv(
        e: *mut XferOfiEp,
        buf: *mut c_void,
        len: usize,
        desc: *mut c_void,
        context: *mut c_void,
    ) -> c_int;
    pub fn xfer_ofi_cq_read(e: *mut XferOfiEp, out: *mut XferOfiCompletion, count: usize)
        -> c_long;
    pub fn xfer_ofi_cq_readerr(
        e: *mut XferOfiEp,
        context: *mut *mut c_void,
        err: *mut c_int,
        prov_errno: *mut c_int,
        msg: *mut c_char,
        cap: usize,
    ) -> c_int;
    pub fn xfer_ofi_strerror(err: c_int) -> *const c_char;
}
