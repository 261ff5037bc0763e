//! The Domain trait and the types a backend exchanges with the engine live in the plugin kit
//! ([`xfer_plugin::domain`]), so a vendor's plugin depends on that small crate alone; this
//! module re-exports them and adds what only a binary that links backends needs.

pub use xfer_plugin::domain::*;

/// A backend linked into the binary; submitted with `inventory::submit!`.
#[derive(Debug)]
pub struct BackendRegistration {
    /// The name configs select it by.
    pub name: &'static str,
    /// Opens one NIC.
    pub open: OpenFn,
    /// The backend's own DomainGroup over the opened NICs; `None`: the built-in
    /// [`StripingGroup`](crate::group::StripingGroup). Plugins loaded through the C ABI always
    /// get the built-in group (a plugin whose library spreads over its rails by itself exposes
    /// the logical device as one NIC).
    pub open_group: Option<crate::group::OpenGroupFn>,
}

inventory::collect!(BackendRegistration);
