//! Commands a worker's own thread submits to its own engine — what its flag wakers and
//! callbacks run during delivery submit, a reactive answer — kept on that thread: the worker
//! takes them up in the same pass, after delivering, with no lock, no wake and no clock read
//! of their own (they are stamped with the batch's). Any other thread, or a worker
//! submitting to another engine, goes through the shared queue as before.
//!
//! Only the worker's thread ever pushes here or takes from here, so nothing here can miss a
//! wake-up: the worker looks here after every delivery and before it parks.

use std::cell::{Cell, RefCell};
use std::collections::VecDeque;

use super::clock::Stamp;
use super::{Command, Shared};

thread_local! {
    /// The engine (its `Shared`'s address, compared, never followed) whose worker this
    /// thread is; 0 on every other thread. Plain cells with no destructor: reading one is a
    /// load, so a submission from any other thread pays one load and a compare.
    static OWNER: Cell<usize> = const { Cell::new(0) };
    /// Whether `KEPT` may hold commands (the worker's pass looks at this first).
    static ANY_KEPT: Cell<bool> = const { Cell::new(false) };
    /// What this thread, as the worker, submitted to its own engine.
    static KEPT: RefCell<VecDeque<Command>> = const { RefCell::new(VecDeque::new()) };
}

/// Marks this thread as `shared`'s worker (until [`leave`]).
pub(super) fn enter(shared: &Shared) {
    OWNER.set(std::ptr::from_ref(shared) as usize);
}

/// This thread is no longer a worker; returns what was still kept (nothing, once the worker
/// failed or shut down everything it held).
pub(super) fn leave() -> VecDeque<Command> {
    OWNER.set(0);
    ANY_KEPT.set(false);
    KEPT.try_with(|kept| std::mem::take(&mut *kept.borrow_mut()))
        .unwrap_or_default()
}

/// Keeps the command `make` makes when this thread is `shared`'s worker (stamped later, by
/// [`take_into`]); else hands `make` back, for the shared queue.
#[inline(always)]
pub(super) fn push<F: FnOnce(Stamp) -> Command>(shared: &Shared, make: F) -> Result<(), F> {
    if OWNER.get() != std::ptr::from_ref(shared) as usize {
        return Err(make);
    }
    // The owner is set only while the worker runs, long before this thread's thread-locals
    // are destroyed. Stamped by `take_into` with the clock read of the batch it joins.
    KEPT.with_borrow_mut(|kept| kept.push_back(make(Stamp::default())));
    ANY_KEPT.set(true);
    Ok(())
}

/// Whether this thread is `shared`'s worker.
#[inline]
pub(super) fn is_worker_of(shared: &Shared) -> bool {
    OWNER.get() == std::ptr::from_ref(shared) as usize
}

/// Whether this thread's worker kept commands.
#[inline]
pub(super) fn is_empty() -> bool {
    !ANY_KEPT.get()
}

/// Moves the kept commands to the back of `batch`, each stamped `now`; returns whether any
/// moved. An empty `batch` is swapped in whole, its capacity kept for the next pushes.
#[inline]
pub(super) fn take_into(batch: &mut VecDeque<Command>, now: impl FnOnce() -> Stamp) -> bool {
    if !ANY_KEPT.replace(false) {
        return false;
    }
    let now = now();
    KEPT.with_borrow_mut(|kept| {
        kept.iter_mut().for_each(|cmd| cmd.stamp(now));
        if batch.is_empty() {
            std::mem::swap(kept, batch);
        } else {
            batch.append(kept);
        }
    });
    true
}
