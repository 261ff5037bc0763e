//! Pure planning: how a transfer is cut into NIC-sized writes, and how many arrivals the
//! receiver will count for it. No I/O, no threads, no FFI; the worker executes what this says.
//!
//! Both peers run the same functions with the same [`StripePolicy`] and NIC count, so a
//! receiver knows how many immediates a transfer of a given shape produces without being told.

mod stripe;

pub use stripe::{expected_arrivals, split, stays_whole, Chunk, StripePolicy, TransferShape};
