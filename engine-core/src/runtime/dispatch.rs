//! Why one file: it is one state machine — the tracker, the per-(NIC, peer) queues, the burst
//! and the page cursor are kept consistent by the same `handle_*`/`poll_*` calls, and a rule
//! split from the queues it guards would be read apart from them; its unit tests and the Pair
//! harness live beside it in `dispatch/`.
//!
//! The dispatch core: everything the worker decides between a submission and its completion,
//! with no thread, no clock and no Domain inside (the verbs handshake's way, quinn-proto's
//! model). The worker feeds it what happened and carries out what it asks for:
//!
//! - [`handle_rdma`](Dispatch::handle_rdma), `handle_pages` and `handle_send` (`now` passed
//!   in) check a transfer against the NICs' capabilities, track it and queue its work
//!   requests in submission order;
//! - [`poll_post`](Dispatch::poll_post) hands out the next post for one NIC — a list of up to
//!   [`LIST_LEN`] listed requests, a batch of a paged request's pages, one queued request or a
//!   message — and [`handle_posted`](Dispatch::handle_posted) takes the NIC's answer (how many
//!   it took, and `Posted`, `Busy` or an error);
//! - [`handle_events`](Dispatch::handle_events) counts completions into the tracker and
//!   gathers arrivals (runs of one immediate from one sender) for the worker, which owns
//!   the locked ImmCounter;
//! - [`poll_messages`](Dispatch::poll_messages) routes the messages that arrived (to the
//!   receive handler, to the inbox, or dropped and why) and
//!   [`take_reposts`](Dispatch::take_reposts) says how many receive buffers go back now;
//! - [`check_registration`](Dispatch::check_registration) says whether every NIC can
//!   register a region, and `handle_registered`/`handle_deregistered` count what the worker
//!   did;
//! - [`poll_deliveries`](Dispatch::poll_deliveries) returns finished transfers, recording
//!   their statistics; [`poll_timeout`](Dispatch::poll_timeout) says when the next deadline
//!   falls and [`handle_timeout`](Dispatch::handle_timeout) ends what is past it.
//!
//! Rules it keeps:
//! - **Exactly once**: every accepted submission finishes once (the [`Tracker`]'s
//!   generation-tagged ids make a late completion stale), with its root cause when several of
//!   its requests failed (a refused key outranks the flushes it caused).
//! - **Backpressure per (NIC, peer)**: a request the NIC has no room for (`Busy`) waits in its
//!   (NIC, peer) queue, and everything after it for that pair queues behind it, so the order
//!   in which work reaches a NIC for one peer is the order it was submitted in; other peers'
//!   work goes on. Queues are retried once per [`retry_queued`](Dispatch::retry_queued).
//! - **Coalescing**: listed requests accepted in a row go to a NIC as one list; a paged
//!   request's pages go in batches ([`PagedWork::batch`]); successes of one request in a row
//!   and arrivals of one immediate from one sender in a row are counted at once.
//! - **Cancellation**: a cancelled transfer's queued requests are dropped (each counts as
//!   done, cancelled) and it finishes as `Cancelled` when its posted ones are in, unless one
//!   of them failed.
//! - After a Domain failed for good ([`set_fatal`](Dispatch::set_fatal), or a `Fatal` answer
//!   to a post) nothing more is handed out: what is left waits in the queues, and the worker
//!   fails everything.

use std::collections::VecDeque;
use std::sync::Arc;
use std::time::Duration;

use foldhash::HashMap;
use smallvec::SmallVec;

use super::clock::{Anchor, Stamp};
use super::completion::OnDone;
use super::control::{Telemetry, TransferControl};
use super::tracker::{Finished, Tracker};
use super::work::{Ops, PageCursor, PagedWork, RdmaWork, Shift, INTERLEAVED_BATCH};
use crate::domain::{
    Capabilities, Device, DomainError, DomainErrorKind, Event, MemoryRegion, PostStatus, RdmaOp,
    RdmaPost, RdmaRequest,
};
use crate::error::Error;
use crate::notifications::Notification;
use crate::stats::{OpKind, Recorder, Started, Stats};
use crate::wire::{Message, MessageError, NetAddr, CHANNEL_NOTIFICATION, MESSAGE_HEADER_LEN};

#[cfg(test)]
mod pair;
#[cfg(test)]
mod tests;

/// Requests per [`RdmaPost::List`] (a list lives on the worker's stack), and the burst after which the worker posts at once.
pub(crate) const LIST_LEN: usize = 32;

/// Where [`Dispatch::poll_post`] builds a list of requests: on the caller's stack.
pub(crate) type PostList<'a> = SmallVec<[RdmaRequest<'a>; LIST_LEN]>;

/// What a NIC answered to a post: how many requests it took, and `Posted` when it took them
/// all, else `Busy` or the error of the first one it did not take.
pub(crate) type PostAnswer = (usize, Result<PostStatus, DomainError>);

/// One post for one NIC, borrowed from the core until [`Dispatch::handle_posted`].
#[derive(Debug)]
pub(crate) enum Post<'a> {
    /// Writes and reads ([`Domain::post_rdma`](crate::domain::Domain::post_rdma)): listed
    /// requests, a batch of a paged request's pages, or one request that waited in its queue.
    Rdma { nic: usize, rdma: RdmaPost<'a> },
    /// A message ([`Domain::post_send`](crate::domain::Domain::post_send)).
    Send {
        nic: usize,
        wr_id: u64,
        peer: &'a NetAddr,
        data: &'a [u8],
    },
}

