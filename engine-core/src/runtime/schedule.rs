//! Who runs the engine's next pass, and when: the worker's scheduling, pure — no clock read,
//! no lock, no Domain call. The worker's thread is the only one that makes passes (it owns
//! the Domains); [`step`] is its loop body, written once over [`Passes`], which the worker
//! implements with the real clock, queue and Domains and the Pair harness (`schedule/pair.rs`)
//! with a virtual clock and a model of them.
//!
//! The policy. A busy pass (it took commands, moved queued work or found events) ends the
//! idle spell, and every 64th busy pass ends what timed out. An idle pass pauses (a yield or
//! a spin hint), and every 16th reads the clock instead: then what timed out ends, and the
//! worker parks once it has been idle for `worker.spin_us` with nothing in flight — unless a
//! Domain moves only while polled. It parks until the next thing due (a transfer's or an
//! expectation's deadline, a Domain's own timer), never longer than a new transfer's or
//! expectation's timeout (so work submitted meanwhile is never due before the worker wakes
//! by itself), nor than `idle_poll_us` when some Domain cannot wake it.
//!
//! Why no other thread makes passes (issue 53): threads that submitted or waited used to make
//! the parked worker's pass themselves. That saved a wake-up per one-way on soft-RoCE, and
//! cost a deadlock (a waker shutting the engine down on a driving thread), deadlines that
//! waited for the drivers, a caller's panic failing the engine, wakers on arbitrary threads,
//! and 1.5–3.7× of the submit→callback rate (docs/performance.md has the figures of both).

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
    /// Pause (a yield or a spin hint), then the next pass.
    Pause,
    /// Read the clock, end what timed out, and ask [`Scheduler::after_look`].
    Look,
}

/// What an idle worker does after a look at the clock.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum AfterLook {
    /// Pause, then the next pass.
    Pause,
    /// Park: announce it, look at the queue and the Domains once more (they arm their
    /// wake-ups then), and sleep until [`Scheduler::park_until`] or a wake.
    Park,
}

/// The worker's scheduling; see the module docs.
#[derive(Debug)]
pub(crate) struct Scheduler {
    /// Idle time before parking, in nanoseconds.
    spin: u64,
    /// No park ever: a Domain makes progress only while polled.
    never_park: bool,
    /// The longest park, in nanoseconds: a new transfer's or expectation's timeout, and
    /// `idle_poll_us` when some Domain cannot wake the worker.
    longest_park: u64,
    /// When the idle spell began, as first seen by a look at the clock.
    since: Option<Stamp>,
    passes: u32,
}

impl Scheduler {
    /// A worker that spins `spin_ns` before it parks, for at most `longest_park_ns`;
    /// `never_park` for Domains that move only while polled.
    pub(crate) fn new(spin_ns: u64, longest_park_ns: u64, never_park: bool) -> Self {
        Self {
            spin: spin_ns,
            never_park,
            longest_park: longest_park_ns,
            since: None,
            passes: 0,
        }
    }

    /// What follows a pass that was `busy` or not.
    pub(crate) fn after_pass(&mut self, busy: bool) -> AfterPass {
        self.passes = self.passes.wrapping_add(1);
        if busy {
            self.since = None;
            return if self.passes % EXPIRE_EVERY == 0 {
                AfterPass::Expire
            } else {
                AfterPass::Go
            };
        }
        if self.passes % LOOK_EVERY == 0 {
            AfterPass::Look
        } else {
            AfterPass::Pause
        }
    }

    /// After a [`Look`](AfterPass::Look) at `now`, with work `in_flight` (transfers tracked,
    /// or requests waiting for room) or not.
    pub(crate) fn after_look(&mut self, now: Stamp, in_flight: bool) -> AfterLook {
        let since = *self.since.get_or_insert(now);
        if in_flight || self.never_park || now.since(since).as_nanos() < u128::from(self.spin) {
            AfterLook::Pause
        } else {
            AfterLook::Park
        }
    }

    /// Until when a worker parking at `now` sleeps, with `next_due` the earliest thing due
    /// though nothing arrives (read after its last look, which may have moved it).
    pub(crate) fn park_until(&self, now: Stamp, next_due: Option<Stamp>) -> Stamp {
        let longest = now.after_nanos(self.longest_park);
        next_due.map_or(longest, |due| due.min(longest))
    }

    /// The worker woke from a park: a new idle spell begins when it is idle again, and its
    /// first idle pass looks at the clock (a timed park ends at a deadline, due now).
    pub(crate) fn woke(&mut self) {
        self.since = None;
        self.passes |= LOOK_EVERY - 1;
    }
}

