//! The pool: slot bookkeeping shared with handles, and the polling thread.

use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::thread::JoinHandle;

use crate::memory::{Block, MemoryKind, SLOTS_PER_BLOCK};
use crate::WatcherError;

/// What a callback asks for next.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Control {
    /// Keep watching.
    Continue,
    /// Free the slot.
    Stop,
}

type Callback = Box<dyn FnMut(u64, u64) -> Control + Send>;

/// Which memory a pool's slots use.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum MemoryChoice {
    /// Device-mapped memory when a CUDA driver and device are present, else host memory
    /// (logged once).
    Auto,
    /// Host memory, always.
    Host,
    /// Device-mapped memory, or an error saying why not.
    DeviceMapped,
}

/// How a pool is set up.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct PoolConfig {
    /// CPU to pin the polling thread to.
    pub cpu: Option<usize>,
    /// Most slots (rounded up to whole blocks of 512).
    pub max_slots: usize,
    /// Which memory.
    pub memory: MemoryChoice,
    /// The CUDA device whose address space device-mapped slots appear in.
    pub cuda_device: i32,
}

impl Default for PoolConfig {
    fn default() -> Self {
        Self {
            cpu: None,
            max_slots: 4 * SLOTS_PER_BLOCK,
            memory: MemoryChoice::Auto,
            cuda_device: 0,
        }
    }
}

/// What handles ask of the poller, which alone owns the callbacks (so a callback may create
/// or drop watchers without deadlocking).
enum Command {
    Watch {
        index: usize,
        generation: u64,
        callback: Callback,
    },
    Unwatch {
        index: usize,
        generation: u64,
    },
}

struct Shared {
    blocks: Mutex<Vec<Arc<Block>>>,
    /// Slots created so far (free or not).
    created: Mutex<usize>,
    free: Mutex<Vec<usize>>,
    commands: Mutex<Vec<Command>>,
    next_generation: AtomicU64,
    active: AtomicU64,
    stop: AtomicBool,
    max_slots: usize,
    poller: Mutex<Option<std::thread::Thread>>,
    /// Set when slots are device-mapped.
    cuda: Option<Arc<crate::cuda::Cuda>>,
}

impl Shared {
    fn command(&self, cmd: Command) {
        self.commands
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .push(cmd);
        if let Some(t) = &*self.poller.lock().unwrap_or_else(|p| p.into_inner()) {
            t.unpark();
        }
    }
}

/// One polling thread and the slots it watches.
pub struct WatcherPool {
    shared: Arc<Shared>,
    thread: Option<JoinHandle<()>>,
}

impl std::fmt::Debug for WatcherPool {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("WatcherPool")
            .field("active", &self.shared.active.load(Ordering::Relaxed))
            .finish()
    }
}

/// A watched slot. Dropping it frees the slot (unless its callback already did).
pub struct Watcher {
    shared: Arc<Shared>,
    block: Arc<Block>,
    index: usize,
    generation: u64,
}

impl std::fmt::Debug for Watcher {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Watcher")
            .field("slot", &self.index)
            .field("value", &self.value())
            .finish()
    }
}

impl Watcher {
    fn cell(&self) -> &AtomicU64 {
        self.block.slot(self.index % SLOTS_PER_BLOCK)
    }

    /// The slot's index in the pool.
    pub fn slot(&self) -> usize {
        self.index
    }

    /// The host address of the slot, for producers that write it directly.
    pub fn host_ptr(&self) -> *mut u64 {
        self.cell().as_ptr()
    }

    /// The address a GPU kernel writes, when the slot is device-mapped memory.
    pub fn device_ptr(&self) -> Option<u64> {
        self.block.device_ptr(self.index % SLOTS_PER_BLOCK)
    }

    /// What backs the slot.
    pub fn memory(&self) -> MemoryKind {
        self.block.kind()
    }

    /// The slot's current value.
    pub fn value(&self) -> u64 {
        self.cell().load(Ordering::Acquire)
    }

    /// Sets the slot (a CPU producer).
    pub fn store(&self, value: u64) {
        self.cell().store(value, Ordering::Release);
    }

