use crate::PlanError;

/// The fixed shape of a deployment: what every rank allocates once and every step reuses.
///
/// Regions are addressed in bytes from the start of one *buffer set*; set `s` of a region of
/// `n` bytes per set starts at `s × n` (two sets).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Layout {
    /// Ranks of the expert-parallel group.
    pub ranks: u32,
    /// Physical experts on each rank (EPLB replicas included).
    pub experts_per_rank: u32,
    /// Slots per token (`top_k`).
    pub top_k: u32,
    /// Most tokens one rank dispatches in a step.
    pub max_tokens: u32,
    /// Bytes of one dispatched row (a token's hidden state, scales included). On the wire each
    /// row is followed by its route record ([`route_bytes`](Self::route_bytes)).
    pub row_bytes: u64,
    /// Bytes of one combined row (an expert's output; differs from `row_bytes` when dispatch
    /// is quantized, e.g. fp8 rows with scales out, bf16 back).
    pub combine_row_bytes: u64,
    /// Bytes of one per-(token, rank) partial sum, which combine returns instead of one row
    /// per (token, expert) when the source gave its weights at dispatch (fp32 values:
    /// `4 × hidden`); 0: combine is per (token, expert) only and no weights travel.
    pub partial_row_bytes: u64,
    /// Rows (one per token) each source may write into its own slot at each receiver before
    /// the counts land (`max_tokens` holds any routing).
    pub private_rows: u32,
    /// Rows each receiver shares among its sources beyond their private slots.
    pub overflow_rows: u32,
}

/// Header bytes are rounded up to this, so the rows after them stay aligned.
pub(crate) const HEADER_ALIGN: u64 = 64;
/// The header's fixed words: magic, epoch, source, ranks, experts per rank, top-k, the
/// membership digest, flags and padding.
pub(crate) const HEADER_FIXED: u64 = 40;
/// Route records are rounded up to this, so the rows after them stay aligned.
pub(crate) const ROUTE_ALIGN: u64 = 16;
/// A route record's entry for a slot routed elsewhere.
pub const ROUTE_NONE: u16 = u16::MAX;
/// Buffer sets, alternating by step.
pub const SETS: u32 = 2;

impl Layout {
    /// A layout with room for any routing: every row a source can send to a receiver fits its
    /// private slot (`max_tokens`: one row per token), no overflow.
    pub fn worst_case(
        ranks: u32,
        experts_per_rank: u32,
        top_k: u32,
        max_tokens: u32,
        row_bytes: u64,
    ) -> Self {
        Self {
            ranks,
            experts_per_rank,
            top_k,
            max_tokens,
            row_bytes,
            combine_row_bytes: row_bytes,
            partial_row_bytes: 0,
            private_rows: max_tokens,
            overflow_rows: 0,
        }
    }

    /// Checks that every size is positive and every region's byte count fits `u64`.
    pub fn validate(&self) -> Result<(), PlanError> {
        let bad = |m: &str| Err(PlanError::Layout(m.into()));
        if self.ranks == 0 || self.ranks > crate::imm::MAX_RANKS {
            return bad("ranks must be in 1..=16384");
        }
        if self.experts_per_rank == 0
            || self.experts_per_rank >= u32::from(ROUTE_NONE)
            || self.top_k == 0
            || self.row_bytes == 0
            || self.combine_row_bytes == 0
        {
            return bad(
                "experts_per_rank (below 65535), top_k, row_bytes and combine_row_bytes must be positive",
            );
        }
        let wire = u128::from(self.row_bytes) + u128::from(self.route_bytes());
        let back = u128::from(self.combine_row_bytes.max(self.partial_row_bytes));
        let total = u128::from(self.ranks) * self.slot_bytes_wide()
            + u128::from(self.overflow_rows) * wire
            + u128::from(self.max_tokens) * u128::from(self.ranks) * wire
            + u128::from(self.max_tokens) * u128::from(self.top_k) * back
            + self.receive_capacity_wide() * u128::from(self.top_k) * back
            + u128::from(self.ranks) * u128::from(self.header_bytes());
        if total * u128::from(SETS) > u128::from(u64::MAX / 4) {
            return bad("regions too large");
        }
        Ok(())
    }

    fn receive_capacity_wide(&self) -> u128 {
        u128::from(self.ranks) * u128::from(self.private_rows) + u128::from(self.overflow_rows)
    }

    fn slot_bytes_wide(&self) -> u128 {
        u128::from(self.header_bytes())
            + u128::from(self.private_rows)
                * (u128::from(self.row_bytes) + u128::from(self.route_bytes()))
    }

