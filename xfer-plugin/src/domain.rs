//! The Domain trait: what one NIC must do for the engine. Backends implement it; one thread
//! at a time calls it (the engine's worker, or a thread making the parked worker's pass in
//! its place, under the worker's lock), so every method takes `&mut self` and none needs a
//! lock.
//!
//! The shape fits both libibverbs RC (a QP per peer, connected lazily, an SRQ for arrivals)
//! and libfabric RDM (one endpoint, peers in an address vector): the engine hands over
//! fully resolved writes (local key, remote key and the peer's address on *this* NIC) and
//! pulls events back with [`Domain::poll`].

use std::fmt;
use std::sync::Arc;
use std::time::{Duration, Instant};

use crate::addr::NetAddr;

mod tables;
pub use tables::{message_size_class, ReceivePool, RegionTable};

/// Where a registered region lives.
///
/// Exhaustive on purpose: a new kind is an ABI change (a new `DEVICE_*` value), and every
/// backend must decide what to do with it.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Device {
    /// Ordinary (pageable or pinned) host memory.
    Host,
    /// Memory of CUDA device `n`.
    Cuda(u32),
}

/// A region of memory to register with a NIC.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct MemoryRegion {
    /// First byte.
    pub ptr: u64,
    /// Length in bytes.
    pub len: u64,
    /// Where it lives.
    pub device: Device,
    /// Whether peers may write into it (false for a local-only registration).
    pub remote_write: bool,
    /// Whether peers may read it (RDMA READ).
    pub remote_read: bool,
}

/// The keys a NIC assigned to a registration.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[repr(C)]
pub struct Registration {
    /// Used in local work requests (lkey / local descriptor).
    pub local_key: u64,
    /// Given to peers so they can write here (rkey / remote key); 0 for local-only.
    pub remote_key: u64,
}

/// What an [`RdmaRequest`] does.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum RdmaOp {
    /// RDMA WRITE of the local range into the remote one. With an immediate, it is delivered
    /// to the peer's ImmCounter once the data has landed.
    Write {
        /// The immediate, if any.
        imm: Option<u32>,
    },
    /// RDMA READ of the remote range into the local one. No immediate: the peer learns
    /// nothing, and its ImmCounter counts nothing.
    Read,
}

impl RdmaOp {
    /// The immediate a write carries (`None` for reads and writes without one).
    pub fn imm(self) -> Option<u32> {
        match self {
            Self::Write { imm } => imm,
            Self::Read => None,
        }
    }
}

/// One RDMA WRITE or READ, fully resolved for one NIC. The two differ only in the direction
/// the bytes move (and a write's optional immediate), so they are one request: the local
/// range is the write's source or the read's destination, the remote range the other end.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct RdmaRequest<'a> {
    /// Returned unchanged in the matching [`Event::Done`].
    pub wr_id: u64,
    /// Write (with its immediate) or read.
    pub op: RdmaOp,
    /// The peer's address on this NIC's index.
    pub peer: &'a NetAddr,
    /// Local address (inside a region registered with this NIC).
    pub local_addr: u64,
    /// This NIC's local key of the local region. A zero-byte write (a barrier's signal) has
    /// no local range: `local_addr` and `local_key` are 0, while its remote range and key are
    /// real and must be checked.
    pub local_key: u64,
    /// Remote address in the peer's address space.
    pub remote_addr: u64,
    /// The peer NIC's remote key of the remote region (registered remotely writable for a
    /// write, readable for a read).
    pub remote_key: u64,
    /// Start of the remote region (its `MrDesc::ptr`), for NICs that address remote regions
    /// by offset rather than by virtual address.
    pub remote_base: u64,
    /// Bytes to move (a write may move zero).
    pub len: u64,
}

impl RdmaRequest<'_> {
    /// Whether this is an RDMA READ.
    pub fn is_read(&self) -> bool {
        self.op == RdmaOp::Read
    }

    /// The immediate a write carries (`None` for reads and writes without one).
    pub fn imm(&self) -> Option<u32> {
        self.op.imm()
    }

    /// This request moved by `shift`: one page of a paged request.
    #[inline]
    pub fn shifted(&self, shift: PageShift) -> Self {
        Self {
            local_addr: self.local_addr + shift.local,
            remote_addr: self.remote_addr + shift.remote,
            ..*self
        }
    }
}

