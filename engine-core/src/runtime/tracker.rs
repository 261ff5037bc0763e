//! Per-transfer completion tracking: which transfers are in flight, how many of their work
//! requests are still out, the first error seen, and their deadlines. Pure bookkeeping that
//! the worker feeds with `Done` events and the clock.
//!
//! A work request's id names its transfer's slot and the slot's generation, so a completion
//! that arrives after its transfer timed out (and the slot was reused) is recognised as stale
//! and ignored instead of completing someone else's transfer.

use super::clock::Stamp;
use std::collections::VecDeque;

use crate::error::{Error, Result};

/// A finished transfer: its waiter and result, the error boxed — `Error` is 80 bytes, and
/// this pair is moved a few times per operation on the hot path (issue 29).
pub(crate) type Finished<W> = (W, std::result::Result<(), Box<Error>>);

struct Slot<W> {
    generation: u32,
    entry: Option<InFlight<W>>,
}

struct InFlight<W> {
    remaining: u64,
    error: Option<Box<Error>>,
    waiter: W,
}

/// In-flight transfers, each finishing exactly once.
pub(crate) struct Tracker<W> {
    slots: Vec<Slot<W>>,
    free: Vec<u32>,
    /// (slot, generation, deadline) in submission order; deadlines only grow because every
    /// transfer gets the same timeout.
    deadlines: VecDeque<(u32, u32, Stamp)>,
    live: usize,
    /// Completions for ids not (or no longer) in flight.
    stale: u64,
}

impl<W> Tracker<W> {
    pub(crate) fn new() -> Self {
        Self {
            slots: Vec::new(),
            free: Vec::new(),
            deadlines: VecDeque::new(),
            live: 0,
            stale: 0,
        }
    }

    /// Transfers in flight.
    pub(crate) fn len(&self) -> usize {
        self.live
    }

    /// Starts tracking a transfer of `requests` work requests (at least one); returns the
    /// work-request id all of them carry.
    pub(crate) fn insert(&mut self, requests: u64, deadline: Stamp, waiter: W) -> u64 {
        debug_assert!(requests > 0);
        let slot = match self.free.pop() {
            Some(s) => s,
            None => {
                self.slots.push(Slot {
                    generation: 0,
                    entry: None,
                });
                (self.slots.len() - 1) as u32
            }
        };
        let s = &mut self.slots[slot as usize];
        s.entry = Some(InFlight {
            remaining: requests,
            error: None,
            waiter,
        });
        self.deadlines.push_back((slot, s.generation, deadline));
        self.live += 1;
        (u64::from(s.generation) << 32) | u64::from(slot)
    }

    fn entry(&mut self, wr_id: u64) -> Option<&mut InFlight<W>> {
        let (slot, generation) = ((wr_id & 0xffff_ffff) as usize, (wr_id >> 32) as u32);
        let s = self.slots.get_mut(slot)?;
        if s.generation != generation {
            return None;
        }
        s.entry.as_mut()
    }

    /// Completions seen for work requests not (or no longer) in flight: late ones after a
    /// timeout, or a backend reporting a request twice.
    pub(crate) fn stale(&self) -> u64 {
        self.stale
    }

    /// Marks the transfer behind `wr_id` cancelled: it finishes with `Cancelled` when its
    /// requests are in, unless one of them failed. Returns whether it was still in flight.
    pub(crate) fn cancel(&mut self, wr_id: u64) -> bool {
        match self.entry(wr_id) {
            Some(entry) => {
                entry
                    .error
                    .get_or_insert_with(|| Box::new(Error::Cancelled));
                true
            }
            None => false,
        }
    }

    /// Whether the transfer behind `wr_id` is still in flight.
    pub(crate) fn is_live(&mut self, wr_id: u64) -> bool {
        self.entry(wr_id).is_some()
    }

    fn finish(&mut self, slot: usize) -> Finished<W> {
        let s = &mut self.slots[slot];
        let done = s.entry.take().expect("finish is called on a live slot");
        s.generation = s.generation.wrapping_add(1);
        self.free.push(slot as u32);
        self.live -= 1;
        (done.waiter, done.error.map_or(Ok(()), Err))
    }

