//! Posting: writes and reads built into chains (up to four per doorbell, the last signalled),
//! messages copied into pooled registered buffers, and what waits for a connection.

use std::sync::atomic::Ordering;
use std::sync::Arc;

use foldhash::HashMap;
use xfer_plugin::addr::NetAddr;
use xfer_plugin::domain::{
    message_size_class, DomainError, DomainErrorKind, PageShift, PostStatus, RdmaRequest, Waker,
};

use super::connections::{Connection, Queued};
use super::{err, VerbsDomain};
use crate::completion::{Outstanding, Progress};
use crate::ffi::{Device, MessageBuffers, Qp, WorkRequest, TAG_MASK, TAG_SEND};
use crate::notify::NotifyState;

/// Writes of one data QP: a chain being built (posted with one doorbell, at most [`CHAIN`]), and what
/// is on the send queue (see [`Outstanding`]): only the last write of a chain is signalled,
/// and each write still gets its own `Done` event. The call that builds a chain also rings
/// its tail before it returns, so the chain is empty between calls and `poll` posts nothing;
/// writes the NIC refuses for want of room come back out (`Busy`, or back to wait for the
/// connection's next flush).
#[derive(Default)]
pub(super) struct DataQueue {
    pub(super) chain: Vec<WorkRequest>,
    pub(super) outstanding: Outstanding<WorkRequest>,
    /// Whether the send queue moves (a completion, or its first write after being empty):
    /// a peer whose queue does not move for `unreachable_ms` is declared unreachable.
    pub(super) progress: Progress,
}

