//! Why one file: it is the `Domain` impl of one libfabric domain — its endpoint, the table of
//! in-flight contexts the three `unsafe` posts point into, and the completions that settle them
//! share one state; options and the shm lifetime rules live beside it (`options.rs`,
//! `shm_lifetime.rs`).
//!
//! One libfabric domain as an xfer Domain.
//!
//! Why one file: it is one type and the state only it owns (the endpoint, its registrations,
//! receive pool, peer table and completion batch); every method of the `Domain` impl reads or
//! writes that state, and the parts that need none of it already live apart (`ffi`, `options`,
//! `shm_lifetime`). A fifth of it is the error classification and its tests.

use std::collections::HashMap;
use std::ffi::c_void;

use xfer_plugin::addr::NetAddr;
use xfer_plugin::domain::{
    message_size_class, post_one_by_one, Capabilities, Device, Domain, DomainCause, DomainConfig,
    DomainError, DomainErrorKind, Event, MemoryRegion, PageShift, PostStatus, RdmaOp, RdmaPost,
    RdmaRequest, RegionTable, Registration,
};

use crate::ffi::{
    Completion, CqError, Endpoint, MemoryRegistration, MessageBuffers, OfiError, Posted,
    ZeroSource, KIND_RECV, KIND_REMOTE_DATA,
};
use crate::gather;
use crate::options::EfaOptions;
use crate::sender::{Refusal, Senders, Source, Verdict, MAX_TRAILER};
use crate::shm_lifetime::{self, EndpointSlot};

/// Most addresses a Domain inserts in its address vector because a message claimed them
/// (so that the provider names their later messages); beyond it, senders it never addressed
/// stay unnamed without a secret. Each costs an address-vector entry (on EFA an address
/// handle), and any sender can claim any address: kept small.
const MAX_LEARNED: usize = 1_024;

/// Scratch the provider may use (FI_CONTEXT2 is eight pointers) at a stable address.
#[repr(C)]
struct OpContext {
    scratch: [usize; 8],
}

/// What a posted operation is, found again from its context when it completes.
enum InFlight {
    /// Failed and reported already, when its peer's address was removed: the provider may
    /// still hold the context (so it is not reused), and a late completion is ignored. A
    /// message's buffer stays out of the pool until then: the provider may still read it.
    Abandoned {
        send_buffer: Option<usize>,
    },
    /// An RDMA write or read: `pages` requests of the engine's (a paged read's pages
    /// gathered into one call, else 1), each answered with its own `Done`.
    Rdma {
        wr_id: u64,
        peer: NetAddr,
        pages: usize,
    },
    Send {
        wr_id: u64,
        peer: NetAddr,
        /// Its buffer in `send_pool`.
        buffer: usize,
    },
    Recv {
        buffer: usize,
    },
}

/// One libfabric domain with its RDM endpoint.
pub struct EfaDomain {
    // Drop order matters: registrations and buffers go before the endpoint's domain closes
    // (the endpoint itself is closed first, in Drop).
    regions: RegionTable<MemoryRegistration>,
    /// Message buffers, with a registration where the provider needs local descriptors.
    receives: MessageBuffers,
    /// Message buffers for sends, registered once per buffer (by `message_size_class`) where
    /// the provider needs local descriptors, instead of a registration per message.
    send_pool: MessageBuffers,
    in_flight: HashMap<usize, (Box<OpContext>, InFlight)>,
    /// Receive buffers the provider refused to take back (EAGAIN), posted after the next poll.
    unposted_receives: Vec<usize>,
    // Boxed so each context keeps its address while the provider holds it.
    #[allow(clippy::vec_box)]
    spare_contexts: Vec<Box<OpContext>>,
    /// Source of zero-byte writes: EFA wants a valid descriptor even for no bytes.
    zero_source: ZeroSource,
    endpoint: EndpointSlot,
    address: NetAddr,
    provider: String,
    peers: HashMap<NetAddr, u64>,
    /// `peers` the other way round: the sender a completion's source entry names.
    names: HashMap<u64, NetAddr>,
    /// This Domain's own address-vector entry, inserted first: libfabric 1.17's shm reports a
    /// sender missing from the address vector as entry 0, so entry 0 must name nobody.
    own_entry: u64,
    /// Who sent a message: the trailer sent messages carry, and the judgement of received ones.
    senders: Senders,
    /// Where a message and its trailer are put together before it is copied to a send buffer.
    sealing: Vec<u8>,
    /// How many addresses `learn` inserted.
    learned: usize,
    /// The addresses `learn` inserted: a provider may not name their messages by source, so
    /// a claim of one from an unnamed source is not suspect (one inserted to send to is).
    learned_addresses: std::collections::HashSet<NetAddr>,
    /// Received messages dropped, by why (see `Refusal`).
    refused: [u64; 5],
    /// RDMA calls (`fi_writemsg`, `fi_readmsg`) the provider took.
    rma_calls: u64,
    options: EfaOptions,
    posts_since_poll: usize,
    completions: Vec<Completion>,
}

