//! The frozen contract: the `#[repr(C)]` types, the table of entries and the compile-time
//! layout assertions, which must agree field by field (the C header is generated from these
//! types, with `RawBytes` kept in `raw.rs` because the log forwarding uses it too). The shims
//! that fill the table from a Rust `Domain`, and [`export_plugin!`](crate::export_plugin), are
//! in `abi/shims.rs`: they may change; this file only grows.
//!
//! The versioned C ABI between the engine and an out-of-tree backend (one `cdylib`).
//!
//! A plugin exports an entry symbol, `xfer_plugin_entry_<backend name>` (or plain
//! [`ENTRY_SYMBOL`] for a library that serves one backend), returning a pointer to a static
//! [`PluginTable`]. The per-name symbol lets several backends be linked into one binary as
//! rlibs without their entry points clashing. Only `#[repr(C)]` types cross this boundary;
//! Rust trait objects stay on their own side.
//!
//! The table starts with a [`PluginHeader`] (ABI version and the table's size) that the
//! engine reads *before* anything else.
//!
//! **The table only grows.** Entries are appended, never moved or changed, and each version's
//! table is a prefix of the next. The engine accepts any version from [`MIN_ABI_VERSION`] to
//! [`ABI_VERSION`]; the declared version decides which entries exist: the engine reads exactly
//! that version's table ([`table_size_of`]) and refuses a `table_size` smaller than it. Entries
//! of later versions are absent (`None`), and the engine refuses what needs them with a typed
//! error naming the plugin. A plugin newer than the engine is refused with both versions named. Version 2
//! appended [`post_read`](PluginTable::post_read) (RDMA READ) and the `remote_read` flag at the
//! end of [`RawRegion`] (which version-1 plugins never read, so a region they register is never
//! remotely readable). Version 3 appended [`capabilities`](PluginTable::capabilities) (limits
//! the engine checks instead of discovering them at run time), [`set_log`](PluginTable::set_log)
//! (the plugin's log lines into the host's `tracing`) and
//! [`options_format`](PluginTable::options_format) (backend options as TOML text or as flat
//! `key=value` lines a C plugin reads without a TOML parser). Version 4 appended
//! [`check_options`](PluginTable::check_options), so an engine refuses a mistyped option when
//! it opens, naming the key, before any NIC is opened. Version 5 appended
//! [`post_write_pages`](PluginTable::post_write_pages): the pages of a paged write in one call
//! (one request and an array of [`PageShift`]s), so a plugin checks and locks once per batch
//! rather than once per page; without it the engine posts them one by one. Version 6 appended
//! [`post_writes`](PluginTable::post_writes): a burst's writes, each its own request, in one
//! call (an array of [`RawWrite`]s). Version 7 appended no entry: it added the event kind
//! [`EVENT_MESSAGE_FROM`], a message with the sender the transport proved, which an engine of
//! an earlier version would take for an unknown kind (so a version-7 plugin is refused there,
//! as every plugin newer than its engine is).
//!
//! Backend authors do not write any of this: [`export_plugin!`](crate::export_plugin) turns a
//! Rust [`Domain`] opener into the table.

use std::ffi::c_void;
use std::panic::{catch_unwind, AssertUnwindSafe};

use crate::addr::{NetAddr, MAX_ADDR_LEN};
use crate::domain::{
    Capabilities, CheckOptionsFn, Device, Domain, DomainConfig, DomainError, DomainErrorKind,
    Event, MemoryRegion, OpenFn, PageShift, PostStatus, RdmaOp, RdmaPost, RdmaRequest,
    Registration,
};
use crate::log::LogFn;
pub use crate::raw::RawBytes;