    /// Adds to the slot (a CPU producer bumping a counter); returns the new value.
    pub fn add(&self, delta: u64) -> u64 {
        self.cell().fetch_add(delta, Ordering::AcqRel) + delta
    }

    /// Frees the slot now.
    pub fn free(self) {}
}

impl Drop for Watcher {
    fn drop(&mut self) {
        // The generation makes this a no-op if the callback already freed the slot and it was
        // handed to another watcher since.
        self.shared.command(Command::Unwatch {
            index: self.index,
            generation: self.generation,
        });
    }
}

impl WatcherPool {
    /// Starts the polling thread (pinned if `config.cpu` is set).
    pub fn new(config: PoolConfig) -> Result<Self, WatcherError> {
        let cuda = match config.memory {
            MemoryChoice::Host => None,
            MemoryChoice::DeviceMapped => Some(Arc::new(
                crate::cuda::Cuda::open(config.cuda_device).map_err(WatcherError::Memory)?,
            )),
            MemoryChoice::Auto => match crate::cuda::Cuda::open(config.cuda_device) {
                Ok(c) => Some(Arc::new(c)),
                Err(why) => {
                    tracing::info!("uvm-watcher: slots in host memory ({why})");
                    None
                }
            },
        };
        let shared = Arc::new(Shared {
            blocks: Mutex::new(Vec::new()),
            created: Mutex::new(0),
            free: Mutex::new(Vec::new()),
            commands: Mutex::new(Vec::new()),
            next_generation: AtomicU64::new(1),
            active: AtomicU64::new(0),
            stop: AtomicBool::new(false),
            max_slots: config.max_slots.div_ceil(SLOTS_PER_BLOCK).max(1) * SLOTS_PER_BLOCK,
            poller: Mutex::new(None),
            cuda,
        });
        let (ready_tx, ready_rx) = std::sync::mpsc::channel();
        let s = Arc::clone(&shared);
        let thread = std::thread::Builder::new()
            .name("xfer-uvm-watcher".into())
            .spawn(move || {
                if let Some(cpu) = config.cpu {
                    if !core_affinity::set_for_current(core_affinity::CoreId { id: cpu }) {
                        let _ = ready_tx.send(Err(WatcherError::Thread(format!(
                            "cannot pin to CPU {cpu}"
                        ))));
                        return;
                    }
                }
                let _ = ready_tx.send(Ok(()));
                poll_loop(&s);
            })
            .map_err(|e| WatcherError::Thread(e.to_string()))?;
        *shared.poller.lock().unwrap_or_else(|p| p.into_inner()) = Some(thread.thread().clone());
        ready_rx
            .recv()
            .map_err(|e| WatcherError::Thread(e.to_string()))??;
        Ok(Self {
            shared,
            thread: Some(thread),
        })
    }

    /// Watches a new slot (starting at 0): `callback(old, new)` runs on the polling thread
    /// at each change it sees. Keep it short; it may submit transfers.
    pub fn watch(
        &self,
        callback: impl FnMut(u64, u64) -> Control + Send + 'static,
    ) -> Result<Watcher, WatcherError> {
        let index = self.take_slot()?;
        let block = Arc::clone(
            &self.shared.blocks.lock().unwrap_or_else(|p| p.into_inner())[index / SLOTS_PER_BLOCK],
        );
        block
            .slot(index % SLOTS_PER_BLOCK)
            .store(0, Ordering::Release);
        let generation = self.shared.next_generation.fetch_add(1, Ordering::Relaxed);
        self.shared.active.fetch_add(1, Ordering::AcqRel);
        self.shared.command(Command::Watch {
            index,
            generation,
            callback: Box::new(callback),
        });
        Ok(Watcher {
            shared: Arc::clone(&self.shared),
            block,
            index,
            generation,
        })
    }

    /// Slots being watched.
    pub fn active(&self) -> usize {
        self.shared.active.load(Ordering::Acquire) as usize
    }

