//! Connections being made: carrying out what the pure handshake (`crate::handshake`) asks —
//! QPs created, connected, installed, promoted, dropped — and its timers and test faults.

use super::*;

impl VerbsDomain {
    pub(super) fn new_qps(&mut self) -> Result<(Qp, Qp), DomainError> {
        // Each QP holds CQ room for what it may have outstanding: the data QP its window
        // (grown while its writes fill it), the message QP its whole (small) queue.
        let o = &self.options;
        let data = self
            .device
            .create_rc(
                false,
                o.send_queue,
                o.send_window.min(o.send_queue),
                o.inline_bytes,
            )
            .map_err(other)?;
        let msg = self
            .device
            .create_rc(true, o.message_queue, o.message_queue, 0)
            .map_err(other)?;
        cq_may_have_resized(&self.notify);
        self.unproven.insert(data.qpn);
        self.unproven.insert(msg.qpn);
        Ok((data, msg))
    }

    /// Sends a handshake datagram; false if it could not go now (every send slot busy, or
    /// an error), in which case requests are resent on the next check and responses on the
    /// peer's next request.
    pub(super) fn send_handshake(&mut self, to: &VerbsAddr, h: &Handshake) -> bool {
        let bytes = self.handshake.seal(h, to);
        match self.device.ud_send(&to.gid, to.lid, to.ud_qpn, &bytes) {
            Ok(()) => {
                self.handshakes_sent += 1;
                if self.handshakes_sent == self.options.faults.ud_error_after_sends {
                    if let Err(e) = self.device.ud_to_error() {
                        log::line(&format!("{}: fault injection: {e}", self.name));
                    }
                }
                true
            }
            Err(e) => {
                // Every send slot busy is routine (the handshake resends); anything else is
                // worth a line.
                if e.kind() != std::io::ErrorKind::WouldBlock {
                    log::line(&format!("{}: handshake send: {e}", self.name));
                }
                false
            }
        }
    }

    /// Starts connecting to `peer` (we are the requester).
    pub(super) fn start_connect(&mut self, peer: &NetAddr) -> Result<(), DomainError> {
        VerbsAddr::decode(peer.raw())
            .map_err(|e| err(DomainErrorKind::InvalidArgument, format!("{peer}: {e}")))?;
        let (data, msg) = self.new_qps()?;
        let mut actions = Vec::new();
        let now = Instant::now();
        let qpns = (data.qpn, msg.qpn);
        if let Err(e) = self.handshake.connect(now, peer, qpns, &mut actions) {
            self.bury(data, msg);
            return Err(err(DomainErrorKind::InvalidArgument, e));
        }
        self.install(peer, (data, msg), VecDeque::new(), false);
        self.carry_out(now, actions);
        Ok(())
    }

    /// Routes completions on `(data, msg)` to `peer`.
    fn route(&mut self, peer: &NetAddr, data: &Qp, msg: &Qp) {
        self.qp_peer.insert(data.qpn, peer.clone());
        self.qp_peer.insert(msg.qpn, peer.clone());
    }

    /// Makes `(data, msg)` the connection with `peer`, with `queued` waiting for it and
    /// `ready` saying whether it may post; completions on its QPs are routed to `peer`.
    pub(super) fn install(
        &mut self,
        peer: &NetAddr,
        (data, msg): (Qp, Qp),
        queued: VecDeque<Queued>,
        ready: bool,
    ) {
        self.route(peer, &data, &msg);
        self.peers.insert(
            peer.clone(),
            Connection {
                data,
                msg,
                queued,
                ready,
            },
        );
    }

    pub(super) fn connect_qps(
        &mut self,
        data: &Qp,
        msg: &Qp,
        h: &Handshake,
        data_psn: u32,
        msg_psn: u32,
    ) -> Result<(), String> {
        let mtu = i32::from(h.mtu.min(self.attr.active_mtu as u8));
        let t = (
            self.options.ack_timeout,
            self.options.retry_cnt,
            self.options.rnr_retry,
        );
        self.device.connect(
            data,
            h.data_qpn,
            h.data_psn,
            data_psn,
            &h.from.gid,
            h.from.lid,
            mtu,
            t,
        )?;
        self.device.connect(
            msg,
            h.msg_qpn,
            h.msg_psn,
            msg_psn,
            &h.from.gid,
            h.from.lid,
            mtu,
            t,
        )
    }

    pub(super) fn handle_handshake(&mut self, raw: &[u8]) {
        let mut actions = Vec::new();
        self.handshake.handle_datagram(raw, &mut actions);
        if !actions.is_empty() {
            self.carry_out(Instant::now(), actions);
        }
    }

