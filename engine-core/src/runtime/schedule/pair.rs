//! The scheduler's Pair harness: the worker's loop ([`step`] over the real [`Scheduler`]) on
//! a virtual clock, against a seeded model of what surrounds it — threads submitting
//! transfers (some to a frozen peer, answered only by their deadline), threads waiting on
//! expectations with deadlines, commands only the worker carries out (registrations,
//! statistics), Domain events and timers, a Domain failing for good, and a shutdown, from
//! another thread or from a waker inside a delivery. Properties checked at every step:
//!
//! - a deadline fires within [`EPSILON`] of when it is due, however busy the worker is;
//! - a command is taken within [`EPSILON`] of its submission, parked or not;
//! - no Domain call after one failed for good;
//! - every accepted submission finishes exactly once (also those a shutdown or failure ends);
//! - a shutdown ends the loop within [`EPSILON`], wherever it was asked from.
//!
//! `XFER_SCHEDULE_SEED=N` reruns one schedule.

use std::collections::BTreeMap;

use super::{step, Passes, Scheduler, Stop};
use crate::runtime::clock::Stamp;

/// How late anything may be: 64 busy passes of the longest pass, with room to spare.
const EPSILON: u64 = 2_000_000;
/// The longest pass the model makes (its virtual cost).
const LONGEST_PASS: u64 = 20_000;

/// Something that reaches the worker from outside at a time.
#[derive(Debug, Clone)]
enum Outside {
    /// A transfer with its deadline; its completion arrives at the time given, if ever.
    Transfer {
        id: u64,
        deadline: u64,
        completes: Option<u64>,
    },
    /// An expectation of arrivals, registered in the shared counter, due the expectation
    /// timeout later. It wakes nobody: the worker parks no longer than that timeout after
    /// it read the deadlines (see `TransferEngine::expect_imm_count`).
    Expect { id: u64 },
    /// A command only the worker carries out.
    WorkerOnly { id: u64 },
    /// A Domain reports something unrelated (a message, a stale completion).
    Event,
    /// The Domain fails for good.
    Fatal,
    /// Another thread shuts the engine down.
    Shutdown,
}

#[derive(Debug, Default)]
struct Model {
    now: u64,
    rng: Option<fastrand::Rng>,
    /// What comes from outside, by time (several at one time keep their order).
    outside: BTreeMap<(u64, u64), Outside>,
    seq: u64,
    /// Submitted, not yet taken by a pass: (submitted at, what).
    queue: Vec<(u64, Outside)>,
    /// Transfers in flight: id → (deadline, completes).
    in_flight: BTreeMap<u64, (u64, Option<u64>)>,
    /// Expectations waiting: id → deadline.
    expecting: BTreeMap<u64, u64>,
    /// How many times each submission finished.
    finished: BTreeMap<u64, u32>,
    /// Events the Domain holds for the next poll.
    events: u32,
    /// The Domain's own timer.
    timer: Option<u64>,
    /// `[timeouts] expect_ms`, in nanoseconds.
    expect_timeout: u64,
    fatal: Option<String>,
    /// When the Domain was found failed for good (the loop must end within EPSILON).
    fatal_at: Option<u64>,
    /// The Domain fails at its next poll.
    failing: bool,
    /// Every submission that reached the worker (each must finish exactly once).
    accepted: Vec<u64>,
    /// The Domain fails in the last look before a park.
    fails_in_last_look: bool,
    /// When a shutdown was asked for.
    shutdown_asked: Option<u64>,
    /// Whether a delivery's waker shuts the engine down, at this delivery count.
    waker_shuts_down_at: Option<u32>,
    deliveries: u32,
    parked: bool,
    violations: Vec<String>,
}

impl Model {
    fn rng(&mut self) -> &mut fastrand::Rng {
        self.rng.as_mut().expect("seeded")
    }

    fn add(&mut self, at: u64, what: Outside) {
        self.seq += 1;
        self.outside.insert((at, self.seq), what);
    }

    /// Moves what reached the worker by now into the queue (or the shared counter).
    fn arrive(&mut self) {
        while let Some(entry) = self.outside.first_entry() {
            let (at, _) = *entry.key();
            if at > self.now {
                break;
            }
            match entry.remove() {
                Outside::Expect { id } => {
                    self.accepted.push(id);
                    self.expecting.insert(id, at + self.expect_timeout);
                }
                Outside::Event => self.events += 1,
                Outside::Fatal => self.failing = true,
                Outside::Shutdown => {
                    self.shutdown_asked.get_or_insert(at);
                    self.queue.push((at, Outside::Shutdown));
                }
                other => {
                    if let Outside::Transfer { id, .. } | Outside::WorkerOnly { id } = &other {
                        self.accepted.push(*id);
                    }
                    self.queue.push((at, other))
                }
            }
        }
    }

