//! Posting: writes and reads built into chains (up to four per doorbell, the last signalled),
//! messages copied into pooled registered buffers, and what waits for a connection.

use super::*;
use xfer_plugin::domain::post_one_by_one;

/// Writes of one data QP: a chain being built (posted with one doorbell, at most 4), and what
/// is on the send queue (see [`Outstanding`]): only the last write of a chain is signalled,
/// and each write still gets its own `Done` event.
#[derive(Default)]
pub(super) struct DataQueue {
    pub(super) chain: Vec<Write>,
    pub(super) outstanding: Outstanding<Write>,
    /// Whether the send queue moves (a completion, or its first write after being empty):
    /// a peer whose queue does not move for `unreachable_ms` is declared unreachable.
    pub(super) progress: Progress,
}

/// Writes per doorbell.
pub(super) const CHAIN: usize = 4;

/// A CQ reservation may have resized the CQ, which need not keep its arming: the notifier
/// arms it again when the worker next parks.
pub(super) fn cq_may_have_resized(notify: &Option<(Arc<NotifyState>, Waker)>) {
    if let Some((notify, _)) = notify {
        notify.armed.store(false, Ordering::SeqCst);
    }
}

/// Whether the data QP `qp` may take one more write: fewer are outstanding (or waiting in
/// its chain) than it holds CQ room for, or its window could be doubled (up to `limit`, its
/// send queue) because the CQ can hold more. `grew` is set when the CQ may have been
/// resized (its notifier must then be armed again).
pub(super) fn has_room(qp: &mut Qp, q: &DataQueue, limit: usize, grew: &mut bool) -> bool {
    let used = q.outstanding.len() + q.chain.len();
    if used < qp.reserved() {
        return true;
    }
    let window = qp.reserved();
    if window >= limit {
        return false;
    }
    if qp.reserve(window.clamp(1, limit - window)) {
        *grew = true;
        return true;
    }
    false
}

/// Adds `w` to the data QP's chain if it has room (`Ok(false)`: none, nothing changed), and
/// rings the doorbell once the chain is full. An error from that post comes after `w` was
/// accepted: the connection's failure reports it (as it does every write of the chain).
pub(super) fn push_write(
    qp: &mut Qp,
    q: &mut DataQueue,
    w: Write,
    limit: usize,
    grew: &mut bool,
) -> Result<bool, String> {
    if !has_room(qp, q, limit, grew) {
        return Ok(false);
    }
    q.chain.push(w);
    if q.chain.len() >= CHAIN {
        post_chain(qp, q)?;
    }
    Ok(true)
}

/// The work request of `wr` (send-side id `wr_id`), its source resolved to (`laddr`, `lkey`)
/// and its rkey checked.
fn write_of(wr_id: u64, wr: &RdmaRequest<'_>, (laddr, lkey): (u64, u32), rkey: u32) -> Write {
    Write {
        wr_id,
        user: wr.wr_id,
        laddr,
        raddr: wr.remote_addr,
        len: wr.len as u32,
        lkey,
        rkey,
        imm: wr.imm().unwrap_or(0),
        has_imm: wr.imm().is_some() as i32,
        signaled: 1,
        read: i32::from(wr.is_read()),
        inline_data: 0, // decided per QP when posted
        flushes: 0,
        pad: 0,
    }
}

/// Posts `q.chain` on `qp` (the last write signalled); what does not fit stays in the chain.
pub(super) fn post_chain(qp: &mut Qp, q: &mut DataQueue) -> Result<(), String> {
    if q.chain.is_empty() {
        return Ok(());
    }
    let last = q.chain.len() - 1;
    for (i, w) in q.chain.iter_mut().enumerate() {
        w.signaled = (i == last) as i32;
    }
    // SAFETY: every write was checked against a live registration when accepted; a region
    // deregistered since has its lkey refused by the NIC (an error completion), never read.
    let posted = unsafe { qp.post_writes(&q.chain) }?;
    if q.outstanding.is_empty() && posted > 0 {
        q.progress.moved();
    }
    for w in q.chain.drain(..posted) {
        q.outstanding.push(w.wr_id, w.user, w.signaled != 0, w);
    }
    Ok(())
}

/// The next send-side work-request id from `counter` (low bits; tagged `TAG_SEND`). A free
/// function so it can be called while a peer's QPs are borrowed from the peer map.
pub(super) fn next_send_id(counter: &mut u64) -> u64 {
    *counter = (*counter + 1) & !TAG_MASK;
    TAG_SEND | *counter
}

/// A message on its way: the engine's id for it and the pool buffer it was copied into.
pub(super) struct SendBuffer {
    /// The engine's id for the send.
    pub(super) user: u64,
    /// Its buffer in `send_pool`, free again when the send completes.
    pub(super) buffer: usize,
}