/// The ABI this engine speaks: bumped when entries are appended to [`PluginTable`] or an
/// event kind is added.
pub const ABI_VERSION: u32 = 7;
/// The oldest ABI whose plugins this engine still loads.
pub const MIN_ABI_VERSION: u32 = 1;
/// Size of a version-1 table: everything before [`PluginTable::post_read`].
pub const V1_TABLE_SIZE: u32 = std::mem::offset_of!(PluginTable, post_read) as u32;
/// Size of a version-2 table: everything before [`PluginTable::capabilities`].
pub const V2_TABLE_SIZE: u32 = std::mem::offset_of!(PluginTable, capabilities) as u32;
/// Size of a version-3 table: everything before [`PluginTable::check_options`].
pub const V3_TABLE_SIZE: u32 = std::mem::offset_of!(PluginTable, check_options) as u32;
/// Size of a version-4 table: everything before [`PluginTable::post_write_pages`].
pub const V4_TABLE_SIZE: u32 = std::mem::offset_of!(PluginTable, post_write_pages) as u32;
/// Size of a version-5 table: everything before [`PluginTable::post_writes`].
pub const V5_TABLE_SIZE: u32 = std::mem::offset_of!(PluginTable, post_writes) as u32;
/// Size of a version-6 table: the whole [`PluginTable`] (version 7 added none).
pub const V6_TABLE_SIZE: u32 = std::mem::size_of::<PluginTable>() as u32;
/// Size of a version-7 table: version 7 added an event kind ([`EVENT_MESSAGE_FROM`]), no
/// entry, so its table is version 6's.
pub const V7_TABLE_SIZE: u32 = std::mem::size_of::<PluginTable>() as u32;

/// The size of a table of ABI `version` (each version appends entries), or `None` for a
/// version this crate does not know. The engine reads exactly this many bytes of a plugin's
/// table: the declared version decides which entries exist, and the declared `table_size`
/// must cover them.
pub const fn table_size_of(version: u32) -> Option<u32> {
    match version {
        1 => Some(V1_TABLE_SIZE),
        2 => Some(V2_TABLE_SIZE),
        3 => Some(V3_TABLE_SIZE),
        4 => Some(V4_TABLE_SIZE),
        5 => Some(V5_TABLE_SIZE),
        6 => Some(V6_TABLE_SIZE),
        7 => Some(V7_TABLE_SIZE),
        _ => None,
    }
}
/// The generic entry symbol, `extern "C" fn() -> *const PluginTable`, looked up when the
/// per-backend one ([`entry_symbol`]) is absent.
pub const ENTRY_SYMBOL: &str = "xfer_plugin_entry";

/// The entry symbol of backend `name`: `xfer_plugin_entry_<name>`.
pub fn entry_symbol(name: &str) -> String {
    format!("{ENTRY_SYMBOL}_{name}")
}

/// The signature of [`ENTRY_SYMBOL`].
pub type EntryFn = unsafe extern "C" fn() -> *const PluginTable;

/// First bytes of every table, in every ABI version.
#[repr(C)]
#[derive(Debug, Clone, Copy)]
pub struct PluginHeader {
    /// The plugin's [`ABI_VERSION`].
    pub abi_version: u32,
    /// `size_of::<PluginTable>()` as the plugin was built.
    pub table_size: u32,
}

/// Room for an error message coming back across the boundary.
#[repr(C)]
#[derive(Debug)]
pub struct RawError {
    /// A [`DomainErrorKind`] as an integer.
    pub kind: u32,
    /// Bytes of `message` used.
    pub len: u32,
    /// UTF-8 message, truncated to fit.
    pub message: [u8; 512],
}

impl RawError {
    /// An empty error buffer.
    pub fn empty() -> Self {
        Self {
            kind: 0,
            len: 0,
            message: [0; 512],
        }
    }

    fn fill(&mut self, err: &DomainError) {
        let msg = err.message.as_bytes();
        let mut n = msg.len().min(self.message.len());
        while !err.message.is_char_boundary(n) {
            n -= 1;
        }
        self.kind = err.kind as u32;
        self.len = n as u32;
        self.message[..n].copy_from_slice(&msg[..n]);
    }

