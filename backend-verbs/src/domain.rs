//! One RDMA device as an xfer Domain: RC QPs per peer, connected lazily through a handshake
//! on the device's UD QP.

use std::collections::VecDeque;
use std::sync::atomic::Ordering;
use std::sync::Arc;
use std::time::{Duration, Instant};

use engine_core::domain::{
    message_size_class, Device as MemDevice, Domain, DomainConfig, DomainError, DomainErrorKind,
    Event, MemoryRegion, PostStatus, ReadRequest, ReceivePool, RegionTable, Registration, Waker,
    WriteRequest,
};
use engine_core::NetAddr;
use foldhash::{HashMap, HashSet};

use crate::completion::{Outstanding, Progress};
use crate::ffi::{
    self, Attr, Device, Mr, Qp, RemoteBits, Wc, Write, KIND_RECV_IMM, KIND_RECV_MSG, KIND_UD_RECV,
    TAG_IMM_RECV, TAG_MASK, TAG_MSG_RECV, TAG_SEND,
};
use crate::handshake::{self, Action, Ends, Handshaker, Prior};
use crate::log;
use crate::notify::NotifyState;
use crate::options::VerbsOptions;
use crate::wire::{choose_gid, choose_gid_for, GidEntry, GidWanted, Handshake, Kind, VerbsAddr};

/// A write or send waiting for its peer's connection.
enum Queued {
    Write(Write),
    Send { wr_id: u64, data: Vec<u8> },
}

/// One peer's connection: its two RC QPs, what waits for them, and whether it may post.
/// The handshake's state lives in [`Handshaker`]; this is what the Domain owns.
struct Connection {
    data: Qp,
    msg: Qp,
    /// Posts waiting for the handshake, or that found the send queue full (retried after
    /// polling).
    queued: VecDeque<Queued>,
    /// The handshake finished on our side: as the requester once our QPs are connected, as
    /// the responder once the requester's `Ready` came (before it, a packet sent early is
    /// dropped at the requester and retransmitted only after the ack timeout).
    ready: bool,
}

/// Writes of one data QP: a chain being built (posted with one doorbell, at most 4), and what
/// is on the send queue (see [`Outstanding`]): only the last write of a chain is signalled,
/// and each write still gets its own `Done` event.
#[derive(Default)]
struct DataQueue {
    chain: Vec<Write>,
    outstanding: Outstanding<Write>,
    /// Whether the send queue moves (a completion, or its first write after being empty):
    /// a peer whose queue does not move for `unreachable_ms` is declared unreachable.
    progress: Progress,
}

/// A write or a read, as `post_rdma` takes it.
struct Rdma<'a> {
    wr_id: u64,
    peer: &'a NetAddr,
    /// (address, key) of the local range: the source of a write, the destination of a read.
    local: (u64, u64),
    /// (address, key) of the peer's range.
    remote: (u64, u64),
    len: u64,
    imm: Option<u32>,
    read: bool,
}

/// A failed completion of `wc.wr_id`: the writes posted before it succeeded (RC completes in
/// order), and it failed with the completion's status.
fn settle_failure(
    outstanding: &mut Outstanding<Write>,
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
            result: Err(err(classify(wc.status), text.to_owned())),
        });
    }
}

/// `IBV_WC_WR_FLUSH_ERR`: the work request never executed (its QP was in the error state).
const WC_WR_FLUSH_ERR: i32 = 5;

/// Writes per doorbell.
const CHAIN: usize = 4;

/// Posts `q.chain` on `qp` (the last write signalled); what does not fit stays in the chain.
fn post_chain(qp: &mut Qp, q: &mut DataQueue) -> Result<(), String> {
    if q.chain.is_empty() {
        return Ok(());
    }
    let last = q.chain.len() - 1;
    for (i, w) in q.chain.iter_mut().enumerate() {
        w.signaled = (i == last) as i32;
    }
    // SAFETY: every write was checked against a live registration when accepted; a region
    // deregistered since has its lkey refused by the NIC (an error completion), never read.
    let posted = unsafe { qp.post_writes(&q.chain) }?;
    if q.outstanding.is_empty() && posted > 0 {
        q.progress.moved();
    }
    for w in q.chain.drain(..posted) {
        q.outstanding.push(w.wr_id, w.user, w.signaled != 0, w);
    }
    Ok(())
}

/// The next send-side work-request id from `counter` (low bits; tagged `TAG_SEND`). A free
/// function so it can be called while a peer's QPs are borrowed from the peer map.
fn next_send_id(counter: &mut u64) -> u64 {
    *counter = (*counter + 1) & !TAG_MASK;
    TAG_SEND | *counter
}

/// A message on its way: the engine's id for it and the pool buffer it was copied into.
struct SendBuffer {
    /// The engine's id for the send.
    user: u64,
    /// Its buffer in `send_pool`, free again when the send completes.
    buffer: usize,
}

