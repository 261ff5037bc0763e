//! Which connections the service serves, pure: no sockets, no clock.
//!
//! A connection is *unauthenticated* from its arrival until its greeting is done (the
//! `Hello` and, with a secret, the proof); then *authenticated*. The rules:
//!
//! - At most [`Limits::max_connections`] at once, of which at most
//!   [`Limits::max_unauthenticated`] unauthenticated, and of those at most
//!   [`Limits::max_unauthenticated_per_source`] from one address.
//! - A new connection beyond a cap takes the place of the oldest unauthenticated
//!   connection: its own address's oldest if that address is at its cap, else the oldest of
//!   all. An authenticated connection is never given up for a new one; when authenticated
//!   connections fill every slot, new ones are refused.
//!
//! So connections that never greet cannot lock anyone out: one address holds a few slots
//! at most (and churning them costs only its own), a client's greeting (a round trip or
//! two) is displaced only by that many newer arrivals from elsewhere, and the connections
//! that keep leases alive are never shed for strangers.

use std::collections::{BTreeMap, HashMap};
use std::net::IpAddr;

use super::Limits;

/// A connection's place, by id (ids only grow: a smaller id is an older connection).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
struct Entry {
    source: IpAddr,
    authenticated: bool,
}

/// The decision on a new connection.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) enum Admit {
    /// Served under `id`; `evict`, if any, is to be closed to make its room.
    Yes { id: u64, evict: Option<u64> },
    /// Every slot holds an authenticated connection.
    No,
}

#[derive(Debug)]
pub(super) struct Admission {
    max: usize,
    max_unauthenticated: usize,
    per_source: usize,
    open: BTreeMap<u64, Entry>,
    /// Unauthenticated connections by source (the count of its entries in `open`).
    unauthenticated: HashMap<IpAddr, usize>,
    next: u64,
}

impl Admission {
    pub(super) fn new(limits: &Limits) -> Self {
        Self {
            max: limits.max_connections,
            max_unauthenticated: limits.max_unauthenticated.min(limits.max_connections),
            per_source: limits.max_unauthenticated_per_source,
            open: BTreeMap::new(),
            unauthenticated: HashMap::new(),
            next: 0,
        }
    }

    /// Connections served now.
    pub(super) fn len(&self) -> usize {
        self.open.len()
    }

    fn unauthenticated_total(&self) -> usize {
        self.unauthenticated.values().sum()
    }

    /// The oldest unauthenticated connection, from `source` if given.
    fn oldest_unauthenticated(&self, source: Option<IpAddr>) -> Option<u64> {
        self.open
            .iter()
            .find(|(_, e)| !e.authenticated && source.is_none_or(|s| s == e.source))
            .map(|(id, _)| *id)
    }

    /// A connection arrives from `source`.
    pub(super) fn handle_arrival(&mut self, source: IpAddr) -> Admit {
        let from_source = self.unauthenticated.get(&source).copied().unwrap_or(0);
        let evict = if from_source >= self.per_source {
            self.oldest_unauthenticated(Some(source))
        } else if self.unauthenticated_total() >= self.max_unauthenticated
            || self.open.len() >= self.max
        {
            match self.oldest_unauthenticated(None) {
                Some(id) => Some(id),
                None => return Admit::No,
            }
        } else {
            None
        };
        if let Some(victim) = evict {
            self.handle_close(victim);
        }
        // A cap of 0 (unauthenticated, or per source) leaves nothing to evict: refused.
        if self.open.len() >= self.max
            || self.unauthenticated_total() >= self.max_unauthenticated
            || self.unauthenticated.get(&source).copied().unwrap_or(0) >= self.per_source
        {
            return Admit::No;
        }
        let id = self.next;
        self.next += 1;
        self.open.insert(
            id,
            Entry {
                source,
                authenticated: false,
            },
        );
        *self.unauthenticated.entry(source).or_default() += 1;
        Admit::Yes { id, evict }
    }

    /// Connection `id` finished its greeting. `false`: it is no longer served (a newer
    /// connection took its place meanwhile) and is to be closed.
    pub(super) fn handle_authenticated(&mut self, id: u64) -> bool {
        let Some(entry) = self.open.get_mut(&id) else {
            return false;
        };
        if !entry.authenticated {
            entry.authenticated = true;
            let source = entry.source;
            self.forget_unauthenticated(source);
        }
        true
    }

