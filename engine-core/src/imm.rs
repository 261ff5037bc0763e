//! Why one file: it is one type. The ImmCounter's entries, idle set, per-sender shares and
//! spare queues are kept in step by one `settle`, and every operation goes through it; what
//! is not that type (about 310 of the lines) is its unit and property tests.
//!
//! The ImmCounter: counted, order-free completion on the receiving side.
//!
//! Every write-with-immediate that lands adds one to the count of its 32-bit immediate. An
//! expectation `(imm, n)` is met once `n` arrivals of `imm` are counted, and then *consumes*
//! those `n`, so the same immediate can be reused for the next iteration (the next layer, the
//! next weight-sync step). Arrivals may come before the expectation is registered, and in any
//! order with arrivals of other immediates. Expectations on one immediate are met in the order
//! they were registered.
//!
//! **Stale arrivals never satisfy a later expectation.** An expectation that times out still
//! *owes* the arrivals it waited for: a transfer that timed out at its sender can land later,
//! and its arrivals would otherwise meet the next expectation on that immediate early, with
//! none of its own data (the next KV-cache request that reuses a layer's immediate would read
//! garbage). So an expired expectation stays in its queue, without a waiter, as a *debt*: it
//! absorbs the next arrivals exactly as if it were still waiting, and the expectations behind
//! it count only what comes after. If the late arrivals never come (the sender's transfer
//! failed), the expectations behind it time out too — loudly, never early. A caller that knows
//! from its peer that nothing more is in flight for an immediate clears the debts and the
//! unconsumed count with [`reset`](ImmCounter::reset).
//!
//! **Bounded memory.** A peer can send any immediate; an entry for an immediate nobody waits
//! for lives until it is expected or reset, so the number of such entries is capped
//! (`max_idle`). An arrival that would need a new entry beyond the cap is dropped and counted,
//! and every expectation that then times out says that arrivals were dropped. Where the backend
//! names an arrival's sender, each sender may create at most `max_idle_per_source` of those
//! entries, so one peer spraying immediates (zero-byte writes cost it nothing) cannot fill the
//! table and make the early arrivals of every other peer drop. Totals (for mirrors) are kept
//! only for immediates someone mirrors.
//!
//! **Immediates only their senders may send.** A zero-byte write-with-immediate costs its
//! sender nothing, and an arrival counted early tells the waiter that data landed which did
//! not (an EP rank reading a peer's slot before the peer wrote it). A caller that knows who
//! sends a family of immediates (those whose bits under a mask equal a value) restricts it to
//! those senders: an arrival of it from a sender the backend names and that is not one of
//! them is refused (counted, never counted as an arrival). Arrivals whose sender the backend
//! does not name are counted as before: a backend that cannot tell senders apart protects
//! nothing here (docs/security.md says which do).
//!
//! This type is pure bookkeeping: no clock, no threads. The engine wraps it in a mutex, feeds it
//! arrivals from the worker and passes `now` in for deadlines.

use std::collections::hash_map::Entry as Slot;
use std::collections::VecDeque;
use std::time::Instant;

use foldhash::{HashMap, HashSet};

use crate::wire::{NetAddr, MAX_NICS};

/// Counts arrivals per immediate and matches them against expectations carrying a `W` (the
/// engine's waiter: a callback or a flag).
#[derive(Debug)]
pub struct ImmCounter<W> {
    entries: HashMap<u32, Entry<W>>,
    /// Running totals of the immediates someone mirrors (from the first mirror on, plus what
    /// was unconsumed then).
    totals: HashMap<u32, u64>,
    /// The most entries with nothing waiting that are kept (see the module docs).
    max_idle: usize,
    /// Entries with no expectation in their queue.
    idle: HashSet<u32>,
    /// The most idle entries one sender may have created.
    max_idle_per_source: usize,
    /// Idle entries by the sender whose arrival created them (senders the backend named).
    idle_by_source: HashMap<NetAddr, usize>,
    /// Arrivals dropped because the table, or their sender's share of it, was full.
    dropped: u64,
    /// Families of immediates only some senders may send: per mask, the allowed senders by
    /// value (see the module docs). Empty unless someone restricts.
    restricted: Vec<(u32, SendersByValue)>,
    /// Arrivals refused because their sender may not send that immediate.
    refused: u64,
    /// Emptied expectation queues of removed entries, reused by new ones: an expectation on
    /// a fresh immediate (one per KV-cache layer or request) otherwise allocated its queue
    /// and freed it when met (~300 instructions of a ~6,700-instruction ping-pong write).
    spare_queues: Vec<VecDeque<Expectation<W>>>,
}

/// Under one mask: the senders allowed for each value of an immediate's masked bits.
type SendersByValue = HashMap<u32, Box<[NetAddr]>>;

/// Emptied queues kept for reuse, and the largest capacity kept (a queue that once held a
/// burst of expectations is freed).
const SPARE_QUEUES: usize = 64;
const SPARE_QUEUE_CAPACITY: usize = 8;

#[derive(Debug)]
struct Entry<W> {
    /// Arrivals counted and not consumed.
    count: u64,
    /// The sender whose arrival created the entry, if the backend named it (its idle
    /// entries are counted against its share).
    source: Option<NetAddr>,
    /// Expectations (and debts of expired ones) in registration order.
    waiting: VecDeque<Expectation<W>>,
}

#[derive(Debug)]
struct Expectation<W> {
    need: u64,
    deadline: Instant,
    /// `None` once expired: a debt that absorbs `need` arrivals.
    waiter: Option<W>,
}

