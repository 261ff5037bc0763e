//! Connections ending: failed (what they held fails or settles from the flushes), retired
//! when replaced, rebuilt after a flush, buried until their last completions are read, and
//! declared unreachable when their queue stops moving.

use super::*;

impl VerbsDomain {
    /// Keeps a retired connection's QPs until their flushes have been read, then frees them
    /// (see `collect_graveyard`).
    pub(super) fn bury(&mut self, data: Qp, msg: Qp) {
        self.unproven.remove(&data.qpn);
        self.unproven.remove(&msg.qpn);
        let now = Instant::now();
        self.graveyard.bury(now, data);
        self.graveyard.bury(now, msg);
    }

    /// Frees retired QPs whose writes are all settled and whose last flushes are long read,
    /// with everything kept about them (peer map, dead list): a long-running engine that
    /// reconnects often would otherwise grow without bound, and a QP number the device hands
    /// out again must not be taken for the dead one. Reads the clock only while QPs are kept.
    pub(super) fn collect_graveyard(&mut self) {
        if self.graveyard.is_empty() {
            return;
        }
        let (data_queues, dead_qps, qp_peer) =
            (&self.data_queues, &mut self.dead_qps, &mut self.qp_peer);
        self.graveyard.collect(
            Instant::now(),
            |qpn| !data_queues.contains_key(&qpn),
            |qp| {
                dead_qps.remove(&qp.qpn);
                qp_peer.remove(&qp.qpn);
                drop(qp);
            },
        );
    }