/// How far one page of a paged request lies from the request's own addresses, in bytes (the
/// C ABI passes a batch's shifts as an array of these, unchanged).
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash, Default)]
#[repr(C)]
pub struct PageShift {
    /// Added to the local address.
    pub local: u64,
    /// Added to the remote address.
    pub remote: u64,
}

impl PageShift {
    /// `local` bytes on our side, `remote` on the peer's.
    pub const fn new(local: u64, remote: u64) -> Self {
        Self { local, remote }
    }
}

/// What one [`Domain::post_rdma`] call posts on one NIC, in order.
///
/// `#[non_exhaustive]`: a Domain matches the kinds it posts better than one by one and hands
/// the rest to [`post_one_by_one`], so a kind added later reaches an existing Domain as
/// requests posted one by one instead of breaking its build.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[non_exhaustive]
pub enum RdmaPost<'a> {
    /// One request (a single write or read that waited in the engine's queue for its peer).
    One(RdmaRequest<'a>),
    /// The pages of a paged request on this NIC: `template` once per entry of `shifts`, each
    /// moved by its byte offsets (see [`RdmaRequest::shifted`]), all with the template's
    /// `wr_id`. They differ only in their addresses, so a Domain can check what they share
    /// once per batch rather than once per page.
    Pages {
        /// The request every page is a shifted copy of.
        template: RdmaRequest<'a>,
        /// How far each page lies from the template.
        shifts: &'a [PageShift],
    },
    /// Requests each with its own `wr_id` and to any peer: the single and listed writes and
    /// reads the engine gathered in one pass over its submissions (a burst). A Domain can
    /// share its locks and lookups across a run of requests to one peer.
    List(&'a [RdmaRequest<'a>]),
}

impl<'a> RdmaPost<'a> {
    /// How many requests this is.
    pub fn len(&self) -> usize {
        match self {
            Self::One(_) => 1,
            Self::Pages { shifts, .. } => shifts.len(),
            Self::List(requests) => requests.len(),
        }
    }

    /// Whether there is nothing to post (a batch or list of none).
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// Request number `index` (from 0), as the Domain must post it.
    pub fn request(&self, index: usize) -> Option<RdmaRequest<'a>> {
        match *self {
            Self::One(request) => (index == 0).then_some(request),
            Self::Pages { template, shifts } => {
                shifts.get(index).map(|&shift| template.shifted(shift))
            }
            Self::List(requests) => requests.get(index).copied(),
        }
    }

    /// The requests, in the order they must be posted.
    pub fn requests(self) -> impl Iterator<Item = RdmaRequest<'a>> {
        (0..self.len()).map_while(move |index| self.request(index))
    }
}

/// Whether a post was accepted.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum PostStatus {
    /// The work request was accepted; exactly one `Done` will follow. It is queued on the
    /// NIC, or — a peer whose connection is still being made (see [`Domain::post_rdma`]) —
    /// held by the Domain until the connection can take it. Refusing such work as `Busy`
    /// instead would stop a list at the first peer still connecting, keeping every later
    /// peer of the list waiting for its handshake.
    Posted,
    /// The NIC's queue is full: nothing was queued, try again after `poll`.
    Busy,
}

/// What a poll returns.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Event {
    /// A work request posted on this NIC finished.
    Done {
        /// The request's id.
        wr_id: u64,
        /// Its outcome.
        result: Result<(), DomainError>,
    },
    /// A peer's write-with-immediate landed in our memory.
    ImmArrival {
        /// The immediate it carried.
        imm: u32,
        /// The sender's address (what its Domain's `address` returns), if the NIC tells.
        /// The engine bounds, per sender, the immediates nobody waits for that a sender can
        /// make it keep; arrivals without a sender share only the overall bound.
        from: Option<NetAddr>,
    },
    /// A message arrived in one of the posted receive buffers (which is then used up).
    Message {
        /// Its bytes.
        data: Vec<u8>,
        /// Who sent it, as the transport proved it: the sending Domain's address (what its
        /// `address` returns), never a claim read from the message's bytes. verbs: the peer
        /// of the RC connection the message came on (with a cluster secret, a peer that
        /// proved it in the handshake); the mock: the sending NIC; EFA/libfabric: the source
        /// address the provider reports (`FI_SOURCE`). `None` when the backend cannot tell:
        /// the engine then tells the application the sender is unknown.
        from: Option<NetAddr>,
    },
}