/// Copies a message into a pooled registered buffer and posts it; `Ok(false)` when the queue
/// is full (the buffer goes back to the pool).
pub(super) fn post_message(
    device: &mut Device,
    qp: &mut Qp,
    (sends, pool): (&mut HashMap<u64, SendBuffer>, &mut ReceivePool<Mr>),
    (wr_id, user): (u64, u64),
    bytes: &[u8],
) -> Result<bool, String> {
    let buffer = pool.take(message_size_class(bytes.len()), |data| {
        // SAFETY: the pool keeps the buffer at this address for the Domain's lifetime, and
        // the registration with it.
        unsafe {
            device.register(
                data.as_ptr() as u64,
                data.len(),
                RemoteBits::of(false, false),
            )
        }
    })?;
    let (ptr, _, mr) = pool.get(buffer);
    let lkey = mr.lkey;
    // SAFETY: the class holds at least `bytes.len()` bytes, and the buffer is ours (taken
    // from the pool, not posted) until it is released.
    unsafe { std::ptr::copy_nonoverlapping(bytes.as_ptr(), ptr, bytes.len()) };
    // SAFETY: the buffer lies in its registration and stays out of the pool until its
    // completion.
    let posted = unsafe { qp.post_send(wr_id, ptr as u64, bytes.len() as u32, lkey) };
    match posted {
        Ok(true) => {
            sends.insert(wr_id, SendBuffer { user, buffer });
            Ok(true)
        }
        other => {
            pool.release(buffer);
            other
        }
    }
}

impl VerbsDomain {
    /// A fresh send-side work-request id (see `next_wr`).
    pub(super) fn wr_id(&mut self) -> u64 {
        next_send_id(&mut self.next_wr)
    }

    /// Posts a write or a read: both travel the same chains and the same in-order accounting.
    pub(super) fn post_request(&mut self, wr: &RdmaRequest<'_>) -> Result<PostStatus, DomainError> {
        if wr.len > u64::from(self.attr.max_msg_sz) {
            return Err(err(
                DomainErrorKind::InvalidArgument,
                format!(
                    "{} of {} bytes exceeds {}'s max message size {}",
                    if wr.is_read() { "read" } else { "write" },
                    wr.len,
                    self.name,
                    self.attr.max_msg_sz
                ),
            ));
        }
        let remote_key = u32::try_from(wr.remote_key).map_err(|_| {
            err(
                DomainErrorKind::InvalidArgument,
                format!("rkey {:#x} is not a verbs rkey", wr.remote_key),
            )
        })?;
        let (laddr, lkey) = if wr.len == 0 {
            (0, 0)
        } else {
            let mr = self.regions.source(wr.local_key, wr.local_addr, wr.len)?;
            (wr.local_addr, mr.lkey)
        };
        let w = write_of(self.wr_id(), wr, (laddr, lkey), remote_key);
        if self.queue_until_ready(wr.peer, || Queued::Write(w))? {
            return Ok(PostStatus::Posted);
        }
        match self.peers.get_mut(wr.peer) {
            Some(Connection {
                data,
                queued,
                ready: true,
                ..
            }) => {
                if !queued.is_empty() {
                    return Ok(PostStatus::Busy);
                }
                let q = self.data_queues.entry(data.qpn).or_default();
                let mut grew = false;
                let pushed = push_write(data, q, w, self.options.send_queue as usize, &mut grew);
                if grew {
                    cq_may_have_resized(&self.notify);
                }
                match pushed {
                    Ok(true) => Ok(PostStatus::Posted),
                    Ok(false) => Ok(PostStatus::Busy),
                    Err(e) => {
                        // The write is accepted (it is in the chain): the connection's failure
                        // reports it, once, as a Done event; returning an error here too
                        // would finish it twice.
                        let peer = wr.peer.clone();
                        self.fail_peer(&peer, &format!("posting writes failed: {e}"));
                        Ok(PostStatus::Posted)
                    }
                }
            }
            // Gone (its connect failed at once); connecting ones were queued above.
            _ => Err(err(
                DomainErrorKind::PeerUnreachable,
                format!("{} failed to connect", wr.peer),
            )),
        }
    }

