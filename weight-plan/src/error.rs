//! Why a layout cannot be planned: each variant names the tensor, shard or parameter at fault.

use crate::layout::Slice;

/// A layout the plan refuses. Every variant is a mistake in the caller's description (the
/// plan has no other way to fail).
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[non_exhaustive]
pub enum PlanError {
    /// Two tensors share a name.
    #[error("tensor {name:?} is listed twice")]
    DuplicateTensor {
        /// The name.
        name: String,
    },
    /// A tensor with elements of zero bytes, more than eight dimensions, or a byte size that
    /// does not fit in 64 bits.
    #[error(
        "tensor {name:?}: element size {elem_size} with shape {shape:?} is not a tensor the plan takes (at most 8 dimensions, elements of at least a byte, under 2^64 bytes)"
    )]
    BadTensor {
        /// The tensor.
        name: String,
        /// Its shape.
        shape: Vec<u64>,
        /// Its element size.
        elem_size: u64,
    },
    /// A shard or a piece names a tensor that is not in the layout.
    #[error("{user} names tensor {name:?}, which the layout does not list")]
    UnknownTensor {
        /// The tensor's name.
        name: String,
        /// Who named it ("shard 3", "parameter 7 (rank 1, qkv_proj)").
        user: String,
    },
    /// A shard's slice reaches past its tensor, names a dimension it lacks, or is empty.
    #[error(
        "shard {shard} (rank {rank}) of {tensor:?}: slice {slice:?} is not inside shape {shape:?}"
    )]
    BadSlice {
        /// Index into `Layout::shards`.
        shard: usize,
        /// Its rank.
        rank: u32,
        /// The tensor.
        tensor: String,
        /// The slice.
        slice: Slice,
        /// The tensor's shape.
        shape: Vec<u64>,
    },
    /// Two different slices of one tensor share bytes: replicas must hold equal slices, so
    /// that each byte has one set of holders to choose a sender from.
    #[error("shards {first} and {second} of {tensor:?} overlap without being the same slice")]
    OverlappingShards {
        /// The tensor.
        tensor: String,
        /// Indices into `Layout::shards`.
        first: usize,
        /// Indices into `Layout::shards`.
        second: usize,
    },
    /// A piece's selection or placement does not fit its tensor or parameter.
    #[error("parameter {param} ({name:?} on rank {rank}), piece {piece}: {reason}")]
    BadPiece {
        /// Index into `Layout::params`.
        param: usize,
        /// The parameter's name.
        name: String,
        /// Its rank.
        rank: u32,
        /// Index into its pieces.
        piece: usize,
        /// What does not fit.
        reason: String,
    },
    /// Two pieces of a parameter overlap: some bytes would be written twice.
    #[error("parameter {param} ({name:?} on rank {rank}): pieces {first} and {second} overlap")]
    OverlappingPieces {
        /// Index into `Layout::params`.
        param: usize,
        /// The parameter's name.
        name: String,
        /// Its rank.
        rank: u32,
        /// Indices into its pieces.
        first: usize,
        /// Indices into its pieces.
        second: usize,
    },
    /// A parameter's pieces leave some of it unwritten.
    #[error(
        "parameter {param} ({name:?} on rank {rank}): pieces cover {covered} of its {size} bytes"
    )]
    Uncovered {
        /// Index into `Layout::params`.
        param: usize,
        /// The parameter's name.
        name: String,
        /// Its rank.
        rank: u32,
        /// Bytes the pieces cover.
        covered: u64,
        /// Bytes it has.
        size: u64,
    },
    /// Part of a tensor that a parameter needs is held by no trainer rank.
    #[error("parameter {param} ({name:?} on rank {rank}) needs {missing} bytes of {tensor:?} that no trainer rank holds")]
    NotHeld {
        /// Index into `Layout::params`.
        param: usize,
        /// The parameter's name.
        name: String,
        /// Its rank.
        rank: u32,
        /// The tensor.
        tensor: String,
        /// How many bytes are missing.
        missing: u64,
    },
}