/// How an expectation ended.
#[derive(Debug, PartialEq, Eq)]
pub enum Outcome<W> {
    /// The arrivals it waited for were counted (and consumed).
    Met(W),
    /// Its deadline passed first. The arrivals it waited for are still owed: they are
    /// absorbed when they land. `dropped` is the number of arrivals (of any immediate) the
    /// counter had to drop so far because its table was full.
    Expired {
        /// The expectation's waiter.
        waiter: W,
        /// Arrivals dropped so far (0 unless the table of idle immediates overflowed).
        dropped: u64,
    },
}

/// What [`ImmCounter::reset`] discarded.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct ResetReport {
    /// Unconsumed arrivals.
    pub unconsumed: u64,
    /// Arrivals still owed to expired expectations.
    pub owed: u64,
}

/// The default cap on entries with nothing waiting (see the module docs).
pub const DEFAULT_MAX_IDLE_IMMS: usize = 1 << 16;

impl<W> Default for ImmCounter<W> {
    fn default() -> Self {
        Self::with_max_idle(DEFAULT_MAX_IDLE_IMMS)
    }
}

impl<W> ImmCounter<W> {
    /// An empty counter with the default cap.
    pub fn new() -> Self {
        Self::default()
    }

    /// An empty counter keeping at most `max_idle` immediates that nobody waits for.
    pub fn with_max_idle(max_idle: usize) -> Self {
        Self::with_limits(max_idle, max_idle)
    }

    /// An empty counter keeping at most `max_idle` immediates that nobody waits for, at
    /// most `max_idle_per_source` of them created by any one named sender.
    pub fn with_limits(max_idle: usize, max_idle_per_source: usize) -> Self {
        Self {
            entries: HashMap::default(),
            totals: HashMap::default(),
            max_idle,
            idle: HashSet::default(),
            max_idle_per_source,
            idle_by_source: HashMap::default(),
            dropped: 0,
            restricted: Vec::new(),
            refused: 0,
            spare_queues: Vec::new(),
        }
    }

    /// An empty counter for an engine: at most `max_idle` immediates that nobody waits for,
    /// at most `max_idle_per_peer` of them created by any one peer engine's arrivals.
    ///
    /// Backends name an arrival's sender by the NIC it came from, and a peer engine has up to
    /// [`MAX_NICS`] of them, none of which says which engine it belongs to; so each NIC
    /// address gets a [`MAX_NICS`]th of a peer's share (rounded up). A peer with fewer NICs
    /// gets less of the table than it could, which only matters for arrivals nobody expects
    /// yet (4,096 a NIC by default).
    pub fn for_peers(max_idle: usize, max_idle_per_peer: usize) -> Self {
        Self::with_limits(max_idle, max_idle_per_peer.div_ceil(MAX_NICS).max(1))
    }

    /// Idle entries created by `source`'s arrivals.
    pub fn idle_from(&self, source: &NetAddr) -> usize {
        self.idle_by_source.get(source).copied().unwrap_or(0)
    }

    /// Arrivals of `imm` counted and not yet consumed by an expectation (or absorbed by a
    /// debt).
    pub fn count(&self, imm: u32) -> u64 {
        self.entries.get(&imm).map_or(0, |e| e.count)
    }

    /// Arrivals of `imm` still owed to expectations that expired.
    pub fn owed(&self, imm: u32) -> u64 {
        self.entries.get(&imm).map_or(0, |e| {
            e.waiting
                .iter()
                .filter(|x| x.waiter.is_none())
                .map(|x| x.need)
                .sum::<u64>()
        })
    }

    /// Arrivals dropped because the table of idle immediates, or their sender's share of
    /// it, was full.
    pub fn dropped(&self) -> u64 {
        self.dropped
    }

    /// From now on, an arrival of an immediate `imm` with `imm & mask == value` counts only
    /// if the backend names no sender or names one of `senders`; others are refused (see
    /// [`refused`](Self::refused)). `None` lifts the restriction. Arrivals that came before,
    /// that nobody waits for yet and that a sender outside `senders` created, are refused now
    /// too (review 56 N-1: a forged arrival counted before the restriction met the first
    /// expectation after it). Only an entry's creator is known: later arrivals of other
    /// senders into an entry stay counted.
    pub fn restrict_senders(&mut self, mask: u32, value: u32, senders: Option<Vec<NetAddr>>) {
        let value = value & mask;
        if let Some(allowed) = &senders {
            let foreign: Vec<u32> = self
                .idle
                .iter()
                .copied()
                .filter(|imm| imm & mask == value)
                .filter(|imm| {
                    self.entries[imm]
                        .source
                        .as_ref()
                        .is_some_and(|s| !allowed.contains(s))
                })
                .collect();
            for imm in foreign {
                if let Some(entry) = self.entries.get_mut(&imm) {
                    self.refused += std::mem::take(&mut entry.count);
                }
                self.settle(imm);
            }
        }
        let at = self.restricted.iter().position(|(m, _)| *m == mask);
        match (senders, at) {
            (Some(senders), Some(at)) => {
                self.restricted[at].1.insert(value, senders.into());
            }
            (Some(senders), None) => {
                let by_value = HashMap::from_iter([(value, senders.into_boxed_slice())]);
                self.restricted.push((mask, by_value));
            }
            (None, Some(at)) => {
                self.restricted[at].1.remove(&value);
                if self.restricted[at].1.is_empty() {
                    self.restricted.swap_remove(at);
                }
            }
            (None, None) => {}
        }
    }

