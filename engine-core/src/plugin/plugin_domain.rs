//! A Domain that lives in a plugin: every call goes through the plugin's table of C entries
//! (events collected through a callback, wakers through a trampoline).

use std::ffi::c_void;
use std::sync::Arc;

use super::abi::{
    decode_message_from, RawBytes, RawCapabilities, RawError, RawEvent, RawRdma, RawRegion,
    RawWrite, DEVICE_CUDA, DEVICE_HOST, EVENT_DONE, EVENT_FAILED, EVENT_IMM, EVENT_MESSAGE,
    EVENT_MESSAGE_FROM, OPTIONS_FLAT, STATUS_BUSY, STATUS_OK,
};
use super::flat::flat_options;
use super::loader::LoadedPlugin;
use crate::domain::{
    post_one_by_one, Capabilities, Device, Domain, DomainConfig, DomainError, DomainErrorKind,
    Event, MemoryRegion, PageShift, PostStatus, RdmaPost, RdmaRequest, Registration, Waker,
};
use crate::wire::{NetAddr, MAX_ADDR_LEN};
use smallvec::SmallVec;

impl LoadedPlugin {
    /// The plugin's `check_options` on `options` (converted to its format), if it has one.
    pub(super) fn check_options(&self, options: &str) -> Result<(), String> {
        let Some(check) = self.table.check_options else {
            return Ok(());
        };
        let flat;
        let options = if self.table.options_format == OPTIONS_FLAT {
            flat = flat_options(options).map_err(|e| e.message)?;
            flat.as_str()
        } else {
            options
        };
        let mut err = RawError::empty();
        // SAFETY: the text is live for the call and only borrowed during it.
        let status = unsafe { check(RawBytes::new(options.as_bytes()), &mut err) };
        if status == STATUS_OK {
            Ok(())
        } else {
            Err(err.to_error().message)
        }
    }

    pub(super) fn open(
        self: &Arc<Self>,
        config: &DomainConfig<'_>,
    ) -> Result<Box<dyn Domain>, DomainError> {
        let flat;
        let options = if self.table.options_format == OPTIONS_FLAT {
            flat = flat_options(config.options)?;
            flat.as_str()
        } else {
            config.options
        };
        let mut handle: *mut c_void = std::ptr::null_mut();
        let mut err = RawError::empty();
        // SAFETY: every pointer is live for the call; the strings are borrowed only during it.
        let status = unsafe {
            (self.table.open)(
                RawBytes::new(config.nic.as_bytes()),
                RawBytes::new(options.as_bytes()),
                &mut handle,
                &mut err,
            )
        };
        if status != STATUS_OK || handle.is_null() {
            return Err(err.to_error());
        }
        Ok(Box::new(PluginDomain {
            plugin: Arc::clone(self),
            handle,
            wakers: Vec::new(),
        }))
    }
}

/// A Domain living in a plugin; every call goes through the table.
struct PluginDomain {
    plugin: Arc<LoadedPlugin>,
    handle: *mut c_void,
    /// The ids of the wakers handed to the plugin (its `ctx`), removed from [`WAKERS`] on drop.
    wakers: Vec<usize>,
}

/// Wakers handed to plugins, by id. A plugin gets an id, never a pointer: one that (against
/// the contract) calls its waker after `close` finds nothing and does nothing, instead of
/// reading freed memory.
static WAKERS: std::sync::LazyLock<std::sync::RwLock<std::collections::HashMap<usize, Waker>>> =
    std::sync::LazyLock::new(Default::default);
static NEXT_WAKER: std::sync::atomic::AtomicUsize = std::sync::atomic::AtomicUsize::new(1);

// SAFETY: the ABI requires Domains to be movable between threads (the engine uses each from
// one worker thread at a time), exactly like the `Send` bound on the Rust trait.
unsafe impl Send for PluginDomain {}

impl PluginDomain {
    fn check(status: i32, err: &RawError) -> Result<PostStatus, DomainError> {
        match status {
            STATUS_OK => Ok(PostStatus::Posted),
            STATUS_BUSY => Ok(PostStatus::Busy),
            _ => Err(err.to_error()),
        }
    }
}