    /// Bytes of a count header: fixed words, then per rank two `u32`s (rows, routed slots),
    /// rounded up to 64 bytes.
    pub fn header_bytes(&self) -> u64 {
        let raw = HEADER_FIXED + 8 * u64::from(self.ranks);
        raw.div_ceil(HEADER_ALIGN) * HEADER_ALIGN
    }

    /// Bytes of a row's route record: for each of its `top_k` slots a little-endian `u16`,
    /// the local expert at the receiver or [`ROUTE_NONE`]; then, when partial sums are
    /// enabled (`partial_row_bytes > 0`), each slot's weight as a little-endian `f32` (zero
    /// when the source gave none); rounded up to 16 bytes.
    pub fn route_bytes(&self) -> u64 {
        let weights = if self.partial_row_bytes > 0 { 4 } else { 0 };
        ((2 + weights) * u64::from(self.top_k)).div_ceil(ROUTE_ALIGN) * ROUTE_ALIGN
    }

    /// Bytes of a row on the wire: the row, then its route record.
    pub fn wire_row_bytes(&self) -> u64 {
        self.row_bytes + self.route_bytes()
    }

    /// Bytes of one source's slot at a receiver: its header, then its private rows.
    pub fn slot_bytes(&self) -> u64 {
        self.header_bytes() + u64::from(self.private_rows) * self.wire_row_bytes()
    }

    /// Byte offset of source `src`'s slot in a dispatch region (one set).
    pub fn slot_offset(&self, src: u32) -> u64 {
        u64::from(src) * self.slot_bytes()
    }

    /// Byte offset of the overflow in a dispatch region (one set).
    pub fn overflow_offset(&self) -> u64 {
        u64::from(self.ranks) * self.slot_bytes()
    }

    /// Bytes of one set of the dispatch region (slots and overflow).
    pub fn dispatch_region_bytes(&self) -> u64 {
        self.overflow_offset() + u64::from(self.overflow_rows) * self.wire_row_bytes()
    }

    /// Rows a receiver holds in all: every private slot and the overflow.
    pub fn receive_capacity(&self) -> u64 {
        u64::from(self.ranks) * u64::from(self.private_rows) + u64::from(self.overflow_rows)
    }

    /// Most rows one rank sends in a step: one per token and rank it routes to,
    /// `max_tokens × min(ranks, top_k)`.
    pub fn max_send_rows(&self) -> u64 {
        u64::from(self.max_tokens) * u64::from(self.ranks.min(self.top_k))
    }

    /// Most routed slots one rank sends in a step (`max_tokens × top_k`): each comes back as
    /// one combine row.
    pub fn max_send_slots(&self) -> u64 {
        u64::from(self.max_tokens) * u64::from(self.top_k)
    }

    /// Most routed slots a receiver holds: `top_k` per row it can hold, and no source sends
    /// more than `max_tokens` rows.
    pub fn receive_slot_capacity(&self) -> u64 {
        self.receive_capacity()
            .min(u64::from(self.ranks) * u64::from(self.max_tokens))
            * u64::from(self.top_k)
    }

    /// Bytes of one set of the dispatch send buffer: a header per peer and every row.
    pub fn send_buffer_bytes(&self) -> u64 {
        u64::from(self.ranks) * self.header_bytes() + self.max_send_rows() * self.wire_row_bytes()
    }

    /// Bytes of one set of the combine region (an output per slot this rank sent, or a
    /// partial sum per row, coming back, behind a header per peer).
    pub fn combine_region_bytes(&self) -> u64 {
        u64::from(self.ranks) * crate::plan::COMBINE_HEADER_BYTES
            + (self.max_send_slots() * self.combine_row_bytes)
                .max(self.max_send_rows() * self.partial_row_bytes)
    }

    /// Bytes of one set of the combine send buffer (an output per slot this rank can receive,
    /// or a partial sum per row, behind a header per source).
    pub fn combine_send_bytes(&self) -> u64 {
        let rows = self
            .receive_capacity()
            .min(u64::from(self.ranks) * u64::from(self.max_tokens));
        u64::from(self.ranks) * crate::plan::COMBINE_HEADER_BYTES
            + (self.receive_slot_capacity() * self.combine_row_bytes)
                .max(rows * self.partial_row_bytes)
    }

    /// Logical experts of the identity map (`ranks × experts_per_rank`).
    pub fn physical_experts(&self) -> u32 {
        self.ranks * self.experts_per_rank
    }
}