/// The kind of a backend failure, so the engine can map it to a typed error.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
#[repr(u32)]
#[non_exhaustive]
pub enum DomainErrorKind {
    /// Anything else; the message says what.
    Other = 0,
    /// The remote NIC refused the access (rkey, bounds, permissions).
    RemoteAccess = 1,
    /// The peer could not be reached or went away.
    PeerUnreachable = 2,
    /// The request was malformed for this NIC.
    InvalidArgument = 3,
    /// The backend's own deadline passed.
    Timeout = 4,
    /// The Domain cannot go on (its plugin panicked, its poll failed for good, it broke the
    /// ABI): the engine stops using it and fails everything in flight.
    Fatal = 5,
}

impl DomainErrorKind {
    /// Decodes the ABI's integer form; unknown values become `Other`.
    pub fn from_raw(raw: u32) -> Self {
        match raw {
            1 => Self::RemoteAccess,
            2 => Self::PeerUnreachable,
            3 => Self::InvalidArgument,
            4 => Self::Timeout,
            5 => Self::Fatal,
            _ => Self::Other,
        }
    }
}

/// What a backend's failure came from, in the terms of the library or NIC that reported it,
/// so a caller can match on it instead of parsing the message.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, thiserror::Error)]
#[non_exhaustive]
pub enum DomainCause {
    /// An operating-system error number (`errno`; libibverbs returns it, libfabric returns
    /// it negated, and it is stored positive here).
    #[error("{}", std::io::Error::from_raw_os_error(*.0))]
    Os(i32),
    /// A status code of the NIC or its provider, in the backend's own numbering (verbs: an
    /// `ibv_wc_status`; libfabric: a completion's provider error).
    #[error("status code {0}")]
    Status(i32),
    /// The backend's own deadline, of this length, passed (with
    /// [`DomainErrorKind::Timeout`]).
    #[error("the backend's deadline of {0:?} passed")]
    Deadline(Duration),
}

impl DomainCause {
    /// The operating-system error, for [`Os`](Self::Os).
    pub fn io_error(&self) -> Option<std::io::Error> {
        match *self {
            Self::Os(errno) => Some(std::io::Error::from_raw_os_error(errno)),
            _ => None,
        }
    }
}

/// A failure reported by a Domain: its kind, the backend's own words and, where the backend
/// knows it, the typed cause (reachable as [`std::error::Error::source`]).
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("{kind:?}: {message}")]
#[non_exhaustive]
pub struct DomainError {
    /// What kind of failure.
    pub kind: DomainErrorKind,
    /// The backend's message (status names, provider text).
    pub message: String,
    /// What it came from, when the backend knows (an errno, a NIC status, a deadline). Not
    /// carried across the C ABI, whose error has room for a kind and a message only.
    #[source]
    pub cause: Option<DomainCause>,
}

impl DomainError {
    /// A failure of `kind` with `message`.
    pub fn new(kind: DomainErrorKind, message: impl Into<String>) -> Self {
        Self {
            kind,
            message: message.into(),
            cause: None,
        }
    }

    /// The same failure, caused by `cause`.
    pub fn with_cause(mut self, cause: DomainCause) -> Self {
        self.cause = Some(cause);
        self
    }

    /// The backend's own deadline of `after` passed: a [`DomainErrorKind::Timeout`] that says
    /// how long it waited.
    pub fn timed_out(after: Duration, message: impl Into<String>) -> Self {
        Self::new(DomainErrorKind::Timeout, message).with_cause(DomainCause::Deadline(after))
    }

    /// The deadline that passed, for a timeout whose backend said.
    pub fn deadline(&self) -> Option<Duration> {
        match self.cause {
            Some(DomainCause::Deadline(d)) => Some(d),
            _ => None,
        }
    }
}

/// Wakes a parked worker; a Domain calls it when events arrive that `poll` would return.
#[derive(Clone)]
pub struct Waker {
    wake: Arc<dyn Fn() + Send + Sync>,
    parking: Option<Arc<dyn Fn() -> bool + Send + Sync>>,
}

