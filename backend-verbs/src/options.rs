//! `[backends.verbs]`.

use engine_core::domain::{DomainError, DomainErrorKind};
use serde::Deserialize;

/// The verbs backend's config table.
#[derive(Debug, Clone, PartialEq, Eq, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct VerbsOptions {
    /// Port of each device.
    pub port: i32,
    /// GID index; chosen automatically (RoCE v2 with an address first) when absent.
    pub gid_index: Option<i32>,
    /// A peer that does not answer the handshake within this fails its queued transfers. Set
    /// by the engine from `[timeouts] connect_ms` (not in `[backends.verbs]`).
    pub connect_ms: u64,
    /// Handshake retry interval.
    pub retry_ms: u64,
    /// Send queue depth of each RC QP.
    pub send_queue: i32,
    /// Zero-length receives kept posted for write-with-immediate arrivals.
    pub imm_receives: i32,
    /// Local ACK timeout exponent (4.096 µs × 2^n).
    pub ack_timeout: i32,
}

impl Default for VerbsOptions {
    fn default() -> Self {
        Self {
            port: 1,
            gid_index: None,
            connect_ms: 3_000,
            retry_ms: 200,
            send_queue: 1024,
            imm_receives: 4096,
            ack_timeout: 14,
        }
    }
}

impl VerbsOptions {
    /// Parses `[backends.verbs]`; unknown keys are named.
    pub fn parse(text: &str) -> Result<Self, DomainError> {
        toml::from_str(text).map_err(|e| {
            DomainError::new(
                DomainErrorKind::InvalidArgument,
                format!("[backends.verbs]: {e}"),
            )
        })
    }
}
