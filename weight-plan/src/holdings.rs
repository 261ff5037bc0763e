//! Who holds what of one tensor: its distinct slices ("holdings"), each with the trainer ranks
//! holding it, checked to be disjoint, and indexed so that a parameter's piece finds the few
//! holdings it touches without scanning all of them.

use crate::error::PlanError;
use crate::layout::{Shard, Slice};
use crate::runs::{BoxCopy, Run};

/// One distinct slice of a tensor and its holders, `(rank, shard index)` sorted by rank.
#[derive(Debug)]
pub(crate) struct Holding {
    pub(crate) slice: Slice,
    pub(crate) holders: Vec<(u32, usize)>,
    /// The holder when there is one (most holdings): read inline in the hot loop, without
    /// following `holders` to the heap.
    pub(crate) single: Option<(u32, usize)>,
}

/// The holdings of one tensor.
#[derive(Debug, Default)]
pub(crate) struct TensorHoldings {
    pub(crate) holdings: Vec<Holding>,
    /// `Flat` holdings by start.
    flats: Vec<usize>,
    /// `Dim` holdings, per dimension, by start.
    dims: Vec<Vec<usize>>,
    /// `flats`' byte ranges and `dims`' index ranges, in the same order: a piece's search
    /// reads these few contiguous pairs instead of following each index to its holding (a
    /// cache miss per step, a sixth of a large plan's time).
    flat_ranges: Vec<(u64, u64)>,
    dim_ranges: Vec<Vec<(u64, u64)>>,
    /// The `Whole` holding, if any.
    whole: Option<usize>,
}

/// A tensor's shape and element size, and its byte size.
#[derive(Clone, Copy, Debug)]
pub(crate) struct Geometry<'a> {
    pub(crate) shape: &'a [u64],
    pub(crate) elem_size: u64,
    pub(crate) bytes: u64,
}

impl Geometry<'_> {
    /// A `Dim` slice as a box: its origin and extent.
    pub(crate) fn dim_box(&self, dim: usize, start: u64, end: u64) -> (Vec<u64>, Vec<u64>) {
        let mut at = vec![0; self.shape.len()];
        let mut extent = self.shape.to_vec();
        at[dim] = start;
        extent[dim] = end - start;
        (at, extent)
    }

    /// The flat-array runs of the box `at`/`extent` (sources and destinations both in the
    /// tensor's flat coordinates).
    fn flat_runs(&self, at: &[u64], extent: &[u64], out: &mut impl FnMut(Run)) {
        BoxCopy {
            extent,
            src_shape: self.shape,
            src_at: at,
            dst_shape: self.shape,
            dst_at: at,
            elem_size: self.elem_size,
        }
        .runs(out);
    }
}

fn slice_fits(slice: &Slice, g: &Geometry<'_>) -> bool {
    match *slice {
        Slice::Whole => true,
        Slice::Flat { start, end } => start <= end && end <= g.bytes,
        Slice::Dim { dim, start, end } => {
            dim < g.shape.len() && start <= end && end <= g.shape[dim]
        }
    }
}

fn is_empty(slice: &Slice, g: &Geometry<'_>) -> bool {
    g.bytes == 0
        || match *slice {
            Slice::Whole => false,
            Slice::Flat { start, end } | Slice::Dim { start, end, .. } => start == end,
        }
}

impl TensorHoldings {
    /// Groups `shards` (indices into `all`) into holdings and checks that distinct ones are
    /// disjoint. Empty slices hold nothing and are left out.
    pub(crate) fn new(
        name: &str,
        g: Geometry<'_>,
        all: &[Shard],
        shards: &[usize],
    ) -> Result<TensorHoldings, PlanError> {
        let mut by_slice: Vec<(&Slice, u32, usize)> = Vec::with_capacity(shards.len());
        for &i in shards {
            let s = &all[i];
            if !slice_fits(&s.slice, &g) {
                return Err(PlanError::BadSlice {
                    shard: i,
                    rank: s.rank,
                    tensor: name.to_owned(),
                    slice: s.slice.clone(),
                    shape: g.shape.to_vec(),
                });
            }
            if !is_empty(&s.slice, &g) {
                by_slice.push((&s.slice, s.rank, i));
            }
        }
        by_slice.sort_unstable();
        let mut t = TensorHoldings {
            dims: vec![Vec::new(); g.shape.len()],
            dim_ranges: vec![Vec::new(); g.shape.len()],
            ..TensorHoldings::default()
        };
        for (slice, rank, shard) in by_slice {
            match t.holdings.last_mut() {
                Some(h) if &h.slice == slice => {
                    // A rank listing the same slice twice holds it once.
                    if h.holders.last().map(|&(r, _)| r) != Some(rank) {
                        h.holders.push((rank, shard));
                    }
                }
                _ => t.holdings.push(Holding {
                    slice: slice.clone(),
                    holders: vec![(rank, shard)],
                    single: None,
                }),
            }
        }
        for h in &mut t.holdings {
            if let [one] = h.holders[..] {
                h.single = Some(one);
            }
        }
        // Sorting by slice put flats and each dimension's slices in order of their start.
        for (i, h) in t.holdings.iter().enumerate() {
            match h.slice {
                Slice::Whole => t.whole = Some(i),
                Slice::Flat { start, end } => {
                    t.flats.push(i);
                    t.flat_ranges.push((start, end));
                }
                Slice::Dim { dim, start, end } => {
                    t.dims[dim].push(i);
                    t.dim_ranges[dim].push((start, end));
                }
            }
        }
        t.check_disjoint(name, &g)?;
        Ok(t)
    }

