//! Why one file: one shim per table entry, all built on the same guards (`guarded`,
//! `guarded_batch`, `handle`) and filled into one `PluginTable::new`; the table's contract is
//! the parent module. About a third of it is the shims' tests.
//!
//! The shims that fill a [`PluginTable`] from a Rust [`Domain`] opener
//! ([`export_plugin!`](crate::export_plugin) uses them): each entry turns the C call back into
//! the `Domain` method, catching panics and errors into a status and a [`RawError`]. The
//! contract they serve (types, table, layouts) is the parent module, which only grows.

use super::*;

impl PluginTable {
    /// The table for opener `O`; every entry is a shim that forwards to a Rust `Domain`.
    pub const fn new<O: PluginOpener>() -> Self {
        Self {
            header: PluginHeader {
                abi_version: ABI_VERSION,
                table_size: std::mem::size_of::<PluginTable>() as u32,
            },
            name: RawBytes {
                ptr: O::NAME.as_ptr(),
                len: O::NAME.len(),
            },
            open: shim_open::<O>,
            close: shim_close,
            address: shim_address,
            register: shim_register,
            deregister: shim_deregister,
            post_write: shim_post_write,
            post_send: shim_post_send,
            post_recvs: shim_post_recvs,
            poll: shim_poll::<true>,
            set_waker: shim_set_waker,
            post_read: Some(shim_post_read),
            capabilities: Some(shim_capabilities),
            set_log: Some(shim_set_log),
            options_format: OPTIONS_TOML,
            reserved: 0,
            check_options: match O::CHECK {
                Some(_) => Some(shim_check_options::<O>),
                None => None,
            },
            post_write_pages: Some(shim_post_write_pages),
            post_writes: Some(shim_post_writes),
        }
    }

    /// The table as a plugin built against ABI `version` built it: its header declares that
    /// version and its size, so the engine reads none of the later entries. For tests and
    /// fixtures that stand for plugins built against older ABIs (version 1: before reads;
    /// 2: before capabilities, logging and flat options; 3: before the options check; 4:
    /// before batches of pages; 5: before lists of writes; 6: before messages with their
    /// senders).
    pub const fn of_version<O: PluginOpener>(version: u32) -> Self {
        let mut table = Self::new::<O>();
        let Some(table_size) = table_size_of(version) else {
            panic!("no such ABI version");
        };
        table.header = PluginHeader {
            abi_version: version,
            table_size,
        };
        if version < 7 {
            // Before ABI 7 a plugin could not name a message's sender.
            table.poll = shim_poll::<false>;
        }
        table
    }
}

/// The handle behind the `*mut c_void`: a boxed trait object, boxed again to get a thin pointer.
type Handle = Box<dyn Domain>;

/// Runs `f`, turning a panic or an error into `STATUS_ERROR` with a message in `err`.
fn guarded(err: *mut RawError, f: impl FnOnce() -> Result<i32, DomainError>) -> i32 {
    let outcome = catch_unwind(AssertUnwindSafe(f)).unwrap_or_else(|panic| {
        // The text travels back: "the plugin panicked" alone tells a vendor nothing.
        let text = crate::panic_message(&*panic);
        Err(DomainError::new(
            DomainErrorKind::Fatal,
            format!("the plugin panicked: {text}"),
        ))
    });
    match outcome {
        Ok(status) => status,
        Err(e) => {
            // SAFETY: the engine always passes a valid, exclusive RawError.
            if let Some(err) = unsafe { err.as_mut() } {
                err.fill(&e);
            }
            STATUS_ERROR
        }
    }
}

/// # Safety
/// `domain` must be a handle returned by `open` and not yet closed, used by one thread at a time.
unsafe fn handle<'a>(domain: *mut c_void) -> &'a mut Handle {
    // SAFETY: per the function's contract, domain came from Box::into_raw in shim_open.
    unsafe { &mut *(domain as *mut Handle) }
}

fn post_status(s: PostStatus) -> i32 {
    match s {
        PostStatus::Posted => STATUS_OK,
        PostStatus::Busy => STATUS_BUSY,
    }
}

fn peer_addr(raw: RawBytes) -> Result<NetAddr, DomainError> {
    // SAFETY: the engine passes a borrowed, live address.
    NetAddr::new(unsafe { raw.as_slice() })
        .map_err(|e| DomainError::new(DomainErrorKind::InvalidArgument, e.to_string()))
}