    /// Sets when this Domain next needs a poll though nothing arrives (`Domain::poll_timeout`):
    /// handshakes to resend or give up (`handshakes`, from `check_handshakes`) and retired
    /// QPs to free. A parked worker is polled only when woken, so the completion-channel
    /// thread wakes it then (kicked when the deadline moved earlier than the one it waits for).
    pub(super) fn publish_deadline(&mut self, handshakes: Option<Instant>) {
        let data_queues = &self.data_queues;
        let freeing = self
            .graveyard
            .poll_timeout(|qpn| !data_queues.contains_key(&qpn));
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
                    if let Some(peer) = self.qp_peer.get(&qpn).cloned() {
                        self.fail_peer(&peer, &format!("the NIC reported {name} on its QP {qpn}"));
                    }
                }
                _ => log::line(&format!("{}: {name}", self.name)),
            }
        }
    }

    pub(super) fn fail_peer(&mut self, peer: &NetAddr, why: &str) {
        self.handshake.forget(peer);
        if let Some((data, msg)) = self.candidates.remove(peer) {
            self.retire_unused(data, msg);
        }
        let Some(c) = self.peers.remove(peer) else {
            return;
        };
        self.fail_connection(peer, c.data, c.msg, c.queued, why);
    }

    /// Fails everything queued or outstanding on a connection that is no longer in `peers`,
    /// and retires its QPs.
    pub(super) fn fail_connection(
        &mut self,
        peer: &NetAddr,
        data: Qp,
        msg: Qp,
        queued: VecDeque<Queued>,
        why: &str,
    ) {
        let failure = |wr_id| Event::Done {
            wr_id,
            result: Err(err(
                DomainErrorKind::PeerUnreachable,
                format!("{peer} via {}: {why}", self.name),
            )),
        };
        let mut failed: Vec<Event> = queued
            .into_iter()
            .map(|q| match q {
                Queued::Write(w) => failure(w.user),
                Queued::Send { wr_id, .. } => failure(wr_id),
            })
            .collect();
        // The QPs go to the error state first: nothing they hold executes any more (a write
        // reported failed must not land later, or a retry double-counts its immediate).
        // What was posted then settles from its own completions — each flushed one fails,
        // one that completed before the error succeeded — instead of being declared failed
        // while the NIC may still be executing it. Writes never posted fail now.
        let mut data = data;
        let mut msg = msg;
        let flushing = data.move_to_error().is_ok();
        let _ = msg.move_to_error();
        if let Some(q) = self.data_queues.get_mut(&data.qpn) {
            failed.extend(
                std::mem::take(&mut q.chain)
                    .into_iter()
                    .map(|w| failure(w.user)),
            );
            if !flushing || q.outstanding.is_empty() {
                failed.extend(q.outstanding.drain().into_iter().map(failure));
                self.data_queues.remove(&data.qpn);
            }
        }
        self.dead_qps.insert(data.qpn);
        self.done.extend(failed);
        self.bury(data, msg);
    }

    /// Retires a connection the peer replaced: its QPs go to the error state and are buried
    /// (kept until their flushes settled what was posted, then freed), and the writes it never
    /// posted are returned, to go out on the new connection.
    pub(super) fn retire_connection(
        &mut self,
        mut data: Qp,
        mut msg: Qp,
        mut queued: VecDeque<Queued>,
    ) -> VecDeque<Queued> {
        let flushing = data.move_to_error().is_ok();
        let _ = msg.move_to_error();
        if let Some(q) = self.data_queues.get_mut(&data.qpn) {
            let unposted: Vec<Queued> = q.chain.drain(..).map(Queued::Write).collect();
            for w in unposted.into_iter().rev() {
                queued.push_front(w);
            }
            if !flushing || q.outstanding.is_empty() {
                let lost = q.outstanding.drain();
                self.data_queues.remove(&data.qpn);
                self.done.extend(lost.into_iter().map(|wr_id| Event::Done {
                    wr_id,
                    result: Err(err(
                        DomainErrorKind::PeerUnreachable,
                        "the peer replaced the connection".to_owned(),
                    )),
                }));
            }
        }
        self.dead_qps.insert(data.qpn);
        self.bury(data, msg);
        queued
    }

    /// Fails writes and sends that were never posted.
    pub(super) fn fail_queued(&mut self, peer: &NetAddr, queued: VecDeque<Queued>, why: &str) {
        for q in queued {
            let wr_id = match q {
                Queued::Write(w) => w.user,
                Queued::Send { wr_id, .. } => wr_id,
            };
            self.done.push(Event::Done {
                wr_id,
                result: Err(err(
                    DomainErrorKind::PeerUnreachable,
                    format!("{peer} via {}: {why}", self.name),
                )),
            });
        }
    }

    /// Replaces `peer`'s connection, which its peer broke, with a new one, and queues on it the
    /// writes that were flushed unexecuted (each at most once more; one flushed again fails).
    pub(super) fn reconnect_with(&mut self, peer: &NetAddr, flushed: Vec<Write>, why: &str) {
        let old = self.peers.remove(peer);
        let mut queued = VecDeque::new();
        if let Some(c) = old {
            queued = self.retire_connection(c.data, c.msg, c.queued);
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
                again.push_back(Queued::Write(w));
            }
        }
        again.extend(queued);
        if let Err(e) = self.start_connect(peer) {
            self.fail_queued(peer, again, &e.message);
            return;
        }
        if let Some(c) = self.peers.get_mut(peer) {
            c.queued.extend(again);
        }
    }

    /// Declares unreachable every peer whose send queue has not moved for `unreachable_ms`
    /// (a vanished peer: the transport's own retries may never give up, as on soft-RoCE; an
    /// empty receive queue at the peer with `rnr_retry = 7`). Its QPs go to the error state and
    /// its writes settle from the flushes as `PeerUnreachable`.
    pub(super) fn check_stalled_peers(&mut self) {
        let limit = Duration::from_millis(self.options.unreachable_ms);
        let now = Instant::now();
        let data_queues = &mut self.data_queues;
        let stalled: Vec<(NetAddr, u64)> = self
            .peers
            .iter()
            .filter_map(|(addr, c)| {
                // A connection still handshaking has posted nothing: no queue to watch.
                let q = data_queues.get_mut(&c.data.qpn)?;
                let idle = q.progress.stalled_for(!q.outstanding.is_empty(), now)?;
                (idle >= limit).then(|| (addr.clone(), idle.as_millis() as u64))
            })
            .collect();
        for (peer, idle) in stalled {
            self.fail_peer(
                &peer,
                &format!(
                    "no completion for {idle} ms (unreachable_ms = {}): the peer is unreachable",
                    self.options.unreachable_ms
                ),
            );
        }
    }
}
