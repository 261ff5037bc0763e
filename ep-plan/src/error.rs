use thiserror::Error;

/// A step that cannot be planned: the caller's input or configuration is wrong, or the
/// routing needs more room than the fixed capacity has.
#[derive(Debug, Clone, PartialEq, Eq, Error)]
#[non_exhaustive]
pub enum PlanError {
    /// The layout is not usable (zero ranks, zero-length rows, sizes past `u64`, …).
    #[error("layout: {0}")]
    Layout(String),
    /// `topk_idx` does not have `tokens × top_k` entries, or more tokens than `max_tokens`.
    #[error("routing shape: {0}")]
    Shape(String),
    /// An expert id that is neither `-1` nor a logical expert of the map.
    #[error("token {token} slot {slot}: expert {expert} is not in 0..{experts} (or -1)")]
    Expert {
        /// The token.
        token: usize,
        /// The top-k slot.
        slot: usize,
        /// The id found.
        expert: i64,
        /// How many logical experts the map has.
        experts: usize,
    },
    /// The expert map does not fit the layout (a replica on a rank past `ranks`, a logical
    /// expert without replicas).
    #[error("expert map: {0}")]
    Map(String),
    /// The rows sent to `receiver` beyond its private slots exceed its overflow: every rank
    /// sees the same count matrix, so every rank fails the step alike.
    #[error("rank {receiver} would receive {rows} rows; it holds {capacity}")]
    Capacity {
        /// The rank that would overflow.
        receiver: u32,
        /// The rows sent to it.
        rows: u64,
        /// Its private slots plus its overflow.
        capacity: u64,
    },
}

/// A count header that does not decode: the bytes came from a peer, so nothing is trusted.
#[derive(Debug, Clone, PartialEq, Eq, Error)]
#[non_exhaustive]
pub enum HeaderError {
    /// Fewer bytes than a header of this layout takes.
    #[error("header of {0} bytes is too short")]
    Short(usize),
    /// Not a header of this protocol (magic word or shape differs).
    #[error("not a dispatch header (magic {0:#x})")]
    Magic(u32),
    /// The layout it was written for differs from ours.
    #[error("header for {ranks} ranks × {experts_per_rank} experts, expected another layout")]
    Shape {
        /// Ranks it claims.
        ranks: u32,
        /// Experts per rank it claims.
        experts_per_rank: u32,
    },
    /// A header of another step or from another source than the slot it sits in.
    #[error("header of step {epoch} from rank {source_rank}, expected step {expected_epoch} from {expected_source}")]
    Stale {
        /// Epoch it carries.
        epoch: u32,
        /// Source it claims.
        source_rank: u32,
        /// The step being received.
        expected_epoch: u32,
        /// The slot's source.
        expected_source: u32,
    },
    /// A count larger than any routing could send (`max_tokens × min(top_k, experts_per_rank)`
    /// to one rank, `max_tokens × top_k` in all).
    #[error("counts out of bounds: {0}")]
    Bounds(String),
}
