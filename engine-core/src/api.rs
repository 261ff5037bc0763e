//! [`TransferEngine`]: the surface users call. Everything that can be checked locally is checked
//! here, on the caller's thread, before anything is queued; the outcome on the wire arrives
//! through [`OnDone`].

use std::collections::{HashMap, HashSet};
use std::sync::atomic::{AtomicU32, AtomicU64, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex, RwLock};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use crate::config::{Config, NicSelection};
use crate::domain::{Device, MemoryRegion, Registration};
use crate::error::{Error, Result};
use crate::group::SpreadPolicy;
use crate::imm::ResetReport;
use crate::plan::{Chunk, TransferShape};
use crate::plugin::find_backend;
use crate::runtime::completion::OnDone;
use crate::runtime::{spawn_callback_thread, spawn_worker, Command, Mirror, Shared, WriteOp};
use crate::wire::{MrDesc, NetAddr};

/// Engine ids, so a handle from one engine is refused by another.
static NEXT_ENGINE: AtomicU32 = AtomicU32::new(1);

/// A region registered with this engine (all its NICs). Cheap to copy; valid until
/// [`TransferEngine::dereg_mr`], and only with the engine that created it.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct MrHandle {
    engine: u32,
    id: u64,
}

impl MrHandle {
    /// The raw id (for logs).
    pub fn id(self) -> u64 {
        self.id
    }
}

/// A set of peers registered with [`TransferEngine::add_peer_group`]; only valid with the
/// engine that created it.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct PeerGroupHandle {
    engine: u32,
    id: u64,
}

/// A write (with its immediate, if any) or a read, as the shared submit paths take it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Rdma {
    Write(Option<u32>),
    Read,
}

impl Rdma {
    fn imm(self) -> Option<u32> {
        match self {
            Self::Write(imm) => imm,
            Self::Read => None,
        }
    }

    /// How errors name the local range: the source of a write, the destination of a read.
    fn local_side(self) -> &'static str {
        match self {
            Self::Write(_) => "source",
            Self::Read => "destination",
        }
    }

    fn remote_side(self) -> &'static str {
        match self {
            Self::Write(_) => "destination",
            Self::Read => "source",
        }
    }
}

/// What peers may do to a registered region.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct RemoteAccess {
    /// Peers may write into it (RDMA WRITE, with or without immediate).
    pub write: bool,
    /// Peers may read it (RDMA READ).
    pub read: bool,
}

impl RemoteAccess {
    /// Local only: a source of writes, a destination of reads.
    pub const NONE: Self = Self {
        write: false,
        read: false,
    };
    /// Peers may write (what [`TransferEngine::reg_mr`] registers).
    pub const WRITE: Self = Self {
        write: true,
        read: false,
    };
    /// Peers may read.
    pub const READ: Self = Self {
        write: false,
        read: true,
    };
    /// Peers may read and write.
    pub const READ_WRITE: Self = Self {
        write: true,
        read: true,
    };
}

/// Pages of a region: page `i` starts at `offset + indices[i] * stride`.
#[derive(Debug, Clone, PartialEq, Eq, Default)]
pub struct Pages {
    /// Page numbers, in any order.
    pub indices: Vec<u32>,
    /// Bytes from one page number to the next.
    pub stride: u64,
    /// Offset of page 0 from the region's start.
    pub offset: u64,
}

/// One destination of a scatter.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ScatterDst {
    /// Bytes to write.
    pub len: u64,
    /// Where they start in the source region.
    pub src_offset: u64,
    /// The destination region.
    pub dst: MrDesc,
    /// Where they go in it.
    pub dst_offset: u64,
}

/// A region on this side, as the caller's thread validates against it.
#[derive(Debug, Clone)]
struct LocalRegion {
    ptr: u64,
    len: u64,
    /// One registration per NIC, in NIC order.
    keys: Vec<Registration>,
}

/// Point-to-point RDMA over one DomainGroup. See the crate docs for the model.
///
/// Dropping the engine fails everything still in flight with [`Error::Shutdown`] (each
/// `OnDone` still fires exactly once) and joins its threads.
pub struct TransferEngine {
    id: u32,
    /// Whether the backend's Domains support RDMA READ.
    reads: bool,
    /// Each NIC's capabilities, as its Domain declared them.
    caps: Vec<crate::domain::Capabilities>,
    /// How this engine's DomainGroup spreads transfers over its NICs.
    spread: Arc<dyn SpreadPolicy>,
    shared: Arc<Shared>,
    addresses: Vec<NetAddr>,
    regions: RwLock<foldhash::HashMap<u64, Arc<LocalRegion>>>,
    peer_groups: Mutex<HashMap<u64, HashSet<NetAddr>>>,
    next_id: AtomicU64,
    next_first_nic: AtomicUsize,
    watchers: std::sync::OnceLock<uvm_watcher::WatcherPool>,
    /// Taken (and joined) by the first `shutdown`.
    worker: Mutex<Option<JoinHandle<()>>>,
    callbacks: Mutex<Option<JoinHandle<()>>>,
}

impl std::fmt::Debug for TransferEngine {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("TransferEngine")
            .field("backend", &self.shared.backend)
            .field("addresses", &self.addresses)
            .finish_non_exhaustive()
    }
}

