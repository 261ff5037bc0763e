//! The process-wide fabric: every open mock NIC, by address, with its registered regions,
//! its outgoing connections and the events waiting for its next poll; and the progress thread
//! that lands operations on the fabric's own clock.
//!
//! What it models of RC/SRD hardware, because the engine must survive it:
//! - completions and arrivals come asynchronously and unordered, whenever the fabric gets to
//!   them, not when the worker polls;
//! - a failed operation puts its connection (local NIC → peer) in the error state: every
//!   operation still outstanding on it is flushed with an error, and the next post opens a
//!   fresh connection (what a verbs backend does when it reconnects);
//! - a write that fails part-way has written part of its data and counts no immediate;
//! - a NIC never touches memory whose registration is gone: every copy holds both regions'
//!   locks, and deregistration takes them for writing.
//!
//! The progress thread that lands delayed and reordered operations is in `progress`.

use std::collections::VecDeque;
use std::sync::atomic::{AtomicBool, AtomicU64, AtomicUsize, Ordering};
use std::sync::{Arc, LazyLock, Mutex, MutexGuard, OnceLock, RwLock, RwLockReadGuard, Weak};

use foldhash::HashMap;
use xfer_plugin::addr::NetAddr;
use xfer_plugin::domain::{DomainError, DomainErrorKind, Event, Waker};

mod progress;
pub(crate) mod rdma;
pub(crate) use progress::schedule;
pub(crate) use rdma::{Listed, Pages, RdmaShape};

/// A registered region.
#[derive(Debug, Clone, Copy)]
pub(crate) struct Region {
    pub(crate) ptr: u64,
    pub(crate) len: u64,
    /// GPU memory: copied through the CUDA driver rather than by the CPU.
    pub(crate) gpu: bool,
    /// The local key of the registration this belongs to (a remote key is revoked with its
    /// own registration only, never with another registration of the same range).
    pub(crate) owner: u64,
    /// Peers may write into it.
    pub(crate) remote_write: bool,
    /// Peers may read it.
    pub(crate) remote_read: bool,
}

impl Region {
    /// Whether `[addr, addr + len)` lies inside the region.
    pub(crate) fn contains(&self, addr: u64, len: u64) -> bool {
        addr >= self.ptr
            && addr
                .checked_add(len)
                .is_some_and(|end| end <= self.ptr + self.len)
    }
}

/// Keys of one NIC: local keys for sources, remote keys for peers' writes.
#[derive(Debug, Default)]
pub(crate) struct Regions {
    pub(crate) local: HashMap<u64, Region>,
    pub(crate) remote: HashMap<u64, Region>,
}

/// A message waiting for the receiver to post a buffer.
pub(crate) struct WaitingSend {
    pub(crate) data: Vec<u8>,
    /// The sending NIC's address: the sender the receiver is told (the fabric knows it, as
    /// a NIC knows the connection a message came on).
    pub(crate) from: NetAddr,
    pub(crate) sender: Weak<Nic>,
    /// The sender's connection, whose queue the message still occupies.
    pub(crate) conn: Arc<Conn>,
    pub(crate) wr_id: u64,
}

/// What a NIC's next poll will return, plus its receive buffers.
#[derive(Default)]
pub(crate) struct Inbox {
    pub(crate) events: Vec<Event>,
    pub(crate) recv_buffers: VecDeque<usize>,
    pub(crate) waiting_sends: VecDeque<WaitingSend>,
}

/// One outgoing connection (this NIC → a peer). The posting Domain keeps it by peer and every
/// operation in flight carries it, so nothing looks a connection (or its peer's NIC) up by
/// address per operation — that cost the mock ~200 instructions a page.
#[derive(Debug)]
pub(crate) struct Conn {
    pub(crate) peer: NetAddr,
    /// The peer's NIC once found. Addresses are never reused, so the first NIC found at the
    /// address is the only one there will ever be; it is weak so that two NICs' connections
    /// to each other keep neither alive.
    target: OnceLock<Weak<Nic>>,
    /// Bumped when the connection goes to error: operations posted under an older epoch are
    /// flushed.
    epoch: AtomicU64,
    /// Operations posted and not completed (the send queue's fill).
    outstanding: AtomicUsize,
}

