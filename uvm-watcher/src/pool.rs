//! The pool: slot bookkeeping shared with handles, and the polling thread.

use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::thread::JoinHandle;

use crate::memory::{changed, Block, MemoryKind, SLOTS_PER_BLOCK};
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

/// Which memory a pool's slots use (see the `memory` module for what each costs).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum MemoryChoice {
    /// GPU memory through GDRCopy when `libgdrapi` and the `gdrdrv` device are present, else
    /// device-mapped memory when a CUDA driver and device are, else host memory; the choice
    /// and the reasons are logged.
    Auto,
    /// Host memory, always.
    Host,
    /// Device-mapped memory, or an error saying why not.
    DeviceMapped,
    /// GPU memory polled through GDRCopy, or an error saying why not (no driver, no
    /// `gdrdrv`, pinning failed) — never a silent fallback.
    GpuGdrcopy,
}

impl MemoryChoice {
    /// Parses a config value: `auto`, `host`, `device_mapped` or `gpu_gdrcopy`.
    pub fn parse(text: &str) -> Result<Self, String> {
        match text {
            "auto" => Ok(Self::Auto),
            "host" => Ok(Self::Host),
            "device_mapped" => Ok(Self::DeviceMapped),
            "gpu_gdrcopy" => Ok(Self::GpuGdrcopy),
            other => Err(format!(
                "unknown watcher memory {other:?}: auto, host, device_mapped or gpu_gdrcopy"
            )),
        }
    }
}

/// Where new blocks come from.
#[derive(Clone)]
enum Source {
    Host,
    Mapped(Arc<xfer_cuda::Cuda>),
    Gdr(Arc<gdrcopy_sys::Gdr>, u32),
}

impl Source {
    fn kind(&self) -> MemoryKind {
        match self {
            Self::Host => MemoryKind::Host,
            Self::Mapped(_) => MemoryKind::DeviceMapped,
            Self::Gdr(..) => MemoryKind::GpuGdrcopy,
        }
    }

    fn block(&self) -> Result<Block, String> {
        match self {
            Self::Host => Ok(Block::host()),
            Self::Mapped(cuda) => Block::mapped(cuda),
            Self::Gdr(gdr, device) => Block::gdr(gdr, *device),
        }
    }

    /// What `choice` gives on this machine, or why it cannot be had. For `Auto`, the reasons
    /// the better kinds were passed over come back too. One block is allocated and dropped to
    /// prove the kind works (pinning can fail where the library loads).
    fn choose(choice: MemoryChoice, device: i32) -> Result<(Self, Vec<String>), String> {
        let gdr = || -> Result<Self, String> {
            let index = u32::try_from(device).map_err(|_| format!("CUDA device {device}"))?;
            if !crate::cuda_driver_present() {
                return Err("no CUDA driver library (libcuda.so) on this machine".into());
            }
            let source = Self::Gdr(Arc::new(gdrcopy_sys::Gdr::open()?), index);
            source
                .block()
                .map_err(|e| format!("pinning GPU memory with GDRCopy: {e}"))?;
            Ok(source)
        };
        // As for GDRCopy, a block is allocated (and freed) to prove the kind works: a driver
        // that opens but cannot allocate mapped memory would fail every later watch.
        let mapped = || -> Result<Self, String> {
            let source = Self::Mapped(Arc::new(xfer_cuda::Cuda::open(device)?));
            source
                .block()
                .map_err(|e| format!("allocating device-mapped memory: {e}"))?;
            Ok(source)
        };
        match choice {
            MemoryChoice::Host => Ok((Self::Host, Vec::new())),
            MemoryChoice::DeviceMapped => mapped().map(|s| (s, Vec::new())),
            MemoryChoice::GpuGdrcopy => gdr().map(|s| (s, Vec::new())),
            MemoryChoice::Auto => {
                let mut passed = Vec::new();
                match gdr() {
                    Ok(s) => return Ok((s, passed)),
                    Err(why) => passed.push(format!("not gpu_gdrcopy: {why}")),
                }
                match mapped() {
                    Ok(s) => return Ok((s, passed)),
                    Err(why) => passed.push(format!("not device_mapped: {why}")),
                }
                Ok((Self::Host, passed))
            }
        }
    }
}

/// Which kind `choice` gives on this machine, with the reasons better kinds were passed over
/// (for `xfer info` and `xfer doctor`), or why the requested kind cannot be had.
pub fn probe(choice: MemoryChoice, cuda_device: i32) -> Result<(MemoryKind, Vec<String>), String> {
    Source::choose(choice, cuda_device).map(|(s, why)| (s.kind(), why))
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
    /// Pause between two polling passes, in microseconds (0: spin, yielding now and then).
    /// Each pass over GPU-memory slots costs one uncached PCIe read per block with active
    /// slots (~1 µs for one slot, ~10 µs for a whole block), so a short pause trades that
    /// much latency for a much cheaper poller.
    pub pass_interval_us: u64,
}

