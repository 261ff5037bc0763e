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

use engine_core::domain::{BackendRegistration, Domain, DomainConfig, DomainError};
use engine_core::group::{DomainGroup, SpreadPolicy, WholeUnits};

/// The name configs select this backend by.
pub const NAME: &str = "mock";

/// Opens one mock NIC.
pub fn open(config: &DomainConfig<'_>) -> Result<Box<dyn Domain>, DomainError> {
    Ok(Box::new(MockDomain::open(config)?))
}

inventory::submit! {
    engine_core::config::OptionsCheck {
        backend: NAME,
        check: |text| options::MockOptions::parse(text).map(|_| ()).map_err(|e| e.message),
    }
}

inventory::submit! {
    BackendRegistration { name: NAME, open, open_group: None }
}

/// The mock again, as backend `mockrails`, with a DomainGroup of its own: the way a vendor
/// whose library spreads traffic over its rails plugs in its group. Each unit (a single write,
/// a page, a scatter destination) goes whole to one rail ([`WholeUnits`]), so the receiver
/// counts one arrival per unit whatever the NIC count. The conformance suite runs on it.
pub const RAILS_NAME: &str = "mockrails";

/// A vendor-style group: the mock's NICs as rails, each unit whole on one of them.
struct RailsGroup {
    rails: Vec<Box<dyn Domain>>,
    policy: std::sync::Arc<WholeUnits>,
}

impl DomainGroup for RailsGroup {
    fn domains(&self) -> &[Box<dyn Domain>] {
        &self.rails
    }

    fn domains_mut(&mut self) -> &mut Vec<Box<dyn Domain>> {
        &mut self.rails
    }

    fn spread(&self) -> std::sync::Arc<dyn SpreadPolicy> {
        self.policy.clone()
    }
}

fn open_rails_group(
    rails: Vec<Box<dyn Domain>>,
    config: &engine_core::Config,
) -> Result<Box<dyn DomainGroup>, DomainError> {
    Ok(Box::new(RailsGroup {
        rails,
        policy: std::sync::Arc::new(WholeUnits {
            max_chunk: config.stripe.max_chunk,
        }),
    }))
}

inventory::submit! {
    BackendRegistration { name: RAILS_NAME, open, open_group: Some(open_rails_group) }
}

inventory::submit! {
    engine_core::config::OptionsCheck {
        backend: RAILS_NAME,
        check: |text| options::MockOptions::parse(text).map(|_| ()).map_err(|e| e.message),
    }
}

engine_core::export_plugin!("mock", open);

/// Makes sure this crate is linked, so its static registration is seen. Call it once from a
/// binary that names the mock backend only in its config.
#[inline(never)]
pub fn link() {}