impl Conn {
    pub(crate) fn new(peer: NetAddr) -> Self {
        Self {
            peer,
            target: OnceLock::new(),
            epoch: AtomicU64::new(0),
            outstanding: AtomicUsize::new(0),
        }
    }

    /// The peer's NIC while it is on the fabric.
    pub(crate) fn target(&self) -> Option<Arc<Nic>> {
        if let Some(nic) = self.target.get() {
            return nic.upgrade().filter(|n| n.alive.load(Ordering::Acquire));
        }
        let nic = lookup(&self.peer)?;
        let _ = self.target.set(Arc::downgrade(&nic));
        Some(nic)
    }

    pub(crate) fn epoch(&self) -> u64 {
        self.epoch.load(Ordering::Acquire)
    }

    /// Counts a post unless `depth` (0: unlimited) operations are already outstanding.
    /// Only the owning Domain posts, so the check and the increment cannot race each other;
    /// completions only ever lower the count in between.
    pub(crate) fn try_occupy(&self, depth: usize) -> bool {
        if depth > 0 && self.outstanding.load(Ordering::Acquire) >= depth {
            return false;
        }
        self.outstanding.fetch_add(1, Ordering::AcqRel);
        true
    }

    /// Counts up to `n` more posts, as many as `depth` (0: unlimited) leaves room for;
    /// returns how many. As [`try_occupy`](Self::try_occupy), for a batch at once.
    pub(crate) fn occupy_up_to(&self, depth: usize, n: usize) -> usize {
        let room = match depth {
            0 => n,
            _ => depth
                .saturating_sub(self.outstanding.load(Ordering::Acquire))
                .min(n),
        };
        self.outstanding.fetch_add(room, Ordering::AcqRel);
        room
    }

    /// RC: the connection goes to the error state (once per epoch, however many of its
    /// operations fail); what is still queued under `epoch` is flushed.
    fn fail(&self, epoch: u64) {
        let _ = self
            .epoch
            .compare_exchange(epoch, epoch + 1, Ordering::AcqRel, Ordering::Acquire);
    }
}

/// One mock NIC as the fabric sees it.
pub(crate) struct Nic {
    pub(crate) addr: NetAddr,
    pub(crate) id: u64,
    pub(crate) alive: AtomicBool,
    /// While set, operations aimed at this NIC neither land nor fail (a hung host).
    pub(crate) frozen: AtomicBool,
    pub(crate) regions: RwLock<Regions>,
    inbox: Mutex<Inbox>,
    waker: OnceLock<Waker>,
}

/// An operation as posted.
#[derive(Debug)]
pub(crate) enum Op {
    /// An RDMA write (with its immediate, if any) or read.
    Rdma {
        wr_id: u64,
        peer: NetAddr,
        shape: RdmaShape,
    },
    Send {
        wr_id: u64,
        peer: NetAddr,
        data: Vec<u8>,
    },
}

impl Op {
    pub(crate) fn wr_id(&self) -> u64 {
        match self {
            Self::Rdma { wr_id, .. } | Self::Send { wr_id, .. } => *wr_id,
        }
    }

    pub(crate) fn peer(&self) -> &NetAddr {
        match self {
            Self::Rdma { peer, .. } | Self::Send { peer, .. } => peer,
        }
    }
}

/// An operation on its way: which connection epoch it was posted under, and whether fault
/// injection fails it.
pub(crate) struct Posted {
    pub(crate) src: Arc<Nic>,
    pub(crate) conn: Arc<Conn>,
    pub(crate) op: Op,
    pub(crate) epoch: u64,
    pub(crate) injected: Option<DomainError>,
}

/// Appends `from` to `to`, leaving `from` empty: by swapping the two when `to` is empty (a
/// batch's events are not copied again; a page's ~50-byte event copied twice more cost as
/// much as its 64 bytes of data).
pub(crate) fn move_events(to: &mut Vec<Event>, from: &mut Vec<Event>) {
    if to.is_empty() {
        std::mem::swap(to, from);
    } else {
        to.append(from);
    }
}