impl Waker {
    /// Wraps a wake function.
    pub fn new(f: impl Fn() + Send + Sync + 'static) -> Self {
        Self {
            wake: Arc::new(f),
            parking: None,
        }
    }

    /// Wraps a wake function and a query saying whether the worker is about to park (see
    /// [`worker_parking`](Self::worker_parking)).
    pub fn with_parking(
        f: impl Fn() + Send + Sync + 'static,
        parking: impl Fn() -> bool + Send + Sync + 'static,
    ) -> Self {
        Self {
            wake: Arc::new(f),
            parking: Some(Arc::new(parking)),
        }
    }

    /// Wakes the worker (cheap when it is not parked).
    pub fn wake(&self) {
        (self.wake)()
    }

    /// Whether the worker announced that it parks after the `poll` in progress. A Domain
    /// that must arm something to be able to wake it (a completion channel) may arm only
    /// when this is true: the worker announces the park before its last poll, so an event
    /// after that poll still wakes it. `true` when unknown (a waker built with
    /// [`new`](Self::new), as the plugin ABI builds them): such a Domain arms at every poll
    /// that finds itself unarmed, busy or not.
    pub fn worker_parking(&self) -> bool {
        self.parking.as_ref().is_none_or(|f| f())
    }
}

impl fmt::Debug for Waker {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str("Waker")
    }
}

/// One NIC. See the module docs.
pub trait Domain: Send {
    /// This NIC's address, as peers must name it.
    fn address(&self) -> NetAddr;

    /// Registers memory; must be usable in writes posted after it returns.
    ///
    /// The contract a Domain relies on (the engine's `reg_mr`, an `unsafe fn`, passes it on
    /// to its caller): the region's memory stays allocated, and is not handed to anyone else,
    /// until [`deregister`](Self::deregister) of its key has returned. Domains copy from
    /// registered memory on the CPU (inline writes, the mock's copies) trusting it; a caller
    /// outside the engine that registers memory it then frees breaks memory safety, as with
    /// any NIC.
    fn register(&mut self, region: &MemoryRegion) -> Result<Registration, DomainError>;

    /// Deregisters the region with this local key; no write touches it after this returns.
    fn deregister(&mut self, local_key: u64) -> Result<(), DomainError>;