/// The wall clock in nanoseconds since the Unix epoch: a sealing Domain's epoch, and the
/// receiver's bound on how far ahead one may be.
fn wall_clock_ns() -> u64 {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0, |d| u64::try_from(d.as_nanos()).unwrap_or(u64::MAX))
}

fn other(e: OfiError) -> DomainError {
    let cause = e.cause();
    with_cause(DomainError::new(DomainErrorKind::Other, e.message), cause)
}

/// `error`, caused by `cause` when libfabric gave one.
fn with_cause(error: DomainError, cause: Option<DomainCause>) -> DomainError {
    match cause {
        Some(cause) => error.with_cause(cause),
        None => error,
    }
}

/// A failed registration, with the memlock limit named when the cause is ENOMEM (the most
/// common set-up failure: `xfer doctor` checks the same limit).
fn registration_error(e: OfiError, len: u64) -> DomainError {
    let mut message = format!("registering {len} bytes: {}", e.message);
    if e.is_out_of_memory() {
        let limit = xfer_topology::doctor::memlock_limit(std::path::Path::new("/proc"))
            .map_or("unlimited".to_owned(), |l| format!("{l} bytes"));
        message.push_str(&format!(
            "; the locked-memory limit (ulimit -l) is {limit}: raise it, see `xfer doctor`"
        ));
    }
    with_cause(DomainError::new(DomainErrorKind::Other, message), e.cause())
}

/// Whether a failed completion of this kind ends the connection to its peer: a
/// connection-level failure does (tcp;ofi_rxm tears the connection down on a refused key and
/// reports it as cancelled), so the address is forgotten and the next transfer reconnects. A
/// refused access or a request refused as this side's mistake does not: removing an address
/// fails everything else in flight to that peer (on EFA it drops their completions), and
/// those transfers did nothing wrong.
fn forgets_peer(kind: DomainErrorKind) -> bool {
    !matches!(
        kind,
        DomainErrorKind::RemoteAccess | DomainErrorKind::InvalidArgument
    )
}

/// A failed completion's cause: the provider's own status where it gave one (what
/// [`classify`] decides by on EFA), else libfabric's error — as an errno when it is one, as a
/// status when it is one of libfabric's own codes (256 and up, e.g. `FI_ETRUNC`).
fn completion_cause(err: i32, prov_errno: i32) -> DomainCause {
    let err = err.saturating_abs();
    match (prov_errno, err) {
        (0, 0..256) => DomainCause::Os(err),
        (0, _) => DomainCause::Status(err),
        _ => DomainCause::Status(prov_errno),
    }
}

/// Maps a completion's error to the engine's kinds. EFA folds bad local keys, invalid address
/// handles and unsupported operations into `EINVAL` together with a bad remote key, so for the
/// `efa` provider its own status (`prov_errno`, from the provider's efa_errno.h) decides; other
/// providers are classified by the libfabric error (errno values).
fn classify(provider: &str, err: i32, prov_errno: i32) -> DomainErrorKind {
    if provider.starts_with("efa") {
        match prov_errno {
            // REMOTE_ERROR_BAD_ADDRESS (rkey / remote range), REMOTE_ERROR_BAD_LENGTH (the
            // remote range too short), RMA_ADDR (RMA address verification failed).
            7 | 11 | 4111 => return DomainErrorKind::RemoteAccess,
            // UNSUPPORTED_OP, INVALID_AH, INVALID_LKEY, local BAD_LENGTH: this side's request.
            3..=6 => return DomainErrorKind::InvalidArgument,
            // REMOTE_ERROR_ABORT, BAD_DEST_QPN, UNRESP_REMOTE, UNKNOWN_PEER, UNREACH_REMOTE,
            // PEER_HANDSHAKE, and the established/unestablished receiver-unresponsive codes.
            8 | 9 | 13..=15 | 4113 | 4124 | 4126 => return DomainErrorKind::PeerUnreachable,
            _ => {}
        }
    }
    match err.abs() {
        1 | 13 | 14 | 121 | 129 => DomainErrorKind::RemoteAccess, // EPERM EACCES EFAULT EREMOTEIO EKEYREJECTED
        22 => DomainErrorKind::RemoteAccess, // EINVAL: a bad key or range at the target
        103 | 104 | 107 | 110 | 111 | 112 | 113 => DomainErrorKind::PeerUnreachable,
        // ECANCELED: the provider cancelled the operation because it tore its connection
        // down (tcp;ofi_rxm: the peer died, or it refused a key; the sender cannot tell
        // which, see `typed_remote_access` in its conformance harness). This side's own
        // cancellations (closing the endpoint) reach nobody: the engine has failed those
        // transfers with its own error by then.
        125 => DomainErrorKind::PeerUnreachable,
        _ => DomainErrorKind::Other,
    }
}

