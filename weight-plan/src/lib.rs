//! The plan of an RL weight update: which trainer rank writes which bytes to which offset of
//! which inference rank's parameters, computed once from both sides' metadata and reused for
//! every version.
//!
//! The caller describes a [`Layout`]: the model's [`Tensor`]s (full shapes), each trainer
//! rank's [`Shard`]s (a [`Slice`] of a tensor: whole, an FSDP flat byte range, or a
//! tensor-parallel range along one dimension), and each inference rank's [`Param`]s, each a
//! box assembled from [`Piece`]s of tensors (unfused parameters are one piece; `qkv_proj`,
//! `gate_up_proj` and stacked expert weights are several, placed at coordinates). [`plan`]
//! returns every [`Write`] as a strided run (`count` rows of `len` bytes, a stride on each
//! side) — what a resharding from m to n ranks along any dimension becomes, one RDMA paged
//! write each, never a gather.
//!
//! What the plan guarantees, property-tested against a byte-level simulation
//! (`tests/properties.rs`):
//! - every byte of every parameter is written exactly once, with the full tensor's byte;
//! - bytes several trainer ranks hold (replicas: equal slices on several ranks) are sent once
//!   per destination, and the largest sender load is the least any byte-level assignment
//!   achieves: `max over sets S of trainer ranks of ⌈(bytes only ranks in S hold) / |S|⌉`
//!   (see `balance.rs`) — in particular at most the ideal `max(largest forced load, total /
//!   ranks)` plus one byte when every byte is held by every rank.
//!
//! Pure: no clock, no I/O; every rank computes the same plan from the same layout. A large
//! layout is planned on several threads, each making its own senders' writes; the plan is the
//! same, write for write, on any number of them ([`plan_with_threads`]).
//!
//! ```
//! use xfer_weight_plan::{plan, Layout, Param, Select, Shard, Slice, Tensor};
//! let w = Tensor { name: "w".into(), shape: vec![4, 6], elem_size: 2 };
//! // Two trainer ranks hold flat halves; two inference ranks hold column halves.
//! let layout = Layout {
//!     tensors: vec![w.clone()],
//!     shards: (0..2)
//!         .map(|r| Shard { rank: r, tensor: "w".into(), slice: Slice::Flat { start: r as u64 * 24, end: r as u64 * 24 + 24 } })
//!         .collect(),
//!     params: (0..2).map(|r| Param::of(r, &w, Select::Dim { dim: 1, start: 3 * r as u64, end: 3 * r as u64 + 3 })).collect(),
//! };
//! let p = plan(&layout).unwrap();
//! assert_eq!(p.received, [24, 24]);
//! assert!(p.writes().all(|w| w.len == 6)); // each row of 3 columns, strided
//! ```

#![forbid(unsafe_code)]
#![warn(missing_docs)]

mod balance;
mod error;
mod holdings;
mod layout;
mod plan;
mod runs;

pub use error::PlanError;
pub use layout::{Layout, Param, Piece, Select, Shard, Slice, Tensor};
pub use plan::{plan, plan_with_threads, Plan, Write, MAX_THREADS};
