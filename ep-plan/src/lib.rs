//! MoE expert-parallel dispatch and combine over xfer's primitives: the plan of every write of
//! a step and the protocol that carries it out, with no clock, no engine and no thread.
//!
//! # The protocol
//!
//! Every rank owns, per buffer set (two, alternating by step), a *dispatch region* — one slot
//! per source rank (a count header, then `private_rows` rows) and a shared overflow of
//! `overflow_rows` rows — and a *combine region* with room for every row it sends out. A step
//! at rank `r`:
//!
//! 1. **Dispatch A** (one write per active peer, itself included): the header — how many rows
//!    `r` sends to *every* rank for each of its local experts — followed by the first
//!    `private_rows` rows for that peer, into `r`'s slot at the peer; immediate
//!    `(epoch, A, r)`. The headers double as the barrier: once a rank holds every header it
//!    knows the whole count matrix of the step.
//! 2. **Dispatch B** (at most one per peer, only when rows overflow the private slots): the
//!    rest, at an offset in the peer's overflow that every rank computes alike from the
//!    matrix (sources in rank order); immediate `(epoch, B, r)`. When nothing overflows,
//!    dispatch is one one-way trip.
//! 3. **Combine** (at most one write per source): the expert outputs of a source's rows, in the
//!    order they came, into the source's combine region at the offset of its own send order;
//!    immediate `(epoch, C, r)`. The source reduces each token's slots in fp32 with its weights.
//!
//! So each rank posts at most two writes per peer per phase, and expects exactly the writes
//! that were posted to it ([`plan`], property-tested over random routings in
//! `tests/properties.rs`).
//!
//! # Failure
//!
//! Every wait has a deadline. A source that misses one is *masked*: it counts as sending zero
//! tokens, its contribution to combine is zero, nobody sends to it or waits for it, and it
//! stays masked until [`Membership::clean`]. Overflow is used only in a step whose every header
//! arrived at a rank with nobody masked, so that a rank that missed a header never computes
//! offsets that disagree with a peer's. Immediates carry the step's epoch, so a late arrival of
//! a masked step is never counted for a later one, and the masked source's slot is never read
//! again before `clean`. [`step::StepMachine`] is that state machine, driven by seeded
//! schedules in its tests.

#![forbid(unsafe_code)]
#![warn(missing_docs)]

mod error;
mod experts;
mod header;
mod imm;
mod layout;
pub mod moves;
pub mod plan;
pub mod step;

pub use error::{HeaderError, PlanError};
pub use experts::ExpertMap;
pub use header::{membership_digest, Header};
pub use imm::{Imm, Phase, IMM_EPOCHS};
pub use layout::{Layout, SETS};
pub use plan::{CountMatrix, Receive, RecvRow, SendPlan, SendRow, Write, COMBINE_HEADER_BYTES};
pub use step::{Membership, StepMachine};
