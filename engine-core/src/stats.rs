//! Why one file: the counters, the runs the core tallies into them and the snapshot that folds
//! the runs in are one piece of state; a snapshot is correct only if all three agree.
//!
//! The engine's counters, as pure data: what the worker records as transfers finish, and the
//! snapshot [`TransferEngine::stats`](crate::TransferEngine::stats) returns.
//!
//! The worker owns the only live copy (plain integers, no shared atomics per operation);
//! `stats()` asks the worker for a copy, so counting costs the hot path an addition or two
//! per transfer and a snapshot costs one round trip to the worker.

use std::collections::{BTreeMap, HashMap};
use std::time::Duration;

use crate::runtime::clock::Stamp;

use serde::Serialize;

use crate::error::Error;
use crate::wire::NetAddr;

/// What an operation was.
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord, Hash, Serialize)]
#[serde(rename_all = "snake_case")]
#[repr(usize)]
pub enum OpKind {
    /// Writes (single, paged, scatter, barrier), with or without an immediate.
    Write,
    /// RDMA reads.
    Read,
    /// Messages (`submit_send`).
    Send,
    /// Notifications sent after a transfer (`notify_when_done`).
    Notification,
}

impl OpKind {
    /// Its name, as in metrics labels.
    pub fn name(self) -> &'static str {
        match self {
            OpKind::Write => "write",
            OpKind::Read => "read",
            OpKind::Send => "send",
            OpKind::Notification => "notification",
        }
    }
}

/// Upper bounds of the latency histograms' buckets, in microseconds (powers of four; the
/// last bucket holds everything above).
pub const LATENCY_BOUNDS_US: [u64; 11] = [
    1, 4, 16, 64, 256, 1_024, 4_096, 16_384, 65_536, 262_144, 1_048_576,
];

/// A fixed-bucket histogram of durations.
#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize)]
pub struct Histogram {
    /// `counts[i]`: durations at most `LATENCY_BOUNDS_US[i]` µs and above the bound before;
    /// the last entry: above every bound.
    pub counts: [u64; LATENCY_BOUNDS_US.len() + 1],
    /// Sum of all durations, in microseconds.
    pub sum_us: u64,
}

impl Histogram {
    /// Records one duration.
    pub fn record(&mut self, d: Duration) {
        self.record_us(u64::try_from(d.as_micros()).unwrap_or(u64::MAX));
    }

    /// Records a duration of `us` microseconds.
    pub(crate) fn record_us(&mut self, us: u64) {
        // The bounds are 4^i: the bucket is ceil(log4(us)), from the bit length of us - 1.
        let bits = 64 - us.saturating_sub(1).leading_zeros() as usize;
        let bucket = bits.div_ceil(2).min(LATENCY_BOUNDS_US.len());
        self.counts[bucket] += 1;
        self.sum_us = self.sum_us.saturating_add(us);
    }

    /// Adds `other`'s durations.
    fn add(&mut self, other: &Histogram) {
        for (count, more) in self.counts.iter_mut().zip(other.counts) {
            *count += more;
        }
        self.sum_us = self.sum_us.saturating_add(other.sum_us);
    }

    /// Durations recorded.
    pub fn count(&self) -> u64 {
        self.counts.iter().sum()
    }
}

/// Counters of one kind of operation.
#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize)]
pub struct OpStats {
    /// Accepted by the worker (refusals at submit are not counted).
    pub started: u64,
    /// Finished successfully.
    pub completed: u64,
    /// Finished with an error, by the error's kind (`Error::kind`).
    pub failed: BTreeMap<&'static str, u64>,
    /// Bytes of the operations that completed successfully.
    pub bytes: u64,
    /// Work requests posted to NICs for them (a striped or paged transfer posts several).
    pub requests: u64,
    /// From the caller submitting the operation to its completion.
    pub latency: Histogram,
    /// From the caller submitting the operation to the worker handing its work requests to
    /// the NICs (a request a full NIC queue turns away waits in the worker; that wait shows
    /// in `latency`). High values mean a saturated worker.
    pub post_latency: Histogram,
}

/// Counters of one peer (by its address on the NIC the operation used).
#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize)]
pub struct PeerStats {
    /// Work requests posted to it.
    pub requests: u64,
    /// Bytes posted to it (or read from it).
    pub bytes: u64,
    /// Operations to it alone that failed.
    pub failed: u64,
    /// The last such failure.
    pub last_error: Option<String>,
    /// False while the last operation to it alone that finished failed (a dead or refusing
    /// peer; `last_error` says why); true again after one succeeds.
    pub healthy: bool,
    /// Milliseconds since an operation to it alone last finished (`None`: none has).
    pub ms_since_activity: Option<u64>,
}