fn locked<T>(m: &Mutex<T>) -> MutexGuard<'_, T> {
    // Every critical section here finishes its own bookkeeping; a poisoned lock holds
    // consistent data.
    m.lock().unwrap_or_else(|p| p.into_inner())
}

impl Nic {
    pub(crate) fn regions(&self) -> RwLockReadGuard<'_, Regions> {
        // Region maps are only ever changed whole-entry; a poisoned lock holds valid data.
        self.regions.read().unwrap_or_else(|p| p.into_inner())
    }

    pub(crate) fn inbox(&self) -> MutexGuard<'_, Inbox> {
        locked(&self.inbox)
    }

    pub(crate) fn set_waker(&self, waker: Waker) {
        let _ = self.waker.set(waker);
    }

    /// Queues an event for this NIC's next poll and wakes its worker.
    pub(crate) fn deliver(&self, event: Event) {
        self.inbox().events.push(event);
        self.wake();
    }

    /// Queues `events` under one hold of the inbox and wakes the worker; leaves `events`
    /// empty, with the room of the queue's own vector when that was empty (the one the
    /// worker handed back at its last poll), so that vectors go round between the poster,
    /// the inbox and the worker and a batch allocates nothing once they have grown.
    pub(crate) fn deliver_all(&self, events: &mut Vec<Event>) {
        if events.is_empty() {
            return;
        }
        move_events(&mut self.inbox().events, events);
        self.wake();
    }

    pub(crate) fn wake(&self) {
        if let Some(w) = self.waker.get() {
            w.wake();
        }
    }

    /// Records an operation's completion on this (its source) NIC: the connection's queue
    /// drains by one, and the engine learns the outcome at its next poll.
    pub(crate) fn complete(&self, conn: &Conn, wr_id: u64, result: Result<(), DomainError>) {
        // Never below zero: every completion follows its own `try_occupy`.
        conn.outstanding.fetch_sub(1, Ordering::AcqRel);
        self.deliver(Event::Done { wr_id, result });
    }

    /// Hands waiting messages to free receive buffers, completing each on its sender.
    pub(crate) fn match_waiting_sends(&self) {
        let mut completions = Vec::new();
        {
            let mut inbox = self.inbox();
            while !inbox.recv_buffers.is_empty() && !inbox.waiting_sends.is_empty() {
                let send = inbox.waiting_sends.pop_front().expect("checked non-empty");
                let result = accept_message(&mut inbox, send.data, send.from, &self.addr);
                completions.push((send.sender, send.conn, send.wr_id, result));
            }
        }
        self.wake();
        for (sender, conn, wr_id, result) in completions {
            if let Some(sender) = sender.upgrade() {
                sender.complete(&conn, wr_id, result);
            }
        }
    }
}

/// Puts a message in the next receive buffer, or refuses it as a NIC would. A refused
/// message leaves the buffer posted (no receive buffer is ever lost).
pub(crate) fn accept_message(
    inbox: &mut Inbox,
    data: Vec<u8>,
    from: NetAddr,
    at: &NetAddr,
) -> Result<(), DomainError> {
    let buf_len = *inbox.recv_buffers.front().expect("the caller checked");
    if data.len() > buf_len {
        return Err(DomainError::new(
            DomainErrorKind::RemoteAccess,
            format!("message of {} bytes is larger than the receive buffer of {buf_len} bytes at mock NIC {at}", data.len()),
        ));
    }
    inbox.recv_buffers.pop_front();
    inbox.events.push(Event::Message {
        data,
        from: Some(from),
    });
    Ok(())
}

struct Fabric {
    nics: RwLock<HashMap<NetAddr, Arc<Nic>>>,
    next_id: AtomicU64,
}

static FABRIC: LazyLock<Fabric> = LazyLock::new(|| Fabric {
    nics: RwLock::new(HashMap::default()),
    next_id: AtomicU64::new(1),
});

/// Keys are unique across the whole fabric, so a key of NIC i used on NIC k is caught.
pub(crate) fn new_key() -> u64 {
    // Spread the counter so keys look unrelated and never collide with a plain small number.
    FABRIC
        .next_id
        .fetch_add(1, Ordering::Relaxed)
        .wrapping_mul(0x9e37_79b9_7f4a_7c15)
}

