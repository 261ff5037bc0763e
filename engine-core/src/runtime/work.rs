//! A transfer's work requests as the worker receives them: listed one by one ([`Ops`]), or —
//! for a paged request — as one plan per starting NIC plus each page's offsets
//! ([`PagedWork`]), expanded only as the worker posts them. A page then costs its two
//! offsets (16 bytes) instead of a 96-byte [`RdmaWork`] that clones its peer's handle
//! (issue 29: no per-page descriptor list).
//! Pure data and iteration; the worker decides what to post.

use smallvec::SmallVec;

use crate::domain::{RdmaOp, RdmaRequest};
use crate::wire::NetAddr;

/// One write or read, resolved to a NIC, its keys and the peer's address on that NIC: an
/// [`RdmaRequest`] that owns its peer address while it waits in the worker's queues.
#[derive(Debug, Clone, PartialEq)]
pub(crate) struct RdmaWork {
    pub(crate) op: RdmaOp,
    pub(crate) nic: usize,
    pub(crate) peer: NetAddr,
    pub(crate) local_addr: u64,
    pub(crate) local_key: u64,
    pub(crate) remote_addr: u64,
    pub(crate) remote_key: u64,
    pub(crate) remote_base: u64,
    pub(crate) len: u64,
}

/// How far a page lies from its plan's (page 0's) addresses.
pub(crate) type Shift = xfer_plugin::domain::PageShift;

impl RdmaWork {
    /// The request a Domain is handed, with the worker's id for it, moved by `shift`.
    #[inline]
    pub(crate) fn request(&self, wr_id: u64, Shift { local, remote }: Shift) -> RdmaRequest<'_> {
        RdmaRequest {
            wr_id,
            op: self.op,
            peer: &self.peer,
            local_addr: self.local_addr + local,
            local_key: self.local_key,
            remote_addr: self.remote_addr + remote,
            remote_key: self.remote_key,
            remote_base: self.remote_base,
            len: self.len,
        }
    }

    /// A copy moved by `shift`, to wait in a queue.
    pub(crate) fn shifted(&self, Shift { local, remote }: Shift) -> Self {
        Self {
            local_addr: self.local_addr + local,
            remote_addr: self.remote_addr + remote,
            ..self.clone()
        }
    }
}

/// Listed operations: one inline (a single write, the commonest command, allocates nothing),
/// more on the heap.
pub(crate) type Ops = SmallVec<[RdmaWork; 1]>;

/// A paged request: page `i` is the work of `plans[i % plans.len()]` moved by `offsets[i]`.
/// Every page has the same length, so its split over the NICs depends only on the NIC it
/// starts at: at most one plan per NIC.
#[derive(Debug)]
pub(crate) struct PagedWork {
    /// The requests of a page starting on each NIC, at offset 0 of both regions.
    pub(crate) plans: Vec<Ops>,
    /// Each page's (local, remote) offset, checked against both regions at submission.
    pub(crate) offsets: Vec<Shift>,
}

impl PagedWork {
    /// Every plan operation with how many pages use its plan: what capability checks and
    /// statistics need, without walking the pages.
    pub(crate) fn shapes(&self) -> impl Iterator<Item = (&RdmaWork, u64)> + Clone {
        let (n, pages) = (self.plans.len(), self.offsets.len());
        self.plans.iter().enumerate().flat_map(move |(k, plan)| {
            // Pages k, k + n, k + 2n, … use plan k.
            let uses = pages.saturating_sub(k).div_ceil(n) as u64;
            plan.iter().map(move |op| (op, uses))
        })
    }

    /// The batch at `cursor` (moved past plans with no page in its block): a plan operation
    /// and the shifts of the pages that use it, in the order [`for_each_batch`]
    /// (Self::for_each_batch) hands them out; `None` once every batch was handed out. With
    /// one NIC the shifts are the request's own, else gathered into `scratch`.
    pub(crate) fn batch<'a>(
        &'a self,
        cursor: &mut PageCursor,
        scratch: &'a mut [Shift; INTERLEAVED_BATCH],
    ) -> Option<(&'a RdmaWork, &'a [Shift])> {
        let n = self.plans.len();
        if n == 1 {
            let op = self.plans[0].get(cursor.op)?;
            return (!self.offsets.is_empty()).then_some((op, &self.offsets[..]));
        }
        // Blocks start at multiples of `n`: page `block + k + j·n` uses plan `k`.
        let (op, block) = loop {
            if cursor.block >= self.offsets.len() {
                return None;
            }
            let end = (cursor.block + INTERLEAVED_BATCH * n).min(self.offsets.len());
            if cursor.plan >= n {
                *cursor = PageCursor {
                    block: end,
                    ..PageCursor::default()
                };
                continue;
            }
            match self.plans[cursor.plan].get(cursor.op) {
                Some(op) if cursor.block + cursor.plan < end => {
                    break (op, &self.offsets[cursor.block..end]);
                }
                _ => {
                    cursor.plan += 1;
                    cursor.op = 0;
                    cursor.done = 0;
                }
            }
        };
        let mut len = 0;
        for &shift in block.iter().skip(cursor.plan).step_by(n) {
            scratch[len] = shift;
            len += 1;
        }
        Some((op, &scratch[..len]))
    }

    /// Calls `post` with every plan operation and the shifts of pages that use it: the
    /// batches the worker hands a Domain whole (issue 29: a Domain checks and locks once per
    /// batch, not per page). With one NIC a batch is every page of the request; when pages
    /// alternate between NICs, each NIC takes its next [`INTERLEAVED_BATCH`] pages in turn,
    /// so that no NIC waits for a whole request to be posted on another. Every request is
    /// posted exactly once; in which order does not matter (delivery is unordered). (The
    /// reference [`batch`](Self::batch) is tested against: the dispatch core walks the same
    /// batches one at a time.)
    #[cfg(test)]
    pub(crate) fn for_each_batch(&self, mut post: impl FnMut(&RdmaWork, &[Shift])) {
        let n = self.plans.len();
        if n == 1 {
            for op in &self.plans[0] {
                post(op, &self.offsets);
            }
            return;
        }
        let mut batch = [Shift::default(); INTERLEAVED_BATCH];
        // Blocks start at multiples of `n`: page `start + k + j·n` uses plan `k`.
        for block in self.offsets.chunks(INTERLEAVED_BATCH * n) {
            for (k, plan) in self.plans.iter().enumerate() {
                let mut len = 0;
                for &shift in block.iter().skip(k).step_by(n) {
                    batch[len] = shift;
                    len += 1;
                }
                if len == 0 {
                    continue;
                }
                for op in plan {
                    post(op, &batch[..len]);
                }
            }
        }
    }
}

