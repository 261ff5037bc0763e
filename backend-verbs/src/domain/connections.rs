//! A device's connections, and every map that must agree about them, kept consistent by the
//! methods here rather than by hand across the Domain's files.
//!
//! A connection is two RC QPs with one peer (data and messages). Its QPs are in exactly one
//! place: the *live* connection with the peer (pending its handshake, or ready), a *candidate*
//! built beside it for a request that did not name it (it replaces the live one when its
//! `Ready` comes), or the *graveyard*, retired, until freed. The rest follows:
//!
//! - **Routes.** Every QP of a live connection or a candidate routes to its peer
//!   ([`route`](Connections::route)); a retired QP keeps its route until it is freed, so its
//!   late completions still name the peer, and loses it then, so a QP number the device hands
//!   out again is not taken for the dead one.
//! - **Data queues.** A data QP's chain and outstanding writes live in its queue from its
//!   first write until every write is accounted for. A retired data QP whose writes are still
//!   outstanding keeps its queue (they settle from their flushes); it is *settled* once its
//!   queue is gone, and only a settled QP is freed.
//! - **Dead.** A retired data QP is dead: its late completions settle what it carried and
//!   fail no connection.
//! - **Unproven.** A new connection's QPs are unproven until their first successful
//!   completion or arrival ([`first_traffic`](Connections::first_traffic)); a retired QP is
//!   not. Empty in the steady state, so the completion path pays one branch.
//!
//! Pure: no FFI (QPs are anything that has a number and can be moved to the error state),
//! time passed in; tested with fake QPs below.

use std::collections::VecDeque;
use std::time::{Duration, Instant};

use foldhash::{HashMap, HashSet};
use xfer_plugin::addr::NetAddr;

use super::datapath::DataQueue;
use super::graveyard::{Graveyard, Numbered};
use crate::ffi::{Qp, WorkRequest};

/// A work request (an RDMA write or read) or a send waiting for its peer's connection.
pub(super) enum Queued {
    Rdma(WorkRequest),
    Send { wr_id: u64, data: Vec<u8> },
}

impl Queued {
    /// The engine's id of the request or send.
    pub(super) fn wr_id(&self) -> u64 {
        match self {
            Self::Rdma(w) => w.user,
            Self::Send { wr_id, .. } => *wr_id,
        }
    }
}

/// What a connection needs of a QP.
pub(super) trait QueuePair: Numbered {
    /// Moves the QP to the error state: nothing it holds executes any more, and everything
    /// posted completes (flushed). False if the NIC refused: no flush will come.
    fn to_error(&mut self) -> bool;
}

impl QueuePair for Qp {
    fn to_error(&mut self) -> bool {
        self.move_to_error().is_ok()
    }
}

/// One peer's connection: its two RC QPs, what waits for them, and whether it may post.
/// The handshake's state lives in the handshake machine; this is what the Domain owns.
pub(super) struct Connection<Q = Qp> {
    pub(super) data: Q,
    pub(super) msg: Q,
    /// Posts waiting for the handshake, or that found the send queue full (retried after
    /// polling).
    pub(super) queued: VecDeque<Queued>,
    /// The handshake finished on our side: as the requester once our QPs are connected, as
    /// the responder once the requester's `Ready` came (before it, a packet sent early is
    /// dropped at the requester and retransmitted only after the ack timeout).
    pub(super) ready: bool,
}

/// What an ended connection leaves to report.
pub(super) struct Ended {
    /// Writes and sends it never posted, in order: to fail, or to move to its successor.
    pub(super) unposted: VecDeque<Queued>,
    /// The engine's ids of writes it posted that will never complete (its QP could not be
    /// moved to the error state, so no flush comes): to fail.
    pub(super) lost: Vec<u64>,
}

/// A device's connections (see the module docs).
pub(super) struct Connections<Q = Qp> {
    live: HashMap<NetAddr, Connection<Q>>,
    candidates: HashMap<NetAddr, (Q, Q)>,
    routes: HashMap<u32, NetAddr>,
    queues: HashMap<u32, DataQueue>,
    dead: HashSet<u32>,
    unproven: HashSet<u32>,
    graveyard: Graveyard<Q>,
}

impl<Q> Default for Connections<Q> {
    fn default() -> Self {
        Self {
            live: HashMap::default(),
            candidates: HashMap::default(),
            routes: HashMap::default(),
            queues: HashMap::default(),
            dead: HashSet::default(),
            unproven: HashSet::default(),
            graveyard: Graveyard::default(),
        }
    }
}

