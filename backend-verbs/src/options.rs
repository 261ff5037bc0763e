//! `[backends.verbs]`.

use serde::Deserialize;
use xfer_plugin::domain::{DomainError, DomainErrorKind};

/// The verbs backend's config table.
#[derive(Debug, Clone, PartialEq, Eq, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct VerbsOptions {
    /// Port of each device.
    pub port: i32,
    /// A port for particular devices (`ports = { mlx5_1 = 2 }`), over `port`.
    pub ports: std::collections::BTreeMap<String, i32>,
    /// GID index; chosen automatically (RoCE v2 with an address first) when absent.
    pub gid_index: Option<i32>,
    /// Choose the GID by IP address (`"192.0.2.7"`, the GID carrying it) or by netdev
    /// (`"eth1"`, its best GID) instead of by index.
    pub gid: Option<String>,
    /// Traffic class (DSCP << 2 | ECN) of RoCE packets: lossless RoCE classes need it.
    pub traffic_class: u8,
    /// InfiniBand service level (0 to 15), which RoCE maps to a priority.
    pub service_level: u8,
    /// Whether packets carry a GRH: `auto` (RoCE always; InfiniBand only when the peer has no
    /// LID), `always`, or `never` (an IB subnet addressed by LIDs alone).
    pub global_routing: String,
    /// A peer that does not answer the handshake within this fails its queued transfers. Set
    /// by the engine from `[timeouts] connect_ms` (not in `[backends.verbs]`).
    pub connect_ms: u64,
    /// Handshake retry interval.
    pub retry_ms: u64,
    /// The engine's `[security] secret_file`: when set, every handshake datagram carries a MAC
    /// with the secret it holds, and datagrams without a valid one are dropped.
    pub secret_file: Option<String>,
    /// Most handshakes answered and waiting for the requester's `Ready` at once; a request
    /// from a new peer beyond that is dropped (a real requester resends it), so a flood of
    /// forged requests costs at most twice this many QPs.
    pub max_half_open: usize,
    /// Most handshakes this side started and that are not answered yet at once (each holds a
    /// pair of QPs); a connection to another peer beyond it fails at once, naming it. Bounds
    /// what a component that sends to addresses taken from messages can be made to build.
    pub max_requesting: usize,
    /// Send queue depth of each data QP: the most writes and reads one peer can have in
    /// flight.
    pub send_queue: i32,
    /// Writes and reads a data QP starts with room for on the completion queue. Every work
    /// request outstanding can complete (a QP in error flushes even unsignalled ones), so the
    /// CQ must hold them all; reserving each QP's whole send queue capped a soft-RoCE engine
    /// at ~15 peers. A peer whose writes fill its window has it doubled, up to `send_queue`,
    /// while the CQ can grow (to the device's max_cqe); until then its writes wait. (At most
    /// `send_queue` is used.)
    pub send_window: i32,
    /// Send queue depth (and CQ reservation) of each message QP: messages to one peer in
    /// flight at once; more wait for completions.
    pub message_queue: i32,
    /// Writes of up to this many bytes are posted inline (`IBV_SEND_INLINE`: the bytes travel
    /// in the work request, so the NIC does not read the source by DMA). The device may grant
    /// less (or none; then nothing is inlined). 0 turns it off.
    pub inline_bytes: u32,
    /// Zero-length receives kept posted for write-with-immediate arrivals.
    pub imm_receives: i32,
    /// Local ACK timeout exponent (4.096 µs × 2^n), 1 to 31 (0, "wait forever", is refused).
    pub ack_timeout: i32,
    /// Transport retries before a write fails with "retry exceeded", 0 to 6. (7 is refused:
    /// soft-RoCE treats it as "retry forever".)
    pub retry_cnt: i32,
    /// Retries when the peer has no receive posted, 0 to 7 (7: forever; a stall is still
    /// caught by `unreachable_ms`).
    pub rnr_retry: i32,
    /// A connection whose send queue holds work and has not completed anything for this long
    /// is declared unreachable: its QPs go to the error state and its writes fail with
    /// `PeerUnreachable` — whatever the transport's own retries would do. Keep it below the
    /// engine's `transfer_ms`, so callers see the cause rather than a timeout.
    pub unreachable_ms: u64,
    /// Wake a parked engine worker from the CQ's completion channel (a thread per device
    /// waits on it). Off, a worker with nothing in flight finds arrivals only at its next idle
    /// poll (`[worker] idle_poll_us`): a millisecond of latency on a quiet connection.
    pub completion_channel: bool,
    /// Test knobs (faults injected on purpose); none are set in production configs.
    pub faults: Faults,
}

/// Faults the tests inject through `[backends.verbs.faults]`, so recovery paths that a
/// ConnectX rarely shows run on soft-RoCE every time.
#[derive(Debug, Clone, Default, PartialEq, Eq, serde::Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct Faults {
    /// After this many handshake datagrams sent (0: never), put the handshake QP into the
    /// error state once, as a failed datagram does.
    pub ud_error_after_sends: u32,
    /// As a requester, wait this long (ms) after a response before bringing the QPs up: a
    /// requester slower than the responder's retransmission budget.
    pub delay_response_ms: u64,
    /// As a responder, wait this long (ms) before answering a new request: a peer slow to
    /// answer, so the requester's writes stay queued meanwhile.
    pub delay_request_ms: u64,
    /// Stall the worker this long (ms) when the first immediate arrives, while the NIC
    /// keeps completing arrivals on the CQ.
    pub stall_on_first_arrival_ms: u64,
    /// Every this many ms (0: never), send each connected peer a request that names no
    /// connection, as a stale or forged datagram would.
    pub forge_requests_every_ms: u64,
    /// A CQ of this many entries that never grows (0: sized from what can be outstanding),
    /// so that a stalled worker lets it overrun: the device reports the overrun as an
    /// asynchronous event, which must fail the Domain with its name.
    pub cq_entries: u32,
}