/// Where a message that arrived goes (see [`Dispatch::poll_messages`]).
#[derive(Debug, PartialEq, Eq)]
pub(crate) enum Routed {
    /// A user's message (whole, its channel byte first) for the receive handler, on the
    /// callback thread, with the sender the transport proved; its buffer goes back to the
    /// NIC once the handler returned.
    User {
        data: Vec<u8>,
        sender: Option<NetAddr>,
    },
    /// A notification, for the inbox; its buffer is given back at once (see
    /// [`take_reposts`](Dispatch::take_reposts)).
    Notification(Notification),
    /// Dropped, and why; its buffer (if it had one) is given back at once.
    Dropped(Unrouted),
}

/// Why a message that arrived was dropped.
#[derive(Debug, PartialEq, Eq)]
pub(crate) enum Unrouted {
    /// No receive handler is set: no receive buffers were posted either, so none is owed.
    NoHandler,
    /// A user's payload larger than the receive buffers (only a backend that overran the
    /// buffer it was given sends one).
    TooLarge { len: usize, max: usize },
    /// Not a message this engine understands.
    Malformed(MessageError),
}

/// Where `data` goes when user payloads of up to `payload_max` bytes are handled (`None`: no
/// receive handler is set).
/// `sender` is who the transport says sent it, never read from `data`.
fn route(data: Vec<u8>, sender: Option<NetAddr>, payload_max: Option<usize>) -> Routed {
    let Some(max) = payload_max else {
        return Routed::Dropped(Unrouted::NoHandler);
    };
    match crate::wire::decode_message(&data) {
        Ok(Message::User(payload)) if payload.len() <= max => Routed::User { data, sender },
        Ok(Message::User(payload)) => Routed::Dropped(Unrouted::TooLarge {
            len: payload.len(),
            max,
        }),
        Ok(Message::Notification { from, id }) => Routed::Notification(Notification {
            id: id.to_vec(),
            from,
            sender,
        }),
        Err(e) => Routed::Dropped(Unrouted::Malformed(e)),
    }
}

/// What a transfer's waiter may carry beyond being completed: the control of a cancellable
/// transfer, which learns its tracker id and telemetry when it is accepted.
pub(crate) trait Waiter {
    /// The transfer's control, if it has one.
    fn control(&self) -> Option<&Arc<TransferControl>> {
        None
    }
}

impl Waiter for OnDone {
    fn control(&self) -> Option<&Arc<TransferControl>> {
        OnDone::control(self)
    }
}

/// A transfer's waiter, with what the counters need of it once it finishes.
pub(crate) struct Tracked<W> {
    waiter: W,
    started: Option<Started>,
}

/// A work request waiting for room on its NIC.
enum Pending {
    Rdma(RdmaWork),
    Send { peer: NetAddr, data: Vec<u8> },
}

impl Pending {
    fn peer(&self) -> &NetAddr {
        match self {
            Self::Rdma(op) => &op.peer,
            Self::Send { peer, .. } => peer,
        }
    }
}

/// Work accepted and not yet handed to a NIC, in submission order.
enum Outgoing {
    Rdma(RdmaWork),
    Pages {
        work: Box<PagedWork>,
        cursor: PageCursor,
    },
    Send {
        peer: NetAddr,
        data: Vec<u8>,
    },
    /// Handed out or queued already (moved away).
    Gone,
}

/// What the post handed out last was, for its answer.
#[derive(Debug, Clone, Copy)]
enum InHand {
    /// `len` listed requests for `nic` from the outbox's `sent`.
    List { nic: usize, len: usize },
    /// A batch of the paged request at the outbox's `sent`.
    Pages,
    /// The message at the outbox's `sent`.
    Send,
    /// The front of the queue `retry.last()` names.
    Queued,
}

/// See the module docs.
pub(crate) struct Dispatch<W> {
    /// The backend's name, for errors.
    backend: String,
    /// Each NIC's limits, checked before anything is posted to it.
    caps: Vec<Capabilities>,
    transfer_timeout: Duration,
    /// The same in nanoseconds (added to `now` for every transfer).
    timeout_ns: u64,
    /// Turns stamps into the `Instant`s of transfer telemetry.
    anchor: Anchor,
    tracker: Tracker<Tracked<W>>,
    /// Work not yet handed out, in submission order, from `sent` on; emptied (keeping its
    /// memory) once all of it was.
    outbox: Vec<(u64, Outgoing)>,
    sent: usize,
    /// The outbox holds something to post before the next submission: a list's worth of
    /// requests, a paged request or a message (listed requests otherwise wait to form a
    /// list until the worker posts at the end of its batch of submissions).
    urgent: bool,
    in_hand: Option<InHand>,
    /// Work refused with `Busy`, per (NIC, peer), in submission order within each.
    pending: HashMap<(usize, NetAddr), VecDeque<(u64, Pending)>>,
    /// Queues still to retry in this round (see `retry_queued`).
    retry: Vec<(usize, NetAddr)>,
    /// Whether queued work moved (posted, failed, dropped) since `take_progress`.
    progress: bool,
    scratch: [Shift; INTERLEAVED_BATCH],
    finished: Vec<Finished<Tracked<W>>>,
    /// Runs of arrivals of one immediate from one sender, in arrival order.
    arrivals: Vec<(u32, Option<NetAddr>, u64)>,
    /// Messages that arrived, each with the sender the transport proved.
    messages: Vec<(Vec<u8>, Option<NetAddr>)>,
    /// Receive buffers to give back to NIC 0 now: those of messages routed anywhere but to
    /// the receive handler (which gives its own back when it returns).
    reposts: usize,
    /// A Domain failed for good: nothing more is handed out.
    fatal: Option<String>,
    /// The engine's counters (see `crate::stats`).
    recorder: Recorder,
}