    fn take_slot(&self) -> Result<usize, WatcherError> {
        if let Some(i) = self
            .shared
            .free
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .pop()
        {
            return Ok(i);
        }
        let mut blocks = self.shared.blocks.lock().unwrap_or_else(|p| p.into_inner());
        let mut created = self
            .shared
            .created
            .lock()
            .unwrap_or_else(|p| p.into_inner());
        if *created >= self.shared.max_slots {
            return Err(WatcherError::Full(self.shared.max_slots));
        }
        let block = match &self.shared.cuda {
            Some(cuda) => Block::mapped(cuda).map_err(WatcherError::Memory)?,
            None => Block::host(),
        };
        blocks.push(Arc::new(block));
        let first = *created;
        *created += SLOTS_PER_BLOCK;
        // Hand out the first new slot; the rest go on the free list (lowest first).
        self.shared
            .free
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .extend((first + 1..first + SLOTS_PER_BLOCK).rev());
        Ok(first)
    }
}

impl Drop for WatcherPool {
    fn drop(&mut self) {
        self.shared.stop.store(true, Ordering::Release);
        if let Some(t) = self.thread.take() {
            t.thread().unpark();
            // Dropped by one of its own callbacks (the last reference to an engine went on
            // the watcher thread): it cannot join itself; it ends when that callback returns.
            if t.thread().id() != std::thread::current().id() {
                let _ = t.join();
            }
        }
    }
}

/// A slot the poller watches.
struct Watch {
    generation: u64,
    callback: Callback,
    last: u64,
    cell: (Arc<Block>, usize),
}

/// Reads every watched slot; calls back on changes; parks when nothing is watched.
fn poll_loop(shared: &Shared) {
    let mut watches: Vec<Option<Watch>> = Vec::new();
    let mut rounds = 0u32;
    let mut freed = Vec::new();
    while !shared.stop.load(Ordering::Acquire) {
        let commands =
            std::mem::take(&mut *shared.commands.lock().unwrap_or_else(|p| p.into_inner()));
        for cmd in commands {
            match cmd {
                Command::Watch {
                    index,
                    generation,
                    callback,
                } => {
                    if watches.len() <= index {
                        watches.resize_with(index + 1, || None);
                    }
                    let block = Arc::clone(
                        &shared.blocks.lock().unwrap_or_else(|p| p.into_inner())
                            [index / SLOTS_PER_BLOCK],
                    );
                    watches[index] = Some(Watch {
                        generation,
                        callback,
                        last: 0,
                        cell: (block, index % SLOTS_PER_BLOCK),
                    });
                }
                Command::Unwatch { index, generation } => {
                    if watches
                        .get(index)
                        .and_then(Option::as_ref)
                        .is_some_and(|w| w.generation == generation)
                    {
                        watches[index] = None;
                        freed.push(index);
                    }
                }
            }
        }
        for (i, slot) in watches.iter_mut().enumerate() {
            let Some(w) = slot else { continue };
            let now = w.cell.0.slot(w.cell.1).load(Ordering::Acquire);
            if now == w.last {
                continue;
            }
            let old = std::mem::replace(&mut w.last, now);
            let outcome =
                std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| (w.callback)(old, now)));
            if !matches!(outcome, Ok(Control::Continue)) {
                if outcome.is_err() {
                    tracing::error!(slot = i, "a watcher callback panicked; its slot is freed");
                }
                *slot = None;
                freed.push(i);
            }
        }
        if !freed.is_empty() {
            shared
                .active
                .fetch_sub(freed.len() as u64, Ordering::AcqRel);
            shared
                .free
                .lock()
                .unwrap_or_else(|p| p.into_inner())
                .append(&mut freed);
        }
        if shared.active.load(Ordering::Acquire) == 0
            && shared
                .commands
                .lock()
                .unwrap_or_else(|p| p.into_inner())
                .is_empty()
        {
            // Nothing to watch: sleep until a handle unparks us (or shutdown).
            std::thread::park_timeout(std::time::Duration::from_millis(100));
            continue;
        }
        rounds = rounds.wrapping_add(1);
        // Spin, but give the CPU away now and then so a small machine is not starved.
        if rounds % 256 == 0 {
            std::thread::yield_now();
        } else {
            std::hint::spin_loop();
        }
    }
}