fn check_range(side: &'static str, offset: u64, len: u64, region_len: u64) -> Result<()> {
    match offset.checked_add(len) {
        Some(end) if end <= region_len => Ok(()),
        _ => Err(Error::OutOfBounds {
            side,
            offset,
            len,
            region_len,
        }),
    }
}

fn page_offset(pages: &Pages, i: usize) -> Option<u64> {
    u64::from(pages.indices[i])
        .checked_mul(pages.stride)?
        .checked_add(pages.offset)
}

impl TransferEngine {
    /// Opens an engine on the first DomainGroup of `config`.
    pub fn open(config: &Config) -> Result<Self> {
        Self::open_group(config, 0)
    }

    /// Opens an engine on DomainGroup `group` of `config`.
    pub fn open_group(config: &Config, group: usize) -> Result<Self> {
        // A Config built or changed in code gets the checks a file gets.
        config.validate()?;
        if group >= config.groups.len() {
            return Err(Error::InvalidArgument(format!(
                "group {group} does not exist; {} has {} groups",
                config.source.display(),
                config.groups.len()
            )));
        }
        let backend = find_backend(&config.backend, config.plugin.as_deref())?;
        let thread_error = |e: std::io::Error| Error::Backend {
            backend: config.backend.clone(),
            message: format!("cannot spawn the callback thread: {e}"),
        };
        let (jobs, callbacks) =
            spawn_callback_thread(format!("xfer-callbacks-{group}")).map_err(thread_error)?;
        let shared = Arc::new(Shared::new(config.clone(), backend.name().to_owned(), jobs));
        let worker = match spawn_worker(Arc::clone(&shared), backend, group) {
            Ok(w) => w,
            Err(e) => {
                let _ = shared.jobs.send(None);
                let _ = callbacks.join();
                return Err(e);
            }
        };
        Ok(Self {
            id: NEXT_ENGINE.fetch_add(1, Ordering::Relaxed),
            reads: worker.reads,
            caps: worker.caps,
            spread: worker.spread,
            shared,
            addresses: worker.addresses,
            regions: RwLock::new(foldhash::HashMap::default()),
            peer_groups: Mutex::new(HashMap::new()),
            next_id: AtomicU64::new(1),
            next_first_nic: AtomicUsize::new(0),
            watchers: std::sync::OnceLock::new(),
            worker: Mutex::new(Some(worker.thread)),
            callbacks: Mutex::new(Some(callbacks)),
        })
    }

    /// This engine's address (its first NIC's), for peers' `submit_send` and peer groups.
    pub fn main_address(&self) -> NetAddr {
        self.addresses[0].clone()
    }

    /// The addresses of all NICs of the group, in NIC order.
    pub fn nic_addresses(&self) -> &[NetAddr] {
        &self.addresses
    }

    /// How many NICs this engine stripes over.
    pub fn nic_count(&self) -> usize {
        self.addresses.len()
    }

    /// How many arrivals (immediates) a receiver counts for a transfer of `shape` from a peer
    /// with this engine's group and config: the `n` to pass to `expect_imm_count`. The group
    /// decides (the built-in striping group gives
    /// [`expected_arrivals`](crate::expected_arrivals)`(shape, nic_count, &config.stripe)`).
    pub fn expected_arrivals(&self, shape: TransferShape<'_>) -> u64 {
        self.spread.expected_arrivals(shape, self.nic_count())
    }

    /// What each NIC's Domain declared it can do (limits, memory kinds, immediates), in NIC
    /// order; the engine refuses what they rule out before posting.
    pub fn capabilities(&self) -> &[crate::domain::Capabilities] {
        &self.caps
    }

    /// The backend's name.
    pub fn backend(&self) -> &str {
        &self.shared.backend
    }

    /// The configuration in force.
    pub fn config(&self) -> &Config {
        &self.shared.config
    }

    /// A request/reply round trip to the worker that gives up after `control_ms`. Only for
    /// requests the worker undoes when nobody waits for the reply any more.
    fn control<T>(
        &self,
        make: impl FnOnce(crossbeam_channel::Sender<Result<T>>) -> Command,
    ) -> Result<T> {
        let (tx, rx) = crossbeam_channel::bounded(1);
        self.shared.submit(make(tx))?;
        let timeout = self.shared.config.timeouts.control();
        match rx.recv_timeout(timeout) {
            Ok(result) => result,
            Err(crossbeam_channel::RecvTimeoutError::Timeout) => Err(Error::Timeout(timeout)),
            // The worker dropped the request: it failed or shut down.
            Err(crossbeam_channel::RecvTimeoutError::Disconnected) => Err(self.gone()),
        }
    }

    /// A round trip that waits for the worker's answer however long it takes: what it
    /// guarantees must hold when it returns. The worker cannot wedge on a panic (it contains
    /// them), so only a backend call that never returns keeps this waiting; that is logged
    /// every `control_ms`.
    fn control_until_done<T>(
        &self,
        what: &str,
        make: impl FnOnce(crossbeam_channel::Sender<Result<T>>) -> Command,
    ) -> Result<T> {
        let (tx, rx) = crossbeam_channel::bounded(1);
        self.shared.submit(make(tx))?;
        let step = self.shared.config.timeouts.control();
        let start = Instant::now();
        loop {
            match rx.recv_timeout(step) {
                Ok(result) => return result,
                Err(crossbeam_channel::RecvTimeoutError::Timeout) => tracing::warn!(
                    waited_ms = start.elapsed().as_millis() as u64,
                    "{what} is still waiting for the worker"
                ),
                Err(crossbeam_channel::RecvTimeoutError::Disconnected) => return Err(self.gone()),
            }
        }
    }