impl EfaDomain {
    /// Opens the domain named by `config.nic` (`auto` for the first; `#suffix` ignored).
    pub fn open(config: &DomainConfig<'_>) -> Result<Self, DomainError> {
        let options = EfaOptions::parse(config.options)?;
        let name = config.nic.split('#').next().unwrap_or_default();
        let domain = (name != "auto" && !name.is_empty()).then_some(name);
        let mut endpoint = Endpoint::open(
            &options.provider,
            options.fabric.as_deref(),
            domain,
            options.shared_memory_choice(),
        )
            .map_err(|e| {
            let offered = crate::ffi::list(None)
                .map(|l| l.iter().map(|(p, d)| format!("{p} ({d})")).collect::<Vec<_>>().join(", "))
                .unwrap_or_else(|e| e);
            DomainError::new(
                DomainErrorKind::InvalidArgument,
                format!(
                    "cannot open libfabric provider {:?}{} domain {:?}: {}; libfabric offers: {offered}",
                    options.provider,
                    options.fabric.as_ref().map(|f| format!(" on fabric {f:?}")).unwrap_or_default(),
                    config.nic,
                    e.message
                ),
            )
        })?;
        if endpoint.attr.cq_data_size < 4 {
            return Err(DomainError::new(
                DomainErrorKind::InvalidArgument,
                format!(
                    "provider {} carries {} bytes of remote CQ data; immediates need 4",
                    options.provider, endpoint.attr.cq_data_size
                ),
            ));
        }
        if endpoint.attr.emulated_write == 1 {
            // Users of other engines met this silently: immediates travel as messages, capped
            // at a few hundred in flight and invisible to the NIC's write counters.
            tracing::warn!(
                provider = %options.provider,
                "this EFA device has no native RDMA write: writes and immediates are emulated with send/recv (slow path)"
            );
        }
        if let Some(wanted) = options.shared_memory_choice() {
            if endpoint.attr.shared_memory != i32::from(wanted) {
                tracing::info!(
                    provider = %options.provider,
                    wanted,
                    "this libfabric cannot set FI_OPT_SHARED_MEMORY_PERMITTED; the provider's default applies"
                );
            }
        }
        let raw = endpoint.name().map_err(other)?;
        let address = NetAddr::new(&raw).map_err(|e| {
            DomainError::new(
                DomainErrorKind::Other,
                format!(
                    "provider {} address of {} bytes: {e}",
                    options.provider,
                    raw.len()
                ),
            )
        })?;
        let senders = match &options.secret_file {
            None => Senders::new(address.clone()),
            Some(path) => {
                let secret =
                    xfer_plugin::secret::read(std::path::Path::new(path)).map_err(|why| {
                        DomainError::new(
                            DomainErrorKind::InvalidArgument,
                            format!("the cluster secret {path}: {why}"),
                        )
                    })?;
                Senders::with_secret(address.clone(), &secret, wall_clock_ns())
            }
        };
        let own_entry = endpoint.insert_peer(address.raw()).map_err(other)?;
        let mut regions = RegionTable::new();
        let zero_source = endpoint.zero_source(regions.next_key()).map_err(other)?;
        shm_lifetime::opened(&options.provider);
        Ok(Self {
            regions,
            receives: MessageBuffers::default(),
            send_pool: MessageBuffers::default(),
            in_flight: HashMap::new(),
            unposted_receives: Vec::new(),
            spare_contexts: Vec::new(),
            zero_source,
            provider: options.provider.clone(),
            endpoint: EndpointSlot::new(endpoint),
            peers: HashMap::from([(address.clone(), own_entry)]),
            names: HashMap::new(),
            own_entry,
            senders,
            sealing: Vec::new(),
            learned: 0,
            learned_addresses: std::collections::HashSet::new(),
            refused: [0; 5],
            rma_calls: 0,
            address,
            options,
            posts_since_poll: 0,
            completions: Vec::with_capacity(64),
        })
    }

    /// The libfabric domain's name.
    pub fn domain_name(&self) -> String {
        self.endpoint.domain_name()
    }

    fn peer(&mut self, addr: &NetAddr) -> Result<u64, DomainError> {
        if shm_lifetime::is_closed(&self.provider, addr) {
            // Never handed to shm, which would crash on the freed endpoint (shm_lifetime).
            return Err(DomainError::new(
                DomainErrorKind::PeerUnreachable,
                format!("{addr}: that shm endpoint of this process closed"),
            ));
        }
        if let Some(&a) = self.peers.get(addr) {
            return Ok(a);
        }
        let a = self.endpoint.insert_peer(addr.raw()).map_err(|e| {
            DomainError::new(
                DomainErrorKind::PeerUnreachable,
                format!("{addr}: {}", e.message),
            )
        })?;
        self.peers.insert(addr.clone(), a);
        self.names.insert(a, addr.clone());
        Ok(a)
    }