    /// Posts RDMA WRITEs and READs: one request, the pages of a paged request or a list (see
    /// [`RdmaPost`]), in order. Returns how many requests were posted and the status of the
    /// post that ended the call: `Ok(Posted)` when all were; otherwise `Ok(Busy)` (the NIC's
    /// queue is full) or the error of request number `posted`, which was not posted, with
    /// nothing after it tried. Each posted request gets its own [`Event::Done`].
    ///
    /// Connecting to a new peer happens here, lazily; requests posted while it connects are
    /// queued by the Domain, not refused. A read's `Done` means the bytes are in local memory.
    /// Backends without reads (see [`Capabilities::reads`]) refuse [`RdmaOp::Read`] with
    /// [`refuse_read`]'s typed error.
    ///
    /// A Domain that only knows how to post one request hands every kind of post to
    /// [`post_one_by_one`] with that; one that can do better for a kind (take its locks, look
    /// its connection up and check what the requests share once per batch or per run to one
    /// peer) matches that kind and hands the rest on.
    fn post_rdma(&mut self, post: RdmaPost<'_>) -> (usize, Result<PostStatus, DomainError>);

    /// Posts a message to `peer` (copied before this returns).
    fn post_send(
        &mut self,
        wr_id: u64,
        peer: &NetAddr,
        data: &[u8],
    ) -> Result<PostStatus, DomainError>;

    /// Adds `count` receive buffers of `buf_len` bytes for incoming messages.
    fn post_recvs(&mut self, buf_len: usize, count: usize) -> Result<(), DomainError>;

    /// Makes progress and appends every event that is ready.
    fn poll(&mut self, events: &mut Vec<Event>) -> Result<(), DomainError>;

    /// When this Domain next needs a [`poll`](Self::poll) though nothing arrives: timers of
    /// its own (a handshake to resend or give up, retired resources to free). `None`: only
    /// when something arrives. Read after a `poll` (which may move it): a worker about to park
    /// should wake no later than this. A Domain with a waker (see [`set_waker`](Self::set_waker))
    /// may also wake the worker then itself, as the verbs Domain's completion-channel thread
    /// does, so that a worker unaware of this method still polls it in time.
    ///
    /// The default: `None`. The plugin ABI does not carry it (a plugin's Domain relies on its
    /// waker for timers).
    fn poll_timeout(&self) -> Option<Instant> {
        None
    }

    /// Asks the Domain to call `waker` whenever `poll` would return something new. Returns
    /// whether it will; a Domain that cannot (most hardware without a completion channel) is
    /// polled on a short interval while the engine idles.
    fn set_waker(&mut self, waker: Waker) -> bool {
        let _ = waker;
        false
    }

    /// This Domain's limits and abilities; the default is [`Capabilities::default`].
    fn capabilities(&self) -> Capabilities {
        Capabilities::default()
    }
}

/// Posts `post` request by request with `post_one` (which posts one request, as
/// [`Domain::post_rdma`] does), stopping at the first it does not take, and answers as
/// [`Domain::post_rdma`] does. What a Domain that handles one request at a time answers with,
/// and what one that batches some kinds of post falls back to for the others.
pub fn post_one_by_one(
    post: RdmaPost<'_>,
    mut post_one: impl FnMut(&RdmaRequest<'_>) -> Result<PostStatus, DomainError>,
) -> (usize, Result<PostStatus, DomainError>) {
    for (posted, request) in post.requests().enumerate() {
        match post_one(&request) {
            Ok(PostStatus::Posted) => {}
            stopped => return (posted, stopped),
        }
    }
    (post.len(), Ok(PostStatus::Posted))
}

/// The error a Domain without RDMA READ answers a read with.
pub fn refuse_read() -> DomainError {
    DomainError::new(
        DomainErrorKind::InvalidArgument,
        "this backend does not support RDMA READ",
    )
}

/// A Domain's limits and abilities, which the engine checks before posting (refusing what a
/// backend cannot do with an error naming it) instead of discovering them at run time.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Capabilities {
    /// Largest single write or read; `None` = no limit.
    pub max_write_size: Option<u64>,
    /// Largest message; `None` = no limit.
    pub max_message_size: Option<usize>,
    /// Longest address the Domain hands out (at most [`MAX_ADDR_LEN`](crate::addr::MAX_ADDR_LEN)).
    pub max_address_len: usize,
    /// Registers host memory.
    pub host_memory: bool,
    /// Registers CUDA memory for direct NIC access.
    pub cuda_memory: bool,
    /// Registers CUDA memory through dma-buf.
    pub dmabuf: bool,
    /// Writes may carry an immediate.
    pub immediates: bool,
    /// Zero-byte writes are supported (with an immediate: a pure signal).
    pub zero_byte_writes: bool,
    /// The Domain makes progress only while polled, also when it only receives (libfabric's
    /// manual-progress providers such as EFA): the engine keeps polling instead of parking.
    pub needs_receiver_polling: bool,
    /// [`Domain::post_rdma`] carries out [`RdmaOp::Read`] (RDMA READ). For a plugin it is
    /// whether its table has the `post_read` entry (ABI 2), not a bit of the C layout.
    pub reads: bool,
}

impl Default for Capabilities {
    /// What the engine assumes of a backend that does not say (and of plugins older than
    /// ABI 3): no limits, host and CUDA memory, immediates and zero-byte writes, no receiver
    /// polling, no reads.
    fn default() -> Self {
        Self {
            max_write_size: None,
            max_message_size: None,
            max_address_len: crate::addr::MAX_ADDR_LEN,
            host_memory: true,
            cuda_memory: true,
            dmabuf: false,
            immediates: true,
            zero_byte_writes: true,
            needs_receiver_polling: false,
            reads: false,
        }
    }
}

/// What a backend's `open` receives for one NIC.
#[derive(Debug, Clone, Copy)]
pub struct DomainConfig<'a> {
    /// The NIC's name from the config (`mlx5_0`, `rxe0`, `mock0`, a libfabric domain).
    pub nic: &'a str,
    /// The backend's own config table (`[backends.<name>]`), as TOML text.
    pub options: &'a str,
}