    fn gone(&self) -> Error {
        match self.shared.failed.get() {
            Some(why) => Error::WorkerFailed(why.clone()),
            None => Error::Shutdown,
        }
    }

    fn register(
        &self,
        ptr: *mut u8,
        len: usize,
        device: Device,
        access: RemoteAccess,
    ) -> Result<(MrHandle, LocalRegion)> {
        if ptr.is_null() || len == 0 {
            return Err(Error::InvalidArgument(format!(
                "cannot register {len} bytes at {ptr:?}: the region must be non-null and non-empty"
            )));
        }
        let region = MemoryRegion {
            ptr: ptr as u64,
            len: len as u64,
            device,
            remote_write: access.write,
            remote_read: access.read,
        };
        // Wrong memory kinds are caught here, before any NIC sees them: a device pointer
        // passed as host memory, host memory (or another GPU's) passed as a device's, a range
        // across two allocations, a device that does not exist.
        match device {
            Device::Host => uvm_watcher::gpu::check_host_range(region.ptr),
            Device::Cuda(i) => uvm_watcher::gpu::check_device_range(region.ptr, region.len, i),
        }
        .map_err(Error::InvalidArgument)?;
        let keys = self.control(|reply| Command::Register { region, reply })?;
        let local = LocalRegion {
            ptr: region.ptr,
            len: region.len,
            keys,
        };
        let handle = MrHandle {
            engine: self.id,
            id: self.next_id.fetch_add(1, Ordering::Relaxed),
        };
        self.regions
            .write()
            .unwrap_or_else(|p| p.into_inner())
            .insert(handle.id, Arc::new(local.clone()));
        Ok((handle, local))
    }

    /// Registers `len` bytes at `ptr` on every NIC; returns the local handle and the
    /// descriptor to give peers so they can write here.
    ///
    /// # Safety
    /// The memory must stay allocated until [`dereg_mr`](Self::dereg_mr) returns, and while it
    /// is registered peers may write into it at any time: read it only after the writes you
    /// wait for have been counted (an `expect_imm_count` or the writer's own signal).
    pub unsafe fn reg_mr(
        &self,
        ptr: *mut u8,
        len: usize,
        device: Device,
    ) -> Result<(MrHandle, MrDesc)> {
        self.register_remote(ptr, len, device, RemoteAccess::WRITE)
    }

    /// Registers `len` bytes at `ptr` on every NIC with the remote access given — e.g.
    /// [`RemoteAccess::READ`] for a region peers pull from with
    /// [`submit_single_read`](Self::submit_single_read) (a prefill node's KV cache) — and
    /// returns the handle and the descriptor for peers. A peer's access the region was not
    /// registered for fails at the peer's NIC as a remote access error, nothing transferred.
    ///
    /// # Safety
    /// As for [`reg_mr`](Self::reg_mr): the memory stays allocated until `dereg_mr` returns,
    /// and peers may read or write it (as allowed) at any time meanwhile.
    pub unsafe fn reg_mr_with(
        &self,
        ptr: *mut u8,
        len: usize,
        device: Device,
        access: RemoteAccess,
    ) -> Result<(MrHandle, MrDesc)> {
        self.register_remote(ptr, len, device, access)
    }

    /// What `reg_mr` and `reg_mr_with` do (their contract is the callers').
    fn register_remote(
        &self,
        ptr: *mut u8,
        len: usize,
        device: Device,
        access: RemoteAccess,
    ) -> Result<(MrHandle, MrDesc)> {
        if !access.write && !access.read {
            return Err(Error::InvalidArgument(
                "a region peers can neither read nor write has no descriptor: use reg_mr_local"
                    .into(),
            ));
        }
        let (handle, local) = self.register(ptr, len, device, access)?;
        let rkeys = self
            .addresses
            .iter()
            .cloned()
            .zip(local.keys.iter().map(|k| k.remote_key))
            .collect();
        let desc = MrDesc::new(local.ptr, local.len, rkeys).map_err(|source| Error::Decode {
            what: "MrDesc",
            source,
        })?;
        Ok((handle, desc))
    }

    /// Registers memory only as a source of writes (peers get no key to it).
    ///
    /// # Safety
    /// The memory must stay allocated until [`dereg_mr`](Self::dereg_mr) returns.
    pub unsafe fn reg_mr_local(
        &self,
        ptr: *mut u8,
        len: usize,
        device: Device,
    ) -> Result<MrHandle> {
        Ok(self.register(ptr, len, device, RemoteAccess::NONE)?.0)
    }

    /// Deregisters a region on every NIC.
    ///
    /// **Whatever it returns, no NIC touches the memory after it returns**: it waits for the
    /// worker however long that takes (no timeout), and if the worker failed or the engine
    /// shut down, the Domains were closed before this returns. An error only says that some
    /// NIC reported a failure while deregistering (logged) or that the handle is unknown.
    /// Writes of this engine still in flight from the region may fail.
    pub fn dereg_mr(&self, handle: MrHandle) -> Result<()> {
        self.check_owner("memory region", handle.engine, handle.id)?;
        let region = self
            .regions
            .write()
            .unwrap_or_else(|p| p.into_inner())
            .remove(&handle.id)
            .ok_or(Error::UnknownHandle(handle.id))?;
        let keys = region.keys.iter().map(|k| k.local_key).collect();
        match self.control_until_done("dereg_mr", |reply| Command::Deregister { keys, reply }) {
            // Closed Domains hold no registrations: the guarantee holds.
            Err(Error::Shutdown | Error::WorkerFailed(_)) => Ok(()),
            other => other,
        }
    }