    /// Connection `id` ended (or was evicted). Closing one twice is harmless.
    pub(super) fn handle_close(&mut self, id: u64) {
        if let Some(e) = self.open.remove(&id) {
            if !e.authenticated {
                self.forget_unauthenticated(e.source);
            }
        }
    }

    fn forget_unauthenticated(&mut self, source: IpAddr) {
        if let Some(n) = self.unauthenticated.get_mut(&source) {
            *n -= 1;
            if *n == 0 {
                self.unauthenticated.remove(&source);
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn ip(n: u8) -> IpAddr {
        IpAddr::from([10, 0, 0, n])
    }

    fn admission(max: usize, unauthenticated: usize, per_source: usize) -> Admission {
        Admission::new(&Limits {
            max_connections: max,
            max_unauthenticated: unauthenticated,
            max_unauthenticated_per_source: per_source,
            ..Limits::default()
        })
    }

    fn admitted(a: &mut Admission, source: IpAddr) -> (u64, Option<u64>) {
        match a.handle_arrival(source) {
            Admit::Yes { id, evict } => (id, evict),
            Admit::No => panic!("refused {source}: {a:?}"),
        }
    }

    /// One address holds its cap at most; its next connection replaces its own oldest,
    /// and another address's connections are untouched.
    #[test]
    fn one_address_holds_its_cap_and_churns_only_its_own() {
        let mut a = admission(100, 50, 3);
        let other = admitted(&mut a, ip(2)).0;
        let ids: Vec<u64> = (0..3).map(|_| admitted(&mut a, ip(1)).0).collect();
        for round in 0..10 {
            let (_, evict) = admitted(&mut a, ip(1));
            assert_eq!(evict, Some(ids[0] + round), "its own oldest");
            assert_eq!(a.len(), 4);
        }
        assert!(a.open.contains_key(&other));
    }

    /// Unauthenticated connections from many addresses fill their share; a new one takes
    /// the oldest's place; authenticated connections keep theirs and keep the rest of the
    /// slots.
    #[test]
    fn strangers_never_displace_an_authenticated_connection() {
        let mut a = admission(6, 3, 2);
        let members: Vec<u64> = (0..2)
            .map(|n| {
                let (id, _) = admitted(&mut a, ip(100 + n));
                assert!(a.handle_authenticated(id));
                id
            })
            .collect();
        for n in 0..50 {
            let _ = admitted(&mut a, ip(n));
            assert!(a.unauthenticated_total() <= 3 && a.len() <= 5);
            assert!(members.iter().all(|m| a.open.contains_key(m)));
        }
        // A member's slot is still there for it, and a member that reconnects gets in.
        let (id, evict) = admitted(&mut a, ip(100));
        assert!(evict.is_some_and(|v| !members.contains(&v)));
        assert!(a.handle_authenticated(id));
    }

    /// With every slot full, a newcomer takes an unauthenticated connection's place; when
    /// all slots are authenticated, it is refused.
    #[test]
    fn a_full_service_evicts_strangers_then_refuses() {
        let mut a = admission(3, 3, 3);
        let (first, _) = admitted(&mut a, ip(1));
        let (second, _) = admitted(&mut a, ip(2));
        assert!(a.handle_authenticated(second));
        let (third, _) = admitted(&mut a, ip(3));
        assert_eq!(admitted(&mut a, ip(4)).1, Some(first));
        assert!(!a.handle_authenticated(first), "evicted: to be closed");
        assert_eq!(admitted(&mut a, ip(5)).1, Some(third));
        let ids: Vec<u64> = a.open.keys().copied().collect();
        for id in ids {
            a.handle_authenticated(id);
        }
        assert_eq!(a.handle_arrival(ip(6)), Admit::No);
        a.handle_close(second);
        a.handle_close(second);
        assert_eq!(admitted(&mut a, ip(6)).1, None);
        assert_eq!(a.len(), 3);
    }

    /// Caps of zero refuse rather than loop or evict the newcomer itself.
    #[test]
    fn zero_caps_refuse() {
        assert_eq!(admission(0, 1, 1).handle_arrival(ip(1)), Admit::No);
        assert_eq!(admission(4, 0, 1).handle_arrival(ip(1)), Admit::No);
        assert_eq!(admission(4, 1, 0).handle_arrival(ip(1)), Admit::No);
    }
}
