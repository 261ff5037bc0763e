//! The submission queue: caller threads push commands, the worker takes all of them at once.
//!
//! A deque behind a mutex, swapped whole with the worker's (emptied) batch: a push is an
//! uncontended lock and a move into capacity left by earlier batches, and the worker takes
//! everything queued with one lock. Once both deques have grown to the largest batch seen,
//! nothing is allocated per command. (The lock-free segment queue used before allocated and
//! zeroed a 31-slot block every 31 commands: ~300 of a single write's ~3,150 instructions,
//! issue 29.) The lock is held only to move a command or swap two deques, never across
//! anything that waits, so a callback that submits cannot deadlock against the worker.

use std::collections::VecDeque;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Mutex, MutexGuard};

/// Slots an emptied batch keeps when it is swapped back in: a burst's deques (up to
/// `worker.max_outstanding` commands, 128 bytes each) are not held for the engine's life.
const KEPT_CAPACITY: usize = 1024;

/// Unbounded multi-producer queue with one consumer that takes whole batches.
pub(crate) struct SubmissionQueue<T> {
    incoming: Mutex<VecDeque<T>>,
    /// Whether `incoming` may hold something: set under the lock by every push, cleared under
    /// it when a batch is taken. A worker pass that finds it clear takes nothing without
    /// locking (most passes of a waiting worker: ~50 instructions each, a ping-pong's
    /// every one-way crossed one or two of them).
    maybe_pushed: AtomicBool,
}

impl<T> SubmissionQueue<T> {
    pub(crate) fn new() -> Self {
        Self {
            incoming: Mutex::new(VecDeque::new()),
            maybe_pushed: AtomicBool::new(false),
        }
    }

    fn incoming(&self) -> MutexGuard<'_, VecDeque<T>> {
        // Only moves happen under the lock: a poisoned deque is still a valid one.
        self.incoming.lock().unwrap_or_else(|p| p.into_inner())
    }

    #[inline(always)]
    pub(crate) fn push(&self, item: T) {
        let mut incoming = self.incoming();
        incoming.push_back(item);
        self.maybe_pushed.store(true, Ordering::Release);
    }

    /// Moves everything queued to the back of `batch`, in order. An empty `batch` is swapped
    /// in whole, so its capacity serves the next pushes. Returns whether anything moved.
    ///
    /// A push that races this call may be missed (it is taken by the next): the worker looks
    /// with [`is_empty`](Self::is_empty), under the lock, before it parks.
    pub(crate) fn take_into(&self, batch: &mut VecDeque<T>) -> bool {
        if !self.maybe_pushed.load(Ordering::Acquire) {
            return false;
        }
        let mut incoming = self.incoming();
        self.maybe_pushed.store(false, Ordering::Relaxed);
        if incoming.is_empty() {
            return false;
        }
        if batch.is_empty() {
            // Shrinking reallocates, so only after a burst, never in steady state.
            if batch.capacity() > KEPT_CAPACITY {
                batch.shrink_to(KEPT_CAPACITY);
            }
            std::mem::swap(&mut *incoming, batch);
        } else {
            batch.append(&mut incoming);
        }
        true
    }

    /// The oldest queued item (the slow paths: draining at shutdown and after a failure).
    pub(crate) fn pop(&self) -> Option<T> {
        self.incoming().pop_front()
    }

    pub(crate) fn is_empty(&self) -> bool {
        self.incoming().is_empty()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::sync::Arc;

    #[test]
    fn batches_keep_the_order_of_pushes() {
        let queue = SubmissionQueue::new();
        let mut batch = VecDeque::new();
        assert!(!queue.take_into(&mut batch));
        (0..3).for_each(|i| queue.push(i));
        assert!(queue.take_into(&mut batch));
        // Taken while the batch still holds work: appended behind it.
        (3..5).for_each(|i| queue.push(i));
        assert!(queue.take_into(&mut batch));
        assert_eq!(batch, [0, 1, 2, 3, 4]);
        assert!(queue.is_empty());
        queue.push(5);
        assert_eq!(queue.pop(), Some(5));
        assert_eq!(queue.pop(), None);
    }

    #[test]
    fn a_push_after_an_empty_take_or_a_pop_is_taken() {
        let queue = SubmissionQueue::new();
        let mut batch = VecDeque::new();
        // Nothing pushed yet: taken without the lock, nothing moves.
        assert!(!queue.take_into(&mut batch));
        queue.push(1);
        assert_eq!(queue.pop(), Some(1));
        // Emptied by a pop: the hint is stale (set), and the take finds nothing.
        assert!(!queue.take_into(&mut batch));
        queue.push(2);
        assert!(queue.take_into(&mut batch));
        assert!(!queue.take_into(&mut batch));
        queue.push(3);
        assert!(queue.take_into(&mut batch));
        assert_eq!(batch, [2, 3]);
    }

    #[test]
    fn an_emptied_batch_lends_its_capacity_to_the_next_pushes() {
        let queue = SubmissionQueue::new();
        let mut batch = VecDeque::new();
        (0..100).for_each(|i| queue.push(i));
        queue.take_into(&mut batch);
        let grown = batch.capacity();
        batch.clear();
        queue.push(100);
        queue.take_into(&mut batch);
        // The grown deque went back to the queue: the next 100 pushes allocate nothing.
        assert_eq!(queue.incoming().capacity(), grown);
    }

    #[test]
    fn a_burst_does_not_keep_its_memory() {
        let queue = SubmissionQueue::new();
        let mut batch = VecDeque::new();
        (0..20 * KEPT_CAPACITY).for_each(|i| queue.push(i));
        queue.take_into(&mut batch);
        batch.clear();
        (0..3 * KEPT_CAPACITY).for_each(|i| queue.push(i));
        queue.take_into(&mut batch);
        // The burst's deque went back to the queue shrunk; the smaller one came out.
        assert!(queue.incoming().capacity() <= 2 * KEPT_CAPACITY);
        batch.clear();
        queue.push(0);
        queue.take_into(&mut batch);
        assert!(queue.incoming().capacity() <= 2 * KEPT_CAPACITY);
        assert!(batch.capacity() <= 2 * KEPT_CAPACITY);
    }

    #[test]
    fn concurrent_producers_lose_nothing_and_keep_their_own_order() {
        let queue = Arc::new(SubmissionQueue::new());
        let producers: Vec<_> = (0..4u64)
            .map(|p| {
                let queue = Arc::clone(&queue);
                std::thread::spawn(move || (0..10_000u64).for_each(|i| queue.push((p, i))))
            })
            .collect();
        let mut next = [0u64; 4];
        let mut batch = VecDeque::new();
        let mut seen = 0;
        while seen < 40_000 {
            queue.take_into(&mut batch);
            for (p, i) in batch.drain(..) {
                assert_eq!(i, next[p as usize], "producer {p} out of order");
                next[p as usize] += 1;
                seen += 1;
            }
        }
        producers.into_iter().for_each(|t| t.join().unwrap());
        assert!(queue.is_empty());
    }
}
