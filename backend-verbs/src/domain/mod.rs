//! One RDMA device as an xfer Domain: RC QPs per peer, connected lazily through a handshake
//! on the device's UD QP.

use std::sync::atomic::Ordering;
use std::sync::Arc;
use std::time::{Duration, Instant};

use foldhash::HashMap;
use xfer_plugin::addr::NetAddr;
use xfer_plugin::domain::{
    post_one_by_one, Capabilities, Device as MemDevice, Domain, DomainCause, DomainError,
    DomainErrorKind, Event, MemoryRegion, PostStatus, RdmaPost, RegionTable, Registration, Waker,
};

use crate::ffi::{
    Attr, Device, MessageBuffers, Mr, RegistrationError, Wc, WorkRequest, TAG_MSG_RECV,
};
use crate::handshake::Handshaker;
use crate::log;
use crate::notify::NotifyState;
use crate::options::VerbsOptions;
use crate::wire::VerbsAddr;

mod completions;
mod connect;
mod connections;
mod datapath;
mod faults;
mod graveyard;
mod lifecycle;
mod memory;
mod setup;

use connections::{Connection, Connections, Queued};
use datapath::{next_send_id, post_message, SendBuffer};
use faults::Faults;

/// An RDMA device.
pub struct VerbsDomain {
    // Drop order: QPs, registrations and buffers before the device.
    /// Every connection and the QPs it retired (see `connections`).
    connections: Connections,
    /// Every peer's handshake (pure: see `handshake`).
    handshake: Handshaker,
    regions: RegionTable<Mr>,
    /// Message buffers posted to the message SRQ.
    receives: MessageBuffers,
    sends: HashMap<u64, SendBuffer>,
    /// Registered message buffers for sends (see `message_size_class`).
    send_pool: MessageBuffers,
    device: Device,
    attr: Attr,
    me: VerbsAddr,
    address: NetAddr,
    name: String,
    options: VerbsOptions,
    done: Vec<Event>,
    wcs: Vec<Wc>,
    rng: fastrand::Rng,
    /// The id of the next send-side work request (low bits; tagged `TAG_SEND`): unique per
    /// work request, so a failed completion names exactly one.
    next_wr: u64,
    /// Polls since the last check for peers that stopped answering.
    polls_since_check: u32,
    /// Immediate receives consumed and not yet reposted: refilled in one batch per poll, and
    /// kept owed (and reported) when the SRQ refuses them.
    imm_deficit: u32,
    next_imm_recv: u64,
    /// Handshake-QP resets already logged.
    ud_resets_seen: u64,
    /// Unauthenticated handshake datagrams already logged.
    unauthenticated_seen: u64,
    /// Faults the tests inject (only with the `faults` feature).
    faults: Faults,
    /// When this Domain next needs a poll though nothing arrives (see `publish_deadline`).
    deadline: Option<Instant>,
    /// Shared with the completion-channel thread once the engine gave a waker (see `notify`),
    /// and that waker (asked whether the worker is about to park).
    notify: Option<(Arc<NotifyState>, Waker)>,
}

fn err(kind: DomainErrorKind, message: impl Into<String>) -> DomainError {
    DomainError::new(kind, message)
}

fn other(message: String) -> DomainError {
    err(DomainErrorKind::Other, message)
}

/// A failed registration of host memory, its errno as the cause, with the memlock limit named
/// when the kernel could not pin the pages (ENOMEM: most often that limit, which `xfer doctor`
/// checks too).
fn registration_error(e: RegistrationError) -> DomainError {
    let mut message = e.message.clone();
    if e.is_out_of_memory() {
        let limit = xfer_topology::doctor::memlock_limit(std::path::Path::new("/proc"))
            .map_or("unlimited".to_owned(), |l| format!("{l} bytes"));
        message.push_str(&format!(
            " (locked-memory limit: {limit}; see `xfer doctor`)"
        ));
    }
    other(message).with_cause(DomainCause::Os(e.errno))
}

/// The error of a work completion that failed with `status` (an `ibv_wc_status`), which it
/// carries as its cause.
fn failed_completion(status: i32, text: impl Into<String>) -> DomainError {
    err(classify(status), text).with_cause(DomainCause::Status(status))
}

/// Maps a failed work completion to the engine's kinds.
fn classify(status: i32) -> DomainErrorKind {
    match status {
        10 => DomainErrorKind::RemoteAccess,   // REM_ACCESS_ERR
        9 => DomainErrorKind::InvalidArgument, // REM_INV_REQ_ERR: the request itself was malformed
        12 | 13 | 5 => DomainErrorKind::PeerUnreachable, // RETRY_EXC, RNR_RETRY_EXC, WR_FLUSH
        _ => DomainErrorKind::Other,
    }
}

impl Domain for VerbsDomain {
    fn address(&self) -> NetAddr {
        self.address.clone()
    }

