//! In-order completion accounting for one RC QP under selective signalling. Pure.
//!
//! Only the last write of each chain asks for a completion. RC completes a QP's work requests
//! in order, so a successful completion also completes every unsignalled write posted before
//! it; a failed one (reported even when unsignalled) means the writes before it succeeded.

use std::collections::VecDeque;

/// A QP's posted writes, oldest first, with whether each was signalled.
#[derive(Debug, Default)]
pub struct Outstanding {
    fifo: VecDeque<(u64, bool)>,
}

impl Outstanding {
    /// Records a posted write.
    pub fn push(&mut self, wr_id: u64, signaled: bool) {
        self.fifo.push_back((wr_id, signaled));
    }

    /// Writes on the send queue.
    pub fn len(&self) -> usize {
        self.fifo.len()
    }

    /// Whether none is.
    pub fn is_empty(&self) -> bool {
        self.fifo.is_empty()
    }

    /// A successful completion (of the oldest signalled write): the ids it completes, in order.
    pub fn complete(&mut self) -> Vec<u64> {
        let mut done = Vec::new();
        while let Some((wr_id, signaled)) = self.fifo.pop_front() {
            done.push(wr_id);
            if signaled {
                break;
            }
        }
        done
    }

    /// A failed completion of a write with id `wr_id`: the ids that succeeded before it, and
    /// the failed one (the oldest write with that id). Later writes stay, for the caller to
    /// fail with [`drain`](Self::drain) once it tears the QP down.
    pub fn fail(&mut self, wr_id: u64) -> (Vec<u64>, Option<u64>) {
        let at = self
            .fifo
            .iter()
            .position(|&(id, _)| id == wr_id)
            .unwrap_or(0);
        let before = self.fifo.drain(..at).map(|(id, _)| id).collect();
        (before, self.fifo.pop_front().map(|(id, _)| id))
    }

    /// Everything still outstanding (the QP failed), oldest first.
    pub fn drain(&mut self) -> Vec<u64> {
        self.fifo.drain(..).map(|(id, _)| id).collect()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_signalled_completion_settles_its_chain() {
        let mut o = Outstanding::default();
        for (id, s) in [(1, false), (1, false), (2, false), (2, true), (3, true)] {
            o.push(id, s);
        }
        assert_eq!(o.complete(), vec![1, 1, 2, 2]);
        assert_eq!(o.complete(), vec![3]);
        assert!(o.is_empty());
        assert_eq!(o.complete(), Vec::<u64>::new());
    }

    #[test]
    fn a_failure_splits_before_and_after() {
        let mut o = Outstanding::default();
        for (id, s) in [(1, false), (2, false), (3, false), (3, true), (4, true)] {
            o.push(id, s);
        }
        assert_eq!(o.fail(3), (vec![1, 2], Some(3)));
        assert_eq!(o.drain(), vec![3, 4]);
        // An id that is not outstanding fails the oldest write.
        o.push(9, true);
        assert_eq!(o.fail(42), (vec![], Some(9)));
    }
}