impl<Q: QueuePair> Connections<Q> {
    /// The live connection with `peer` (pending or ready).
    pub(super) fn get(&self, peer: &NetAddr) -> Option<&Connection<Q>> {
        self.live.get(peer)
    }

    /// The live connection with `peer`, to post on or queue for.
    pub(super) fn get_mut(&mut self, peer: &NetAddr) -> Option<&mut Connection<Q>> {
        self.live.get_mut(peer)
    }

    /// Every live connection.
    pub(super) fn iter(&self) -> impl Iterator<Item = (&NetAddr, &Connection<Q>)> {
        self.live.iter()
    }

    /// Every live connection, to take back what waits on it (a deregistered region's
    /// writes). Its QPs stay where they are.
    pub(super) fn iter_mut(&mut self) -> impl Iterator<Item = &mut Connection<Q>> {
        self.live.values_mut()
    }

    /// The live connection with `peer` and its data queue (made on first use): to post on.
    pub(super) fn sending(
        &mut self,
        peer: &NetAddr,
    ) -> Option<(&mut Connection<Q>, &mut DataQueue)> {
        let c = self.live.get_mut(peer)?;
        let q = self.queues.entry(c.data.qpn()).or_default();
        Some((c, q))
    }

    /// The peer that QP `qpn` talks to (also while retired, until freed).
    pub(super) fn route(&self, qpn: u32) -> Option<&NetAddr> {
        self.routes.get(&qpn)
    }

    /// Makes `(data, msg)` the live connection with `peer`, pending its handshake (not ready),
    /// with `queued` waiting for it. The caller has ended or taken the one it replaces.
    pub(super) fn pending(
        &mut self,
        peer: &NetAddr,
        (data, msg): (Q, Q),
        queued: VecDeque<Queued>,
    ) {
        self.admit(peer, &data, &msg);
        let old = self.live.insert(
            peer.clone(),
            Connection {
                data,
                msg,
                queued,
                ready: false,
            },
        );
        debug_assert!(
            old.is_none(),
            "a live connection replaced without ending it"
        );
    }

    /// Routes new (or reinstalled) QPs to `peer`, unproven.
    fn admit(&mut self, peer: &NetAddr, data: &Q, msg: &Q) {
        for qpn in [data.qpn(), msg.qpn()] {
            self.routes.insert(qpn, peer.clone());
            self.unproven.insert(qpn);
        }
    }

    /// The handshake with `peer` finished on our side: its connection may post. False if
    /// there is none.
    pub(super) fn ready(&mut self, peer: &NetAddr) -> bool {
        self.live.get_mut(peer).map(|c| c.ready = true).is_some()
    }

    /// Takes the live connection with `peer` out, still routed: the caller installs it again
    /// ([`pending`](Self::pending)) or ends it ([`end`](Self::end)).
    pub(super) fn take(&mut self, peer: &NetAddr) -> Option<Connection<Q>> {
        self.live.remove(peer)
    }

    /// Ends a connection no longer live: its QPs go to the error state first (nothing they
    /// hold executes any more: a write reported failed must not land later, or a retry
    /// double-counts its immediate), then are retired. What was posted settles from its own
    /// flushes; what could not be flushed is returned as lost, with what was never posted.
    pub(super) fn end(&mut self, now: Instant, c: Connection<Q>) -> Ended {
        let Connection {
            mut data,
            mut msg,
            mut queued,
            ..
        } = c;
        let flushing = data.to_error();
        msg.to_error();
        let mut lost = Vec::new();
        if let Some(q) = self.queues.get_mut(&data.qpn()) {
            for w in q.chain.drain(..).rev() {
                queued.push_front(Queued::Rdma(w));
            }
            if !flushing || q.outstanding.is_empty() {
                lost = q.outstanding.drain();
                self.queues.remove(&data.qpn());
            }
        }
        self.retire(now, data, msg);
        Ended {
            unposted: queued,
            lost,
        }
    }

    /// Puts QPs that are no longer live into the graveyard: dead, proven of nothing.
    fn retire(&mut self, now: Instant, data: Q, msg: Q) {
        self.dead.insert(data.qpn());
        self.unproven.remove(&data.qpn());
        self.unproven.remove(&msg.qpn());
        self.graveyard.bury(now, data);
        self.graveyard.bury(now, msg);
    }