unsafe extern "C" fn shim_open<O: PluginOpener>(
    nic: RawBytes,
    options: RawBytes,
    out: *mut *mut c_void,
    err: *mut RawError,
) -> i32 {
    guarded(err, || {
        // SAFETY: the engine passes live UTF-8 strings for the call's duration.
        let (nic, options) = unsafe { (nic.as_slice(), options.as_slice()) };
        let utf8 = |b| {
            std::str::from_utf8(b)
                .map_err(|e| DomainError::new(DomainErrorKind::InvalidArgument, e.to_string()))
        };
        let domain: Handle = (O::OPEN)(&DomainConfig {
            nic: utf8(nic)?,
            options: utf8(options)?,
        })?;
        // SAFETY: out is a valid pointer the engine provides.
        unsafe { *out = Box::into_raw(Box::new(domain)) as *mut c_void };
        Ok(STATUS_OK)
    })
}

unsafe extern "C" fn shim_close(domain: *mut c_void) {
    if !domain.is_null() {
        // SAFETY: handles come from Box::into_raw in shim_open and are closed once.
        let boxed = unsafe { Box::from_raw(domain as *mut Handle) };
        let _ = catch_unwind(AssertUnwindSafe(move || drop(boxed)));
    }
}

unsafe extern "C" fn shim_address(domain: *mut c_void, buf: *mut u8, cap: usize) -> usize {
    catch_unwind(AssertUnwindSafe(|| {
        // SAFETY: a live handle, per the ABI contract.
        let addr = unsafe { handle(domain) }.address();
        let raw = addr.raw();
        if raw.len() > cap || raw.len() > MAX_ADDR_LEN {
            return 0;
        }
        // SAFETY: buf has room for cap >= raw.len() bytes.
        unsafe { std::ptr::copy_nonoverlapping(raw.as_ptr(), buf, raw.len()) };
        raw.len()
    }))
    .unwrap_or(0)
}

unsafe extern "C" fn shim_register(
    domain: *mut c_void,
    region: *const RawRegion,
    out: *mut Registration,
    err: *mut RawError,
) -> i32 {
    guarded(err, || {
        // SAFETY: the engine passes a valid region for the call's duration.
        let r = unsafe { *region };
        let device = match r.device_kind {
            DEVICE_HOST => Device::Host,
            DEVICE_CUDA => Device::Cuda(r.device_index),
            other => {
                return Err(DomainError::new(
                    DomainErrorKind::InvalidArgument,
                    format!("unknown device kind {other} (0 = host, 1 = CUDA)"),
                ))
            }
        };
        let region = MemoryRegion {
            ptr: r.ptr,
            len: r.len,
            device,
            remote_write: r.remote_write != 0,
            remote_read: r.remote_read != 0,
        };
        // SAFETY: a live handle, per the ABI contract.
        let reg = unsafe { handle(domain) }.register(&region)?;
        // SAFETY: out is valid for writes.
        unsafe { *out = reg };
        Ok(STATUS_OK)
    })
}

unsafe extern "C" fn shim_deregister(
    domain: *mut c_void,
    local_key: u64,
    err: *mut RawError,
) -> i32 {
    guarded(err, || {
        // SAFETY: a live handle, per the ABI contract.
        let domain = unsafe { handle(domain) };
        domain.deregister(local_key).map(|()| STATUS_OK)
    })
}

unsafe extern "C" fn shim_post_write(
    domain: *mut c_void,
    wr: *const RawWrite,
    err: *mut RawError,
) -> i32 {
    // SAFETY: the engine passes a valid request for the call's duration, and a live handle
    // and error slot, per the ABI contract.
    unsafe { shim_post_rdma(domain, RawRdma::Write(*wr), err) }
}

unsafe extern "C" fn shim_post_read(
    domain: *mut c_void,
    rd: *const RawRead,
    err: *mut RawError,
) -> i32 {
    // SAFETY: as in shim_post_write.
    unsafe { shim_post_rdma(domain, RawRdma::Read(*rd), err) }
}

/// The `count` entries at `first` (which may be null when `count` is 0).
///
/// # Safety
/// With `count > 0`, `first` must point to `count` valid entries that outlive `'a`.
unsafe fn array<'a, T>(first: *const T, count: usize) -> &'a [T] {
    if count == 0 {
        &[]
    } else {
        // SAFETY: per the function's contract.
        unsafe { std::slice::from_raw_parts(first, count) }
    }
}