    fn check_owner(&self, what: &'static str, owner: u32, id: u64) -> Result<()> {
        if owner == self.id {
            Ok(())
        } else {
            Err(Error::ForeignHandle {
                what,
                id,
                owner,
                this: self.id,
            })
        }
    }

    fn local_region(&self, handle: MrHandle) -> Result<Arc<LocalRegion>> {
        self.check_owner("memory region", handle.engine, handle.id)?;
        self.regions
            .read()
            .unwrap_or_else(|p| p.into_inner())
            .get(&handle.id)
            .cloned()
            .ok_or(Error::UnknownHandle(handle.id))
    }

    fn check_peer_nics(&self, desc: &MrDesc) -> Result<()> {
        if desc.rkeys().len() != self.nic_count() {
            return Err(Error::InvalidArgument(format!(
                "the destination MrDesc has {} NICs but this engine has {}; peers must use the same NIC count",
                desc.rkeys().len(),
                self.nic_count()
            )));
        }
        Ok(())
    }

    fn first_nic(&self) -> usize {
        match self.shared.config.nic_selection {
            NicSelection::First(n) => n,
            NicSelection::RoundRobin => {
                self.next_first_nic.fetch_add(1, Ordering::Relaxed) % self.nic_count()
            }
        }
    }

    /// Plans one contiguous unit and appends its writes, pairing each chunk with *its* NIC's
    /// local key, remote key and peer address (the one place where they are paired).
    #[allow(clippy::too_many_arguments)]
    fn plan_unit(
        &self,
        ops: &mut Vec<WriteOp>,
        chunks: &mut Vec<Chunk>,
        first: usize,
        src: &LocalRegion,
        src_offset: u64,
        dst: &MrDesc,
        dst_offset: u64,
        len: u64,
        imm: Option<u32>,
        read: bool,
    ) {
        chunks.clear();
        self.spread.split(len, self.nic_count(), first, chunks);
        for c in chunks.iter() {
            let (peer, remote_key) = &dst.rkeys()[c.nic];
            ops.push(WriteOp {
                read,
                nic: c.nic,
                peer: peer.clone(),
                local_addr: src.ptr + src_offset + c.offset,
                local_key: src.keys[c.nic].local_key,
                remote_addr: dst.ptr() + dst_offset + c.offset,
                remote_key: *remote_key,
                remote_base: dst.ptr(),
                len: c.len,
                imm,
            });
        }
    }

    /// Writes `len` bytes from `src` (handle, offset) to `dst` (descriptor, offset); large
    /// writes stripe over the NICs. With `imm`, each write carries it: the receiver counts
    /// [`expected_arrivals`](crate::expected_arrivals) of them.
    pub fn submit_single_write(
        &self,
        len: u64,
        imm: Option<u32>,
        src: (MrHandle, u64),
        dst: (&MrDesc, u64),
        on_done: impl Into<OnDone>,
    ) -> Result<()> {
        self.submit_single(Rdma::Write(imm), len, src, dst, on_done.into())
    }

    /// Writes pages of `page_len` bytes: source page `i` of `src` to destination page `i` of
    /// `dst`. Pages are spread over the NICs; each write carries `imm`.
    pub fn submit_paged_writes(
        &self,
        page_len: u64,
        imm: Option<u32>,
        src: (MrHandle, &Pages),
        dst: (&MrDesc, &Pages),
        on_done: impl Into<OnDone>,
    ) -> Result<()> {
        self.submit_paged(Rdma::Write(imm), page_len, src, dst, on_done.into())
    }

    /// Reads `len` bytes of a peer's region (descriptor, offset) into `local` (handle,
    /// offset); large reads stripe over the NICs like writes. `on_done` fires when the bytes
    /// are in local memory. There is no immediate: the peer is not told, and counts nothing.
    /// The peer's region must have been registered readable ([`RemoteAccess::READ`]);
    /// otherwise the read fails with `RemoteAccess` and nothing is read.
    pub fn submit_single_read(
        &self,
        len: u64,
        local: (MrHandle, u64),
        remote: (&MrDesc, u64),
        on_done: impl Into<OnDone>,
    ) -> Result<()> {
        self.check_reads()?;
        self.submit_single(Rdma::Read, len, local, remote, on_done.into())
    }

    /// Reads pages of `page_len` bytes: remote page `i` of `remote` into local page `i` of
    /// `local`, spread over the NICs (see [`submit_single_read`](Self::submit_single_read)).
    pub fn submit_paged_reads(
        &self,
        page_len: u64,
        local: (MrHandle, &Pages),
        remote: (&MrDesc, &Pages),
        on_done: impl Into<OnDone>,
    ) -> Result<()> {
        self.check_reads()?;
        self.submit_paged(Rdma::Read, page_len, local, remote, on_done.into())
    }

    /// Whether this engine's backend performs RDMA READ (plugins before ABI version 2, and
    /// backends that declare none, do not: reads fail with `NotAvailable`).
    pub fn supports_reads(&self) -> bool {
        self.reads
    }