    /// Retires QPs that never carried a connection's traffic (a dropped candidate, QPs whose
    /// handshake could not start).
    pub(super) fn retire_unused(&mut self, now: Instant, (mut data, mut msg): (Q, Q)) {
        data.to_error();
        msg.to_error();
        self.retire(now, data, msg);
    }

    /// Fails the connection with `peer` and drops its candidate: what it leaves to report,
    /// `None` if there was no live connection.
    pub(super) fn fail(&mut self, now: Instant, peer: &NetAddr) -> Option<Ended> {
        self.drop_candidate(now, peer);
        let c = self.live.remove(peer)?;
        Some(self.end(now, c))
    }

    /// Makes `(data, msg)` the candidate beside `peer`'s connection (routed, unproven); an
    /// earlier candidate is retired unused.
    pub(super) fn candidate(&mut self, now: Instant, peer: &NetAddr, (data, msg): (Q, Q)) {
        self.admit(peer, &data, &msg);
        if let Some(old) = self.candidates.insert(peer.clone(), (data, msg)) {
            self.retire_unused(now, old);
        }
    }

    /// Retires `peer`'s candidate unused, if it has one.
    pub(super) fn drop_candidate(&mut self, now: Instant, peer: &NetAddr) {
        if let Some(qps) = self.candidates.remove(peer) {
            self.retire_unused(now, qps);
        }
    }

    /// `peer`'s candidate got its `Ready`: it becomes the live connection, ready, and the one
    /// it replaces ends, its unposted work moving over. Returns the old connection's lost
    /// writes (to fail); `None` if there was no candidate.
    pub(super) fn promote(&mut self, now: Instant, peer: &NetAddr) -> Option<Vec<u64>> {
        let (data, msg) = self.candidates.remove(peer)?;
        let (queued, lost) = match self.live.remove(peer) {
            Some(old) => {
                let ended = self.end(now, old);
                (ended.unposted, ended.lost)
            }
            None => (VecDeque::new(), Vec::new()),
        };
        self.live.insert(
            peer.clone(),
            Connection {
                data,
                msg,
                queued,
                ready: true,
            },
        );
        Some(lost)
    }

    /// The first successful completion or arrival on QP `qpn` since it was admitted: the
    /// peer whose live connection that proves (see `handshake`). A candidate's QP stays
    /// unproven: it proves its connection once promoted. Costs one branch when nothing is
    /// unproven.
    pub(super) fn first_traffic(&mut self, qpn: u32) -> Option<NetAddr> {
        if self.unproven.is_empty() || !self.unproven.remove(&qpn) {
            return None;
        }
        let peer = self.routes.get(&qpn)?;
        if self
            .candidates
            .get(peer)
            .is_some_and(|(d, m)| d.qpn() == qpn || m.qpn() == qpn)
        {
            self.unproven.insert(qpn);
            return None;
        }
        let live = self
            .live
            .get(peer)
            .is_some_and(|c| c.data.qpn() == qpn || c.msg.qpn() == qpn);
        live.then(|| peer.clone())
    }

    /// Whether QP `qpn` is the message QP of `peer`'s live connection.
    pub(super) fn is_live_msg(&self, peer: &NetAddr, qpn: u32) -> bool {
        self.live.get(peer).is_some_and(|c| c.msg.qpn() == qpn)
    }

    /// Whether QP `qpn` carries writes whose completions must be settled: a data QP with
    /// writes on it, or a dead one.
    pub(super) fn is_data(&self, qpn: u32) -> bool {
        self.queues.contains_key(&qpn) || self.dead.contains(&qpn)
    }

    /// Whether QP `qpn` is a retired data QP.
    pub(super) fn is_dead(&self, qpn: u32) -> bool {
        self.dead.contains(&qpn)
    }

    /// The data queue of QP `qpn`, while it has one.
    pub(super) fn queue_mut(&mut self, qpn: u32) -> Option<&mut DataQueue> {
        self.queues.get_mut(&qpn)
    }

    /// Every data queue, with its QP's number.
    pub(super) fn queues_mut(&mut self) -> impl Iterator<Item = (u32, &mut DataQueue)> {
        self.queues.iter_mut().map(|(&qpn, q)| (qpn, q))
    }