/// An RDMA device.
pub struct VerbsDomain {
    // Drop order: QPs, registrations and buffers before the device.
    peers: HashMap<NetAddr, Connection>,
    /// Every peer's handshake (pure: see `handshake`).
    handshake: Handshaker,
    /// QPs built beside an unproven connection for a request that did not name it: they
    /// replace it when their `Ready` comes (`Action::Promote`).
    candidates: HashMap<NetAddr, (Qp, Qp)>,
    /// QPs of connections that have not carried traffic yet: their first successful
    /// completion or arrival proves the connection to the handshake. Empty in the steady
    /// state, so the completion path pays one branch.
    unproven: HashSet<u32>,
    /// QPs of failed connections, kept until the device closes so their flushed completions
    /// can still be read.
    graveyard: Vec<(Instant, Qp)>,
    regions: RegionTable<Mr>,
    /// Message buffers posted to the message SRQ.
    receives: ReceivePool<Mr>,
    sends: HashMap<u64, SendBuffer>,
    /// Registered message buffers for sends (see `message_size_class`).
    send_pool: ReceivePool<Mr>,
    device: Device,
    attr: Attr,
    me: VerbsAddr,
    address: NetAddr,
    name: String,
    options: VerbsOptions,
    /// QP number → the peer it talks to.
    qp_peer: HashMap<u32, NetAddr>,
    /// Data QP number → its chain and outstanding writes.
    data_queues: HashMap<u32, DataQueue>,
    /// Data QPs whose writes were all accounted for when they failed; their late
    /// completions are ignored.
    dead_qps: HashSet<u32>,
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
    /// Handshake datagrams sent (for the `ud_error_after_sends` fault).
    handshakes_sent: u32,
    /// Handshake-QP resets already logged.
    ud_resets_seen: u64,
    /// Unauthenticated handshake datagrams already logged.
    unauthenticated_seen: u64,
    /// The `stall_on_first_arrival_ms` fault, until it fired.
    stall_once: Option<u64>,
    /// When the `forge_requests_every_ms` fault last fired.
    last_forged: Instant,
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

/// Maps a failed work completion to the engine's kinds.
fn classify(status: i32) -> DomainErrorKind {
    match status {
        10 => DomainErrorKind::RemoteAccess,   // REM_ACCESS_ERR
        9 => DomainErrorKind::InvalidArgument, // REM_INV_REQ_ERR: the request itself was malformed
        12 | 13 | 5 => DomainErrorKind::PeerUnreachable, // RETRY_EXC, RNR_RETRY_EXC, WR_FLUSH
        _ => DomainErrorKind::Other,
    }
}

impl VerbsDomain {
    /// Opens the device named `config.nic`.
    pub fn open(config: &DomainConfig<'_>) -> Result<Self, DomainError> {
        let options = VerbsOptions::parse(config.options)?;
        let port = options.port_of(config.nic);
        let mut device = Device::open(config.nic, port).map_err(|e| {
            err(
                DomainErrorKind::InvalidArgument,
                format!(
                    "{e}; devices present: {:?} (see `xfer doctor`)",
                    ffi::devices()
                ),
            )
        })?;
        let gid_index = match options.gid_index {
            Some(i) => i,
            None => {
                let mut entries = Vec::new();
                for index in 0.. {
                    match device.gid(index) {
                        Ok(Some((gid, roce_v2))) => entries.push(GidEntry {
                            index: index as u32,
                            gid,
                            roce_v2,
                        }),
                        Ok(None) => {}
                        Err(()) => break,
                    }
                }
                if let Some(wanted) = &options.gid {
                    // Each GID's netdev, as sysfs shows it.
                    let netdevs: Vec<Option<String>> = entries
                        .iter()
                        .map(|e| {
                            std::fs::read_to_string(format!(
                                "/sys/class/infiniband/{}/ports/{port}/gid_attrs/ndevs/{}",
                                config.nic, e.index
                            ))
                            .ok()
                            .map(|s| s.trim().to_owned())
                        })
                        .collect();
                    let chosen = choose_gid_for(&entries, &netdevs, &GidWanted::parse(wanted));
                    chosen.ok_or_else(|| {
                        err(
                            DomainErrorKind::InvalidArgument,
                            format!(
                                "{} port {port} has no GID for gid = {wanted:?} (an IP address of, or a netdev on, this port; see `xfer info`)",
                                config.nic
                            ),
                        )
                    })? as i32
                } else {
                    choose_gid(&entries).ok_or_else(|| {
                        err(
                            DomainErrorKind::InvalidArgument,
                            format!(
                            "{} port {} has no usable GID: bring its netdev up (see `xfer doctor`)",
                            config.nic, port
                        ),
                        )
                    })? as i32
                }
            }
        };
        let stall_once = Some(options.faults.stall_on_first_arrival_ms).filter(|&ms| ms > 0);
        // The CQ holds what can complete on it: the immediate receives posted (imm_receives),
        // every message receive the message SRQ can hold, and the handshake QP's 64 receives
        // and 64 sends (plus slack); each RC QP's send queue is added when it is created (the
        // shim grows the CQ). A fixed size overran as soon as more could be outstanding.
        let srq_size = options.imm_receives.max(16) * 2;
        let cq_size = match options.faults.cq_entries {
            0 => options.imm_receives + srq_size + 2 * 64 + 64,
            fixed => fixed as i32,
        };
        let attr = device
            .setup(gid_index, cq_size, srq_size)
            .map_err(|e| other(format!("{}: {e}", config.nic)))?;
        if options.faults.cq_entries > 0 {
            device.fix_cq_size();
        }
        if attr.state != 4 {
            return Err(err(
                DomainErrorKind::InvalidArgument,
                format!(
                    "{} port {} is not ACTIVE (state {}); see `xfer doctor`",
                    config.nic, port, attr.state
                ),
            ));
        }
        let global_mode = match options.global_routing.as_str() {
            "always" => 1,
            "never" if attr.ethernet != 0 => {
                return Err(err(
                    DomainErrorKind::InvalidArgument,
                    format!(
                        "global_routing = \"never\" on {}, a RoCE port: RoCE packets always carry a GRH",
                        config.nic
                    ),
                ))
            }
            "never" => 2,
            _ => 0,
        };
        device.set_path(options.traffic_class, options.service_level, global_mode);
        for i in 0..options.imm_receives {
            // SAFETY: zero-length receives touch no memory.
            unsafe { device.post_srq_recv(false, TAG_IMM_RECV | i as u64, 0, 0, 0) }
                .map_err(other)?;
        }
        // Reposted immediate receives get ids after those posted here.
        let next_imm_recv = u64::try_from(options.imm_receives).unwrap_or(0);
        let me = VerbsAddr {
            gid: attr.gid,
            lid: attr.lid,
            ud_qpn: attr.ud_qpn,
        };
        let address = NetAddr::new(&me.encode()).expect("24 bytes is a valid address");
        let settings = handshake::Settings {
            retry: Duration::from_millis(options.retry_ms),
            connect: Duration::from_millis(options.connect_ms),
            max_half_open: options.max_half_open,
        };
        let mut handshake = Handshaker::new(me, attr.active_mtu as u8, settings, fastrand::u64(..));
        if let Some(path) = &options.secret_file {
            let secret = std::fs::read(path).map_err(|e| {
                err(
                    DomainErrorKind::InvalidArgument,
                    format!("[security] secret_file {path}: {e}"),
                )
            })?;
            if secret.is_empty() {
                return Err(err(
                    DomainErrorKind::InvalidArgument,
                    format!("[security] secret_file {path} is empty"),
                ));
            }
            handshake = handshake.with_secret(&secret);
        }
        Ok(Self {
            peers: HashMap::default(),
            handshake,
            candidates: HashMap::default(),
            unproven: HashSet::default(),
            graveyard: Vec::new(),
            regions: RegionTable::new(),
            receives: ReceivePool::new(),
            sends: HashMap::default(),
            send_pool: ReceivePool::new(),
            device,
            attr,
            me,
            address,
            name: config.nic.to_owned(),
            options,
            qp_peer: HashMap::default(),
            data_queues: HashMap::default(),
            dead_qps: HashSet::default(),
            done: Vec::new(),
            wcs: vec![Wc::default(); 32],
            rng: fastrand::Rng::new(),
            next_wr: 0,
            polls_since_check: 0,
            handshakes_sent: 0,
            ud_resets_seen: 0,
            unauthenticated_seen: 0,
            stall_once,
            last_forged: Instant::now(),
            notify: None,
            imm_deficit: 0,
            next_imm_recv,
        })
    }