/// Whether work for `peer` on `nic` waits already (then new work queues behind it).
#[inline]
fn ahead(
    pending: &HashMap<(usize, NetAddr), VecDeque<(u64, Pending)>>,
    nic: usize,
    peer: &NetAddr,
) -> bool {
    // With nothing queued at all (the usual case) the queue's key is never built.
    !pending.is_empty() && pending.contains_key(&(nic, peer.clone()))
}

/// Turns a Domain's error into the engine's typed error. A timeout becomes
/// [`Error::Timeout`] only with the deadline the backend said passed; one that did not say
/// stays a [`Error::Backend`] of kind `Timeout` rather than claiming a length.
pub(crate) fn map_domain_error(backend: &str, e: DomainError) -> Error {
    match (e.kind, e.deadline()) {
        (DomainErrorKind::RemoteAccess, _) => Error::RemoteAccess(e),
        (DomainErrorKind::PeerUnreachable, _) => Error::PeerUnreachable(e),
        (DomainErrorKind::InvalidArgument, _) => Error::Refused {
            backend: backend.to_owned(),
            source: e,
        },
        (DomainErrorKind::Timeout, Some(after)) => Error::Timeout(after),
        _ => Error::Backend {
            backend: backend.to_owned(),
            source: e,
        },
    }
}

impl<W: Waiter> Dispatch<W> {
    /// A core for NICs with `caps`; transfers time out `transfer_timeout` after they are
    /// accepted. `anchor` only turns stamps into telemetry's `Instant`s.
    pub(crate) fn new(
        backend: String,
        caps: Vec<Capabilities>,
        transfer_timeout: Duration,
        anchor: Anchor,
    ) -> Self {
        Self {
            backend,
            caps,
            transfer_timeout,
            timeout_ns: u64::try_from(transfer_timeout.as_nanos()).unwrap_or(u64::MAX),
            anchor,
            tracker: Tracker::new(),
            outbox: Vec::new(),
            sent: 0,
            urgent: false,
            in_hand: None,
            pending: HashMap::default(),
            retry: Vec::new(),
            progress: false,
            scratch: [Shift::default(); INTERLEAVED_BATCH],
            finished: Vec::new(),
            arrivals: Vec::new(),
            messages: Vec::new(),
            reposts: 0,
            fatal: None,
            recorder: Recorder::default(),
        }
    }

    /// Transfers in flight.
    pub(crate) fn in_flight(&self) -> usize {
        self.tracker.len()
    }

    /// Whether work waits in a (NIC, peer) queue.
    pub(crate) fn has_queued(&self) -> bool {
        !self.pending.is_empty()
    }

    /// Whether the worker should carry out the posts before the next submission.
    #[inline]
    pub(crate) fn has_urgent_posts(&self) -> bool {
        self.urgent
    }

    /// Accepts listed writes or reads at `now`: they join the burst, handed out in lists.
    /// Returns the id their work requests carry, or `None` when the transfer finished at once
    /// (nothing to do, refused, cancelled while queued).
    #[inline]
    pub(crate) fn handle_rdma(
        &mut self,
        now: Stamp,
        ops: Ops,
        waiter: W,
        submitted: Stamp,
    ) -> Option<u64> {
        let id = self.start_rdma(now, ops.iter().map(|op| (op, 1)), waiter, submitted)?;
        match ops.into_inner() {
            // A single write or read (the commonest submission), without an iterator.
            Ok([op]) => self.outbox.push((id, Outgoing::Rdma(op))),
            Err(ops) => self
                .outbox
                .extend(ops.into_iter().map(|op| (id, Outgoing::Rdma(op)))),
        }
        self.urgent |= self.outbox.len() - self.sent >= LIST_LEN;
        Some(id)
    }

    /// Accepts a paged transfer at `now` (returns as [`handle_rdma`](Self::handle_rdma)).
    pub(crate) fn handle_pages(
        &mut self,
        now: Stamp,
        work: Box<PagedWork>,
        waiter: W,
        submitted: Stamp,
    ) -> Option<u64> {
        let id = self.start_rdma(now, work.shapes(), waiter, submitted)?;
        let cursor = PageCursor::default();
        self.outbox.push((id, Outgoing::Pages { work, cursor }));
        self.urgent = true;
        Some(id)
    }