    /// Every write of data QP `qpn` is accounted for: its queue goes (it is settled), and its
    /// late completions are ignored.
    pub(super) fn settled(&mut self, qpn: u32) {
        self.queues.remove(&qpn);
        self.dead.insert(qpn);
    }

    /// A retired data QP's queue, once its flushes have settled everything in it, goes.
    pub(super) fn settle_if_empty(&mut self, qpn: u32) {
        if self
            .queues
            .get(&qpn)
            .is_some_and(|q| q.outstanding.is_empty())
        {
            self.queues.remove(&qpn);
        }
    }

    /// Every live connection whose send queue has not moved for `limit`, with how long.
    pub(super) fn stalled(&mut self, now: Instant, limit: Duration) -> Vec<(NetAddr, Duration)> {
        let queues = &mut self.queues;
        self.live
            .iter()
            .filter_map(|(peer, c)| {
                // A connection still handshaking has posted nothing: no queue to watch.
                let q = queues.get_mut(&c.data.qpn())?;
                let idle = q.progress.stalled_for(!q.outstanding.is_empty(), now)?;
                (idle >= limit).then(|| (peer.clone(), idle))
            })
            .collect()
    }

    /// Frees the retired QPs that are settled and have lingered (see `graveyard`), with their
    /// routes and dead marks.
    pub(super) fn collect(&mut self, now: Instant) {
        let (queues, dead, routes) = (&self.queues, &mut self.dead, &mut self.routes);
        self.graveyard.collect(
            now,
            |qpn| !queues.contains_key(&qpn),
            |qp| {
                dead.remove(&qp.qpn());
                routes.remove(&qp.qpn());
                drop(qp);
            },
        );
    }

    /// Whether retired QPs wait to be freed (no clock needs reading when none do).
    pub(super) fn any_retired(&self) -> bool {
        !self.graveyard.is_empty()
    }

    /// When [`collect`](Self::collect) next frees something; `None` if nothing waits, or
    /// only QPs whose flushes are still to come (a completion, through a poll, settles them).
    pub(super) fn poll_timeout(&self) -> Option<Instant> {
        let queues = &self.queues;
        self.graveyard
            .poll_timeout(|qpn| !queues.contains_key(&qpn))
    }
}

#[cfg(test)]
mod tests {
    use super::super::graveyard::LINGER;
    use super::*;

    /// A QP without a device: its number, whether it is in the error state, and whether the
    /// NIC refuses to put it there.
    #[derive(Debug)]
    struct FakeQp {
        qpn: u32,
        error: bool,
        refuses: bool,
    }

    impl Numbered for FakeQp {
        fn qpn(&self) -> u32 {
            self.qpn
        }
    }

    impl QueuePair for FakeQp {
        fn to_error(&mut self) -> bool {
            self.error = !self.refuses;
            self.error
        }
    }

    fn qps(data: u32) -> (FakeQp, FakeQp) {
        let qp = |qpn| FakeQp {
            qpn,
            error: false,
            refuses: false,
        };
        (qp(data), qp(data + 1))
    }

    fn peer(n: u8) -> NetAddr {
        NetAddr::new(&[n; 24]).unwrap()
    }

    fn write(user: u64) -> WorkRequest {
        WorkRequest {
            wr_id: 1000 + user,
            user,
            len: 8,
            ..WorkRequest::default()
        }
    }

    /// Posts writes `users` on `peer`'s connection as the data path does (outstanding, one
    /// signalled chain).
    fn post(c: &mut Connections<FakeQp>, to: &NetAddr, users: &[u64]) {
        let (_, q) = c.sending(to).unwrap();
        for (i, &u) in users.iter().enumerate() {
            let w = write(u);
            q.outstanding.push(w.wr_id, u, i + 1 == users.len(), w);
        }
    }

