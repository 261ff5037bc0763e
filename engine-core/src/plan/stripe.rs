//! Striping one contiguous write across the NICs of a DomainGroup.
//!
//! Every unit of a transfer (the single write, each page, each scatter destination) is planned
//! the same way by [`split`]:
//! 1. below `min_stripe_len`, or with one NIC, the unit stays whole on its first NIC;
//! 2. otherwise it is cut into at most `nics` parts of `ceil(len / nics)` bytes rounded up to
//!    `align` (the last part takes the remainder), part `i` going to NIC `(first + i) % nics`;
//! 3. any part longer than `max_chunk` (the smallest message limit among the backends) is cut
//!    again into `max_chunk`-sized writes on the same NIC.
//!
//! Each resulting write carries the transfer's immediate, because on an unordered transport
//! only "all chunks arrived" means "the data is there". All arithmetic is in `u64`: no length
//! is ever truncated to 32 bits.

use serde::{Deserialize, Serialize};

/// The knobs of striping. Both peers must use the same values (they come from the config).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct StripePolicy {
    /// Units shorter than this go whole to one NIC.
    pub min_stripe_len: u64,
    /// Part boundaries are multiples of this (a power of two).
    pub align: u64,
    /// No single write is longer than this.
    pub max_chunk: u64,
}

impl Default for StripePolicy {
    fn default() -> Self {
        Self {
            min_stripe_len: 64 << 10,
            align: 4096,
            max_chunk: 1 << 30,
        }
    }
}

impl StripePolicy {
    /// Checks the invariants `split` relies on; returns what is wrong.
    pub fn validate(&self) -> Result<(), String> {
        if !self.align.is_power_of_two() {
            return Err(format!(
                "stripe.align must be a power of two, not {}",
                self.align
            ));
        }
        if self.max_chunk < self.align {
            return Err(format!(
                "stripe.max_chunk ({}) must be at least stripe.align ({})",
                self.max_chunk, self.align
            ));
        }
        Ok(())
    }
}

/// One write of a planned unit: `len` bytes at `offset` within the unit, posted on NIC `nic`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Chunk {
    /// Index of the NIC within the DomainGroup.
    pub nic: usize,
    /// Offset from the start of the unit.
    pub offset: u64,
    /// Bytes in this write (zero only for a zero-length unit).
    pub len: u64,
}

/// The NIC-level parts of a unit, before `max_chunk` cutting: (offset, len) pairs.
fn parts(len: u64, nics: usize, policy: &StripePolicy) -> impl Iterator<Item = (u64, u64)> {
    let per = if nics <= 1 || len < policy.min_stripe_len {
        len.max(1)
    } else {
        let even = len.div_ceil(nics as u64);
        even.div_ceil(policy.align) * policy.align
    };
    let count = if len == 0 { 1 } else { len.div_ceil(per) };
    (0..count).map(move |i| {
        let offset = i * per;
        (offset, per.min(len - offset))
    })
}

/// How many writes a part of `len` bytes becomes.
fn writes_in_part(len: u64, policy: &StripePolicy) -> u64 {
    len.div_ceil(policy.max_chunk).max(1)
}

/// Whether [`split`] leaves a unit of `len` bytes whole on its first NIC (rule 1, within
/// `max_chunk`).
#[inline]
pub fn stays_whole(len: u64, nics: usize, policy: &StripePolicy) -> bool {
    len <= policy.max_chunk && (nics <= 1 || len < policy.min_stripe_len)
}

/// Plans one unit of `len` bytes over `nics` NICs starting at NIC `first`, appending to `out`.
///
/// `nics` must be at least 1 and `first < nics`; `policy` must have passed `validate`.
pub fn split(len: u64, nics: usize, first: usize, policy: &StripePolicy, out: &mut Vec<Chunk>) {
    debug_assert!(nics >= 1 && first < nics);
    if stays_whole(len, nics, policy) {
        // Rule 1 without the divisions: the commonest unit (a page, a small write) is whole.
        out.push(Chunk {
            nic: first,
            offset: 0,
            len,
        });
        return;
    }
    for (i, (part_offset, part_len)) in parts(len, nics, policy).enumerate() {
        let nic = (first + i) % nics;
        let writes = writes_in_part(part_len, policy);
        for w in 0..writes {
            let offset = w * policy.max_chunk;
            out.push(Chunk {
                nic,
                offset: part_offset + offset,
                len: policy.max_chunk.min(part_len - offset),
            });
        }
    }
}

