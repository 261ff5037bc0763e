//! `[backends.efa]`.

use serde::Deserialize;
use xfer_plugin::domain::{DomainError, DomainErrorKind};

/// The EFA backend's config table.
#[derive(Debug, Clone, PartialEq, Eq, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct EfaOptions {
    /// libfabric provider: `efa` on AWS; `shm` or `tcp;ofi_rxm` elsewhere.
    pub provider: String,
    /// At most this many posts between two polls of the CQ; more get backpressure, so the
    /// provider's progress engine runs often enough.
    pub max_posts_per_poll: usize,
    /// The engine's `[timeouts] connect_ms`, passed to every backend. RDM endpoints have no
    /// connection handshake of their own (the provider's first-contact exchange is part of
    /// the first transfer, bounded by `transfer_ms`), so it bounds nothing here yet.
    pub connect_ms: u64,
    /// The engine's `[security] secret_file`, passed to every backend. RDM endpoints have no
    /// handshake of xfer's to authenticate (see docs/security.md for what EFA protects).
    pub secret_file: Option<String>,
    /// Whether the provider may carry traffic to peers on the same host over its own
    /// shared-memory path (`FI_OPT_SHARED_MEMORY_PERMITTED`, libfabric ≥ 1.19). Unset: off
    /// for `efa` (same-host peers then go through the NIC like every other peer, with the
    /// NIC's semantics: delivery-complete, GPU memory), the provider's default otherwise. A
    /// library without the option keeps its default (`xfer info` says which).
    pub shared_memory: Option<bool>,
    /// The libfabric fabric to use (`efa` or `efa-direct` on libfabric 2.x, `shm`, an
    /// address range for tcp): pinned here rather than left to whichever the library lists
    /// first. Unset: the first that offers what the backend needs.
    pub fabric: Option<String>,
    /// Largest message the backend carries, the engine's one-byte channel header included
    /// (default 64 KiB + 1: the engine's default `worker.max_message` and its header).
    /// Every receive buffer is at least this long and longer messages are refused at the
    /// sender, so no receive is ever truncated: libfabric's shm and tcp providers (1.17)
    /// stop delivering to an endpoint after a truncated receive. Peers must agree on it.
    pub max_message: usize,
}

impl Default for EfaOptions {
    fn default() -> Self {
        Self {
            provider: "efa".into(),
            max_posts_per_poll: 64,
            connect_ms: 3_000,
            secret_file: None,
            shared_memory: None,
            fabric: None,
            max_message: (64 << 10) + 1,
        }
    }
}

impl EfaOptions {
    /// What is asked of the provider's shared-memory path: the option, else off for `efa`.
    pub fn shared_memory_choice(&self) -> Option<bool> {
        self.shared_memory
            .or_else(|| self.provider.starts_with("efa").then_some(false))
    }

    /// Parses the TOML text of `[backends.efa]`; unknown keys are named in the error.
    pub fn parse(text: &str) -> Result<Self, DomainError> {
        toml::from_str(text).map_err(|e| {
            DomainError::new(
                DomainErrorKind::InvalidArgument,
                format!("[backends.efa]: {e}"),
            )
        })
    }
}