/// Where a paged request's posting stands: the batch [`PagedWork::batch`] returns next, and
/// how many of its pages were handed out already (posted, failed or queued).
#[derive(Debug, Default, Clone, Copy, PartialEq, Eq)]
pub(crate) struct PageCursor {
    /// First page of the current block (always 0 with one NIC).
    block: usize,
    /// The plan (starting NIC) within the block.
    plan: usize,
    /// The operation within the plan.
    op: usize,
    /// Pages of the current batch already handed out.
    pub(crate) done: usize,
}

impl PageCursor {
    /// On to the next batch.
    pub(crate) fn advance(&mut self) {
        self.op += 1;
        self.done = 0;
    }
}

/// Pages per batch when a paged request's pages alternate between NICs.
pub(crate) const INTERLEAVED_BATCH: usize = 32;

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    fn work(nic: usize, local_addr: u64, remote_addr: u64, len: u64) -> RdmaWork {
        RdmaWork {
            op: RdmaOp::Write { imm: None },
            nic,
            peer: NetAddr::new(&[nic as u8 + 1; 4]).unwrap(),
            local_addr,
            local_key: 10 + nic as u64,
            remote_addr,
            remote_key: 20 + nic as u64,
            remote_base: 0,
            len,
        }
    }

    proptest! {
        /// A paged request yields exactly what listing every page's requests one by one would
        /// (the form it replaced), and counts them alike.
        #[test]
        fn a_paged_request_expands_to_its_pages_listed_one_by_one(
            pages in proptest::collection::vec((0u64..1 << 20, 0u64..1 << 20).prop_map(|(l, r)| Shift::new(l, r)), 0..200),
            chunks_per_plan in proptest::collection::vec(0usize..3, 1..5),
        ) {
            let plans: Vec<Ops> = chunks_per_plan
                .iter()
                .enumerate()
                .map(|(k, &c)| (0..c).map(|j| work(k, 100 * j as u64, 1000 + 100 * j as u64, 100)).collect())
                .collect();
            let listed: Vec<RdmaWork> = pages
                .iter()
                .enumerate()
                .flat_map(|(i, &shift)| plans[i % plans.len()].iter().map(move |w| w.shifted(shift)))
                .collect();
            let paged = PagedWork { plans: plans.clone(), offsets: pages };
            let mut posted = Vec::new();
            let mut batches = Vec::new();
            paged.for_each_batch(|w, shifts| {
                batches.push(shifts.len());
                posted.extend(shifts.iter().map(|&s| (w.clone(), s)));
            });
            // Every request exactly once (the order within a request does not matter).
            let mut expanded: Vec<RdmaWork> = posted.iter().map(|(w, s)| w.shifted(*s)).collect();
            let key = |w: &RdmaWork| (w.nic, w.local_addr, w.remote_addr);
            expanded.sort_by_key(key);
            let mut sorted = listed.clone();
            sorted.sort_by_key(key);
            prop_assert_eq!(&expanded, &sorted);
            // With more than one NIC no batch is longer than the interleaving allows.
            if plans.len() > 1 {
                prop_assert!(batches.iter().all(|&len| len <= INTERLEAVED_BATCH));
            }
            prop_assert_eq!(paged.shapes().map(|(_, uses)| uses).sum::<u64>(), listed.len() as u64);
            // The shapes stand for every request: per NIC, as many and as many bytes.
            for nic in 0..plans.len() {
                let (n, bytes) = paged
                    .shapes()
                    .filter(|(w, _)| w.nic == nic)
                    .fold((0, 0), |(n, b), (w, uses)| (n + uses, b + uses * w.len));
                let on_nic = listed.iter().filter(|w| w.nic == nic);
                prop_assert_eq!((n, bytes), (on_nic.clone().count() as u64, on_nic.map(|w| w.len).sum::<u64>()));
            }
            // The cursor walks the same batches one at a time.
            let mut walked = Vec::new();
            let (mut cursor, mut scratch) = (PageCursor::default(), [Shift::default(); INTERLEAVED_BATCH]);
            while let Some((w, shifts)) = paged.batch(&mut cursor, &mut scratch) {
                walked.extend(shifts.iter().map(|&s| (w.clone(), s)));
                cursor.advance();
            }
            prop_assert_eq!(&walked, &posted);
            // A shifted request is what the Domain sees.
            for (w, s) in &posted {
                let moved = w.shifted(*s);
                prop_assert_eq!(w.request(7, *s), moved.request(7, Shift::default()));
                prop_assert_eq!(w.request(7, Shift::default()).shifted(*s), moved.request(7, Shift::default()));
            }
        }
    }
}