    /// Arrivals refused because a restriction did not allow their sender.
    pub fn refused(&self) -> u64 {
        self.refused
    }

    /// Whether a restriction refuses `imm` from `source`.
    fn refuses(&self, imm: u32, source: Option<&NetAddr>) -> bool {
        let Some(source) = source else {
            return false;
        };
        self.restricted.iter().any(|(mask, by_value)| {
            by_value
                .get(&(imm & mask))
                .is_some_and(|allowed| !allowed.contains(source))
        })
    }

    /// Immediates with arrivals counted and nobody waiting for them.
    pub fn idle(&self) -> usize {
        self.idle.len()
    }

    /// Arrivals owed to expired (or cancelled) expectations, over every immediate.
    pub fn owed_total(&self) -> u64 {
        self.entries
            .values()
            .flat_map(|e| e.waiting.iter().filter(|x| x.waiter.is_none()))
            .map(|x| x.need)
            .sum()
    }

    /// Immediates with an entry (for memory checks).
    pub fn entries(&self) -> usize {
        self.entries.len()
    }

    /// Starts keeping the running total of `imm` (for a mirror); returns it: what is
    /// unconsumed now, or the total kept so far.
    pub fn track_total(&mut self, imm: u32) -> u64 {
        let count = self.count(imm);
        *self.totals.entry(imm).or_insert(count)
    }

    /// The running total of a tracked immediate (0 if it is not tracked).
    pub fn total(&self, imm: u32) -> u64 {
        self.totals.get(&imm).copied().unwrap_or(0)
    }

    /// Whether any expectation is waiting (debts do not count: they have no deadline).
    pub fn has_waiting(&self) -> bool {
        self.entries
            .values()
            .any(|e| e.waiting.iter().any(|x| x.waiter.is_some()))
    }

    /// Counts `n` arrivals of `imm` from a sender the backend did not name; returns the
    /// expectations this met, in registration order.
    pub fn handle_arrivals(&mut self, imm: u32, n: u64, met: &mut Vec<Outcome<W>>) {
        self.handle_arrivals_from(imm, n, None, met)
    }

    /// Counts `n` arrivals of `imm` from `source` (if the backend named it); returns the
    /// expectations this met, in registration order.
    pub fn handle_arrivals_from(
        &mut self,
        imm: u32,
        n: u64,
        source: Option<&NetAddr>,
        met: &mut Vec<Outcome<W>>,
    ) {
        // One length check on the usual path (nothing restricted).
        if !self.restricted.is_empty() && self.refuses(imm, source) {
            self.refused += n;
            return;
        }
        if !self.totals.is_empty() {
            if let Some(total) = self.totals.get_mut(&imm) {
                *total += n;
            }
        }
        self.count_arrivals(imm, n, source, met);
    }

    /// [`handle_arrivals_from`](Self::handle_arrivals_from) but for the running totals.
    fn count_arrivals(
        &mut self,
        imm: u32,
        n: u64,
        source: Option<&NetAddr>,
        met: &mut Vec<Outcome<W>>,
    ) {
        // One lookup for the common cases (an arrival that meets the only expectation, or
        // that finds nobody waiting): `settle`'s own lookups only where the idle
        // bookkeeping may change.
        let mut slot = match self.entries.entry(imm) {
            Slot::Occupied(slot) => slot,
            Slot::Vacant(slot) => {
                let share_full = source.is_some_and(|s| {
                    self.idle_by_source.get(s).copied().unwrap_or(0) >= self.max_idle_per_source
                });
                if self.idle.len() >= self.max_idle || share_full {
                    self.dropped += n;
                    return;
                }
                let mut entry = Entry::new(self.spare_queues.pop());
                entry.source = source.cloned();
                slot.insert_entry(entry)
            }
        };
        let entry = slot.get_mut();
        let waited = !entry.waiting.is_empty();
        entry.count += n;
        entry.drain_met(met);
        if waited && entry.waiting.is_empty() {
            if entry.count == 0 {
                // Spent: removed as `settle` would, with nothing else to do: it was not idle
                // (something waited), so neither the idle set nor a sender's share counted it.
                let spent = slot.remove();
                self.recycle(spent.waiting);
                return;
            }
            // Counted one by one, the arrival that met the last expectation would have left
            // nothing, and the entry would have gone; the rest would have come as new
            // arrivals, kept (charged to their sender's share) or dropped as such. So they
            // are: `n` at once counts as `n` one at a time.
            let rest = std::mem::take(&mut entry.count);
            self.settle(imm);
            return self.count_arrivals(imm, rest, source, met);
        }
        // An entry is idle exactly when nothing waits on it (see `settle`): if something
        // waited before and still does (an expectation of many arrivals, the stream's usual
        // case), nothing changed and the idle bookkeeping is left alone.
        if !waited {
            self.settle(imm);
        }
    }

    /// Registers an expectation of `need` arrivals of `imm`. If it is met by arrivals already
    /// counted (and nothing earlier on `imm` is waiting or owed), it is returned at once.
    pub fn expect(&mut self, imm: u32, need: u64, deadline: Instant, waiter: W) -> Option<W> {
        let spare = &mut self.spare_queues;
        let entry = self
            .entries
            .entry(imm)
            .or_insert_with(|| Entry::new(spare.pop()));
        if entry.waiting.is_empty() && entry.count >= need {
            entry.count -= need;
            self.settle(imm);
            return Some(waiter);
        }
        // Idle exactly when nothing waited and something was counted (an entry with neither
        // is removed by `settle`, so one is only ever fresh, and not idle): only then does
        // the waiter added below change the idle bookkeeping.
        let was_idle = entry.waiting.is_empty() && entry.count > 0;
        entry.waiting.push_back(Expectation {
            need,
            deadline,
            waiter: Some(waiter),
        });
        if was_idle {
            self.settle(imm);
        }
        None
    }

