//! `[backends.mock]`: how the mock NIC behaves, and fault-injection knobs.
//!
//! By default the mock is as unkind as RC or SRD hardware: operations complete asynchronously
//! on the fabric's own clock (a progress thread, not the worker's polling), in no particular
//! order, a little late (`jitter_us`). `inline = true` turns that off — every operation lands
//! during its post, in order — for measuring the engine's own overhead against memcpy.

use serde::Deserialize;
use xfer_plugin::domain::{Capabilities, DomainError, DomainErrorKind};

/// The mock's config table.
#[derive(Debug, Clone, PartialEq, Eq, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct MockOptions {
    /// Seed of the fault RNG (each NIC mixes in its own id).
    pub seed: u64,
    /// Land operations in a shuffled order (SRD-like), and deliver events shuffled.
    pub reorder: bool,
    /// Land every operation during its post, in order (an ideal NIC; for benchmarks). The
    /// delay, jitter and reorder knobs then do nothing.
    pub inline: bool,
    /// Hold each operation this long before it lands ...
    pub delay_us: u64,
    /// ... plus a uniformly drawn extra of up to this long.
    pub jitter_us: u64,
    /// Fail the Nth operation posted on each NIC (1-based; 0 = never).
    pub fail_nth: u64,
    /// Fail every Nth operation posted on each NIC (0 = never).
    pub fail_every: u64,
    /// At most this many operations outstanding per peer connection (a send queue); more get
    /// `Busy` (0 = unlimited).
    pub queue_depth: usize,
    /// Panic inside the Nth post on each NIC (1-based; 0 = never): a backend bug, for testing
    /// that the engine contains it.
    pub panic_on_post: u64,
    /// Panic while closing (after leaving the fabric): a backend bug, for testing that the
    /// engine then never tells a caller that registered memory may be freed.
    pub panic_on_close: bool,
    /// Panic while opening: a backend bug, for testing that the engine reports it as such.
    pub panic_on_open: bool,
    /// Take this long to register memory (a slow `ibv_reg_mr`), on the worker thread.
    pub register_delay_us: u64,
    /// The engine's `[timeouts] connect_ms`, passed to every backend. The mock has no
    /// handshake to bound; it is accepted so the one setting reaches every backend alike.
    pub connect_ms: u64,
    /// The engine's `[security] secret_file`, passed to every backend; the mock has no
    /// handshake to authenticate.
    pub secret_file: Option<String>,
    /// Declared capabilities (what `Domain::capabilities` reports), to test that the engine
    /// honours a backend's limits: the largest write or read (0 = none) ...
    pub max_write_size: u64,
    /// ... the largest message (0 = none) ...
    pub max_message_size: usize,
    /// ... no immediates ...
    pub no_immediates: bool,
    /// ... no zero-byte writes ...
    pub no_zero_byte_writes: bool,
    /// ... host memory only ...
    pub host_memory_only: bool,
    /// ... and progress only while polled (like EFA). The mock fails its Domain (`Fatal`)
    /// when the engine posts anything its declared limits rule out: visibly wrong.
    pub needs_receiver_polling: bool,
    /// A broken backend, for proving the conformance suite catches it: post this many
    /// receive buffers for each one asked for (as a plugin with buffers of its own would).
    /// 0 or 1 = as asked.
    pub receives_multiplier: usize,
    /// A broken backend: `set_waker` promises to wake the engine and never does.
    pub silent_waker: bool,
    /// A broken backend: every work request's completion is reported twice.
    pub duplicate_completions: bool,
    /// A broken backend: writes land, but their immediates are never reported.
    pub lose_immediates: bool,
    /// A broken backend: messages are delivered, but their senders never get a `Done`.
    pub lose_send_completions: bool,
}

impl Default for MockOptions {
    fn default() -> Self {
        Self {
            seed: 1,
            reorder: true,
            inline: false,
            delay_us: 0,
            jitter_us: 20,
            fail_nth: 0,
            fail_every: 0,
            queue_depth: 0,
            panic_on_post: 0,
            panic_on_close: false,
            panic_on_open: false,
            register_delay_us: 0,
            connect_ms: 0,
            secret_file: None,
            max_write_size: 0,
            max_message_size: 0,
            no_immediates: false,
            no_zero_byte_writes: false,
            host_memory_only: false,
            needs_receiver_polling: false,
            receives_multiplier: 1,
            silent_waker: false,
            duplicate_completions: false,
            lose_immediates: false,
            lose_send_completions: false,
        }
    }
}

impl MockOptions {
    /// The capabilities these options declare.
    pub fn capabilities(&self) -> Capabilities {
        Capabilities {
            max_write_size: (self.max_write_size > 0).then_some(self.max_write_size),
            max_message_size: (self.max_message_size > 0).then_some(self.max_message_size),
            cuda_memory: !self.host_memory_only,
            immediates: !self.no_immediates,
            zero_byte_writes: !self.no_zero_byte_writes,
            needs_receiver_polling: self.needs_receiver_polling,
            reads: true,
            ..Capabilities::default()
        }
    }

    /// Parses the TOML text of `[backends.mock]`; unknown keys are named in the error.
    pub fn parse(text: &str) -> Result<Self, DomainError> {
        toml::from_str(text).map_err(|e| {
            DomainError::new(
                DomainErrorKind::InvalidArgument,
                format!("[backends.mock]: {e}"),
            )
        })
    }
}