    fn check_reads(&self) -> Result<()> {
        if self.reads {
            Ok(())
        } else {
            Err(Error::NotAvailable(format!(
                "backend {} does not support RDMA READ (a plugin built before ABI version 2, or a backend without reads)",
                self.shared.backend
            )))
        }
    }

    /// One contiguous write or read between a local and a remote range.
    fn submit_single(
        &self,
        op: Rdma,
        len: u64,
        local: (MrHandle, u64),
        remote: (&MrDesc, u64),
        on_done: OnDone,
    ) -> Result<()> {
        let region = self.local_region(local.0)?;
        check_range(op.local_side(), local.1, len, region.len)?;
        check_range(op.remote_side(), remote.1, len, remote.0.len())?;
        self.check_peer_nics(remote.0)?;
        let mut ops = Vec::with_capacity(1);
        let mut chunks = Vec::with_capacity(1);
        self.plan_unit(
            &mut ops,
            &mut chunks,
            self.first_nic(),
            &region,
            local.1,
            remote.0,
            remote.1,
            len,
            op.imm(),
            op == Rdma::Read,
        );
        self.shared.submit_counted(Command::Writes { ops, on_done })
    }

    /// Pages of `page_len` bytes: local page `i` with remote page `i`, spread over the NICs.
    fn submit_paged(
        &self,
        op: Rdma,
        page_len: u64,
        local: (MrHandle, &Pages),
        remote: (&MrDesc, &Pages),
        on_done: OnDone,
    ) -> Result<()> {
        let (local_pages, remote_pages) = (local.1, remote.1);
        if local_pages.indices.len() != remote_pages.indices.len() {
            return Err(Error::InvalidArgument(format!(
                "{} {} pages but {} {} pages",
                local_pages.indices.len(),
                op.local_side(),
                remote_pages.indices.len(),
                op.remote_side()
            )));
        }
        let region = self.local_region(local.0)?;
        self.check_peer_nics(remote.0)?;
        let overflow = |side| Error::OutOfBounds {
            side,
            offset: u64::MAX,
            len: page_len,
            region_len: 0,
        };
        let first = self.first_nic();
        let mut ops = Vec::with_capacity(local_pages.indices.len());
        let mut chunks = Vec::new();
        for i in 0..local_pages.indices.len() {
            let l = page_offset(local_pages, i).ok_or_else(|| overflow(op.local_side()))?;
            let r = page_offset(remote_pages, i).ok_or_else(|| overflow(op.remote_side()))?;
            check_range(op.local_side(), l, page_len, region.len)?;
            check_range(op.remote_side(), r, page_len, remote.0.len())?;
            self.plan_unit(
                &mut ops,
                &mut chunks,
                (first + i) % self.nic_count(),
                &region,
                l,
                remote.0,
                r,
                page_len,
                op.imm(),
                op == Rdma::Read,
            );
        }
        self.shared.submit_counted(Command::Writes { ops, on_done })
    }

    /// Registers a set of peers (by main address) that scatters and barriers may be checked
    /// against.
    pub fn add_peer_group(&self, addrs: Vec<NetAddr>) -> Result<PeerGroupHandle> {
        if addrs.is_empty() {
            return Err(Error::InvalidArgument(
                "a peer group needs at least one peer".into(),
            ));
        }
        let id = self.next_id.fetch_add(1, Ordering::Relaxed);
        self.peer_groups
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .insert(id, addrs.into_iter().collect());
        Ok(PeerGroupHandle {
            engine: self.id,
            id,
        })
    }

