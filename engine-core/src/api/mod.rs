//! [`TransferEngine`]: the surface users call. Everything that can be checked locally is checked
//! here, on the caller's thread, before anything is queued; the outcome on the wire arrives
//! through [`OnDone`].

use std::collections::{HashMap, HashSet};
use std::sync::atomic::{AtomicU32, AtomicU64, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex, RwLock};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use crate::config::{Config, NicSelection};
use crate::domain::{Device, MemoryRegion, RdmaOp, Registration};
use crate::error::{Error, Result};
use crate::group::SpreadPolicy;
use crate::imm::ResetReport;
use crate::plan::{Chunk, TransferShape};
use crate::plugin::find_backend;
use crate::runtime::completion::{DoneCounter, DoneFlag, OnDone};
use crate::runtime::{
    spawn_callback_thread, spawn_worker, Command, Mirror, Ops, PagedWork, RdmaWork, Shared,
};
use crate::wire::{MrDesc, NetAddr};

mod immediates;
mod memory;
mod messages;
mod request;
mod transfers;
mod watchers;

use memory::LocalRegion;
pub use request::Request;

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

/// What peers may do to a registered region.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, serde::Serialize, serde::Deserialize)]
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
    pub(crate) shared: Arc<Shared>,
    addresses: Vec<NetAddr>,
    regions: RwLock<foldhash::HashMap<u64, Arc<LocalRegion>>>,
    peer_groups: Mutex<HashMap<u64, HashSet<NetAddr>>>,
    next_id: AtomicU64,
    next_first_nic: AtomicUsize,
    watchers: std::sync::OnceLock<uvm_watcher::WatcherPool>,
    /// Taken (and joined) by the first `shutdown`.
    worker: Mutex<Option<JoinHandle<()>>>,
    callbacks: Mutex<Option<JoinHandle<()>>>,
    /// The `[metrics] listen` endpoint, if configured; stopped by `shutdown`.
    metrics: Mutex<Option<crate::metrics::Endpoint>>,
}