    /// The error it holds.
    pub fn to_error(&self) -> DomainError {
        let n = (self.len as usize).min(self.message.len());
        DomainError::new(
            DomainErrorKind::from_raw(self.kind),
            String::from_utf8_lossy(&self.message[..n]).into_owned(),
        )
    }
}

/// [`MemoryRegion`] in C layout.
#[repr(C)]
#[derive(Debug, Clone, Copy)]
pub struct RawRegion {
    /// First byte.
    pub ptr: u64,
    /// Length.
    pub len: u64,
    /// [`DEVICE_HOST`] or [`DEVICE_CUDA`]; anything else is refused.
    pub device_kind: u32,
    /// The CUDA device index.
    pub device_index: u32,
    /// 1 if peers may write into it.
    pub remote_write: u32,
    /// 1 if peers may read it (ABI 2; version-1 plugins do not read it).
    pub remote_read: u32,
}

/// [`RawRegion::device_kind`]: host memory.
pub const DEVICE_HOST: u32 = 0;
/// [`RawRegion::device_kind`]: memory of CUDA device `device_index`.
pub const DEVICE_CUDA: u32 = 1;

/// [`RawCapabilities::memory_kinds`]: registers host memory.
pub const MEMORY_HOST: u32 = 1;
/// Registers CUDA memory (GPUDirect: the NIC reads and writes it without a host bounce).
pub const MEMORY_CUDA: u32 = 2;
/// Registers CUDA memory through dma-buf.
pub const MEMORY_DMABUF: u32 = 4;

/// [`RawCapabilities::flags`]: writes may carry an immediate.
pub const CAP_IMMEDIATES: u32 = 1;
/// Zero-byte writes (with an immediate: a pure signal) are supported.
pub const CAP_ZERO_BYTE_WRITES: u32 = 2;
/// The Domain only makes progress while polled, also on the receiving side (libfabric's
/// manual-progress providers, EFA): the engine keeps polling it instead of parking.
pub const CAP_NEEDS_RECEIVER_POLLING: u32 = 4;

/// [`PluginTable::options_format`]: the backend's options as TOML text (the `[backends.<name>]`
/// table).
pub const OPTIONS_TOML: u32 = 0;
/// The backend's options as lines `key=value\n`: nested tables as dotted keys
/// (`faults.delay_ms=3`), strings unquoted with `\` written `\\`, a newline `\n` and a comma
/// `\,` (so an unescaped comma always separates array elements), arrays comma-separated,
/// booleans `true`/`false`. Keys in sorted order.
pub const OPTIONS_FLAT: u32 = 1;

/// [`Capabilities`] in C layout (ABI 3).
#[repr(C)]
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct RawCapabilities {
    /// Largest single write or read in bytes; 0 = no limit.
    pub max_write_size: u64,
    /// Largest message in bytes; 0 = no limit.
    pub max_message_size: u64,
    /// Longest address this plugin hands out (at most 64).
    pub max_address_len: u32,
    /// `MEMORY_*` bits.
    pub memory_kinds: u32,
    /// `CAP_*` bits.
    pub flags: u32,
    /// Zero; room to grow without changing the size.
    pub reserved: u32,
}

impl RawCapabilities {
    /// The C form of `caps`.
    pub fn from_capabilities(caps: &Capabilities) -> Self {
        let bit = |on: bool, b: u32| if on { b } else { 0 };
        Self {
            max_write_size: caps.max_write_size.unwrap_or(0),
            max_message_size: caps.max_message_size.unwrap_or(0) as u64,
            max_address_len: caps.max_address_len as u32,
            memory_kinds: bit(caps.host_memory, MEMORY_HOST)
                | bit(caps.cuda_memory, MEMORY_CUDA)
                | bit(caps.dmabuf, MEMORY_DMABUF),
            flags: bit(caps.immediates, CAP_IMMEDIATES)
                | bit(caps.zero_byte_writes, CAP_ZERO_BYTE_WRITES)
                | bit(caps.needs_receiver_polling, CAP_NEEDS_RECEIVER_POLLING),
            reserved: 0,
        }
    }