    /// When the next thing from outside would wake a parked worker.
    fn next_wake(&self) -> Option<u64> {
        let completion = self.in_flight.values().filter_map(|(_, c)| *c).min();
        let outside = self
            .outside
            .iter()
            .find(|(_, what)| !matches!(what, Outside::Expect { .. }))
            .map(|((at, _), _)| *at);
        [completion, outside].into_iter().flatten().min()
    }

    fn finish(&mut self, id: u64) {
        let n = self.finished.entry(id).or_default();
        *n += 1;
        if *n > 1 {
            self.violations
                .push(format!("submission {id} finished {n} times"));
        }
        self.deliveries += 1;
        // A flag's waker runs during this delivery, on the worker's thread: it may shut the
        // engine down (queued, as `TransferEngine::shutdown` does there; never joining).
        if self.waker_shuts_down_at == Some(self.deliveries) {
            self.shutdown_asked.get_or_insert(self.now);
            self.queue.push((self.now, Outside::Shutdown));
        }
    }

    /// A poll that finds the Domain failed (the worker's `poll_domains`: no events then).
    fn fail_if_failing(&mut self) -> bool {
        if self.failing && self.fatal.is_none() {
            self.fatal = Some("the NIC went away".into());
            self.fatal_at = Some(self.now);
        }
        self.fatal.is_some()
    }

    fn domain_call(&mut self, what: &str) {
        if self.fatal.is_some() {
            self.violations
                .push(format!("{what} after the Domain failed for good"));
        }
    }

    /// Fails what is left, as the worker's shutdown and failure paths do.
    fn fail_everything(&mut self) {
        let ids: Vec<u64> = self.in_flight.keys().copied().collect();
        for id in ids {
            self.in_flight.remove(&id);
            self.finish(id);
        }
        let ids: Vec<u64> = self.expecting.keys().copied().collect();
        for id in ids {
            self.expecting.remove(&id);
            self.finish(id);
        }
        for (_, what) in std::mem::take(&mut self.queue) {
            if let Outside::Transfer { id, .. } | Outside::WorkerOnly { id } = what {
                self.finish(id);
            }
        }
    }

    fn check(&mut self) {
        let now = self.now;
        for (id, (deadline, _)) in &self.in_flight {
            if now > deadline + EPSILON {
                self.violations.push(format!(
                    "transfer {id} due at {deadline} still in flight at {now}"
                ));
            }
        }
        for (id, deadline) in &self.expecting {
            if now > deadline + EPSILON {
                self.violations.push(format!(
                    "expectation {id} due at {deadline} still waiting at {now}"
                ));
            }
        }
        for (at, what) in &self.queue {
            if now > at + EPSILON {
                self.violations
                    .push(format!("{what:?} queued at {at} not taken at {now}"));
            }
        }
        if let Some(at) = self.fatal_at {
            if now > at + EPSILON {
                self.violations.push(format!(
                    "a Domain failed at {at}; the loop still ran at {now}"
                ));
            }
        }
        if let Some(asked) = self.shutdown_asked {
            if now > asked + EPSILON {
                self.violations
                    .push(format!("shutdown asked at {asked} still running at {now}"));
            }
        }
    }
}

impl Passes for Model {
    fn pass(&mut self) -> Option<bool> {
        let cost = self.rng().u64(1_000..=LONGEST_PASS);
        self.now += cost;
        self.arrive();
        let mut busy = false;
        let mut taken = std::mem::take(&mut self.queue).into_iter();
        while let Some((at, what)) = taken.next() {
            busy = true;
            match what {
                Outside::Shutdown => {
                    // It stays first, with what came after it, for the loop's end (as in
                    // the worker).
                    self.queue = std::iter::once((at, Outside::Shutdown))
                        .chain(taken)
                        .collect();
                    return None;
                }
                Outside::Transfer {
                    id,
                    deadline,
                    completes,
                } => {
                    self.domain_call("a post");
                    self.in_flight.insert(id, (deadline, completes));
                }
                Outside::WorkerOnly { id } => {
                    self.domain_call("a registration");
                    self.finish(id);
                }
                _ => unreachable!("not queued"),
            }
        }
        self.domain_call("a poll");
        if self.fail_if_failing() {
            return Some(true);
        }
        let now = self.now;
        let done: Vec<u64> = self
            .in_flight
            .iter()
            .filter(|(_, (_, c))| c.is_some_and(|c| c <= now))
            .map(|(id, _)| *id)
            .collect();
        for id in done {
            self.in_flight.remove(&id);
            self.finish(id);
            busy = true;
        }
        if self.events > 0 {
            self.events = 0;
            busy = true;
        }
        if self.timer.is_some_and(|t| t <= now) {
            self.timer = None;
            busy = true;
        }
        Some(busy)
    }

