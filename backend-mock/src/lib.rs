//! # backend-mock: an in-process fabric that behaves like a NIC
//!
//! Every engine opened on this backend in one process joins the same fabric. A write checks
//! the source's local key and bounds, the destination's remote key, bounds and write
//! permission exactly as a NIC would, then copies the bytes into the peer's registered region
//! and counts the immediate there; on any check failing it reports a remote-access error and
//! writes nothing.
//!
//! Faults are injected from the config (`[backends.mock]`, see [`MockOptions`]), seeded and
//! deterministic per NIC: reordered arrivals and completions (like SRD), delays, the Nth or
//! every Nth operation failing, a bounded queue (backpressure). [`kill`] drops a NIC from the
//! fabric: its pending and later operations fail, and so does everything aimed at it.
//!
//! The crate builds as an rlib (registered statically under the name `mock`) and as a cdylib
//! exporting the same backend through the plugin ABI.

mod domain;
mod fabric;
mod options;

pub use domain::MockDomain;
pub use fabric::kill;
pub use options::MockOptions;

use engine_core::domain::{BackendRegistration, Domain, DomainConfig, DomainError};

/// The name configs select this backend by.
pub const NAME: &str = "mock";

/// Opens one mock NIC.
pub fn open(config: &DomainConfig<'_>) -> Result<Box<dyn Domain>, DomainError> {
    Ok(Box::new(MockDomain::open(config)?))
}

inventory::submit! {
    BackendRegistration { name: NAME, open }
}

engine_core::export_plugin!("mock", open);

/// Makes sure this crate is linked, so its static registration is seen. Call it once from a
/// binary that names the mock backend only in its config.
#[inline(never)]
pub fn link() {}
