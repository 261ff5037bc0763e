//! Safe wrappers over `ofi-sys`. All of this backend's `unsafe` is in this file.

use std::ffi::{c_char, c_void, CStr, CString};
use std::ptr::NonNull;

use ofi_sys as sys;
use xfer_plugin::domain::{Device, MemoryRegion, ReceivePool};

/// A failed libfabric call: its (negative) return code and text.
#[derive(Debug, Clone)]
pub(crate) struct OfiError {
    pub(crate) message: String,
    /// libfabric's return code (`-FI_E…`, which are negative errno values), when the error
    /// came from a libfabric call: callers decide by it, never by the text.
    pub(crate) code: Option<i32>,
}

impl OfiError {
    /// libfabric's code as the errno it is, for a `DomainError`'s cause.
    pub(crate) fn cause(&self) -> Option<xfer_plugin::domain::DomainCause> {
        self.code
            .map(|c| xfer_plugin::domain::DomainCause::Os(c.saturating_abs()))
    }

    /// Whether libfabric ran out of memory (`-FI_ENOMEM`): for registrations, most often the
    /// locked-memory limit.
    pub(crate) fn is_out_of_memory(&self) -> bool {
        self.code == Some(-12)
    }
}

fn error(what: &str, code: i32) -> OfiError {
    // SAFETY: fi_strerror returns a pointer to a static, NUL-terminated string.
    let text = unsafe { CStr::from_ptr(sys::xfer_ofi_strerror(code)) }.to_string_lossy();
    OfiError {
        message: format!("{what}: {text} ({code})"),
        code: Some(code),
    }
}

fn text(buf: &[c_char]) -> String {
    // SAFETY: the shim NUL-terminates what it writes (snprintf), and buf is zeroed beforehand.
    unsafe { CStr::from_ptr(buf.as_ptr()) }
        .to_string_lossy()
        .into_owned()
}

fn cstring(s: &str) -> Result<CString, OfiError> {
    CString::new(s).map_err(|_| OfiError {
        message: format!("{s:?} contains a NUL byte"),
        code: None,
    })
}

/// `(provider, domain)` pairs libfabric offers with RDM + RMA (all providers if `None`).
pub(crate) fn list(provider: Option<&str>) -> Result<Vec<(String, String)>, String> {
    let prov = provider.map(cstring).transpose().map_err(|e| e.message)?;
    let mut buf = vec![0 as c_char; 64 * 1024];
    // SAFETY: prov is NUL-terminated or null; buf has the capacity we pass.
    let rc = unsafe {
        sys::xfer_ofi_list(
            prov.as_ref().map_or(std::ptr::null(), |p| p.as_ptr()),
            buf.as_mut_ptr(),
            buf.len(),
        )
    };
    if rc != 0 {
        return Err(error("fi_getinfo", rc).message);
    }
    Ok(text(&buf)
        .lines()
        .filter_map(|l| l.split_once(' '))
        .map(|(p, d)| (p.to_owned(), d.to_owned()))
        .collect())
}

/// Provider properties to honour.
pub(crate) type Attr = sys::XferOfiAttr;
pub(crate) use sys::{KIND_RECV, KIND_REMOTE_DATA};

/// A classified completion; `context` is the address passed when posting.
#[derive(Debug, Clone, Copy)]
pub(crate) struct Completion {
    pub(crate) context: usize,
    pub(crate) kind: i32,
    pub(crate) len: usize,
    pub(crate) data: u64,
    /// The sender's address-vector entry (received messages and remote CQ data), where the
    /// provider named one.
    pub(crate) src: Option<u64>,
}

/// What a post did.
pub(crate) enum Posted {
    Queued,
    Again,
}

/// A fabric + domain + RDM endpoint + AV + CQ, closed on drop.
pub(crate) struct Endpoint {
    raw: NonNull<sys::XferOfiEp>,
    pub(crate) attr: Attr,
    /// Where `fi_cq_read` writes.
    entries: Vec<sys::XferOfiCompletion>,
}

// SAFETY: the endpoint is used by one thread at a time (the engine's worker owns its Domain);
// FI_THREAD_DOMAIN asks exactly that of us, and nothing in it is tied to the opening thread.
unsafe impl Send for Endpoint {}