/// Counters of one NIC.
#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize)]
pub struct NicStats {
    /// Work requests handed to it.
    pub requests: u64,
    /// Their bytes.
    pub bytes: u64,
}

/// Registrations with the NICs.
#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize)]
pub struct RegistrationStats {
    /// Successful registrations.
    pub registered: u64,
    /// Their bytes.
    pub bytes: u64,
    /// Time spent registering (all NICs), in microseconds.
    pub time_us: u64,
    /// Deregistrations.
    pub deregistered: u64,
    /// Registrations that failed.
    pub failed: u64,
    /// `reg_mr`s served by a live registration covering them (`[memory] registration_cache`),
    /// not counted in `registered`.
    pub cache_hits: u64,
}

/// A snapshot of the engine's counters.
#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize)]
pub struct Stats {
    /// Per kind of operation.
    pub ops: BTreeMap<OpKind, OpStats>,
    /// Per peer address (serialized keyed by the address's hex text).
    #[serde(serialize_with = "by_address_text")]
    pub peers: HashMap<NetAddr, PeerStats>,
    /// Completions for work requests the engine does not know (or no longer waits for): a
    /// late completion after its transfer timed out, or a backend reporting one request
    /// twice. Non-zero without timeouts means a backend broke "exactly once".
    pub stale_completions: u64,
    /// Immediates that arrived.
    pub imm_arrivals: u64,
    /// Arrivals dropped because the ImmCounter's table of idle immediates was full.
    pub imm_dropped: u64,
    /// Immediates with arrivals nobody waits for yet (the ImmCounter's idle table).
    pub imm_idle: u64,
    /// Arrivals owed to expectations that timed out or were cancelled (their debts).
    pub imm_owed: u64,
    /// Work requests the worker holds because their NIC's queue was full.
    pub queued_requests: u64,
    /// Per NIC of the DomainGroup (by index): work requests posted and their bytes.
    pub nics: Vec<NicStats>,
    /// Notifications refused or dropped (see `notifications_dropped`).
    pub notifications_dropped: u64,
    /// Operations accepted and not finished (transfers, sends, reserved notifications).
    pub outstanding: u64,
    /// Registrations.
    pub registrations: RegistrationStats,
}

impl Stats {
    /// The counters of `kind` (zeros if none was seen).
    pub fn op(&self, kind: OpKind) -> OpStats {
        self.ops.get(&kind).cloned().unwrap_or_default()
    }
}

fn by_address_text<S: serde::Serializer>(
    peers: &HashMap<NetAddr, PeerStats>,
    s: S,
) -> Result<S::Ok, S::Error> {
    s.collect_map(peers.iter().map(|(a, p)| (a.to_string(), p)))
}

/// What the worker remembers of a transfer until it finishes.
#[derive(Debug)]
pub(crate) struct Started {
    pub(crate) kind: OpKind,
    /// The peer's index in the recorder, when the whole operation went to one (not a
    /// scatter to many).
    pub(crate) peer: Option<u32>,
    pub(crate) bytes: u64,
    /// When it was submitted.
    pub(crate) at: Stamp,
    /// The NICs its work requests went to (bit `i`: NIC `i`).
    pub(crate) nics: u8,
}

const KINDS: [OpKind; 4] = [
    OpKind::Write,
    OpKind::Read,
    OpKind::Send,
    OpKind::Notification,
];

/// The counters the recorder adds to as runs end (see [`Recorder`]), laid out for the data
/// path: operation kinds in an array, peers in a vector by index.
#[derive(Clone, Debug, Default)]
struct Counters {
    ops: [OpStats; KINDS.len()],
    nics: Vec<NicStats>,
    peers: Vec<(NetAddr, PeerStats)>,
    /// When an operation to each peer (same index) last succeeded and last failed.
    peer_times: Vec<(Option<Stamp>, Option<Stamp>)>,
}

