//! Threads and queues: the worker that drives one DomainGroup, and the callback thread.
//!
//! ```text
//!  caller threads ──submit──▶ SegQueue<Command> ──▶ worker ──post/poll──▶ Domains (NICs)
//!        ▲                     (lock-free,            │
//!        │                      unbounded)            ├─ flags/counters: set directly
//!        └────── callbacks ◀── callback thread ◀──────┘  callbacks: crossbeam channel
//! ```
//! Both queues are unbounded, so a callback that submits new work can never deadlock against
//! a full queue: no cycle of bounded queues exists.

mod callbacks;
pub(crate) mod completion;
mod tracker;
mod worker;

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex, OnceLock};
use std::thread::Thread;

use crossbeam_channel::Sender;
use crossbeam_queue::SegQueue;

use crate::config::Config;
use crate::domain::{MemoryRegion, Registration};
use crate::error::{Error, Result};
use crate::imm::ImmCounter;
use crate::wire::NetAddr;
use completion::{Job, OnDone};

pub(crate) use callbacks::spawn_callback_thread;
pub(crate) use worker::spawn_worker;

/// Receives an immediate's running total of arrivals; see `TransferEngine::mirror_imm_count`.
pub(crate) type Mirror = Arc<dyn Fn(u64) + Send + Sync>;

/// Handles incoming messages; see `TransferEngine::submit_recvs`.
pub(crate) type RecvHandler = Arc<dyn Fn(&[u8]) + Send + Sync>;

/// One write, resolved to a NIC, its keys and the peer's address on that NIC.
#[derive(Debug, Clone)]
pub(crate) struct WriteOp {
    pub(crate) nic: usize,
    pub(crate) peer: NetAddr,
    pub(crate) local_addr: u64,
    pub(crate) local_key: u64,
    pub(crate) remote_addr: u64,
    pub(crate) remote_key: u64,
    pub(crate) remote_base: u64,
    pub(crate) len: u64,
    pub(crate) imm: Option<u32>,
}

/// What callers ask of the worker.
pub(crate) enum Command {
    /// A transfer made of writes; finishes when all have.
    Writes { ops: Vec<WriteOp>, on_done: OnDone },
    /// A message to a peer's main address.
    Send {
        peer: NetAddr,
        data: Vec<u8>,
        on_done: OnDone,
    },
    /// Register with every NIC; reply with one registration per NIC.
    Register {
        region: MemoryRegion,
        reply: Sender<Result<Vec<Registration>>>,
    },
    /// Deregister one local key per NIC.
    Deregister {
        keys: Vec<u64>,
        reply: Sender<Result<()>>,
    },
    /// Add receive buffers on the main NIC.
    PostRecvs { buf_len: usize, count: usize },
    /// Fail what is in flight and stop.
    Shutdown,
}

/// State shared by the engine's handle, its worker and its callback thread.
pub(crate) struct Shared {
    pub(crate) config: Config,
    pub(crate) backend: String,
    queue: SegQueue<Command>,
    worker: OnceLock<Thread>,
    pub(crate) imm: Mutex<ImmCounter<OnDone>>,
    pub(crate) jobs: Sender<Job>,
    pub(crate) recv_handler: OnceLock<(usize, RecvHandler)>,
    closed: AtomicBool,
    /// Set by the worker just before it parks; wakers unpark only then.
    pub(crate) parked: AtomicBool,
    /// Mirrors of immediates' totals, and whether there are any (checked per batch).
    pub(crate) mirrors: std::sync::RwLock<std::collections::HashMap<u32, Vec<Mirror>>>,
    pub(crate) has_mirrors: AtomicBool,
}

impl Shared {
    pub(crate) fn new(config: Config, backend: String, jobs: Sender<Job>) -> Self {
        Self {
            config,
            backend,
            queue: SegQueue::new(),
            worker: OnceLock::new(),
            imm: Mutex::new(ImmCounter::new()),
            jobs,
            recv_handler: OnceLock::new(),
            closed: AtomicBool::new(false),
            parked: AtomicBool::new(false),
            mirrors: std::sync::RwLock::new(std::collections::HashMap::new()),
            has_mirrors: AtomicBool::new(false),
        }
    }

    /// Queues a command for the worker and wakes it.
    pub(crate) fn submit(&self, cmd: Command) -> Result<()> {
        if self.closed.load(Ordering::Acquire) {
            return Err(Error::Shutdown);
        }
        self.queue.push(cmd);
        self.wake();
        Ok(())
    }

    /// Refuses further submissions (the engine is being dropped).
    pub(crate) fn close(&self) {
        self.closed.store(true, Ordering::Release);
    }

    /// Wakes the worker if it parked. The worker announces `parked` and then checks the queue
    /// and its Domains once more before parking (both sides use `SeqCst`), so either it sees
    /// the new work or this sees `parked`: no wake-up is lost, and a busy worker costs
    /// submitters one shared load instead of an atomic swap.
    pub(crate) fn wake(&self) {
        if self.parked.load(Ordering::SeqCst) {
            if let Some(t) = self.worker.get() {
                t.unpark();
            }
        }
    }

    pub(crate) fn lock_imm(&self) -> std::sync::MutexGuard<'_, ImmCounter<OnDone>> {
        // A panic while holding this lock cannot leave the counter half-updated (every
        // method finishes its own bookkeeping before returning), so poisoning is ignored.
        self.imm.lock().unwrap_or_else(|p| p.into_inner())
    }
}