/// A batch entry's body, `post` (how many it posted and why it stopped, or an error before
/// posting anything), under [`guarded`], with the count stored in `posted`: a panic reports
/// nothing posted (the engine then treats the Domain as failed for good).
///
/// # Safety
/// `posted` must be valid for writes, `err` as for [`guarded`].
unsafe fn guarded_batch(
    posted: *mut usize,
    err: *mut RawError,
    post: impl FnOnce() -> Result<(usize, Result<PostStatus, DomainError>), DomainError>,
) -> i32 {
    // SAFETY: per the function's contract.
    unsafe { *posted = 0 };
    guarded(err, || {
        let (n, status) = post()?;
        // SAFETY: as above.
        unsafe { *posted = n };
        status.map(post_status)
    })
}

unsafe extern "C" fn shim_post_write_pages(
    domain: *mut c_void,
    template: *const RawWrite,
    shifts: *const PageShift,
    count: usize,
    posted: *mut usize,
    err: *mut RawError,
) -> i32 {
    let post = || {
        // SAFETY: the engine passes a valid template for the call's duration.
        let raw = RawRdma::Write(unsafe { *template });
        let peer = peer_addr(raw.peer())?;
        // SAFETY: the engine passes `count` shifts, valid for the call's duration.
        let shifts = unsafe { array(shifts, count) };
        let pages = RdmaPost::Pages {
            template: raw.request(&peer),
            shifts,
        };
        // SAFETY: a live handle, per the ABI contract.
        let (n, status) = unsafe { handle(domain) }.post_rdma(pages);
        Ok((n.min(count), status))
    };
    // SAFETY: `posted` and `err` are valid, per the ABI contract.
    unsafe { guarded_batch(posted, err, post) }
}

unsafe extern "C" fn shim_post_writes(
    domain: *mut c_void,
    requests: *const RawWrite,
    count: usize,
    posted: *mut usize,
    err: *mut RawError,
) -> i32 {
    let post = || {
        // SAFETY: the engine passes `count` requests, valid for the call's duration.
        let raws = unsafe { array(requests, count) };
        // Each run of writes to one peer decodes its address once; a request whose address
        // does not decode ends the list there (its error is the list's).
        let mut peers: Vec<NetAddr> = Vec::new();
        let mut peer_of = Vec::with_capacity(raws.len());
        let mut refused = None;
        for raw in raws {
            // SAFETY: the engine passes borrowed, live addresses.
            let bytes = unsafe { raw.peer.as_slice() };
            if peers.last().is_none_or(|p| p.raw() != bytes) {
                match peer_addr(raw.peer) {
                    Ok(peer) => peers.push(peer),
                    Err(e) => {
                        refused = Some(e);
                        break;
                    }
                }
            }
            peer_of.push(peers.len() - 1);
        }
        let list: Vec<RdmaRequest<'_>> = raws
            .iter()
            .zip(&peer_of)
            .map(|(raw, &p)| RawRdma::Write(*raw).request(&peers[p]))
            .collect();
        // SAFETY: a live handle, per the ABI contract.
        let (n, status) = unsafe { handle(domain) }.post_rdma(RdmaPost::List(&list));
        let n = n.min(list.len());
        Ok(match (status, refused) {
            (Ok(PostStatus::Posted), Some(e)) if n == list.len() => (n, Err(e)),
            (status, _) => (n, status),
        })
    };
    // SAFETY: `posted` and `err` are valid, per the ABI contract.
    unsafe { guarded_batch(posted, err, post) }
}

/// Both post shims: decode, refuse a read the Domain cannot do, post.
///
/// # Safety
/// `domain` is a live handle and `err` valid for writes, per the ABI contract.
unsafe fn shim_post_rdma(domain: *mut c_void, raw: RawRdma, err: *mut RawError) -> i32 {
    guarded(err, || {
        let peer = peer_addr(raw.peer())?;
        let req = raw.request(&peer);
        // SAFETY: a live handle, per the ABI contract.
        let domain = unsafe { handle(domain) };
        if req.is_read() && !domain.capabilities().reads {
            return Err(crate::domain::refuse_read());
        }
        // A Domain's answer for one request: its status says whether it was posted.
        let (_, status) = domain.post_rdma(RdmaPost::One(req));
        status.map(post_status)
    })
}