/// Operations accepted in a row with one shape: one kind, all of their work requests on
/// one NIC to one peer (a burst's writes, a ping-pong's). An operation that extends the run
/// costs a comparison and a few additions; the run reaches the counters when two operations
/// of another shape in a row take the run over (see [`Recorder`]), and a snapshot adds it
/// to what it reports.
#[derive(Clone, Debug)]
struct AcceptedRun {
    kind: OpKind,
    nic: usize,
    peer: u32,
    ops: u64,
    requests: u64,
    bytes: u64,
    post_latency: Histogram,
}

impl AcceptedRun {
    fn add_to(&self, c: &mut Counters) {
        let op = &mut c.ops[self.kind as usize];
        op.started += self.ops;
        op.requests += self.requests;
        op.post_latency.add(&self.post_latency);
        // The run's start made room for its NIC and its peer.
        let nic = &mut c.nics[self.nic];
        nic.requests += self.requests;
        nic.bytes += self.bytes;
        let peer = &mut c.peers[self.peer as usize].1;
        peer.requests += self.requests;
        peer.bytes += self.bytes;
    }
}

/// Operations of one kind that succeeded in a row, to one peer (or each to several): the
/// counterpart of [`AcceptedRun`] for completions.
#[derive(Clone, Debug)]
struct CompletedRun {
    kind: OpKind,
    peer: Option<u32>,
    ops: u64,
    bytes: u64,
    latency: Histogram,
    /// When the last of them finished.
    last: Stamp,
}

impl CompletedRun {
    fn add_to(&self, c: &mut Counters) {
        let op = &mut c.ops[self.kind as usize];
        op.completed += self.ops;
        op.bytes += self.bytes;
        op.latency.add(&self.latency);
        if let Some(i) = self.peer {
            // A success counted directly while the run was open may be the later one.
            let ok = &mut c.peer_times[i as usize].0;
            *ok = (*ok).max(Some(self.last));
        }
    }
}

/// The worker's live counters. The commonest operations come in runs of one shape (one
/// kind, NIC and peer), so those are tallied in a run first and added to the counters
/// once per run, not looked up by kind, NIC and peer one operation at a time; a snapshot
/// adds the open runs to what it reports, so it reads exactly what per-operation counting
/// would. Everything is a sum, a maximum of stamps or a histogram: the order in which runs
/// and operations counted directly reach the counters does not change them.
///
/// An operation of another shape than the open run's is counted directly, as it would be
/// without runs; the second of a new shape in a row takes the run over. So work that
/// changes shape at every operation (writes to peers in turn) costs what direct counting
/// does, not a run ended and begun per operation.
#[derive(Debug, Default)]
pub(crate) struct Recorder {
    counters: Counters,
    peer_index: foldhash::HashMap<NetAddr, u32>,
    /// The index `posted_to` returned last: consecutive operations mostly go to one peer (a
    /// burst, a request's pages), which then costs a comparison instead of a map lookup.
    last_peer: Option<u32>,
    accepted: Option<AcceptedRun>,
    /// The shape of the operation accepted last, when it was not the run's.
    accepted_aside: Option<(OpKind, usize, u32)>,
    completed: Option<CompletedRun>,
    /// The shape of the success counted last, when it was not the run's.
    completed_aside: Option<(OpKind, Option<u32>)>,
    /// The counters kept as they are reported.
    pub(crate) rest: Stats,
}

impl Recorder {
    /// An operation of `requests` work requests was accepted, `waited_us` microseconds
    /// after it was submitted.
    pub(crate) fn started(&mut self, kind: OpKind, requests: u64, waited_us: u64) {
        let op = &mut self.counters.ops[kind as usize];
        op.started += 1;
        op.requests += requests;
        op.post_latency.record_us(waited_us);
    }

    /// `requests` work requests carrying `bytes` for NIC `nic`.
    pub(crate) fn on_nic(&mut self, nic: usize, requests: u64, bytes: u64) {
        let nics = &mut self.counters.nics;
        if nic >= nics.len() {
            nics.resize_with(nic + 1, NicStats::default);
        }
        let n = &mut nics[nic];
        n.requests += requests;
        n.bytes += bytes;
    }

    /// Work requests to `peer` carrying `bytes`; returns the peer's index. (Inline: an
    /// operation outside the run then costs one call, as it did before runs.)
    #[inline(always)]
    pub(crate) fn posted_to(&mut self, peer: &NetAddr, requests: u64, bytes: u64) -> u32 {
        let c = &mut self.counters;
        let last = self.last_peer.filter(|&i| c.peers[i as usize].0 == *peer);
        let index = match last.or_else(|| self.peer_index.get(peer).copied()) {
            Some(i) => i,
            None => {
                let i = c.peers.len() as u32;
                c.peers.push((peer.clone(), PeerStats::default()));
                c.peer_times.push((None, None));
                self.peer_index.insert(peer.clone(), i);
                i
            }
        };
        self.last_peer = Some(index);
        let p = &mut c.peers[index as usize].1;
        p.requests += requests;
        p.bytes += bytes;
        index
    }