    /// Carries out what the handshake asked for (see [`Action`]); what that feeds back to it
    /// is carried out in turn.
    pub(super) fn carry_out(&mut self, now: Instant, actions: Vec<Action>) {
        let mut actions = VecDeque::from(actions);
        while let Some(action) = actions.pop_front() {
            let mut more = Vec::new();
            match action {
                Action::Send { peer, to, msg } => {
                    if !self.send_handshake(&to, &msg) {
                        self.handshake.unsent(now, &peer);
                    }
                }
                Action::Accept {
                    peer,
                    request,
                    psns,
                    prior,
                } => {
                    let result = self.accept(&peer, &request, psns, prior);
                    self.handshake
                        .accepted(now, &peer, &request, prior, result, &mut more);
                }
                Action::Complete {
                    peer,
                    response,
                    local,
                } => {
                    let result = self.complete(&peer, &response, local);
                    self.handshake
                        .completed(&peer, &response, result, &mut more);
                }
                Action::Ready { peer } => {
                    if let Some(c) = self.peers.get_mut(&peer) {
                        c.ready = true;
                    }
                    self.flush(&peer);
                }
                Action::Promote { peer } => self.promote(&peer),
                Action::DropCandidate { peer } => {
                    if let Some((data, msg)) = self.candidates.remove(&peer) {
                        self.retire_unused(data, msg);
                    }
                }
                Action::Fail { peer, why } => self.fail_peer(&peer, &why.to_string()),
            }
            actions.extend(more);
        }
    }

    /// Accepts `peer`'s `request`: QPs as `prior` says (ours requested from it: reuse; a
    /// connection it replaces: retire it — what it holds settles from the flushes, what it
    /// never posted moves over — and create new ones), connected to the request's with our
    /// first PSNs `psns`. A failure fails what was queued.
    pub(super) fn accept(
        &mut self,
        peer: &NetAddr,
        request: &Handshake,
        (data_psn, msg_psn): (u32, u32),
        prior: Prior,
    ) -> Result<Ends, String> {
        if self.options.faults.delay_request_ms > 0 && prior == Prior::None {
            // Test fault: a responder slow to answer a new peer.
            std::thread::sleep(Duration::from_millis(self.options.faults.delay_request_ms));
        }
        if prior == Prior::Candidate {
            let (data, msg) = self
                .new_qps()
                .map_err(|e| format!("no QPs for a candidate connection: {}", e.message))?;
            if let Err(e) = self.connect_qps(&data, &msg, request, data_psn, msg_psn) {
                self.retire_unused(data, msg);
                return Err(format!("accepting {peer}: {e}"));
            }
            self.route(peer, &data, &msg);
            let ends = Ends {
                data_qpn: data.qpn,
                data_psn,
                msg_qpn: msg.qpn,
                msg_psn,
            };
            if let Some((old_data, old_msg)) = self.candidates.insert(peer.clone(), (data, msg)) {
                self.retire_unused(old_data, old_msg);
            }
            return Ok(ends);
        }
        let (data, msg, queued) = match self.peers.remove(peer) {
            Some(c) if prior == Prior::Requesting => (c.data, c.msg, c.queued),
            Some(c) => {
                let queued = self.retire_connection(c.data, c.msg, c.queued);
                match self.new_qps() {
                    Ok((d, m)) => (d, m, queued),
                    Err(e) => {
                        let why = format!("no QPs for the new connection: {}", e.message);
                        self.fail_queued(peer, queued, &why);
                        return Err(why);
                    }
                }
            }
            None => {
                let (d, m) = self
                    .new_qps()
                    .map_err(|e| format!("no QPs for the new connection: {}", e.message))?;
                (d, m, VecDeque::new())
            }
        };
        if let Err(e) = self.connect_qps(&data, &msg, request, data_psn, msg_psn) {
            let why = format!("accepting {peer}: {e}");
            log::line(&format!("{}: {why}", self.name));
            self.fail_connection(peer, data, msg, queued, &why);
            return Err(why);
        }
        let ends = Ends {
            data_qpn: data.qpn,
            data_psn,
            msg_qpn: msg.qpn,
            msg_psn,
        };
        self.install(peer, (data, msg), queued, false);
        Ok(ends)
    }

    /// The candidate's `Ready` came: it replaces the connection it stood beside, which is
    /// retired (what it holds settles from its flushes; what it never posted moves over).
    pub(super) fn promote(&mut self, peer: &NetAddr) {
        let Some((data, msg)) = self.candidates.remove(peer) else {
            return;
        };
        let queued = match self.peers.remove(peer) {
            Some(old) => self.retire_connection(old.data, old.msg, old.queued),
            None => VecDeque::new(),
        };
        // Its Ready came: it posts at once.
        self.install(peer, (data, msg), queued, true);
        self.flush(peer);
    }

