//! The process-wide fabric: every open mock NIC, by address, with its registered regions and
//! the events waiting for its next poll.

use std::collections::{HashMap, VecDeque};
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, LazyLock, Mutex, MutexGuard, OnceLock, RwLock, RwLockReadGuard, Weak};

use engine_core::domain::{DomainError, DomainErrorKind, Event, Waker};
use engine_core::NetAddr;

/// A registered region.
#[derive(Debug, Clone, Copy)]
pub(crate) struct Region {
    pub(crate) ptr: u64,
    pub(crate) len: u64,
    /// GPU memory: copied through the CUDA driver rather than by the CPU.
    pub(crate) gpu: bool,
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
    pub(crate) sender: Weak<Nic>,
    pub(crate) wr_id: u64,
}

/// What a NIC's next poll will return from others, plus its receive buffers.
#[derive(Default)]
pub(crate) struct Inbox {
    pub(crate) events: Vec<Event>,
    pub(crate) recv_buffers: VecDeque<usize>,
    pub(crate) waiting_sends: VecDeque<WaitingSend>,
}

/// One mock NIC as the fabric sees it.
pub(crate) struct Nic {
    pub(crate) addr: NetAddr,
    pub(crate) id: u64,
    pub(crate) alive: AtomicBool,
    pub(crate) regions: RwLock<Regions>,
    inbox: Mutex<Inbox>,
    waker: OnceLock<Waker>,
}

impl Nic {
    pub(crate) fn regions(&self) -> RwLockReadGuard<'_, Regions> {
        // Region maps are only ever replaced whole-entry; a poisoned lock holds valid data.
        self.regions.read().unwrap_or_else(|p| p.into_inner())
    }

    pub(crate) fn inbox(&self) -> MutexGuard<'_, Inbox> {
        self.inbox.lock().unwrap_or_else(|p| p.into_inner())
    }

    pub(crate) fn set_waker(&self, waker: Waker) {
        let _ = self.waker.set(waker);
    }

    /// Queues an event for this NIC's next poll and wakes its worker.
    pub(crate) fn deliver(&self, event: Event) {
        self.inbox().events.push(event);
        self.wake();
    }

    pub(crate) fn wake(&self) {
        if let Some(w) = self.waker.get() {
            w.wake();
        }
    }

    /// Hands waiting messages to free receive buffers, completing each on its sender.
    pub(crate) fn match_waiting_sends(&self) {
        let mut completions = Vec::new();
        {
            let mut inbox = self.inbox();
            while !inbox.recv_buffers.is_empty() && !inbox.waiting_sends.is_empty() {
                let send = inbox.waiting_sends.pop_front().expect("checked non-empty");
                let buf_len = inbox.recv_buffers.pop_front().expect("checked non-empty");
                let result = accept_message(&mut inbox, buf_len, send.data, &self.addr);
                completions.push((send.sender, send.wr_id, result));
            }
        }
        self.wake();
        for (sender, wr_id, result) in completions {
            if let Some(sender) = sender.upgrade() {
                sender.deliver(Event::Done { wr_id, result });
            }
        }
    }
}

/// Puts a message in a buffer of `buf_len` bytes, or refuses it as a NIC would.
pub(crate) fn accept_message(
    inbox: &mut Inbox,
    buf_len: usize,
    data: Vec<u8>,
    at: &NetAddr,
) -> Result<(), DomainError> {
    if data.len() > buf_len {
        return Err(DomainError::new(
            DomainErrorKind::RemoteAccess,
            format!("message of {} bytes is larger than the receive buffer of {buf_len} bytes at mock NIC {at}", data.len()),
        ));
    }
    inbox.events.push(Event::Message { data });
    Ok(())
}

struct Fabric {
    nics: RwLock<HashMap<NetAddr, Arc<Nic>>>,
    next_id: AtomicU64,
}

static FABRIC: LazyLock<Fabric> = LazyLock::new(|| Fabric {
    nics: RwLock::new(HashMap::new()),
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

/// Removes a NIC: later operations aimed at it fail, and messages waiting for its buffers
/// fail on their senders.
pub(crate) fn leave(nic: &Nic) {
    nic.alive.store(false, Ordering::Release);
    FABRIC
        .nics
        .write()
        .unwrap_or_else(|p| p.into_inner())
        .remove(&nic.addr);
    let waiting: Vec<WaitingSend> = nic.inbox().waiting_sends.drain(..).collect();
    for send in waiting {
        if let Some(sender) = send.sender.upgrade() {
            sender.deliver(Event::Done {
                wr_id: send.wr_id,
                result: Err(unreachable(&nic.addr)),
            });
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

pub(crate) fn unreachable(addr: &NetAddr) -> DomainError {
    DomainError::new(
        DomainErrorKind::PeerUnreachable,
        format!("no live mock NIC at {addr}"),
    )
}