unsafe extern "C" fn shim_post_send(
    domain: *mut c_void,
    wr_id: u64,
    peer: RawBytes,
    data: RawBytes,
    err: *mut RawError,
) -> i32 {
    guarded(err, || {
        let peer = peer_addr(peer)?;
        // SAFETY: the engine passes live message bytes for the call's duration.
        let data = unsafe { data.as_slice() };
        // SAFETY: a live handle, per the ABI contract.
        unsafe { handle(domain) }
            .post_send(wr_id, &peer, data)
            .map(post_status)
    })
}

unsafe extern "C" fn shim_post_recvs(
    domain: *mut c_void,
    buf_len: usize,
    count: usize,
    err: *mut RawError,
) -> i32 {
    guarded(err, || {
        // SAFETY: a live handle, per the ABI contract.
        let domain = unsafe { handle(domain) };
        domain.post_recvs(buf_len, count).map(|()| STATUS_OK)
    })
}

/// `NAMES_SENDERS`: whether messages go out with their sender (`EVENT_MESSAGE_FROM`, ABI 7)
/// when the Domain names one; a table of an older version sends `EVENT_MESSAGE` only.
unsafe extern "C" fn shim_poll<const NAMES_SENDERS: bool>(
    domain: *mut c_void,
    sink: *mut c_void,
    sink_fn: EventSink,
    err: *mut RawError,
) -> i32 {
    guarded(err, || {
        let mut events = Vec::new();
        // SAFETY: a live handle, per the ABI contract.
        unsafe { handle(domain) }.poll(&mut events)?;
        for event in &events {
            // The framed bytes of a message with its sender, alive until the sink returned.
            let framed;
            let raw = match event {
                Event::Done {
                    wr_id,
                    result: Ok(()),
                } => RawEvent {
                    kind: EVENT_DONE,
                    error_kind: 0,
                    wr_id: *wr_id,
                    imm: 0,
                    data: RawBytes::new(&[]),
                },
                Event::Done {
                    wr_id,
                    result: Err(e),
                } => RawEvent {
                    kind: EVENT_FAILED,
                    error_kind: e.kind as u32,
                    wr_id: *wr_id,
                    imm: 0,
                    data: RawBytes::new(e.message.as_bytes()),
                },
                Event::ImmArrival { imm, from } => RawEvent {
                    kind: EVENT_IMM,
                    error_kind: 0,
                    wr_id: 0,
                    imm: *imm,
                    data: RawBytes::new(from.as_ref().map_or(&[], NetAddr::raw)),
                },
                Event::Message {
                    data,
                    from: Some(from),
                } if NAMES_SENDERS => {
                    framed = encode_message_from(from, data);
                    RawEvent {
                        kind: EVENT_MESSAGE_FROM,
                        error_kind: 0,
                        wr_id: 0,
                        imm: 0,
                        data: RawBytes::new(&framed),
                    }
                }
                Event::Message { data, .. } => RawEvent {
                    kind: EVENT_MESSAGE,
                    error_kind: 0,
                    wr_id: 0,
                    imm: 0,
                    data: RawBytes::new(data),
                },
            };
            // SAFETY: sink/sink_fn come from the engine's PluginDomain::poll and are valid
            // for this call; raw borrows `events`, which outlives the call.
            unsafe { sink_fn(sink, &raw) };
        }
        Ok(STATUS_OK)
    })
}

unsafe extern "C" fn shim_set_waker(domain: *mut c_void, ctx: *const c_void, wake: WakeFn) -> u32 {
    /// Lets the raw context cross into the `Send + Sync` waker closure.
    struct Ctx(*const c_void);
    // SAFETY: the engine guarantees ctx stays valid and callable from any thread until close.
    unsafe impl Send for Ctx {}
    // SAFETY: as above; the engine's wake context is thread-safe.
    unsafe impl Sync for Ctx {}
    let ctx = Ctx(ctx);
    let waker = crate::domain::Waker::new(move || {
        let ctx = &ctx;
        // SAFETY: the engine keeps ctx alive until after close.
        unsafe { wake(ctx.0) }
    });
    catch_unwind(AssertUnwindSafe(|| {
        // SAFETY: a live handle, per the ABI contract.
        let domain = unsafe { handle(domain) };
        domain.set_waker(waker) as u32
    }))
    .unwrap_or(0)
}

