//! The fabric's clock: one process-wide thread that lands scheduled operations when they are
//! due (delay, jitter and reordering come from the order it is given), and holds back those
//! aimed at a frozen NIC.

use std::cmp::Reverse;
use std::collections::BinaryHeap;
use std::sync::atomic::Ordering;
use std::sync::{Condvar, LazyLock, Mutex};
use std::time::{Duration, Instant};

use super::{land, locked, Posted};

/// An operation waiting for its time on the progress thread.
struct Scheduled {
    due: Instant,
    /// Breaks ties: posting order, or a random draw when reordering.
    order: u64,
    posted: Posted,
}

impl PartialEq for Scheduled {
    fn eq(&self, other: &Self) -> bool {
        (self.due, self.order) == (other.due, other.order)
    }
}
impl Eq for Scheduled {}
impl PartialOrd for Scheduled {
    fn partial_cmp(&self, other: &Self) -> Option<std::cmp::Ordering> {
        Some(self.cmp(other))
    }
}
impl Ord for Scheduled {
    fn cmp(&self, other: &Self) -> std::cmp::Ordering {
        (self.due, self.order).cmp(&(other.due, other.order))
    }
}

/// The fabric's clock: one thread that lands operations when they are due.
struct Progress {
    queue: Mutex<BinaryHeap<Reverse<Scheduled>>>,
    ready: Condvar,
}

static PROGRESS: LazyLock<&'static Progress> = LazyLock::new(|| {
    let progress: &'static Progress = Box::leak(Box::new(Progress {
        queue: Mutex::new(BinaryHeap::new()),
        ready: Condvar::new(),
    }));
    std::thread::Builder::new()
        .name("xfer-mock-fabric".into())
        .spawn(move || progress.run())
        .expect("cannot start the mock fabric's progress thread");
    progress
});

/// Operations aimed at a frozen NIC are looked at again this often.
const FROZEN_RETRY: Duration = Duration::from_millis(1);

impl Progress {
    fn run(&self) {
        let mut due = Vec::new();
        loop {
            {
                let mut queue = locked(&self.queue);
                loop {
                    let now = Instant::now();
                    match queue.peek() {
                        Some(Reverse(next)) if next.due <= now => break,
                        Some(Reverse(next)) => {
                            let wait = next.due - now;
                            queue = self
                                .ready
                                .wait_timeout(queue, wait)
                                .unwrap_or_else(|p| p.into_inner())
                                .0;
                        }
                        None => {
                            queue = self.ready.wait(queue).unwrap_or_else(|p| p.into_inner());
                        }
                    }
                }
                let now = Instant::now();
                while queue.peek().is_some_and(|Reverse(s)| s.due <= now) {
                    due.push(queue.pop().expect("peeked").0);
                }
            }
            for mut s in due.drain(..) {
                let frozen = s
                    .posted
                    .conn
                    .target()
                    .is_some_and(|t| t.frozen.load(Ordering::Acquire));
                if frozen && s.posted.src.alive.load(Ordering::Acquire) {
                    s.due = Instant::now() + FROZEN_RETRY;
                    locked(&self.queue).push(Reverse(s));
                    continue;
                }
                land(s.posted);
            }
        }
    }
}

/// Hands an operation to the fabric, to land at `due`.
pub(crate) fn schedule(posted: Posted, due: Instant, order: u64) {
    let progress = *PROGRESS;
    locked(&progress.queue).push(Reverse(Scheduled { due, order, posted }));
    progress.ready.notify_one();
}
