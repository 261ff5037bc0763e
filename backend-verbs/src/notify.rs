//! Waking a parked engine worker from the CQ's completion channel.
//!
//! The worker parks when nothing is in flight, so an arrival (a write with immediate, a
//! message, a handshake datagram) must wake it, or it waits for its next idle poll. The
//! protocol with the Domain, which polls the CQ on the worker's thread:
//!
//! - At a poll while the worker says it is about to park (`Waker::worker_parking`: it
//!   announces the park before its last poll), the Domain arms the CQ (`armed` false → true)
//!   and drains it once more (completions already on the CQ raise no event) — whatever the
//!   drain before found: completions that produce no event (a handshake datagram) leave the
//!   worker parking all the same. While `armed` stays true it does not arm again: one `ibv_req_notify_cq` per
//!   park at most, and none while the worker is busy.
//! - This thread waits on the channel. An event means a completion came after arming: it
//!   clears `armed` first and then calls the waker, so the worker's next pass (which the
//!   waker guarantees) sees `armed` false and re-arms before it can park again.
//! - Asynchronous events (a CQ overrun, a QP or port error) are read by the Domain, which
//!   fails typed on the fatal ones. A parked worker would not read them until its next
//!   arrival, perhaps never (an overrun CQ delivers nothing more), so this thread also waits
//!   on the async fd: when one is pending it sets `async_pending`, wakes the worker and stops
//!   watching the fd (it stays readable until read) until the Domain has read the events,
//!   cleared the flag and kicked the wait.
//! - The Domain also has timer work while idle: handshakes it must resend every `retry_ms`
//!   and deadlines it must enforce, retired QPs to free. At each poll it publishes when it
//!   next needs one (its `poll_timeout`, as the `deadline` here); the wait lasts until then,
//!   and the worker is woken once for each deadline reached. The Domain kicks the wait when
//!   the deadline changes, so a wait begun for another one (or without one) is not kept.
//!
//! The loop is generic over its event source so that it is tested without a device.

use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::time::{Duration, Instant};

use xfer_plugin::domain::Waker;

use crate::ffi::{CqEvents, Wait};

/// What the Domain and its notifier thread share.
#[derive(Debug)]
pub(crate) struct NotifyState {
    /// The CQ is armed: an event will come at its next completion.
    pub(crate) armed: AtomicBool,
    /// An asynchronous event waits to be read by the Domain.
    pub(crate) async_pending: AtomicBool,
    /// When the Domain next needs a poll though nothing arrives: nanoseconds after `epoch`,
    /// [`NO_DEADLINE`] for none.
    deadline: AtomicU64,
    epoch: Instant,
}

const NO_DEADLINE: u64 = u64::MAX;

impl Default for NotifyState {
    fn default() -> Self {
        Self {
            armed: AtomicBool::new(false),
            async_pending: AtomicBool::new(false),
            deadline: AtomicU64::new(NO_DEADLINE),
            epoch: Instant::now(),
        }
    }
}

impl NotifyState {
    /// Publishes the Domain's next deadline; true when it changed: the wait must then be
    /// kicked, or it keeps waiting for the old one (or, woken for it already, for nothing).
    pub(crate) fn set_deadline(&self, at: Option<Instant>) -> bool {
        let raw = at.map_or(NO_DEADLINE, |at| {
            // A deadline before the epoch is due: the earliest one expressible.
            let ns = at.saturating_duration_since(self.epoch).as_nanos();
            u64::try_from(ns).unwrap_or(NO_DEADLINE - 1)
        });
        raw != self.deadline.swap(raw, Ordering::SeqCst)
    }

    /// The deadline last published.
    pub(crate) fn deadline(&self) -> Option<Instant> {
        match self.deadline.load(Ordering::SeqCst) {
            NO_DEADLINE => None,
            ns => Some(self.epoch + Duration::from_nanos(ns)),
        }
    }
}

/// Where the loop waits: the device's completion channel, or a script in tests.
pub(crate) trait EventSource {
    fn wait(&self, timeout: Option<Duration>, watch_async: bool) -> Result<Wait, String>;
    fn stopping(&self) -> bool;
}

impl EventSource for CqEvents {
    fn wait(&self, timeout: Option<Duration>, watch_async: bool) -> Result<Wait, String> {
        CqEvents::wait(self, timeout, watch_async)
    }
    fn stopping(&self) -> bool {
        CqEvents::stopping(self)
    }
}

