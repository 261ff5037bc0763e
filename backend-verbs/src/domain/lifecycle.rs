//! Connections ending: failed (what they held fails or settles from the flushes), retired
//! when replaced, rebuilt after a flush, buried until their last completions are read, and
//! declared unreachable when their queue stops moving.

use std::collections::VecDeque;
use std::time::{Duration, Instant};

use xfer_plugin::addr::NetAddr;
use xfer_plugin::domain::{DomainError, DomainErrorKind, Event};

use super::connections::{Connection, Ended, Queued};
use super::{err, other, VerbsDomain};
use crate::ffi::WorkRequest;
use crate::log;

impl VerbsDomain {
    /// Frees retired QPs whose writes are all settled and whose last flushes are long read,
    /// with everything kept about them (routes, dead marks): a long-running engine that
    /// reconnects often would otherwise grow without bound, and a QP number the device hands
    /// out again must not be taken for the dead one. Reads the clock only while QPs are kept.
    pub(super) fn collect_graveyard(&mut self) {
        if self.connections.any_retired() {
            self.connections.collect(Instant::now());
        }
    }

    /// Sets when this Domain next needs a poll though nothing arrives (`Domain::poll_timeout`):
    /// handshakes to resend or give up (`handshakes`, from `check_handshakes`) and retired
    /// QPs to free. A parked worker is polled only when woken, so the completion-channel
    /// thread wakes it then (kicked when the deadline changed).
    pub(super) fn publish_deadline(&mut self, handshakes: Option<Instant>) {
        let freeing = self.connections.poll_timeout();
        self.deadline = handshakes.into_iter().chain(freeing).min();
        if let Some((notify, _)) = &self.notify {
            if notify.set_deadline(self.deadline) {
                self.device.kick();
            }
        }
    }

    /// Reads the device's asynchronous events: a CQ overrun, a fatal device or SRQ error fail
    /// the Domain (typed, once) rather than stalling it silently; a QP error fails that
    /// connection (its writes settle from the flushes); others are logged.
    pub(super) fn read_async_events(&mut self) -> Result<(), DomainError> {
        loop {
            let event = self.device.async_event().map_err(other)?;
            let Some((name, kind, qpn)) = event else {
                return Ok(());
            };
            // ibv_event_type: 0 CQ_ERR, 1 QP_FATAL, 2 QP_REQ_ERR, 3 QP_ACCESS_ERR,
            // 8 DEVICE_FATAL, 14 SRQ_ERR.
            match kind {
                0 | 8 | 14 => {
                    let (cap, need) = self.device.cq_state();
                    return Err(err(
                        DomainErrorKind::Fatal,
                        format!("{}: {name} (completion queue of {cap} entries, {need} reserved); the device cannot be used further", self.name),
                    ));
                }
                1..=3 => {
                    if let Some(peer) = self.connections.route(qpn).cloned() {
                        self.fail_peer(&peer, &format!("the NIC reported {name} on its QP {qpn}"));
                    }
                }
                _ => log::line(&format!("{}: {name}", self.name)),
            }
        }
    }

    pub(super) fn fail_peer(&mut self, peer: &NetAddr, why: &str) {
        self.handshake.forget(peer);
        if let Some(ended) = self.connections.fail(Instant::now(), peer) {
            self.report_failed(peer, ended, why);
        }
    }

    /// Fails a connection that is no longer live: its QPs go to the error state and are
    /// retired; what it never posted fails now, what it posted settles from its own flushes
    /// (each flushed one fails, one that completed before the error succeeded) instead of
    /// being declared failed while the NIC may still be executing it.
    pub(super) fn fail_connection(&mut self, peer: &NetAddr, c: Connection, why: &str) {
        let ended = self.connections.end(Instant::now(), c);
        self.report_failed(peer, ended, why);
    }

    /// Fails everything an ended connection left.
    fn report_failed(&mut self, peer: &NetAddr, ended: Ended, why: &str) {
        let Ended { unposted, lost } = ended;
        self.fail_queued(peer, unposted, why);
        self.fail_ids(lost, &format!("{peer} via {}: {why}", self.name));
    }

    /// Fails the writes `wr_ids` as unreachable with `text`.
    fn fail_ids(&mut self, wr_ids: Vec<u64>, text: &str) {
        self.done
            .extend(wr_ids.into_iter().map(|wr_id| Event::Done {
                wr_id,
                result: Err(err(DomainErrorKind::PeerUnreachable, text.to_owned())),
            }));
    }

    /// Retires a connection the peer replaced: its QPs go to the error state and are retired
    /// (their flushes settle what was posted), and the writes it never posted are returned, to
    /// go out on the new connection.
    pub(super) fn retire_connection(&mut self, c: Connection) -> VecDeque<Queued> {
        let ended = self.connections.end(Instant::now(), c);
        self.replaced(ended.lost);
        ended.unposted
    }

    /// Fails the writes a replaced connection lost (posted, and never to be flushed).
    pub(super) fn replaced(&mut self, lost: Vec<u64>) {
        self.fail_ids(lost, "the peer replaced the connection");
    }

    /// Fails writes and sends that were never posted.
    pub(super) fn fail_queued(&mut self, peer: &NetAddr, queued: VecDeque<Queued>, why: &str) {
        let text = format!("{peer} via {}: {why}", self.name);
        self.fail_ids(queued.iter().map(Queued::wr_id).collect(), &text);
    }

    /// Replaces `peer`'s connection, which its peer broke, with a new one, and queues on it the
    /// writes that were flushed unexecuted (each at most once more; one flushed again fails).
    pub(super) fn reconnect_with(&mut self, peer: &NetAddr, flushed: Vec<WorkRequest>, why: &str) {
        let mut queued = VecDeque::new();
        if let Some(c) = self.connections.take(peer) {
            queued = self.retire_connection(c);
        }
        self.handshake.forget(peer);
        let mut again: VecDeque<Queued> = VecDeque::new();
        for mut w in flushed {
            if w.flushes >= 1 {
                self.done.push(Event::Done {
                    wr_id: w.user,
                    result: Err(err(
                        DomainErrorKind::PeerUnreachable,
                        format!("{peer} via {}: flushed twice: {why}", self.name),
                    )),
                });
            } else {
                w.flushes += 1;
                again.push_back(Queued::Rdma(w));
            }
        }
        again.extend(queued);
        if let Err(e) = self.start_connect(peer) {
            self.fail_queued(peer, again, &e.message);
            return;
        }
        if let Some(c) = self.connections.get_mut(peer) {
            c.queued.extend(again);
        }
    }

    /// Declares unreachable every peer whose send queue has not moved for `unreachable_ms`
    /// (a vanished peer: the transport's own retries may never give up, as on soft-RoCE; an
    /// empty receive queue at the peer with `rnr_retry = 7`). Its QPs go to the error state and
    /// its writes settle from the flushes as `PeerUnreachable`.
    pub(super) fn check_stalled_peers(&mut self) {
        let limit = Duration::from_millis(self.options.unreachable_ms);
        for (peer, idle) in self.connections.stalled(Instant::now(), limit) {
            self.fail_peer(
                &peer,
                &format!(
                    "no completion for {} ms (unreachable_ms = {}): the peer is unreachable",
                    idle.as_millis(),
                    self.options.unreachable_ms
                ),
            );
        }
    }
}