    /// Destroys QPs that never carried a connection's traffic (a dropped candidate).
    pub(super) fn retire_unused(&mut self, mut data: Qp, mut msg: Qp) {
        let _ = data.move_to_error();
        let _ = msg.move_to_error();
        self.dead_qps.insert(data.qpn);
        self.bury(data, msg);
    }

    /// The first successful completion or arrival on QP `qpn`: if it belongs to its peer's
    /// connection, that connection is proven (see `handshake`).
    pub(super) fn traffic_on(&mut self, qpn: u32) {
        let Some(peer) = self.qp_peer.get(&qpn).cloned() else {
            return;
        };
        if self
            .candidates
            .get(&peer)
            .is_some_and(|(d, m)| d.qpn == qpn || m.qpn == qpn)
        {
            // A candidate's: it proves its connection once promoted, at the next completion.
            self.unproven.insert(qpn);
            return;
        }
        if self
            .peers
            .get(&peer)
            .is_some_and(|c| c.data.qpn == qpn || c.msg.qpn == qpn)
        {
            let mut actions = Vec::new();
            self.handshake.proven(&peer, &mut actions);
            self.carry_out(Instant::now(), actions);
        }
    }

    /// Connects our requested QPs (`local`) to `response`'s.
    pub(super) fn complete(
        &mut self,
        peer: &NetAddr,
        response: &Handshake,
        local: Ends,
    ) -> Result<(), String> {
        if self.options.faults.delay_response_ms > 0 {
            // Test fault: a requester slow to bring its QPs up.
            std::thread::sleep(Duration::from_millis(self.options.faults.delay_response_ms));
        }
        let Some(c) = self.peers.remove(peer) else {
            return Err("the connection is gone".into());
        };
        debug_assert_eq!((c.data.qpn, c.msg.qpn), (local.data_qpn, local.msg_qpn));
        let result = self
            .connect_qps(&c.data, &c.msg, response, local.data_psn, local.msg_psn)
            .map_err(|e| {
                format!(
                    "connecting the QPs failed: {e} (local GID index {}, MTU {}; peer MTU {})",
                    self.attr.gid_index, self.attr.active_mtu, response.mtu
                )
            });
        self.peers.insert(peer.clone(), c);
        result
    }

    /// Resends and deadlines of the handshakes under way (and the `forge_requests_every_ms`
    /// fault); returns when they next need this, `None` with none under way. Runs at every
    /// poll: with no handshake under way (the steady state) it reads no clock (a system call
    /// where the TSC is unusable, as in the soft-RoCE guest).
    pub(super) fn check_handshakes(&mut self) -> Option<Instant> {
        let forge = Duration::from_millis(self.options.faults.forge_requests_every_ms);
        let due = self.handshake.poll_timeout();
        if due.is_none() && forge.is_zero() {
            return None;
        }
        let now = Instant::now();
        if !forge.is_zero() && now.duration_since(self.last_forged) >= forge {
            self.last_forged = now;
            self.forge_requests();
        }
        let mut due = due;
        if due.is_some_and(|due| due <= now) {
            let mut actions = Vec::new();
            self.handshake.handle_timeout(now, &mut actions);
            self.carry_out(now, actions);
            due = self.handshake.poll_timeout();
        }
        let forged = (!forge.is_zero()).then(|| self.last_forged + forge);
        due.into_iter().chain(forged).min()
    }

    /// Test fault: a request for every connected peer that names no connection (as a stale
    /// or forged datagram would), with our current QPs.
    pub(super) fn forge_requests(&mut self) {
        let forged: Vec<(NetAddr, Handshake)> = self
            .peers
            .iter()
            .filter(|(_, c)| c.ready)
            .map(|(peer, c)| {
                (
                    peer.clone(),
                    Handshake {
                        kind: Kind::Request,
                        request_id: self.rng.u64(..),
                        prev: 0,
                        from: self.me,
                        data_qpn: c.data.qpn,
                        data_psn: 0,
                        msg_qpn: c.msg.qpn,
                        msg_psn: 0,
                        mtu: self.attr.active_mtu as u8,
                    },
                )
            })
            .collect();
        for (peer, h) in forged {
            if let Ok(to) = VerbsAddr::decode(peer.raw()) {
                self.send_handshake(&to, &h);
            }
        }
    }
}
