//! When an idle worker pauses, looks at the clock, or parks: a pure state machine the worker
//! asks after each pass, with the clock read passed in (see the worker's spinning policy).
//!
//! A busy pass (it took commands, moved queued work, or found events) ends the idle spell. An
//! idle pass pauses (a yield or a spin hint), and every 16th reads the clock instead: then
//! the worker ends what timed out, and parks once it has been idle for `worker.spin_us`
//! with nothing in flight — unless a Domain moves only while polled. A busy worker still ends
//! what timed out every 64th pass.

use std::time::Duration;

use super::clock::Stamp;

/// Idle passes between two looks at the clock.
const LOOK_EVERY: u32 = 16;
/// Busy passes between two expiries.
const EXPIRE_EVERY: u32 = 64;

/// What the worker does after a pass.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum AfterPass {
    /// The next pass, at once.
    Go,
    /// End what timed out, then the next pass.
    Expire,
    /// Pause (see `Worker::idle_pause`), then the next pass.
    Pause,
    /// Read the clock, end what timed out, and ask [`Idle::parks`].
    Look,
}

/// See the module docs.
#[derive(Debug)]
pub(crate) struct Idle {
    spin: Duration,
    /// No park ever: a Domain makes progress only while polled.
    never_park: bool,
    /// When the idle spell began, as first seen by a look at the clock.
    since: Option<Stamp>,
    rounds: u32,
}

impl Idle {
    /// A worker that spins `spin` before it parks; `never_park` for Domains that move only
    /// while polled.
    pub(crate) fn new(spin: Duration, never_park: bool) -> Self {
        Self {
            spin,
            never_park,
            since: None,
            rounds: 0,
        }
    }

    /// What follows a pass that was `busy` or not.
    pub(crate) fn after_pass(&mut self, busy: bool) -> AfterPass {
        self.rounds = self.rounds.wrapping_add(1);
        if busy {
            self.since = None;
            return if self.rounds % EXPIRE_EVERY == 0 {
                AfterPass::Expire
            } else {
                AfterPass::Go
            };
        }
        if self.rounds % LOOK_EVERY == 0 {
            AfterPass::Look
        } else {
            AfterPass::Pause
        }
    }

    /// After a [`Look`](AfterPass::Look) at `now`: whether to park (else pause), with work
    /// `in_flight` (transfers tracked, or requests waiting for room) or not. `waiters`:
    /// threads waiting on the engine poll the NICs themselves (see `drive_parked`), so the
    /// worker parks at once rather than spin for its `spin`.
    pub(crate) fn parks(&mut self, now: Stamp, in_flight: bool, waiters: bool) -> bool {
        let since = *self.since.get_or_insert(now);
        !(in_flight || self.never_park || (!waiters && now.since(since) < self.spin))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn ms(ms: u64) -> Stamp {
        Stamp::from_nanos(ms * 1_000_000)
    }

    /// Runs idle passes until a look, returning how many passes that took.
    fn idle_until_look(idle: &mut Idle) -> u32 {
        let mut passes = 1;
        while idle.after_pass(false) != AfterPass::Look {
            passes += 1;
        }
        passes
    }

    #[test]
    fn an_idle_worker_pauses_and_looks_at_the_clock_every_16th_pass() {
        let mut idle = Idle::new(Duration::ZERO, false);
        assert_eq!(idle_until_look(&mut idle), 16);
        assert_eq!(idle_until_look(&mut idle), 16);
    }

    #[test]
    fn with_no_spin_it_parks_at_its_first_look_unless_work_is_in_flight() {
        let mut idle = Idle::new(Duration::ZERO, false);
        idle_until_look(&mut idle);
        assert!(
            !idle.parks(ms(1), true, false),
            "a transfer in flight: it keeps polling"
        );
        assert!(idle.parks(ms(1), false, false));
    }

    #[test]
    fn it_parks_once_idle_for_spin_and_a_busy_pass_starts_the_spell_again() {
        let mut idle = Idle::new(Duration::from_millis(5), false);
        idle_until_look(&mut idle);
        assert!(
            !idle.parks(ms(10), false, false),
            "the spell begins at its first look"
        );
        idle_until_look(&mut idle);
        assert!(!idle.parks(ms(14), false, false));
        idle_until_look(&mut idle);
        assert!(idle.parks(ms(15), false, false));
        assert_ne!(idle.after_pass(true), AfterPass::Pause);
        idle_until_look(&mut idle);
        assert!(
            !idle.parks(ms(16), false, false),
            "busy in between: a new spell"
        );
    }

    #[test]
    fn with_threads_waiting_on_the_engine_it_parks_at_its_first_look() {
        let mut idle = Idle::new(Duration::from_millis(5), false);
        idle_until_look(&mut idle);
        assert!(idle.parks(ms(10), false, true), "the waiters poll: no spin");
        let mut never = Idle::new(Duration::ZERO, true);
        idle_until_look(&mut never);
        assert!(
            !never.parks(ms(10), false, true),
            "still never, for Domains that need it"
        );
    }

    #[test]
    fn domains_that_move_only_while_polled_keep_it_from_ever_parking() {
        let mut idle = Idle::new(Duration::ZERO, true);
        idle_until_look(&mut idle);
        assert!(!idle.parks(ms(1_000_000), false, false));
    }

    #[test]
    fn a_busy_worker_ends_what_timed_out_every_64th_pass() {
        let mut idle = Idle::new(Duration::ZERO, false);
        let expiries: Vec<u32> = (1..=128)
            .filter(|_| idle.after_pass(true) == AfterPass::Expire)
            .collect();
        assert_eq!(expiries, [64, 128]);
    }
}
