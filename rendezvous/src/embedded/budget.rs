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

/// Why bytes could not be reserved.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) enum OverBudget {
    /// More than one connection may hold, whatever else is held: asking again does not help.
    Connection { bytes: u64, budget: u64 },
    /// The service holds its budget for other connections (clients that have not taken
    /// their answers): it frees as they read or are cut off.
    Service { bytes: u64, held: u64, budget: u64 },
}

/// The service's bytes held, and its budget.
#[derive(Debug)]
pub(super) struct Budget {
    held: AtomicU64,
    limit: u64,
    per_connection: u64,
}

impl Budget {
    pub(super) fn new(limits: &Limits) -> Arc<Self> {
        Arc::new(Self {
            held: AtomicU64::new(0),
            limit: limits.max_pending_bytes as u64,
            per_connection: limits.max_pending_bytes_per_connection as u64,
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

/// Adds `bytes` to `counter` unless that passes `limit`; the total before, as `Err`, if so.
fn add_within(counter: &AtomicU64, bytes: u64, limit: u64) -> Result<(), u64> {
    counter
        .fetch_update(Ordering::AcqRel, Ordering::Acquire, |held| {
            held.checked_add(bytes).filter(|&total| total <= limit)
        })
        .map(drop)
}

/// One connection's bytes held (its answer being written, its watch queue).
#[derive(Debug)]
pub(super) struct Account {
    budget: Arc<Budget>,
    held: AtomicU64,
}

impl Account {
    /// Reserves `bytes` within this connection's budget and the service's.
    pub(super) fn reserve(self: &Arc<Self>, bytes: u64) -> Result<Held, OverBudget> {
        let per_connection = self.budget.per_connection;
        add_within(&self.held, bytes, per_connection).map_err(|_| OverBudget::Connection {
            bytes,
            budget: per_connection,
        })?;
        if let Err(held) = add_within(&self.budget.held, bytes, self.budget.limit) {
            self.held.fetch_sub(bytes, Ordering::AcqRel);
            return Err(OverBudget::Service {
                bytes,
                held,
                budget: self.budget.limit,
            });
        }
        Ok(Held {
            account: Arc::clone(self),
            bytes,
        })
    }

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

    fn budget(total: usize, per_connection: usize) -> Arc<Budget> {
        Budget::new(&Limits {
            max_pending_bytes: total,
            max_pending_bytes_per_connection: per_connection,
            ..Limits::default()
        })
    }

    #[test]
    fn reservations_stay_within_both_budgets_and_come_back_when_dropped() {
        let b = budget(100, 60);
        let (one, two) = (b.account(), b.account());
        let a = one.reserve(50).unwrap();
        assert_eq!(
            one.reserve(20).unwrap_err(),
            OverBudget::Connection {
                bytes: 20,
                budget: 60
            }
        );
        let c = two.reserve(40).unwrap();
        assert_eq!(
            two.reserve(20).unwrap_err(),
            OverBudget::Service {
                bytes: 20,
                held: 90,
                budget: 100
            }
        );
        // A refused reservation leaves nothing behind.
        assert_eq!((b.held(), one.held.load(Ordering::Acquire)), (90, 50));
        drop(a);
        let d = two.reserve(20).unwrap();
        assert_eq!(b.held(), 60);
        drop((c, d));
        assert_eq!(b.held(), 0);
        // Unlimited holds are counted all the same.
        let h = one.hold(1000);
        assert_eq!(b.held(), 1000);
        assert!(one.reserve(1).is_err());
        drop(h);
        assert_eq!(b.held(), 0);
    }

    #[test]
    fn an_absurd_size_is_refused_not_wrapped() {
        let b = budget(100, 100);
        let a = b.account();
        let _h = a.reserve(10).unwrap();
        assert!(matches!(
            a.reserve(u64::MAX),
            Err(OverBudget::Connection { .. })
        ));
        assert_eq!(b.held(), 10);
    }
}