    /// Records one work request's outcome; returns the transfer's waiter and result once its
    /// last request is in. Stale or unknown ids return `None`.
    pub(crate) fn handle_done(&mut self, wr_id: u64, result: Result<()>) -> Option<Finished<W>> {
        let Some(entry) = self.entry(wr_id) else {
            self.stale += 1;
            return None;
        };
        entry.remaining -= 1;
        if let Err(e) = result {
            // The root cause wins over what it caused, whatever arrives first: a striped
            // transfer's bad key on one NIC flushes its requests on the others.
            if entry
                .error
                .as_ref()
                .is_none_or(|kept| cause_rank(&e) > cause_rank(kept))
            {
                entry.error = Some(Box::new(e));
            }
        }
        if entry.remaining > 0 {
            return None;
        }
        Some(self.finish((wr_id & 0xffff_ffff) as usize))
    }

    /// Records `n` work requests of `wr_id` that succeeded (a run of completions of one
    /// request's pages, counted at once); as `n` calls of [`handle_done`](Self::handle_done)
    /// with `Ok`: completions beyond what the transfer still awaits count as stale.
    pub(crate) fn handle_ok(&mut self, wr_id: u64, n: u64) -> Option<Finished<W>> {
        let Some(entry) = self.entry(wr_id) else {
            self.stale += n;
            return None;
        };
        let counted = n.min(entry.remaining);
        entry.remaining -= counted;
        if entry.remaining > 0 {
            return None;
        }
        self.stale += n - counted;
        Some(self.finish((wr_id & 0xffff_ffff) as usize))
    }

    /// Ends every transfer whose deadline is at or before `now` with `timeout()`.
    pub(crate) fn poll_expired(
        &mut self,
        now: Stamp,
        timeout: impl Fn() -> Error,
        out: &mut Vec<Finished<W>>,
    ) {
        while let Some(&(slot, generation, deadline)) = self.deadlines.front() {
            let s = &self.slots[slot as usize];
            let live = s.generation == generation && s.entry.is_some();
            if live && deadline > now {
                break;
            }
            self.deadlines.pop_front();
            if live {
                let (waiter, _) = self.finish(slot as usize);
                out.push((waiter, Err(Box::new(timeout()))));
            }
        }
    }

    /// The earliest deadline still pending.
    pub(crate) fn next_deadline(&self) -> Option<Stamp> {
        self.deadlines.front().map(|&(_, _, d)| d)
    }

    /// Ends every transfer (at shutdown), returning their waiters.
    pub(crate) fn drain(&mut self) -> Vec<W> {
        self.deadlines.clear();
        let live: Vec<usize> = (0..self.slots.len())
            .filter(|&i| self.slots[i].entry.is_some())
            .collect();
        live.into_iter().map(|i| self.finish(i).0).collect()
    }
}