    /// The sender a completion's source entry names, if it names one of ours.
    fn source(&self, src: Option<u64>) -> Source {
        match src {
            Some(e) if e != self.own_entry => self
                .names
                .get(&e)
                .map_or(Source::Unknown, |a| Source::Known(a.clone())),
            _ => Source::Unknown,
        }
    }

    /// Inserts an address a message claimed, so the provider names that endpoint's later
    /// messages (bounded: a sender can claim any address).
    fn learn(&mut self, addr: &NetAddr) {
        if self.learned >= MAX_LEARNED || self.peers.contains_key(addr) {
            return;
        }
        self.learned += 1;
        self.learned_addresses.insert(addr.clone());
        if let Err(e) = self.peer(addr) {
            tracing::debug!(address = %self.address, claim = %addr, error = %e.message, "a message's claimed sender cannot be inserted");
        }
    }

    /// RDMA calls the provider took so far: a paged read's pages share calls (see `gather`).
    pub fn rma_calls(&self) -> u64 {
        self.rma_calls
    }

    /// Received messages dropped so far: without a valid MAC, replayed, or from a source other
    /// than the one the MAC proves (only with a cluster secret), or with no trailer.
    pub fn messages_refused(&self) -> u64 {
        self.refused.iter().sum()
    }

    fn refuse(&mut self, why: Refusal, source: &Source) {
        let n = &mut self.refused[why as usize];
        *n += 1;
        // Logged at the first and then every power of two: a flood must not flood the log.
        if n.is_power_of_two() {
            tracing::warn!(address = %self.address, ?why, ?source, count = *n, "a received message was dropped");
        }
    }

    fn acquire(&mut self, state: InFlight) -> *mut c_void {
        let mut ctx = self
            .spare_contexts
            .pop()
            .unwrap_or_else(|| Box::new(OpContext { scratch: [0; 8] }));
        let ptr = &mut *ctx as *mut OpContext as *mut c_void;
        self.in_flight.insert(ptr as usize, (ctx, state));
        ptr
    }

    fn release(&mut self, ptr: usize) -> Option<InFlight> {
        let (ctx, state) = self.in_flight.remove(&ptr)?;
        self.spare_contexts.push(ctx);
        // A message buffer is free again only now that the provider returned its context
        // (before, it may still be reading it).
        if let InFlight::Send { buffer, .. }
        | InFlight::Abandoned {
            send_buffer: Some(buffer),
        } = state
        {
            self.send_pool.release(buffer);
        }
        Some(state)
    }

    /// Runs a post, undoing the context on anything but success.
    fn finish_post(
        &mut self,
        ctx: *mut c_void,
        result: Result<Posted, OfiError>,
    ) -> Result<PostStatus, DomainError> {
        match result {
            Ok(Posted::Queued) => {
                self.posts_since_poll += 1;
                Ok(PostStatus::Posted)
            }
            Ok(Posted::Again) => {
                self.release(ctx as usize);
                Ok(PostStatus::Busy)
            }
            Err(e) => {
                self.release(ctx as usize);
                Err(other(e))
            }
        }
    }

    /// Posts a paged read's pages (`template` moved by each of `shifts`), several a call:
    /// how many were posted, and why it stopped there.
    fn post_read_pages(
        &mut self,
        template: &RdmaRequest<'_>,
        shifts: &[PageShift],
    ) -> (usize, Result<PostStatus, DomainError>) {
        let attr = self.endpoint.attr;
        let limit = attr.iov_limit.min(attr.rma_iov_limit);
        let mut posted = 0;
        while posted < shifts.len() {
            if self.posts_since_poll >= self.options.max_posts_per_poll {
                return (posted, Ok(PostStatus::Busy));
            }
            let call = gather::next_call(
                &shifts[posted..],
                template.len,
                limit,
                attr.max_msg_size as u64,
            );
            match self.post_gathered_read(template, &call) {
                Ok(PostStatus::Posted) => posted += call.pages,
                stopped => return (posted, stopped),
            }
        }
        (posted, Ok(PostStatus::Posted))
    }

    /// Posts one call of a paged read: its segments, each checked inside the local
    /// registration; one completion settles its pages.
    fn post_gathered_read(
        &mut self,
        template: &RdmaRequest<'_>,
        call: &gather::Gathered,
    ) -> Result<PostStatus, DomainError> {
        let dest = self.peer(template.peer)?;
        let virt = self.endpoint.attr.mr_virt_addr != 0;
        let mut segments =
            [(std::ptr::null_mut(), 0, std::ptr::null_mut(), 0); gather::MAX_SEGMENTS];
        for (slot, s) in segments.iter_mut().zip(call.segments()) {
            let local = template.local_addr + s.local;
            let mr = self.regions.source(template.local_key, local, s.len)?;
            let remote = template.remote_addr + s.remote;
            // Offset-addressed providers (no FI_MR_VIRT_ADDR) take the offset in the region.
            let remote = if virt {
                remote
            } else {
                remote - template.remote_base
            };
            *slot = (local as *mut u8, s.len as usize, mr.desc, remote);
        }
        let ctx = self.acquire(InFlight::Rdma {
            wr_id: template.wr_id,
            peer: template.peer.clone(),
            pages: call.pages,
        });
        // SAFETY: every local segment lies in a live registration (checked above); ctx stays
        // in `in_flight` until its completion is read.
        let result = unsafe {
            self.endpoint
                .rdma_readv(&segments[..call.count], dest, template.remote_key, ctx)
        };
        self.finish_rma(ctx, result)
    }