/// Writes per doorbell (written once, in verbs-sys's build script).
pub(super) const CHAIN: usize = verbs_sys::CHAIN;

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
pub(super) fn push_request(
    qp: &mut Qp,
    q: &mut DataQueue,
    w: WorkRequest,
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
fn work_request_of(
    wr_id: u64,
    wr: &RdmaRequest<'_>,
    (laddr, lkey): (u64, u32),
    rkey: u32,
) -> WorkRequest {
    WorkRequest {
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
    let posted = qp.post_chain(&q.chain)?;
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
    (sends, pool): (&mut HashMap<u64, SendBuffer>, &mut MessageBuffers),
    (wr_id, user): (u64, u64),
    bytes: &[u8],
) -> Result<bool, String> {
    let buffer = pool.take(device, message_size_class(bytes.len()))?;
    match pool.post_send(qp, buffer, wr_id, bytes) {
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

/// What a request's fields allow before anything is looked up: its length within NIC
/// `nic`'s message size, its remote key a verbs rkey (returned).
fn check_request(wr: &RdmaRequest<'_>, max_msg_sz: u32, nic: &str) -> Result<u32, DomainError> {
    if wr.len > u64::from(max_msg_sz) {
        return Err(err(
            DomainErrorKind::InvalidArgument,
            format!(
                "{} of {} bytes exceeds {nic}'s max message size {max_msg_sz}",
                if wr.is_read() { "read" } else { "write" },
                wr.len,
            ),
        ));
    }
    u32::try_from(wr.remote_key).map_err(|_| {
        err(
            DomainErrorKind::InvalidArgument,
            format!("rkey {:#x} is not a verbs rkey", wr.remote_key),
        )
    })
}

impl VerbsDomain {
    /// A fresh send-side work-request id (see `next_wr`).
    pub(super) fn wr_id(&mut self) -> u64 {
        next_send_id(&mut self.next_wr)
    }

    /// Posts a write or a read: both travel the same chains and the same in-order accounting.
    pub(super) fn post_request(&mut self, wr: &RdmaRequest<'_>) -> Result<PostStatus, DomainError> {
        let remote_key = check_request(wr, self.attr.max_msg_sz, &self.name)?;
        let (laddr, lkey) = if wr.len == 0 {
            (0, 0)
        } else {
            let mr = self.regions.source(wr.local_key, wr.local_addr, wr.len)?;
            (wr.local_addr, mr.lkey)
        };
        let w = work_request_of(self.wr_id(), wr, (laddr, lkey), remote_key);
        if self.queue_until_ready(wr.peer, || Queued::Rdma(w))? {
            return Ok(PostStatus::Posted);
        }
        match self.connections.sending(wr.peer) {
            Some((
                Connection {
                    data,
                    queued,
                    ready: true,
                    ..
                },
                q,
            )) => {
                if !queued.is_empty() {
                    return Ok(PostStatus::Busy);
                }
                let mut grew = false;
                let limit = self.options.send_queue as usize;
                // Rung now, not at the next poll: `poll` posts nothing.
                let pushed = push_request(data, q, w, limit, &mut grew)
                    .and_then(|pushed| post_chain(data, q).map(|()| pushed));
                if grew {
                    cq_may_have_resized(&self.notify);
                }
                match pushed {
                    Ok(true) if q.chain.is_empty() => Ok(PostStatus::Posted),
                    Ok(true) => {
                        // The NIC refused it for want of room (the chain held only it):
                        // nothing was queued.
                        q.chain.clear();
                        Ok(PostStatus::Busy)
                    }
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

    /// The pages of a paged write (`RdmaPost::Pages`): a run of writes that differ only in
    /// their addresses (see `post_run`).
    pub(super) fn post_pages(
        &mut self,
        wr: &RdmaRequest<'_>,
        shifts: &[PageShift],
    ) -> (usize, Result<PostStatus, DomainError>) {
        let Some((&first, rest)) = shifts.split_first() else {
            return (0, Ok(PostStatus::Posted));
        };
        self.post_run(&wr.shifted(first), rest.iter().map(|&s| wr.shifted(s)))
    }

    /// A burst's requests (`RdmaPost::List`): each run of writes to one peer (see `post_run`)
    /// together; reads and zero-byte writes alone.
    pub(super) fn post_list(
        &mut self,
        requests: &[RdmaRequest<'_>],
    ) -> (usize, Result<PostStatus, DomainError>) {
        let mut posted = 0;
        while let Some(first) = requests.get(posted) {
            let runs = |r: &&RdmaRequest<'_>| {
                !first.is_read()
                    && first.len > 0
                    && !r.is_read()
                    && r.len > 0
                    && r.peer == first.peer
            };
            let run = requests[posted + 1..].iter().take_while(runs).count();
            let (n, status) = self.post_run(first, requests[posted + 1..][..run].iter().copied());
            posted += n;
            match status {
                Ok(PostStatus::Posted) if n == 1 + run => {}
                stopped => return (posted, stopped),
            }
        }
        (posted, Ok(PostStatus::Posted))
    }

    /// Posts `first`, then the writes of `rest` to the same peer. The first goes alone,
    /// through every check (and connects to the peer if need be); the rest, when the peer is
    /// connected with nothing queued, share its connection lookup: each is checked against
    /// its message size, remote key and source region and chained, and the chain's tail is
    /// posted at once rather than at the next poll. Reads, zero-byte writes and requests for
    /// a peer that is not ready go one by one (they queue for the connection as single
    /// requests do). Returns as `Domain::post_rdma` does.
    fn post_run<'p>(
        &mut self,
        first: &RdmaRequest<'p>,
        rest: impl ExactSizeIterator<Item = RdmaRequest<'p>>,
    ) -> (usize, Result<PostStatus, DomainError>) {
        let total = 1 + rest.len();
        match self.post_request(first) {
            Ok(PostStatus::Posted) => {}
            stopped => return (0, stopped),
        }
        let batchable = first.len > 0
            && !first.is_read()
            && matches!(
                self.connections.get(first.peer),
                Some(Connection { ready: true, queued, .. }) if queued.is_empty()
            );
        if !batchable {
            let mut posted = 1;
            for wr in rest {
                match self.post_request(&wr) {
                    Ok(PostStatus::Posted) => posted += 1,
                    stopped => return (posted, stopped),
                }
            }
            return (posted, Ok(PostStatus::Posted));
        }
        let (limit, max_msg) = (self.options.send_queue as usize, self.attr.max_msg_sz);
        let Some((Connection { data, .. }, q)) = self.connections.sending(first.peer) else {
            unreachable!("checked above");
        };
        let (mut grew, mut failed) = (false, None);
        let mut outcome = (total, Ok(PostStatus::Posted));
        for (i, wr) in rest.enumerate() {
            let checked = check_request(&wr, max_msg, &self.name).and_then(|rkey| {
                let mr = self.regions.source(wr.local_key, wr.local_addr, wr.len)?;
                Ok((mr.lkey, rkey))
            });
            let (lkey, rkey) = match checked {
                Ok(keys) => keys,
                Err(e) => {
                    outcome = (1 + i, Err(e));
                    break;
                }
            };
            let w = work_request_of(
                next_send_id(&mut self.next_wr),
                &wr,
                (wr.local_addr, lkey),
                rkey,
            );
            match push_request(data, q, w, limit, &mut grew) {
                Ok(true) => {}
                Ok(false) => {
                    outcome = (1 + i, Ok(PostStatus::Busy));
                    break;
                }
                Err(e) => {
                    // Request `1 + i` was accepted: the connection's failure reports it; the
                    // rest wait for the engine to post them again (on a fresh connection).
                    failed = Some(e);
                    let posted = 2 + i;
                    let status = if posted == total {
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
        if failed.is_none() && !q.chain.is_empty() {
            // The NIC refused the chain's tail for want of room: the last requests accepted
            // here were not queued after all.
            outcome = (outcome.0 - q.chain.len(), Ok(PostStatus::Busy));
            q.chain.clear();
        }
        if grew {
            cq_may_have_resized(&self.notify);
        }
        if let Some(e) = failed {
            let peer = first.peer.clone();
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
        if self.connections.get(peer).is_none() {
            self.start_connect(peer)?;
        }
        match self.connections.get_mut(peer) {
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

    /// Posts what is queued for a connected peer, until its send queue is full.
    pub(super) fn flush(&mut self, peer: &NetAddr) {
        let mut failed = None;
        if let Some((
            Connection {
                data,
                msg,
                queued,
                ready: true,
            },
            dq,
        )) = self.connections.sending(peer)
        {
            let limit = self.options.send_queue as usize;
            let mut grew = false;
            while let Some(q) = queued.pop_front() {
                let r = match &q {
                    Queued::Rdma(w) => push_request(data, dq, *w, limit, &mut grew),
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
            if failed.is_none() {
                match post_chain(data, dq) {
                    // What the NIC refused for want of room waits again, in its order.
                    Ok(()) => dq
                        .chain
                        .drain(..)
                        .rev()
                        .for_each(|w| queued.push_front(Queued::Rdma(w))),
                    Err(e) => failed = Some(e),
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
