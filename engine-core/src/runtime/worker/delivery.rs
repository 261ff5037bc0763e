//! What reaches the engine's users from a pass: messages routed to the receive handler or
//! the inbox, arrivals counted and mirrored, finished transfers and met expectations
//! delivered, deadlines ended.

use std::panic::{catch_unwind, AssertUnwindSafe};
use std::sync::atomic::Ordering;
use std::sync::Arc;

use super::Worker;
use crate::error::Error;
use crate::imm::Outcome;
use crate::notifications::Refused;
use crate::runtime::clock::Stamp;
use crate::runtime::completion::{send_batch, CounterRun};
use crate::runtime::dispatch::{map_domain_error, Routed, Unrouted};
use crate::runtime::{Command, Mirror, Shared};
use crate::wire::{NetAddr, MESSAGE_HEADER_LEN};

/// Logs a dropped notification: the first of each kind, then at every power of two, so a
/// flood from a refused peer cannot flood the log as well.
fn report_dropped_notification(why: Refused, shared: &Shared) {
    let dropped = shared
        .notifications
        .lock()
        .unwrap_or_else(|p| p.into_inner())
        .dropped();
    if dropped.is_power_of_two() {
        let reason = match why {
            Refused::Sender => "its sender is not among the peers allowed to notify",
            Refused::Full => "worker.max_notifications are queued and not taken",
            Refused::Forged => "it claims a sender other than the one the transport proved",
            Refused::Share => {
                "its sender has worker.max_notifications_per_peer queued and not taken"
            }
        };
        tracing::error!("a notification was dropped: {reason} ({dropped} dropped so far)");
    }
}

impl Worker {
    /// Carries out the core's routing of the messages that arrived: a user's to the receive
    /// handler on the callback thread, a notification to the inbox; the buffers of those not
    /// handed to the handler go back to the NIC here and now.
    pub(super) fn route_messages(&mut self) {
        let handler = self.shared.recv_handler.get();
        let payload_max = handler.map(|(max, _)| *max);
        for routed in self.core.poll_messages(payload_max) {
            match routed {
                Routed::User { data, sender } => {
                    // Routed to the handler only when one is set.
                    if let Some((max, handler)) = handler {
                        hand_to_receive_handler(
                            &self.shared,
                            *max,
                            Arc::clone(handler),
                            data,
                            sender,
                        )
                    }
                }
                Routed::Notification(note) => {
                    let offered = self
                        .shared
                        .notifications
                        .lock()
                        .unwrap_or_else(|p| p.into_inner())
                        .offer(note);
                    match offered {
                        Ok(()) => self.shared.notified.notify_all(),
                        Err(why) => report_dropped_notification(why, &self.shared),
                    }
                }
                Routed::Dropped(Unrouted::NoHandler) => {
                    tracing::error!("a message arrived with no receive handler; dropped")
                }
                Routed::Dropped(Unrouted::TooLarge { len, max }) => tracing::error!(
                    "a message of {len} bytes arrived for receive buffers of {max}; dropped"
                ),
                Routed::Dropped(Unrouted::Malformed(e)) => {
                    tracing::warn!("{e} arrived; dropped")
                }
            }
        }
        let reposts = self.core.take_reposts();
        if let (Some(max), true) = (payload_max, reposts > 0) {
            let buf_len = crate::wire::receive_buffer_len(max);
            if let Err(e) = self.group.domains_mut()[0].post_recvs(buf_len, reposts) {
                let e = map_domain_error(&self.shared.backend, e);
                tracing::error!(error = %e, "cannot post a receive buffer again");
            }
        }
    }