    /// [`finish_post`](Self::finish_post) for an RDMA call, counting it.
    fn finish_rma(
        &mut self,
        ctx: *mut c_void,
        result: Result<Posted, OfiError>,
    ) -> Result<PostStatus, DomainError> {
        let status = self.finish_post(ctx, result)?;
        self.rma_calls += u64::from(status == PostStatus::Posted);
        Ok(status)
    }

    /// Posts an RDMA write or read between a local range and a peer's.
    fn post_rma(&mut self, req: &RdmaRequest<'_>) -> Result<PostStatus, DomainError> {
        let (peer, len) = (req.peer, req.len);
        if self.posts_since_poll >= self.options.max_posts_per_poll {
            return Ok(PostStatus::Busy);
        }
        let dest = self.peer(peer)?;
        let (buf, desc) = if len == 0 {
            (self.zero_source.ptr(), self.zero_source.desc())
        } else {
            let mr = self.regions.source(req.local_key, req.local_addr, len)?;
            (req.local_addr as *mut u8, mr.desc)
        };
        // Offset-addressed providers (no FI_MR_VIRT_ADDR) take the offset in the region.
        let remote_addr = if self.endpoint.attr.mr_virt_addr != 0 {
            req.remote_addr
        } else {
            req.remote_addr - req.remote_base
        };
        let remote_key = req.remote_key;
        let ctx = self.acquire(InFlight::Rdma {
            wr_id: req.wr_id,
            peer: peer.clone(),
            pages: 1,
        });
        // SAFETY: the local range lies in a live registration (checked above, or the Domain's
        // own zero source, which a zero-byte operation never touches); ctx stays in
        // `in_flight` until its completion is read.
        let result = unsafe {
            match req.op {
                RdmaOp::Write { imm } => self.endpoint.write(
                    buf,
                    len as usize,
                    desc,
                    dest,
                    remote_addr,
                    remote_key,
                    imm,
                    ctx,
                ),
                RdmaOp::Read => self.endpoint.rdma_read(
                    buf,
                    len as usize,
                    desc,
                    dest,
                    remote_addr,
                    remote_key,
                    ctx,
                ),
            }
        };
        self.finish_rma(ctx, result)
    }

    fn handle_completion(&mut self, c: &Completion, events: &mut Vec<Event>) {
        if c.kind == KIND_REMOTE_DATA {
            // Immediates are 32 bits; providers carry 4 or 8 bytes of CQ data. The sender is the
            // provider's source where it names a known one (no MAC: a write carries none).
            let from = match self.source(c.src) {
                Source::Known(a) => Some(a),
                Source::Unknown => None,
            };
            events.push(Event::ImmArrival {
                imm: c.data as u32,
                from,
            });
            return;
        }
        match self.release(c.context) {
            Some(InFlight::Rdma { wr_id, pages, .. }) => {
                events.extend((0..pages).map(|_| Event::Done {
                    wr_id,
                    result: Ok(()),
                }))
            }
            Some(InFlight::Send { wr_id, .. }) => events.push(Event::Done {
                wr_id,
                result: Ok(()),
            }),
            Some(InFlight::Recv { buffer }) if c.kind == KIND_RECV => {
                let (_, buf_len, _) = self.receives.get(buffer);
                let Some(mut data) = self.receives.take_message(buffer, c.len) else {
                    return;
                };
                let source = self.source(c.src);
                let (peers, learned, own) = (&self.peers, &self.learned_addresses, &self.address);
                let known = |a: &NetAddr| a != own && peers.contains_key(a) && !learned.contains(a);
                match self
                    .senders
                    .open_checked(&data, &source, wall_clock_ns(), &known)
                {
                    Verdict::Deliver { len, from, learn } => {
                        data.truncate(len);
                        if let Some(claim) = learn {
                            self.learn(&claim);
                        }
                        events.push(Event::Message { data, from });
                    }
                    Verdict::Drop(why) => {
                        self.refuse(why, &source);
                        // The engine reposts a buffer per message it is handed: this one it
                        // never sees, so the Domain puts one back itself.
                        if let Err(e) = self.post_recvs_of(buf_len, 1) {
                            tracing::error!(address = %self.address, error = %e.message, "a receive buffer could not be posted again");
                        }
                    }
                }
            }
            Some(InFlight::Recv { buffer }) => self.repost(buffer),
            Some(InFlight::Abandoned { .. }) => {}
            // Never silently: a completion this Domain did not post means the provider and
            // the shim disagree on what it is (an immediate taken for an own operation was
            // lost this way on libfabric 2.1's shm).
            None => tracing::error!(
                address = %self.address,
                kind = c.kind,
                len = c.len,
                "a completion for an operation this Domain never posted; dropped"
            ),
        }
    }