/// How much an error says about why a transfer failed, for choosing among its requests'
/// errors: a request's own fault (the peer's NIC refused its key, or it was malformed)
/// outranks a backend's own words, which outrank an unreachable peer — what a request that
/// was flushed because another failed reports — which outranks running out of time.
fn cause_rank(e: &Error) -> u8 {
    match e {
        Error::RemoteAccess(_)
        | Error::InvalidArgument(_)
        | Error::Refused { .. }
        | Error::OutOfBounds { .. } => 4,
        Error::Backend { .. } => 3,
        Error::PeerUnreachable(_) => 2,
        Error::Timeout(_) | Error::NotListening { .. } => 0,
        // What the user asked for: whatever actually went wrong says more.
        Error::Cancelled => 0,
        _ => 1,
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::domain::{DomainError, DomainErrorKind};
    use std::time::Duration;

    /// Issue 25 §8: a read of a write-only region striped over two NICs failed as "flushed"
    /// (or unreachable) when the other NIC's flush arrived before the refusal that caused it.
    #[test]
    fn the_root_cause_wins_over_the_flushes_it_caused_in_any_order() {
        let root = Error::remote_access("bad key");
        let flush = Error::PeerUnreachable(DomainError::new(
            DomainErrorKind::PeerUnreachable,
            "flushed",
        ));
        let far = Stamp::from_nanos(60_000_000_000);
        for order in [[flush.clone(), root.clone()], [root.clone(), flush.clone()]] {
            let mut t = Tracker::new();
            let id = t.insert(2, far, ());
            let [first, second] = order;
            assert!(t.handle_done(id, Err(first)).is_none());
            let (_, r) = t.handle_done(id, Err(second)).unwrap();
            assert_eq!(r, Err(Box::new(root.clone())));
        }
    }

    #[test]
    fn a_transfer_finishes_after_its_last_request_with_the_first_error() {
        let mut t = Tracker::new();
        let far = Stamp::from_nanos(60_000_000_000);
        let id = t.insert(3, far, "w");
        assert!(t.handle_done(id, Ok(())).is_none());
        assert!(t
            .handle_done(id, Err(Error::remote_access("first")))
            .is_none());
        let (w, r) = t
            .handle_done(id, Err(Error::remote_access("second")))
            .unwrap();
        assert_eq!((w, r), ("w", Err(Box::new(Error::remote_access("first")))));
        assert_eq!(t.len(), 0);
        assert!(
            t.handle_done(id, Ok(())).is_none(),
            "a finished transfer never finishes again"
        );
    }

    #[test]
    fn late_completions_after_a_timeout_do_not_touch_the_reused_slot() {
        let mut t = Tracker::new();
        let now = Stamp::from_nanos(1_000);
        let old = t.insert(1, now, "old");
        let mut out = Vec::new();
        t.poll_expired(now, || Error::Timeout(Duration::ZERO), &mut out);
        assert_eq!(
            out,
            vec![("old", Err(Box::new(Error::Timeout(Duration::ZERO))))]
        );
        let new = t.insert(1, now.after(Duration::from_secs(60)), "new");
        assert_eq!(new & 0xffff_ffff, old & 0xffff_ffff, "the slot is reused");
        assert!(
            t.handle_done(old, Ok(())).is_none(),
            "the stale completion is ignored"
        );
        assert!(t.is_live(new));
        assert_eq!(t.handle_done(new, Ok(())), Some(("new", Ok(()))));
    }

    proptest::proptest! {
        /// Counting a run of successes at once finishes, and counts stale completions, exactly
        /// as counting them one by one does — whatever the runs, with errors in between and
        /// more completions than the transfer has (a backend reporting one twice).
        #[test]
        fn counting_successes_in_runs_equals_counting_them_one_by_one(
            requests in 1u64..20,
            events in proptest::collection::vec((1u64..6, proptest::bool::ANY), 0..12),
        ) {
            let far = Stamp::from_nanos(60_000_000_000);
            let (mut runs, mut single) = (Tracker::new(), Tracker::new());
            let (a, b) = (runs.insert(requests, far, ()), single.insert(requests, far, ()));
            let (mut by_runs, mut one_by_one) = (Vec::new(), Vec::new());
            for (i, &(n, failed)) in events.iter().enumerate() {
                if failed {
                    let e = || Err(Error::remote_access(format!("event {i}")));
                    by_runs.extend(runs.handle_done(a, e()).map(|f| (i, f)));
                    one_by_one.extend(single.handle_done(b, e()).map(|f| (i, f)));
                    continue;
                }
                by_runs.extend(runs.handle_ok(a, n).map(|f| (i, f)));
                for _ in 0..n {
                    one_by_one.extend(single.handle_done(b, Ok(())).map(|f| (i, f)));
                }
            }
            proptest::prop_assert_eq!(by_runs, one_by_one);
            proptest::prop_assert_eq!((runs.stale(), runs.len()), (single.stale(), single.len()));
        }
    }

    #[test]
    fn drain_ends_everything_in_flight() {
        let mut t = Tracker::new();
        let far = Stamp::from_nanos(60_000_000_000);
        let a = t.insert(2, far, 1);
        t.insert(1, far, 2);
        t.handle_done(a, Ok(()));
        let mut left = t.drain();
        left.sort();
        assert_eq!(left, vec![1, 2]);
        assert_eq!(t.len(), 0);
        assert_eq!(t.next_deadline(), None);
    }
}