    /// Accepts a message to `peer`'s main address (NIC 0) at `now` (returns as
    /// [`handle_rdma`](Self::handle_rdma)).
    pub(crate) fn handle_send(
        &mut self,
        now: Stamp,
        peer: NetAddr,
        data: Vec<u8>,
        waiter: W,
        submitted: Stamp,
    ) -> Option<u64> {
        if let Some(max) = self.caps[0].max_message_size.filter(|&m| data.len() > m) {
            // Counted as the user sees it: without the channel byte.
            let refused = format!(
                "a message of {} bytes is larger than backend {}'s limit of {}",
                data.len() - MESSAGE_HEADER_LEN,
                self.backend,
                max.saturating_sub(MESSAGE_HEADER_LEN)
            );
            self.finish_now(waiter, Err(self.refused(refused)));
            return None;
        }
        let kind = if data.first() == Some(&CHANNEL_NOTIFICATION) {
            OpKind::Notification
        } else {
            OpKind::Send
        };
        let bytes = data.len() as u64;
        let id = self.track(now, 1, waiter, |core| {
            let waited_us = now.micros_since(submitted);
            let index = core.recorder.accepted(kind, 0, &peer, 1, bytes, waited_us);
            Started {
                kind,
                peer: Some(index),
                bytes,
                at: submitted,
                nics: 1,
            }
        })?;
        self.outbox.push((id, Outgoing::Send { peer, data }));
        self.urgent = true;
        Some(id)
    }

    /// Finishes `waiter` with `result` without tracking it (refused before it started, or
    /// failed with the engine).
    pub(crate) fn finish_now(&mut self, waiter: W, result: Result<(), Error>) {
        let tracked = Tracked {
            waiter,
            started: None,
        };
        self.finished.push((tracked, result.map_err(Box::new)));
    }

    /// Cancels the transfer `id` (see the module docs); a no-op once it finished.
    pub(crate) fn cancel(&mut self, id: u64) {
        if !self.tracker.cancel(id) {
            return;
        }
        let mut dropped = 0;
        for (queued, work) in &mut self.outbox[self.sent..] {
            if *queued == id && !matches!(work, Outgoing::Gone) {
                dropped += match std::mem::replace(work, Outgoing::Gone) {
                    Outgoing::Pages { work, cursor } => {
                        // Its batches from the cursor on, each page a request.
                        let (mut c, mut all) = (cursor, 0u64);
                        while let Some((_, shifts)) = work.batch(&mut c, &mut self.scratch) {
                            all += (shifts.len() - c.done.min(shifts.len())) as u64;
                            c.advance();
                        }
                        all
                    }
                    _ => 1,
                };
            }
        }
        for queue in self.pending.values_mut() {
            let before = queue.len();
            queue.retain(|(queued, _)| *queued != id);
            dropped += (before - queue.len()) as u64;
        }
        self.pending.retain(|_, q| !q.is_empty());
        for _ in 0..dropped {
            if let Some(done) = self.tracker.handle_done(id, Err(Error::Cancelled)) {
                self.finished.push(done);
            }
        }
    }

    /// Checks and tracks a transfer's writes or reads; `shapes` are its distinct requests
    /// with how many each stands for (see `PagedWork::shapes`). Returns the id to post them
    /// under, or `None` when the transfer already finished (nothing to do, refused,
    /// cancelled).
    fn start_rdma<'a>(
        &mut self,
        now: Stamp,
        shapes: impl Iterator<Item = (&'a RdmaWork, u64)> + Clone,
        waiter: W,
        submitted: Stamp,
    ) -> Option<u64> {
        let requests = shapes.clone().map(|(_, uses)| uses).sum();
        if requests == 0 {
            self.finish_now(waiter, Ok(()));
            return None;
        }
        if let Some(refused) = shapes
            .clone()
            .find_map(|(op, _)| self.beyond_capabilities(op))
        {
            // Refused whole, before any part is posted: the backend said it cannot.
            self.finish_now(waiter, Err(self.refused(refused)));
            return None;
        }
        self.track(now, requests, waiter, |core| {
            core.count_rdma(now, shapes, requests, submitted)
        })
    }

    /// Starts tracking a transfer of `requests` work requests (counted by `count`), unless
    /// it was cancelled while queued: then it finishes with `Cancelled`, nothing is posted,
    /// and this returns `None`.
    fn track(
        &mut self,
        now: Stamp,
        requests: u64,
        waiter: W,
        count: impl FnOnce(&mut Self) -> Started,
    ) -> Option<u64> {
        let deadline = now.after_nanos(self.timeout_ns);
        let Some(control) = waiter.control().cloned() else {
            let started = count(self);
            let tracked = Tracked {
                waiter,
                started: Some(started),
            };
            return Some(self.tracker.insert(requests, deadline, tracked));
        };
        let mut waiter = Some(waiter);
        let taken = control.take(|| {
            let started = count(self);
            let telemetry = Telemetry {
                submitted: Some(self.anchor.instant(started.at)),
                posted: Some(self.anchor.instant(now.max(started.at))),
                completed: None,
                bytes: started.bytes,
                requests,
                nics: (0..8).filter(|i| started.nics & (1 << i) != 0).collect(),
            };
            let tracked = Tracked {
                waiter: waiter.take().expect("taken once"),
                started: Some(started),
            };
            (self.tracker.insert(requests, deadline, tracked), telemetry)
        });
        match taken {
            Ok(()) => control.posted_id(),
            Err(e) => {
                let waiter = waiter.take().expect("not taken when refused");
                self.finish_now(waiter, Err(e));
                None
            }
        }
    }

