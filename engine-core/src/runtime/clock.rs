//! Timestamps for statistics and telemetry: the monotonic clock (`CLOCK_MONOTONIC`, the one
//! `Instant` reads on Linux) as plain nanoseconds. Issue 29: every write measured two
//! durations between `Instant`s — each a normalising subtraction of seconds and nanoseconds and
//! a 128-bit division to microseconds — about 190 instructions of a write's ~2,600; between
//! two [`Stamp`]s it is one subtraction and one division by a constant. The dispatch core's
//! deadlines are stamps too (its clock is passed in, so a test's clock is virtual); the
//! ImmCounter's stay `Instant`s (they meet the public API), and an [`Anchor`] turns one into
//! the other.

use std::time::{Duration, Instant};

use rustix::time::{clock_gettime, ClockId};

/// A moment on the monotonic clock, in nanoseconds since the clock's origin (boot).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, PartialOrd, Ord)]
pub(crate) struct Stamp(u64);

impl Stamp {
    /// Now.
    #[inline]
    pub(crate) fn now() -> Self {
        let t = clock_gettime(ClockId::Monotonic);
        // A monotonic clock counts from boot: neither field is negative, and u64 nanoseconds
        // last 584 years of uptime.
        Self((t.tv_sec as u64) * 1_000_000_000 + t.tv_nsec as u64)
    }

    /// Whole microseconds from `earlier` to `self`; 0 if `earlier` is not earlier.
    #[inline]
    pub(crate) fn micros_since(self, earlier: Stamp) -> u64 {
        self.0.saturating_sub(earlier.0) / 1_000
    }

    /// `d` after this moment.
    #[cfg(test)]
    pub(crate) fn after(self, d: Duration) -> Self {
        self.after_nanos(u64::try_from(d.as_nanos()).unwrap_or(u64::MAX))
    }

    /// `nanos` nanoseconds after this moment (a duration converted once, not per use).
    #[inline]
    pub(crate) fn after_nanos(self, nanos: u64) -> Self {
        Self(self.0.saturating_add(nanos))
    }

    /// A moment `nanos` nanoseconds from the clock's origin (a virtual clock's, in tests).
    #[cfg(test)]
    pub(crate) fn from_nanos(nanos: u64) -> Self {
        Self(nanos)
    }

    /// From `earlier` to `self`; zero if `earlier` is not earlier.
    pub(crate) fn since(self, earlier: Stamp) -> Duration {
        Duration::from_nanos(self.0.saturating_sub(earlier.0))
    }
}

/// One moment read as both a [`Stamp`] and an `Instant`, to turn stamps into the `Instant`s
/// the public telemetry reports (rarely: a status query), without reading the clock per stamp.
#[derive(Clone, Copy, Debug)]
pub(crate) struct Anchor {
    stamp: Stamp,
    instant: Instant,
}

impl Anchor {
    /// Reads both clocks now.
    pub(crate) fn now() -> Self {
        Self {
            stamp: Stamp::now(),
            instant: Instant::now(),
        }
    }

    /// The `Stamp` of `instant` (see [`instant`](Self::instant)).
    pub(crate) fn stamp(&self, instant: Instant) -> Stamp {
        match instant.checked_duration_since(self.instant) {
            Some(after) => self
                .stamp
                .after_nanos(u64::try_from(after.as_nanos()).unwrap_or(u64::MAX)),
            None => Stamp(self.stamp.0.saturating_sub(
                u64::try_from((self.instant - instant).as_nanos()).unwrap_or(u64::MAX),
            )),
        }
    }

    /// The `Instant` of `stamp` (both clocks are `CLOCK_MONOTONIC`: only the read between
    /// them, well under a microsecond, separates them).
    pub(crate) fn instant(&self, stamp: Stamp) -> Instant {
        if stamp >= self.stamp {
            self.instant + stamp.since(self.stamp)
        } else {
            self.instant
                .checked_sub(self.stamp.since(stamp))
                .unwrap_or(self.instant)
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn stamps_measure_what_instants_measure() {
        let (s0, i0) = (Stamp::now(), Instant::now());
        std::thread::sleep(Duration::from_millis(20));
        let (i1, s1) = (Instant::now(), Stamp::now());
        // The stamps bracket the instants' interval from outside.
        let by_instants = i1.duration_since(i0);
        let by_stamps = s1.since(s0);
        assert!(by_stamps >= by_instants, "{by_stamps:?} < {by_instants:?}");
        assert!(
            by_stamps - by_instants < Duration::from_millis(5),
            "{by_stamps:?} vs {by_instants:?}: not the same clock"
        );
        assert_eq!(s1.micros_since(s0), by_stamps.as_micros() as u64);
        assert_eq!(s0.micros_since(s1), 0, "out of order is zero, not a wrap");
    }

    #[test]
    fn an_anchor_turns_stamps_into_the_instants_of_the_same_moments() {
        let before = Stamp::now();
        let anchor = Anchor::now();
        let after = Stamp::now();
        let (b, a) = (anchor.instant(before), anchor.instant(after));
        assert!(b <= anchor.instant(anchor.stamp) && anchor.instant(anchor.stamp) <= a);
        assert_eq!(a.duration_since(b), after.since(before));
        assert_eq!(anchor.instant(anchor.stamp), anchor.instant);
    }
}