unsafe extern "C" fn shim_capabilities(domain: *mut c_void, out: *mut RawCapabilities) -> i32 {
    catch_unwind(AssertUnwindSafe(|| {
        // SAFETY: a live handle, per the ABI contract.
        let caps = unsafe { handle(domain) }.capabilities();
        // SAFETY: out is valid for writes, per the ABI contract.
        unsafe { *out = RawCapabilities::from_capabilities(&caps) };
        STATUS_OK
    }))
    .unwrap_or(STATUS_ERROR)
}

unsafe extern "C" fn shim_set_log(log: LogFn, max_level: u32) {
    static MAX_LEVEL: std::sync::atomic::AtomicU32 = std::sync::atomic::AtomicU32::new(0);
    // This library's own copy of `tracing` gets a global subscriber that forwards to the host.
    // A later call (the library loaded again by another engine) finds it set and keeps it —
    // the host's function is the same — but takes the host's level as it is now.
    let _ = catch_unwind(|| {
        crate::log::Forward::set_max_level(&MAX_LEVEL, max_level);
        let _ = tracing::subscriber::set_global_default(crate::log::Forward::new(log, &MAX_LEVEL));
    });
}

/// `check_options` for opener `O` (only in tables whose opener has a check).
unsafe extern "C" fn shim_check_options<O: PluginOpener>(
    options: RawBytes,
    err: *mut RawError,
) -> i32 {
    guarded(err, || {
        // SAFETY: the engine passes its options text, live for the call.
        let text = std::str::from_utf8(unsafe { options.as_slice() }).map_err(|_| {
            DomainError::new(DomainErrorKind::InvalidArgument, "options are not UTF-8")
        })?;
        let check = O::CHECK.ok_or_else(|| {
            DomainError::new(DomainErrorKind::Other, "this plugin has no options check")
        })?;
        check(text)
            .map(|()| STATUS_OK)
            .map_err(|m| DomainError::new(DomainErrorKind::InvalidArgument, m))
    })
}

