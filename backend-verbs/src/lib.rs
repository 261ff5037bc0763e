//! # backend-verbs: libibverbs RC
//!
//! One Domain per RDMA device (ConnectX, RoCE NICs; soft-RoCE in tests). Per peer, two RC QPs
//! (one-sided writes; messages) created lazily on first use and connected through a
//! request/response handshake on the device's UD QP (the `NetAddr` carries GID, LID and UD
//! QPN), with retries and a deadline; random PSNs; MTU = the smaller of both ports'.
//! Write-with-immediate arrivals consume zero-length receives of one SRQ and feed the
//! ImmCounter; messages land in the buffers of another SRQ. Failed completions name their
//! status and mark the peer failed; the next transfer reconnects.
//!
//! `unsafe` lives in `ffi.rs`; the handshake and address formats and the GID choice are pure
//! (`wire.rs`).

pub mod completion;
mod cq;
mod domain;
mod ffi;
mod handshake;
mod log;
mod notify;
mod options;
mod ud;
pub mod wire;

pub use domain::VerbsDomain;
pub use options::VerbsOptions;

use xfer_plugin::domain::{Domain, DomainConfig, DomainError};
use xfer_plugin::registry::BackendRegistration;

/// The name configs select this backend by.
pub const NAME: &str = "verbs";

/// Opens one RDMA device.
pub fn open(config: &DomainConfig<'_>) -> Result<Box<dyn Domain>, DomainError> {
    Ok(Box::new(VerbsDomain::open(config)?))
}

/// RDMA devices present.
pub fn devices() -> Vec<String> {
    ffi::devices()
}

xfer_plugin::inventory::submit! {
    BackendRegistration {
        name: NAME,
        open,
        check_options: |text| options::VerbsOptions::parse(text).map(|_| ()).map_err(|e| e.message),
    }
}

xfer_plugin::export_plugin!(
    "verbs",
    open,
    check = |text| options::VerbsOptions::parse(text)
        .map(|_| ())
        .map_err(|e| e.message)
);

/// Makes sure this crate is linked, so its static registration is seen.
#[inline(never)]
pub fn link() {}