    fn fatal(&self) -> Option<String> {
        self.fatal.clone()
    }

    fn now(&mut self) -> Stamp {
        Stamp::from_nanos(self.now)
    }

    fn expire(&mut self, now: Stamp) {
        let now = now.since(Stamp::from_nanos(0)).as_nanos() as u64;
        let due: Vec<u64> = self
            .in_flight
            .iter()
            .filter(|(_, (deadline, _))| *deadline <= now)
            .map(|(id, _)| *id)
            .collect();
        for id in due {
            self.in_flight.remove(&id);
            self.finish(id);
        }
        let due: Vec<u64> = self
            .expecting
            .iter()
            .filter(|(_, deadline)| **deadline <= now)
            .map(|(id, _)| *id)
            .collect();
        for id in due {
            self.expecting.remove(&id);
            self.finish(id);
        }
    }

    fn in_flight(&self) -> bool {
        !self.in_flight.is_empty()
    }

    fn pause(&mut self) {
        self.now += 1_000;
    }

    fn announce_park(&mut self) -> bool {
        self.parked = true;
        // The announcement and the last look take time too: things arrive meanwhile.
        let cost = self.rng().u64(0..5_000);
        self.now += cost;
        self.arrive();
        self.failing |= std::mem::take(&mut self.fails_in_last_look);
        self.domain_call("the last poll before a park");
        // A Domain failed for good reports no events: the worker finds itself idle.
        self.fail_if_failing();
        let now = self.now;
        let arrived = self
            .in_flight
            .values()
            .any(|(_, c)| c.is_some_and(|c| c <= now));
        if !self.queue.is_empty() || self.events > 0 || arrived {
            self.parked = false;
            return false;
        }
        true
    }

    fn next_due(&self) -> Option<Stamp> {
        let transfer = self.in_flight.values().map(|(d, _)| *d).min();
        let expect = self.expecting.values().copied().min();
        [transfer, expect, self.timer]
            .into_iter()
            .flatten()
            .min()
            .map(Stamp::from_nanos)
    }

    fn park(&mut self, until: Stamp) {
        let until = until.since(Stamp::from_nanos(0)).as_nanos() as u64;
        let woken = self.next_wake().map_or(until, |w| w.min(until));
        self.now = self.now.max(woken);
        self.parked = false;
    }
}

/// One schedule: a seeded mix of the above over about 100 ms of virtual time.
fn schedule(seed: u64, scheduler: Scheduler, expect_timeout: u64) -> Model {
    let mut m = Model {
        rng: Some(fastrand::Rng::with_seed(seed)),
        ..Model::default()
    };
    let mut rng = m.rng.take().expect("seeded");
    m.expect_timeout = expect_timeout;
    let mut id = 0;
    let horizon = 100_000_000;
    // Busy stretches: many transfers, some to a frozen peer.
    let bursts = rng.u64(0..4);
    for _ in 0..bursts {
        let start = rng.u64(0..horizon);
        for k in 0..rng.u64(1..400) {
            id += 1;
            let at = start + k * rng.u64(1_000..20_000);
            let frozen = rng.u8(0..10) == 0;
            let deadline = at + rng.u64(1_000_000..30_000_000);
            let completes = (!frozen).then(|| at + rng.u64(1_000..200_000));
            m.add(
                at,
                Outside::Transfer {
                    id,
                    deadline,
                    completes,
                },
            );
        }
    }
    for _ in 0..rng.u64(0..20) {
        id += 1;
        m.add(rng.u64(0..horizon), Outside::Expect { id });
    }
    for _ in 0..rng.u64(0..10) {
        id += 1;
        m.add(rng.u64(0..horizon), Outside::WorkerOnly { id });
    }
    for _ in 0..rng.u64(0..30) {
        m.add(rng.u64(0..horizon), Outside::Event);
    }
    if rng.bool() {
        m.timer = Some(rng.u64(0..horizon));
    }
    if rng.u8(0..5) == 0 {
        m.add(rng.u64(0..horizon), Outside::Fatal);
    }
    match rng.u8(0..3) {
        0 => m.add(horizon + rng.u64(0..horizon), Outside::Shutdown),
        1 => m.waker_shuts_down_at = Some(rng.u32(1..50)),
        _ => {}
    }
    m.rng = Some(rng);
    // The loop, bounded: it must end by the shutdown or the failure, or run out of events.
    let mut scheduler = scheduler;
    for _ in 0..2_000_000 {
        let stepped = step(&mut scheduler, &mut m);
        m.check();
        match stepped {
            Ok(()) => {}
            Err(Stop::Shutdown) | Err(Stop::Fatal(_)) => {
                m.fail_everything();
                return m;
            }
        }
        if m.outside.is_empty() && m.queue.is_empty() && m.shutdown_asked.is_none() {
            // Nothing more will come: a shutdown from the engine's drop.
            m.add(m.now, Outside::Shutdown);
        }
        if !m.violations.is_empty() {
            return m;
        }
    }
    m.violations.push("the loop did not end".into());
    m
}