    /// What it says, as the engine uses it.
    pub fn to_capabilities(&self) -> Capabilities {
        let has = |bits: u32, b: u32| bits & b != 0;
        Capabilities {
            max_write_size: (self.max_write_size != 0).then_some(self.max_write_size),
            max_message_size: (self.max_message_size != 0)
                .then(|| usize::try_from(self.max_message_size).unwrap_or(usize::MAX)),
            max_address_len: self.max_address_len as usize,
            host_memory: has(self.memory_kinds, MEMORY_HOST),
            cuda_memory: has(self.memory_kinds, MEMORY_CUDA),
            dmabuf: has(self.memory_kinds, MEMORY_DMABUF),
            immediates: has(self.flags, CAP_IMMEDIATES),
            zero_byte_writes: has(self.flags, CAP_ZERO_BYTE_WRITES),
            needs_receiver_polling: has(self.flags, CAP_NEEDS_RECEIVER_POLLING),
            // Not in the C layout: the table's `post_read` entry says it (see `PluginDomain`).
            reads: false,
        }
    }
}

/// An [`RdmaRequest`] of [`RdmaOp::Write`] in C layout.
#[repr(C)]
#[derive(Debug, Clone, Copy)]
pub struct RawWrite {
    /// See [`RdmaRequest::wr_id`].
    pub wr_id: u64,
    /// The peer's address bytes.
    pub peer: RawBytes,
    /// Source address.
    pub local_addr: u64,
    /// Source local key.
    pub local_key: u64,
    /// Destination address.
    pub remote_addr: u64,
    /// Destination remote key.
    pub remote_key: u64,
    /// Start of the destination region.
    pub remote_base: u64,
    /// Bytes.
    pub len: u64,
    /// 1 if `imm` is meaningful.
    pub has_imm: u32,
    /// The immediate.
    pub imm: u32,
}

/// An [`RdmaRequest`] of [`RdmaOp::Read`] in C layout (ABI 2).
#[repr(C)]
#[derive(Debug, Clone, Copy)]
pub struct RawRead {
    /// Returned in the matching done event.
    pub wr_id: u64,
    /// The peer's address bytes.
    pub peer: RawBytes,
    /// Destination address (local).
    pub local_addr: u64,
    /// Destination local key.
    pub local_key: u64,
    /// Source address (at the peer).
    pub remote_addr: u64,
    /// Source remote key.
    pub remote_key: u64,
    /// Start of the source region.
    pub remote_base: u64,
    /// Bytes.
    pub len: u64,
}

/// The one place an [`RdmaRequest`] meets the ABI's C structs: the C ABI keeps a write and a
/// read apart (a table entry each, ABI 2 appended reads), the Rust side has one request.
/// Either form borrows the peer's address bytes, which must outlive the C call.
pub enum RawRdma {
    /// A write, for [`PluginTable::post_write`].
    Write(RawWrite),
    /// A read, for [`PluginTable::post_read`].
    Read(RawRead),
}

impl RawRdma {
    /// The C form of `req` (engine side, before calling the plugin).
    pub fn from_request(req: &RdmaRequest<'_>) -> Self {
        let peer = RawBytes::new(req.peer.raw());
        match req.op {
            RdmaOp::Write { imm } => Self::Write(RawWrite {
                wr_id: req.wr_id,
                peer,
                local_addr: req.local_addr,
                local_key: req.local_key,
                remote_addr: req.remote_addr,
                remote_key: req.remote_key,
                remote_base: req.remote_base,
                len: req.len,
                has_imm: imm.is_some() as u32,
                imm: imm.unwrap_or(0),
            }),
            RdmaOp::Read => Self::Read(RawRead {
                wr_id: req.wr_id,
                peer,
                local_addr: req.local_addr,
                local_key: req.local_key,
                remote_addr: req.remote_addr,
                remote_key: req.remote_key,
                remote_base: req.remote_base,
                len: req.len,
            }),
        }
    }

