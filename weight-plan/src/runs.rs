//! Strided runs: `count` rows of `len` bytes, row `i` read at `src + i * src_stride` and
//! written at `dst + i * dst_stride` — what a box of one row-major array placed in another
//! becomes, and what an RDMA paged write carries.

/// The most dimensions a tensor or parameter may have.
pub(crate) const MAX_DIMS: usize = 8;

/// A strided copy; every row is contiguous on both sides.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) struct Run {
    pub(crate) src: u64,
    pub(crate) dst: u64,
    pub(crate) len: u64,
    pub(crate) count: u64,
    pub(crate) src_stride: u64,
    pub(crate) dst_stride: u64,
}

impl Run {
    pub(crate) fn contiguous(src: u64, dst: u64, len: u64) -> Run {
        Run {
            src,
            dst,
            len,
            count: 1,
            src_stride: len,
            dst_stride: len,
        }
    }

    pub(crate) fn bytes(&self) -> u64 {
        self.len * self.count
    }

    /// Rows `from..to` of this run.
    fn rows(&self, from: u64, to: u64) -> Run {
        Run {
            src: self.src + from * self.src_stride,
            dst: self.dst + from * self.dst_stride,
            count: to - from,
            ..*self
        }
    }

    /// Bytes `from..to` of row `row`.
    fn part_of_row(&self, row: u64, from: u64, to: u64) -> Run {
        Run::contiguous(
            self.src + row * self.src_stride + from,
            self.dst + row * self.dst_stride + from,
            to - from,
        )
    }

    /// The first `n` bytes (0 < n < bytes) and the rest, in row order, each as at most two runs.
    pub(crate) fn split(&self, n: u64, head: &mut Vec<Run>, tail: &mut Vec<Run>) {
        debug_assert!(0 < n && n < self.bytes());
        let (full, rem) = (n / self.len, n % self.len);
        if full > 0 {
            head.push(self.rows(0, full));
        }
        if rem > 0 {
            head.push(self.part_of_row(full, 0, rem));
            tail.push(self.part_of_row(full, rem, self.len));
            if full + 1 < self.count {
                tail.push(self.rows(full + 1, self.count));
            }
        } else {
            tail.push(self.rows(full, self.count));
        }
    }

    /// The bytes of this run whose source lies in `start..end`, with sources made relative to
    /// `start` (the run's sources are in a flat array's coordinates; `start..end` is a flat
    /// shard of it). At most three runs: a partial first row, whole rows, a partial last row.
    pub(crate) fn clip(&self, start: u64, end: u64, out: &mut impl FnMut(Run)) {
        let rel = |mut r: Run| {
            r.src -= start;
            r
        };
        if start >= end {
            return;
        }
        let row_start = |i: u64| self.src + i * self.src_stride;
        // Rows that reach past `start`, and rows that begin before `end`.
        let first = if start < self.src + self.len {
            0
        } else {
            (start - self.src - self.len) / self.src_stride + 1
        };
        let last = if end <= self.src {
            0
        } else {
            (end - self.src).div_ceil(self.src_stride).min(self.count)
        };
        if first >= last {
            return;
        }
        let clip_row = |i: u64| {
            let lo = start.max(row_start(i)) - row_start(i);
            let hi = end.min(row_start(i) + self.len) - row_start(i);
            (lo, hi)
        };
        let mut whole_from = first;
        let mut whole_to = last;
        let (lo, hi) = clip_row(first);
        if lo > 0 || hi < self.len {
            out(rel(self.part_of_row(first, lo, hi)));
            whole_from = first + 1;
        }
        if last > whole_from {
            let (lo, hi) = clip_row(last - 1);
            if lo > 0 || hi < self.len {
                whole_to = last - 1;
                out(rel(self.part_of_row(last - 1, lo, hi)));
            }
        }
        if whole_to > whole_from {
            let mid = self.rows(whole_from, whole_to);
            out(rel(mid));
        }
    }
}

/// A box of one row-major array copied into another, as strided runs.
pub(crate) struct BoxCopy<'a> {
    /// The box's extent, one entry per dimension.
    pub(crate) extent: &'a [u64],
    /// The source array's shape and the box's origin in it.
    pub(crate) src_shape: &'a [u64],
    pub(crate) src_at: &'a [u64],
    /// The destination array's shape and the box's origin in it.
    pub(crate) dst_shape: &'a [u64],
    pub(crate) dst_at: &'a [u64],
    pub(crate) elem_size: u64,
}