impl Endpoint {
    /// Opens an endpoint of `provider` on the domain named `domain` (the first if `None`);
    /// `shared_memory` permits or forbids the provider's same-host path (`None`: its default).
    pub(crate) fn open(
        provider: &str,
        fabric: Option<&str>,
        domain: Option<&str>,
        shared_memory: Option<bool>,
    ) -> Result<Self, OfiError> {
        let prov = cstring(provider)?;
        let fab = fabric.map(cstring).transpose()?;
        let dom = domain.map(cstring).transpose()?;
        let mut raw = std::ptr::null_mut();
        let mut attr = Attr::default();
        let mut err = [0 as c_char; 512];
        // SAFETY: every pointer is valid for the call; strings are NUL-terminated.
        let rc = unsafe {
            sys::xfer_ofi_open(
                prov.as_ptr(),
                fab.as_ref().map_or(std::ptr::null(), |f| f.as_ptr()),
                dom.as_ref().map_or(std::ptr::null(), |d| d.as_ptr()),
                shared_memory.map_or(-1, std::os::raw::c_int::from),
                &mut raw,
                &mut attr,
                err.as_mut_ptr(),
                err.len(),
            )
        };
        match NonNull::new(raw) {
            Some(raw) if rc == 0 => Ok(Self {
                raw,
                attr,
                entries: vec![sys::XferOfiCompletion::default(); 64],
            }),
            _ => Err(OfiError {
                message: text(&err),
                code: (rc != 0).then_some(rc),
            }),
        }
    }

    /// Closes the endpoint itself (cancelling posted operations) ahead of the rest, so the
    /// owner can release registrations and buffers while the domain is still open.
    pub(crate) fn close_endpoint(&mut self) {
        // SAFETY: the bundle is open; the shim closes the endpoint once and nulls it.
        unsafe { sys::xfer_ofi_close_ep(self.raw.as_ptr()) };
    }

    /// The domain's name.
    pub(crate) fn domain_name(&self) -> String {
        // SAFETY: the endpoint is open; the shim returns a string owned by its fi_info.
        unsafe { CStr::from_ptr(sys::xfer_ofi_domain_name(self.raw.as_ptr())) }
            .to_string_lossy()
            .into_owned()
    }

    /// `fi_getname`: the endpoint's address bytes.
    pub(crate) fn name(&self) -> Result<Vec<u8>, OfiError> {
        let mut buf = vec![0u8; 256];
        let mut len = buf.len();
        // SAFETY: buf has `len` bytes of room; the shim updates len to the name's size.
        let rc =
            unsafe { sys::xfer_ofi_getname(self.raw.as_ptr(), buf.as_mut_ptr().cast(), &mut len) };
        if rc != 0 {
            return Err(error("fi_getname", rc));
        }
        buf.truncate(len);
        Ok(buf)
    }

    /// `fi_av_insert` of one address.
    pub(crate) fn insert_peer(&mut self, addr: &[u8]) -> Result<u64, OfiError> {
        // libfabric reads as many bytes as its own address format has (EFA: 32, sockaddrs,
        // shm: a NUL-terminated name of up to 256), whatever length we hold; copying into a
        // zeroed 256-byte buffer keeps a short or foreign address from being over-read.
        let mut padded = [0u8; 256];
        let n = addr.len().min(padded.len() - 1);
        padded[..n].copy_from_slice(&addr[..n]);
        let mut fi_addr = 0u64;
        // SAFETY: `padded` is 256 readable bytes, more than any provider's address format.
        let rc = unsafe {
            sys::xfer_ofi_av_insert(self.raw.as_ptr(), padded.as_ptr().cast(), &mut fi_addr)
        };
        if rc != 0 {
            return Err(error("fi_av_insert", rc));
        }
        Ok(fi_addr)
    }

    /// `fi_av_remove`: forgets a peer, so the next insert connects afresh.
    pub(crate) fn remove_peer(&mut self, fi_addr: u64) {
        // SAFETY: the endpoint is open; removing an address is valid for any inserted one.
        unsafe { sys::xfer_ofi_av_remove(self.raw.as_ptr(), fi_addr) };
    }