    /// The request `self` carries, addressed to `peer` (the decoded [`RawWrite::peer`] or
    /// [`RawRead::peer`]; plugin side, inside the shims).
    pub fn request<'a>(&self, peer: &'a NetAddr) -> RdmaRequest<'a> {
        let (wr_id, op, local_addr, local_key, remote_addr, remote_key, remote_base, len) =
            match *self {
                Self::Write(w) => (
                    w.wr_id,
                    RdmaOp::Write {
                        imm: (w.has_imm != 0).then_some(w.imm),
                    },
                    w.local_addr,
                    w.local_key,
                    w.remote_addr,
                    w.remote_key,
                    w.remote_base,
                    w.len,
                ),
                Self::Read(r) => (
                    r.wr_id,
                    RdmaOp::Read,
                    r.local_addr,
                    r.local_key,
                    r.remote_addr,
                    r.remote_key,
                    r.remote_base,
                    r.len,
                ),
            };
        RdmaRequest {
            wr_id,
            op,
            peer,
            local_addr,
            local_key,
            remote_addr,
            remote_key,
            remote_base,
            len,
        }
    }

    /// The peer's address bytes as the plugin received them.
    fn peer(&self) -> RawBytes {
        match self {
            Self::Write(w) => w.peer,
            Self::Read(r) => r.peer,
        }
    }
}

/// [`RawEvent::kind`]: a posted request finished well.
pub const EVENT_DONE: u32 = 0;
/// A posted request failed; `error_kind` and `data` (the text) say how.
pub const EVENT_FAILED: u32 = 1;
/// A peer's write with immediate `imm` landed.
pub const EVENT_IMM: u32 = 2;
/// A message (`data`) arrived in a posted receive buffer; its sender is not known.
pub const EVENT_MESSAGE: u32 = 3;
/// ABI 7: a message arrived in a posted receive buffer, with the sender the transport proved
/// (never a claim read from the message): `data` is one byte `n` (1 to [`MAX_ADDR_LEN`]),
/// then the `n` bytes of the sender's address (as its Domain's `address` returns it), then
/// the message. See [`encode_message_from`] and [`decode_message_from`]. A plugin that
/// cannot tell the sender sends [`EVENT_MESSAGE`].
pub const EVENT_MESSAGE_FROM: u32 = 4;

/// The `data` of an [`EVENT_MESSAGE_FROM`] event: the sender's address, length-prefixed,
/// then the message.
pub fn encode_message_from(from: &NetAddr, message: &[u8]) -> Vec<u8> {
    let addr = from.raw();
    let mut data = Vec::with_capacity(1 + addr.len() + message.len());
    // A NetAddr is 1 to MAX_ADDR_LEN (64) bytes: its length fits the byte.
    data.push(addr.len() as u8);
    data.extend_from_slice(addr);
    data.extend_from_slice(message);
    data
}

/// Splits the `data` of an [`EVENT_MESSAGE_FROM`] event into the sender's address and the
/// message; `None` when the prefix is not an address (a zero or too long length, or bytes
/// missing), which the engine treats as a broken plugin.
pub fn decode_message_from(data: &[u8]) -> Option<(NetAddr, &[u8])> {
    let (&n, rest) = data.split_first()?;
    let n = usize::from(n);
    if n == 0 || n > MAX_ADDR_LEN || rest.len() < n {
        return None;
    }
    let (addr, message) = rest.split_at(n);
    Some((NetAddr::new(addr).ok()?, message))
}

/// One event in C layout; its byte strings are valid only during the sink call.
#[repr(C)]
#[derive(Debug, Clone, Copy)]
pub struct RawEvent {
    /// `EVENT_*`; any other value makes the engine fail the Domain.
    pub kind: u32,
    /// A [`DomainErrorKind`] for kind 1.
    pub error_kind: u32,
    /// For kinds 0 and 1.
    pub wr_id: u64,
    /// For kind 2.
    pub imm: u32,
    /// Message bytes (kind 3), the sender's address and the message (kind 4, see
    /// [`EVENT_MESSAGE_FROM`]), error text (kind 1), or for kind 2 the sender's address (as
    /// its `address` returns it; empty if the NIC does not tell), which lets the engine bound
    /// per sender the immediates nobody waits for.
    pub data: RawBytes,
}