    /// Counts an accepted transfer from its shapes (one lookup per run of shapes to the same
    /// peer, so a transfer to one peer costs one); returns what its completion needs.
    fn count_rdma<'a>(
        &mut self,
        now: Stamp,
        shapes: impl Iterator<Item = (&'a RdmaWork, u64)>,
        requests: u64,
        submitted: Stamp,
    ) -> Started {
        let mut shapes = shapes.peekable();
        let (first, first_uses) = shapes
            .next()
            .expect("the caller checked that there is work");
        let kind = match first.op {
            RdmaOp::Read => OpKind::Read,
            RdmaOp::Write { .. } => OpKind::Write,
        };
        let waited_us = now.micros_since(submitted);
        if shapes.peek().is_none() {
            // One shape (a single write or read, or pages of one plan operation): one NIC,
            // one peer, counted in the recorder's run of such operations.
            let bytes = first.len * first_uses;
            let peer =
                self.recorder
                    .accepted(kind, first.nic, &first.peer, first_uses, bytes, waited_us);
            return Started {
                kind,
                peer: Some(peer),
                bytes,
                at: submitted,
                nics: 1 << first.nic,
            };
        }
        self.recorder.started(kind, requests, waited_us);
        let mut bytes = 0;
        let mut nics = 0u8;
        let mut single_peer = true;
        let mut run = (&first.peer, 0u64, 0u64);
        for (op, uses) in std::iter::once((first, first_uses)).chain(shapes) {
            let op_bytes = op.len * uses;
            bytes += op_bytes;
            nics |= 1 << op.nic;
            self.recorder.on_nic(op.nic, uses, op_bytes);
            if op.peer != *run.0 {
                single_peer = false;
                self.recorder.posted_to(run.0, run.1, run.2);
                run = (&op.peer, 0, 0);
            }
            run.1 += uses;
            run.2 += op_bytes;
        }
        let last = self.recorder.posted_to(run.0, run.1, run.2);
        Started {
            kind,
            peer: single_peer.then_some(last),
            bytes,
            at: submitted,
            nics,
        }
    }

    /// Why the backend's declared capabilities rule out `op`, if they do. (The check inline,
    /// once per operation of every transfer; the message only when it fails.)
    #[inline]
    fn beyond_capabilities(&self, op: &RdmaWork) -> Option<String> {
        let caps = &self.caps[op.nic];
        let fits = caps.max_write_size.is_none_or(|m| op.len <= m)
            && (op.len > 0 || caps.zero_byte_writes)
            && (op.op.imm().is_none() || caps.immediates);
        if fits {
            None
        } else {
            self.refusal(op)
        }
    }

    /// The error of a request the backend's capabilities rule out, named by `why`.
    #[cold]
    fn refused(&self, why: String) -> Error {
        Error::Refused {
            backend: self.backend.clone(),
            source: DomainError::new(DomainErrorKind::InvalidArgument, why),
        }
    }

    #[cold]
    fn refusal(&self, op: &RdmaWork) -> Option<String> {
        let caps = &self.caps[op.nic];
        let backend = &self.backend;
        let what = match op.op {
            RdmaOp::Read => "read",
            RdmaOp::Write { .. } => "write",
        };
        if let Some(max) = caps.max_write_size.filter(|&m| op.len > m) {
            return Some(format!(
                "a {what} of {} bytes on NIC {} is larger than backend {backend}'s limit of {max} (lower stripe.max_chunk or split the transfer)",
                op.len, op.nic
            ));
        }
        if op.len == 0 && !caps.zero_byte_writes {
            return Some(format!(
                "backend {backend} does not support zero-byte writes"
            ));
        }
        if op.op.imm().is_some() && !caps.immediates {
            return Some(format!(
                "backend {backend} does not support writes with an immediate"
            ));
        }
        None
    }

    fn queue(&mut self, nic: usize, id: u64, work: Pending) {
        let key = (nic, work.peer().clone());
        self.pending.entry(key).or_default().push_back((id, work));
    }

    fn fail_request(&mut self, id: u64, e: DomainError) {
        if e.kind == DomainErrorKind::Fatal {
            self.fatal.get_or_insert_with(|| e.message.clone());
        }
        let err = map_domain_error(&self.backend, e);
        if let Some(done) = self.tracker.handle_done(id, Err(err)) {
            self.finished.push(done);
        }
    }

    /// A Domain failed for good (`why`): nothing is handed out from now on.
    pub(crate) fn set_fatal(&mut self, why: String) {
        self.fatal.get_or_insert(why);
    }

    /// Why a Domain failed for good, if one did.
    pub(crate) fn fatal(&self) -> Option<&String> {
        self.fatal.as_ref()
    }

    /// Starts a round of retries: each (NIC, peer) queue is offered again, in order, until
    /// its NIC is busy again (once per pass of the worker, not in a loop).
    pub(crate) fn retry_queued(&mut self) {
        self.retry.clear();
        self.retry.extend(self.pending.keys().cloned());
        // In a fixed order, not the map's (seeded per process): the same inputs give the
        // same posts, so a test's schedule replays exactly.
        self.retry.sort_unstable();
    }

    /// Whether queued work moved (posted, failed, or dropped because its transfer ended)
    /// since the last call.
    pub(crate) fn take_progress(&mut self) -> bool {
        std::mem::take(&mut self.progress)
    }