    /// Reposts the immediate receives consumed so far, in one batch. What the SRQ refuses stays
    /// owed and is reported: an SRQ that runs dry would stall every writer (RNR) silently.
    fn refill_imm_receives(&mut self) -> Result<(), DomainError> {
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

    /// Posts a write or a read: both travel the same chains and the same in-order accounting.
    fn post_rdma(&mut self, wr: Rdma<'_>) -> Result<PostStatus, DomainError> {
        if wr.len > u64::from(self.attr.max_msg_sz) {
            return Err(err(
                DomainErrorKind::InvalidArgument,
                format!(
                    "{} of {} bytes exceeds {}'s max message size {}",
                    if wr.read { "read" } else { "write" },
                    wr.len,
                    self.name,
                    self.attr.max_msg_sz
                ),
            ));
        }
        let remote_key = u32::try_from(wr.remote.1).map_err(|_| {
            err(
                DomainErrorKind::InvalidArgument,
                format!("rkey {:#x} is not a verbs rkey", wr.remote.1),
            )
        })?;
        let (laddr, lkey) = if wr.len == 0 {
            (0, 0)
        } else {
            let mr = self.regions.source(wr.local.1, wr.local.0, wr.len)?;
            (wr.local.0, mr.lkey)
        };
        let w = Write {
            wr_id: self.wr_id(),
            user: wr.wr_id,
            laddr,
            raddr: wr.remote.0,
            len: wr.len as u32,
            lkey,
            rkey: remote_key,
            imm: wr.imm.unwrap_or(0),
            has_imm: wr.imm.is_some() as i32,
            signaled: 1,
            read: i32::from(wr.read),
            inline_data: 0, // decided per QP when posted
            flushes: 0,
            pad: 0,
        };
        if self.queue_until_ready(wr.peer, || Queued::Write(w))? {
            return Ok(PostStatus::Posted);
        }
        match self.peers.get_mut(wr.peer) {
            Some(Connection {
                data,
                queued,
                ready: true,
                ..
            }) => {
                let q = self.data_queues.entry(data.qpn).or_default();
                if !queued.is_empty()
                    || q.outstanding.len() + q.chain.len() >= self.options.send_queue as usize
                {
                    return Ok(PostStatus::Busy);
                }
                q.chain.push(w);
                if q.chain.len() >= CHAIN {
                    if let Err(e) = post_chain(data, q) {
                        // The write is accepted (it is in the chain): the connection's failure
                        // reports it, once, as a Done event; returning an error here too
                        // would finish it twice.
                        let peer = wr.peer.clone();
                        self.fail_peer(&peer, &format!("posting writes failed: {e}"));
                    }
                }
                Ok(PostStatus::Posted)
            }
            // Gone (its connect failed at once); connecting ones were queued above.
            _ => Err(err(
                DomainErrorKind::PeerUnreachable,
                format!("{} failed to connect", wr.peer),
            )),
        }
    }

    /// Connects to `peer` if need be, and queues what `make` builds while the connection
    /// cannot take posts (connecting, or waiting for the requester's `Ready`): `true` if it
    /// was queued, `false` if the caller may post now.
    fn queue_until_ready(
        &mut self,
        peer: &NetAddr,
        make: impl FnOnce() -> Queued,
    ) -> Result<bool, DomainError> {
        if !self.peers.contains_key(peer) {
            self.start_connect(peer)?;
        }
        match self.peers.get_mut(peer) {
            Some(Connection {
                queued,
                ready: false,
                ..
            }) => {
                queued.push_back(make());
                Ok(true)
            }
            _ => Ok(false),
        }
    }

    /// Keeps a retired connection's QPs until their flushes have been read, then frees them
    /// (see `collect_graveyard`).
    fn bury(&mut self, data: Qp, msg: Qp) {
        self.unproven.remove(&data.qpn);
        self.unproven.remove(&msg.qpn);
        let now = Instant::now();
        self.graveyard.push((now, data));
        self.graveyard.push((now, msg));
    }

    /// Frees retired QPs whose writes are all settled and whose last flushes are long read,
    /// with everything kept about them (peer map, dead list): a long-running engine that
    /// reconnects often would otherwise grow without bound, and a QP number the device hands
    /// out again must not be taken for the dead one.
    fn collect_graveyard(&mut self) {
        const LINGER: Duration = Duration::from_secs(5);
        let now = Instant::now();
        let (data_queues, dead_qps, qp_peer) =
            (&self.data_queues, &mut self.dead_qps, &mut self.qp_peer);
        self.graveyard.retain(|(since, qp)| {
            let settled = !data_queues.contains_key(&qp.qpn);
            if settled && now.duration_since(*since) >= LINGER {
                dead_qps.remove(&qp.qpn);
                qp_peer.remove(&qp.qpn);
                false
            } else {
                true
            }
        });
    }

    /// A fresh send-side work-request id (see `next_wr`).
    fn wr_id(&mut self) -> u64 {
        next_send_id(&mut self.next_wr)
    }

    fn new_qps(&mut self) -> Result<(Qp, Qp), DomainError> {
        let data = self
            .device
            .create_rc(false, self.options.send_queue, self.options.inline_bytes)
            .map_err(other)?;
        let msg = self
            .device
            .create_rc(true, self.options.send_queue.min(256), 0)
            .map_err(other)?;
        if let Some((notify, _)) = &self.notify {
            // The CQ may have been resized for the new send queues, which need not keep its
            // arming: arm again when the worker next parks.
            notify.armed.store(false, Ordering::SeqCst);
        }
        self.unproven.insert(data.qpn);
        self.unproven.insert(msg.qpn);
        Ok((data, msg))
    }

    /// Sends a handshake datagram; false if it could not go now (every send slot busy, or
    /// an error), in which case requests are resent on the next check and responses on the
    /// peer's next request.
    fn send_handshake(&mut self, to: &VerbsAddr, h: &Handshake) -> bool {
        let bytes = self.handshake.seal(h);
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
                if !e.contains("Resource temporarily unavailable") {
                    log::line(&format!("{}: {e}", self.name));
                }
                false
            }
        }
    }