/// Called by the plugin for each event during `poll`.
pub type EventSink = unsafe extern "C" fn(sink: *mut c_void, event: *const RawEvent);
/// Called by the plugin to wake the engine's worker.
pub type WakeFn = unsafe extern "C" fn(ctx: *const c_void);

/// Status codes of the table's functions.
pub const STATUS_OK: i32 = 0;
/// The queue is full ([`PostStatus::Busy`]).
pub const STATUS_BUSY: i32 = 1;
/// Failed; the `RawError` says why.
pub const STATUS_ERROR: i32 = -1;

/// The function table a plugin exports. Every handle is the `*mut c_void` `open` returned.
#[repr(C)]
#[derive(Debug)]
pub struct PluginTable {
    /// Version and size, checked before anything else is read.
    pub header: PluginHeader,
    /// The backend's name (UTF-8, static).
    pub name: RawBytes,
    /// Opens a Domain for one NIC with the backend's options (TOML text).
    pub open: unsafe extern "C" fn(
        nic: RawBytes,
        options: RawBytes,
        out: *mut *mut c_void,
        err: *mut RawError,
    ) -> i32,
    /// Closes a Domain.
    pub close: unsafe extern "C" fn(domain: *mut c_void),
    /// Writes the address into `buf`; returns its length (or 0 if `cap` is too small).
    pub address: unsafe extern "C" fn(domain: *mut c_void, buf: *mut u8, cap: usize) -> usize,
    /// Registers memory.
    pub register: unsafe extern "C" fn(
        domain: *mut c_void,
        region: *const RawRegion,
        out: *mut Registration,
        err: *mut RawError,
    ) -> i32,
    /// Deregisters memory.
    pub deregister:
        unsafe extern "C" fn(domain: *mut c_void, local_key: u64, err: *mut RawError) -> i32,
    /// Posts a write.
    pub post_write:
        unsafe extern "C" fn(domain: *mut c_void, wr: *const RawWrite, err: *mut RawError) -> i32,
    /// Posts a message.
    pub post_send: unsafe extern "C" fn(
        domain: *mut c_void,
        wr_id: u64,
        peer: RawBytes,
        data: RawBytes,
        err: *mut RawError,
    ) -> i32,
    /// Adds receive buffers.
    pub post_recvs: unsafe extern "C" fn(
        domain: *mut c_void,
        buf_len: usize,
        count: usize,
        err: *mut RawError,
    ) -> i32,
    /// Makes progress and hands each ready event to `sink_fn(sink, event)`.
    pub poll: unsafe extern "C" fn(
        domain: *mut c_void,
        sink: *mut c_void,
        sink_fn: EventSink,
        err: *mut RawError,
    ) -> i32,
    /// Installs a wake function; returns 1 if the plugin will call it.
    pub set_waker:
        unsafe extern "C" fn(domain: *mut c_void, ctx: *const c_void, wake: WakeFn) -> u32,
    /// ABI 2: posts an RDMA READ (null: the plugin has no reads). Appended; absent from
    /// version-1 tables.
    pub post_read: Option<
        unsafe extern "C" fn(domain: *mut c_void, rd: *const RawRead, err: *mut RawError) -> i32,
    >,
    /// ABI 3: fills in the Domain's limits and abilities (null: the engine assumes no limits,
    /// host and CUDA memory, immediates and zero-byte writes, no receiver polling).
    pub capabilities:
        Option<unsafe extern "C" fn(domain: *mut c_void, out: *mut RawCapabilities) -> i32>,
    /// ABI 3: called by each engine that opens the plugin, before its first `open` (so
    /// possibly more than once per process), with the host's log function and the most
    /// verbose level it wants (1 = error … 5 = trace; see the `log` module); may be null.
    pub set_log: Option<unsafe extern "C" fn(log: LogFn, max_level: u32)>,
    /// ABI 3: how `open` receives the backend's options: [`OPTIONS_TOML`] or [`OPTIONS_FLAT`].
    pub options_format: u32,
    /// Zero; keeps the table's size a multiple of 8 on every target.
    pub reserved: u32,
    /// ABI 4: checks the backend's options (in [`options_format`](Self::options_format))
    /// without opening anything; an error names the mistake (null: the options are checked
    /// when a NIC opens). The engine calls it once when it opens.
    pub check_options: Option<unsafe extern "C" fn(options: RawBytes, err: *mut RawError) -> i32>,
    /// ABI 5: posts the pages of a paged write: `request` moved by each of the `count`
    /// entries of `shifts` (added to its local and remote addresses), in order, all with the
    /// request's `wr_id`, each to get its own done event. (Not named `template`: the header
    /// is C++ too.) Stores in `posted` how many were
    /// posted; returns [`STATUS_OK`] when all were, otherwise [`STATUS_BUSY`] or
    /// [`STATUS_ERROR`] (with `err`) for request number `*posted`, which was not posted, and
    /// nothing after it was tried (null: the engine posts each page with `post_write`).
    pub post_write_pages: Option<
        unsafe extern "C" fn(
            domain: *mut c_void,
            request: *const RawWrite,
            shifts: *const PageShift,
            count: usize,
            posted: *mut usize,
            err: *mut RawError,
        ) -> i32,
    >,
    /// ABI 6: posts the `count` writes of `requests`, in order, each with its own `wr_id`
    /// and peer: the writes the engine gathered in one pass over its submissions (a burst).
    /// Stores in `posted` how many were posted; returns [`STATUS_OK`] when all were,
    /// otherwise [`STATUS_BUSY`] or [`STATUS_ERROR`] (with `err`) for request number
    /// `*posted`, which was not posted, and nothing after it was tried (null: the engine
    /// posts each with `post_write`).
    pub post_writes: Option<
        unsafe extern "C" fn(
            domain: *mut c_void,
            requests: *const RawWrite,
            count: usize,
            posted: *mut usize,
            err: *mut RawError,
        ) -> i32,
    >,
}