/// The notifier thread's loop; returns when the source says the device is closing.
pub(crate) fn run(source: &impl EventSource, state: &NotifyState, waker: &Waker) {
    // Whether the last wait failed: its error is logged once per run of failures.
    let mut failing = false;
    // The deadline the worker was last woken for: once per deadline (the worker's poll
    // publishes the next), not every millisecond until that poll.
    let mut woken_for = None;
    loop {
        if source.stopping() {
            return;
        }
        let due = state.deadline().filter(|&d| Some(d) != woken_for);
        let timeout = due.map(|d| d.saturating_duration_since(Instant::now()));
        let watch_async = !state.async_pending.load(Ordering::SeqCst);
        match source.wait(timeout, watch_async) {
            Ok(woke) => {
                failing = false;
                let mut wake = false;
                if woke.completion {
                    state.armed.store(false, Ordering::SeqCst);
                    wake = true;
                }
                if woke.async_event && watch_async {
                    state.async_pending.store(true, Ordering::SeqCst);
                    wake = true;
                }
                // Whatever ended the wait: a wait's timeout is rounded to milliseconds, so
                // only a deadline actually reached wakes the worker.
                if due.is_some_and(|d| Instant::now() >= d) {
                    woken_for = due;
                    wake = true;
                }
                if wake {
                    waker.wake();
                }
            }
            Err(e) => {
                // The channel cannot be waited on: the worker is woken on a short interval
                // instead (what a Domain without a channel gets), so nothing is stranded.
                if !failing {
                    crate::log::line(&format!("{e}; waking the worker every millisecond instead"));
                }
                failing = true;
                state.armed.store(false, Ordering::SeqCst);
                waker.wake();
                std::thread::sleep(Duration::from_millis(1));
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::cell::RefCell;
    use std::sync::atomic::AtomicU32;
    use std::sync::Arc;

    /// Plays a script of wait outcomes; records the timeouts asked for; stops when done.
    struct Script {
        outcomes: RefCell<Vec<Result<Wait, String>>>,
        asked: RefCell<Vec<Option<Duration>>>,
        /// Whether each wait watched the async fd.
        watched: RefCell<Vec<bool>>,
        /// Run before each outcome is returned (to change the shared state mid-script).
        before: Box<dyn Fn(usize)>,
    }

    impl EventSource for Script {
        fn wait(&self, timeout: Option<Duration>, watch_async: bool) -> Result<Wait, String> {
            let step = self.asked.borrow().len();
            self.asked.borrow_mut().push(timeout);
            self.watched.borrow_mut().push(watch_async);
            (self.before)(step);
            self.outcomes.borrow_mut().remove(0)
        }
        fn stopping(&self) -> bool {
            self.outcomes.borrow().is_empty()
        }
    }

    fn counting_waker() -> (Waker, Arc<AtomicU32>) {
        let wakes = Arc::new(AtomicU32::new(0));
        let w = wakes.clone();
        (
            Waker::new(move || {
                w.fetch_add(1, Ordering::SeqCst);
            }),
            wakes,
        )
    }

    const COMPLETION: Wait = Wait {
        completion: true,
        kick: false,
        async_event: false,
    };
    const KICK: Wait = Wait {
        completion: false,
        kick: true,
        async_event: false,
    };
    const ASYNC: Wait = Wait {
        completion: false,
        kick: false,
        async_event: true,
    };

    #[test]
    fn a_pending_async_event_wakes_the_worker_once_until_the_domain_has_read_it() {
        let state = Arc::new(NotifyState::default());
        let (waker, wakes) = counting_waker();
        let domain = state.clone();
        let script = Script {
            // The event; waits that must not watch the fd while it is unread (the Domain
            // reads it during the second of them and kicks); then the fd is watched again.
            outcomes: RefCell::new(vec![
                Ok(ASYNC),
                Ok(Wait::default()),
                Ok(KICK),
                Ok(Wait::default()),
            ]),
            asked: RefCell::new(Vec::new()),
            watched: RefCell::new(Vec::new()),
            before: Box::new(move |step| {
                if step == 2 {
                    domain.async_pending.store(false, Ordering::SeqCst);
                }
            }),
        };
        run(&script, &state, &waker);
        assert_eq!(*script.watched.borrow(), vec![true, false, false, true]);
        assert_eq!(wakes.load(Ordering::SeqCst), 1);
    }

    #[test]
    fn an_event_disarms_before_it_wakes_and_idle_waits_have_no_timeout() {
        let state = Arc::new(NotifyState::default());
        state.armed.store(true, Ordering::SeqCst);
        let seen = state.clone();
        let armed_at_wake = Arc::new(AtomicBool::new(true));
        let flag = armed_at_wake.clone();
        let waker =
            Waker::new(move || flag.store(seen.armed.load(Ordering::SeqCst), Ordering::SeqCst));
        let script = Script {
            outcomes: RefCell::new(vec![Ok(COMPLETION), Ok(Wait::default())]),
            asked: RefCell::new(Vec::new()),
            watched: RefCell::new(Vec::new()),
            before: Box::new(|_| {}),
        };
        run(&script, &state, &waker);
        assert!(
            !armed_at_wake.load(Ordering::SeqCst),
            "woken while still marked armed"
        );
        assert_eq!(*script.asked.borrow(), vec![None, None]);
    }

    #[test]
    fn a_deadline_reached_wakes_the_worker_once() {
        let state = Arc::new(NotifyState::default());
        assert!(state.set_deadline(Some(Instant::now())));
        let (waker, wakes) = counting_waker();
        let script = Script {
            // Its wait times out; a later spurious return must not wake the worker again.
            outcomes: RefCell::new(vec![Ok(Wait::default()), Ok(Wait::default())]),
            asked: RefCell::new(Vec::new()),
            watched: RefCell::new(Vec::new()),
            before: Box::new(|_| {}),
        };
        run(&script, &state, &waker);
        assert_eq!(*script.asked.borrow(), vec![Some(Duration::ZERO), None]);
        assert_eq!(wakes.load(Ordering::SeqCst), 1);
    }

    #[test]
    fn a_deadline_not_reached_wakes_nobody_and_a_changed_one_is_picked_up_after_the_kick() {
        let state = Arc::new(NotifyState::default());
        let hour = Duration::from_secs(3600);
        assert!(state.set_deadline(Some(Instant::now() + hour)));
        let (waker, wakes) = counting_waker();
        let domain = state.clone();
        let script = Script {
            // Woken early (the wait rounds to milliseconds): nobody is woken. The Domain then
            // publishes a deadline already due and kicks; the next wait is for it.
            outcomes: RefCell::new(vec![Ok(Wait::default()), Ok(KICK), Ok(Wait::default())]),
            asked: RefCell::new(Vec::new()),
            watched: RefCell::new(Vec::new()),
            before: Box::new(move |step| {
                if step == 1 {
                    assert!(domain.set_deadline(Some(Instant::now())), "changed: kick");
                }
            }),
        };
        run(&script, &state, &waker);
        let asked = script.asked.borrow();
        assert!(asked[0].is_some_and(|t| t > hour - Duration::from_secs(60)));
        assert!(asked[1].is_some_and(|t| t > hour - Duration::from_secs(60)));
        assert_eq!(asked[2], Some(Duration::ZERO));
        assert_eq!(wakes.load(Ordering::SeqCst), 1);
    }

    #[test]
    fn publishing_the_same_deadline_asks_for_no_kick() {
        let state = NotifyState::default();
        let at = Instant::now() + Duration::from_secs(5);
        assert!(!state.set_deadline(None), "none, as before");
        assert!(state.set_deadline(Some(at)));
        assert!(!state.set_deadline(Some(at)));
        assert_eq!(state.deadline(), Some(at));
        assert!(state.set_deadline(Some(at + Duration::from_secs(1))));
        assert!(state.set_deadline(None));
        assert_eq!(state.deadline(), None);
    }

    #[test]
    fn a_channel_that_fails_degrades_to_waking_on_an_interval() {
        let state = NotifyState::default();
        state.armed.store(true, Ordering::SeqCst);
        let (waker, wakes) = counting_waker();
        let script = Script {
            outcomes: RefCell::new(vec![Err("EBADF".into()), Err("EBADF".into())]),
            asked: RefCell::new(Vec::new()),
            watched: RefCell::new(Vec::new()),
            before: Box::new(|_| {}),
        };
        run(&script, &state, &waker);
        assert_eq!(wakes.load(Ordering::SeqCst), 2);
        assert!(!state.armed.load(Ordering::SeqCst));
    }
}