    /// Registers a region the engine hands to `Domain::register` under `key`: host memory,
    /// or the memory of a CUDA device (`FI_HMEM_CUDA`).
    pub(crate) fn register_region(
        &mut self,
        region: &MemoryRegion,
        key: u64,
    ) -> Result<MemoryRegistration, OfiError> {
        let cuda_device = match region.device {
            Device::Cuda(index) => Some(index as i32),
            _ => None,
        };
        // SAFETY: `Domain::register`'s contract: the engine registers only memory its caller
        // keeps allocated until it is deregistered (`TransferEngine::reg_mr` is `unsafe` for
        // that; device memory it checked is this GPU's), and deregistering drops this
        // registration.
        unsafe {
            self.register(
                region.ptr as *const u8,
                region.len as usize,
                cuda_device,
                key,
                (region.remote_write, region.remote_read),
            )
        }
    }

    /// The source of zero-byte writes, registered under `key` (EFA wants a valid descriptor
    /// even for no bytes).
    pub(crate) fn zero_source(&mut self, key: u64) -> Result<ZeroSource, OfiError> {
        let bytes = vec![0u8; 64].into_boxed_slice();
        // SAFETY: `ZeroSource` keeps the bytes at this address and drops the registration
        // first.
        let registration =
            unsafe { self.register(bytes.as_ptr(), bytes.len(), None, key, (false, false)) }?;
        Ok(ZeroSource {
            registration,
            bytes,
        })
    }

    /// Registers `len` bytes at `ptr` for local use and remote writes: host memory, or with
    /// `cuda_device` the memory of that CUDA device (`FI_HMEM_CUDA`).
    ///
    /// # Safety
    /// The memory must stay allocated until the returned registration is dropped.
    pub(crate) unsafe fn register(
        &mut self,
        ptr: *const u8,
        len: usize,
        cuda_device: Option<i32>,
        requested_key: u64,
        (remote_write, remote_read): (bool, bool),
    ) -> Result<MemoryRegistration, OfiError> {
        let mut mr = std::ptr::null_mut();
        let mut key = 0u64;
        let mut desc = std::ptr::null_mut();
        // SAFETY: per this function's contract the memory is live; out-pointers are valid.
        let rc = unsafe {
            sys::xfer_ofi_mr_reg(
                self.raw.as_ptr(),
                ptr.cast(),
                len,
                cuda_device.unwrap_or(-1),
                requested_key,
                i32::from(remote_write) | (i32::from(remote_read) << 1),
                &mut mr,
                &mut key,
                &mut desc,
            )
        };
        match NonNull::new(mr) {
            Some(mr) if rc == 0 => Ok(MemoryRegistration { mr, key, desc }),
            _ => Err(error("fi_mr_regattr", rc)),
        }
    }

    /// Posts an RDMA write (with remote CQ data when `imm` is given).
    ///
    /// # Safety
    /// `buf..buf+len` must be live and inside the region `desc` belongs to (or `desc` null when
    /// the provider does not need local descriptors), and `context` must stay valid and
    /// untouched until its completion is read.
    #[allow(clippy::too_many_arguments)]
    pub(crate) unsafe fn write(
        &mut self,
        buf: *const u8,
        len: usize,
        desc: *mut c_void,
        dest: u64,
        remote_addr: u64,
        remote_key: u64,
        imm: Option<u32>,
        context: *mut c_void,
    ) -> Result<Posted, OfiError> {
        // SAFETY: per this function's contract.
        let rc = unsafe {
            sys::xfer_ofi_write(
                self.raw.as_ptr(),
                buf.cast(),
                len,
                desc,
                dest,
                remote_addr,
                remote_key,
                imm.is_some() as i32,
                u64::from(imm.unwrap_or(0)),
                context,
            )
        };
        posted("fi_writemsg", rc)
    }

    /// Posts an RDMA read of the peer's range into `buf`.
    ///
    /// # Safety
    /// As for [`write`](Self::write); `buf..buf+len` is written by the NIC until completion.
    #[allow(clippy::too_many_arguments)]
    pub(crate) unsafe fn rdma_read(
        &mut self,
        buf: *mut u8,
        len: usize,
        desc: *mut c_void,
        dest: u64,
        remote_addr: u64,
        remote_key: u64,
        context: *mut c_void,
    ) -> Result<Posted, OfiError> {
        // SAFETY: per this function's contract.
        let rc = unsafe {
            sys::xfer_ofi_read(
                self.raw.as_ptr(),
                buf.cast(),
                len,
                desc,
                dest,
                remote_addr,
                remote_key,
                context,
            )
        };
        posted("fi_readmsg", rc)
    }