    fn register(&mut self, region: &MemoryRegion) -> Result<Registration, DomainError> {
        let mr = match region.device {
            MemDevice::Cuda(index) => self.register_gpu(region, index)?,
            _ => self
                .device
                .register_region(region)
                .map_err(registration_error)?,
        };
        let key = self.regions.next_key();
        let remote_key = u64::from(mr.rkey);
        Ok(self.regions.insert(key, region, mr, remote_key))
    }

    /// Deregisters only once no work request can use the region: writes and reads that
    /// would use it but are not posted yet (queued for a connection, or in a chain) fail now;
    /// posted ones are waited for (polling here, completions kept for the next `poll`), at most
    /// `unreachable_ms`, after which their connections go to the error state (a QP in error
    /// executes nothing). Without this, a queued write was later posted with the dead lkey —
    /// a protection error that broke the connection and failed unrelated writes — and a
    /// posted read could land in memory already freed.
    fn deregister(&mut self, local_key: u64) -> Result<(), DomainError> {
        let lkey = self
            .regions
            .registration(local_key)
            .ok_or_else(|| {
                err(
                    DomainErrorKind::InvalidArgument,
                    format!("local key {local_key} is not registered"),
                )
            })?
            .lkey;
        let uses = |w: &WorkRequest| w.len > 0 && w.lkey == lkey;
        let gone = || {
            Err(err(
                DomainErrorKind::InvalidArgument,
                "its local region was deregistered before it was posted",
            ))
        };
        let mut failed = Vec::new();
        for c in self.connections.iter_mut() {
            c.queued.retain(|q| match q {
                Queued::Rdma(w) if uses(w) => {
                    failed.push(w.user);
                    false
                }
                _ => true,
            });
        }
        for (_, q) in self.connections.queues_mut() {
            q.chain.retain(|w| {
                let keep = !uses(w);
                if !keep {
                    failed.push(w.user);
                }
                keep
            });
        }
        self.done
            .extend(failed.into_iter().map(|wr_id| Event::Done {
                wr_id,
                result: gone(),
            }));
        let deadline = Instant::now() + Duration::from_millis(self.options.unreachable_ms);
        loop {
            let busy: Vec<u32> = self
                .connections
                .queues_mut()
                .filter(|(_, q)| q.outstanding.any(uses))
                .map(|(qpn, _)| qpn)
                .collect();
            if busy.is_empty() {
                break;
            }
            if Instant::now() >= deadline {
                for qpn in busy {
                    if let Some(peer) = self.connections.route(qpn).cloned() {
                        self.fail_peer(
                            &peer,
                            "a region its writes use was deregistered while they stayed unfinished",
                        );
                    }
                }
                break;
            }
            let mut events = Vec::new();
            self.poll(&mut events)?;
            self.done.append(&mut events);
        }
        self.regions.remove(local_key).map(drop)
    }

    /// A batch of pages and each run of a list's writes to one peer share one connection
    /// lookup and one doorbell (see `post_run`); one request goes alone.
    fn post_rdma(&mut self, post: RdmaPost<'_>) -> (usize, Result<PostStatus, DomainError>) {
        match post {
            RdmaPost::Pages { template, shifts } => self.post_pages(&template, shifts),
            RdmaPost::List(requests) => self.post_list(requests),
            one_or_newer => post_one_by_one(one_or_newer, |r| self.post_request(r)),
        }
    }

    fn capabilities(&self) -> Capabilities {
        Capabilities {
            reads: true,
            ..Capabilities::default()
        }
    }

    fn post_send(
        &mut self,
        wr_id: u64,
        peer: &NetAddr,
        data: &[u8],
    ) -> Result<PostStatus, DomainError> {
        let queued = self.queue_until_ready(peer, || Queued::Send {
            wr_id,
            data: data.to_vec(),
        })?;
        if queued {
            return Ok(PostStatus::Posted);
        }
        match self.connections.get_mut(peer) {
            Some(Connection {
                msg,
                queued,
                ready: true,
                ..
            }) => {
                if !queued.is_empty() {
                    return Ok(PostStatus::Busy);
                }
                let id = next_send_id(&mut self.next_wr);
                match post_message(
                    &mut self.device,
                    msg,
                    (&mut self.sends, &mut self.send_pool),
                    (id, wr_id),
                    data,
                ) {
                    Ok(true) => Ok(PostStatus::Posted),
                    Ok(false) => Ok(PostStatus::Busy),
                    Err(e) => Err(other(e)),
                }
            }
            _ => Err(err(
                DomainErrorKind::PeerUnreachable,
                format!("{peer} failed to connect"),
            )),
        }
    }

    fn post_recvs(&mut self, buf_len: usize, count: usize) -> Result<(), DomainError> {
        for _ in 0..count {
            let index = self
                .receives
                .take(&mut self.device, buf_len)
                .map_err(other)?;
            self.receives
                .post_recv(&mut self.device, index, TAG_MSG_RECV | index as u64)
                .map_err(other)?;
        }
        Ok(())
    }