    /// The next post to carry out, built in `list` where it is a list; `None` when nothing
    /// is left to hand out (new work, or queued work in a round of retries). Every post
    /// handed out must be answered with [`handle_posted`](Self::handle_posted) before the
    /// next call.
    pub(crate) fn poll_post<'a: 'b, 'b>(
        &'a mut self,
        list: &'b mut PostList<'a>,
    ) -> Option<Post<'b>> {
        debug_assert!(self.in_hand.is_none(), "a post was not answered");
        let hand = self.next_post()?;
        self.in_hand = Some(hand);
        let Self {
            outbox,
            sent,
            scratch,
            retry,
            pending,
            ..
        } = self;
        let sent = *sent;
        Some(match hand {
            InHand::List { nic, len } => {
                // (An iterator chain: `extend` builds each request in place, where a loop
                // of pushes copied every one once more.)
                list.extend(outbox[sent..sent + len].iter().map(|(id, w)| match w {
                    Outgoing::Rdma(op) => op.request(*id, Shift::default()),
                    _ => unreachable!("a list holds listed requests only"),
                }));
                Post::Rdma {
                    nic,
                    rdma: RdmaPost::List(list),
                }
            }
            InHand::Pages => {
                let (id, Outgoing::Pages { work, cursor }) = &outbox[sent] else {
                    unreachable!("in hand")
                };
                let mut c = *cursor;
                let (op, shifts) = work.batch(&mut c, scratch).expect("in hand");
                Post::Rdma {
                    nic: op.nic,
                    rdma: RdmaPost::Pages {
                        template: op.request(*id, Shift::default()),
                        shifts: &shifts[c.done..],
                    },
                }
            }
            InHand::Send => {
                let (id, Outgoing::Send { peer, data }) = &outbox[sent] else {
                    unreachable!("in hand")
                };
                Post::Send {
                    nic: 0,
                    wr_id: *id,
                    peer,
                    data,
                }
            }
            InHand::Queued => {
                let key = retry.last().expect("in hand");
                let (id, work) = pending[key].front().expect("in hand");
                match work {
                    Pending::Rdma(op) => Post::Rdma {
                        nic: key.0,
                        rdma: RdmaPost::One(op.request(*id, Shift::default())),
                    },
                    Pending::Send { peer, data } => Post::Send {
                        nic: key.0,
                        wr_id: *id,
                        peer,
                        data,
                    },
                }
            }
        })
    }

    /// Finds the next post, queueing on the way what must wait behind its peer's queue.
    fn next_post(&mut self) -> Option<InHand> {
        while self.sent < self.outbox.len() {
            let fatal = self.fatal.is_some();
            let (id, item) = &mut self.outbox[self.sent];
            let id = *id;
            match item {
                Outgoing::Rdma(op) => {
                    let nic = op.nic;
                    let pending = &self.pending;
                    let len = if fatal {
                        0
                    } else {
                        self.outbox[self.sent..]
                            .iter()
                            .take(LIST_LEN)
                            .take_while(|(_, w)| match w {
                                Outgoing::Rdma(op) => {
                                    op.nic == nic && !ahead(pending, nic, &op.peer)
                                }
                                _ => false,
                            })
                            .count()
                    };
                    if len > 0 {
                        return Some(InHand::List { nic, len });
                    }
                    // Its peer has work queued already (or a Domain failed for good: then
                    // all waits, and fails with everything else).
                    self.queue_sent(nic);
                }
                Outgoing::Pages { work, cursor } => {
                    let Some((op, shifts)) = work.batch(cursor, &mut self.scratch) else {
                        self.sent += 1;
                        continue;
                    };
                    if cursor.done >= shifts.len() {
                        cursor.advance();
                        continue;
                    }
                    if !fatal && !ahead(&self.pending, op.nic, &op.peer) {
                        return Some(InHand::Pages);
                    }
                    self.queue_pages_left(id);
                }
                Outgoing::Send { peer, .. } => {
                    if !fatal && !ahead(&self.pending, 0, peer) {
                        return Some(InHand::Send);
                    }
                    self.queue_sent(0);
                }
                Outgoing::Gone => self.sent += 1,
            }
        }
        if !self.outbox.is_empty() {
            // Everything was handed out: keep the memory for the next burst.
            self.outbox.clear();
            self.sent = 0;
        }
        self.urgent = false;
        self.next_queued()
    }

    /// Moves the outbox's item at `sent` (a listed request or a message) to its queue.
    fn queue_sent(&mut self, nic: usize) {
        let (id, item) = &mut self.outbox[self.sent];
        let id = *id;
        self.sent += 1;
        match std::mem::replace(item, Outgoing::Gone) {
            Outgoing::Rdma(op) => self.queue(nic, id, Pending::Rdma(op)),
            Outgoing::Send { peer, data } => self.queue(nic, id, Pending::Send { peer, data }),
            Outgoing::Pages { .. } | Outgoing::Gone => unreachable!("listed or a message"),
        }
    }

    /// Queues the pages of the current batch of the paged request at `sent` not yet handed
    /// out, and moves on to its next batch.
    fn queue_pages_left(&mut self, id: u64) {
        let (_, Outgoing::Pages { work, cursor }) = &mut self.outbox[self.sent] else {
            unreachable!("a paged request")
        };
        let Some((op, shifts)) = work.batch(cursor, &mut self.scratch) else {
            return;
        };
        let key = (op.nic, op.peer.clone());
        let queue = self.pending.entry(key).or_default();
        for &shift in &shifts[cursor.done..] {
            queue.push_back((id, Pending::Rdma(op.shifted(shift))));
        }
        cursor.advance();
    }

    /// The next queued request of this round of retries.
    fn next_queued(&mut self) -> Option<InHand> {
        while let Some(key) = self.retry.last() {
            if self.fatal.is_some() {
                // Not now: it stays queued and fails with everything else.
                self.retry.clear();
                return None;
            }
            let Some(queue) = self.pending.get_mut(key) else {
                self.retry.pop();
                continue;
            };
            match queue.front() {
                None => {
                    self.pending.remove(key);
                    self.retry.pop();
                }
                // Its transfer already ended (timed out, cancelled): dropped.
                Some(&(id, _)) if !self.tracker.is_live(id) => {
                    queue.pop_front();
                    self.progress = true;
                }
                Some(_) => return Some(InHand::Queued),
            }
        }
        None
    }

    /// Takes a NIC's answer to the post [`poll_post`](Self::poll_post) handed out last: what
    /// it took is posted; a request it refused fails its transfer; one it had no room for
    /// waits in its (NIC, peer) queue, and what follows for that peer queues behind it.
    pub(crate) fn handle_posted(&mut self, (posted, status): PostAnswer) {
        let Some(hand) = self.in_hand.take() else {
            debug_assert!(false, "an answer to no post");
            return;
        };
        match hand {
            InHand::List { len, .. } => {
                // A Domain that counted more than it was given is broken: trust the length.
                let posted = posted.min(len);
                self.sent += posted;
                if posted == len {
                    return;
                }
                let (id, item) = &self.outbox[self.sent];
                let (id, nic) = match item {
                    Outgoing::Rdma(op) => (*id, op.nic),
                    _ => unreachable!("a list holds listed requests only"),
                };
                match status {
                    Ok(_) => self.queue_sent(nic),
                    Err(e) => {
                        self.sent += 1;
                        self.fail_request(id, e);
                    }
                }
            }
            InHand::Pages => {
                let (id, Outgoing::Pages { work, cursor }) = &mut self.outbox[self.sent] else {
                    unreachable!("in hand")
                };
                let id = *id;
                let mut c = *cursor;
                let Some((_, shifts)) = work.batch(&mut c, &mut self.scratch) else {
                    unreachable!("in hand")
                };
                let len = shifts.len();
                cursor.done = (cursor.done + posted).min(len);
                match status {
                    Ok(PostStatus::Posted) if cursor.done == len => cursor.advance(),
                    // A Domain that said "all posted" but counted fewer is broken: what it
                    // did not count is neither posted nor lost, but queued.
                    Ok(_) => self.queue_pages_left(id),
                    // The page the error belongs to fails its request; the batch goes on
                    // after it.
                    Err(e) => {
                        cursor.done += 1;
                        self.fail_request(id, e);
                    }
                }
            }
            InHand::Send => match status {
                Ok(PostStatus::Posted) => self.sent += 1,
                Ok(PostStatus::Busy) => self.queue_sent(0),
                Err(e) => {
                    let id = self.outbox[self.sent].0;
                    self.outbox[self.sent].1 = Outgoing::Gone;
                    self.sent += 1;
                    self.fail_request(id, e);
                }
            },
            InHand::Queued => {
                let key = self.retry.last().expect("in hand");
                let queue = self.pending.get_mut(key).expect("in hand");
                match status {
                    Ok(PostStatus::Posted) => {
                        queue.pop_front();
                        self.progress = true;
                    }
                    Ok(PostStatus::Busy) => {
                        // Done with this queue for this round.
                        self.retry.pop();
                    }
                    Err(e) => {
                        let (id, _) = queue.pop_front().expect("in hand");
                        self.progress = true;
                        self.fail_request(id, e);
                    }
                }
            }
        }
    }

    /// Counts a NIC's events: completions into the tracker (a run of successes of one
    /// request at once), arrivals into runs of one immediate from one sender (see
    /// [`poll_arrivals`](Self::poll_arrivals)), messages aside (see
    /// [`poll_messages`](Self::poll_messages)). Drains `events`.
    pub(crate) fn handle_events(&mut self, events: &mut Vec<Event>) {
        let mut run: Option<(u64, u64)> = None;
        let mut arrived = 0;
        for event in events.drain(..) {
            match event {
                Event::ImmArrival { imm, from } => {
                    arrived += 1;
                    match self.arrivals.last_mut() {
                        Some((v, f, n)) if *v == imm && *f == from => *n += 1,
                        _ => self.arrivals.push((imm, from, 1)),
                    }
                }
                Event::Done {
                    wr_id,
                    result: Ok(()),
                } => match &mut run {
                    Some((id, n)) if *id == wr_id => *n += 1,
                    _ => {
                        if let Some((id, n)) = run.replace((wr_id, 1)) {
                            self.count_successes(id, n);
                        }
                    }
                },
                Event::Done {
                    wr_id,
                    result: Err(e),
                } => {
                    // In arrival order: the successes before it count first.
                    if let Some((id, n)) = run.take() {
                        self.count_successes(id, n);
                    }
                    let e = map_domain_error(&self.backend, e);
                    if let Some(done) = self.tracker.handle_done(wr_id, Err(e)) {
                        self.finished.push(done);
                    }
                }
                Event::Message { data, from } => self.messages.push((data, from)),
            }
        }
        if let Some((id, n)) = run {
            self.count_successes(id, n);
        }
        self.recorder.rest.imm_arrivals += arrived;
    }

    #[inline]
    fn count_successes(&mut self, wr_id: u64, n: u64) {
        if let Some(done) = self.tracker.handle_ok(wr_id, n) {
            self.finished.push(done);
        }
    }

    /// Whether arrivals wait for [`poll_arrivals`](Self::poll_arrivals).
    #[inline]
    pub(crate) fn has_arrivals(&self) -> bool {
        !self.arrivals.is_empty()
    }

    /// Runs of arrivals counted by `handle_events`, in arrival order: (immediate, sender,
    /// how many).
    pub(crate) fn poll_arrivals(&mut self) -> std::vec::Drain<'_, (u32, Option<NetAddr>, u64)> {
        self.arrivals.drain(..)
    }

    /// Whether messages wait for [`poll_messages`](Self::poll_messages).
    #[inline]
    pub(crate) fn has_messages(&self) -> bool {
        !self.messages.is_empty()
    }

    /// Messages that arrived, in order, each routed (see [`Routed`]) for a receive handler
    /// that takes user payloads of up to `payload_max` bytes (`None`: none is set). The
    /// buffers of those not for the handler are counted for [`take_reposts`](Self::take_reposts).
    pub(crate) fn poll_messages(
        &mut self,
        payload_max: Option<usize>,
    ) -> impl Iterator<Item = Routed> + '_ {
        let reposts = &mut self.reposts;
        self.messages.drain(..).map(move |(data, sender)| {
            let routed = route(data, sender, payload_max);
            if !matches!(
                routed,
                Routed::User { .. } | Routed::Dropped(Unrouted::NoHandler)
            ) {
                *reposts += 1;
            }
            routed
        })
    }

    /// How many receive buffers to give back to NIC 0 now (see
    /// [`poll_messages`](Self::poll_messages)); counted from zero again.
    pub(crate) fn take_reposts(&mut self) -> usize {
        std::mem::take(&mut self.reposts)
    }

    /// How many transfers finished and wait for [`poll_deliveries`](Self::poll_deliveries).
    #[inline]
    pub(crate) fn finished(&self) -> usize {
        self.finished.len()
    }

    /// Finished transfers with their results, in the order they finished; their statistics
    /// are recorded as finished at `now`.
    pub(crate) fn poll_deliveries(
        &mut self,
        now: Stamp,
    ) -> impl Iterator<Item = (W, Result<(), Box<Error>>)> + '_ {
        let recorder = &mut self.recorder;
        self.finished.drain(..).map(move |(tracked, result)| {
            if let Some(started) = &tracked.started {
                let outcome = result.as_ref().copied().map_err(Box::as_ref);
                recorder.finished(started, outcome, now);
            }
            (tracked.waiter, result)
        })
    }

    /// The earliest deadline of a transfer in flight.
    pub(crate) fn poll_timeout(&self) -> Option<Stamp> {
        self.tracker.next_deadline()
    }

    /// Ends every transfer whose deadline is at or before `now` with `Timeout`.
    pub(crate) fn handle_timeout(&mut self, now: Stamp) {
        let timeout = self.transfer_timeout;
        let before = self.finished.len();
        self.tracker
            .poll_expired(now, || Error::Timeout(timeout), &mut self.finished);
        if self.finished.len() > before && self.sent < self.outbox.len() {
            // A transfer that ended before its work was handed out: none of it is posted.
            // (Queued work is dropped when its queue is retried.)
            let tracker = &mut self.tracker;
            for (id, work) in &mut self.outbox[self.sent..] {
                if !tracker.is_live(*id) {
                    *work = Outgoing::Gone;
                }
            }
        }
    }

    /// Ends everything in flight or queued with `error` (the worker failed or shut down).
    pub(crate) fn fail_everything(&mut self, error: &Error) {
        self.pending.clear();
        self.retry.clear();
        self.outbox.clear();
        self.sent = 0;
        self.urgent = false;
        self.in_hand = None;
        for tracked in self.tracker.drain() {
            self.finished.push((tracked, Err(Box::new(error.clone()))));
        }
    }

    /// The counters as of `now`, with the core's own gauges.
    pub(crate) fn stats(&self, now: Stamp) -> Stats {
        let mut stats = self.recorder.snapshot(now);
        stats.stale_completions = self.tracker.stale();
        stats.queued_requests = self.pending.values().map(|q| q.len() as u64).sum();
        stats
    }

    /// Whether every NIC can register `region`, by what each declared: the refusal names the
    /// memory and the NIC. (The worker registers what passes, NIC by NIC.)
    pub(crate) fn check_registration(&self, region: &MemoryRegion) -> Result<(), Error> {
        match region.device {
            Device::Cuda(gpu) => {
                if let Some(nic) = self.caps.iter().position(|c| !c.cuda_memory && !c.dmabuf) {
                    return Err(self.refused(format!(
                        "cannot register CUDA memory (GPU {gpu}) on NIC {nic}: the backend declares host memory only"
                    )));
                }
            }
            Device::Host => {
                if !self.caps.iter().all(|c| c.host_memory) {
                    return Err(self.refused("cannot register host memory".into()));
                }
            }
        }
        Ok(())
    }

    /// Counts a registration of `bytes` that took `micros` on the NICs, or one that failed
    /// (`None`).
    pub(crate) fn handle_registered(&mut self, registered: Option<(u64, u64)>) {
        let r = &mut self.recorder.rest.registrations;
        match registered {
            Some((bytes, micros)) => {
                r.registered += 1;
                r.bytes += bytes;
                r.time_us += micros;
            }
            None => r.failed += 1,
        }
    }

    /// Counts a deregistration.
    pub(crate) fn handle_deregistered(&mut self) {
        self.recorder.rest.registrations.deregistered += 1;
    }

    /// The NICs' capabilities.
    pub(crate) fn caps(&self) -> &[Capabilities] {
        &self.caps
    }
}