    /// Posts one RDMA read of several segments of the peer's region (`remote_key`), each
    /// `(local buffer, len, local descriptor, remote address)`; one completion for all.
    ///
    /// # Safety
    /// As for [`rdma_read`](Self::rdma_read), for every segment.
    pub(crate) unsafe fn rdma_readv(
        &mut self,
        segments: &[(*mut u8, usize, *mut c_void, u64)],
        dest: u64,
        remote_key: u64,
        context: *mut c_void,
    ) -> Result<Posted, OfiError> {
        const MOST: usize = crate::gather::MAX_SEGMENTS;
        let n = segments.len().min(MOST);
        let mut bufs = [std::ptr::null_mut::<c_void>(); MOST];
        let mut lens = [0usize; MOST];
        let mut descs = [std::ptr::null_mut::<c_void>(); MOST];
        let mut raddrs = [0u64; MOST];
        for (i, &(buf, len, desc, raddr)) in segments[..n].iter().enumerate() {
            bufs[i] = buf.cast();
            lens[i] = len;
            descs[i] = desc;
            raddrs[i] = raddr;
        }
        // SAFETY: per this function's contract; the arrays hold `n` entries and outlive the
        // call (libfabric copies what it keeps).
        let rc = unsafe {
            sys::xfer_ofi_readv(
                self.raw.as_ptr(),
                n,
                bufs.as_ptr(),
                lens.as_ptr(),
                descs.as_mut_ptr(),
                dest,
                raddrs.as_ptr(),
                remote_key,
                context,
            )
        };
        posted("fi_readmsg", rc)
    }

    /// Posts a message send.
    ///
    /// # Safety
    /// As for [`write`](Self::write), for `buf`, `desc` and `context`.
    pub(crate) unsafe fn send(
        &mut self,
        buf: *const u8,
        len: usize,
        desc: *mut c_void,
        dest: u64,
        context: *mut c_void,
    ) -> Result<Posted, OfiError> {
        // SAFETY: per this function's contract.
        let rc =
            unsafe { sys::xfer_ofi_send(self.raw.as_ptr(), buf.cast(), len, desc, dest, context) };
        posted("fi_send", rc)
    }

    /// Posts a receive buffer.
    ///
    /// # Safety
    /// As for [`write`](Self::write); the buffer is written by the provider until completion.
    pub(crate) unsafe fn recv(
        &mut self,
        buf: *mut u8,
        len: usize,
        desc: *mut c_void,
        context: *mut c_void,
    ) -> Result<Posted, OfiError> {
        // SAFETY: per this function's contract.
        let rc = unsafe { sys::xfer_ofi_recv(self.raw.as_ptr(), buf.cast(), len, desc, context) };
        posted("fi_recv", rc)
    }

    /// Reads up to 64 completions, appending them to `out`; `Ok(n)` for n of them, or the
    /// error completion (its context and texts) that is waiting.
    pub(crate) fn read(&mut self, out: &mut Vec<Completion>) -> Result<usize, CqError> {
        // SAFETY: `entries` has entries.len() writable elements.
        let n = unsafe {
            sys::xfer_ofi_cq_read(
                self.raw.as_ptr(),
                self.entries.as_mut_ptr(),
                self.entries.len(),
            )
        };
        if n >= 0 {
            out.extend(self.entries[..n as usize].iter().map(|e| Completion {
                context: e.context as usize,
                kind: e.kind,
                len: e.len,
                data: e.data,
                src: (e.src != sys::ADDR_NOTAVAIL).then_some(e.src),
            }));
            return Ok(n as usize);
        }
        if n != sys::CQ_ERROR_AVAILABLE {
            return Err(CqError::Read(error("fi_cq_read", n as i32)));
        }
        let mut context = std::ptr::null_mut();
        let (mut err, mut prov_errno) = (0, 0);
        let mut msg = [0 as c_char; 512];
        // SAFETY: all out-pointers are valid; msg has the capacity passed.
        let rc = unsafe {
            sys::xfer_ofi_cq_readerr(
                self.raw.as_ptr(),
                &mut context,
                &mut err,
                &mut prov_errno,
                msg.as_mut_ptr(),
                msg.len(),
            )
        };
        if rc != 0 {
            return Err(CqError::Read(error("fi_cq_readerr", rc)));
        }
        Err(CqError::Completion {
            context: context as usize,
            err,
            prov_errno,
            message: text(&msg),
        })
    }
}

