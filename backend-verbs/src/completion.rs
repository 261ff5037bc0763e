//! In-order completion accounting for one RC QP under selective signalling. Pure.
//!
//! Only the last write of each chain asks for a completion. RC completes a QP's work requests
//! in order, so a successful completion also completes every unsignalled write posted before
//! it; a failed one (reported even when unsignalled) means the writes before it succeeded.

use std::collections::VecDeque;
use std::time::{Duration, Instant};

/// Whether a send queue stopped moving, told from a count of its moves compared at periodic
/// checks: the clock is read once per check, not once per completion (a clock read is a
/// system call on machines without a usable TSC — soft-RoCE's guest reads the HPET — and a
/// cost on every completion of the hot path elsewhere).
#[derive(Debug, Clone, Copy, Default)]
pub struct Progress {
    moves: u64,
    seen: u64,
    /// When a check last found the queue holding work it had not seen move (None: idle or
    /// moved since).
    still_since: Option<Instant>,
}

impl Progress {
    /// The queue moved: a completion, or its first work after being empty.
    pub fn moved(&mut self) {
        self.moves = self.moves.wrapping_add(1);
    }

    /// At a check at `now`, with `busy` saying whether the queue holds work: how long it
    /// has held work without moving, as far as the checks can tell (from the first check that
    /// found it still), or `None` if it is idle or moved since the last check.
    pub fn stalled_for(&mut self, busy: bool, now: Instant) -> Option<Duration> {
        if !busy || self.moves != self.seen {
            self.seen = self.moves;
            self.still_since = busy.then_some(now);
            return None;
        }
        let since = *self.still_since.get_or_insert(now);
        Some(now.saturating_duration_since(since))
    }
}

/// A QP's posted writes, oldest first: each with the id the NIC knows it by (unique per work
/// request), the engine's id for it (shared by the chunks of one transfer), whether it was
/// signalled, and the work request itself (`P`), to post again if it was flushed unexecuted.
#[derive(Debug)]
pub struct Outstanding<P = ()> {
    fifo: VecDeque<(u64, u64, bool, P)>,
}

impl<P> Default for Outstanding<P> {
    fn default() -> Self {
        Self {
            fifo: VecDeque::new(),
        }
    }
}

impl<P> Outstanding<P> {
    /// Records a posted write: `wr_id` as posted, `user` as the engine knows it, `posted` to
    /// repost it with.
    pub fn push(&mut self, wr_id: u64, user: u64, signaled: bool, posted: P) {
        self.fifo.push_back((wr_id, user, signaled, posted));
    }

    /// Writes on the send queue.
    pub fn len(&self) -> usize {
        self.fifo.len()
    }

    /// Whether none is.
    pub fn is_empty(&self) -> bool {
        self.fifo.is_empty()
    }

    /// A successful completion (of the oldest signalled write): the engine ids it completes,
    /// in order.
    pub fn complete(&mut self) -> Vec<u64> {
        let mut done = Vec::new();
        while let Some((_, user, signaled, _)) = self.fifo.pop_front() {
            done.push(user);
            if signaled {
                break;
            }
        }
        done
    }

    /// A failed completion of the work request posted as `wr_id`: the engine ids of the writes
    /// that succeeded before it, and the failed one's. Later writes stay (their own flush
    /// completions settle them, or [`drain`](Self::drain)). A `wr_id` that is not outstanding
    /// (a duplicate, or one already settled) settles nothing.
    pub fn fail(&mut self, wr_id: u64) -> (Vec<u64>, Option<u64>) {
        let Some(at) = self.fifo.iter().position(|(id, ..)| *id == wr_id) else {
            return (Vec::new(), None);
        };
        let before = self.fifo.drain(..at).map(|(_, user, ..)| user).collect();
        (before, self.fifo.pop_front().map(|(_, user, ..)| user))
    }

    /// The QP was put in the error state by its peer, and `wr_id` was flushed — so it and
    /// everything after it never executed. Returns the engine ids of the writes before it
    /// (they succeeded) and the work requests from it on, to post again.
    pub fn flushed_from(&mut self, wr_id: u64) -> (Vec<u64>, Vec<P>) {
        let Some(at) = self.fifo.iter().position(|(id, ..)| *id == wr_id) else {
            return (Vec::new(), Vec::new());
        };
        let before = self.fifo.drain(..at).map(|(_, user, ..)| user).collect();
        let rest = self.fifo.drain(..).map(|(.., posted)| posted).collect();
        (before, rest)
    }

