//! Riding out a service that is not up yet, or is restarting: a serving system starts its
//! processes in any order, so a client retries what failed for want of a connection, with
//! backoff, until its caller's deadline, says once in the log that it is waiting, and then
//! fails with [`Error::Unreachable`] naming the service.
//!
//! Only [`Error::Unreachable`] and [`Error::Busy`] (the embedded service holds its memory
//! budget for others, which frees within its write timeout) are retried: a refusal, a
//! malformed record or a bad name is an answer, and repeating the call would only repeat it.

use std::time::{Duration, Instant};

use crate::{Error, Result};

/// How long a client waits for its service when the caller names no wait: long enough for
/// a service started in the same breath (or restarted) to come up on a loaded machine.
pub const DEFAULT_WAIT: Duration = Duration::from_secs(30);

/// The pause before retry `attempt` (0-based): 20 ms doubling to 1 s, so a service that
/// comes up is found within a second and one that does not is asked about once a second.
pub(crate) fn backoff(attempt: u32) -> Duration {
    Duration::from_millis(20u64 << attempt.min(6)).min(Duration::from_secs(1))
}

/// Runs `call` until it returns anything but [`Error::Unreachable`] or [`Error::Busy`], or
/// until `wait` has passed since the first try; then the last of those (an `Unreachable`
/// with how long it waited). `service` names the service in the log line.
pub(crate) fn until<T>(
    service: &str,
    wait: Duration,
    mut call: impl FnMut() -> Result<T>,
) -> Result<T> {
    let started = Instant::now();
    let deadline = started.checked_add(wait);
    let mut attempt = 0;
    loop {
        let failed = match call() {
            Err(e @ (Error::Unreachable { .. } | Error::Busy { .. })) => e,
            other => return other,
        };
        let now = Instant::now();
        let left = deadline.map_or(Duration::MAX, |d| d.saturating_duration_since(now));
        if left.is_zero() {
            return Err(match failed {
                Error::Unreachable { why, .. } => Error::Unreachable {
                    service: service.to_owned(),
                    waited: now - started,
                    why,
                },
                busy => busy,
            });
        }
        if attempt == 0 {
            match &failed {
                Error::Unreachable { why, .. } => tracing::warn!(
                    "rendezvous service {service} is not reachable yet ({why}); retrying for up to {wait:?}"
                ),
                busy => tracing::warn!("{busy}; retrying for up to {wait:?}"),
            }
        }
        std::thread::sleep(backoff(attempt).min(left));
        attempt += 1;
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn unreachable() -> Error {
        Error::Unreachable {
            service: "xfer://x:1".into(),
            waited: Duration::ZERO,
            why: "connection refused".into(),
        }
    }

    #[test]
    fn backoff_grows_to_a_second_and_stays() {
        let pauses: Vec<u64> = (0..10).map(|a| backoff(a).as_millis() as u64).collect();
        assert_eq!(pauses, [20, 40, 80, 160, 320, 640, 1000, 1000, 1000, 1000]);
    }

    #[test]
    fn retries_only_unreachable_and_stops_at_the_first_answer() {
        let mut calls = 0;
        let got = until("xfer://x:1", Duration::from_secs(5), || {
            calls += 1;
            if calls < 3 {
                Err(unreachable())
            } else {
                Ok(calls)
            }
        });
        assert_eq!(got.unwrap(), 3);
        let mut calls = 0;
        let refused: Result<()> = until("xfer://x:1", Duration::from_secs(5), || {
            calls += 1;
            Err(Error::Service {
                service: "xfer://x:1".into(),
                why: "refused".into(),
            })
        });
        assert!(matches!(refused, Err(Error::Service { .. })) && calls == 1);
    }

    /// A busy service (its memory budget held for others) is ridden out like an
    /// unreachable one, and after the wait the caller sees `Busy`, not `Unreachable`.
    #[test]
    fn busy_is_ridden_out_and_named_after_the_wait() {
        let busy = || Error::Busy {
            service: "xfer://x:1".into(),
            bytes: 10,
            held: 95,
            budget: 100,
        };
        let mut calls = 0;
        let got = until("xfer://x:1", Duration::from_secs(5), || {
            calls += 1;
            if calls < 3 {
                Err(busy())
            } else {
                Ok(calls)
            }
        });
        assert_eq!(got.unwrap(), 3);
        let e = until::<()>("xfer://x:1", Duration::ZERO, || Err(busy())).unwrap_err();
        assert!(matches!(e, Error::Busy { held: 95, .. }), "{e:?}");
    }

    #[test]
    fn gives_up_after_the_wait_naming_the_service_and_the_time() {
        let mut calls = 0;
        let e = until::<()>("xfer://x:1", Duration::from_millis(100), || {
            calls += 1;
            Err(unreachable())
        })
        .unwrap_err();
        match e {
            Error::Unreachable {
                service, waited, ..
            } => {
                assert_eq!(service, "xfer://x:1");
                assert!(waited >= Duration::from_millis(100));
            }
            other => panic!("{other:?}"),
        }
        // 20 + 40 ms, then the rest of the 100 ms: a handful of tries, not a spin.
        assert!((2..=5).contains(&calls), "{calls} tries");
        let mut calls = 0;
        let _ = until::<()>("xfer://x:1", Duration::ZERO, || {
            calls += 1;
            Err(unreachable())
        });
        assert_eq!(calls, 1, "a zero wait tries once");
    }
}
