//! What completes: the CQ drained and routed by work-request id and QP number only (a failed
//! completion's other fields are undefined), writes settled in order, receives reposted.

use std::sync::atomic::Ordering;

use xfer_plugin::addr::NetAddr;
use xfer_plugin::domain::{DomainError, DomainErrorKind, Event};

use super::{err, failed_completion, other, VerbsDomain};
use crate::completion::Outstanding;
use crate::ffi::{
    self, Wc, WorkRequest, KIND_RECV_IMM, KIND_RECV_MSG, KIND_UD_RECV, TAG_MASK, TAG_MSG_RECV,
};

/// A failed completion of `wc.wr_id`: the writes posted before it succeeded (RC completes in
/// order), and it failed with the completion's status.
pub(super) fn settle_failure(
    outstanding: &mut Outstanding<WorkRequest>,
    wc: &Wc,
    text: &str,
    events: &mut Vec<Event>,
) {
    let (before, failed) = outstanding.fail(wc.wr_id);
    events.extend(before.into_iter().map(|wr_id| Event::Done {
        wr_id,
        result: Ok(()),
    }));
    if let Some(wr_id) = failed {
        events.push(Event::Done {
            wr_id,
            result: Err(failed_completion(wc.status, text.to_owned())),
        });
    }
}

/// `IBV_WC_WR_FLUSH_ERR`: the work request never executed (its QP was in the error state).
pub(super) const WC_WR_FLUSH_ERR: i32 = 5;

impl VerbsDomain {
    /// Reposts the immediate receives consumed so far, in one batch. What the SRQ refuses stays
    /// owed and is reported: an SRQ that runs dry would stall every writer (RNR) silently.
    pub(super) fn refill_imm_receives(&mut self) -> Result<(), DomainError> {
        if self.imm_deficit == 0 {
            return Ok(());
        }
        let (posted, error) = self
            .device
            .post_imm_recvs(self.next_imm_recv, self.imm_deficit);
        self.next_imm_recv += u64::from(posted);
        self.imm_deficit -= posted;
        match error {
            None => Ok(()),
            Some(e) => Err(other(format!(
                "{}: {} immediate receives could not be reposted ({e}); writers will stall",
                self.name, self.imm_deficit
            ))),
        }
    }

    /// The peer of a failed completion's QP, and a message naming the status, the device
    /// and the peer.
    pub(super) fn describe_failure(&self, wc: &Wc) -> (Option<NetAddr>, String) {
        let peer = self.connections.route(wc.qp_num).cloned();
        let text = format!(
            "{} (vendor error {:#x}) on {} to {}",
            ffi::status_text(wc.status),
            wc.vendor_err,
            self.name,
            peer.as_ref()
                .map_or("an unknown peer".into(), |p| p.to_string())
        );
        (peer, text)
    }

    /// A completion of a data QP: settles the writes it completes, in post order.
    pub(super) fn data_completion(&mut self, wc: &Wc, events: &mut Vec<Event>) {
        if self.connections.is_dead(wc.qp_num) {
            self.settle_flushed(wc, events);
            return;
        }
        let failure = (wc.status != 0).then(|| self.describe_failure(wc));
        let Some(q) = self.connections.queue_mut(wc.qp_num) else {
            return;
        };
        q.progress.moved();
        let Some((peer, text)) = failure else {
            events.extend(
                q.outstanding
                    .complete()
                    .into_iter()
                    .map(|wr_id| Event::Done {
                        wr_id,
                        result: Ok(()),
                    }),
            );
            return;
        };
        if wc.status == WC_WR_FLUSH_ERR {
            // The first error on a live QP is a flush: the peer broke the connection (its
            // side went to the error state, e.g. after its own bad write). Nothing from this
            // write on executed, so it goes out again on a new connection — our caller did
            // nothing wrong. Once only: a write flushed twice fails.
            let (before, rest) = q.outstanding.flushed_from(wc.wr_id);
            events.extend(before.into_iter().map(|wr_id| Event::Done {
                wr_id,
                result: Ok(()),
            }));
            if let Some(p) = peer {
                self.reconnect_with(&p, rest, &text);
                return;
            }
            events.extend(rest.into_iter().map(|w| Event::Done {
                wr_id: w.user,
                result: Err(failed_completion(wc.status, text.clone())),
            }));
            self.connections.settled(wc.qp_num);
            return;
        }
        // RC completes in order: what was posted before the failed write succeeded.
        settle_failure(&mut q.outstanding, wc, &text, events);
        // The QP is in error now: the rest fail, and the next transfer reconnects.
        match peer {
            Some(p) => self.fail_peer(&p, &format!("the connection failed: {text}")),
            None => self.connections.settled(wc.qp_num),
        }
    }