impl std::fmt::Debug for TransferEngine {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("TransferEngine")
            .field("backend", &self.shared.backend)
            .field("addresses", &self.addresses)
            .finish_non_exhaustive()
    }
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
        // The cluster secret is resolved once (the config's, else $XFER_SECRET_FILE's: one file
        // keys the rendezvous and the handshake), and this engine keeps to it.
        let mut resolved = config.clone();
        resolved.security.secret_file = config.secret_file().map_err(|m| {
            Error::Config(crate::config::ConfigError::Invalid {
                file: config.source.clone(),
                message: m,
            })
        })?;
        let config = &resolved;
        let backend = find_backend(&config.backend, config.plugin.as_deref())?;
        // A plugin's options are checked here, as a linked backend's were by `validate`: a
        // mistyped key is refused by name before any NIC opens.
        backend
            .check_plugin_options(&config.backend_options())
            .map_err(|why| {
                Error::Config(crate::config::ConfigError::Invalid {
                    file: config.source.clone(),
                    message: format!("[backends.{}] {why}", config.backend),
                })
            })?;
        let thread_error = |e: std::io::Error| {
            Error::backend_io(&config.backend, "cannot spawn the callback thread", &e)
        };
        let (jobs, callbacks) =
            spawn_callback_thread(format!("xfer-callbacks-{group}")).map_err(thread_error)?;
        let shared = Arc::new(Shared::new(config.clone(), backend.name().to_owned(), jobs));
        shared
            .notifications
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .share(config.worker.max_notifications_per_peer);
        let worker = match spawn_worker(Arc::clone(&shared), backend, group) {
            Ok(w) => w,
            Err(e) => {
                let _ = shared.jobs.send(None);
                let _ = callbacks.join();
                return Err(e);
            }
        };
        let metrics = match &config.metrics.listen {
            Some(listen) => {
                match crate::metrics::Endpoint::start(listen, Arc::downgrade(&shared)) {
                    Ok(m) => Some(m),
                    Err(e) => {
                        shared.close();
                        shared.push_shutdown();
                        let _ = worker.thread.join();
                        let _ = shared.jobs.send(None);
                        let _ = callbacks.join();
                        return Err(e);
                    }
                }
            }
            None => None,
        };
        Ok(Self {
            metrics: Mutex::new(metrics),
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

    /// The file of the cluster secret this engine's backend was given (`[security]
    /// secret_file`, else `$XFER_SECRET_FILE` as it was when the engine opened), or `None`:
    /// the verbs handshake is then unauthenticated. Components that secure their rendezvous
    /// with a secret compare it with theirs, so a half-secured set-up is refused by name.
    pub fn secret_file(&self) -> Option<&std::path::Path> {
        self.shared.config.security.secret_file.as_deref()
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
    pub(super) fn control<T>(
        &self,
        what: &'static str,
        make: impl FnOnce(crossbeam_channel::Sender<Result<T>>) -> Command,
    ) -> Result<T> {
        self.shared.check_not_on_worker(what)?;
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
    pub(super) fn control_until_done<T>(
        &self,
        what: &'static str,
        make: impl FnOnce(crossbeam_channel::Sender<Result<T>>) -> Command,
    ) -> Result<T> {
        self.shared.check_not_on_worker(what)?;
        let (tx, rx) = crossbeam_channel::bounded(1);
        self.shared.submit(make(tx))?;
        let step = self.shared.config.timeouts.control();
        let start = Instant::now();
        loop {
            match rx.recv_timeout(step) {
                Ok(result) => return result,
                // Queued after the worker's last drain (it raced a shutdown): nobody will
                // answer, and the Domains are closed.
                Err(crossbeam_channel::RecvTimeoutError::Timeout)
                    if self.shared.domains_are_closed() =>
                {
                    return Err(self.gone())
                }
                Err(crossbeam_channel::RecvTimeoutError::Timeout) => tracing::warn!(
                    waited_ms = start.elapsed().as_millis() as u64,
                    "{what} is still waiting for the worker"
                ),
                Err(crossbeam_channel::RecvTimeoutError::Disconnected) => return Err(self.gone()),
            }
        }
    }

    pub(super) fn gone(&self) -> Error {
        match self.shared.failed.get() {
            Some(why) => Error::WorkerFailed(why.clone()),
            None => Error::Shutdown,
        }
    }

    /// Transfers and sends accepted and not yet finished (bounded by
    /// `worker.max_outstanding`; past it, `submit_*` returns [`Error::Busy`]).
    pub fn outstanding(&self) -> usize {
        self.shared.outstanding.load(Ordering::Acquire)
    }

    /// A snapshot of the engine's counters ([`Stats`](crate::Stats)): operations, bytes,
    /// errors by kind and latency histograms per kind of operation, per-peer traffic and
    /// failures, stale completions, immediates, notifications and registrations. One round
    /// trip to the worker, which keeps the counters as plain integers (counting costs the
    /// data path no shared atomics). Fails only if the worker does not answer within
    /// `[timeouts] control_ms`.
    pub fn stats(&self) -> Result<crate::Stats> {
        self.shared.stats()
    }

    /// The peers this engine has sent work to, by address, with their health: whether the
    /// last operation to each alone that finished succeeded (if not, `last_error` says why:
    /// a dead peer says `peer unreachable …`), how long ago one last finished, and its
    /// traffic. One round trip to the worker, like [`stats`](Self::stats).
    pub fn peers(&self) -> Result<Vec<(NetAddr, crate::stats::PeerStats)>> {
        let mut peers: Vec<_> = self.shared.stats()?.peers.into_iter().collect();
        peers.sort_by(|a, b| a.0.cmp(&b.0));
        Ok(peers)
    }

    /// Wraps `on_done` so that its transfer can be watched and cancelled: pass the returned
    /// `OnDone` to any `submit_*` (or `notify_when_done`'s result), keep the handle for
    /// [`status`](crate::TransferHandle::status) and [`cancel`](crate::TransferHandle::cancel).
    pub fn cancellable(&self, on_done: impl Into<OnDone>) -> (crate::TransferHandle, OnDone) {
        let (handle, control) = crate::TransferHandle::new(&self.shared);
        (
            handle,
            OnDone::Controlled(control, Box::new(on_done.into())),
        )
    }

    /// Where the `[metrics] listen` endpoint serves `/metrics` (useful with port 0).
    pub fn metrics_address(&self) -> Option<std::net::SocketAddr> {
        self.metrics
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .as_ref()
            .and_then(|m| m.addr())
    }

    /// Waits for `flag` to be set (at most `timeout`) and returns its outcome, as
    /// [`DoneFlag::wait`] does — but looking without sleeping at first, for up to
    /// `worker.wait_poll_us` (yielding between looks), so that an outcome the worker delivers
    /// soon costs this thread no wake-up. The worker makes every pass; nothing runs on this
    /// thread but the looks. On the worker's own thread (inside a waker) it fails with
    /// [`Error::OnWorkerThread`] unless the flag is set already.
    pub fn wait(&self, flag: &DoneFlag, timeout: Duration) -> Result<()> {
        if !flag.is_done() {
            self.shared.check_not_on_worker("TransferEngine::wait")?;
        }
        let start = Instant::now();
        self.shared.poll_until(timeout, || flag.is_done());
        flag.wait(timeout.saturating_sub(start.elapsed()))
    }

    /// What [`wait`](Self::wait) does before it sleeps, for callers with a sleep of their
    /// own (a binding's, which must also look for signals): looks at `done()` without
    /// sleeping until it says yes or for `limit` (at most `worker.wait_poll_us`). Returns
    /// `done()`'s last answer; when it is `false`, the worker is left to wake the caller's
    /// sleep. A `done` that panics unwinds into the caller, never into the engine.
    pub fn drive_until(&self, limit: Duration, done: impl FnMut() -> bool) -> bool {
        self.shared.poll_until(limit, done)
    }

    /// [`wait`](Self::wait) for `counter` to count `n` outcomes (as
    /// [`DoneCounter::wait_for`]).
    pub fn wait_for(&self, counter: &DoneCounter, n: u64, timeout: Duration) -> Result<()> {
        if counter.finished() < n {
            self.shared
                .check_not_on_worker("TransferEngine::wait_for")?;
        }
        let start = Instant::now();
        self.shared.poll_until(timeout, || counter.finished() >= n);
        counter.wait_for(n, timeout.saturating_sub(start.elapsed()))
    }

    /// Waits until fewer than `worker.max_outstanding` operations are outstanding, or
    /// `timeout` passes (`Err(Timeout)`). A submit may still get `Busy` if other threads
    /// submit in between.
    pub fn wait_for_capacity(&self, timeout: Duration) -> Result<()> {
        let limit = self.shared.config.worker.max_outstanding;
        let start = Instant::now();
        if self.outstanding() >= limit {
            // Only the worker frees capacity.
            self.shared.check_not_on_worker("wait_for_capacity")?;
        }
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
}

impl TransferEngine {
    /// Whether a Domain panicked while the engine closed it and was abandoned: its NIC may
    /// then still hold registrations, and memory registered with this engine must never be
    /// freed (deregistrations from then on keep it and fail). Bindings that free memory after
    /// a close ask this first.
    pub fn domains_abandoned(&self) -> bool {
        self.shared.domains_abandoned()
    }

    /// Stops the engine now, whoever else still holds it (a binding's `close()` while other
    /// threads are inside calls): the worker stops, the Domains close — so no NIC touches any
    /// registered memory once this returns — everything pending fails with
    /// [`Error::Shutdown`], waiters for notifications wake with it, and every later call
    /// fails with it. Dropping the engine does the same; calling it again does nothing.
    pub fn shutdown(&self) {
        drop(
            self.metrics
                .lock()
                .unwrap_or_else(|p| p.into_inner())
                .take(),
        );
        self.shared.close();
        self.shared.push_shutdown();
        // Notification waiters first: one may be what the worker waits for (its waker's
        // lock), and they need nothing more from the worker to learn of the shutdown.
        self.wake_notification_waiters();
        let me = std::thread::current().id();
        let on_worker = self.shared.on_worker_thread();
        let worker = self.worker.lock().unwrap_or_else(|p| p.into_inner()).take();
        if let Some(w) = worker {
            // Called on the worker itself (a flag's waker, a mirror sink): it ends when the
            // pass it is in returns, closing the Domains then.
            if w.thread().id() != me {
                let _ = w.join();
            }
        }
        self.wake_notification_waiters();
        // On the worker, the pass this waker runs in may still hand the callback thread a
        // batch (the callbacks of this very delivery): no end marker before it. The thread
        // ends once the engine's last holder lets go (its channel disconnects).
        if !on_worker {
            let _ = self.shared.jobs.send(None);
        }
        let callbacks = self
            .callbacks
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .take();
        if let Some(c) = callbacks {
            // Called from inside a callback: that thread ends on its own after this job. On
            // the worker: not joined either — a callback may be waiting for the worker (a
            // `dereg_mr` during the shutdown waits for its Domains to close), and the thread
            // ends once the engine's last holder lets go.
            if c.thread().id() != me && !on_worker {
                let _ = c.join();
            }
        }
    }

    /// Wakes threads waiting for notifications (they see the engine closed).
    fn wake_notification_waiters(&self) {
        // Under the queue's lock: a waiter checks `closed` under it before it sleeps, so
        // this cannot fall between its check and its wait.
        let _queue = self
            .shared
            .notifications
            .lock()
            .unwrap_or_else(|p| p.into_inner());
        self.shared.notified.notify_all();
    }
}

impl Drop for TransferEngine {
    fn drop(&mut self) {
        self.shutdown();
    }
}
