//! The embedded rendezvous service (`xfer serve`): keys with leases and prefix watches over
//! TCP, in memory, with etcd's semantics for what the rendezvous uses — and nothing more.
//!
//! Frames are a 4-byte little-endian length and a postcard body. A watch has its own
//! connection, on which the server streams changes after the current entries.
//!
//! No client can exhaust it ([`Limits`]): connections are capped and idle ones closed;
//! connections that have not greeted have a share of the slots and a cap per address, and
//! never displace a greeted one (`admission`); the bytes held for answers and watch queues
//! have a budget per connection and for the service, past which a listing is refused by
//! name (`budget`, `answer`); values, entries and watchers are bounded; a client that does
//! not take what it is sent is cut off; and a request split across reads keeps its
//! framing. Lease ids come from the OS's CSPRNG, and a key belongs to the live lease that
//! wrote it (only its holder, who alone knows the id, may write it again). With a cluster
//! secret, the service and each client prove it to each other when a connection opens
//! ([`crate::Secret`]); without one, it listens on loopback only (see
//! `docs/security.md`). Watches carry heartbeats and resubscribe after a restart.
//!
//! Modules: `wire` (frames and messages), `state` (keys, leases, watchers: pure),
//! `admission` (which connections are served: pure), `budget` (bytes held for clients:
//! pure), `answer` (answers as frames, within the budget), `server` (connections and
//! threads), `client` (the `Store` over TCP).

mod admission;
mod answer;
mod budget;
mod client;
mod server;
mod state;
mod wire;

use std::time::Duration;

pub use answer::{
    is_lease_for_tests, list_frame_for_tests, put_frame_for_tests, watch_frame_for_tests,
};
pub(crate) use client::Client;
pub use server::Server;
// The `frame` fuzz target's entry points (see `wire::fuzzing`): hidden, not an API.
#[doc(hidden)]
pub use wire::fuzzing;
pub use wire::{
    hello_frame_for_tests, is_taken_for_tests, request_frame_for_tests, takeover_frame_for_tests,
    value_of_response_for_tests,
};

/// Largest frame a client accepts: a listing of `max_entries` (default) values of
/// [`MAX_VALUE`] fits, so a listing never fails because someone stored large values.
const MAX_FRAME: usize = 128 << 20;

/// Largest request the service reads (a key and a value).
const MAX_REQUEST: usize = MAX_VALUE + 4096;

/// Largest value stored under a key: the largest record (256 named regions of 4 NICs each)
/// is about 77 KiB; a typical one is under 200 bytes.
pub const MAX_VALUE: usize = 96 << 10;

/// Longest lease: a name cannot be kept alive without keeping it alive.
pub const MAX_TTL: Duration = Duration::from_secs(3600);

/// How often a served connection looks up from its read (for the stop flag and idleness).
const READ_TICK: Duration = Duration::from_millis(500);
/// The longest a connection may take over its greeting (`Hello`, and with a secret the
/// proof), however its bytes arrive: before it proves anything, a client holds a connection
/// slot no longer (or [`Limits::idle`], if shorter).
const GREETING: Duration = Duration::from_secs(10);

/// An idle watch stream carries a heartbeat this often.
const HEARTBEAT: Duration = Duration::from_secs(1);

/// A watch stream silent this long (no change, no heartbeat) is taken for broken: the
/// client subscribes again.
const WATCH_SILENCE: Duration = Duration::from_secs(5);

/// What the service bounds.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Limits {
    /// Connections served at once (request and watch connections); more are closed at once.
    pub max_connections: usize,
    /// Of those, connections that have not finished their greeting (the `Hello` and, with a
    /// secret, the proof) — each holds its slot for the greeting's 10 s at most. A new
    /// connection beyond this takes the place of the oldest of them; an authenticated
    /// connection is never given up for a new one.
    pub max_unauthenticated: usize,
    /// Of the unauthenticated connections, those from one address; a new one beyond this
    /// takes the place of that address's oldest.
    pub max_unauthenticated_per_source: usize,
    /// A request connection with no request for this long is closed (clients reopen theirs
    /// on their next call).
    pub idle: Duration,
    /// A client that does not take a whole answer or watch event within this is cut off (a
    /// deadline for the frame, not for each `send()`: a client reading a little at a time
    /// cannot stretch it).
    pub write_timeout: Duration,
    /// Keys stored at once; a put of a new key beyond it is refused. The default keeps a
    /// full listing within what a client reads in one frame (for more peers, use etcd).
    pub max_entries: usize,
    /// Watches at once; more are refused.
    pub max_watchers: usize,
    /// Changes queued for one watcher; a watcher that falls this far behind is cut off (it
    /// sees its watch end) rather than grow the service without bound.
    pub watch_queue: usize,
    /// Bytes the service holds at once for its clients: answers being written (a client
    /// that does not read holds its answer until [`write_timeout`](Self::write_timeout)
    /// cuts it off) and watch changes queued.
    pub max_pending_bytes: usize,
    /// Of those, bytes one connection holds: its answer being written, or its watch's
    /// snapshot and queued changes.
    pub max_pending_bytes_per_connection: usize,
}

/// The least byte budget the service accepts: an empty listing (a client's first call)
/// and a refusal must fit.
const MIN_PENDING: usize = 4096;

impl Limits {
    /// What makes these limits unusable (a cap that would refuse every client), if
    /// anything.
    fn unusable(&self) -> Option<String> {
        let caps = [
            ("max_connections", self.max_connections),
            ("max_unauthenticated", self.max_unauthenticated),
            (
                "max_unauthenticated_per_source",
                self.max_unauthenticated_per_source,
            ),
        ];
        if let Some((name, _)) = caps.iter().find(|(_, n)| *n == 0) {
            return Some(format!("Limits::{name} is 0: no client could connect"));
        }
        let budgets = [
            ("max_pending_bytes", self.max_pending_bytes),
            (
                "max_pending_bytes_per_connection",
                self.max_pending_bytes_per_connection,
            ),
        ];
        budgets
            .iter()
            .find(|(_, n)| *n < MIN_PENDING)
            .map(|(name, n)| {
                format!("Limits::{name} is {n} bytes: at least {MIN_PENDING} (an empty listing must fit)")
            })
    }
}

impl Default for Limits {
    fn default() -> Self {
        Self {
            max_connections: 1024,
            max_unauthenticated: 128,
            max_unauthenticated_per_source: 16,
            idle: Duration::from_secs(60),
            write_timeout: Duration::from_secs(5),
            max_entries: 1024,
            max_watchers: 256,
            watch_queue: 4096,
            max_pending_bytes: 256 << 20,
            max_pending_bytes_per_connection: MAX_FRAME,
        }
    }
}