    /// Posts a receive buffer of the pool again (after a failed receive); one the provider
    /// refuses for now (EAGAIN) is retried after the next poll.
    fn repost(&mut self, buffer: usize) {
        match self.post_receive(buffer) {
            Ok(()) => {}
            Err(e) => {
                self.receives.release(buffer);
                tracing::error!(
                    address = %self.address,
                    error = %e.message,
                    "a receive buffer could not be posted again"
                );
            }
        }
    }

    /// Posts `count` receive buffers of exactly `buf_len` bytes.
    fn post_recvs_of(&mut self, buf_len: usize, count: usize) -> Result<(), DomainError> {
        for _ in 0..count {
            let regions = &mut self.regions;
            let buffer = self
                .receives
                .take(&mut self.endpoint, buf_len, || regions.next_key())
                .map_err(other)?;
            self.post_receive(buffer)?;
        }
        Ok(())
    }

    /// Posts pool buffer `buffer` as a receive; one the provider refuses for now (EAGAIN) is
    /// kept for after the next poll — not an error.
    fn post_receive(&mut self, buffer: usize) -> Result<(), DomainError> {
        let (ptr, len, desc) = self.receives.get(buffer);
        let ctx = self.acquire(InFlight::Recv { buffer });
        // SAFETY: the buffer is owned by the Domain and not reused until its completion.
        let result = unsafe { self.endpoint.recv(ptr, len, desc, ctx) };
        if self.finish_post(ctx, result)? == PostStatus::Busy {
            self.unposted_receives.push(buffer);
        }
        Ok(())
    }

    /// Fails `requests` requests of `wr_id` to `peer` with `error` (and, for a
    /// connection-level failure, everything else in flight to that peer).
    fn fail(
        &mut self,
        wr_id: u64,
        peer: &NetAddr,
        requests: usize,
        error: DomainError,
        events: &mut Vec<Event>,
    ) {
        if forgets_peer(error.kind) {
            self.forget_peer(peer, &error, events);
        }
        events.extend((0..requests).map(|_| Event::Done {
            wr_id,
            result: Err(error.clone()),
        }));
    }

    /// Removes a peer's address after a connection-level failure, and fails everything still
    /// in flight to it now: once the address is gone, the provider may never complete them.
    fn forget_peer(&mut self, peer: &NetAddr, error: &DomainError, events: &mut Vec<Event>) {
        if *peer == self.address {
            // Entry 0 stays this Domain's own, never reused for another peer (see `own_entry`).
            return;
        }
        let Some(fi_addr) = self.peers.remove(peer) else {
            return;
        };
        self.names.remove(&fi_addr);
        self.endpoint.remove_peer(fi_addr);
        for (_, state) in self.in_flight.values_mut() {
            let to_peer = matches!(state, InFlight::Rdma { peer: p, .. } | InFlight::Send { peer: p, .. } if p == peer);
            if to_peer {
                let send_buffer = match state {
                    InFlight::Send { buffer, .. } => Some(*buffer),
                    _ => None,
                };
                let (wr_id, requests) =
                    match std::mem::replace(state, InFlight::Abandoned { send_buffer }) {
                        InFlight::Rdma { wr_id, pages, .. } => (wr_id, pages),
                        InFlight::Send { wr_id, .. } => (wr_id, 1),
                        _ => continue,
                    };
                events.extend((0..requests).map(|_| Event::Done {
                    wr_id,
                    result: Err(error.clone()),
                }));
            }
        }
    }
}

impl Domain for EfaDomain {
    fn address(&self) -> NetAddr {
        self.address.clone()
    }

    fn register(&mut self, region: &MemoryRegion) -> Result<Registration, DomainError> {
        let key = self.regions.next_key();
        let registered = self.endpoint.register_region(region, key);
        let mr = match region.device {
            Device::Cuda(index) => registered.map_err(|e| {
                // The provider refusing the memory itself (no FI_HMEM, a range it cannot
                // take) is the request refused; anything else is the backend failing.
                let kind = match e.code {
                    Some(-22 | -38 | -95) => DomainErrorKind::InvalidArgument, // EINVAL, ENOSYS, EOPNOTSUPP
                    _ => DomainErrorKind::Other,
                };
                with_cause(
                    DomainError::new(
                        kind,
                        format!("{} cannot register GPU memory of CUDA device {index}: {} (does the provider support FI_HMEM?)", self.provider, e.message),
                    ),
                    e.cause(),
                )
            })?,
            _ => registered.map_err(|e| registration_error(e, region.len))?,
        };
        let remote_key = mr.key;
        Ok(self.regions.insert(key, region, mr, remote_key))
    }