    fn set_waker(&mut self, waker: Waker) -> bool {
        if !self.options.completion_channel || self.notify.is_some() {
            return false;
        }
        let state = Arc::new(NotifyState::default());
        let shared = state.clone();
        let thread_waker = waker.clone();
        let started = self
            .device
            .start_notifier(format!("xfer-verbs-{}", self.name), move |events| {
                crate::notify::run(&events, &shared, &thread_waker)
            });
        match started {
            Ok(()) => {
                self.notify = Some((state, waker));
                true
            }
            Err(e) => {
                log::line(&format!(
                    "{}: {e}; the engine polls this device on an interval",
                    self.name
                ));
                false
            }
        }
    }

    fn poll(&mut self, events: &mut Vec<Event>) -> Result<(), DomainError> {
        self.polls_since_check += 1;
        if self.polls_since_check >= 1024 {
            self.polls_since_check = 0;
            self.check_stalled_peers();
            let dropped = self.handshake.unauthenticated();
            if dropped != self.unauthenticated_seen {
                self.unauthenticated_seen = dropped;
                log::line(&format!(
                    "{}: {dropped} handshake datagrams without a valid MAC dropped so far (a peer without the cluster secret, or forged)",
                    self.name
                ));
            }
            self.read_async_events()?;
        }
        let async_pending = self
            .notify
            .as_ref()
            .is_some_and(|(n, _)| n.async_pending.load(Ordering::SeqCst));
        if async_pending {
            // The notifier saw one and stopped watching the fd until it is read: read, then
            // let it watch again.
            let read = self.read_async_events();
            if let Some((notify, _)) = &self.notify {
                notify.async_pending.store(false, Ordering::SeqCst);
            }
            self.device.kick();
            read?;
        }
        events.append(&mut self.done);
        // Arm whatever this drain found: completions that raise no event (a handshake
        // datagram, a flushed write of a dead QP) leave the worker idle, and it parks after
        // this poll. Arming only after an empty drain lost exactly those wake-ups (a receiver
        // parked unarmed right after a handshake datagram; guest runs failed 2 of 4).
        let result = self
            .drain_cq(events)
            .and_then(|()| self.arm_if_parking(events));
        let resets = self.device.ud_resets();
        if resets != self.ud_resets_seen {
            self.ud_resets_seen = resets;
            log::line(&format!(
                "{}: the handshake QP failed and was reset ({resets} so far); handshakes in flight are resent",
                self.name
            ));
        }
        // Every receive consumed in this pass goes back in one batch.
        let refill = self.refill_imm_receives();
        let handshakes = self.check_handshakes();
        // Work accepted earlier that waited for its connection (or for room on its send
        // queue) goes out; chains are rung by the calls that build them, so nothing new is
        // posted here.
        let connected: Vec<NetAddr> = self
            .connections
            .iter()
            .filter(|(_, c)| c.ready && !c.queued.is_empty())
            .map(|(a, _)| a.clone())
            .collect();
        for p in connected {
            self.flush(&p);
        }
        self.collect_graveyard();
        self.publish_deadline(handshakes);
        events.append(&mut self.done);
        result.and(refill)
    }

    fn poll_timeout(&self) -> Option<Instant> {
        self.deadline
    }
}

#[cfg(test)]
mod tests {
    #[test]
    fn messages_share_a_few_buffer_sizes() {
        assert_eq!(xfer_plugin::domain::message_size_class(0), 256);
        assert_eq!(xfer_plugin::domain::message_size_class(256), 256);
        assert_eq!(xfer_plugin::domain::message_size_class(257), 512);
        assert_eq!(xfer_plugin::domain::message_size_class(65_536), 65_536);
    }

    /// A failed registration keeps its errno, and names the memlock limit only when the
    /// kernel ran out of memory pinning the pages.
    #[test]
    fn a_failed_registration_carries_its_errno() {
        use xfer_plugin::domain::DomainCause;
        let oom = super::registration_error(crate::ffi::RegistrationError {
            message: "ibv_reg_mr of 4096 bytes: Cannot allocate memory".into(),
            errno: 12,
        });
        assert_eq!(oom.cause, Some(DomainCause::Os(12)));
        assert!(oom.message.contains("locked-memory limit"), "{oom}");
        let fault = super::registration_error(crate::ffi::RegistrationError {
            message: "ibv_reg_mr of 4096 bytes: Bad address".into(),
            errno: 14,
        });
        assert_eq!(fault.cause, Some(DomainCause::Os(14)));
        assert!(!fault.message.contains("locked-memory"), "{fault}");
    }

    /// A failed completion keeps the NIC's status as a typed cause, beside the kind it maps
    /// to and the status's name.
    #[test]
    fn a_failed_completion_carries_its_status() {
        use xfer_plugin::domain::{DomainCause, DomainErrorKind};
        let e = super::failed_completion(10, "REM_ACCESS_ERR");
        assert_eq!(e.kind, DomainErrorKind::RemoteAccess);
        assert_eq!(e.cause, Some(DomainCause::Status(10)));
        let e = super::failed_completion(12, "RETRY_EXC_ERR");
        assert_eq!(e.kind, DomainErrorKind::PeerUnreachable);
        assert_eq!(e.cause, Some(DomainCause::Status(12)));
    }
}