    /// An operation of `requests` work requests carrying `bytes`, all on NIC `nic` to
    /// `peer`, was accepted `waited_us` microseconds after it was submitted: `started`,
    /// `on_nic` and `posted_to` in one, counted in the open run when it has the run's
    /// shape. Returns the peer's index.
    #[inline(always)]
    pub(crate) fn accepted(
        &mut self,
        kind: OpKind,
        nic: usize,
        peer: &NetAddr,
        requests: u64,
        bytes: u64,
        waited_us: u64,
    ) -> u32 {
        if let Some(run) = &mut self.accepted {
            if run.kind == kind
                && run.nic == nic
                && self.counters.peers[run.peer as usize].0 == *peer
            {
                run.ops += 1;
                run.requests += requests;
                run.bytes += bytes;
                // Operations of another shape in turn with the run's never take it over.
                run.post_latency.record_us(waited_us);
                self.accepted_aside = None;
                return run.peer;
            }
        }
        self.accepted_aside(kind, nic, peer, requests, bytes, waited_us)
    }

    /// An operation of another shape than the open run's: counted directly, and when the
    /// one before was of its shape too, its shape takes the run over.
    #[inline(never)]
    fn accepted_aside(
        &mut self,
        kind: OpKind,
        nic: usize,
        peer: &NetAddr,
        requests: u64,
        bytes: u64,
        waited_us: u64,
    ) -> u32 {
        self.started(kind, requests, waited_us);
        self.on_nic(nic, requests, bytes);
        let index = self.posted_to(peer, requests, bytes);
        let shape = (kind, nic, index);
        if self.accepted_aside.replace(shape) == Some(shape) {
            if let Some(run) = self.accepted.take() {
                run.add_to(&mut self.counters);
            }
            self.accepted = Some(AcceptedRun {
                kind,
                nic,
                peer: index,
                ops: 0,
                requests: 0,
                bytes: 0,
                post_latency: Histogram::default(),
            });
            self.accepted_aside = None;
        }
        index
    }

    /// An operation finished at `now`.
    #[inline(always)]
    pub(crate) fn finished(&mut self, s: &Started, result: Result<(), &Error>, now: Stamp) {
        if let Err(e) = result {
            return self.failed(s, e, now);
        }
        let took_us = now.micros_since(s.at);
        if let Some(run) = &mut self.completed {
            if run.kind == s.kind && run.peer == s.peer {
                run.ops += 1;
                run.bytes += s.bytes;
                run.latency.record_us(took_us);
                run.last = now;
                self.completed_aside = None;
                return;
            }
        }
        // Another shape: counted directly, as without runs.
        let op = &mut self.counters.ops[s.kind as usize];
        op.latency.record_us(took_us);
        op.completed += 1;
        op.bytes += s.bytes;
        if let Some(i) = s.peer {
            self.counters.peer_times[i as usize].0 = Some(now);
        }
        let shape = (s.kind, s.peer);
        if self.completed_aside.replace(shape) == Some(shape) {
            self.completed_run(shape, now);
        }
    }

    /// The second success in a row of `shape`, not the open run's: the run ends, and the
    /// next one has `shape`.
    #[inline(never)]
    fn completed_run(&mut self, (kind, peer): (OpKind, Option<u32>), now: Stamp) {
        if let Some(run) = self.completed.take() {
            run.add_to(&mut self.counters);
        }
        self.completed = Some(CompletedRun {
            kind,
            peer,
            ops: 0,
            bytes: 0,
            latency: Histogram::default(),
            last: now,
        });
        self.completed_aside = None;
    }

    /// An operation that failed with `e` at `now`.
    #[cold]
    #[inline(never)]
    fn failed(&mut self, s: &Started, e: &Error, now: Stamp) {
        let c = &mut self.counters;
        let op = &mut c.ops[s.kind as usize];
        op.latency.record_us(now.micros_since(s.at));
        *op.failed.entry(e.kind()).or_default() += 1;
        if let Some(i) = s.peer {
            let p = &mut c.peers[i as usize].1;
            p.failed += 1;
            p.last_error = Some(e.to_string());
            c.peer_times[i as usize].1 = Some(now);
        }
    }

