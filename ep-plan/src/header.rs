use crate::layout::HEADER_FIXED;
use crate::{HeaderError, Layout};

const MAGIC: u32 = 0x5845_5031; // "XEP1"

/// A source's count header: how many rows it sends each rank, per local expert, this step.
/// It travels in front of the private rows of every dispatch A write, so every rank that holds
/// every header knows the step's whole count matrix.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Header {
    /// The step (full epoch, not truncated).
    pub epoch: u32,
    /// The rank that wrote it.
    pub source: u32,
    /// A digest of the ranks the source talked to when the step began
    /// ([`membership_digest`]): overflow is exchanged only between ranks that agree on it.
    pub membership: u64,
    /// `counts[rank × experts_per_rank + local_expert]`.
    pub counts: Vec<u32>,
}

/// A digest (FNV-1a) of a membership: which ranks are active.
pub fn membership_digest(active: &[bool]) -> u64 {
    let mut h: u64 = 0xcbf2_9ce4_8422_2325;
    for &a in active {
        h ^= u64::from(a) + 1;
        h = h.wrapping_mul(0x0000_0100_0000_01b3);
    }
    h
}

impl Header {
    /// Rows for `rank` (all its local experts).
    pub fn rows_to(&self, layout: &Layout, rank: u32) -> u64 {
        let e = layout.experts_per_rank as usize;
        let r = rank as usize;
        self.counts[r * e..(r + 1) * e]
            .iter()
            .map(|&c| u64::from(c))
            .sum()
    }

    /// Rows for `rank`'s local expert `expert`.
    pub fn count(&self, layout: &Layout, rank: u32, expert: u32) -> u32 {
        self.counts[(rank * layout.experts_per_rank + expert) as usize]
    }

    /// The header's bytes (`layout.header_bytes()` of them, little-endian words, zero padded).
    pub fn encode(&self, layout: &Layout) -> Vec<u8> {
        let mut out = Vec::with_capacity(layout.header_bytes() as usize);
        let (lo, hi) = (self.membership as u32, (self.membership >> 32) as u32);
        for w in [
            MAGIC,
            self.epoch,
            self.source,
            layout.ranks,
            layout.experts_per_rank,
            0,
            lo,
            hi,
        ] {
            out.extend_from_slice(&w.to_le_bytes());
        }
        debug_assert_eq!(out.len() as u64, HEADER_FIXED);
        for c in &self.counts {
            out.extend_from_slice(&c.to_le_bytes());
        }
        out.resize(layout.header_bytes() as usize, 0);
        out
    }

    /// Decodes the header found in `source`'s slot during step `epoch`, checking everything a
    /// peer could get wrong: magic, shape, epoch and source, and bounds on every count (no
    /// more rows than `max_tokens × top_k` in all).
    pub fn decode(
        layout: &Layout,
        epoch: u32,
        source: u32,
        bytes: &[u8],
    ) -> Result<Self, HeaderError> {
        let need = layout.header_bytes() as usize;
        if bytes.len() < need {
            return Err(HeaderError::Short(bytes.len()));
        }
        let word = |i: usize| {
            u32::from_le_bytes([
                bytes[4 * i],
                bytes[4 * i + 1],
                bytes[4 * i + 2],
                bytes[4 * i + 3],
            ])
        };
        if word(0) != MAGIC {
            return Err(HeaderError::Magic(word(0)));
        }
        if word(3) != layout.ranks || word(4) != layout.experts_per_rank {
            return Err(HeaderError::Shape {
                ranks: word(3),
                experts_per_rank: word(4),
            });
        }
        if word(1) != epoch || word(2) != source {
            return Err(HeaderError::Stale {
                epoch: word(1),
                source_rank: word(2),
                expected_epoch: epoch,
                expected_source: source,
            });
        }
        let fixed = (HEADER_FIXED / 4) as usize;
        let n = (layout.ranks * layout.experts_per_rank) as usize;
        let counts: Vec<u32> = (0..n).map(|i| word(fixed + i)).collect();
        let total: u64 = counts.iter().map(|&c| u64::from(c)).sum();
        if total > layout.max_send_rows() {
            return Err(HeaderError::Bounds(format!(
                "{total} rows in all, at most {} can be sent",
                layout.max_send_rows()
            )));
        }
        let membership = u64::from(word(6)) | (u64::from(word(7)) << 32);
        Ok(Self {
            epoch,
            source,
            membership,
            counts,
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn layout() -> Layout {
        Layout::worst_case(3, 2, 2, 4, 16)
    }

    #[test]
    fn round_trips_and_rejects_what_a_peer_could_get_wrong() {
        let l = layout();
        let h = Header {
            epoch: 7,
            source: 1,
            membership: 5,
            counts: vec![1, 0, 2, 1, 0, 3],
        };
        let b = h.encode(&l);
        assert_eq!(b.len() as u64, l.header_bytes());
        assert_eq!(Header::decode(&l, 7, 1, &b), Ok(h.clone()));
        assert_eq!(
            Header::decode(&l, 7, 1, &b[..10]),
            Err(HeaderError::Short(10))
        );
        assert!(matches!(
            Header::decode(&l, 9, 1, &b),
            Err(HeaderError::Stale { .. })
        ));
        assert!(matches!(
            Header::decode(&l, 7, 2, &b),
            Err(HeaderError::Stale { .. })
        ));
        let mut bad = b.clone();
        bad[0] ^= 1;
        assert!(matches!(
            Header::decode(&l, 7, 1, &bad),
            Err(HeaderError::Magic(_))
        ));
        let other = Layout::worst_case(2, 3, 2, 4, 16);
        assert!(matches!(
            Header::decode(
                &other,
                7,
                1,
                &Header {
                    epoch: 7,
                    source: 1,
                    membership: 5,
                    counts: vec![0; 6]
                }
                .encode(&layout())
            ),
            Err(HeaderError::Shape { .. })
        ));
        let huge = Header {
            epoch: 7,
            source: 1,
            membership: 5,
            counts: vec![u32::MAX, 0, 0, 0, 0, 1],
        };
        assert!(matches!(
            Header::decode(&l, 7, 1, &huge.encode(&l)),
            Err(HeaderError::Bounds(_))
        ));
        // Zeroed memory (a slot nobody wrote) is not a header.
        assert!(matches!(
            Header::decode(&l, 0, 0, &vec![0; b.len()]),
            Err(HeaderError::Magic(0))
        ));
    }
}
