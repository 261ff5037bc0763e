//! # backend-mock: an in-process fabric that behaves like a NIC
//!
//! Every engine opened on this backend in one process joins the same fabric. A write checks
//! the source's local key and bounds, the destination's remote key, bounds and write
//! permission exactly as a NIC would, then copies the bytes into the peer's registered region
//! and counts the immediate there; on any check failing it reports a remote-access error and
//! writes nothing.
//!
//! By default it is as unkind as the hardware: operations land asynchronously on the fabric's
//! own clock and unordered; a failed operation puts its connection in the error state and
//! flushes what is queued on it (as RC does); a write that fails part-way leaves part of its
//! data. Faults are injected from the config (`[backends.mock]`, see [`MockOptions`]), seeded
//! per NIC: delays, the Nth or every Nth operation failing, a per-peer send queue depth
//! (backpressure), a panic inside a post, slow registration. [`kill`] drops a NIC from the
//! fabric: its pending and later operations fail, and so does everything aimed at it;
//! [`freeze`] makes one hang. `inline = true` makes it an ideal in-order NIC, for benchmarks.
//!
//! The crate builds as an rlib (registered statically under the name `mock`) and as a cdylib
//! exporting the same backend through the plugin ABI.

mod domain;
mod fabric;
mod options;

pub use domain::MockDomain;
pub use fabric::{freeze, kill, registrations};
pub use options::MockOptions;

use xfer_plugin::domain::{Domain, DomainConfig, DomainError};
use xfer_plugin::registry::BackendRegistration;

/// The name configs select this backend by.
pub const NAME: &str = "mock";

/// Opens one mock NIC.
pub fn open(config: &DomainConfig<'_>) -> Result<Box<dyn Domain>, DomainError> {
    Ok(Box::new(MockDomain::open(config)?))
}

xfer_plugin::inventory::submit! {
    BackendRegistration {
        name: NAME,
        open,
        check_options: |text| MockOptions::parse(text).map(|_| ()).map_err(|e| e.message),
    }
}

xfer_plugin::export_plugin!(
    "mock",
    open,
    check = |text| MockOptions::parse(text).map(|_| ()).map_err(|e| e.message)
);

/// Makes sure this crate is linked, so its static registration is seen. Call it once from a
/// binary that names the mock backend only in its config.
#[inline(never)]
pub fn link() {}