    /// Ends the open runs: their counts join the counters.
    #[cfg(test)]
    fn close_runs(&mut self) {
        if let Some(run) = self.accepted.take() {
            run.add_to(&mut self.counters);
        }
        if let Some(run) = self.completed.take() {
            run.add_to(&mut self.counters);
        }
    }

    /// The counters as reported at `now`, the open runs included.
    pub(crate) fn snapshot(&self, now: Stamp) -> Stats {
        let mut c = self.counters.clone();
        if let Some(run) = &self.accepted {
            run.add_to(&mut c);
        }
        if let Some(run) = &self.completed {
            run.add_to(&mut c);
        }
        let mut stats = self.rest.clone();
        stats.ops = KINDS
            .iter()
            .zip(c.ops)
            .filter(|(_, o)| o.started > 0)
            .map(|(k, o)| (*k, o))
            .collect();
        stats.nics = c.nics;
        stats.peers = c
            .peers
            .into_iter()
            .zip(c.peer_times)
            .map(|((addr, mut p), (ok, failed))| {
                p.healthy = match (ok, failed) {
                    (_, None) => true,
                    (None, Some(_)) => false,
                    (Some(ok), Some(failed)) => ok > failed,
                };
                p.ms_since_activity = ok.max(failed).map(|t| now.micros_since(t) / 1_000);
                (addr, p)
            })
            .collect();
        stats
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn durations_land_in_their_buckets() {
        let mut h = Histogram::default();
        for us in [0, 1, 2, 4, 5, 1_048_576, 1_048_577, u64::MAX / 1_000] {
            h.record(Duration::from_micros(us));
        }
        assert_eq!(h.counts[0], 2, "0 and 1 µs");
        assert_eq!(h.counts[1], 2, "2 and 4 µs");
        assert_eq!(h.counts[2], 1, "5 µs");
        assert_eq!(h.counts[10], 1, "the last bound itself");
        assert_eq!(h.counts[11], 2, "above every bound");
        assert_eq!(h.count(), 8);
        // The bit arithmetic agrees with the bounds everywhere near them.
        for (i, &bound) in LATENCY_BOUNDS_US.iter().enumerate() {
            for (us, want) in [(bound, i), (bound + 1, i + 1)] {
                let mut h = Histogram::default();
                h.record(Duration::from_micros(us));
                assert_eq!(h.counts[want], 1, "{us} µs");
            }
        }
    }

    #[test]
    fn finished_operations_count_bytes_only_on_success_and_errors_by_kind() {
        let mut r = Recorder::default();
        let peer = NetAddr::new(&[1]).unwrap();
        let start = Stamp::now();
        r.started(OpKind::Write, 2, 3);
        let s = Started {
            kind: OpKind::Write,
            peer: Some(r.posted_to(&peer, 2, 100)),
            bytes: 100,
            at: start,
            nics: 1,
        };
        r.finished(&s, Ok(()), start.after(Duration::from_micros(10)));
        r.started(OpKind::Write, 1, 0);
        r.finished(&s, Err(&Error::Timeout(Duration::from_secs(1))), start);
        let stats = r.snapshot(start);
        let w = stats.op(OpKind::Write);
        assert_eq!(
            (w.started, w.completed, w.bytes, w.requests),
            (2, 1, 100, 3)
        );
        assert_eq!(w.failed.get("timeout"), Some(&1));
        let p = &stats.peers[&peer];
        assert_eq!((p.requests, p.bytes, p.failed), (2, 100, 1));
        assert!(p.last_error.as_deref().unwrap().contains("timed out"));
    }

    /// Operations counted in open runs show in a snapshot exactly as if each had been added
    /// to the counters on its own: mid-run, after the runs closed, and against a recorder
    /// that closes its runs after every operation.
    #[test]
    fn a_snapshot_counts_the_open_runs() {
        let (a, b) = (NetAddr::new(&[1]).unwrap(), NetAddr::new(&[2]).unwrap());
        let t0 = Stamp::now();
        let at = |us| t0.after(Duration::from_micros(us));
        let timeout = Error::Timeout(Duration::from_secs(1));
        // (kind, NIC, peer, requests, bytes, submitted at µs), accepted at 100 µs; then
        // each finishes (the third fails) at 200 + 300·i µs.
        let ops = [
            (OpKind::Write, 0, &a, 1, 64, 90),
            (OpKind::Write, 0, &a, 1, 64, 30),
            (OpKind::Write, 0, &a, 4, 256, 99),
            (OpKind::Read, 0, &a, 1, 8, 100),
            (OpKind::Write, 1, &a, 1, 64, 0),
            (OpKind::Write, 1, &b, 1, 64, 0),
            (OpKind::Write, 1, &b, 1, 64, 70),
        ];
        let (mut runs, mut each) = (Recorder::default(), Recorder::default());
        let mut started = Vec::new();
        for (i, &(kind, nic, peer, requests, bytes, submitted)) in ops.iter().enumerate() {
            let waited = 100 - submitted;
            let index = runs.accepted(kind, nic, peer, requests, bytes, waited);
            assert_eq!(
                each.accepted(kind, nic, peer, requests, bytes, waited),
                index
            );
            each.close_runs();
            started.push(Started {
                kind,
                peer: Some(index),
                bytes,
                at: at(submitted),
                nics: 1 << nic,
            });
            if i == 2 {
                // Mid-run: the three writes so far are in the open run.
                let mid = runs.snapshot(at(100));
                assert_eq!(mid, each.snapshot(at(100)));
                let w = mid.op(OpKind::Write);
                assert_eq!((w.started, w.requests, w.post_latency.count()), (3, 6, 3));
                assert_eq!(w.post_latency.sum_us, 10 + 70 + 1);
                assert_eq!((mid.nics[0].requests, mid.nics[0].bytes), (6, 384));
                assert_eq!(mid.peers[&a].requests, 6);
            }
        }
        for (i, s) in started.iter().enumerate() {
            let now = at(200 + 300 * i as u64);
            let result = if i == 2 { Err(&timeout) } else { Ok(()) };
            runs.finished(s, result, now);
            each.finished(s, result, now);
            each.close_runs();
            assert_eq!(runs.snapshot(now), each.snapshot(now), "after {i}");
        }
        let end = at(5_000);
        let open = runs.snapshot(end);
        runs.close_runs();
        assert_eq!(open, runs.snapshot(end));
        assert_eq!(open, each.snapshot(end));
        let w = open.op(OpKind::Write);
        assert_eq!((w.started, w.completed, w.bytes), (6, 5, 64 * 5));
        assert_eq!((w.latency.count(), w.failed.get("timeout")), (6, Some(&1)));
        assert_eq!(open.op(OpKind::Read).completed, 1);
        assert_eq!((open.nics[1].requests, open.nics[1].bytes), (3, 192));
        let (pa, pb) = (&open.peers[&a], &open.peers[&b]);
        assert_eq!((pa.requests, pa.failed, pb.requests), (8, 1, 2));
        // Peer b's last success was the last operation: 2,000 µs before the snapshot.
        assert_eq!(
            (pb.ms_since_activity, pa.ms_since_activity),
            (Some(3), Some(3))
        );
    }

    /// `engine.peers()` health: a peer whose last finished operation failed is unhealthy,
    /// with the reason, until one succeeds again.
    #[test]
    fn a_peer_is_unhealthy_from_a_failure_until_the_next_success() {
        let mut r = Recorder::default();
        let peer = NetAddr::new(&[7]).unwrap();
        let t0 = Stamp::now();
        let at = |ms| t0.after(Duration::from_millis(ms));
        r.started(OpKind::Write, 1, 0);
        let s = Started {
            kind: OpKind::Write,
            peer: Some(r.posted_to(&peer, 1, 8)),
            bytes: 8,
            at: t0,
            nics: 1,
        };
        let before = r.snapshot(t0).peers[&peer].clone();
        assert!(before.healthy && before.ms_since_activity.is_none());
        r.finished(&s, Ok(()), at(10));
        r.finished(
            &s,
            Err(&Error::PeerUnreachable(crate::domain::DomainError::new(
                crate::domain::DomainErrorKind::PeerUnreachable,
                "gone",
            ))),
            at(20),
        );
        let down = r.snapshot(at(25)).peers[&peer].clone();
        assert!(!down.healthy);
        assert_eq!(down.ms_since_activity, Some(5));
        assert!(down.last_error.unwrap().contains("gone"));
        r.finished(&s, Ok(()), at(30));
        assert!(r.snapshot(at(30)).peers[&peer].healthy);
    }
}