    fn check_group<'a>(
        &self,
        group: Option<PeerGroupHandle>,
        owners: impl Iterator<Item = &'a NetAddr>,
    ) -> Result<()> {
        let Some(group) = group else { return Ok(()) };
        self.check_owner("peer group", group.engine, group.id)?;
        let groups = self.peer_groups.lock().unwrap_or_else(|p| p.into_inner());
        let members = groups
            .get(&group.id)
            .ok_or(Error::UnknownPeerGroup(group.id))?;
        for owner in owners {
            if !members.contains(owner) {
                return Err(Error::InvalidArgument(format!(
                    "peer {owner} is not in peer group {}",
                    group.id
                )));
            }
        }
        Ok(())
    }

    /// Writes pieces of one source region to many destinations (any peers, any sizes).
    pub fn submit_scatter(
        &self,
        group: Option<PeerGroupHandle>,
        on_done: impl Into<OnDone>,
        imm: Option<u32>,
        src: MrHandle,
        dsts: &[ScatterDst],
    ) -> Result<()> {
        let region = self.local_region(src)?;
        self.check_group(group, dsts.iter().map(|d| d.dst.owner()))?;
        let first = self.first_nic();
        let mut ops = Vec::with_capacity(dsts.len());
        let mut chunks = Vec::new();
        for (j, d) in dsts.iter().enumerate() {
            check_range("source", d.src_offset, d.len, region.len)?;
            check_range("destination", d.dst_offset, d.len, d.dst.len())?;
            self.check_peer_nics(&d.dst)?;
            self.plan_unit(
                &mut ops,
                &mut chunks,
                (first + j) % self.nic_count(),
                &region,
                d.src_offset,
                &d.dst,
                d.dst_offset,
                d.len,
                imm,
                false,
            );
        }
        self.shared.submit_counted(Command::Writes {
            ops,
            on_done: on_done.into(),
        })
    }

    /// A zero-byte write carrying `imm` to each destination region's owner (one arrival each).
    pub fn submit_barrier(
        &self,
        group: Option<PeerGroupHandle>,
        on_done: impl Into<OnDone>,
        imm: u32,
        dsts: &[MrDesc],
    ) -> Result<()> {
        self.check_group(group, dsts.iter().map(MrDesc::owner))?;
        let first = self.first_nic();
        let mut ops = Vec::with_capacity(dsts.len());
        for (j, d) in dsts.iter().enumerate() {
            self.check_peer_nics(d)?;
            let nic = (first + j) % self.nic_count();
            let (peer, remote_key) = &d.rkeys()[nic];
            // Zero-byte writes still name a valid destination and key: EFA refuses them
            // otherwise, and a NIC checks the key even for no bytes.
            ops.push(WriteOp {
                read: false,
                nic,
                peer: peer.clone(),
                local_addr: 0,
                local_key: 0,
                remote_addr: d.ptr(),
                remote_key: *remote_key,
                remote_base: d.ptr(),
                len: 0,
                imm: Some(imm),
            });
        }
        self.shared.submit_counted(Command::Writes {
            ops,
            on_done: on_done.into(),
        })
    }

    /// Sends a message to a peer's main address; `data` is copied, the caller may reuse it.
    pub fn submit_send(
        &self,
        peer: &NetAddr,
        data: &[u8],
        on_done: impl Into<OnDone>,
    ) -> Result<()> {
        let max = self.shared.config.worker.max_message;
        if data.len() > max {
            return Err(Error::InvalidArgument(format!(
                "message of {} bytes is larger than worker.max_message ({max})",
                data.len()
            )));
        }
        self.shared.submit_counted(Command::Send {
            peer: peer.clone(),
            data: data.to_vec(),
            on_done: on_done.into(),
        })
    }

    /// Posts `count` receive buffers of `len` bytes; `handler` is called (on the callback
    /// thread) with each message, after which its buffer is posted again. One pool per engine.
    pub fn submit_recvs(
        &self,
        len: usize,
        count: usize,
        handler: impl Fn(&[u8]) + Send + Sync + 'static,
    ) -> Result<()> {
        if len == 0 || count == 0 {
            return Err(Error::InvalidArgument(
                "receive buffers need a non-zero length and count".into(),
            ));
        }
        if self
            .shared
            .recv_handler
            .set((len, Arc::new(handler)))
            .is_err()
        {
            return Err(Error::InvalidArgument(
                "this engine already has a receive pool".into(),
            ));
        }
        // Nothing is registered by the caller here, so a plain timeout is safe.
        self.control(|reply| Command::PostRecvs {
            buf_len: len,
            count,
            reply: Some(reply),
        })
    }

    /// An `OnDone` for a write (or paged write, scatter to one peer, read) that, once the
    /// transfer succeeded, sends the notification `id` to `peer` and then finishes `on_done`
    /// with the send's outcome; a failed transfer finishes `on_done` with its error and
    /// sends nothing. Pass it to any `submit_*`:
    ///
    /// ```ignore
    /// let done = engine.notify_when_done(dst.owner(), b"req-42", flag)?;
    /// engine.submit_paged_writes(page_len, None, (src, &sp), (&dst, &dp), done)?;
    /// ```
    ///
    /// **The peer sees the notification only after every byte of the transfer is in its
    /// memory**: the send is posted only after the transfer's completion, and a write
    /// completes at the sender only once the target's NIC has placed it (an RC ack on verbs;
    /// delivery-complete on libfabric; the mock completes after copying). The peer takes
    /// notifications with [`poll_notifications`](Self::poll_notifications) or
    /// [`wait_notification`](Self::wait_notification), after
    /// [`listen_notifications`](Self::listen_notifications). See ARCHITECTURE, "Notifications".
    pub fn notify_when_done(
        &self,
        peer: &NetAddr,
        id: &[u8],
        on_done: impl Into<OnDone>,
    ) -> Result<OnDone> {
        let message = crate::wire::encode_notification(id);
        let max = self.shared.config.worker.max_message;
        if message.len() > max {
            return Err(Error::InvalidArgument(format!(
                "a notification id of {} bytes does not fit a message of worker.max_message ({max}) bytes with its {}-byte tag",
                id.len(),
                crate::wire::NOTIFY_TAG.len()
            )));
        }
        let (peer, on_done) = (peer.clone(), on_done.into());
        let shared = Arc::downgrade(&self.shared);
        // This runs on the callback thread, so `on_done` is finished right here.
        Ok(OnDone::callback(move |result| {
            if let Err(e) = result {
                return on_done.complete_inline(Err(e));
            }
            let Some(s) = shared.upgrade() else {
                return on_done.complete_inline(Err(Error::Shutdown));
            };
            // The send's own completion finishes `on_done`; if it cannot even be queued,
            // `on_done` gets that error (and is never lost).
            let slot = Arc::new(Mutex::new(Some(on_done)));
            let take = |slot: &Mutex<Option<OnDone>>| {
                slot.lock().unwrap_or_else(|p| p.into_inner()).take()
            };
            let inner = Arc::clone(&slot);
            let queued = s.submit_counted(Command::Send {
                peer,
                data: message,
                on_done: OnDone::callback(move |r| {
                    if let Some(d) = take(&inner) {
                        d.complete_inline(r);
                    }
                }),
            });
            if let Err(e) = queued {
                if let Some(d) = take(&slot) {
                    d.complete_inline(Err(e));
                }
            }
        }))
    }

    /// Makes sure notifications can arrive: posts `count` receive buffers for them when the
    /// engine has no receive pool yet (messages that are not notifications are then logged
    /// and dropped); with a pool from [`submit_recvs`](Self::submit_recvs), notifications
    /// share it and this does nothing.
    pub fn listen_notifications(&self, count: usize) -> Result<()> {
        if self.shared.recv_handler.get().is_some() {
            return Ok(());
        }
        let len = (crate::wire::NOTIFY_TAG.len() + 256)
            .min(self.shared.config.worker.max_message.max(64));
        match self.submit_recvs(len, count, |m: &[u8]| {
            tracing::warn!("a message of {} bytes arrived at an engine that only listens for notifications; dropped", m.len());
        }) {
            // Raced with another listener or submit_recvs: a pool exists, which is enough.
            Err(Error::InvalidArgument(m)) if m.contains("already has a receive pool") => Ok(()),
            other => other,
        }
    }

    /// Takes every notification that arrived so far (ids, in arrival order).
    pub fn poll_notifications(&self) -> Vec<Vec<u8>> {
        self.shared
            .notifications
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .drain(..)
            .collect()
    }

    /// Takes the next notification, waiting up to `timeout` for one (`Err(Timeout)`).
    pub fn wait_notification(&self, timeout: Duration) -> Result<Vec<u8>> {
        // A timeout too large for the clock waits without end.
        let deadline = Instant::now().checked_add(timeout);
        let mut q = self
            .shared
            .notifications
            .lock()
            .unwrap_or_else(|p| p.into_inner());
        loop {
            if let Some(id) = q.pop_front() {
                return Ok(id);
            }
            if self.shared.is_closed() {
                return Err(Error::Shutdown);
            }
            let left = deadline.map_or(Duration::MAX, |d| {
                d.saturating_duration_since(Instant::now())
            });
            if left.is_zero() {
                return Err(Error::Timeout(timeout));
            }
            q = self
                .shared
                .notified
                .wait_timeout(q, left)
                .unwrap_or_else(|p| p.into_inner())
                .0;
        }
    }

    /// Calls `on_done` once `count` writes carrying `imm` have landed here (counting those
    /// that landed before this call), consuming them; fails with `Timeout` after
    /// `timeouts.expect_ms`.
    ///
    /// Expectations on one immediate are met in registration order. **An expectation that
    /// times out still owes its arrivals**: late arrivals of the transfer it waited for are
    /// absorbed when they land, never counted for a later expectation on the same immediate
    /// (which would then complete early, with none of its own data). If they never land (the
    /// sender's transfer failed), later expectations on that immediate time out too; once the
    /// peers agree that nothing more is in flight, [`reset_imm`](Self::reset_imm) clears it.
    pub fn expect_imm_count(&self, imm: u32, count: u64, on_done: impl Into<OnDone>) -> Result<()> {
        let deadline = Instant::now() + self.shared.config.timeouts.expect();
        let mut counter = self.shared.lock_imm();
        // Checked under the counter's lock: the worker sets it before draining expectations.
        if let Some(why) = self.shared.failed.get() {
            return Err(Error::WorkerFailed(why.clone()));
        }
        let ready = counter.expect(imm, count, deadline, on_done.into());
        drop(counter);
        match ready {
            Some(w) => w.complete(Ok(()), &self.shared.jobs),
            // The worker may be parked with a later deadline in mind.
            None => self.shared.wake(),
        }
        Ok(())
    }

    /// Mirrors the running total of `imm`'s arrivals (consumed or not) into `sink`, called on
    /// the worker thread after each batch in which some arrived (and once now). Keep it to a
    /// store: the typical sink is `GpuCounter::set`, so a GPU kernel can poll "all pages of
    /// layer k have arrived" in its own memory.
    pub fn mirror_imm_count(
        &self,
        imm: u32,
        sink: impl Fn(u64) + Send + Sync + 'static,
    ) -> Result<()> {
        let mirror = Mirror::new(sink);
        // Registered under the counter's lock, so no arrival slips between the first report
        // and the registration; reported after both locks are released (the sink is user
        // code). A racing report from the worker is ordered by the sink's own high-water mark.
        let total = {
            let mut counter = self.shared.lock_imm();
            let total = counter.track_total(imm);
            self.shared
                .mirrors
                .write()
                .unwrap_or_else(|p| p.into_inner())
                .entry(imm)
                .or_default()
                .push(Arc::clone(&mirror));
            self.shared.has_mirrors.store(true, Ordering::Release);
            total
        };
        mirror.report(imm, total);
        Ok(())
    }

    /// Arrivals of `imm` counted and not yet consumed by an expectation.
    pub fn imm_count(&self, imm: u32) -> u64 {
        self.shared.lock_imm().count(imm)
    }

    /// Arrivals of `imm` still owed to expectations that timed out (absorbed when they land).
    pub fn imm_owed(&self, imm: u32) -> u64 {
        self.shared.lock_imm().owed(imm)
    }

    /// Arrivals the ImmCounter dropped because its table of immediates nobody waited for was
    /// full (`worker.max_idle_imms`).
    pub fn imm_dropped(&self) -> u64 {
        self.shared.lock_imm().dropped()
    }

    /// Forgets `imm`'s unconsumed arrivals and what timed-out expectations still owe. Call it
    /// only once the peers agree that no write carrying `imm` is in flight (e.g. after a
    /// barrier on another immediate, or after the sender's transfers all finished): an
    /// arrival that lands after the reset counts for the next expectation. Waiting
    /// expectations keep waiting for new arrivals.
    pub fn reset_imm(&self, imm: u32) -> ResetReport {
        self.shared.lock_imm().reset(imm)
    }

    /// Transfers and sends accepted and not yet finished (bounded by
    /// `worker.max_outstanding`; past it, `submit_*` returns [`Error::Busy`]).
    pub fn outstanding(&self) -> usize {
        self.shared.outstanding.load(Ordering::Acquire)
    }

    /// Waits until fewer than `worker.max_outstanding` operations are outstanding, or
    /// `timeout` passes (`Err(Timeout)`). A submit may still get `Busy` if other threads
    /// submit in between.
    pub fn wait_for_capacity(&self, timeout: Duration) -> Result<()> {
        let limit = self.shared.config.worker.max_outstanding;
        let start = Instant::now();
        while self.outstanding() >= limit {
            if let Some(why) = self.shared.failed.get() {
                return Err(Error::WorkerFailed(why.clone()));
            }
            if start.elapsed() >= timeout {
                return Err(Error::Timeout(timeout));
            }
            std::thread::sleep(Duration::from_micros(50));
        }
        Ok(())
    }

    /// Allocates a watcher slot: a u64 that a producer (a GPU kernel through
    /// `Watcher::device_ptr`, or a CPU thread) bumps; `cb(old, new)` runs on the engine's
    /// pinned watcher thread at each change it sees (changes between two polls coalesce into
    /// one call; see the `uvm_watcher` crate). Return `Control::Stop` to free the slot. The
    /// callback may submit transfers: the typical use starts a layer's RDMA when the GPU
    /// signals the layer is computed.
    ///
    /// A callback that captures an `Arc` of this engine keeps it alive (engine → watcher pool
    /// → callback → engine) until it returns `Stop` or its slot is freed; use
    /// [`alloc_uvm_watcher_for`](Self::alloc_uvm_watcher_for) to be handed the engine instead.
    pub fn alloc_uvm_watcher(
        &self,
        cb: impl FnMut(u64, u64) -> uvm_watcher::Control + Send + 'static,
    ) -> Result<uvm_watcher::Watcher> {
        let pool = match self.watchers.get() {
            Some(p) => p,
            None => {
                let w = &self.shared.config.watcher;
                let pool = uvm_watcher::WatcherPool::new(uvm_watcher::PoolConfig {
                    cpu: w.cpu,
                    max_slots: w.max_slots,
                    memory: w.memory_choice().map_err(Error::InvalidArgument)?,
                    pass_interval_us: w.pass_interval_us,
                    ..uvm_watcher::PoolConfig::default()
                })?;
                // Another thread may have won the race; its pool is used and ours dropped.
                let _ = self.watchers.set(pool);
                self.watchers.get().expect("set above")
            }
        };
        Ok(pool.watch(cb)?)
    }

    /// Like [`alloc_uvm_watcher`](Self::alloc_uvm_watcher), but the callback is handed the
    /// engine (`cb(&engine, old, new)`) instead of capturing it: the slot holds the engine
    /// weakly, so dropping the caller's last `Arc` drops the engine (the slot then stops).
    pub fn alloc_uvm_watcher_for(
        self: &Arc<Self>,
        mut cb: impl FnMut(&Arc<TransferEngine>, u64, u64) -> uvm_watcher::Control + Send + 'static,
    ) -> Result<uvm_watcher::Watcher> {
        let weak = Arc::downgrade(self);
        self.alloc_uvm_watcher(move |old, new| match weak.upgrade() {
            Some(engine) => cb(&engine, old, new),
            None => uvm_watcher::Control::Stop,
        })
    }
}

