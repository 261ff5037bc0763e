//! `[backends.mock]`: fault-injection knobs.

use engine_core::domain::{DomainError, DomainErrorKind};
use serde::Deserialize;

/// The mock's config table. All faults are off by default.
#[derive(Debug, Clone, Default, PartialEq, Eq, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct MockOptions {
    /// Seed of the fault RNG (each NIC mixes in its own id).
    pub seed: u64,
    /// Deliver arrivals and completions in a shuffled order.
    pub reorder: bool,
    /// Hold each operation this long before it lands ...
    pub delay_us: u64,
    /// ... plus a uniformly drawn extra of up to this long.
    pub jitter_us: u64,
    /// Fail the Nth operation posted on each NIC (1-based; 0 = never).
    pub fail_nth: u64,
    /// Fail every Nth operation posted on each NIC (0 = never).
    pub fail_every: u64,
    /// At most this many operations outstanding per NIC; more get `Busy` (0 = unlimited).
    pub queue_depth: usize,
}

impl MockOptions {
    /// Parses the TOML text of `[backends.mock]`; unknown keys are named in the error.
    pub fn parse(text: &str) -> Result<Self, DomainError> {
        toml::from_str(text).map_err(|e| {
            DomainError::new(
                DomainErrorKind::InvalidArgument,
                format!("[backends.mock]: {e}"),
            )
        })
    }

    /// Whether operations must be held and executed during `poll` rather than at once.
    pub(crate) fn defers(&self) -> bool {
        self.reorder || self.delay_us > 0 || self.jitter_us > 0 || self.queue_depth > 0
    }
}