/// What a pass's I/O is, as [`step`] sees it: the worker's, or the harness's model.
pub(crate) trait Passes {
    /// The work of a pass: commands, posts, queued work, the Domains' events, deliveries.
    /// Whether there was any; `None` once the shutdown was taken.
    fn pass(&mut self) -> Option<bool>;
    /// Why the Domains cannot go on, once one failed for good (then nothing calls them
    /// again: [`step`] stops).
    fn fatal(&self) -> Option<String>;
    /// Reads the clock.
    fn now(&mut self) -> Stamp;
    /// Ends transfers and expectations due at or before `now`, delivering their outcome.
    fn expire(&mut self, now: Stamp);
    /// Whether transfers are tracked, or requests wait for room.
    fn in_flight(&self) -> bool;
    /// A pause between idle passes.
    fn pause(&mut self);
    /// Announces the park and looks once more (the queue, the Domains: a Domain arms its
    /// wake-up when polled while the worker is announced parked); `false`, with the
    /// announcement withdrawn, when something came in.
    fn announce_park(&mut self) -> bool;
    /// The earliest thing due though nothing arrives.
    fn next_due(&self) -> Option<Stamp>;
    /// Sleeps until `until` or a wake, then withdraws the announcement.
    fn park(&mut self, until: Stamp);
}

/// Why [`step`] says the loop ends.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) enum Stop {
    /// The shutdown was taken.
    Shutdown,
    /// A Domain failed for good, with why.
    Fatal(String),
}

/// One turn of the worker's loop: a pass, then what the scheduler says. `Err` when the loop
/// ends.
pub(crate) fn step(schedule: &mut Scheduler, io: &mut impl Passes) -> Result<(), Stop> {
    let busy = io.pass().ok_or(Stop::Shutdown)?;
    if let Some(why) = io.fatal() {
        return Err(Stop::Fatal(why));
    }
    match schedule.after_pass(busy) {
        AfterPass::Go => {}
        AfterPass::Expire => {
            let now = io.now();
            io.expire(now);
        }
        AfterPass::Pause => io.pause(),
        AfterPass::Look => {
            let now = io.now();
            io.expire(now);
            match schedule.after_look(now, io.in_flight()) {
                AfterLook::Pause => io.pause(),
                AfterLook::Park => {
                    if io.announce_park() {
                        // That last look may have found a Domain failed for good.
                        if let Some(why) = io.fatal() {
                            return Err(Stop::Fatal(why));
                        }
                        // Read after the last look, which may have moved a Domain's timer.
                        let until = schedule.park_until(io.now(), io.next_due());
                        io.park(until);
                        schedule.woke();
                    }
                }
            }
        }
    }
    Ok(())
}

#[cfg(test)]
mod pair;

#[cfg(test)]
mod tests {
    use super::*;

    fn ms(ms: u64) -> Stamp {
        Stamp::from_nanos(ms * 1_000_000)
    }

    const HOUR: u64 = 3_600_000_000_000;

    /// Runs idle passes until a look, returning how many passes that took.
    fn idle_until_look(s: &mut Scheduler) -> u32 {
        let mut passes = 1;
        while s.after_pass(false) != AfterPass::Look {
            passes += 1;
        }
        passes
    }

    #[test]
    fn an_idle_worker_pauses_and_looks_at_the_clock_every_16th_pass() {
        let mut s = Scheduler::new(0, HOUR, false);
        assert_eq!(idle_until_look(&mut s), 16);
        assert_eq!(idle_until_look(&mut s), 16);
    }

    #[test]
    fn with_no_spin_it_parks_at_its_first_look_unless_work_is_in_flight() {
        let mut s = Scheduler::new(0, HOUR, false);
        idle_until_look(&mut s);
        assert_eq!(s.after_look(ms(1), true), AfterLook::Pause);
        assert_eq!(s.after_look(ms(1), false), AfterLook::Park);
    }

    #[test]
    fn it_parks_once_idle_for_spin_and_a_busy_pass_starts_the_spell_again() {
        let mut s = Scheduler::new(5_000_000, HOUR, false);
        idle_until_look(&mut s);
        assert_eq!(s.after_look(ms(10), false), AfterLook::Pause);
        idle_until_look(&mut s);
        assert_eq!(s.after_look(ms(14), false), AfterLook::Pause);
        idle_until_look(&mut s);
        assert_eq!(s.after_look(ms(15), false), AfterLook::Park);
        assert_ne!(s.after_pass(true), AfterPass::Pause);
        idle_until_look(&mut s);
        assert_eq!(
            s.after_look(ms(16), false),
            AfterLook::Pause,
            "busy in between: a new spell"
        );
    }

    #[test]
    fn domains_that_move_only_while_polled_keep_it_from_ever_parking() {
        let mut s = Scheduler::new(0, HOUR, true);
        idle_until_look(&mut s);
        assert_eq!(s.after_look(ms(1_000_000), false), AfterLook::Pause);
    }

    #[test]
    fn a_busy_worker_ends_what_timed_out_every_64th_pass() {
        let mut s = Scheduler::new(0, HOUR, false);
        let expiries: Vec<u32> = (1..=128)
            .filter(|_| s.after_pass(true) == AfterPass::Expire)
            .collect();
        assert_eq!(expiries, [64, 128]);
    }

    #[test]
    fn a_park_ends_at_what_is_due_next_and_never_later_than_the_longest_park() {
        let s = Scheduler::new(0, 1_000_000_000, false);
        assert_eq!(s.park_until(ms(10), Some(ms(30))), ms(30));
        assert_eq!(s.park_until(ms(10), None), ms(1_010));
        assert_eq!(s.park_until(ms(10), Some(ms(5_000))), ms(1_010));
        assert_eq!(
            s.park_until(ms(10), Some(ms(3))),
            ms(3),
            "already due: no sleep"
        );
    }
}