/// A scheduler as the worker makes one, and the expectation timeout it was made with.
fn scheduler(rng: &mut fastrand::Rng) -> (Scheduler, u64) {
    let spin = [0, 50_000, 5_000_000][rng.usize(0..3)];
    let expect_timeout = [1_000_000_000, 20_000_000][rng.usize(0..2)];
    // The longest park: the timeouts, and 1 ms (`idle_poll_us`) for Domains that cannot
    // wake the worker.
    let longest = if rng.bool() {
        expect_timeout
    } else {
        1_000_000
    };
    (
        Scheduler::new(spin, longest, rng.u8(0..8) == 0),
        expect_timeout,
    )
}

fn run(seed: u64) {
    let mut rng = fastrand::Rng::with_seed(seed ^ 0x5eed);
    let (scheduler, expect_timeout) = scheduler(&mut rng);
    let m = schedule(seed, scheduler, expect_timeout);
    assert!(
        m.violations.is_empty(),
        "seed {seed} (XFER_SCHEDULE_SEED={seed}): {:?}",
        m.violations
    );
    let not_once: Vec<(u64, u32)> = m
        .accepted
        .iter()
        .map(|id| (*id, m.finished.get(id).copied().unwrap_or(0)))
        .filter(|(_, n)| *n != 1)
        .collect();
    assert!(
        not_once.is_empty(),
        "seed {seed}: submissions finished other than once: {not_once:?}"
    );
}

#[test]
fn the_worker_loop_keeps_every_property_on_400_seeded_schedules() {
    if let Ok(seed) = std::env::var("XFER_SCHEDULE_SEED") {
        run(seed.parse().expect("XFER_SCHEDULE_SEED=N"));
        return;
    }
    for seed in 0..400 {
        run(seed);
    }
}

/// A busy worker that never looked at the clock would leave a frozen peer's transfer in
/// flight for as long as other traffic keeps it busy.
#[test]
fn a_deadline_fires_on_time_while_other_traffic_keeps_the_worker_busy() {
    let mut m = Model {
        rng: Some(fastrand::Rng::with_seed(7)),
        ..Model::default()
    };
    m.add(
        0,
        Outside::Transfer {
            id: 0,
            deadline: 5_000_000,
            completes: None,
        },
    );
    for k in 1..5_000 {
        m.add(
            k * 5_000,
            Outside::Transfer {
                id: k,
                deadline: k * 5_000 + 1_000_000_000,
                completes: Some(k * 5_000 + 2_000),
            },
        );
    }
    let mut s = Scheduler::new(50_000, 1_000_000_000, false);
    while !m.finished.contains_key(&0) {
        step(&mut s, &mut m).expect("runs");
        m.check();
        assert!(m.violations.is_empty(), "{:?}", m.violations);
    }
}

/// A parked worker must wake for an expectation's deadline though nothing arrives (checked
/// at every step: the expectation may not wait past its deadline by more than EPSILON).
#[test]
fn a_parked_worker_wakes_for_an_expectations_deadline() {
    let mut m = Model {
        rng: Some(fastrand::Rng::with_seed(3)),
        expect_timeout: 40_000_000,
        ..Model::default()
    };
    m.add(1_000, Outside::Expect { id: 1 });
    let mut s = Scheduler::new(0, 40_000_000, false);
    while !m.finished.contains_key(&1) {
        step(&mut s, &mut m).expect("runs");
        m.check();
        assert!(m.violations.is_empty(), "{:?}", m.violations);
    }
}

/// A Domain found failed for good by the last look before a park ends the loop then, not
/// after the park (no Domain call after it either).
#[test]
fn a_domain_failing_in_the_last_look_before_a_park_ends_the_loop_at_once() {
    let mut m = Model {
        rng: Some(fastrand::Rng::with_seed(11)),
        expect_timeout: 1_000_000_000,
        fails_in_last_look: true,
        ..Model::default()
    };
    m.add(1_000, Outside::Expect { id: 1 });
    let mut s = Scheduler::new(0, 1_000_000_000, false);
    let stopped = loop {
        let stepped = step(&mut s, &mut m);
        m.check();
        assert!(m.violations.is_empty(), "{:?}", m.violations);
        if let Err(stop) = stepped {
            break stop;
        }
    };
    assert!(matches!(stopped, Stop::Fatal(_)), "{stopped:?}");
    assert!(m.now < EPSILON, "the loop ran on until {}", m.now);
}