    /// Whether any outstanding work request satisfies `f` (e.g. uses a region about to be
    /// deregistered).
    pub fn any(&self, f: impl Fn(&P) -> bool) -> bool {
        self.fifo.iter().any(|(.., posted)| f(posted))
    }

    /// Everything still outstanding, oldest first (engine ids).
    pub fn drain(&mut self) -> Vec<u64> {
        self.fifo.drain(..).map(|(_, user, ..)| user).collect()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_queue_is_stalled_only_while_it_holds_work_that_has_not_moved_between_checks() {
        let t0 = Instant::now();
        let at = |ms: u64| t0 + Duration::from_millis(ms);
        let mut p = Progress::default();
        assert_eq!(p.stalled_for(false, at(0)), None, "idle");
        p.moved(); // work posted
        assert_eq!(
            p.stalled_for(true, at(10)),
            None,
            "moved since the last check"
        );
        assert_eq!(p.stalled_for(true, at(30)), Some(Duration::from_millis(20)));
        assert_eq!(p.stalled_for(true, at(50)), Some(Duration::from_millis(40)));
        p.moved(); // a completion
        assert_eq!(p.stalled_for(true, at(60)), None);
        assert_eq!(p.stalled_for(true, at(65)), Some(Duration::from_millis(5)));
        assert_eq!(p.stalled_for(false, at(70)), None, "drained");
        // Work again without a recorded move (posted and completed between checks is a move;
        // this is the defensive case): stillness counts from the first check that sees it.
        assert_eq!(p.stalled_for(true, at(80)), Some(Duration::ZERO));
        assert_eq!(p.stalled_for(true, at(95)), Some(Duration::from_millis(15)));
    }

    #[test]
    fn any_looks_at_every_outstanding_request() {
        let mut o = Outstanding::default();
        o.push(1, 10, false, 7u32);
        o.push(2, 10, true, 9u32);
        assert!(o.any(|&p| p == 9) && !o.any(|&p| p == 8));
        o.complete();
        assert!(!o.any(|&p| p == 9));
    }

    #[test]
    fn a_signalled_completion_settles_its_chain() {
        let mut o = Outstanding::default();
        for (id, user, s) in [
            (1, 1, false),
            (2, 1, false),
            (3, 2, false),
            (4, 2, true),
            (5, 3, true),
        ] {
            o.push(id, user, s, ());
        }
        assert_eq!(o.complete(), vec![1, 1, 2, 2]);
        assert_eq!(o.complete(), vec![3]);
        assert!(o.is_empty());
        assert_eq!(o.complete(), Vec::<u64>::new());
    }

    /// Chunks of one transfer share the engine's id; the NIC's id says which one failed. (It
    /// used to blame the oldest write with the engine's id, reporting an unrelated completed
    /// chunk as failed.)
    #[test]
    fn a_failure_names_exactly_the_work_request_that_failed() {
        let mut o = Outstanding::default();
        for (id, user, s) in [
            (10, 7, false),
            (11, 8, false),
            (12, 7, false),
            (13, 7, true),
        ] {
            o.push(id, user, s, ());
        }
        assert_eq!(o.fail(12), (vec![7, 8], Some(7)));
        assert_eq!(o.drain(), vec![7]);
        // An id that is not outstanding settles nothing.
        o.push(20, 9, true, ());
        assert_eq!(o.fail(42), (vec![], None));
        assert_eq!(o.len(), 1);
    }

    /// A flush the peer caused: what came before succeeded, the rest is returned to repost.
    #[test]
    fn a_flush_from_the_peer_returns_the_unexecuted_requests() {
        let mut o = Outstanding::default();
        for (id, user, s) in [(1, 1, false), (2, 1, true), (3, 2, false), (4, 2, true)] {
            o.push(id, user, s, id * 10);
        }
        assert_eq!(o.flushed_from(3), (vec![1, 1], vec![30, 40]));
        assert!(o.is_empty());
        assert_eq!(o.flushed_from(9), (vec![], vec![]));
    }

    /// After the QP moved to the error state, each write's flush completion settles it alone.
    #[test]
    fn flushes_settle_one_by_one() {
        let mut o = Outstanding::default();
        for (id, user, s) in [(1, 1, false), (2, 1, false), (3, 2, true)] {
            o.push(id, user, s, ());
        }
        assert_eq!(o.fail(1), (vec![], Some(1)));
        assert_eq!(o.fail(2), (vec![], Some(1)));
        assert_eq!(o.fail(3), (vec![], Some(2)));
        assert!(o.is_empty());
    }
}