    /// Discards `imm`'s unconsumed arrivals and what expired expectations still owe, for a
    /// caller that knows from its peer that nothing more is in flight for it. Waiting
    /// expectations keep waiting, now for new arrivals only.
    pub fn reset(&mut self, imm: u32) -> ResetReport {
        let Some(entry) = self.entries.get_mut(&imm) else {
            return ResetReport::default();
        };
        let mut report = ResetReport {
            unconsumed: entry.count,
            owed: 0,
        };
        entry.count = 0;
        entry.waiting.retain(|x| {
            if x.waiter.is_none() {
                report.owed += x.need;
            }
            x.waiter.is_some()
        });
        self.settle(imm);
        report
    }

    /// Ends every expectation whose deadline is at or before `now`; each stays behind as a
    /// debt (see the module docs).
    pub fn poll_expired(&mut self, now: Instant, out: &mut Vec<Outcome<W>>) {
        let dropped = self.dropped;
        let mut touched = Vec::new();
        for (imm, entry) in self.entries.iter_mut() {
            let mut any = false;
            for e in entry.waiting.iter_mut() {
                if e.deadline <= now {
                    if let Some(waiter) = e.waiter.take() {
                        out.push(Outcome::Expired { waiter, dropped });
                        any = true;
                    }
                }
            }
            if any {
                touched.push(*imm);
            }
        }
        for imm in touched {
            self.settle(imm);
        }
    }

    /// Ends the first waiting expectation whose waiter `matches` (it was cancelled) and
    /// returns its waiter; like an expiry, it stays behind as a debt and absorbs the
    /// arrivals it waited for.
    pub fn cancel_where(&mut self, mut matches: impl FnMut(&W) -> bool) -> Option<W> {
        let (imm, waiter) = self.entries.iter_mut().find_map(|(imm, entry)| {
            let x = entry
                .waiting
                .iter_mut()
                .find(|x| x.waiter.as_ref().is_some_and(&mut matches))?;
            Some((*imm, x.waiter.take()?))
        })?;
        self.settle(imm);
        Some(waiter)
    }

    /// Ends every waiting expectation (at shutdown), returning their waiters.
    pub fn drain_waiting(&mut self) -> Vec<W> {
        let waiters = self
            .entries
            .values_mut()
            .flat_map(|e| e.waiting.drain(..).filter_map(|x| x.waiter))
            .collect();
        let imms: Vec<u32> = self.entries.keys().copied().collect();
        for imm in imms {
            self.settle(imm);
        }
        waiters
    }

    /// The earliest deadline of any waiting expectation.
    pub fn next_deadline(&self) -> Option<Instant> {
        self.entries
            .values()
            .flat_map(|e| {
                e.waiting
                    .iter()
                    .filter(|x| x.waiter.is_some())
                    .map(|x| x.deadline)
            })
            .min()
    }

    /// Keeps the idle set and the table in step with `imm`'s entry: an entry with nothing
    /// counted and nothing queued goes; one with nothing queued is idle.
    /// An idle entry a named sender created counts against that sender's share while it
    /// is idle.
    fn settle(&mut self, imm: u32) {
        let mut removed = None;
        let changed = match self.entries.get(&imm) {
            Some(e) if e.count == 0 && e.waiting.is_empty() => {
                removed = self.entries.remove(&imm);
                self.idle.remove(&imm)
            }
            Some(e) if e.waiting.is_empty() => self.idle.insert(imm),
            Some(_) | None => self.idle.remove(&imm),
        };
        let source = if changed {
            let entry = removed.as_ref().or_else(|| self.entries.get(&imm));
            entry.and_then(|e| e.source.clone())
        } else {
            None
        };
        if let Some(entry) = removed {
            self.recycle(entry.waiting);
        }
        let Some(source) = source else {
            return;
        };
        if self.idle.contains(&imm) {
            *self.idle_by_source.entry(source).or_insert(0) += 1;
        } else if let Some(share) = self.idle_by_source.get_mut(&source) {
            *share -= 1;
            if *share == 0 {
                self.idle_by_source.remove(&source);
            }
        }
    }
}

impl<W> ImmCounter<W> {
    /// Keeps a removed entry's (empty) queue for a new entry, unless enough are kept or it
    /// grew large.
    fn recycle(&mut self, queue: VecDeque<Expectation<W>>) {
        if self.spare_queues.len() < SPARE_QUEUES && queue.capacity() <= SPARE_QUEUE_CAPACITY {
            self.spare_queues.push(queue);
        }
    }
}

impl<W> Entry<W> {
    /// An entry with nothing counted, its queue (empty) reused if one is given.
    fn new(queue: Option<VecDeque<Expectation<W>>>) -> Self {
        debug_assert!(queue.as_ref().is_none_or(VecDeque::is_empty));
        Self {
            count: 0,
            source: None,
            waiting: queue.unwrap_or_default(),
        }
    }