impl Drop for PluginDomain {
    fn drop(&mut self) {
        // SAFETY: the handle came from open and is closed exactly once, here.
        unsafe { (self.plugin.table.close)(self.handle) };
        // After close; a late call finds no waker (see WAKERS).
        let mut wakers = WAKERS.write().unwrap_or_else(|p| p.into_inner());
        for id in self.wakers.drain(..) {
            wakers.remove(&id);
        }
    }
}

/// What a poll collects: the events, the first event kind the engine does not know, and the
/// length of the first message whose sender was framed wrongly.
struct Collected<'a> {
    events: &'a mut Vec<Event>,
    unknown_kind: Option<u32>,
    bad_sender: Option<usize>,
    /// The last sender an arrival named: a stream of arrivals from one peer shares one
    /// address instead of allocating one each.
    last_source: Option<NetAddr>,
}

impl Collected<'_> {
    /// The sender an `EVENT_IMM` names in its bytes (none when empty or not an address).
    fn source(&mut self, raw: &[u8]) -> Option<NetAddr> {
        if raw.is_empty() {
            return None;
        }
        if self
            .last_source
            .as_ref()
            .is_none_or(|last| last.raw() != raw)
        {
            self.last_source = Some(NetAddr::new(raw).ok()?);
        }
        self.last_source.clone()
    }
}