    /// A completion of a data QP already in the error state: settles the writes it names (a
    /// flush fails its write; a success completes its chain), without failing the connection
    /// again.
    pub(super) fn settle_flushed(&mut self, wc: &Wc, events: &mut Vec<Event>) {
        let text = (wc.status != 0).then(|| self.describe_failure(wc).1);
        let Some(q) = self.connections.queue_mut(wc.qp_num) else {
            return;
        };
        match text {
            None => events.extend(
                q.outstanding
                    .complete()
                    .into_iter()
                    .map(|wr_id| Event::Done {
                        wr_id,
                        result: Ok(()),
                    }),
            ),
            Some(text) => settle_failure(&mut q.outstanding, wc, &text, events),
        }
        self.connections.settle_if_empty(wc.qp_num);
    }

    /// Reads every completion on the CQ into `events`.
    pub(super) fn drain_cq(&mut self, events: &mut Vec<Event>) -> Result<(), DomainError> {
        let mut wcs = std::mem::take(&mut self.wcs);
        let result = loop {
            let n = match self.device.poll(&mut wcs) {
                Ok(n) => n,
                Err(e) => break Err(other(e)),
            };
            for wc in &wcs[..n] {
                if wc.status == 0 && wc.kind != KIND_UD_RECV {
                    self.traffic_on(wc.qp_num);
                }
                match wc.kind {
                    KIND_UD_RECV => {
                        let len = (wc.byte_len as usize).min(wc.data.len());
                        let raw = wc.data[..len].to_vec();
                        self.handle_handshake(&raw);
                    }
                    KIND_RECV_IMM => {
                        if wc.status == 0 {
                            events.push(Event::ImmArrival {
                                imm: wc.imm,
                                // The QP says who wrote: RC connects one peer per QP.
                                from: self.connections.route(wc.qp_num).cloned(),
                            });
                        }
                        if let Some(stall) = self.faults.stall_on_arrival() {
                            // Test fault: a worker stalled (a long registration, say) while
                            // arrivals keep completing on the CQ.
                            std::thread::sleep(stall);
                        }
                        // Reposted in one batch at the end of this poll.
                        self.imm_deficit += 1;
                    }
                    KIND_RECV_MSG => {
                        let index = (wc.wr_id & !TAG_MASK) as usize;
                        if wc.status != 0 {
                            // A failed receive (an oversized message) goes back on the SRQ:
                            // the pool must not shrink.
                            let reposted = self.receives.post_recv(
                                &mut self.device,
                                index,
                                TAG_MSG_RECV | index as u64,
                            );
                            if reposted.is_err() {
                                self.receives.release(index);
                            }
                        } else if let Some(data) =
                            self.receives.take_message(index, wc.byte_len as usize)
                        {
                            events.push(Event::Message {
                                data,
                                // The QP says who sent it: RC connects one peer per QP,
                                // through a handshake that peer answered (see the ImmArrival).
                                from: self.connections.route(wc.qp_num).cloned(),
                            });
                        }
                    }
                    _ if self.connections.is_data(wc.qp_num) => {
                        self.data_completion(wc, events);
                    }
                    _ => {
                        // A message: every send is signalled, so each has its own completion.
                        let Some(send) = self.sends.remove(&wc.wr_id) else {
                            continue;
                        };
                        self.send_pool.release(send.buffer);
                        let result = if wc.status == 0 {
                            Ok(())
                        } else {
                            let (peer, text) = self.describe_failure(wc);
                            // A late error of a connection already replaced must not tear
                            // down its successor.
                            let current = peer
                                .as_ref()
                                .is_some_and(|p| self.connections.is_live_msg(p, wc.qp_num));
                            if let (true, Some(p)) = (current, peer) {
                                self.fail_peer(&p, &text);
                            }
                            Err(failed_completion(wc.status, text))
                        };
                        events.push(Event::Done {
                            wr_id: send.user,
                            result,
                        });
                    }
                }
            }
            if n < wcs.len() {
                break Ok(());
            }
        };
        self.wcs = wcs;
        result
    }

    /// When the worker is about to park (it announced so before this poll): arms the CQ for
    /// the notifier thread (once per event, see `notify`) and reads what completed since the
    /// drain, which raises no event. A busy worker's polls arm nothing (an armed CQ wakes the
    /// notifier thread at its next completion: CPU the NIC's driver may need).
    pub(super) fn arm_if_parking(&mut self, events: &mut Vec<Event>) -> Result<(), DomainError> {
        let Some((notify, waker)) = &self.notify else {
            return Ok(());
        };
        if !waker.worker_parking() || notify.armed.swap(true, Ordering::SeqCst) {
            return Ok(());
        }
        if let Err(e) = self.device.arm_cq() {
            notify.armed.store(false, Ordering::SeqCst);
            return Err(err(DomainErrorKind::Fatal, format!("{}: {e}", self.name)));
        }
        self.drain_cq(events)
    }
}