    /// Meets (or, for debts, pays) the expectations at the head of the queue that what is
    /// counted covers.
    fn drain_met(&mut self, met: &mut Vec<Outcome<W>>) {
        while let Some(head) = self.waiting.front() {
            if self.count < head.need {
                break;
            }
            self.count -= head.need;
            let head = self.waiting.pop_front().expect("front() was Some");
            if let Some(waiter) = head.waiter {
                met.push(Outcome::Met(waiter));
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::time::Duration;

    fn later(s: u64) -> Instant {
        Instant::now() + Duration::from_secs(s)
    }

    #[test]
    fn arrivals_before_the_expectation_are_counted_and_consumed() {
        let mut c = ImmCounter::new();
        let mut met = Vec::new();
        c.handle_arrivals(7, 3, &mut met);
        assert!(met.is_empty());
        assert_eq!(c.expect(7, 2, later(5), "a"), Some("a"));
        assert_eq!(c.count(7), 1);
        assert_eq!(c.expect(7, 2, later(5), "b"), None);
        c.handle_arrivals(7, 1, &mut met);
        assert_eq!(met, vec![Outcome::Met("b")]);
        assert_eq!(c.count(7), 0);
    }

    #[test]
    fn expectations_on_one_imm_are_met_in_order_and_others_are_untouched() {
        let mut c = ImmCounter::new();
        let mut met = Vec::new();
        assert_eq!(c.expect(1, 2, later(5), "first"), None);
        assert_eq!(c.expect(1, 1, later(5), "second"), None);
        c.handle_arrivals(2, 5, &mut met);
        assert!(met.is_empty());
        c.handle_arrivals(1, 1, &mut met);
        assert!(met.is_empty(), "the second must not overtake the first");
        c.handle_arrivals(1, 2, &mut met);
        assert_eq!(met, vec![Outcome::Met("first"), Outcome::Met("second")]);
        assert_eq!(c.count(2), 5);
    }

    #[test]
    fn an_expired_expectation_owes_its_arrivals_and_unblocks_nothing_early() {
        let mut c = ImmCounter::new();
        let now = Instant::now();
        let mut out = Vec::new();
        assert_eq!(c.expect(1, 5, now + Duration::from_millis(1), "slow"), None);
        assert_eq!(c.expect(1, 1, now + Duration::from_secs(9), "next"), None);
        c.handle_arrivals(1, 1, &mut out);
        assert!(out.is_empty());
        assert_eq!(c.next_deadline(), Some(now + Duration::from_millis(1)));
        c.poll_expired(now + Duration::from_millis(2), &mut out);
        assert_eq!(
            out,
            vec![Outcome::Expired {
                waiter: "slow",
                dropped: 0
            }]
        );
        out.clear();
        // The 4 the expired one still waited for land late: absorbed, not counted for "next".
        c.handle_arrivals(1, 4, &mut out);
        assert!(out.is_empty(), "stale arrivals met a later expectation");
        assert_eq!(c.owed(1), 0);
        c.handle_arrivals(1, 1, &mut out);
        assert_eq!(out, vec![Outcome::Met("next")]);
        assert!(!c.has_waiting());
        assert_eq!(c.entries(), 0, "nothing left behind");
    }

    /// The defect a user hit: a timed-out layer's late arrivals completed the next request
    /// that reused the immediate, with none of its own data.
    #[test]
    fn late_arrivals_of_a_timed_out_request_do_not_complete_the_next_one() {
        let mut c = ImmCounter::new();
        let now = Instant::now();
        let mut out = Vec::new();
        assert_eq!(c.expect(3, 2, now, "request 1"), None);
        c.poll_expired(now, &mut out);
        out.clear();
        // Request 1's two writes land after its expectation expired.
        c.handle_arrivals(3, 2, &mut out);
        // Request 2 registers after; nothing of its own has landed.
        assert_eq!(c.expect(3, 2, later(5), "request 2"), None);
        assert!(out.is_empty());
        c.handle_arrivals(3, 2, &mut out);
        assert_eq!(out, vec![Outcome::Met("request 2")]);
    }

    #[test]
    fn reset_forgets_debts_and_unconsumed_arrivals() {
        let mut c = ImmCounter::new();
        let now = Instant::now();
        let mut out = Vec::new();
        c.expect(4, 3, now, "expired");
        c.poll_expired(now, &mut out);
        out.clear();
        c.handle_arrivals(4, 1, &mut out);
        assert_eq!((c.count(4), c.owed(4)), (1, 3));
        assert_eq!(
            c.reset(4),
            ResetReport {
                unconsumed: 1,
                owed: 3
            }
        );
        assert_eq!(c.entries(), 0);
        assert_eq!(c.expect(4, 1, later(5), "fresh"), None);
        c.handle_arrivals(4, 1, &mut out);
        assert_eq!(out, vec![Outcome::Met("fresh")]);
    }

    #[test]
    fn a_met_expectations_queue_serves_the_next_immediate_and_the_pool_is_bounded() {
        let mut c = ImmCounter::new();
        let mut out = Vec::new();
        c.expect(1, 1, later(5), "first");
        c.handle_arrivals(1, 1, &mut out);
        assert_eq!(c.entries(), 0);
        assert_eq!(c.spare_queues.len(), 1, "the met entry's queue is kept");
        c.expect(2, 2, later(5), "second");
        assert!(c.spare_queues.is_empty(), "and taken by the next entry");
        c.handle_arrivals(2, 1, &mut out);
        c.handle_arrivals(2, 1, &mut out);
        assert_eq!(out, vec![Outcome::Met("first"), Outcome::Met("second")]);
        // Many expectations met at once keep at most SPARE_QUEUES queues.
        for imm in 0..2 * SPARE_QUEUES as u32 {
            c.expect(100 + imm, 1, later(5), "many");
        }
        for imm in 0..2 * SPARE_QUEUES as u32 {
            c.handle_arrivals(100 + imm, 1, &mut out);
        }
        assert_eq!(c.spare_queues.len(), SPARE_QUEUES);
        assert_eq!(c.entries(), 0);
    }

    #[test]
    fn idle_immediates_are_capped_and_drops_are_reported_on_expiry() {
        let mut c = ImmCounter::with_max_idle(2);
        let now = Instant::now();
        let mut out = Vec::new();
        for imm in 0..10 {
            c.handle_arrivals(imm, 1, &mut out);
        }
        assert_eq!(c.entries(), 2, "a peer cannot grow the table at will");
        assert_eq!(c.dropped(), 8);
        // An immediate someone waits for is not idle: its arrivals are always counted.
        assert_eq!(c.expect(100, 2, now, "w"), None);
        c.handle_arrivals(100, 1, &mut out);
        assert_eq!(c.count(100), 1);
        c.poll_expired(now, &mut out);
        assert_eq!(
            out,
            vec![Outcome::Expired {
                waiter: "w",
                dropped: 8
            }]
        );
    }

    fn peer(name: &str) -> NetAddr {
        NetAddr::new(name.as_bytes()).unwrap()
    }

    /// Issue 25: a peer that fills the table with zero-byte writes of fresh immediates made
    /// every other peer's early arrivals drop. Each named sender now has a share.
    #[test]
    fn one_sender_cannot_take_the_whole_table_of_idle_immediates() {
        let mut c: ImmCounter<&str> = ImmCounter::with_limits(8, 3);
        let (flood, honest) = (peer("flood"), peer("honest"));
        let mut out = Vec::new();
        for imm in 0..100 {
            c.handle_arrivals_from(imm, 1, Some(&flood), &mut out);
        }
        assert_eq!(c.idle_from(&flood), 3);
        assert_eq!(c.dropped(), 97);
        // The honest peer's early arrival is kept, and met when its receiver expects it.
        c.handle_arrivals_from(500, 1, Some(&honest), &mut out);
        assert_eq!(c.count(500), 1);
        assert_eq!(c.expect(500, 1, later(1), "honest"), Some("honest"));
        // Arrivals for an immediate someone waits for never count against a share.
        assert_eq!(c.expect(600, 2, later(1), "waited"), None);
        c.handle_arrivals_from(600, 2, Some(&flood), &mut out);
        assert_eq!(out, vec![Outcome::Met("waited")]);
        // Consuming the flood's idle entries gives its share back.
        assert_eq!(c.expect(0, 1, later(1), "a"), Some("a"));
        assert_eq!(c.idle_from(&flood), 2);
        c.handle_arrivals_from(200, 1, Some(&flood), &mut out);
        assert_eq!((c.idle_from(&flood), c.count(200)), (3, 1));
        // Unnamed senders are bound by the table's cap only.
        for imm in 1000..1010 {
            c.handle_arrivals(imm, 1, &mut out);
        }
        assert_eq!(c.entries(), 8);
    }

    /// Review 56 M6: a zero-byte write-with-immediate from anyone counted as the arrival an
    /// EP rank waits for from one peer, which then read that peer's slot before it was
    /// written. A restricted family counts only its senders' arrivals.
    #[test]
    fn a_restricted_immediate_counts_only_its_senders() {
        let mut c: ImmCounter<&str> = ImmCounter::new();
        let (b0, b1, stranger) = (peer("b-nic0"), peer("b-nic1"), peer("stranger"));
        let mut out = Vec::new();
        // The family "source B" of an EP group: tag 3 in the top bits, source 7 in the low.
        let (mask, value) = (0xF000_3FFF, (3 << 28) | 7);
        c.restrict_senders(mask, value, Some(vec![b0.clone(), b1.clone()]));
        let imm = value | (5 << 16); // epoch 5, phase 0
        assert_eq!(c.expect(imm, 2, later(1), "slot"), None);
        c.handle_arrivals_from(imm, 1, Some(&stranger), &mut out);
        assert_eq!((c.count(imm), c.refused()), (0, 1));
        assert!(out.is_empty(), "a stranger's immediate met the wait");
        // Early or waited for, from any of B's NICs: counted.
        c.handle_arrivals_from(imm, 1, Some(&b1), &mut out);
        c.handle_arrivals_from(imm, 1, Some(&b0), &mut out);
        assert_eq!(out, vec![Outcome::Met("slot")]);
        // Another family is not restricted; a sender the backend does not name is counted.
        c.handle_arrivals_from(imm + 1, 1, Some(&stranger), &mut out);
        c.handle_arrivals(imm, 1, &mut out);
        assert_eq!((c.count(imm + 1), c.count(imm), c.refused()), (1, 1, 1));
        // Lifted: the stranger counts again.
        c.restrict_senders(mask, value, None);
        c.handle_arrivals_from(imm, 1, Some(&stranger), &mut out);
        assert_eq!((c.count(imm), c.refused()), (2, 1));
        assert!(c.restricted.is_empty());
    }

    /// Review 56 N-1: an arrival a stranger sent before the restriction existed stayed
    /// counted and met the first expectation after it. Restricting refuses the idle arrivals
    /// of the family that a sender outside the set created; the allowed sender's are kept.
    #[test]
    fn restricting_refuses_what_outsiders_sent_before() {
        let mut c: ImmCounter<&str> = ImmCounter::new();
        let (b, stranger) = (peer("b"), peer("stranger"));
        let mut out = Vec::new();
        c.handle_arrivals_from(0x17, 1, Some(&stranger), &mut out);
        c.handle_arrivals_from(0x27, 1, Some(&b), &mut out);
        c.handle_arrivals(0x37, 1, &mut out);
        c.handle_arrivals_from(0x18, 1, Some(&stranger), &mut out); // another family
        c.restrict_senders(0xF, 7, Some(vec![b.clone()]));
        assert_eq!(c.refused(), 1);
        assert_eq!(
            (c.count(0x17), c.entries()),
            (0, 3),
            "the stranger's entry stayed"
        );
        assert_eq!(c.idle_from(&stranger), 1, "its share was not given back");
        assert_eq!(
            c.expect(0x17, 1, later(1), "first"),
            None,
            "met by a forged arrival"
        );
        assert_eq!(c.expect(0x27, 1, later(1), "b"), Some("b"));
        assert_eq!(c.expect(0x37, 1, later(1), "unnamed"), Some("unnamed"));
    }

    /// Issue 42 item 6: a sender is a NIC address, and one peer engine has up to
    /// [`MAX_NICS`] of them. With the default limits, a peer spraying fresh immediates from
    /// four NICs filled all 65,536 entries and a second peer's early arrival was dropped.
    #[test]
    fn a_peer_with_four_nics_holds_one_peers_share_in_all() {
        let (max_idle, per_peer) = (DEFAULT_MAX_IDLE_IMMS, DEFAULT_MAX_IDLE_IMMS / 4);
        let mut c: ImmCounter<&str> = ImmCounter::for_peers(max_idle, per_peer);
        let nics: Vec<NetAddr> = (0..MAX_NICS)
            .map(|i| peer(&format!("flood nic {i}")))
            .collect();
        let mut out = Vec::new();
        let mut imm = 0;
        for nic in &nics {
            for _ in 0..per_peer {
                c.handle_arrivals_from(imm, 1, Some(nic), &mut out);
                imm += 1;
            }
        }
        let held: usize = nics.iter().map(|n| c.idle_from(n)).sum();
        assert!(held <= per_peer, "one peer's NICs hold {held} > {per_peer}");
        // Three more peers of four NICs each still fit, and so does an honest one's arrival.
        c.handle_arrivals_from(u32::MAX, 1, Some(&peer("honest")), &mut out);
        assert_eq!(c.count(u32::MAX), 1);
    }

    #[test]
    fn a_cancelled_expectation_owes_its_arrivals_like_an_expired_one() {
        let mut c = ImmCounter::new();
        let mut out = Vec::new();
        assert_eq!(c.expect(5, 2, later(60), "first"), None);
        assert_eq!(c.expect(5, 1, later(60), "second"), None);
        assert_eq!(c.cancel_where(|w| *w == "first"), Some("first"));
        assert_eq!(c.cancel_where(|w| *w == "first"), None, "once");
        assert_eq!(c.owed(5), 2);
        // The cancelled one's two arrivals are absorbed; the third meets "second".
        c.handle_arrivals(5, 2, &mut out);
        assert!(out.is_empty());
        c.handle_arrivals(5, 1, &mut out);
        assert_eq!(out, vec![Outcome::Met("second")]);
    }

    #[test]
    fn totals_are_kept_only_for_tracked_immediates() {
        let mut c: ImmCounter<()> = ImmCounter::new();
        let mut out = Vec::new();
        c.handle_arrivals(1, 2, &mut out);
        assert_eq!(c.total(1), 0);
        assert_eq!(c.track_total(1), 2, "starts from what is unconsumed");
        c.handle_arrivals(1, 3, &mut out);
        assert_eq!(c.expect(1, 5, later(1), ()), Some(()));
        assert_eq!(c.total(1), 5, "consuming does not lower a total");
        c.handle_arrivals(2, 1, &mut out);
        assert_eq!(c.total(2), 0);
    }

    proptest::proptest! {
        /// Whatever the interleaving of arrivals, expectations and expiries, an expectation is
        /// met only by arrivals that landed after every earlier expectation on its immediate
        /// (met or expired) had its share: arrivals are assigned in registration order.
        #[test]
        fn arrivals_are_assigned_in_registration_order(
            ops in proptest::collection::vec((0u8..3, 1u64..4), 1..60)
        ) {
            let mut c = ImmCounter::new();
            let t0 = Instant::now();
            let mut out = Vec::new();
            // Model: the queue of (id, need), and arrivals assigned FIFO.
            let mut queue: VecDeque<(usize, u64, bool)> = VecDeque::new();
            let mut spare = 0u64;
            let mut met_model = Vec::new();
            let mut met_real = Vec::new();
            let mut next_id = 0usize;
            for (kind, n) in ops {
                match kind {
                    0 => {
                        c.handle_arrivals(9, n, &mut out);
                        spare += n;
                    }
                    1 => {
                        let id = next_id;
                        next_id += 1;
                        if let Some(w) = c.expect(9, n, t0, id) {
                            met_real.push(w);
                        }
                        queue.push_back((id, n, false));
                    }
                    _ => {
                        c.poll_expired(t0, &mut out);
                        for e in queue.iter_mut() {
                            e.2 = true;
                        }
                    }
                }
                while let Some(&(id, need, expired)) = queue.front() {
                    if spare < need { break; }
                    spare -= need;
                    queue.pop_front();
                    if !expired { met_model.push(id); }
                }
                for o in out.drain(..) {
                    if let Outcome::Met(w) = o { met_real.push(w); }
                }
            }
            proptest::prop_assert_eq!(met_real, met_model);
            proptest::prop_assert_eq!(c.count(9), spare);
        }

        /// Each sender's share always equals the idle entries its arrivals created, and no
        /// sender holds more than its share, whatever arrives, is expected, expires or is
        /// reset.
        #[test]
        fn shares_match_the_idle_entries_of_each_sender(
            ops in proptest::collection::vec((0u8..4, 0u32..12, 0usize..3), 1..120)
        ) {
            let senders = [peer("a"), peer("b"), peer("c")];
            let mut c: ImmCounter<u32> = ImmCounter::with_limits(10, 4);
            let t0 = Instant::now();
            let mut out = Vec::new();
            for (kind, imm, who) in ops {
                match kind {
                    0 | 1 => c.handle_arrivals_from(imm, 1, Some(&senders[who]), &mut out),
                    2 => { let _ = c.expect(imm, 1, t0, imm); }
                    _ => {
                        c.poll_expired(t0, &mut out);
                        let _ = c.reset(imm);
                    }
                }
                for s in &senders {
                    let idle_created = c
                        .entries
                        .iter()
                        .filter(|(imm, e)| c.idle.contains(imm) && e.source.as_ref() == Some(s))
                        .count();
                    proptest::prop_assert_eq!(c.idle_from(s), idle_created);
                    proptest::prop_assert!(idle_created <= 4);
                }
                proptest::prop_assert!(c.idle.len() <= 10);
                // What `handle_arrivals_from` relies on to skip the bookkeeping.
                for (imm, e) in &c.entries {
                    proptest::prop_assert_eq!(c.idle.contains(imm), e.waiting.is_empty());
                }
            }
        }

        /// Arrivals counted `n` at a time (the worker counts a run of one immediate from one
        /// sender at once) meet the same expectations in the same order, keep the same counts
        /// and drop the same arrivals as counted one at a time, within tight bounds.
        #[test]
        fn arrivals_counted_in_runs_are_counted_as_one_by_one(
            ops in proptest::collection::vec((0u8..3, 0u32..5, 0usize..2, 1u64..6), 1..80)
        ) {
            let senders = [peer("a"), peer("b")];
            let (mut runs, mut singles): (ImmCounter<usize>, ImmCounter<usize>) =
                (ImmCounter::with_limits(3, 2), ImmCounter::with_limits(3, 2));
            let t0 = Instant::now() + std::time::Duration::from_secs(60);
            let (mut met_runs, mut met_singles) = (Vec::new(), Vec::new());
            for (i, (kind, imm, who, n)) in ops.into_iter().enumerate() {
                if kind == 0 {
                    let (a, b) = (runs.expect(imm, n, t0, i), singles.expect(imm, n, t0, i));
                    proptest::prop_assert_eq!(a, b);
                    continue;
                }
                runs.handle_arrivals_from(imm, n, Some(&senders[who]), &mut met_runs);
                for _ in 0..n {
                    singles.handle_arrivals_from(imm, 1, Some(&senders[who]), &mut met_singles);
                }
                let ids = |met: &Vec<Outcome<usize>>| -> Vec<usize> {
                    met.iter().map(|o| match o { Outcome::Met(w) => *w, _ => usize::MAX }).collect()
                };
                proptest::prop_assert_eq!(ids(&met_runs), ids(&met_singles));
                proptest::prop_assert_eq!(runs.dropped(), singles.dropped());
                for v in 0..5 {
                    proptest::prop_assert_eq!(runs.count(v), singles.count(v));
                }
            }
        }
    }

    proptest::proptest! {
        /// Restrictions change only which arrivals count: for any arrivals from any senders,
        /// the restricted counter counts exactly the arrivals an unrestricted one counts from
        /// allowed or unnamed senders, and refuses the rest.
        #[test]
        fn restricting_refuses_exactly_the_other_named_senders(
            ops in proptest::collection::vec((0u32..4, 0usize..4, 1u64..4), 1..80)
        ) {
            let senders = [Some(peer("a")), Some(peer("b")), Some(peer("c")), None];
            let mut restricted: ImmCounter<&str> = ImmCounter::new();
            let mut plain: ImmCounter<&str> = ImmCounter::new();
            // Immediates 0 and 2 (low bit clear) only from "a"; 1 and 3 from "a" or "b".
            restricted.restrict_senders(1, 0, Some(vec![peer("a")]));
            restricted.restrict_senders(1, 1, Some(vec![peer("a"), peer("b")]));
            let (mut out, mut refused) = (Vec::new(), 0);
            for (imm, who, n) in ops {
                let from = senders[who].as_ref();
                restricted.handle_arrivals_from(imm, n, from, &mut out);
                let allowed = match from {
                    None => true,
                    Some(s) if imm % 2 == 0 => *s == peer("a"),
                    Some(s) => *s == peer("a") || *s == peer("b"),
                };
                if allowed {
                    plain.handle_arrivals_from(imm, n, from, &mut out);
                } else {
                    refused += n;
                }
            }
            proptest::prop_assert_eq!(restricted.refused(), refused);
            for imm in 0..4 {
                proptest::prop_assert_eq!(restricted.count(imm), plain.count(imm));
            }
        }
    }
}