fn posted(what: &str, rc: i32) -> Result<Posted, OfiError> {
    match rc {
        0 => Ok(Posted::Queued),
        sys::POST_AGAIN => Ok(Posted::Again),
        _ => Err(error(what, rc)),
    }
}

/// What went wrong reading the CQ.
pub(crate) enum CqError {
    /// Reading itself failed.
    Read(OfiError),
    /// One operation completed in error.
    Completion {
        context: usize,
        err: i32,
        /// The provider's own code (EFA: its completion status or proprietary error).
        prov_errno: i32,
        message: String,
    },
}

impl Drop for Endpoint {
    fn drop(&mut self) {
        // SAFETY: opened by xfer_ofi_open and closed once; registrations are dropped first
        // (the Domain declares them before the endpoint).
        unsafe { sys::xfer_ofi_close(self.raw.as_ptr()) };
    }
}

/// A registered region, deregistered on drop.
pub(crate) struct MemoryRegistration {
    mr: NonNull<sys::FidMr>,
    pub(crate) key: u64,
    pub(crate) desc: *mut c_void,
}

// SAFETY: used only from the Domain's owning thread, like the Endpoint.
unsafe impl Send for MemoryRegistration {}

impl Drop for MemoryRegistration {
    fn drop(&mut self) {
        // SAFETY: registered by xfer_ofi_mr_reg and closed once.
        unsafe { sys::xfer_ofi_mr_close(self.mr.as_ptr()) };
    }
}

/// `FI_VERSION(major, minor)` the shim passes to `fi_getinfo`.
pub(crate) fn api_version() -> u32 {
    // SAFETY: a pure function of the loaded library's version.
    unsafe { sys::xfer_ofi_api_version() }
}

/// The Domain's source of zero-byte writes: bytes that stay at their address while
/// registered (the registration drops first).
pub(crate) struct ZeroSource {
    registration: MemoryRegistration,
    bytes: Box<[u8]>,
}

impl ZeroSource {
    /// The bytes' address, for a post.
    pub(crate) fn ptr(&self) -> *mut u8 {
        self.bytes.as_ptr().cast_mut()
    }

    /// The registration's local descriptor.
    pub(crate) fn desc(&self) -> *mut c_void {
        self.registration.desc
    }
}

/// Message buffers the Domain owns (its receive pool and its send pool), registered where
/// the provider needs local descriptors: each stays at its address and registered until the
/// pool drops, which deregisters before it frees (see `ReceivePool`).
#[derive(Default)]
pub(crate) struct MessageBuffers(ReceivePool<Option<MemoryRegistration>>);

impl MessageBuffers {
    /// A free buffer of exactly `len` bytes, or a new one, registered on `endpoint` under the
    /// key `key` gives when the provider needs local descriptors.
    pub(crate) fn take(
        &mut self,
        endpoint: &mut Endpoint,
        len: usize,
        key: impl FnOnce() -> u64,
    ) -> Result<usize, OfiError> {
        self.0.take(len, |data| {
            if endpoint.attr.mr_local == 0 {
                return Ok(None);
            }
            // SAFETY: the pool keeps `data` at this address until it drops, and drops this
            // registration before the buffer.
            unsafe { endpoint.register(data.as_ptr(), data.len(), None, key(), (false, false)) }
                .map(Some)
        })
    }

    /// Buffer `index`: its bytes' address and length, and its local descriptor (null where
    /// the provider needs none).
    pub(crate) fn get(&mut self, index: usize) -> (*mut u8, usize, *mut c_void) {
        let (ptr, len, mr) = self.0.get(index);
        (
            ptr,
            len,
            mr.as_ref().map_or(std::ptr::null_mut(), |m| m.desc),
        )
    }

    /// Copies `data` to the start of buffer `index`; false if it does not fit.
    pub(crate) fn fill(&mut self, index: usize, data: &[u8]) -> bool {
        self.0.fill(index, data)
    }

    /// A copy of the first `len` bytes of buffer `index`, which is then free for reuse.
    pub(crate) fn take_message(&mut self, index: usize, len: usize) -> Option<Vec<u8>> {
        self.0.take_message(index, len)
    }

    /// Puts buffer `index` back unused.
    pub(crate) fn release(&mut self, index: usize) {
        self.0.release(index)
    }
}
