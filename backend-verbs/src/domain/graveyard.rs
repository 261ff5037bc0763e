//! Retired QPs, kept until their last completions have been read, then freed — at a deadline
//! the Domain returns (`Domain::poll_timeout`), not whenever it happens to be polled: an idle
//! worker parks, and a parked worker is polled only when something wakes it.
//!
//! A retired QP is *settled* once nothing it carried is still outstanding (the Domain knows:
//! its data queue is gone). It is freed [`LINGER`] after its burial if settled by then, or at
//! the first collection after it settled (its settling completion came through a poll, which
//! collects). Pure: time is passed in, and QPs are anything with a number.

use std::time::{Duration, Instant};

/// How long a retired QP is kept after its burial: its message QP's flushes, which settle
/// nothing the Domain tracks, are long read by then.
pub(super) const LINGER: Duration = Duration::from_secs(5);

/// A QP as the graveyard sees it: its number.
pub(super) trait Numbered {
    fn qpn(&self) -> u32;
}

impl Numbered for crate::ffi::Qp {
    fn qpn(&self) -> u32 {
        self.qpn
    }
}

/// Retired QPs and when each was buried.
pub(super) struct Graveyard<Q> {
    buried: Vec<(Instant, Q)>,
}

impl<Q> Default for Graveyard<Q> {
    fn default() -> Self {
        Self { buried: Vec::new() }
    }
}

impl<Q: Numbered> Graveyard<Q> {
    /// Keeps `qp`, retired at `now`.
    pub(super) fn bury(&mut self, now: Instant, qp: Q) {
        self.buried.push((now, qp));
    }

    /// Whether any QP waits to be freed (no clock needs reading when none does).
    pub(super) fn is_empty(&self) -> bool {
        self.buried.is_empty()
    }

    /// When [`collect`](Self::collect) next frees something, given which QPs are `settled`:
    /// the earliest end of a settled QP's linger. An unsettled one has no deadline: the
    /// completion that settles it comes through a poll.
    pub(super) fn poll_timeout(&self, settled: impl Fn(u32) -> bool) -> Option<Instant> {
        self.buried
            .iter()
            .filter(|(_, qp)| settled(qp.qpn()))
            .map(|&(since, _)| since + LINGER)
            .min()
    }

    /// Hands to `free` every QP that is `settled` and buried at least [`LINGER`] before `now`.
    pub(super) fn collect(
        &mut self,
        now: Instant,
        settled: impl Fn(u32) -> bool,
        mut free: impl FnMut(Q),
    ) {
        let mut i = 0;
        while i < self.buried.len() {
            let (since, qp) = &self.buried[i];
            if settled(qp.qpn()) && now.saturating_duration_since(*since) >= LINGER {
                free(self.buried.swap_remove(i).1);
            } else {
                i += 1;
            }
        }
    }

    /// Calls `f` with every QP kept.
    #[cfg(test)]
    pub(super) fn each(&self, f: impl FnMut(&Q)) {
        self.buried.iter().map(|(_, qp)| qp).for_each(f);
    }

    /// How many QPs are kept.
    #[cfg(test)]
    pub(super) fn len(&self) -> usize {
        self.buried.len()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[derive(Debug, PartialEq)]
    struct FakeQp(u32);

    impl Numbered for FakeQp {
        fn qpn(&self) -> u32 {
            self.0
        }
    }

    fn collected(g: &mut Graveyard<FakeQp>, now: Instant, settled: &[u32]) -> Vec<u32> {
        let mut freed = Vec::new();
        g.collect(now, |n| settled.contains(&n), |qp| freed.push(qp.0));
        freed.sort_unstable();
        freed
    }

    #[test]
    fn a_settled_qp_is_freed_at_the_end_of_its_linger_and_that_is_the_deadline() {
        let t0 = Instant::now();
        let mut g = Graveyard::default();
        g.bury(t0, FakeQp(7));
        g.bury(t0 + Duration::from_secs(1), FakeQp(8));
        assert_eq!(g.poll_timeout(|_| true), Some(t0 + LINGER));
        assert!(collected(&mut g, t0 + LINGER - Duration::from_nanos(1), &[7, 8]).is_empty());
        assert_eq!(collected(&mut g, t0 + LINGER, &[7, 8]), vec![7]);
        assert_eq!(
            g.poll_timeout(|_| true),
            Some(t0 + Duration::from_secs(1) + LINGER)
        );
        assert_eq!(
            collected(&mut g, t0 + Duration::from_secs(60), &[7, 8]),
            vec![8]
        );
        assert!(g.is_empty());
        assert_eq!(g.poll_timeout(|_| true), None, "nothing left: no deadline");
    }

    #[test]
    fn an_unsettled_qp_has_no_deadline_and_is_freed_at_the_first_collection_once_settled() {
        let t0 = Instant::now();
        let mut g = Graveyard::default();
        g.bury(t0, FakeQp(1));
        g.bury(t0, FakeQp(2));
        assert_eq!(g.poll_timeout(|n| n == 2), Some(t0 + LINGER));
        assert_eq!(g.poll_timeout(|_| false), None);
        let late = t0 + 3 * LINGER;
        assert_eq!(collected(&mut g, late, &[2]), vec![2]);
        assert_eq!(g.len(), 1, "its flushes are still outstanding: kept");
        assert_eq!(collected(&mut g, late, &[1]), vec![1]);
        assert!(g.is_empty());
    }

    #[test]
    fn every_buried_qp_is_freed_exactly_once() {
        let t0 = Instant::now();
        let mut g = Graveyard::default();
        for n in 0..100 {
            g.bury(t0 + Duration::from_millis(u64::from(n) * 37), FakeQp(n));
        }
        let mut freed = Vec::new();
        let mut now = t0;
        while let Some(due) = g.poll_timeout(|_| true) {
            assert!(due > now || freed.is_empty(), "a deadline in the past");
            now = due;
            freed.extend(collected(&mut g, now, &(0..100).collect::<Vec<_>>()));
        }
        freed.sort_unstable();
        assert_eq!(freed, (0..100).collect::<Vec<_>>());
    }
}
