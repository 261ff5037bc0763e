//! # xfer-plugin: what a NIC vendor builds an xfer backend against
//!
//! A small crate (no CUDA, no engine, no TOML parser) holding exactly what crosses between the
//! engine and a backend:
//! - [`domain`]: the [`Domain`](domain::Domain) trait one NIC implements, and the requests,
//!   events, errors and [`Capabilities`](domain::Capabilities) it exchanges with the engine;
//! - [`addr`]: [`NetAddr`](addr::NetAddr), the opaque NIC address a backend hands out;
//! - [`abi`]: the versioned, append-only C ABI, and [`export_plugin!`] that turns a Rust
//!   `Domain` opener into it (C plugins use the generated header `include/xfer_plugin.h`);
//! - [`log`]: how a plugin's `tracing` events reach the host process's subscriber;
//! - [`registry`]: how a backend linked into a binary as a Rust crate announces itself.
//!
//! The conformance suite needs a running engine, so it lives in `xfer-conformance` (a
//! dev-dependency) and in the `xfer conformance --plugin` command, which needs no Rust at all. `docs/plugins.md` is the guide; its Rust snippets are compiled as
//! this crate's doc tests (see [`guide`]).
//!
//! ## Changes
//!
//! The C ABI ([`abi::PluginTable`]) only grows, and its version says what a plugin has. The
//! Rust [`Domain`](domain::Domain) trait is versioned with this crate: a change that breaks a
//! Rust plugin's build raises the minor version.
//!
//! - **0.2**: the three RDMA post methods (`post_rdma` of one request, `post_rdma_pages`,
//!   `post_rdma_list`) are one, [`Domain::post_rdma`](domain::Domain::post_rdma), taking an
//!   [`RdmaPost`](domain::RdmaPost) (`One`, `Pages` or `List`) and answering as the batch
//!   methods did: how many were posted, and why it stopped. The defaults `post_one_by_one`
//!   and `post_each` are one helper, [`post_one_by_one`](domain::post_one_by_one), which takes
//!   the post and the Domain's one-request post: a Domain that posts one request at a time
//!   passes every post to it; one that batches some kinds matches those and passes on the
//!   rest. The C ABI is unchanged.

pub mod abi;
pub mod addr;
pub mod domain;
pub mod log;
mod raw;
pub mod registry;
pub mod secret;

/// Re-exported so a backend submits its [`registry::BackendRegistration`] without naming
/// the crate itself.
pub use inventory;

/// The text of a panic payload (`&str` or `String`; anything else is named as such).
pub fn panic_message(payload: &(dyn std::any::Any + Send)) -> String {
    if let Some(s) = payload.downcast_ref::<&str>() {
        (*s).to_owned()
    } else if let Some(s) = payload.downcast_ref::<String>() {
        s.clone()
    } else {
        "a panic without a message".to_owned()
    }
}

#[doc = include_str!("../../docs/plugins.md")]
pub mod guide {}