/// Adds a NIC to the fabric.
pub(crate) fn join() -> Arc<Nic> {
    let id = FABRIC.next_id.fetch_add(1, Ordering::Relaxed);
    let mut raw = b"mock".to_vec();
    raw.extend_from_slice(&id.to_le_bytes());
    let addr = NetAddr::new(&raw).expect("12 bytes is a valid address");
    let nic = Arc::new(Nic {
        addr: addr.clone(),
        id,
        alive: AtomicBool::new(true),
        frozen: AtomicBool::new(false),
        regions: RwLock::new(Regions::default()),
        inbox: Mutex::new(Inbox::default()),
        waker: OnceLock::new(),
    });
    FABRIC
        .nics
        .write()
        .unwrap_or_else(|p| p.into_inner())
        .insert(addr, Arc::clone(&nic));
    nic
}

/// Finds a live NIC.
pub(crate) fn lookup(addr: &NetAddr) -> Option<Arc<Nic>> {
    FABRIC
        .nics
        .read()
        .unwrap_or_else(|p| p.into_inner())
        .get(addr)
        .filter(|n| n.alive.load(Ordering::Acquire))
        .cloned()
}

/// Removes a NIC: later operations aimed at it fail, operations it posted fail without
/// touching memory, and messages waiting for its buffers fail on their senders.
pub(crate) fn leave(nic: &Nic) {
    {
        // Under the regions lock: a copy in progress finishes first, and none starts after.
        let mut regions = nic.regions.write().unwrap_or_else(|p| p.into_inner());
        nic.alive.store(false, Ordering::Release);
        regions.local.clear();
        regions.remote.clear();
    }
    FABRIC
        .nics
        .write()
        .unwrap_or_else(|p| p.into_inner())
        .remove(&nic.addr);
    let waiting: Vec<WaitingSend> = nic.inbox().waiting_sends.drain(..).collect();
    for send in waiting {
        if let Some(sender) = send.sender.upgrade() {
            sender.complete(&send.conn, send.wr_id, Err(unreachable(&nic.addr)));
        }
    }
    nic.wake();
}

/// Drops the NIC at `addr` from the fabric, as if its host died: its pending and later
/// operations fail, and so does everything aimed at it. Returns whether such a NIC existed.
pub fn kill(addr: &NetAddr) -> bool {
    match lookup(addr) {
        Some(nic) => {
            leave(&nic);
            true
        }
        None => false,
    }
}

/// Makes the NIC at `addr` hang (or recover): operations aimed at it neither land nor fail
/// while it is frozen, as with a host that stopped answering but whose link is up; senders
/// learn of it only through their own deadlines. Returns whether such a NIC exists.
pub fn freeze(addr: &NetAddr, frozen: bool) -> bool {
    match lookup(addr) {
        Some(nic) => {
            nic.frozen.store(frozen, Ordering::Release);
            true
        }
        None => false,
    }
}

/// How many registrations (local keys) the NIC at `addr` holds, for tests that check no
/// registration outlives its owner's knowledge of it.
pub fn registrations(addr: &NetAddr) -> Option<usize> {
    lookup(addr).map(|nic| nic.regions().local.len())
}

/// What an operation of a NIC that left the fabric fails with (its own side is gone).
pub(crate) fn dropped(addr: &NetAddr) -> DomainError {
    DomainError::new(
        DomainErrorKind::PeerUnreachable,
        format!("mock NIC {addr} was dropped from the fabric"),
    )
}

pub(crate) fn unreachable(addr: &NetAddr) -> DomainError {
    DomainError::new(
        DomainErrorKind::PeerUnreachable,
        format!("no live mock NIC at {addr}"),
    )
}

/// What an operation flushed with its failed connection completes with: the peer is out of
/// reach on that connection until it is rebuilt (verbs reports `IBV_WC_WR_FLUSH_ERR` so too).
fn flushed(peer: &NetAddr) -> DomainError {
    DomainError::new(
        DomainErrorKind::PeerUnreachable,
        format!("flushed: the connection to mock NIC {peer} went to the error state after an earlier operation failed"),
    )
}