/// Exports a backend as an xfer plugin: `export_plugin!("name", open_fn);` in a `cdylib`, or
/// `export_plugin!("name", open_fn, check = check_fn);` to have mistyped options refused when
/// an engine opens, before any NIC.
///
/// `open_fn` has the type [`OpenFn`]; `check_fn` is a `fn(&str) -> Result<(), String>` given
/// the options' TOML text; `"name"` must be a string literal (it names the entry symbol,
/// [`entry_symbol`]`("name")`).
#[macro_export]
macro_rules! export_plugin {
    ($name:literal, $open:path) => {
        $crate::export_plugin!(@table $name, $open, None);
    };
    ($name:literal, $open:path, check = $check:expr) => {
        $crate::export_plugin!(@table $name, $open, Some($check));
    };
    (@table $name:literal, $open:path, $check:expr) => {
        #[doc(hidden)]
        pub struct XferPluginOpener;
        impl $crate::abi::PluginOpener for XferPluginOpener {
            const NAME: &'static str = $name;
            const OPEN: $crate::domain::OpenFn = $open;
            const CHECK: Option<$crate::domain::CheckOptionsFn> = $check;
        }
        #[doc(hidden)]
        pub static XFER_PLUGIN_TABLE: $crate::abi::PluginTable =
            $crate::abi::PluginTable::new::<XferPluginOpener>();
        /// The xfer plugin entry point of this backend.
        #[export_name = concat!("xfer_plugin_entry_", $name)]
        pub extern "C" fn xfer_plugin_entry() -> *const $crate::abi::PluginTable {
            &XFER_PLUGIN_TABLE
        }
    };
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::domain::{post_one_by_one, DomainConfig, PostStatus};

    /// A Domain that accepts registrations and records the local and remote address of every
    /// write it accepts, answering the write numbered `stop` (from 0) with `Busy` (`true`) or
    /// an error: enough to drive the shims.
    struct Inert {
        seen: std::sync::Arc<std::sync::Mutex<Vec<(u64, u64)>>>,
        stop: Option<(usize, bool)>,
    }

    impl Domain for Inert {
        fn address(&self) -> NetAddr {
            NetAddr::new(b"inert").expect("a valid address")
        }
        fn register(&mut self, _: &MemoryRegion) -> Result<Registration, DomainError> {
            Ok(Registration {
                local_key: 1,
                remote_key: 2,
            })
        }
        fn deregister(&mut self, _: u64) -> Result<(), DomainError> {
            Ok(())
        }
        fn post_rdma(&mut self, post: RdmaPost<'_>) -> (usize, Result<PostStatus, DomainError>) {
            let mut seen = self.seen.lock().unwrap();
            post_one_by_one(post, |req| match self.stop {
                Some((n, true)) if seen.len() == n => Ok(PostStatus::Busy),
                Some((n, false)) if seen.len() == n => {
                    Err(DomainError::new(DomainErrorKind::RemoteAccess, "refused"))
                }
                _ => {
                    seen.push((req.local_addr, req.remote_addr));
                    Ok(PostStatus::Posted)
                }
            })
        }
        fn post_send(&mut self, _: u64, _: &NetAddr, _: &[u8]) -> Result<PostStatus, DomainError> {
            Ok(PostStatus::Busy)
        }
        fn post_recvs(&mut self, _: usize, _: usize) -> Result<(), DomainError> {
            Ok(())
        }
        fn poll(&mut self, _: &mut Vec<Event>) -> Result<(), DomainError> {
            Ok(())
        }
    }

    /// An `Inert` whose every write is busy.
    fn open_inert(_: &DomainConfig<'_>) -> Result<Box<dyn Domain>, DomainError> {
        Ok(Box::new(Inert {
            seen: Default::default(),
            stop: Some((0, true)),
        }))
    }

    struct InertOpener;
    impl PluginOpener for InertOpener {
        const NAME: &'static str = "inert";
        const OPEN: OpenFn = open_inert;
    }

    /// Through the C ABI as the engine calls it: a device kind the ABI does not define is
    /// refused with its number, never taken for CUDA; the defined ones register.
    #[test]
    fn an_unknown_device_kind_is_refused_by_the_shim() {
        let table = PluginTable::new::<InertOpener>();
        let handle = open_through(&table);
        let buf = [0u8; 64];
        let region = |device_kind| RawRegion {
            ptr: buf.as_ptr() as u64,
            len: buf.len() as u64,
            device_kind,
            device_index: 0,
            remote_write: 1,
            remote_read: 0,
        };
        let mut out = Registration {
            local_key: 0,
            remote_key: 0,
        };
        for (kind, want) in [(DEVICE_HOST, STATUS_OK), (7, STATUS_ERROR)] {
            let mut err = RawError::empty();
            // SAFETY: a live handle; the region and out-pointers live for the call.
            let status = unsafe { (table.register)(handle, &region(kind), &mut out, &mut err) };
            assert_eq!(status, want, "device kind {kind}");
            if want == STATUS_ERROR {
                let e = err.to_error();
                assert_eq!(e.kind, DomainErrorKind::InvalidArgument);
                assert!(e.message.contains("unknown device kind 7"), "{e}");
            }
        }
        // SAFETY: the handle came from open and is closed once.
        unsafe { (table.close)(handle) };
    }

    /// The capabilities entry reports what the Domain declares, in the C layout.
    #[test]
    fn capabilities_cross_the_abi_unchanged() {
        let caps = Capabilities {
            max_write_size: Some(1 << 20),
            max_message_size: None,
            max_address_len: 12,
            host_memory: true,
            cuda_memory: false,
            dmabuf: true,
            immediates: false,
            zero_byte_writes: true,
            needs_receiver_polling: true,
            reads: false,
        };
        assert_eq!(
            RawCapabilities::from_capabilities(&caps).to_capabilities(),
            caps
        );
        assert_eq!(
            RawCapabilities::from_capabilities(&Capabilities::default()).to_capabilities(),
            Capabilities::default()
        );
    }

    /// Opens an `Inert` Domain through the table, as the engine does.
    fn open_through(table: &PluginTable) -> *mut c_void {
        let mut handle = std::ptr::null_mut();
        let mut err = RawError::empty();
        // SAFETY: the strings and out-pointers live for the call.
        let opened = unsafe {
            (table.open)(
                RawBytes::new(b"nic0"),
                RawBytes::new(b""),
                &mut handle,
                &mut err,
            )
        };
        assert_eq!(opened, STATUS_OK);
        handle
    }

    /// A request turned into the C structs and back is the same request, for writes with and
    /// without an immediate and for reads; a write's immediate never leaks into a read.
    #[test]
    fn rdma_requests_cross_the_abi_unchanged() {
        let peer = NetAddr::new(b"peer-7").expect("a valid address");
        for op in [
            RdmaOp::Write { imm: Some(0) },
            RdmaOp::Write {
                imm: Some(u32::MAX),
            },
            RdmaOp::Write { imm: None },
            RdmaOp::Read,
        ] {
            let req = RdmaRequest {
                wr_id: 11,
                op,
                peer: &peer,
                local_addr: 0x1000,
                local_key: 3,
                remote_addr: 0x2040,
                remote_key: 5,
                remote_base: 0x2000,
                len: 64,
            };
            let raw = RawRdma::from_request(&req);
            assert_eq!(matches!(raw, RawRdma::Read(_)), op == RdmaOp::Read);
            // The raw bytes borrow `peer`, alive here.
            let back = peer_addr(raw.peer()).expect("the peer's bytes");
            assert_eq!(back, peer);
            assert_eq!(raw.request(&back), RdmaRequest { peer: &back, ..req });
        }
    }

    /// The table's two entries reach the Domain's one `post_rdma`, except a read to a Domain
    /// that does not support reads: the shim refuses it, typed, before the Domain sees it.
    #[test]
    fn a_read_to_a_domain_without_reads_is_refused_by_the_shim() {
        let table = PluginTable::new::<InertOpener>();
        let handle = open_through(&table);
        let peer = NetAddr::new(b"peer").expect("a valid address");
        let write = RawWrite {
            wr_id: 1,
            peer: RawBytes::new(peer.raw()),
            local_addr: 0,
            local_key: 0,
            remote_addr: 0,
            remote_key: 1,
            remote_base: 0,
            len: 0,
            has_imm: 1,
            imm: 9,
        };
        let mut err = RawError::empty();
        // SAFETY: a live handle; the request and error slot live for the call.
        let status = unsafe { (table.post_write)(handle, &write, &mut err) };
        assert_eq!(status, STATUS_BUSY, "the write reached Inert's post_rdma");
        let read = RawRead {
            wr_id: 2,
            peer: RawBytes::new(peer.raw()),
            local_addr: 0,
            local_key: 0,
            remote_addr: 0,
            remote_key: 1,
            remote_base: 0,
            len: 8,
        };
        let post_read = table.post_read.expect("ABI 2 has reads");
        let mut err = RawError::empty();
        // SAFETY: as above.
        let status = unsafe { post_read(handle, &read, &mut err) };
        assert_eq!(status, STATUS_ERROR);
        let e = err.to_error();
        assert_eq!(e.kind, DomainErrorKind::InvalidArgument);
        assert!(e.message.contains("RDMA READ"), "{e}");
        // SAFETY: the handle came from open and is closed once.
        unsafe { (table.close)(handle) };
    }

    /// Calls a C batch entry, `post(handle, posted, err)`, on an `Inert` that stops at
    /// `stop`; returns the status, what the entry said it posted, its error slot, and the
    /// (local, remote) addresses the Domain took.
    fn post_to_inert(
        stop: Option<(usize, bool)>,
        post: impl FnOnce(*mut c_void, &mut usize, &mut RawError) -> i32,
    ) -> (i32, usize, RawError, Vec<(u64, u64)>) {
        let seen = std::sync::Arc::new(std::sync::Mutex::new(Vec::new()));
        let mut domain: Handle = Box::new(Inert {
            seen: std::sync::Arc::clone(&seen),
            stop,
        });
        let handle = (&mut domain as *mut Handle).cast::<c_void>();
        let (mut posted, mut err) = (usize::MAX, RawError::empty());
        let status = post(handle, &mut posted, &mut err);
        let seen = seen.lock().unwrap().clone();
        (status, posted, err, seen)
    }

    /// ABI 5: a batch of pages through the C entry reaches the Domain as each page's request
    /// (the template moved by its shift), and the entry reports how many were posted and why
    /// it stopped — all posted, the NIC full at page 2, or page 3 refused with its error.
    #[test]
    fn a_batch_of_pages_crosses_the_abi_and_says_where_it_stopped() {
        let peer = NetAddr::new(b"peer-9").expect("a valid address");
        let template = RawWrite {
            wr_id: 5,
            peer: RawBytes::new(peer.raw()),
            local_addr: 0x1000,
            local_key: 1,
            remote_addr: 0x8000,
            remote_key: 2,
            remote_base: 0x8000,
            len: 64,
            has_imm: 1,
            imm: 9,
        };
        let shifts: Vec<PageShift> = (0..5).map(|i| PageShift::new(64 * i, 128 * i)).collect();
        for (stop, want_posted, want_status) in [
            (None, 5, STATUS_OK),
            (Some((2, true)), 2, STATUS_BUSY),
            (Some((3, false)), 3, STATUS_ERROR),
        ] {
            // SAFETY: a live handle (boxed by post_to_inert, outliving the call), a valid
            // template and shifts, and output slots of ours.
            let (status, posted, err, seen) = post_to_inert(stop, |handle, posted, err| unsafe {
                shim_post_write_pages(handle, &template, shifts.as_ptr(), 5, posted, err)
            });
            assert_eq!((posted, status), (want_posted, want_status), "{stop:?}");
            let expected: Vec<(u64, u64)> = shifts[..want_posted]
                .iter()
                .map(|s| (0x1000 + s.local, 0x8000 + s.remote))
                .collect();
            assert_eq!(seen, expected, "{stop:?}");
            if status == STATUS_ERROR {
                let e = err.to_error();
                assert_eq!(
                    (e.kind, e.message.as_str()),
                    (DomainErrorKind::RemoteAccess, "refused")
                );
            }
        }
        // No shifts: nothing posted, nothing to say.
        // SAFETY: as above; a null array with a count of 0 is never read.
        let (status, posted, ..) = post_to_inert(None, |handle, posted, err| unsafe {
            shim_post_write_pages(handle, &template, std::ptr::null(), 0, posted, err)
        });
        assert_eq!((posted, status), (0, STATUS_OK));
    }

    /// ABI 6: a list of writes through the C entry reaches the Domain request by request,
    /// each with its own addresses, and the entry says how many were posted and why it
    /// stopped — all posted, the NIC full at request 2, request 3 refused, or request 4's
    /// address not decodable (the four before it posted, the list's error names it).
    #[test]
    fn a_list_of_writes_crosses_the_abi_and_says_where_it_stopped() {
        let (a, b) = (b"peer-a".as_slice(), b"peer-b".as_slice());
        let write = |i: u64, peer: &[u8]| RawWrite {
            wr_id: i,
            peer: RawBytes::new(peer),
            local_addr: 0x1000 + 8 * i,
            local_key: 1,
            remote_addr: 0x8000 - 16 * i,
            remote_key: 2,
            remote_base: 0x7000,
            len: 8,
            has_imm: (i % 2) as u32,
            imm: i as u32,
        };
        let too_long = [7u8; MAX_ADDR_LEN + 1];
        for (stop, last, want_posted, want_status) in [
            (None, b, 5, STATUS_OK),
            (Some((2, true)), b, 2, STATUS_BUSY),
            (Some((3, false)), b, 3, STATUS_ERROR),
            (None, &too_long[..], 4, STATUS_ERROR),
        ] {
            let writes: Vec<RawWrite> = [a, a, b, a, last]
                .iter()
                .zip(0..)
                .map(|(p, i)| write(i, p))
                .collect();
            // SAFETY: a live handle (boxed by post_to_inert, outliving the call), valid
            // requests whose peers outlive the call, and output slots of ours.
            let (status, posted, err, seen) = post_to_inert(stop, |handle, posted, err| unsafe {
                shim_post_writes(handle, writes.as_ptr(), writes.len(), posted, err)
            });
            assert_eq!((posted, status), (want_posted, want_status), "{stop:?}");
            let expected: Vec<(u64, u64)> = writes[..want_posted]
                .iter()
                .map(|w| (w.local_addr, w.remote_addr))
                .collect();
            assert_eq!(seen, expected, "{stop:?}");
            if status == STATUS_ERROR {
                let e = err.to_error();
                let want = if stop.is_some() {
                    DomainErrorKind::RemoteAccess
                } else {
                    DomainErrorKind::InvalidArgument
                };
                assert_eq!(e.kind, want, "{e}");
            }
        }
    }
}