    fn overlap(&self, name: &str, a: usize, b: usize) -> PlanError {
        PlanError::OverlappingShards {
            tensor: name.to_owned(),
            first: self.holdings[a].holders[0].1,
            second: self.holdings[b].holders[0].1,
        }
    }

    fn check_disjoint(&self, name: &str, g: &Geometry<'_>) -> Result<(), PlanError> {
        if let Some(w) = self.whole {
            if let Some(other) = (0..self.holdings.len()).find(|&i| i != w) {
                return Err(self.overlap(name, w, other));
            }
        }
        let range = |i: usize| match self.holdings[i].slice {
            Slice::Flat { start, end } | Slice::Dim { start, end, .. } => (start, end),
            Slice::Whole => (0, u64::MAX),
        };
        for sorted in std::iter::once(&self.flats).chain(&self.dims) {
            for w in sorted.windows(2) {
                if range(w[1]).0 < range(w[0]).1 {
                    return Err(self.overlap(name, w[0], w[1]));
                }
            }
        }
        // Slices along different dimensions always share an element; a flat range and a slab
        // share bytes when the range cuts one of the slab's rows.
        let used: Vec<&Vec<usize>> = self.dims.iter().filter(|d| !d.is_empty()).collect();
        if used.len() > 1 {
            return Err(self.overlap(name, used[0][0], used[1][0]));
        }
        if let Some(dims) = used.first().filter(|_| !self.flats.is_empty()) {
            for &d in dims.iter() {
                let Slice::Dim { dim, start, end } = self.holdings[d].slice else {
                    unreachable!("dims holds Dim slices")
                };
                let (at, extent) = g.dim_box(dim, start, end);
                let mut hit = None;
                g.flat_runs(&at, &extent, &mut |run| {
                    for &f in &self.flats {
                        let (s, e) = range(f);
                        let mut any = false;
                        run.clip(s, e, &mut |_| any = true);
                        if any && hit.is_none() {
                            hit = Some(f);
                        }
                    }
                });
                if let Some(f) = hit {
                    return Err(self.overlap(name, d, f));
                }
            }
        }
        Ok(())
    }

    /// Holdings that may share bytes with the box `at`/`extent` of the tensor.
    pub(crate) fn candidates(
        &self,
        g: &Geometry<'_>,
        at: &[u64],
        extent: &[u64],
        out: &mut Vec<usize>,
    ) {
        out.clear();
        out.extend(self.whole);
        if !self.flats.is_empty() {
            // The box lies within its first and one past its last byte.
            let stride = |j: usize| g.shape[j + 1..].iter().product::<u64>() * g.elem_size;
            let lo: u64 = (0..at.len()).map(|j| at[j] * stride(j)).sum();
            let hi: u64 = (0..at.len())
                .map(|j| (at[j] + extent[j] - 1) * stride(j))
                .sum::<u64>()
                + g.elem_size;
            let first = self.flat_ranges.partition_point(|&(_, end)| end <= lo);
            let touched = self.flat_ranges[first..]
                .iter()
                .take_while(|&&(start, _)| start < hi)
                .count();
            out.extend(&self.flats[first..first + touched]);
        }
        for (dim, (sorted, ranges)) in self.dims.iter().zip(&self.dim_ranges).enumerate() {
            if sorted.is_empty() {
                continue;
            }
            let (lo, hi) = (at[dim], at[dim] + extent[dim]);
            let first = ranges.partition_point(|&(_, end)| end <= lo);
            let touched = ranges[first..]
                .iter()
                .take_while(|&&(start, _)| start < hi)
                .count();
            out.extend(&sorted[first..first + touched]);
        }
    }
}