// SAFETY: the table is immutable static data (function pointers and a static name).
unsafe impl Sync for PluginTable {}
// SAFETY: as above: a copy holds the same function pointers and the same static name.
unsafe impl Send for PluginTable {}

/// Implemented by the type [`export_plugin!`](crate::export_plugin) generates.
pub trait PluginOpener {
    /// The backend's name.
    const NAME: &'static str;
    /// Opens one NIC.
    const OPEN: OpenFn;
    /// Checks the backend's options (TOML text) without opening anything.
    const CHECK: Option<CheckOptionsFn> = None;
}

mod shims;

// Published layouts: plugins built against earlier versions rely on these sizes and offsets,
// so a change here (a field moved, resized or inserted rather than appended) fails the build.
// The generated C header asserts the same numbers on the C side.
const _: () = {
    use std::mem::{offset_of, size_of};
    assert!(size_of::<PluginHeader>() == 8);
    assert!(size_of::<RawBytes>() == 16);
    assert!(size_of::<RawError>() == 520);
    assert!(size_of::<RawRegion>() == 32);
    assert!(size_of::<RawWrite>() == 80);
    assert!(size_of::<RawRead>() == 72);
    assert!(size_of::<RawEvent>() == 40);
    assert!(size_of::<RawCapabilities>() == 32);
    assert!(V1_TABLE_SIZE == 104);
    assert!(V2_TABLE_SIZE == 112);
    assert!(offset_of!(PluginTable, set_log) == 120);
    assert!(V3_TABLE_SIZE == 136);
    assert!(V4_TABLE_SIZE == 144);
    assert!(size_of::<PageShift>() == 16);
    assert!(V5_TABLE_SIZE == 152);
    assert!(size_of::<PluginTable>() == 160);
};
