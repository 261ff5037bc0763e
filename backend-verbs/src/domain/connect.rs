//! Connections being made: carrying out what the pure handshake (`crate::handshake`) asks —
//! QPs created, connected, installed, promoted, dropped — and its timers and test faults.

use std::collections::VecDeque;
use std::time::Instant;

use xfer_plugin::addr::NetAddr;
use xfer_plugin::domain::{DomainError, DomainErrorKind};

use super::connections::Connection;
use super::datapath::cq_may_have_resized;
use super::{err, other, VerbsDomain};
use crate::ffi::{Attr, Device, Qp};
use crate::handshake::{Action, Ends, Prior};
use crate::log;
use crate::options::VerbsOptions;
use crate::wire::{Handshake, Kind, VerbsAddr};

/// Connects our `(data, msg)` QPs to the ones `h` names, with our first PSNs `psns`, on
/// `device` with the Domain's path settings.
fn connect_qps(
    (device, options, attr): (&mut Device, &VerbsOptions, &Attr),
    (data, msg): (&Qp, &Qp),
    h: &Handshake,
    (data_psn, msg_psn): (u32, u32),
) -> Result<(), String> {
    let mtu = i32::from(h.mtu.min(attr.active_mtu as u8));
    let t = (options.ack_timeout, options.retry_cnt, options.rnr_retry);
    device.connect(
        data,
        h.data_qpn,
        h.data_psn,
        data_psn,
        &h.from.gid,
        h.from.lid,
        mtu,
        t,
    )?;
    device.connect(
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
        Ok((data, msg))
    }

    /// Sends a handshake datagram; false if it could not go now (every send slot busy, or
    /// an error), in which case requests are resent on the next check and responses on the
    /// peer's next request.
    pub(super) fn send_handshake(&mut self, to: &VerbsAddr, h: &Handshake) -> bool {
        let bytes = self.handshake.seal(h, to);
        match self.device.ud_send(&to.gid, to.lid, to.ud_qpn, &bytes) {
            Ok(()) => {
                if self.faults.handshake_sent() {
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
        if self.handshake.requesting_full() {
            // Refused before any QP is built.
            return Err(err(
                DomainErrorKind::Other,
                self.handshake.requesting_refusal(peer),
            ));
        }
        let (data, msg) = self.new_qps()?;
        let mut actions = Vec::new();
        let now = Instant::now();
        let qpns = (data.qpn, msg.qpn);
        if let Err(e) = self.handshake.connect(now, peer, qpns, &mut actions) {
            self.connections.retire_unused(now, (data, msg));
            return Err(err(DomainErrorKind::InvalidArgument, e));
        }
        self.connections.pending(peer, (data, msg), VecDeque::new());
        self.carry_out(now, actions);
        Ok(())
    }

    pub(super) fn handle_handshake(&mut self, raw: &[u8]) {
        let mut actions = Vec::new();
        // Senders' epochs are checked against it (a far-future one is refused).
        let wall = std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .map_or(0, |d| d.as_nanos() as u64);
        self.handshake.handle_wall_clock(wall);
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
                    self.connections.ready(&peer);
                    self.flush(&peer);
                }
                Action::Promote { peer } => self.promote(now, &peer),
                Action::DropCandidate { peer } => self.connections.drop_candidate(now, &peer),
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
        if let (Some(delay), Prior::None) = (self.faults.request_delay(), prior) {
            // Test fault: a responder slow to answer a new peer.
            std::thread::sleep(delay);
        }
        let psns = (data_psn, msg_psn);
        let now = Instant::now();
        if prior == Prior::Candidate {
            let (data, msg) = self
                .new_qps()
                .map_err(|e| format!("no QPs for a candidate connection: {}", e.message))?;
            let path = (&mut self.device, &self.options, &self.attr);
            if let Err(e) = connect_qps(path, (&data, &msg), request, psns) {
                self.connections.retire_unused(now, (data, msg));
                return Err(format!("accepting {peer}: {e}"));
            }
            let ends = Ends {
                data_qpn: data.qpn,
                data_psn,
                msg_qpn: msg.qpn,
                msg_psn,
            };
            self.connections.candidate(now, peer, (data, msg));
            return Ok(ends);
        }
        let (data, msg, queued) = match self.connections.take(peer) {
            Some(c) if prior == Prior::Requesting => (c.data, c.msg, c.queued),
            Some(c) => {
                let queued = self.retire_connection(c);
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
        let path = (&mut self.device, &self.options, &self.attr);
        if let Err(e) = connect_qps(path, (&data, &msg), request, psns) {
            let why = format!("accepting {peer}: {e}");
            log::line(&format!("{}: {why}", self.name));
            let c = Connection {
                data,
                msg,
                queued,
                ready: false,
            };
            self.fail_connection(peer, c, &why);
            return Err(why);
        }
        let ends = Ends {
            data_qpn: data.qpn,
            data_psn,
            msg_qpn: msg.qpn,
            msg_psn,
        };
        self.connections.pending(peer, (data, msg), queued);
        Ok(ends)
    }

    /// The candidate's `Ready` came: it replaces the connection it stood beside, which is
    /// retired (what it holds settles from its flushes; what it never posted moves over).
    pub(super) fn promote(&mut self, now: Instant, peer: &NetAddr) {
        if let Some(lost) = self.connections.promote(now, peer) {
            self.replaced(lost);
            // Its Ready came: it posts at once.
            self.flush(peer);
        }
    }

    /// The first successful completion or arrival on QP `qpn`: if it belongs to its peer's
    /// live connection, that connection is proven (see `handshake`). One branch in the
    /// steady state, where nothing is unproven.
    pub(super) fn traffic_on(&mut self, qpn: u32) {
        if let Some(peer) = self.connections.first_traffic(qpn) {
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
        if let Some(delay) = self.faults.response_delay() {
            // Test fault: a requester slow to bring its QPs up.
            std::thread::sleep(delay);
        }
        let Some(c) = self.connections.get(peer) else {
            return Err("the connection is gone".into());
        };
        debug_assert_eq!((c.data.qpn, c.msg.qpn), (local.data_qpn, local.msg_qpn));
        let path = (&mut self.device, &self.options, &self.attr);
        let psns = (local.data_psn, local.msg_psn);
        connect_qps(path, (&c.data, &c.msg), response, psns).map_err(|e| {
            format!(
                "connecting the QPs failed: {e} (local GID index {}, MTU {}; peer MTU {})",
                self.attr.gid_index, self.attr.active_mtu, response.mtu
            )
        })
    }

    /// Resends and deadlines of the handshakes under way (and the `forge_requests_every_ms`
    /// fault); returns when they next need this, `None` with none under way. Runs at every
    /// poll: with no handshake under way (the steady state) it reads no clock (a system call
    /// where the TSC is unusable, as in the soft-RoCE guest).
    pub(super) fn check_handshakes(&mut self) -> Option<Instant> {
        let due = self.handshake.poll_timeout();
        if due.is_none() && self.faults.next_forge().is_none() {
            return None;
        }
        let now = Instant::now();
        if self.faults.forge_due(now) {
            self.forge_requests();
        }
        let mut due = due;
        if due.is_some_and(|due| due <= now) {
            let mut actions = Vec::new();
            self.handshake.handle_timeout(now, &mut actions);
            self.carry_out(now, actions);
            due = self.handshake.poll_timeout();
        }
        due.into_iter().chain(self.faults.next_forge()).min()
    }

    /// Test fault: a request for every connected peer that names no connection (as a stale
    /// or forged datagram would), with our current QPs.
    pub(super) fn forge_requests(&mut self) {
        let forged: Vec<(NetAddr, Handshake)> = self
            .connections
            .iter()
            .filter(|(_, c)| c.ready)
            .map(|(peer, c)| {
                (
                    peer.clone(),
                    Handshake {
                        kind: Kind::Request,
                        request_id: self.rng.u64(..),
                        cookie: 0,
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