impl Default for VerbsOptions {
    fn default() -> Self {
        Self {
            port: 1,
            ports: std::collections::BTreeMap::new(),
            gid_index: None,
            gid: None,
            traffic_class: 0,
            service_level: 0,
            global_routing: "auto".into(),
            connect_ms: 3_000,
            secret_file: None,
            retry_ms: 200,
            max_half_open: 256,
            max_requesting: 4096,
            send_queue: 1024,
            send_window: 32,
            message_queue: 16,
            inline_bytes: 64,
            imm_receives: 4096,
            ack_timeout: 14,
            retry_cnt: 6,
            rnr_retry: 7,
            unreachable_ms: 2_000,
            completion_channel: true,
            faults: Faults::default(),
        }
    }
}

impl VerbsOptions {
    /// Parses `[backends.verbs]`; unknown keys are named.
    pub fn parse(text: &str) -> Result<Self, DomainError> {
        let options: Self = toml::from_str(text).map_err(|e| {
            DomainError::new(
                DomainErrorKind::InvalidArgument,
                format!("[backends.verbs]: {e}"),
            )
        })?;
        options.validate().map_err(|m| {
            DomainError::new(
                DomainErrorKind::InvalidArgument,
                format!("[backends.verbs]: {m}"),
            )
        })?;
        if !cfg!(feature = "faults") && options.faults != Faults::default() {
            return Err(DomainError::new(
                DomainErrorKind::InvalidArgument,
                "[backends.verbs.faults]: this build injects no faults (backend-verbs' `faults` feature, for its tests)",
            ));
        }
        Ok(options)
    }

    /// Values a NIC would take but that cannot work (an infinite timeout, no receives).
    pub fn validate(&self) -> Result<(), String> {
        let checks = [
            (
                (1..=31).contains(&self.ack_timeout),
                format!(
                    "ack_timeout = {} (1 to 31; 0 would wait forever)",
                    self.ack_timeout
                ),
            ),
            (
                (0..=6).contains(&self.retry_cnt),
                format!(
                    "retry_cnt = {} (0 to 6; soft-RoCE retries forever at 7)",
                    self.retry_cnt
                ),
            ),
            (
                (0..=7).contains(&self.rnr_retry),
                format!("rnr_retry = {} (0 to 7)", self.rnr_retry),
            ),
            (
                self.imm_receives >= 1,
                format!("imm_receives = {} (at least 1)", self.imm_receives),
            ),
            (
                self.max_requesting >= 1,
                format!(
                    "max_requesting = {} (at least 1: no connection could start)",
                    self.max_requesting
                ),
            ),
            (
                self.send_queue >= 1,
                format!("send_queue = {} (at least 1)", self.send_queue),
            ),
            (
                self.send_window >= 1,
                format!("send_window = {} (at least 1)", self.send_window),
            ),
            (
                self.message_queue >= 1,
                format!("message_queue = {} (at least 1)", self.message_queue),
            ),
            (
                self.service_level <= 15,
                format!("service_level = {} (0 to 15)", self.service_level),
            ),
            (
                ["auto", "always", "never"].contains(&self.global_routing.as_str()),
                format!(
                    "global_routing = {:?} (auto, always or never)",
                    self.global_routing
                ),
            ),
            (
                !(self.gid.is_some() && self.gid_index.is_some()),
                "gid and gid_index both choose the GID: set one".to_owned(),
            ),
            (
                self.unreachable_ms >= 1 && self.retry_ms >= 1 && self.connect_ms >= 1,
                "unreachable_ms, retry_ms and connect_ms must be at least 1".to_owned(),
            ),
        ];
        match checks.into_iter().find(|(ok, _)| !ok) {
            Some((_, message)) => Err(message),
            None => Ok(()),
        }
    }
}

impl VerbsOptions {
    /// The port to use on device `nic`.
    pub fn port_of(&self, nic: &str) -> i32 {
        self.ports.get(nic).copied().unwrap_or(self.port)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn values_that_cannot_work_are_refused_by_name() {
        for (text, needle) in [
            ("ack_timeout = 0", "ack_timeout"),
            ("retry_cnt = 7", "retry_cnt"),
            ("rnr_retry = 8", "rnr_retry"),
            ("imm_receives = 0", "imm_receives"),
            ("send_queue = 0", "send_queue"),
            ("send_window = 0", "send_window"),
            ("message_queue = 0", "message_queue"),
            ("unreachable_ms = 0", "unreachable_ms"),
            ("service_level = 16", "service_level"),
            ("global_routing = \"sometimes\"", "global_routing"),
            ("gid = \"eth0\"\ngid_index = 1", "gid and gid_index"),
        ] {
            let e = VerbsOptions::parse(text).unwrap_err();
            assert!(e.message.contains(needle), "{text}: {}", e.message);
        }
        assert!(VerbsOptions::parse("").is_ok());
    }
}
