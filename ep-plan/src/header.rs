use crate::layout::HEADER_FIXED;
use crate::{HeaderError, Layout};

/// "XEP2": rows per (token, rank), each with its route record (`XEP1` sent one row per
/// (token, expert) and counted them per local expert).
pub const HEADER_MAGIC: u32 = 0x5845_5032;

/// A source's count header: how many rows it sends each rank this step (one per token routed
/// there) and how many routed slots they carry. It travels in front of the private rows of
/// every dispatch A write, so every rank that holds every header knows the step's whole count
/// matrix.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Header {
    /// The step (full epoch, not truncated).
    pub epoch: u32,
    /// The rank that wrote it.
    pub source: u32,
    /// A digest of the ranks the source talked to when the step began
    /// ([`membership_digest`]): overflow is exchanged only between ranks that agree on it.
    pub membership: u64,
    /// `rows[rank]`: rows (tokens) sent to `rank`.
    pub rows: Vec<u32>,
    /// `slots[rank]`: routed slots those rows carry (each comes back as one combine row).
    pub slots: Vec<u32>,
    /// The source gave its weights at dispatch: its rows carry them, and combine returns one
    /// partial sum per row instead of one output per slot.
    pub weighted: bool,
}

/// The header flag for [`Header::weighted`].
const WEIGHTED: u32 = 1;

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
    /// Rows (tokens) for `rank`.
    pub fn rows_to(&self, rank: u32) -> u64 {
        u64::from(self.rows[rank as usize])
    }

    /// Routed slots for `rank` (what its combine write sends back, at most).
    pub fn slots_to(&self, rank: u32) -> u64 {
        u64::from(self.slots[rank as usize])
    }

    /// The header's bytes (`layout.header_bytes()` of them, little-endian words, zero padded).
    pub fn encode(&self, layout: &Layout) -> Vec<u8> {
        let mut out = Vec::with_capacity(layout.header_bytes() as usize);
        let (lo, hi) = (self.membership as u32, (self.membership >> 32) as u32);
        for w in [
            HEADER_MAGIC,
            self.epoch,
            self.source,
            layout.ranks,
            layout.experts_per_rank,
            layout.top_k,
            lo,
            hi,
            if self.weighted { WEIGHTED } else { 0 },
            0,
        ] {
            out.extend_from_slice(&w.to_le_bytes());
        }
        debug_assert_eq!(out.len() as u64, HEADER_FIXED);
        for (r, s) in self.rows.iter().zip(&self.slots) {
            out.extend_from_slice(&r.to_le_bytes());
            out.extend_from_slice(&s.to_le_bytes());
        }
        out.resize(layout.header_bytes() as usize, 0);
        out
    }

    /// Decodes the header found in `source`'s slot during step `epoch`, checking everything a
    /// peer could get wrong: magic, shape, epoch and source, and bounds on every count (at
    /// most `max_tokens` rows to a rank, each carrying 1 to `top_k` slots, at most
    /// `max_tokens × min(ranks, top_k)` rows and `max_tokens × top_k` slots in all).
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
        if word(0) != HEADER_MAGIC {
            return Err(HeaderError::Magic(word(0)));
        }
        if word(3) != layout.ranks || word(4) != layout.experts_per_rank || word(5) != layout.top_k
        {
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
        let n = layout.ranks as usize;
        let rows: Vec<u32> = (0..n).map(|i| word(fixed + 2 * i)).collect();
        let slots: Vec<u32> = (0..n).map(|i| word(fixed + 2 * i + 1)).collect();
        let k = u64::from(layout.top_k);
        for (r, (&n, &s)) in rows.iter().zip(&slots).enumerate() {
            let (n, s) = (u64::from(n), u64::from(s));
            if n > u64::from(layout.max_tokens) || s < n || s > n * k {
                return Err(HeaderError::Bounds(format!(
                    "{n} rows with {s} slots to rank {r} (at most {} rows, each 1 to {k} slots)",
                    layout.max_tokens
                )));
            }
        }
        let total = |c: &[u32]| c.iter().map(|&c| u64::from(c)).sum::<u64>();
        if total(&rows) > layout.max_send_rows() || total(&slots) > layout.max_send_slots() {
            return Err(HeaderError::Bounds(format!(
                "{} rows and {} slots in all, at most {} and {} can be sent",
                total(&rows),
                total(&slots),
                layout.max_send_rows(),
                layout.max_send_slots()
            )));
        }
        let weighted = match word(8) {
            0 => false,
            WEIGHTED if layout.partial_row_bytes > 0 => true,
            flags => {
                return Err(HeaderError::Bounds(format!(
                    "flags {flags:#x} (partial sums {})",
                    if layout.partial_row_bytes > 0 {
                        "enabled"
                    } else {
                        "disabled"
                    }
                )))
            }
        };
        let membership = u64::from(word(6)) | (u64::from(word(7)) << 32);
        Ok(Self {
            epoch,
            source,
            membership,
            rows,
            slots,
            weighted,
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
            rows: vec![1, 0, 2],
            slots: vec![2, 0, 3],
            weighted: false,
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
        let other = Layout::worst_case(3, 3, 2, 4, 16);
        assert!(matches!(
            Header::decode(
                &other,
                7,
                1,
                &Header {
                    epoch: 7,
                    source: 1,
                    membership: 5,
                    rows: vec![0; 3],
                    slots: vec![0; 3],
                    weighted: false,
                }
                .encode(&layout())
            ),
            Err(HeaderError::Shape { .. })
        ));
        // More rows than tokens, rows without slots, more slots than top-k per row, more in
        // all than a rank can send: each a bound a peer's bytes must meet.
        for (rows, slots) in [
            (vec![u32::MAX, 0, 0], vec![u32::MAX, 0, 0]),
            (vec![5, 0, 0], vec![5, 0, 0]),
            (vec![1, 0, 0], vec![0, 0, 0]),
            (vec![1, 0, 0], vec![3, 0, 0]),
            (vec![4, 4, 1], vec![8, 8, 1]),
        ] {
            let bad = Header {
                epoch: 7,
                source: 1,
                membership: 5,
                rows,
                slots,
                weighted: false,
            };
            assert!(
                matches!(
                    Header::decode(&l, 7, 1, &bad.encode(&l)),
                    Err(HeaderError::Bounds(_))
                ),
                "{bad:?}"
            );
        }
        // Weights only where the layout has room for partial sums.
        let weighted = Header {
            weighted: true,
            ..h.clone()
        };
        assert!(matches!(
            Header::decode(&l, 7, 1, &weighted.encode(&l)),
            Err(HeaderError::Bounds(_))
        ));
        let partial = Layout {
            partial_row_bytes: 32,
            ..l.clone()
        };
        assert_eq!(
            Header::decode(&partial, 7, 1, &weighted.encode(&partial)),
            Ok(weighted)
        );
        // Zeroed memory (a slot nobody wrote) is not a header.
        assert!(matches!(
            Header::decode(&l, 0, 0, &vec![0; b.len()]),
            Err(HeaderError::Magic(0))
        ));
    }
}