    fn deregister(&mut self, local_key: u64) -> Result<(), DomainError> {
        self.regions.remove(local_key).map(drop)
    }

    /// A paged read's pages gathered into as few calls as the provider takes (`gather`);
    /// everything else request by request.
    fn post_rdma(&mut self, post: RdmaPost<'_>) -> (usize, Result<PostStatus, DomainError>) {
        match post {
            RdmaPost::Pages { template, shifts } if template.is_read() && template.len > 0 => {
                self.post_read_pages(&template, shifts)
            }
            post => post_one_by_one(post, |r| self.post_rma(r)),
        }
    }

    fn capabilities(&self) -> Capabilities {
        // 0 = the provider did not say: no limit the engine could check.
        let max = (self.endpoint.attr.max_msg_size > 0).then_some(self.endpoint.attr.max_msg_size);
        Capabilities {
            max_write_size: max.map(|m| m as u64),
            // What every peer's receive buffers hold (the option), within the provider's.
            // Each message carries a trailer naming its sender (src/sender.rs).
            max_message_size: Some(max.map_or(self.options.max_message, |m| {
                m.saturating_sub(MAX_TRAILER).min(self.options.max_message)
            })),
            // EFA moves RMA, immediates and its handshake only while the receiver polls
            // (manual progress): the engine keeps polling an EFA Domain instead of parking.
            // shm and tcp;ofi_rxm progress with the 1 ms idle poll, as before.
            needs_receiver_polling: self.provider.starts_with("efa"),
            // Without FI_HMEM the provider would take a CUDA pointer for host memory; the
            // engine refuses device memory instead, naming the backend.
            cuda_memory: self.endpoint.attr.hmem != 0,
            // Only when the provider granted FI_READ/FI_REMOTE_READ; the engine refuses reads
            // otherwise, naming the backend.
            reads: self.endpoint.attr.rma_read != 0,
            ..Capabilities::default()
        }
    }

    fn post_send(
        &mut self,
        wr_id: u64,
        peer: &NetAddr,
        data: &[u8],
    ) -> Result<PostStatus, DomainError> {
        if self.posts_since_poll >= self.options.max_posts_per_poll {
            return Ok(PostStatus::Busy);
        }
        let dest = self.peer(peer)?;
        let mut sealed = std::mem::take(&mut self.sealing);
        self.senders.seal(peer, data, &mut sealed);
        let regions = &mut self.regions;
        let taken = self
            .send_pool
            .take(&mut self.endpoint, message_size_class(sealed.len()), || {
                regions.next_key()
            })
            .map_err(other);
        let buffer = match taken {
            Ok(buffer) => buffer,
            Err(e) => {
                self.sealing = sealed;
                return Err(e);
            }
        };
        let filled = self.send_pool.fill(buffer, &sealed);
        debug_assert!(filled, "a size-class buffer holds its message");
        let len = sealed.len();
        self.sealing = sealed;
        let (ptr, _, desc) = self.send_pool.get(buffer);
        let ctx = self.acquire(InFlight::Send {
            wr_id,
            peer: peer.clone(),
            buffer,
        });
        // SAFETY: the buffer (and its registration) stay out of the pool until completion.
        let result = unsafe { self.endpoint.send(ptr, len, desc, dest, ctx) };
        self.finish_post(ctx, result)
    }

    fn post_recvs(&mut self, buf_len: usize, count: usize) -> Result<(), DomainError> {
        // Never shorter than the longest message a peer may send, with its trailer: a
        // truncated receive stops shm's and tcp's delivery to this endpoint (see
        // EfaOptions::max_message).
        self.post_recvs_of(buf_len.max(self.options.max_message) + MAX_TRAILER, count)
    }

    fn poll(&mut self, events: &mut Vec<Event>) -> Result<(), DomainError> {
        self.posts_since_poll = 0;
        let mut completions = std::mem::take(&mut self.completions);
        let result = loop {
            completions.clear();
            match self.endpoint.read(&mut completions) {
                Ok(0) => break Ok(()),
                Ok(_) => completions
                    .iter()
                    .for_each(|c| self.handle_completion(c, events)),
                Err(CqError::Completion {
                    context,
                    err,
                    prov_errno,
                    message,
                }) => {
                    let error = DomainError::new(
                        classify(&self.provider, err, prov_errno),
                        format!(
                            "{} via {}: {message} (libfabric error {err}, provider errno {prov_errno})",
                            self.provider, self.address
                        ),
                    )
                    .with_cause(completion_cause(err, prov_errno));
                    match self.release(context) {
                        Some(InFlight::Rdma { wr_id, peer, pages }) => {
                            self.fail(wr_id, &peer, pages, error, events)
                        }
                        Some(InFlight::Send { wr_id, peer, .. }) => {
                            self.fail(wr_id, &peer, 1, error, events)
                        }
                        // A failed receive goes back on the queue: the pool must not shrink.
                        Some(InFlight::Recv { buffer }) => self.repost(buffer),
                        Some(InFlight::Abandoned { .. }) | None => {}
                    }
                }
                // The CQ itself failed: the Domain cannot go on (never a log line per poll).
                Err(CqError::Read(e)) => {
                    break Err(DomainError::new(
                        DomainErrorKind::Fatal,
                        format!(
                            "{} via {}: reading the CQ failed: {}",
                            self.provider, self.address, e.message
                        ),
                    ))
                }
            }
        };
        self.completions = completions;
        // Receives the provider refused earlier (EAGAIN) go back now.
        for buffer in std::mem::take(&mut self.unposted_receives) {
            self.repost(buffer);
        }
        result
    }
}