    /// Counts the core's runs of arrivals into the ImmCounter, taking its lock once per
    /// batch of events, then reports mirrored totals.
    pub(super) fn count_arrivals(&mut self) {
        let mut counter = self.shared.lock_imm();
        // Read under the lock `mirror_imm_count` registers under: a mirror registered before
        // this batch was counted is reported it.
        let mirrored = self.shared.has_mirrors.load(Ordering::Acquire);
        for (value, from, n) in self.core.poll_arrivals() {
            counter.handle_arrivals_from(value, n, from.as_ref(), &mut self.imm_outcomes);
            if mirrored && !self.arrived.contains(&value) {
                self.arrived.push(value);
            }
        }
        if self.arrived.is_empty() {
            return;
        }
        let totals: Vec<(u32, u64)> = self
            .arrived
            .drain(..)
            .map(|v| (v, counter.total(v)))
            .collect();
        drop(counter);
        // User sinks run with no engine lock held; clone them out of the map first.
        let sinks: Vec<(u32, u64, Arc<Mirror>)> = {
            let mirrors = self
                .shared
                .mirrors
                .read()
                .unwrap_or_else(|p| p.into_inner());
            totals
                .iter()
                .flat_map(|&(v, total)| {
                    mirrors
                        .get(&v)
                        .into_iter()
                        .flatten()
                        .map(move |m| (v, total, Arc::clone(m)))
                })
                .collect()
        };
        let mut any_failed = false;
        for (v, total, sink) in sinks {
            sink.report(v, total);
            any_failed |= sink.is_failed();
        }
        if any_failed {
            self.shared
                .mirrors
                .write()
                .unwrap_or_else(|p| p.into_inner())
                .values_mut()
                .for_each(|list| list.retain(|m| !m.is_failed()));
        }
    }

    /// Hands finished transfers and met expectations to their waiters.
    pub(super) fn deliver(&mut self) {
        let finished = self.core.finished();
        // Most passes of a waiting worker finish nothing: then not even the drains run.
        if finished == 0 && self.imm_outcomes.is_empty() && self.callbacks.is_empty() {
            return;
        }
        // Capacity first: whoever sees one of these done (a flag or counter is set right
        // here) may submit again at the limit at once, and must not be told Busy.
        self.shared.finished(finished);
        let mut run = CounterRun::default();
        if finished > 0 {
            for (on_done, result) in self.core.poll_deliveries(Stamp::now()) {
                run.complete(on_done, result.map_err(|e| *e), &mut self.callbacks);
            }
        }
        let timeout = self.shared.config.timeouts.expect();
        for outcome in self.imm_outcomes.drain(..) {
            match outcome {
                Outcome::Met(w) => run.complete(w, Ok(()), &mut self.callbacks),
                Outcome::Expired { waiter, dropped } => {
                    let error = if dropped > 0 {
                        Error::ArrivalsDropped { timeout, dropped }
                    } else {
                        Error::Timeout(timeout)
                    };
                    run.complete(waiter, Err(error), &mut self.callbacks)
                }
            }
        }
        run.flush();
        send_batch(&mut self.callbacks, &self.shared.jobs);
    }

    /// Ends transfers and expectations whose deadlines are at or before `now`.
    pub(super) fn expire(&mut self, now: Stamp) {
        self.core.handle_timeout(now);
        self.shared
            .lock_imm()
            .poll_expired(self.anchor.instant(now), &mut self.imm_outcomes);
        self.deliver();
    }
}

/// Runs the receive handler on `data`'s payload on the callback thread, then gives its
/// buffer back to the NIC — also when the handler panics, or the pool would shrink by one
/// buffer per panic.
pub(super) fn hand_to_receive_handler(
    shared: &Arc<Shared>,
    payload_max: usize,
    handler: crate::runtime::RecvHandler,
    data: Vec<u8>,
    sender: Option<NetAddr>,
) {
    let buf_len = crate::wire::receive_buffer_len(payload_max);
    let weak = Arc::downgrade(shared);
    let job = Box::new(move || {
        let payload = &data[MESSAGE_HEADER_LEN..];
        let handled = catch_unwind(AssertUnwindSafe(|| handler(payload, sender.as_ref())));
        if let Some(shared) = weak.upgrade() {
            let _ = shared.submit(Command::PostRecvs {
                buf_len,
                count: 1,
                reply: None,
            });
        }
        if let Err(panic) = handled {
            std::panic::resume_unwind(panic);
        }
    });
    let _ = shared.jobs.send(Some(job));
}
