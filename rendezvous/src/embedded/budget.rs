//! Bytes the service holds for its clients, pure: answers being written and watch changes
//! queued, per connection and for the whole service, each within its budget
//! ([`Limits::max_pending_bytes_per_connection`], [`Limits::max_pending_bytes`]).
//!
//! What a client has been sent but not taken stays in the service's memory until the client
//! reads it or the write timeout cuts it off; without a budget, a listing of large values
//! asked by many clients that never read multiplies into gigabytes. A reservation is taken
//! before the bytes are (a listing's size is known from the lengths it holds, before a byte
//! is copied) and given back when they are dropped ([`Held`]).

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;

use super::Limits;

/// The service's bytes held, and its budget.
#[derive(Debug)]
pub(super) struct Budget {
    held: AtomicU64,
}

impl Budget {
    pub(super) fn new(_limits: &Limits) -> Arc<Self> {
        Arc::new(Self {
            held: AtomicU64::new(0),
        })
    }

    /// Bytes held now, by every connection.
    pub(super) fn held(&self) -> u64 {
        self.held.load(Ordering::Acquire)
    }

    /// A new connection's account.
    pub(super) fn account(self: &Arc<Self>) -> Arc<Account> {
        Arc::new(Account {
            budget: Arc::clone(self),
            held: AtomicU64::new(0),
        })
    }
}

/// One connection's bytes held (its answer being written, its watch queue).
#[derive(Debug)]
pub(super) struct Account {
    budget: Arc<Budget>,
    held: AtomicU64,
}

impl Account {
    /// Counts `bytes` without a limit: answers of one value at most (a lookup, a lease, a
    /// keep-alive), which the connection cap bounds, are never refused for want of memory
    /// that listings hold.
    pub(super) fn hold(self: &Arc<Self>, bytes: u64) -> Held {
        self.held.fetch_add(bytes, Ordering::AcqRel);
        self.budget.held.fetch_add(bytes, Ordering::AcqRel);
        Held {
            account: Arc::clone(self),
            bytes,
        }
    }
}

/// Bytes counted as held until this is dropped.
#[derive(Debug)]
pub(super) struct Held {
    account: Arc<Account>,
    bytes: u64,
}

impl Drop for Held {
    fn drop(&mut self) {
        self.account.held.fetch_sub(self.bytes, Ordering::AcqRel);
        self.account
            .budget
            .held
            .fetch_sub(self.bytes, Ordering::AcqRel);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn holds_are_counted_until_dropped() {
        let b = Budget::new(&Limits::default());
        let (one, two) = (b.account(), b.account());
        let h = one.hold(1000);
        let g = two.hold(24);
        assert_eq!(b.held(), 1024);
        drop(h);
        assert_eq!((b.held(), one.held.load(Ordering::Acquire)), (24, 0));
        drop(g);
        assert_eq!(b.held(), 0);
    }
}
