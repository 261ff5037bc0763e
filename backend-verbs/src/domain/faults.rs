//! Faults the tests inject through `[backends.verbs.faults]` (see `options::Faults`), kept
//! apart from the Domain's own state. They exist only with the crate's `faults` feature (on
//! for its own tests); without it every hook below answers "no fault" and compiles to nothing,
//! and a configuration that asks for a fault is refused when it is parsed.

use std::time::{Duration, Instant};

use crate::options;

/// The injected faults' settings and what they have done so far.
#[cfg(feature = "faults")]
pub(super) struct Faults {
    config: options::Faults,
    /// Handshake datagrams sent (for `ud_error_after_sends`).
    handshakes_sent: u32,
    /// `stall_on_first_arrival_ms`, until it fired.
    stall_once: Option<Duration>,
    /// When `forge_requests_every_ms` last fired.
    last_forged: Instant,
}

#[cfg(feature = "faults")]
impl Faults {
    pub(super) fn new(config: &options::Faults, now: Instant) -> Self {
        Self {
            config: config.clone(),
            handshakes_sent: 0,
            stall_once: Some(Duration::from_millis(config.stall_on_first_arrival_ms))
                .filter(|d| !d.is_zero()),
            last_forged: now,
        }
    }

    /// A CQ of this fixed size (`cq_entries`), which never grows.
    pub(super) fn cq_entries(&self) -> Option<u32> {
        Some(self.config.cq_entries).filter(|&n| n > 0)
    }

    /// A handshake datagram went out: whether the handshake QP must now go to the error
    /// state (`ud_error_after_sends`, once).
    pub(super) fn handshake_sent(&mut self) -> bool {
        self.handshakes_sent += 1;
        self.handshakes_sent == self.config.ud_error_after_sends
    }

    /// An immediate arrived: how long to stall the worker (the first arrival only).
    pub(super) fn stall_on_arrival(&mut self) -> Option<Duration> {
        self.stall_once.take()
    }

    /// How long a responder waits before answering a new peer (`delay_request_ms`).
    pub(super) fn request_delay(&self) -> Option<Duration> {
        Some(Duration::from_millis(self.config.delay_request_ms)).filter(|d| !d.is_zero())
    }

    /// How long a requester waits before bringing its QPs up (`delay_response_ms`).
    pub(super) fn response_delay(&self) -> Option<Duration> {
        Some(Duration::from_millis(self.config.delay_response_ms)).filter(|d| !d.is_zero())
    }

    fn forge_every(&self) -> Option<Duration> {
        Some(Duration::from_millis(self.config.forge_requests_every_ms)).filter(|d| !d.is_zero())
    }

    /// When forged requests go out next (`forge_requests_every_ms`), if they do.
    pub(super) fn next_forge(&self) -> Option<Instant> {
        self.forge_every().map(|every| self.last_forged + every)
    }

    /// Whether forged requests are due at `now` (then they are counted as sent).
    pub(super) fn forge_due(&mut self, now: Instant) -> bool {
        let due = self.next_forge().is_some_and(|at| at <= now);
        if due {
            self.last_forged = now;
        }
        due
    }
}

/// Without the `faults` feature: no fault, ever.
#[cfg(not(feature = "faults"))]
pub(super) struct Faults;

#[cfg(not(feature = "faults"))]
impl Faults {
    pub(super) fn new(_: &options::Faults, _: Instant) -> Self {
        Self
    }
    pub(super) fn cq_entries(&self) -> Option<u32> {
        None
    }
    pub(super) fn handshake_sent(&mut self) -> bool {
        false
    }
    pub(super) fn stall_on_arrival(&mut self) -> Option<Duration> {
        None
    }
    pub(super) fn request_delay(&self) -> Option<Duration> {
        None
    }
    pub(super) fn response_delay(&self) -> Option<Duration> {
        None
    }
    pub(super) fn next_forge(&self) -> Option<Instant> {
        None
    }
    pub(super) fn forge_due(&mut self, _: Instant) -> bool {
        false
    }
}

#[cfg(all(test, feature = "faults"))]
mod tests {
    use super::*;

    #[test]
    fn each_fault_fires_as_configured_and_none_by_default() {
        let t0 = Instant::now();
        let mut none = Faults::new(&options::Faults::default(), t0);
        assert_eq!(none.cq_entries(), None);
        assert!(!none.handshake_sent());
        assert_eq!(none.stall_on_arrival(), None);
        assert_eq!((none.request_delay(), none.response_delay()), (None, None));
        assert_eq!(none.next_forge(), None);
        assert!(!none.forge_due(t0 + Duration::from_secs(3600)));

        let config = options::Faults {
            ud_error_after_sends: 2,
            stall_on_first_arrival_ms: 30,
            forge_requests_every_ms: 10,
            ..options::Faults::default()
        };
        let mut some = Faults::new(&config, t0);
        assert!(!some.handshake_sent());
        assert!(some.handshake_sent(), "at the second send");
        assert!(!some.handshake_sent(), "once");
        assert_eq!(some.stall_on_arrival(), Some(Duration::from_millis(30)));
        assert_eq!(some.stall_on_arrival(), None, "the first arrival only");
        let every = Duration::from_millis(10);
        assert_eq!(some.next_forge(), Some(t0 + every));
        assert!(!some.forge_due(t0));
        assert!(some.forge_due(t0 + every));
        assert_eq!(some.next_forge(), Some(t0 + 2 * every));
    }
}