    /// The pages of a paged write (see `Domain::post_rdma_pages`). The first goes alone,
    /// through every check (and connects to the peer if need be); the rest, when the peer is
    /// connected with nothing queued, share its checks and its connection lookup: each is
    /// checked against its source region and chained, and the chain's tail is posted at once
    /// rather than at the next poll. Reads, zero-byte writes and pages for a peer that is not
    /// ready go one by one (they queue for the connection as single requests do).
    pub(super) fn post_pages(
        &mut self,
        wr: &RdmaRequest<'_>,
        shifts: &[PageShift],
    ) -> (usize, Result<PostStatus, DomainError>) {
        let Some((&first, rest)) = shifts.split_first() else {
            return (0, Ok(PostStatus::Posted));
        };
        match self.post_request(&wr.shifted(first)) {
            Ok(PostStatus::Posted) => {}
            stopped => return (0, stopped),
        }
        let batchable = wr.len > 0
            && !wr.is_read()
            && matches!(
                self.peers.get(wr.peer),
                Some(Connection { ready: true, queued, .. }) if queued.is_empty()
            );
        if !batchable {
            let (posted, status) = post_one_by_one(self, wr, rest);
            return (1 + posted, status);
        }
        // The first page passed the rkey's conversion.
        let rkey = wr.remote_key as u32;
        let limit = self.options.send_queue as usize;
        let Some(Connection { data, .. }) = self.peers.get_mut(wr.peer) else {
            unreachable!("checked above");
        };
        let q = self.data_queues.entry(data.qpn).or_default();
        let (mut grew, mut failed) = (false, None);
        let mut outcome = (shifts.len(), Ok(PostStatus::Posted));
        for (i, &shift) in rest.iter().enumerate() {
            let page = wr.shifted(shift);
            let source = self
                .regions
                .source(page.local_key, page.local_addr, page.len);
            let lkey = match source {
                Ok(mr) => mr.lkey,
                Err(e) => {
                    outcome = (1 + i, Err(e));
                    break;
                }
            };
            let w = write_of(
                next_send_id(&mut self.next_wr),
                &page,
                (page.local_addr, lkey),
                rkey,
            );
            match push_write(data, q, w, limit, &mut grew) {
                Ok(true) => {}
                Ok(false) => {
                    outcome = (1 + i, Ok(PostStatus::Busy));
                    break;
                }
                Err(e) => {
                    // Page `1 + i` was accepted: the connection's failure reports it; the
                    // rest wait for the engine to post them again (on a fresh connection).
                    failed = Some(e);
                    let posted = 2 + i;
                    let status = if posted == shifts.len() {
                        PostStatus::Posted
                    } else {
                        PostStatus::Busy
                    };
                    outcome = (posted, Ok(status));
                    break;
                }
            }
        }
        if failed.is_none() {
            failed = post_chain(data, q).err();
        }
        if grew {
            cq_may_have_resized(&self.notify);
        }
        if let Some(e) = failed {
            let peer = wr.peer.clone();
            self.fail_peer(&peer, &format!("posting writes failed: {e}"));
        }
        outcome
    }

    /// Connects to `peer` if need be, and queues what `make` builds while the connection
    /// cannot take posts (connecting, or waiting for the requester's `Ready`): `true` if it
    /// was queued, `false` if the caller may post now.
    pub(super) fn queue_until_ready(
        &mut self,
        peer: &NetAddr,
        make: impl FnOnce() -> Queued,
    ) -> Result<bool, DomainError> {
        if !self.peers.contains_key(peer) {
            self.start_connect(peer)?;
        }
        match self.peers.get_mut(peer) {
            Some(Connection {
                queued,
                ready: false,
                ..
            }) => {
                queued.push_back(make());
                Ok(true)
            }
            _ => Ok(false),
        }
    }

    /// Posts every non-empty chain of a connected peer.
    pub(super) fn post_chains(&mut self) {
        let mut failed = Vec::new();
        for (addr, c) in self.peers.iter_mut() {
            if !c.ready {
                continue;
            }
            if let Some(q) = self.data_queues.get_mut(&c.data.qpn) {
                if let Err(e) = post_chain(&mut c.data, q) {
                    failed.push((addr.clone(), e));
                }
            }
        }
        for (addr, e) in failed {
            self.fail_peer(&addr, &e);
        }
    }

    /// Posts what is queued for a connected peer, until its send queue is full.
    pub(super) fn flush(&mut self, peer: &NetAddr) {
        let mut failed = None;
        if let Some(Connection {
            data,
            msg,
            queued,
            ready: true,
        }) = self.peers.get_mut(peer)
        {
            let limit = self.options.send_queue as usize;
            let mut grew = false;
            while let Some(q) = queued.pop_front() {
                let r = match &q {
                    Queued::Write(w) => {
                        let dq = self.data_queues.entry(data.qpn).or_default();
                        push_write(data, dq, *w, limit, &mut grew)
                    }
                    Queued::Send { wr_id, data: bytes } => {
                        let id = next_send_id(&mut self.next_wr);
                        post_message(
                            &mut self.device,
                            msg,
                            (&mut self.sends, &mut self.send_pool),
                            (id, *wr_id),
                            bytes,
                        )
                    }
                };
                match r {
                    Ok(true) => {}
                    Ok(false) => {
                        queued.push_front(q);
                        break;
                    }
                    Err(e) => {
                        failed = Some(e);
                        break;
                    }
                }
            }
            if grew {
                cq_may_have_resized(&self.notify);
            }
        }
        if let Some(e) = failed {
            self.fail_peer(peer, &e);
        }
    }
}