impl BoxCopy<'_> {
    /// The runs, in row-major order of the box. The innermost dimensions that the box spans
    /// fully on both sides join one contiguous row; the next dimension out becomes the run's
    /// stride; any further ones are enumerated, one run each.
    pub(crate) fn runs(&self, out: &mut impl FnMut(Run)) {
        let n = self.extent.len();
        debug_assert!(self.src_shape.len() == n && self.dst_shape.len() == n);
        if self.extent.contains(&0) {
            return;
        }
        let full =
            |j: usize| self.extent[j] == self.src_shape[j] && self.extent[j] == self.dst_shape[j];
        // k: the outermost dimension of a contiguous row.
        let mut k = n.saturating_sub(1);
        while k > 0 && full(k) {
            k -= 1;
        }
        // Element strides of each array.
        let strides = |shape: &[u64]| {
            let mut s = [self.elem_size; MAX_DIMS];
            for j in (0..n.saturating_sub(1)).rev() {
                s[j] = s[j + 1] * shape[j + 1];
            }
            s
        };
        let (ss, ds) = (strides(self.src_shape), strides(self.dst_shape));
        let origin = |at: &[u64], st: &[u64]| at.iter().zip(st).map(|(a, s)| a * s).sum::<u64>();
        let (src0, dst0) = (origin(self.src_at, &ss), origin(self.dst_at, &ds));
        if n == 0 {
            return out(Run::contiguous(0, 0, self.elem_size));
        }
        let len = self.extent[k..].iter().product::<u64>() * self.elem_size;
        if k == 0 {
            return out(Run::contiguous(src0, dst0, len));
        }
        let (count, src_stride, dst_stride) = (self.extent[k - 1], ss[k - 1], ds[k - 1]);
        // Odometer over dimensions 0..k-1.
        let outer = k - 1;
        let mut idx = [0u64; MAX_DIMS];
        loop {
            let (mut s, mut d) = (src0, dst0);
            for j in 0..outer {
                s += idx[j] * ss[j];
                d += idx[j] * ds[j];
            }
            out(Run {
                src: s,
                dst: d,
                len,
                count,
                src_stride,
                dst_stride,
            });
            let mut j = outer;
            loop {
                if j == 0 {
                    return;
                }
                j -= 1;
                idx[j] += 1;
                if idx[j] < self.extent[j] {
                    break;
                }
                idx[j] = 0;
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn expand(r: &Run) -> Vec<(u64, u64)> {
        (0..r.count)
            .flat_map(|i| {
                (0..r.len)
                    .map(move |b| (r.src + i * r.src_stride + b, r.dst + i * r.dst_stride + b))
            })
            .collect()
    }

    #[test]
    fn clip_keeps_exactly_the_bytes_inside() {
        let run = Run {
            src: 3,
            dst: 100,
            len: 4,
            count: 5,
            src_stride: 10,
            dst_stride: 6,
        };
        for start in 0..60 {
            for end in start..60 {
                let mut got = Vec::new();
                run.clip(start, end, &mut |r| {
                    assert!(r.count > 0 && r.len > 0);
                    got.extend(expand(&r).into_iter().map(|(s, d)| (s + start, d)));
                });
                got.sort_unstable();
                let mut want: Vec<_> = expand(&run)
                    .into_iter()
                    .filter(|&(s, _)| s >= start && s < end)
                    .collect();
                want.sort_unstable();
                assert_eq!(got, want, "clip to {start}..{end}");
            }
        }
    }

    #[test]
    fn split_divides_in_row_order() {
        let run = Run {
            src: 0,
            dst: 7,
            len: 3,
            count: 4,
            src_stride: 5,
            dst_stride: 3,
        };
        for n in 1..run.bytes() {
            let (mut head, mut tail) = (Vec::new(), Vec::new());
            run.split(n, &mut head, &mut tail);
            let h: Vec<_> = head.iter().flat_map(expand).collect();
            let t: Vec<_> = tail.iter().flat_map(expand).collect();
            assert_eq!(h.len() as u64, n);
            assert_eq!([h, t].concat(), expand(&run));
        }
    }

    #[test]
    fn a_column_slab_is_one_strided_run() {
        // Columns 2..5 of a 4x8 matrix into a 4x3 one.
        let mut runs = Vec::new();
        BoxCopy {
            extent: &[4, 3],
            src_shape: &[4, 8],
            src_at: &[0, 2],
            dst_shape: &[4, 3],
            dst_at: &[0, 0],
            elem_size: 2,
        }
        .runs(&mut |r| runs.push(r));
        assert_eq!(
            runs,
            [Run {
                src: 4,
                dst: 0,
                len: 6,
                count: 4,
                src_stride: 16,
                dst_stride: 6
            }]
        );
    }
}
