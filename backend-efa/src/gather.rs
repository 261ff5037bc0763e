//! How a paged read's pages go to libfabric: as few `fi_readmsg` calls as the provider allows
//! (pure: no FFI). Pages adjacent on both sides (a fresh cache's consecutive blocks) merge into
//! one segment; up to the provider's iovec limit of segments go in one call, each page whole
//! in one call. One call's completion settles every page it carries.
//!
//! Why: libfabric's shm moves each `fi_readmsg` through the target's command queue, so per
//! page it paid a post, a command and a completion (issue 54's MLA row: 18 KiB pages, 512 a
//! layer, at 0.21× NIXL on shared memory).

use xfer_plugin::domain::PageShift;

/// The most segments one call carries here, whatever the provider allows.
pub(crate) const MAX_SEGMENTS: usize = 4;

/// One contiguous range on both sides, as offsets from the request's own addresses.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct Segment {
    pub(crate) local: u64,
    pub(crate) remote: u64,
    pub(crate) len: u64,
}

/// What one call carries: `pages` whole pages, in `segments` (the first `count` of them).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct Gathered {
    pub(crate) pages: usize,
    pub(crate) segments: [Segment; MAX_SEGMENTS],
    pub(crate) count: usize,
}

impl Gathered {
    pub(crate) fn segments(&self) -> &[Segment] {
        &self.segments[..self.count]
    }
}

/// The next call's pages, from the front of `shifts` (pages of `page_len` bytes, non-empty):
/// at most `limit` segments (the provider's iovec limits, at least 1) and `max_len` bytes in
/// all (the provider's largest message; 0 for none). At least one page.
pub(crate) fn next_call(
    shifts: &[PageShift],
    page_len: u64,
    limit: usize,
    max_len: u64,
) -> Gathered {
    let limit = limit.clamp(1, MAX_SEGMENTS);
    let max_len = if max_len == 0 { u64::MAX } else { max_len };
    let empty = Segment {
        local: 0,
        remote: 0,
        len: 0,
    };
    let mut g = Gathered {
        pages: 0,
        segments: [empty; MAX_SEGMENTS],
        count: 0,
    };
    let mut total = 0u64;
    for shift in shifts {
        if g.pages > 0 && total.saturating_add(page_len) > max_len {
            break;
        }
        let adjacent = g.count > 0 && {
            let last = &g.segments[g.count - 1];
            last.local.checked_add(last.len) == Some(shift.local)
                && last.remote.checked_add(last.len) == Some(shift.remote)
        };
        if adjacent {
            g.segments[g.count - 1].len += page_len;
        } else if g.count < limit {
            g.segments[g.count] = Segment {
                local: shift.local,
                remote: shift.remote,
                len: page_len,
            };
            g.count += 1;
        } else {
            break;
        }
        g.pages += 1;
        total = total.saturating_add(page_len);
    }
    g
}

#[cfg(test)]
mod tests {
    use super::*;

    fn shifts(pairs: &[(u64, u64)]) -> Vec<PageShift> {
        pairs.iter().map(|&(l, r)| PageShift::new(l, r)).collect()
    }

    /// Consecutive pages on both sides are one segment, as long as the provider takes.
    #[test]
    fn adjacent_pages_merge_into_one_segment() {
        let s = shifts(&[(0, 100), (10, 110), (20, 120)]);
        let g = next_call(&s, 10, 4, 0);
        assert_eq!(g.pages, 3);
        assert_eq!(
            g.segments(),
            &[Segment {
                local: 0,
                remote: 100,
                len: 30
            }]
        );
        let g = next_call(&s, 10, 4, 25);
        assert_eq!((g.pages, g.segments()[0].len), (2, 20));
    }

    /// Adjacent on one side only is not adjacent; scattered pages take a segment each, up to
    /// the limit; the rest wait for the next call.
    #[test]
    fn scattered_pages_take_a_segment_each_up_to_the_limit() {
        let s = shifts(&[(0, 50), (10, 0), (20, 10), (30, 90), (40, 70), (50, 60)]);
        let g = next_call(&s, 10, 4, 0);
        // (10,0) and (20,10) are adjacent on both sides: one segment.
        assert_eq!(g.pages, 5);
        assert_eq!(
            g.segments(),
            &[
                Segment {
                    local: 0,
                    remote: 50,
                    len: 10
                },
                Segment {
                    local: 10,
                    remote: 0,
                    len: 20
                },
                Segment {
                    local: 30,
                    remote: 90,
                    len: 10
                },
                Segment {
                    local: 40,
                    remote: 70,
                    len: 10
                },
            ]
        );
        let g = next_call(&s[5..], 10, 4, 0);
        assert_eq!((g.pages, g.count), (1, 1));
        // A provider taking one segment a call (EFA's rma_iov_limit): merging only.
        assert_eq!(next_call(&s, 10, 1, 0).pages, 1);
        assert_eq!(next_call(&s[1..], 10, 1, 0).pages, 2);
    }

    /// A page larger than the provider's largest message still goes (the engine split it
    /// already where it must); no call is empty.
    #[test]
    fn every_call_takes_at_least_one_page() {
        let s = shifts(&[(0, 0), (100, 100)]);
        assert_eq!(next_call(&s, 100, 4, 50).pages, 1);
        assert_eq!(next_call(&s, 100, 0, 0).pages, 2);
    }

    /// Every page is carried exactly once, whole, at its own offsets, over random layouts.
    #[test]
    fn calls_cover_every_page_once_at_its_offsets() {
        let mut x = 0x2545_f491_4f6c_dd1du64;
        let mut rand = |n: u64| {
            x ^= x << 13;
            x ^= x >> 7;
            x ^= x << 17;
            x % n
        };
        for _ in 0..500 {
            let page_len = 1 + rand(64);
            let n = 1 + rand(40) as usize;
            // Runs of consecutive pages, at random places.
            let mut s = Vec::new();
            while s.len() < n {
                let (l, r) = (rand(1_000) * page_len, rand(1_000) * page_len);
                for k in 0..1 + rand(5) {
                    s.push(PageShift::new(l + k * page_len, r + k * page_len));
                }
            }
            s.truncate(n);
            let (limit, max_len) = (rand(6) as usize, rand(4) * page_len * 3);
            let mut at = 0;
            while at < s.len() {
                let g = next_call(&s[at..], page_len, limit, max_len);
                assert!(g.pages >= 1 && g.count >= 1 && g.count <= limit.clamp(1, MAX_SEGMENTS));
                let bytes: u64 = g.segments().iter().map(|s| s.len).sum();
                assert_eq!(bytes, g.pages as u64 * page_len);
                assert!(max_len == 0 || g.pages == 1 || bytes <= max_len);
                // Walk the segments page by page: they are exactly the pages taken.
                let mut page = at;
                for seg in g.segments() {
                    let mut off = 0;
                    while off < seg.len {
                        assert_eq!(s[page], PageShift::new(seg.local + off, seg.remote + off));
                        off += page_len;
                        page += 1;
                    }
                }
                assert_eq!(page, at + g.pages);
                at += g.pages;
            }
        }
    }
}