    /// The invariants of the module docs.
    fn check(c: &Connections<FakeQp>) {
        let mut seen = HashSet::default();
        let mut place = |qpn: u32, what: &str| {
            assert!(seen.insert(qpn), "QP {qpn} in two places ({what})");
        };
        for (p, conn) in &c.live {
            for qpn in [conn.data.qpn, conn.msg.qpn] {
                place(qpn, "live");
                assert_eq!(
                    c.routes.get(&qpn),
                    Some(p),
                    "live QP {qpn} routed to its peer"
                );
                assert!(!c.dead.contains(&qpn), "live QP {qpn} dead");
            }
        }
        for (p, (d, m)) in &c.candidates {
            for qpn in [d.qpn, m.qpn] {
                place(qpn, "candidate");
                assert_eq!(c.routes.get(&qpn), Some(p), "candidate QP {qpn} routed");
            }
        }
        let mut buried = HashSet::default();
        c.graveyard.each(|qp: &FakeQp| {
            place(qp.qpn, "graveyard");
            buried.insert(qp.qpn);
            assert!(
                qp.error || qp.refuses,
                "QP {} retired outside the error state",
                qp.qpn
            );
            assert!(
                !c.unproven.contains(&qp.qpn),
                "retired QP {} unproven",
                qp.qpn
            );
        });
        for qpn in &c.dead {
            assert!(buried.contains(qpn), "dead QP {qpn} not in the graveyard");
        }
        for qpn in c.queues.keys() {
            assert!(seen.contains(qpn), "a queue for QP {qpn}, which is nowhere");
        }
        for qpn in c.routes.keys() {
            assert!(seen.contains(qpn), "a route for QP {qpn}, which is nowhere");
        }
        for qpn in &c.unproven {
            assert!(seen.contains(qpn), "unproven QP {qpn}, which is nowhere");
        }
    }

    #[test]
    fn a_pending_connection_is_routed_and_unproven_until_its_first_traffic() {
        let mut c = Connections::default();
        c.pending(&peer(1), qps(10), VecDeque::new());
        check(&c);
        assert_eq!(c.route(10), Some(&peer(1)));
        assert_eq!(c.route(11), Some(&peer(1)));
        assert!(!c.get(&peer(1)).unwrap().ready);
        assert!(c.ready(&peer(1)));
        assert!(!c.ready(&peer(2)), "no connection: nothing made ready");
        assert_eq!(c.first_traffic(10), Some(peer(1)));
        assert_eq!(c.first_traffic(10), None, "proven once");
        assert_eq!(c.first_traffic(11), Some(peer(1)));
        assert!(c.unproven.is_empty(), "the steady state costs one branch");
        check(&c);
    }

    #[test]
    fn a_failed_connection_returns_what_it_never_posted_and_settles_the_rest_from_flushes() {
        let t0 = Instant::now();
        let mut c = Connections::default();
        let p = peer(1);
        c.pending(&p, qps(10), VecDeque::new());
        c.ready(&p);
        post(&mut c, &p, &[1, 2]);
        let (conn, q) = c.sending(&p).unwrap();
        q.chain.push(write(3));
        conn.queued.push_back(Queued::Send {
            wr_id: 4,
            data: vec![1],
        });
        let ended = c.fail(t0, &p).unwrap();
        let unposted: Vec<u64> = ended.unposted.iter().map(Queued::wr_id).collect();
        assert_eq!(unposted, vec![3, 4], "the chain first, then what waited");
        assert!(
            ended.lost.is_empty(),
            "flushing: posted writes settle from their flushes"
        );
        check(&c);
        assert!(c.is_dead(10) && c.is_data(10));
        assert_eq!(
            c.route(10),
            Some(&p),
            "late completions still name the peer"
        );
        assert_eq!(c.poll_timeout(), Some(t0 + LINGER), "the message QP's");
        c.collect(t0 + LINGER * 3);
        check(&c);
        assert_eq!(c.route(11), None, "the message QP is freed");
        assert_eq!(c.route(10), Some(&p), "not freed before its flushes settle");
        assert_eq!(c.poll_timeout(), None, "unsettled: no deadline");
        // The flush of the chain's last write settles both.
        let q = c.queue_mut(10).unwrap();
        let (before, failed) = q.outstanding.fail(1002);
        assert_eq!((before, failed), (vec![1], Some(2)));
        c.settle_if_empty(10);
        assert_eq!(c.poll_timeout(), Some(t0 + LINGER));
        c.collect(t0 + LINGER);
        check(&c);
        assert_eq!(
            c.route(10),
            None,
            "freed: the number may be handed out again"
        );
        assert!(!c.is_data(10));
        assert!(!c.any_retired());
    }

