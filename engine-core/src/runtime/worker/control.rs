//! The commands the worker carries out itself: registrations, receive buffers, cancels,
//! statistics (transfers and messages go to the core).

use std::sync::atomic::Ordering;
use std::time::Instant;

use super::Worker;
use crate::domain::Registration;
use crate::error::Result;
use crate::runtime::clock::Stamp;
use crate::runtime::dispatch::map_domain_error;
use crate::runtime::Command;

impl Worker {
    /// Transfers and messages go to the core; anything else is carried out here, after the
    /// work submitted before it was handed to the NICs.
    pub(super) fn handle_command(&mut self, cmd: Command) {
        let now = self.stamp;
        // A listed transfer's operations join the burst, posted in lists once it holds a
        // list's worth, at the end of the pass, or before the next command of another kind
        // (whichever comes first: a NIC is not kept waiting for a whole pass).
        match cmd {
            Command::Listed {
                ops,
                on_done,
                submitted,
            } => self.core.handle_rdma(now, ops, on_done, submitted),
            Command::Pages {
                work,
                on_done,
                submitted,
            } => self.core.handle_pages(now, work, on_done, submitted),
            Command::Send {
                peer,
                data,
                on_done,
                submitted,
            } => self.core.handle_send(now, peer, data, on_done, submitted),
            other => {
                self.carry_out_posts();
                return self.handle_control(other);
            }
        };
        if self.core.has_urgent_posts() {
            self.carry_out_posts();
        }
    }

    pub(super) fn handle_control(&mut self, cmd: Command) {
        match cmd {
            Command::Listed { .. } | Command::Pages { .. } | Command::Send { .. } => {
                unreachable!("the core's")
            }
            Command::Register { region, reply } => {
                let began = Instant::now();
                let result = self.register(&region);
                let took = u64::try_from(began.elapsed().as_micros()).unwrap_or(u64::MAX);
                self.core
                    .handle_registered(result.as_ref().ok().map(|_| (region.len, took)));
                if let Err(unsent) = reply.send(result) {
                    // The caller stopped waiting and was told it failed: undo it, so no
                    // registration outlives the caller's knowledge of it.
                    if let Ok(regs) = unsent.into_inner() {
                        for (d, reg) in self.group.domains_mut().iter_mut().zip(&regs) {
                            let _ = d.deregister(reg.local_key);
                        }
                    }
                }
            }
            Command::Deregister { keys, reply, keep } => {
                self.core.handle_deregistered();
                let mut result = Ok(());
                for (domain, key) in self.group.domains_mut().iter_mut().zip(keys) {
                    if let Err(e) = domain.deregister(key) {
                        result = result.and(Err(map_domain_error(&self.shared.backend, e)));
                    }
                }
                if result.is_ok() {
                    drop(keep);
                } else {
                    // A NIC refused to let go of the registration: the memory stays (leaked).
                    std::mem::forget(keep);
                }
                let _ = reply.send(result);
            }
            Command::PostRecvs {
                buf_len,
                count,
                reply,
            } => {
                let result = self.group.domains_mut()[0]
                    .post_recvs(buf_len, count)
                    .map_err(|e| map_domain_error(&self.shared.backend, e));
                match reply {
                    Some(reply) => {
                        let _ = reply.send(result);
                    }
                    None => {
                        if let Err(e) = result {
                            tracing::error!(error = %e, "cannot post a receive buffer again");
                        }
                    }
                }
            }
            Command::Cancel { control } => {
                if let Some(id) = control.posted_id() {
                    self.core.cancel(id);
                }
            }
            Command::Stats { reply } => {
                let mut stats = self.core.stats(Stamp::now());
                stats.outstanding = self.shared.outstanding.load(Ordering::Acquire) as u64;
                {
                    let imm = self.shared.lock_imm();
                    stats.imm_dropped = imm.dropped();
                    stats.imm_idle = imm.idle() as u64;
                    stats.imm_owed = imm.owed_total();
                }
                stats.notifications_dropped = self
                    .shared
                    .notifications
                    .lock()
                    .unwrap_or_else(|p| p.into_inner())
                    .dropped();
                let _ = reply.send(Ok(stats));
            }
            Command::Shutdown => unreachable!("handled by run"),
        }
    }

    /// Registers `region` with every NIC, once the core found they all can; undoes the
    /// registrations made when one NIC refuses.
    pub(super) fn register(
        &mut self,
        region: &crate::domain::MemoryRegion,
    ) -> Result<Vec<Registration>> {
        self.core.check_registration(region)?;
        let domains = self.group.domains_mut();
        let mut done = Vec::with_capacity(domains.len());
        for i in 0..domains.len() {
            match domains[i].register(region) {
                Ok(reg) => done.push(reg),
                Err(e) => {
                    for (d, reg) in domains.iter_mut().zip(&done) {
                        let _ = d.deregister(reg.local_key);
                    }
                    return Err(map_domain_error(&self.shared.backend, e));
                }
            }
        }
        Ok(done)
    }
}