unsafe extern "C" fn collect_event(sink: *mut c_void, event: *const RawEvent) {
    // SAFETY: sink is the &mut Collected passed by PluginDomain::poll for this call.
    let collected = unsafe { &mut *(sink as *mut Collected<'_>) };
    // SAFETY: the plugin passes a valid event whose bytes live for this call.
    let e = unsafe { &*event };
    // SAFETY: as above.
    let data = unsafe { e.data.as_slice() };
    let event = match e.kind {
        EVENT_DONE => Event::Done {
            wr_id: e.wr_id,
            result: Ok(()),
        },
        EVENT_FAILED => Event::Done {
            wr_id: e.wr_id,
            result: Err(DomainError::new(
                DomainErrorKind::from_raw(e.error_kind),
                String::from_utf8_lossy(data).into_owned(),
            )),
        },
        EVENT_IMM => Event::ImmArrival {
            imm: e.imm,
            from: collected.source(data),
        },
        EVENT_MESSAGE => Event::Message {
            data: data.to_vec(),
            from: None,
        },
        EVENT_MESSAGE_FROM => match decode_message_from(data) {
            Some((from, message)) => Event::Message {
                data: message.to_vec(),
                from: Some(from),
            },
            // Never delivered without its sender: a plugin that frames it wrongly is broken.
            None => {
                collected.bad_sender.get_or_insert(data.len());
                return;
            }
        },
        // Never guessed at: taken for a message, an immediate would vanish.
        other => {
            collected.unknown_kind.get_or_insert(other);
            return;
        }
    };
    collected.events.push(event);
}

unsafe extern "C" fn wake_trampoline(ctx: *const c_void) {
    // ctx is a waker id, not a pointer (see WAKERS): nothing is dereferenced.
    let id = ctx as usize;
    let waker = WAKERS
        .read()
        .unwrap_or_else(|p| p.into_inner())
        .get(&id)
        .cloned();
    if let Some(w) = waker {
        w.wake();
    }
}

/// Writes and reads through the table's entries for them (see `post_rdma` below).
impl PluginDomain {
    /// One write or read through `post_write` or `post_read` (ABI 2).
    fn post_one(&mut self, req: &RdmaRequest<'_>) -> Result<PostStatus, DomainError> {
        let mut err = RawError::empty();
        let status = match RawRdma::from_request(req) {
            // SAFETY: live handle; raw borrows req.peer, which outlives the call.
            RawRdma::Write(raw) => unsafe {
                (self.plugin.table.post_write)(self.handle, &raw, &mut err)
            },
            RawRdma::Read(raw) => {
                let Some(post_read) = self.plugin.table.post_read else {
                    return Err(DomainError::new(
                        DomainErrorKind::InvalidArgument,
                        format!(
                            "plugin {} ({}, ABI version {}) has no RDMA READ",
                            self.plugin.name,
                            self.plugin.path.display(),
                            self.plugin.version
                        ),
                    ));
                };
                // SAFETY: as for the write.
                unsafe { post_read(self.handle, &raw, &mut err) }
            }
        };
        Self::check(status, &err)
    }

    /// A batch of writes in one call when the plugin has the ABI-5 entry; otherwise (reads,
    /// older plugins) one call per page.
    fn post_pages(
        &mut self,
        template: RdmaRequest<'_>,
        shifts: &[PageShift],
    ) -> (usize, Result<PostStatus, DomainError>) {
        let (Some(post_pages), RawRdma::Write(raw)) = (
            self.plugin.table.post_write_pages,
            RawRdma::from_request(&template),
        ) else {
            let pages = RdmaPost::Pages { template, shifts };
            return post_one_by_one(pages, |r| self.post_one(r));
        };
        let (mut err, mut posted) = (RawError::empty(), 0usize);
        // SAFETY: live handle; `raw` borrows the template's peer and `shifts` is valid for
        // `shifts.len()` entries, both outliving the call; `posted` and `err` are ours.
        let status = unsafe {
            post_pages(
                self.handle,
                &raw,
                shifts.as_ptr(),
                shifts.len(),
                &mut posted,
                &mut err,
            )
        };
        // A plugin claiming more than it was given is not believed past the batch.
        (posted.min(shifts.len()), Self::check(status, &err))
    }

    /// A burst's writes in calls of up to `LIST_LEN` when the plugin has the ABI-6 entry;
    /// otherwise (reads, older plugins) one call per request.
    fn post_list(
        &mut self,
        requests: &[RdmaRequest<'_>],
    ) -> (usize, Result<PostStatus, DomainError>) {
        /// Writes per call: their C forms live on the stack.
        const LIST_LEN: usize = 32;
        let Some(post_writes) = self.plugin.table.post_writes else {
            return post_one_by_one(RdmaPost::List(requests), |r| self.post_one(r));
        };
        let mut posted = 0;
        while let Some(rest) = requests.get(posted..).filter(|r| !r.is_empty()) {
            // The writes up to the next read (ABI 6 carries writes; a read goes alone).
            let writes: SmallVec<[RawWrite; LIST_LEN]> = rest
                .iter()
                .take(LIST_LEN)
                .map_while(|r| match RawRdma::from_request(r) {
                    RawRdma::Write(raw) => Some(raw),
                    RawRdma::Read(_) => None,
                })
                .collect();
            if writes.is_empty() {
                match self.post_one(&rest[0]) {
                    Ok(PostStatus::Posted) => posted += 1,
                    stopped => return (posted, stopped),
                }
                continue;
            }
            let (mut err, mut n) = (RawError::empty(), 0usize);
            // SAFETY: live handle; `writes` borrow their requests' peers, which outlive the
            // call, and hold `writes.len()` entries; `n` and `err` are ours.
            let status = unsafe {
                post_writes(self.handle, writes.as_ptr(), writes.len(), &mut n, &mut err)
            };
            // A plugin claiming more than it was given is not believed past the list.
            let n = n.min(writes.len());
            posted += n;
            match Self::check(status, &err) {
                Ok(PostStatus::Posted) if n == writes.len() => {}
                stopped => return (posted, stopped),
            }
        }
        (posted, Ok(PostStatus::Posted))
    }
}

impl Domain for PluginDomain {
    fn address(&self) -> NetAddr {
        let mut buf = [0u8; MAX_ADDR_LEN];
        // SAFETY: live handle; buf has MAX_ADDR_LEN bytes of room.
        let n = unsafe { (self.plugin.table.address)(self.handle, buf.as_mut_ptr(), buf.len()) };
        // A plugin returning no address is broken; a one-byte zero address fails every
        // lookup loudly instead of crashing here.
        NetAddr::new(&buf[..n]).unwrap_or_else(|_| NetAddr::new(&[0]).expect("one byte is valid"))
    }

    fn register(&mut self, region: &MemoryRegion) -> Result<Registration, DomainError> {
        let (device_kind, device_index) = match region.device {
            Device::Host => (DEVICE_HOST, 0),
            Device::Cuda(i) => (DEVICE_CUDA, i),
        };
        let raw = RawRegion {
            ptr: region.ptr,
            len: region.len,
            device_kind,
            device_index,
            remote_write: region.remote_write as u32,
            remote_read: region.remote_read as u32,
        };
        let mut out = Registration {
            local_key: 0,
            remote_key: 0,
        };
        let mut err = RawError::empty();
        // SAFETY: live handle; all pointers valid for the call.
        let status = unsafe { (self.plugin.table.register)(self.handle, &raw, &mut out, &mut err) };
        Self::check(status, &err).map(|_| out)
    }

    fn deregister(&mut self, local_key: u64) -> Result<(), DomainError> {
        let mut err = RawError::empty();
        // SAFETY: live handle; err valid for the call.
        let status = unsafe { (self.plugin.table.deregister)(self.handle, local_key, &mut err) };
        Self::check(status, &err).map(|_| ())
    }

    /// Each kind of post onto the table's entries for it: a batch of pages onto
    /// `post_write_pages` (ABI 5), a list onto `post_writes` (ABI 6), one request onto
    /// `post_write` or `post_read`; what the plugin's version has no entry for goes one by one.
    fn post_rdma(&mut self, post: RdmaPost<'_>) -> (usize, Result<PostStatus, DomainError>) {
        match post {
            RdmaPost::Pages { template, shifts } => self.post_pages(template, shifts),
            RdmaPost::List(requests) => self.post_list(requests),
            one_or_newer => post_one_by_one(one_or_newer, |r| self.post_one(r)),
        }
    }

    fn post_send(
        &mut self,
        wr_id: u64,
        peer: &NetAddr,
        data: &[u8],
    ) -> Result<PostStatus, DomainError> {
        let mut err = RawError::empty();
        // SAFETY: live handle; both byte strings outlive the call (the plugin copies them).
        let status = unsafe {
            (self.plugin.table.post_send)(
                self.handle,
                wr_id,
                RawBytes::new(peer.raw()),
                RawBytes::new(data),
                &mut err,
            )
        };
        Self::check(status, &err)
    }

    fn post_recvs(&mut self, buf_len: usize, count: usize) -> Result<(), DomainError> {
        let mut err = RawError::empty();
        // SAFETY: live handle; err valid for the call.
        let status =
            unsafe { (self.plugin.table.post_recvs)(self.handle, buf_len, count, &mut err) };
        Self::check(status, &err).map(|_| ())
    }

    fn poll(&mut self, events: &mut Vec<Event>) -> Result<(), DomainError> {
        let mut err = RawError::empty();
        let mut collected = Collected {
            events,
            unknown_kind: None,
            bad_sender: None,
            last_source: None,
        };
        let sink = &mut collected as *mut Collected<'_> as *mut c_void;
        // SAFETY: live handle; `sink` is exclusively borrowed for the call, and collect_event
        // casts it back to the same type.
        let status =
            unsafe { (self.plugin.table.poll)(self.handle, sink, collect_event, &mut err) };
        if let Some(kind) = collected.unknown_kind {
            return Err(DomainError::new(
                DomainErrorKind::Fatal,
                format!(
                    "plugin {} handed the engine an event of unknown kind {kind} (ABI version {})",
                    self.plugin.name, self.plugin.version
                ),
            ));
        }
        if let Some(len) = collected.bad_sender {
            return Err(DomainError::new(
                DomainErrorKind::Fatal,
                format!(
                    "plugin {} handed the engine a message of {len} bytes whose sender is not framed as an address (ABI version {})",
                    self.plugin.name, self.plugin.version
                ),
            ));
        }
        Self::check(status, &err).map(|_| ())
    }

    fn capabilities(&self) -> Capabilities {
        // Reads are the table's `post_read` entry (ABI 2), whatever else the plugin declares.
        let reads = self.plugin.table.post_read.is_some();
        let Some(query) = self.plugin.table.capabilities else {
            return Capabilities {
                reads,
                ..Capabilities::default()
            };
        };
        let mut raw = RawCapabilities::from_capabilities(&Capabilities::default());
        // SAFETY: live handle; raw is valid for writes during the call.
        if unsafe { query(self.handle, &mut raw) } != STATUS_OK {
            tracing::warn!(plugin = %self.plugin.name, "the plugin's capabilities query failed; assuming the defaults");
            return Capabilities {
                reads,
                ..Capabilities::default()
            };
        }
        Capabilities {
            reads,
            ..raw.to_capabilities()
        }
    }

    fn set_waker(&mut self, waker: Waker) -> bool {
        let id = NEXT_WAKER.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
        WAKERS
            .write()
            .unwrap_or_else(|p| p.into_inner())
            .insert(id, waker);
        let ctx = id as *const c_void;
        // SAFETY: live handle; ctx is an opaque id the trampoline looks up, valid forever.
        let will_wake =
            unsafe { (self.plugin.table.set_waker)(self.handle, ctx, wake_trampoline) } != 0;
        // A previous waker stays registered until close: the plugin may still call it.
        self.wakers.push(id);
        will_wake
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// An event kind the engine does not know is never guessed at (taken for a message, an
    /// immediate would vanish): it is recorded, and poll turns it into a fatal error.
    #[test]
    fn an_unknown_event_kind_is_recorded_not_read_as_a_message() {
        let mut events = Vec::new();
        let mut collected = Collected {
            events: &mut events,
            unknown_kind: None,
            bad_sender: None,
            last_source: None,
        };
        let sink = &mut collected as *mut Collected<'_> as *mut c_void;
        for kind in [2, 9, 3] {
            let event = RawEvent {
                kind,
                error_kind: 0,
                wr_id: 0,
                imm: 7,
                data: RawBytes::new(b"m"),
            };
            // SAFETY: sink points at a live Collected; the event and its bytes are live.
            unsafe { collect_event(sink, &event) };
        }
        assert_eq!(collected.unknown_kind, Some(9));
        assert_eq!(
            events,
            vec![
                // An immediate's bytes name its sender.
                Event::ImmArrival {
                    imm: 7,
                    from: Some(NetAddr::new(b"m").unwrap())
                },
                Event::Message {
                    data: b"m".to_vec(),
                    from: None
                }
            ]
        );
    }

    /// A message with its sender (ABI 7) is split into the two; a prefix that is not an
    /// address is recorded, never delivered as a message without a sender or with one.
    #[test]
    fn a_message_with_its_sender_is_split_and_a_bad_prefix_is_recorded() {
        let mut events = Vec::new();
        let mut collected = Collected {
            events: &mut events,
            unknown_kind: None,
            bad_sender: None,
            last_source: None,
        };
        let sink = &mut collected as *mut Collected<'_> as *mut c_void;
        let sender = NetAddr::new(b"peer-0").unwrap();
        let good = super::super::abi::encode_message_from(&sender, b"hello");
        for data in [&good[..], &[0, b'x'][..], &[9, b'x'][..], &[][..]] {
            let event = RawEvent {
                kind: EVENT_MESSAGE_FROM,
                error_kind: 0,
                wr_id: 0,
                imm: 0,
                data: RawBytes::new(data),
            };
            // SAFETY: sink points at a live Collected; the event and its bytes are live.
            unsafe { collect_event(sink, &event) };
        }
        assert_eq!(collected.bad_sender, Some(2));
        assert_eq!(
            events,
            vec![Event::Message {
                data: b"hello".to_vec(),
                from: Some(sender)
            }]
        );
    }
}