/// Lands one scheduled operation, on the fabric's progress thread.
pub(crate) fn land(posted: Posted) {
    let Posted {
        src,
        conn,
        op,
        epoch,
        injected,
    } = posted;
    land_on(&src, &conn, op, epoch, injected);
}

/// Lands one operation from `src` over `conn`, on whichever thread the fabric runs it (an
/// inline mock's poster: without building a [`Posted`], whose ~150 bytes were copied per
/// operation).
pub(crate) fn land_on(
    src: &Arc<Nic>,
    conn: &Arc<Conn>,
    op: Op,
    epoch: u64,
    injected: Option<DomainError>,
) {
    let peer = &conn.peer;
    let wr_id = op.wr_id();
    if !src.alive.load(Ordering::Acquire) {
        src.complete(conn, wr_id, Err(dropped(&src.addr)));
        return;
    }
    if conn.epoch() != epoch {
        src.complete(conn, wr_id, Err(flushed(peer)));
        return;
    }
    let result = match op {
        Op::Rdma { shape, .. } => rdma::rdma(src, conn, &shape, injected),
        Op::Send { data, .. } => match injected {
            Some(e) => Err(e),
            None => match send(src, conn, data, wr_id) {
                // Completes when the receiver posts a buffer (from its side).
                Ok(false) => return,
                Ok(true) => Ok(()),
                Err(e) => Err(e),
            },
        },
    };
    if result.is_err() {
        conn.fail(epoch);
    }
    src.complete(conn, wr_id, result);
}

/// A posting Domain's vectors for a batch's completions and immediates, empty between
/// batches (see [`Nic::deliver_all`]): a fresh vector per batch cost a single write ~150
/// instructions of allocating and freeing.
#[derive(Debug, Default)]
pub(crate) struct BatchEvents {
    done: Vec<Event>,
    arrivals: Vec<Event>,
}

/// Lands a batch posted inline from `src` over `conn` (see [`rdma::Batch`]), the
/// connection's queue already occupied once per request. As posting them one by one would: a
/// request that fails puts the connection in the error state, and those after it land on the
/// fresh connection (as a post after the failure would). The completions reach `src`'s inbox
/// under one hold.
pub(crate) fn land_batch(
    src: &Arc<Nic>,
    conn: &Conn,
    shape: &RdmaShape,
    batch: &impl rdma::Batch,
    events: &mut BatchEvents,
) {
    let BatchEvents { done, arrivals } = events;
    // Nothing left by a batch that panicked part-way is delivered with this one.
    done.clear();
    arrivals.clear();
    // With room for all at once: for 100,000 pages (~5 MB), growing it was most of the
    // batch, and a vector that has grown goes round (see `Nic::deliver_all`).
    done.reserve(batch.len());
    let mut complete = |i: usize, result: Result<(), DomainError>| {
        if result.is_err() {
            conn.fail(conn.epoch());
        }
        // Never below zero: the poster occupied the queue once per request.
        conn.outstanding.fetch_sub(1, Ordering::AcqRel);
        done.push(Event::Done {
            wr_id: batch.wr_id(i),
            result,
        });
    };
    if src.alive.load(Ordering::Acquire) {
        rdma::rdma_batch(src, conn, shape, batch, arrivals, &mut complete);
    } else {
        for i in 0..batch.len() {
            complete(i, Err(dropped(&src.addr)));
        }
    }
    src.deliver_all(done);
}

/// Returns whether the message was delivered now (else it waits for a receive buffer).
fn send(src: &Arc<Nic>, conn: &Arc<Conn>, data: Vec<u8>, wr_id: u64) -> Result<bool, DomainError> {
    let peer = &conn.peer;
    let target = conn.target().ok_or_else(|| unreachable(peer))?;
    let mut inbox = target.inbox();
    let delivered = if inbox.recv_buffers.is_empty() {
        inbox.waiting_sends.push_back(WaitingSend {
            data,
            from: src.addr.clone(),
            sender: Arc::downgrade(src),
            conn: Arc::clone(conn),
            wr_id,
        });
        false
    } else {
        accept_message(&mut inbox, data, src.addr.clone(), peer)?;
        true
    };
    drop(inbox);
    if delivered {
        target.wake();
    }
    Ok(delivered)
}
