//! What the caller describes: the model's tensors, which part of each one every trainer rank
//! holds, and which parameters every inference rank has, each assembled from pieces of tensors.

/// One tensor of the model as the trainer defines it (full shape, before any sharding).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Tensor {
    /// Its name (unique).
    pub name: String,
    /// Its full shape, row-major.
    pub shape: Vec<u64>,
    /// Bytes per element as sent (after any transform the sender applies).
    pub elem_size: u64,
}

/// Which part of a tensor a trainer rank holds. The rank's shard buffer holds that part
/// contiguously, row-major.
#[derive(Clone, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub enum Slice {
    /// The whole tensor (an unsharded or replicated parameter).
    Whole,
    /// Bytes `start..end` of the tensor flattened row-major: an FSDP flat shard (the ends need
    /// not fall on element boundaries).
    Flat {
        /// First byte.
        start: u64,
        /// One past the last byte.
        end: u64,
    },
    /// Indices `start..end` along dimension `dim`, every index of the others: a tensor-parallel
    /// row or column slice (or an FSDP2 `Shard(dim)`).
    Dim {
        /// The sliced dimension.
        dim: usize,
        /// First index.
        start: u64,
        /// One past the last index.
        end: u64,
    },
}

/// One trainer rank's shard of one tensor. Several ranks holding the same slice of a tensor
/// are replicas: the plan sends those bytes once per destination, from one of them.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Shard {
    /// The trainer rank holding it.
    pub rank: u32,
    /// The tensor's name.
    pub tensor: String,
    /// The part held.
    pub slice: Slice,
}

/// Which part of a source tensor a piece of a parameter takes: a box, so that it can be
/// placed into the parameter's own shape.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Select {
    /// All of the tensor.
    Whole,
    /// Indices `start..end` along dimension `dim`.
    Dim {
        /// The sliced dimension.
        dim: usize,
        /// First index.
        start: u64,
        /// One past the last index.
        end: u64,
    },
}

/// A part of a source tensor placed inside a parameter: the selected box, its shape padded on
/// the left with ones to the parameter's rank, lands with its first element at coordinates
/// `at`. Fused parameters are several pieces: `qkv_proj` is q, k and v each selected along
/// dimension 0 (this rank's heads) at `[0, 0]`, `[q_rows, 0]`, `[q_rows + k_rows, 0]`; a
/// stacked expert weight `w13[e]` is `gate_e` at `[e, 0, 0]` and `up_e` at `[e, rows, 0]`.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Piece {
    /// The source tensor's name.
    pub tensor: String,
    /// The part of it taken.
    pub select: Select,
    /// Where that part starts in the parameter, one coordinate per parameter dimension.
    pub at: Vec<u64>,
}

/// One inference rank's parameter: a row-major buffer of `shape` that the pieces tile
/// exactly (every element written by exactly one piece).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Param {
    /// The inference rank holding it.
    pub rank: u32,
    /// Its name on that rank (for errors and the caller's own bookkeeping).
    pub name: String,
    /// Its shape.
    pub shape: Vec<u64>,
    /// Bytes per element: must equal each source tensor's.
    pub elem_size: u64,
    /// What it is made of.
    pub pieces: Vec<Piece>,
}

impl Param {
    /// An unfused parameter: `select` of `tensor`, with that shape (`shape` must be the
    /// selected part's).
    pub fn of(rank: u32, tensor: &Tensor, select: Select) -> Param {
        let mut shape = tensor.shape.clone();
        if let Select::Dim { dim, start, end } = select {
            if let Some(d) = shape.get_mut(dim) {
                *d = end.saturating_sub(start);
            }
        }
        Param {
            rank,
            name: tensor.name.clone(),
            pieces: vec![Piece {
                tensor: tensor.name.clone(),
                select,
                at: vec![0; shape.len()],
            }],
            shape,
            elem_size: tensor.elem_size,
        }
    }
}

/// Everything the plan is computed from: both sides' metadata, known to every rank, so that
/// each computes the same plan.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct Layout {
    /// The model's tensors.
    pub tensors: Vec<Tensor>,
    /// What each trainer rank holds (a write's `src_shard` indexes this list).
    pub shards: Vec<Shard>,
    /// What each inference rank needs (a write's `dst_param` indexes this list).
    pub params: Vec<Param>,
}