    /// Reads the device's asynchronous events: a CQ overrun, a fatal device or SRQ error fail
    /// the Domain (typed, once) rather than stalling it silently; a QP error fails that
    /// connection (its writes settle from the flushes); others are logged.
    fn read_async_events(&mut self) -> Result<(), DomainError> {
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

    /// Starts connecting to `peer` (we are the requester).
    fn start_connect(&mut self, peer: &NetAddr) -> Result<(), DomainError> {
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
        self.install(peer, data, msg, VecDeque::new());
        self.carry_out(now, actions);
        Ok(())
    }

    /// Makes `(data, msg)` the connection with `peer`, not ready yet, with `queued` waiting
    /// for it; completions on its QPs are routed to `peer`.
    fn install(&mut self, peer: &NetAddr, data: Qp, msg: Qp, queued: VecDeque<Queued>) {
        self.qp_peer.insert(data.qpn, peer.clone());
        self.qp_peer.insert(msg.qpn, peer.clone());
        self.peers.insert(
            peer.clone(),
            Connection {
                data,
                msg,
                queued,
                ready: false,
            },
        );
    }

    fn fail_peer(&mut self, peer: &NetAddr, why: &str) {
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
    fn fail_connection(
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

    /// Retires a connection the peer replaced: its QPs go to the error state and are kept until
    /// the device closes (their flushes settle what was posted), and the writes it never
    /// posted are returned, to go out on the new connection.
    fn retire_connection(
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
    fn fail_queued(&mut self, peer: &NetAddr, queued: VecDeque<Queued>, why: &str) {
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

    /// Posts every non-empty chain of a connected peer.
    fn post_chains(&mut self) {
        let mut failed = Vec::new();
        for (addr, c) in self.peers.iter_mut() {
            if !c.ready {
                continue;
            }
            if let Some(q) = self.data_queues.get_mut(&c.data.qpn) {
                if let Err(e) = post_chain(&mut c.data, q) {
                    failed.push((addr.clone(), e));
                }
            }
        }
        for (addr, e) in failed {
            self.fail_peer(&addr, &e);
        }
    }

    /// The peer of a failed completion's QP, and a message naming the status, the device
    /// and the peer.
    fn describe_failure(&self, wc: &Wc) -> (Option<NetAddr>, String) {
        let peer = self.qp_peer.get(&wc.qp_num).cloned();
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
    fn data_completion(&mut self, wc: &Wc, events: &mut Vec<Event>) {
        if self.dead_qps.contains(&wc.qp_num) {
            self.settle_flushed(wc, events);
            return;
        }
        let failure = (wc.status != 0).then(|| self.describe_failure(wc));
        let Some(q) = self.data_queues.get_mut(&wc.qp_num) else {
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
                result: Err(err(classify(wc.status), text.clone())),
            }));
            self.data_queues.remove(&wc.qp_num);
            self.dead_qps.insert(wc.qp_num);
            return;
        }
        // RC completes in order: what was posted before the failed write succeeded.
        settle_failure(&mut q.outstanding, wc, &text, events);
        // The QP is in error now: the rest fail, and the next transfer reconnects.
        match peer {
            Some(p) => self.fail_peer(&p, &format!("the connection failed: {text}")),
            None => {
                self.data_queues.remove(&wc.qp_num);
                self.dead_qps.insert(wc.qp_num);
            }
        }
    }

    /// Replaces `peer`'s connection, which its peer broke, with a new one, and queues on it the
    /// writes that were flushed unexecuted (each at most once more; one flushed again fails).
    fn reconnect_with(&mut self, peer: &NetAddr, flushed: Vec<Write>, why: &str) {
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

    /// A completion of a data QP already in the error state: settles the writes it names (a
    /// flush fails its write; a success completes its chain), without failing the connection
    /// again.
    fn settle_flushed(&mut self, wc: &Wc, events: &mut Vec<Event>) {
        let text = (wc.status != 0).then(|| self.describe_failure(wc).1);
        let Some(q) = self.data_queues.get_mut(&wc.qp_num) else {
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
        if q.outstanding.is_empty() {
            self.data_queues.remove(&wc.qp_num);
        }
    }

    /// Declares unreachable every peer whose send queue has not moved for `unreachable_ms`
    /// (a vanished peer: the transport's own retries may never give up, as on soft-RoCE; an
    /// empty receive queue at the peer with `rnr_retry = 7`). Its QPs go to the error state and
    /// its writes settle from the flushes as `PeerUnreachable`.
    fn check_stalled_peers(&mut self) {
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

    fn connect_qps(
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

    fn handle_handshake(&mut self, raw: &[u8]) {
        let mut actions = Vec::new();
        self.handshake.handle_datagram(raw, &mut actions);
        if !actions.is_empty() {
            self.carry_out(Instant::now(), actions);
        }
    }

    /// Carries out what the handshake asked for (see [`Action`]); what that feeds back to it
    /// is carried out in turn.
    fn carry_out(&mut self, now: Instant, actions: Vec<Action>) {
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
    fn accept(
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
            self.qp_peer.insert(data.qpn, peer.clone());
            self.qp_peer.insert(msg.qpn, peer.clone());
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
        self.install(peer, data, msg, queued);
        Ok(ends)
    }

    /// The candidate's `Ready` came: it replaces the connection it stood beside, which is
    /// retired (what it holds settles from its flushes; what it never posted moves over).
    fn promote(&mut self, peer: &NetAddr) {
        let Some((data, msg)) = self.candidates.remove(peer) else {
            return;
        };
        let queued = match self.peers.remove(peer) {
            Some(old) => self.retire_connection(old.data, old.msg, old.queued),
            None => VecDeque::new(),
        };
        self.peers.insert(
            peer.clone(),
            Connection {
                data,
                msg,
                queued,
                ready: true,
            },
        );
        self.flush(peer);
    }

    /// Destroys QPs that never carried a connection's traffic (a dropped candidate).
    fn retire_unused(&mut self, mut data: Qp, mut msg: Qp) {
        let _ = data.move_to_error();
        let _ = msg.move_to_error();
        self.dead_qps.insert(data.qpn);
        self.bury(data, msg);
    }

    /// The first successful completion or arrival on QP `qpn`: if it belongs to its peer's
    /// connection, that connection is proven (see `handshake`).
    fn traffic_on(&mut self, qpn: u32) {
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
    fn complete(
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

    /// Posts what is queued for a connected peer, until its send queue is full.
    fn flush(&mut self, peer: &NetAddr) {
        let mut failed = None;
        if let Some(Connection {
            data,
            msg,
            queued,
            ready: true,
        }) = self.peers.get_mut(peer)
        {
            let limit = self.options.send_queue as usize;
            while let Some(q) = queued.pop_front() {
                let r = match &q {
                    Queued::Write(w) => {
                        let dq = self.data_queues.entry(data.qpn).or_default();
                        if dq.outstanding.len() + dq.chain.len() >= limit {
                            Ok(false)
                        } else {
                            dq.chain.push(*w);
                            if dq.chain.len() >= CHAIN {
                                post_chain(data, dq).map(|()| true)
                            } else {
                                Ok(true)
                            }
                        }
                    }
                    Queued::Send { wr_id, data: bytes } => {
                        let id = next_send_id(&mut self.next_wr);
                        post_message(
                            &mut self.device,
                            msg,
                            (&mut self.sends, &mut self.send_pool),
                            (id, *wr_id),
                            bytes,
                        )
                    }
                };
                match r {
                    Ok(true) => {}
                    Ok(false) => {
                        queued.push_front(q);
                        break;
                    }
                    Err(e) => {
                        failed = Some(e);
                        break;
                    }
                }
            }
        }
        if let Some(e) = failed {
            self.fail_peer(peer, &e);
        }
    }

    fn check_handshakes(&mut self) {
        let forge = self.options.faults.forge_requests_every_ms;
        // Runs at every poll: with no handshake under way (the steady state) it reads no
        // clock (a system call where the TSC is unusable, as in the soft-RoCE guest).
        let pending = forge > 0 || self.handshake.pending();
        if let Some((notify, _)) = &self.notify {
            // Resends and deadlines below need this check to run while the worker idles:
            // the notifier wakes it every retry_ms while any is pending.
            if notify.timers.swap(pending, Ordering::SeqCst) != pending && pending {
                self.device.kick();
            }
        }
        if !pending {
            return;
        }
        let now = Instant::now();
        if forge > 0 && now.duration_since(self.last_forged) >= Duration::from_millis(forge) {
            self.last_forged = now;
            self.forge_requests();
        }
        if self.handshake.poll_timeout().is_some_and(|due| due <= now) {
            let mut actions = Vec::new();
            self.handshake.handle_timeout(now, &mut actions);
            self.carry_out(now, actions);
        }
    }

    /// Test fault: a request for every connected peer that names no connection (as a stale
    /// or forged datagram would), with our current QPs.
    fn forge_requests(&mut self) {
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

/// Copies a message into a pooled registered buffer and posts it; `Ok(false)` when the queue
/// is full (the buffer goes back to the pool).
fn post_message(
    device: &mut Device,
    qp: &mut Qp,
    (sends, pool): (&mut HashMap<u64, SendBuffer>, &mut ReceivePool<Mr>),
    (wr_id, user): (u64, u64),
    bytes: &[u8],
) -> Result<bool, String> {
    let buffer = pool.take(message_size_class(bytes.len()), |data| {
        // SAFETY: the pool keeps the buffer at this address for the Domain's lifetime, and
        // the registration with it.
        unsafe {
            device.register(
                data.as_ptr() as u64,
                data.len(),
                RemoteBits::of(false, false),
            )
        }
    })?;
    let (ptr, _, mr) = pool.get(buffer);
    let lkey = mr.lkey;
    // SAFETY: the class holds at least `bytes.len()` bytes, and the buffer is ours (taken
    // from the pool, not posted) until it is released.
    unsafe { std::ptr::copy_nonoverlapping(bytes.as_ptr(), ptr, bytes.len()) };
    // SAFETY: the buffer lies in its registration and stays out of the pool until its
    // completion.
    let posted = unsafe { qp.post_send(wr_id, ptr as u64, bytes.len() as u32, lkey) };
    match posted {
        Ok(true) => {
            sends.insert(wr_id, SendBuffer { user, buffer });
            Ok(true)
        }
        other => {
            pool.release(buffer);
            other
        }
    }
}

impl VerbsDomain {
    /// GPU memory: dma-buf first (`cuMemGetHandleForAddressRange` → `ibv_reg_dmabuf_mr`),
    /// then plain `ibv_reg_mr` (works with nvidia-peermem); both reasons if neither works.
    fn register_gpu(&mut self, region: &MemoryRegion, index: u32) -> Result<Mr, DomainError> {
        let dmabuf =
            uvm_watcher::gpu::dmabuf(region.ptr, region.len, index).and_then(|(fd, offset)| {
                // SAFETY: the engine checked the range is live device memory of this GPU; the fd
                // was just exported for it and is handed over.
                unsafe {
                    self.device.register_dmabuf(
                        offset,
                        region.len as usize,
                        region.ptr,
                        fd,
                        RemoteBits::of(region.remote_write, region.remote_read),
                    )
                }
            });
        let dmabuf_error = match dmabuf {
            Ok(mr) => return Ok(mr),
            Err(e) => e,
        };
        let remote = RemoteBits::of(region.remote_write, region.remote_read);
        // SAFETY: as for host memory; with nvidia-peermem the NIC pins GPU pages itself.
        match unsafe { self.device.register(region.ptr, region.len as usize, remote) } {
            Ok(mr) => Ok(mr),
            Err(peermem_error) => Err(err(
                DomainErrorKind::InvalidArgument,
                format!("GPU memory of CUDA device {index} cannot be registered with {}: dma-buf: {dmabuf_error}; nvidia-peermem: {peermem_error} (see `xfer doctor`)", self.name),
            )),
        }
    }
}

impl VerbsDomain {
    /// Reads every completion on the CQ into `events`.
    fn drain_cq(&mut self, events: &mut Vec<Event>) -> Result<(), DomainError> {
        let mut wcs = std::mem::take(&mut self.wcs);
        let result = loop {
            let n = match self.device.poll(&mut wcs) {
                Ok(n) => n,
                Err(e) => break Err(other(e)),
            };
            for wc in &wcs[..n] {
                if wc.status == 0
                    && wc.kind != KIND_UD_RECV
                    && !self.unproven.is_empty()
                    && self.unproven.remove(&wc.qp_num)
                {
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
                            events.push(Event::ImmArrival { imm: wc.imm });
                        }
                        if let Some(ms) = self.stall_once.take() {
                            // Test fault: a worker stalled (a long registration, say) while
                            // arrivals keep completing on the CQ.
                            std::thread::sleep(Duration::from_millis(ms));
                        }
                        // Reposted in one batch at the end of this poll.
                        self.imm_deficit += 1;
                    }
                    KIND_RECV_MSG => {
                        let index = (wc.wr_id & !TAG_MASK) as usize;
                        if wc.status != 0 {
                            // A failed receive (an oversized message) goes back on the SRQ:
                            // the pool must not shrink.
                            let (addr, len, mr) = self.receives.get(index);
                            let lkey = mr.lkey;
                            // SAFETY: the buffer is registered and owned by the pool; it is not
                            // reused until this receive completes.
                            let reposted = unsafe {
                                self.device.post_srq_recv(
                                    true,
                                    TAG_MSG_RECV | index as u64,
                                    addr as u64,
                                    len as u32,
                                    lkey,
                                )
                            };
                            if reposted.is_err() {
                                self.receives.release(index);
                            }
                        } else if let Some(data) =
                            self.receives.take_message(index, wc.byte_len as usize)
                        {
                            events.push(Event::Message { data });
                        }
                    }
                    _ if self.data_queues.contains_key(&wc.qp_num)
                        || self.dead_qps.contains(&wc.qp_num) =>
                    {
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
                            let current = peer.as_ref().is_some_and(|p| {
                                self.peers.get(p).is_some_and(|c| c.msg.qpn == wc.qp_num)
                            });
                            if let (true, Some(p)) = (current, peer) {
                                self.fail_peer(&p, &text);
                            }
                            Err(err(classify(wc.status), text))
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
    fn arm_if_parking(&mut self, events: &mut Vec<Event>) -> Result<(), DomainError> {
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

impl Domain for VerbsDomain {
    fn address(&self) -> NetAddr {
        self.address.clone()
    }

    fn register(&mut self, region: &MemoryRegion) -> Result<Registration, DomainError> {
        let mr = match region.device {
            MemDevice::Cuda(index) => self.register_gpu(region, index)?,
            _ => {
                // SAFETY: TransferEngine::reg_mr's contract keeps the memory allocated until it
                // is deregistered, which drops this registration.
                unsafe {
                    self.device.register(
                        region.ptr,
                        region.len as usize,
                        RemoteBits::of(region.remote_write, region.remote_read),
                    )
                }
                .map_err(|e| {
                    let limit =
                        engine_core::topo::doctor::memlock_limit(std::path::Path::new("/proc"))
                            .map_or("unlimited".to_owned(), |l| format!("{l} bytes"));
                    other(format!(
                        "{e} (locked-memory limit: {limit}; see `xfer doctor`)"
                    ))
                })?
            }
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
        let uses = |w: &Write| w.len > 0 && w.lkey == lkey;
        let gone = || {
            Err(err(
                DomainErrorKind::InvalidArgument,
                "its local region was deregistered before it was posted",
            ))
        };
        let mut failed = Vec::new();
        for c in self.peers.values_mut() {
            c.queued.retain(|q| match q {
                Queued::Write(w) if uses(w) => {
                    failed.push(w.user);
                    false
                }
                _ => true,
            });
        }
        for q in self.data_queues.values_mut() {
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
                .data_queues
                .iter()
                .filter(|(_, q)| q.outstanding.any(uses))
                .map(|(&qpn, _)| qpn)
                .collect();
            if busy.is_empty() {
                break;
            }
            if Instant::now() >= deadline {
                for qpn in busy {
                    if let Some(peer) = self.qp_peer.get(&qpn).cloned() {
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

    fn post_write(&mut self, wr: &WriteRequest<'_>) -> Result<PostStatus, DomainError> {
        self.post_rdma(Rdma {
            wr_id: wr.wr_id,
            peer: wr.peer,
            local: (wr.local_addr, wr.local_key),
            remote: (wr.remote_addr, wr.remote_key),
            len: wr.len,
            imm: wr.imm,
            read: false,
        })
    }

    fn supports_read(&self) -> bool {
        true
    }

    fn post_read(&mut self, rd: &ReadRequest<'_>) -> Result<PostStatus, DomainError> {
        self.post_rdma(Rdma {
            wr_id: rd.wr_id,
            peer: rd.peer,
            local: (rd.local_addr, rd.local_key),
            remote: (rd.remote_addr, rd.remote_key),
            len: rd.len,
            imm: None,
            read: true,
        })
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
        match self.peers.get_mut(peer) {
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
            let device = &mut self.device;
            // SAFETY: the buffer lives in the pool for the Domain's lifetime.
            let index = self
                .receives
                .take(buf_len, |data| unsafe {
                    device.register(
                        data.as_ptr() as u64,
                        data.len(),
                        RemoteBits::of(false, false),
                    )
                })
                .map_err(other)?;
            let (addr, len, mr) = self.receives.get(index);
            // SAFETY: the buffer is registered and not reused until its completion.
            unsafe {
                self.device.post_srq_recv(
                    true,
                    TAG_MSG_RECV | index as u64,
                    addr as u64,
                    len as u32,
                    mr.lkey,
                )
            }
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
        let retry = Duration::from_millis(self.options.retry_ms);
        let thread_waker = waker.clone();
        let started = self
            .device
            .start_notifier(format!("xfer-verbs-{}", self.name), move |events| {
                crate::notify::run(&events, &shared, retry, &thread_waker)
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
        // Chains still building since the last pass go out now, one doorbell each.
        self.post_chains();
        self.polls_since_check += 1;
        if self.polls_since_check >= 1024 {
            self.polls_since_check = 0;
            self.check_stalled_peers();
            self.collect_graveyard();
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
        self.check_handshakes();
        let connected: Vec<NetAddr> = self
            .peers
            .iter()
            .filter(|(_, c)| c.ready && !c.queued.is_empty())
            .map(|(a, _)| a.clone())
            .collect();
        for p in connected {
            self.flush(&p);
        }
        self.post_chains();
        events.append(&mut self.done);
        result.and(refill)
    }
}

#[cfg(test)]
mod tests {
    #[test]
    fn messages_share_a_few_buffer_sizes() {
        assert_eq!(super::message_size_class(0), 256);
        assert_eq!(super::message_size_class(256), 256);
        assert_eq!(super::message_size_class(257), 512);
        assert_eq!(super::message_size_class(65_536), 65_536);
    }
}