impl TransferEngine {
    /// Stops the engine now, whoever else still holds it (a binding's `close()` while other
    /// threads are inside calls): the worker stops, the Domains close — so no NIC touches any
    /// registered memory once this returns — everything pending fails with
    /// [`Error::Shutdown`], waiters for notifications wake with it, and every later call
    /// fails with it. Dropping the engine does the same; calling it again does nothing.
    pub fn shutdown(&self) {
        self.shared.close();
        self.shared.push_shutdown();
        let me = std::thread::current().id();
        let worker = self.worker.lock().unwrap_or_else(|p| p.into_inner()).take();
        if let Some(w) = worker {
            // Called on the worker itself (a flag's waker): it ends when this returns.
            if w.thread().id() != me {
                let _ = w.join();
            }
        }
        {
            // Under the queue's lock: a waiter checks `closed` under it before it sleeps, so
            // this cannot fall between its check and its wait.
            let _queue = self
                .shared
                .notifications
                .lock()
                .unwrap_or_else(|p| p.into_inner());
            self.shared.notified.notify_all();
        }
        let _ = self.shared.jobs.send(None);
        let callbacks = self
            .callbacks
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .take();
        if let Some(c) = callbacks {
            // Called from inside a callback: that thread ends on its own after this job.
            if c.thread().id() != me {
                let _ = c.join();
            }
        }
    }
}

impl Drop for TransferEngine {
    fn drop(&mut self) {
        self.shutdown();
    }
}