impl Default for PoolConfig {
    fn default() -> Self {
        Self {
            cpu: None,
            max_slots: 4 * SLOTS_PER_BLOCK,
            memory: MemoryChoice::Auto,
            cuda_device: 0,
            pass_interval_us: 0,
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
    /// Where blocks come from.
    source: Source,
    pass_interval: std::time::Duration,
    /// Polling passes over active slots, and the time they took (read and compare).
    passes: AtomicU64,
    pass_ns: AtomicU64,
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
    fn at(&self) -> usize {
        self.index % SLOTS_PER_BLOCK
    }

    /// The slot's index in the pool.
    pub fn slot(&self) -> usize {
        self.index
    }

    /// The CPU address of the slot, for producers that write it directly (for GPU memory:
    /// inside the uncached BAR mapping; prefer [`store`](Self::store)).
    pub fn host_ptr(&self) -> *mut u64 {
        self.block.host_ptr(self.at())
    }

    /// The address a GPU kernel writes, when the slot is device-mapped memory.
    pub fn device_ptr(&self) -> Option<u64> {
        self.block.device_ptr(self.at())
    }

    /// What backs the slot.
    pub fn memory(&self) -> MemoryKind {
        self.block.kind()
    }

    /// The slot's current value.
    pub fn value(&self) -> u64 {
        self.block.load(self.at())
    }

    /// Sets the slot (a CPU producer).
    pub fn store(&self, value: u64) {
        self.block.store(self.at(), value);
    }

    /// Adds to the slot (a CPU producer bumping a counter); returns the new value. Atomic
    /// except in GPU memory, where it is a read-modify-write over PCIe (see `MemoryKind`).
    pub fn add(&self, delta: u64) -> u64 {
        self.block.add(self.at(), delta)
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
        let (source, passed_over) =
            Source::choose(config.memory, config.cuda_device).map_err(WatcherError::Memory)?;
        tracing::info!(
            memory = source.kind().name(),
            passed_over = ?passed_over,
            "uvm-watcher: slots in {} memory",
            source.kind().name()
        );
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
            source,
            pass_interval: std::time::Duration::from_micros(config.pass_interval_us),
            passes: AtomicU64::new(0),
            pass_ns: AtomicU64::new(0),
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
        block.store(index % SLOTS_PER_BLOCK, 0);
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

    /// What backs this pool's slots.
    pub fn memory(&self) -> MemoryKind {
        self.shared.source.kind()
    }

    /// Polling passes over active slots so far, and the total time they took (reading the
    /// slots and finding what changed; callbacks excluded): what polling costs the CPU.
    pub fn pass_stats(&self) -> (u64, std::time::Duration) {
        (
            self.shared.passes.load(Ordering::Relaxed),
            std::time::Duration::from_nanos(self.shared.pass_ns.load(Ordering::Relaxed)),
        )
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
        let block = self.shared.source.block().map_err(WatcherError::Memory)?;
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
    let mut span: Vec<u64> = Vec::new();
    let mut changes: Vec<(usize, u64, u64)> = Vec::new();
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
        // One read per block with active slots, covering the span from its lowest to its
        // highest active slot (one bulk BAR read for GPU memory), then what changed.
        let started = std::time::Instant::now();
        changes.clear();
        for (b, chunk) in watches.chunks_mut(SLOTS_PER_BLOCK).enumerate() {
            let active = || chunk.iter().enumerate().filter(|(_, w)| w.is_some());
            let (Some((lo, _)), Some((hi, _))) = (active().next(), active().next_back()) else {
                continue;
            };
            let block = &chunk[lo].as_ref().expect("active").cell.0;
            span.resize(hi - lo + 1, 0);
            block.read_span(lo, &mut span);
            let base = b * SLOTS_PER_BLOCK;
            let watched = chunk
                .iter_mut()
                .enumerate()
                .filter_map(|(k, w)| w.as_mut().map(|w| (base + k, &mut w.last)));
            changed(watched, base + lo, &span, &mut changes);
        }
        if !watches.is_empty() {
            shared.passes.fetch_add(1, Ordering::Relaxed);
            shared
                .pass_ns
                .fetch_add(started.elapsed().as_nanos() as u64, Ordering::Relaxed);
        }
        for &(i, old, now) in &changes {
            let Some(w) = watches[i].as_mut() else {
                continue;
            };
            let outcome =
                std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| (w.callback)(old, now)));
            if !matches!(outcome, Ok(Control::Continue)) {
                if outcome.is_err() {
                    tracing::error!(slot = i, "a watcher callback panicked; its slot is freed");
                }
                watches[i] = None;
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
        if !shared.pass_interval.is_zero() {
            std::thread::park_timeout(shared.pass_interval);
            continue;
        }
        // Spin, but give the CPU away now and then so a small machine is not starved.
        if rounds % 256 == 0 {
            std::thread::yield_now();
        } else {
            std::hint::spin_loop();
        }
    }
}