impl Drop for EfaDomain {
    fn drop(&mut self) {
        let Some(endpoint) = self.endpoint.take() else {
            return;
        };
        // On shm, parked while other endpoints of this process may still point into it.
        if let Some(endpoint) = shm_lifetime::close(&self.provider, &self.address, endpoint) {
            self.endpoint.put(endpoint);
            // Cancel everything posted before the buffers and registrations it uses go away.
            self.endpoint.close_endpoint();
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Out of memory is told by libfabric's code, not its text: it names the memlock limit.
    #[test]
    fn a_registration_out_of_memory_names_the_locked_memory_limit() {
        let oom = OfiError {
            message: "fi_mr_regattr: whatever the text".into(),
            code: Some(-12),
        };
        let e = registration_error(oom, 4096);
        assert!(e.message.contains("locked-memory limit (ulimit -l)"), "{e}");
        // The code, not only its words: a caller matches on the errno.
        assert_eq!(e.cause, Some(DomainCause::Os(12)));
        assert_eq!(
            e.cause.and_then(|c| c.io_error()).map(|io| io.kind()),
            Some(std::io::ErrorKind::OutOfMemory)
        );
        let other = OfiError {
            message: "fi_mr_regattr: Cannot allocate memory, in words only".into(),
            code: Some(-22),
        };
        assert!(!registration_error(other, 4096).message.contains("ulimit"));
    }

    /// A request refused as this side's mistake (an invalid local key on EFA) fails alone:
    /// forgetting the peer would fail everything else in flight to it with that error.
    #[test]
    fn only_connection_failures_forget_the_peer() {
        let bad_local_key = classify("efa", -22, 5);
        assert!(!forgets_peer(bad_local_key));
        assert!(!forgets_peer(classify("efa", -22, 7)));
        assert!(forgets_peer(classify("efa", -103, 4124)));
        assert!(forgets_peer(DomainErrorKind::Other));
    }

    /// The provider's status is the cause where it gave one; libfabric's error only when it
    /// is an errno.
    #[test]
    fn a_failed_completion_keeps_the_code_that_explains_it() {
        assert_eq!(completion_cause(-22, 5), DomainCause::Status(5));
        assert_eq!(completion_cause(-111, 0), DomainCause::Os(111));
        // FI_ETRUNC (265) is libfabric's own code, not an errno.
        assert_eq!(completion_cause(-265, 0), DomainCause::Status(265));
    }

    /// EFA reports a bad remote key and a bad local key alike as EINVAL; its own status tells
    /// them apart. Other providers are classified by the libfabric error.
    #[test]
    fn efa_errors_are_classified_by_the_providers_status() {
        let einval = -22;
        assert_eq!(classify("efa", einval, 7), DomainErrorKind::RemoteAccess);
        assert_eq!(classify("efa", einval, 5), DomainErrorKind::InvalidArgument);
        assert_eq!(classify("efa", einval, 3), DomainErrorKind::InvalidArgument);
        assert_eq!(
            classify("efa", -103, 4124),
            DomainErrorKind::PeerUnreachable
        );
        assert_eq!(
            classify("efa-direct", -107, 14),
            DomainErrorKind::PeerUnreachable
        );
        // Unknown EFA status: the libfabric error decides.
        assert_eq!(
            classify("efa", -111, 4096),
            DomainErrorKind::PeerUnreachable
        );
        // tcp;ofi_rxm refuses a forged key with EINVAL (no provider status to go by).
        assert_eq!(
            classify("tcp;ofi_rxm", einval, 0),
            DomainErrorKind::RemoteAccess
        );
        assert_eq!(classify("shm", -5, 0), DomainErrorKind::Other);
        // tcp;ofi_rxm cancels what is in flight on a connection it tears down: a write to a
        // peer that died completes with FI_ECANCELED (CI's fresh run, `dead_peer`, once).
        assert_eq!(
            classify("tcp;ofi_rxm", -125, 2),
            DomainErrorKind::PeerUnreachable
        );
    }
}