/// The shape of what a receiver is sent, as far as counting arrivals is concerned.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum TransferShape<'a> {
    /// One `submit_single_write` of `len` bytes.
    Single {
        /// Bytes written.
        len: u64,
    },
    /// One `submit_paged_writes` of `pages` pages of `page_len` bytes.
    Paged {
        /// Bytes per page.
        page_len: u64,
        /// Number of pages.
        pages: u64,
    },
    /// The destinations of one `submit_scatter` that land on this receiver, by length.
    Scatter {
        /// Length of each destination aimed at this receiver.
        lens: &'a [u64],
    },
    /// One `submit_barrier` (one zero-byte write per peer).
    Barrier,
}

impl TransferShape<'_> {
    /// The arrivals of this shape when each unit of `len` bytes (the single write, a page, a
    /// scatter destination) becomes `writes(len)` writes; a barrier is one zero-byte write.
    pub fn arrivals(self, writes: impl Fn(u64) -> u64) -> u64 {
        match self {
            TransferShape::Single { len } => writes(len),
            TransferShape::Paged { page_len, pages } => pages * writes(page_len),
            TransferShape::Scatter { lens } => lens.iter().map(|&len| writes(len)).sum(),
            TransferShape::Barrier => 1,
        }
    }
}

/// How many immediates a receiver counts for a transfer of `shape`, sent by a peer with `nics`
/// NICs and `policy`: the `n` to pass to `expect_imm_count`.
pub fn expected_arrivals(shape: TransferShape<'_>, nics: usize, policy: &StripePolicy) -> u64 {
    shape.arrivals(|len| {
        parts(len, nics, policy)
            .map(|(_, part_len)| writes_in_part(part_len, policy))
            .sum()
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    fn plan(len: u64, nics: usize, first: usize, policy: &StripePolicy) -> Vec<Chunk> {
        let mut out = Vec::new();
        split(len, nics, first, policy, &mut out);
        out
    }

    #[test]
    fn small_writes_stay_whole_on_the_first_nic() {
        let p = StripePolicy::default();
        assert_eq!(
            plan(100, 4, 2, &p),
            vec![Chunk {
                nic: 2,
                offset: 0,
                len: 100
            }]
        );
        assert_eq!(
            plan(0, 4, 3, &p),
            vec![Chunk {
                nic: 3,
                offset: 0,
                len: 0
            }]
        );
    }

    #[test]
    fn large_writes_are_split_evenly_on_aligned_boundaries_from_the_first_nic() {
        let p = StripePolicy::default();
        let c = plan(1 << 20, 4, 1, &p);
        let nics: Vec<_> = c.iter().map(|c| c.nic).collect();
        assert_eq!(nics, vec![1, 2, 3, 0]);
        assert!(c
            .iter()
            .all(|c| c.len == 256 << 10 && c.offset % p.align == 0));
        // An uneven length: the remainder goes to the last part, nothing is dropped.
        let c = plan((1 << 20) + 5, 4, 0, &p);
        assert_eq!(c.iter().map(|c| c.len).sum::<u64>(), (1 << 20) + 5);
    }

    #[test]
    fn lengths_past_four_gib_are_not_truncated() {
        let p = StripePolicy::default();
        let len = (5u64 << 30) + 3;
        let c = plan(len, 2, 0, &p);
        assert_eq!(c.iter().map(|c| c.len).sum::<u64>(), len);
        assert!(c.iter().all(|c| c.len <= p.max_chunk));
        assert_eq!(
            c.len() as u64,
            expected_arrivals(TransferShape::Single { len }, 2, &p)
        );
    }

    fn policy() -> impl Strategy<Value = StripePolicy> {
        (0u64..1 << 16, 0u32..14, 0u32..6).prop_map(|(min, align_log, extra_log)| {
            let align = 1u64 << align_log;
            StripePolicy {
                min_stripe_len: min,
                align,
                max_chunk: align << extra_log,
            }
        })
    }

    proptest! {
        #[test]
        fn every_byte_is_covered_exactly_once_and_arrivals_match(
            len in 0u64..1 << 22, nics in 1usize..=4, first_seed in 0usize..4, policy in policy(),
        ) {
            let first = first_seed % nics;
            let chunks = plan(len, nics, first, &policy);
            let mut next = 0;
            for c in &chunks {
                prop_assert_eq!(c.offset, next, "chunks must tile the unit in order");
                prop_assert!(c.nic < nics);
                prop_assert!(c.len <= policy.max_chunk);
                prop_assert!(c.len > 0 || len == 0);
                next += c.len;
            }
            prop_assert_eq!(next, len);
            prop_assert_eq!(chunks.len() as u64,
                expected_arrivals(TransferShape::Single { len }, nics, &policy));
            prop_assert_eq!(chunks[0].nic, first);
            // The shortcut agrees with the plan: whole means one chunk covering the unit.
            let whole = chunks.len() == 1 && chunks[0].len == len;
            prop_assert_eq!(stays_whole(len, nics, &policy), whole);
        }
    }
}
