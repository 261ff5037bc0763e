//! MoE expert-parallel dispatch and combine over xfer's primitives: the plan of every write of
//! a step and the protocol that carries it out, with no clock, no engine and no thread.
//!
//! # The protocol
//!
//! Every rank owns, per buffer set (two, alternating by step), a *dispatch region* — one slot
//! per source rank (a count header, then `private_rows` rows) and a shared overflow of
//! `overflow_rows` rows — and a *combine region* with room for every slot it sends out. A
//! token travels **once to each rank** hosting any of its experts (EPLB replicas as the map
//! picks them), however many of its top-k slots go there: its row is followed by a *route
//! record* ([`Layout::route_bytes`]: for each top-k slot a little-endian `u16`, the local
//! expert at that rank or [`ROUTE_NONE`], padded to 16 bytes), from which the receiver puts
//! the row in the place of every local expert it names. A step at rank `r`:
//!
//! 1. **Dispatch A** (one write per active peer, itself included): the header — how many rows
//!    `r` sends *every* rank and how many routed slots they carry — followed by the first
//!    `private_rows` rows for that peer (by token), into `r`'s slot at the peer; immediate
//!    `(epoch, A, r)`. The headers double as the barrier: once a rank holds every header it
//!    knows the whole count matrix of the step.
//! 2. **Dispatch B** (at most one per peer, only when rows overflow the private slots): the
//!    rest, at an offset in the peer's overflow that every rank computes alike from the
//!    matrix (sources in rank order); immediate `(epoch, B, r)`. When nothing overflows,
//!    dispatch is one one-way trip.
//! 3. The receiver reads the route records of the rows that arrived
//!    ([`StepMachine::read_routes`]; a source whose records do not decode is masked) and
//!    lays the slots out as DeepEP's low-latency layout orders them: for each local expert,
//!    the sources in rank order, each source's tokens in its order.
//! 4. **Combine** (one write per source): one expert output per slot received, in the
//!    source's order (token, then slot), into the source's combine region at the offset of
//!    its own slots for this rank; immediate `(epoch, C, r)`. The source reduces each token's
//!    slots in fp32 with its weights. A source that gave its weights at dispatch
//!    ([`SendPlan::with_weights`]: they travel in the route records, its header says so) gets
//!    one fp32 partial sum per row instead (the row's slots weighted and summed, slots in
//!    order), and adds a token's partial sums in rank order.
//!
//! So each rank posts at most two writes per peer per phase, moves one row per (token, rank)
//! (plus headers and route records) out and one per (token, expert) or per (token, rank) back,
//! and expects exactly the writes that were posted to it
//! ([`plan`], property-tested over random routings in `tests/properties.rs`).
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
pub use header::{membership_digest, Header, HEADER_MAGIC};
pub use imm::{Imm, Phase, IMM_EPOCHS};
pub use layout::{Layout, ROUTE_NONE, SETS};
pub use plan::{
    CountMatrix, Receive, RecvRow, RecvSlot, SendPlan, SendRow, SendSlot, Write,
    COMBINE_HEADER_BYTES,
};
pub use step::{Membership, StepMachine};
