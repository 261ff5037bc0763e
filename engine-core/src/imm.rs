//! The ImmCounter: counted, order-free completion on the receiving side.
//!
//! Every write-with-immediate that lands adds one to the count of its 32-bit immediate. An
//! expectation `(imm, n)` is met once `n` arrivals of `imm` are counted, and then *consumes*
//! those `n`, so the same immediate can be reused for the next iteration (the next layer, the
//! next weight-sync step). Arrivals may come before the expectation is registered, and in any
//! order with arrivals of other immediates. Expectations on one immediate are met in the order
//! they were registered.
//!
//! This type is pure bookkeeping: no clock, no threads. The engine wraps it in a mutex, feeds it
//! arrivals from the worker and passes `now` in for deadlines.

use std::collections::{HashMap, VecDeque};
use std::time::Instant;

/// Counts arrivals per immediate and matches them against expectations carrying a `W` (the
/// engine's waiter: a callback or a flag).
#[derive(Debug)]
pub struct ImmCounter<W> {
    entries: HashMap<u32, Entry<W>>,
    /// Every arrival ever counted, per immediate (consumed or not).
    totals: HashMap<u32, u64>,
}

#[derive(Debug)]
struct Entry<W> {
    count: u64,
    waiting: VecDeque<Expectation<W>>,
}

#[derive(Debug)]
struct Expectation<W> {
    need: u64,
    deadline: Instant,
    waiter: W,
}

/// How an expectation ended.
#[derive(Debug, PartialEq, Eq)]
pub enum Outcome<W> {
    /// The arrivals it waited for were counted (and consumed).
    Met(W),
    /// Its deadline passed first; the arrivals counted so far stay counted.
    Expired(W),
}

impl<W> Default for ImmCounter<W> {
    fn default() -> Self {
        Self {
            entries: HashMap::new(),
            totals: HashMap::new(),
        }
    }
}

impl<W> ImmCounter<W> {
    /// An empty counter.
    pub fn new() -> Self {
        Self::default()
    }

    /// Arrivals of `imm` counted and not yet consumed by an expectation.
    pub fn count(&self, imm: u32) -> u64 {
        self.entries.get(&imm).map_or(0, |e| e.count)
    }

    /// Every arrival of `imm` counted so far, consumed or not (what a mirror reports).
    pub fn total(&self, imm: u32) -> u64 {
        self.totals.get(&imm).copied().unwrap_or(0)
    }

    /// Whether any expectation is waiting.
    pub fn has_waiting(&self) -> bool {
        self.entries.values().any(|e| !e.waiting.is_empty())
    }

    /// Counts `n` arrivals of `imm`; returns the expectations this met, in registration order.
    pub fn handle_arrivals(&mut self, imm: u32, n: u64, met: &mut Vec<Outcome<W>>) {
        *self.totals.entry(imm).or_insert(0) += n;
        let entry = self.entries.entry(imm).or_insert_with(|| Entry {
            count: 0,
            waiting: VecDeque::new(),
        });
        entry.count += n;
        entry.drain_met(met);
    }

    /// Registers an expectation of `need` arrivals of `imm`. If it is met by arrivals already
    /// counted (and no earlier expectation on `imm` is waiting), it is returned at once.
    pub fn expect(&mut self, imm: u32, need: u64, deadline: Instant, waiter: W) -> Option<W> {
        let entry = self.entries.entry(imm).or_insert_with(|| Entry {
            count: 0,
            waiting: VecDeque::new(),
        });
        if entry.waiting.is_empty() && entry.count >= need {
            entry.count -= need;
            return Some(waiter);
        }
        entry.waiting.push_back(Expectation {
            need,
            deadline,
            waiter,
        });
        None
    }

    /// Ends every expectation whose deadline is at or before `now`. Removing a head can let the
    /// ones queued behind it be met by what is already counted; those are returned as met.
    pub fn poll_expired(&mut self, now: Instant, out: &mut Vec<Outcome<W>>) {
        for entry in self.entries.values_mut() {
            if entry.waiting.iter().all(|e| e.deadline > now) {
                continue;
            }
            let mut kept = VecDeque::with_capacity(entry.waiting.len());
            for e in entry.waiting.drain(..) {
                if e.deadline <= now {
                    out.push(Outcome::Expired(e.waiter));
                } else {
                    kept.push_back(e);
                }
            }
            entry.waiting = kept;
            entry.drain_met(out);
        }
        self.entries
            .retain(|_, e| e.count > 0 || !e.waiting.is_empty());
    }

    /// Ends every waiting expectation (at shutdown), returning their waiters.
    pub fn drain_waiting(&mut self) -> Vec<W> {
        self.entries
            .values_mut()
            .flat_map(|e| e.waiting.drain(..).map(|x| x.waiter))
            .collect()
    }

    /// The earliest deadline of any waiting expectation.
    pub fn next_deadline(&self) -> Option<Instant> {
        self.entries
            .values()
            .flat_map(|e| e.waiting.iter().map(|x| x.deadline))
            .min()
    }
}

impl<W> Entry<W> {
    fn drain_met(&mut self, met: &mut Vec<Outcome<W>>) {
        while let Some(head) = self.waiting.front() {
            if self.count < head.need {
                break;
            }
            self.count -= head.need;
            let head = self.waiting.pop_front().expect("front() was Some");
            met.push(Outcome::Met(head.waiter));
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
    fn expiry_keeps_the_count_and_unblocks_the_queue() {
        let mut c = ImmCounter::new();
        let now = Instant::now();
        let mut out = Vec::new();
        assert_eq!(c.expect(1, 5, now + Duration::from_millis(1), "slow"), None);
        assert_eq!(c.expect(1, 1, now + Duration::from_secs(9), "fast"), None);
        c.handle_arrivals(1, 1, &mut out);
        assert!(out.is_empty());
        assert_eq!(c.next_deadline(), Some(now + Duration::from_millis(1)));
        c.poll_expired(now + Duration::from_millis(2), &mut out);
        assert_eq!(out, vec![Outcome::Expired("slow"), Outcome::Met("fast")]);
        assert_eq!(c.count(1), 0);
        assert!(!c.has_waiting());
        assert_eq!(c.next_deadline(), None);
    }
}