/// Opens one Domain.
pub type OpenFn = fn(&DomainConfig<'_>) -> Result<Box<dyn Domain>, DomainError>;

/// Checks a backend's options (its `[backends.<name>]` table as TOML text) without opening
/// anything; the error names the mistake.
pub type CheckOptionsFn = fn(&str) -> Result<(), String>;

#[cfg(test)]
mod tests {
    use super::*;

    /// A one-request poster that takes `takes` requests and answers the next with `stop`,
    /// recording each request it was offered.
    fn poster<'r>(
        takes: usize,
        stop: Result<PostStatus, DomainError>,
        offered: &'r mut Vec<(u64, u64, u64)>,
    ) -> impl FnMut(&RdmaRequest<'_>) -> Result<PostStatus, DomainError> + 'r {
        move |r| {
            offered.push((r.wr_id, r.local_addr, r.remote_addr));
            if offered.len() > takes {
                stop.clone()
            } else {
                Ok(PostStatus::Posted)
            }
        }
    }

    /// Posting one by one answers how many were taken and why it stopped — `Busy`, or the
    /// error of the first request not taken — offers nothing after that one, and offers the
    /// pages of a batch moved by their shifts; one request alone answers 1 or 0.
    #[test]
    fn posting_one_by_one_stops_at_the_first_request_not_taken() {
        let peer = NetAddr::new(b"peer").expect("a valid address");
        let request = |wr_id, at| RdmaRequest {
            wr_id,
            op: RdmaOp::Write { imm: Some(3) },
            peer: &peer,
            local_addr: at,
            local_key: 1,
            remote_addr: 0x1000 + at,
            remote_key: 2,
            remote_base: 0x1000,
            len: 8,
        };
        let list = [request(1, 0), request(2, 8), request(3, 16), request(4, 24)];
        let shifts = [0, 8, 16, 24].map(|b| PageShift::new(b, 2 * b));
        let refused = DomainError::new(DomainErrorKind::RemoteAccess, "refused");
        let posts = [
            RdmaPost::List(&list),
            RdmaPost::Pages {
                template: request(9, 0),
                shifts: &shifts,
            },
        ];
        for post in posts {
            let all: Vec<_> = post
                .requests()
                .map(|r| (r.wr_id, r.local_addr, r.remote_addr))
                .collect();
            assert_eq!(all.len(), 4);
            if let RdmaPost::Pages { .. } = post {
                assert_eq!(all[3], (9, 24, 0x1000 + 48), "a page moved by its shift");
            }
            for takes in 0..=4 {
                for stop in [Ok(PostStatus::Busy), Err(refused.clone())] {
                    let mut offered = Vec::new();
                    let answer = post_one_by_one(post, poster(takes, stop.clone(), &mut offered));
                    if takes == 4 {
                        assert_eq!(answer, (4, Ok(PostStatus::Posted)));
                        assert_eq!(offered, all);
                    } else {
                        assert_eq!(answer, (takes, stop), "{post:?}");
                        assert_eq!(offered, all[..=takes], "nothing after the stop is tried");
                    }
                }
            }
        }
        let one = RdmaPost::One(request(5, 0));
        for (takes, want) in [
            (1, (1, Ok(PostStatus::Posted))),
            (0, (0, Ok(PostStatus::Busy))),
        ] {
            let mut offered = Vec::new();
            let answer = post_one_by_one(one, poster(takes, Ok(PostStatus::Busy), &mut offered));
            assert_eq!((answer, offered.len()), (want, 1));
        }
        let nothing = RdmaPost::List(&[]);
        let mut offered = Vec::new();
        let answer = post_one_by_one(nothing, poster(0, Err(refused), &mut offered));
        assert_eq!((answer, offered.len()), ((0, Ok(PostStatus::Posted)), 0));
        assert!(nothing.is_empty() && nothing.request(0).is_none());
    }

    #[test]
    fn a_waker_says_whether_the_worker_parks_and_assumes_it_does_when_unknown() {
        use std::sync::atomic::{AtomicBool, Ordering};
        let parked = Arc::new(AtomicBool::new(false));
        let seen = parked.clone();
        let told = Waker::with_parking(|| {}, move || seen.load(Ordering::SeqCst));
        assert!(!told.worker_parking());
        parked.store(true, Ordering::SeqCst);
        assert!(told.clone().worker_parking());
        assert!(
            Waker::new(|| {}).worker_parking(),
            "unknown: arm every time"
        );
    }
}