    #[test]
    fn a_qp_the_nic_cannot_move_to_error_loses_its_posted_writes_at_once() {
        let t0 = Instant::now();
        let mut c = Connections::default();
        let p = peer(1);
        let (mut data, msg) = qps(10);
        data.refuses = true;
        c.pending(&p, (data, msg), VecDeque::new());
        c.ready(&p);
        post(&mut c, &p, &[1, 2]);
        let ended = c.fail(t0, &p).unwrap();
        assert_eq!(ended.lost, vec![1, 2]);
        assert_eq!(c.poll_timeout(), Some(t0 + LINGER), "settled at once");
        check(&c);
    }

    #[test]
    fn a_promoted_candidate_takes_over_the_unposted_work_and_the_old_connection_retires() {
        let t0 = Instant::now();
        let mut c = Connections::default();
        let p = peer(1);
        c.pending(&p, qps(10), VecDeque::from([Queued::Rdma(write(7))]));
        c.candidate(t0, &p, qps(20));
        check(&c);
        assert_eq!(c.route(20), Some(&p));
        assert_eq!(c.first_traffic(20), None, "a candidate proves nothing yet");
        assert_eq!(c.promote(t0, &p), Some(vec![]));
        check(&c);
        let live = c.get(&p).unwrap();
        assert_eq!((live.data.qpn, live.ready), (20, true));
        let moved: Vec<u64> = live.queued.iter().map(Queued::wr_id).collect();
        assert_eq!(moved, vec![7]);
        assert_eq!(c.first_traffic(20), Some(p.clone()), "proven once promoted");
        assert!(c.is_dead(10));
        assert_eq!(c.promote(t0, &p), None, "no candidate left");
    }

    #[test]
    fn a_second_candidate_retires_the_first_and_failing_drops_it() {
        let t0 = Instant::now();
        let mut c = Connections::default();
        let p = peer(1);
        c.pending(&p, qps(10), VecDeque::new());
        c.candidate(t0, &p, qps(20));
        c.candidate(t0, &p, qps(30));
        check(&c);
        assert!(c.is_dead(20));
        assert!(c.fail(t0, &p).is_some());
        check(&c);
        assert!(c.is_dead(30) && c.is_dead(10));
        assert!(c.fail(t0, &p).is_none(), "nothing left to fail");
        c.collect(t0 + LINGER);
        check(&c);
        assert!(c.routes.is_empty() && c.dead.is_empty() && !c.any_retired());
    }

    #[test]
    fn a_taken_connection_is_reinstalled_or_ended_and_stays_routed_meanwhile() {
        let t0 = Instant::now();
        let mut c = Connections::default();
        let p = peer(1);
        c.pending(&p, qps(10), VecDeque::new());
        let taken = c.take(&p).unwrap();
        assert_eq!(c.route(10), Some(&p));
        c.pending(&p, (taken.data, taken.msg), taken.queued);
        check(&c);
        let taken = c.take(&p).unwrap();
        let ended = c.end(t0, taken);
        assert!(ended.unposted.is_empty() && ended.lost.is_empty());
        check(&c);
    }

    #[test]
    fn only_connections_with_outstanding_writes_that_do_not_move_are_stalled() {
        let t0 = Instant::now();
        let limit = Duration::from_millis(500);
        let mut c = Connections::default();
        for n in 1..=3 {
            c.pending(&peer(n), qps(u32::from(n) * 10), VecDeque::new());
            c.ready(&peer(n));
        }
        post(&mut c, &peer(1), &[1]);
        let (_, q) = c.sending(&peer(1)).unwrap();
        q.progress.moved();
        let _ = c.sending(&peer(2));
        assert!(c.stalled(t0, limit).is_empty(), "the clock starts");
        let later = t0 + Duration::from_secs(10);
        let stalled: Vec<NetAddr> = c.stalled(later, limit).into_iter().map(|s| s.0).collect();
        assert_eq!(
            stalled,
            vec![peer(1)],
            "idle queues and handshakes are not stalled"
        );
    }

    #[test]
    fn qp_numbers_reused_after_freeing_belong_to_their_new_connection() {
        let t0 = Instant::now();
        let mut c: Connections<FakeQp> = Connections::default();
        let (a, b) = (peer(1), peer(2));
        c.pending(&a, qps(10), VecDeque::new());
        c.fail(t0, &a);
        c.collect(t0 + LINGER);
        c.pending(&b, qps(10), VecDeque::new());
        check(&c);
        assert_eq!(c.route(10), Some(&b));
        assert!(!c.is_dead(10), "not taken for the dead one");
    }
}
