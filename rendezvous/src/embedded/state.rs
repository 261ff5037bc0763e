//! The service's state, pure: keys with their leases, lease expiry, watchers' queues. Every
//! request is one call of [`State::handle`] under the server's lock.

use std::collections::{BTreeMap, BTreeSet, HashMap};
use std::sync::mpsc::{SyncSender, TrySendError};
use std::sync::Arc;
use std::time::{Duration, Instant};

use super::budget::{Account, Held};
use super::wire::{Request, Response};
use super::{Limits, MAX_TTL, MAX_VALUE};
use crate::Change;

struct Lease {
    ttl: Duration,
    deadline: Instant,
    keys: BTreeSet<String>,
}

/// A change queued for a watcher, with the bytes it holds counted against the watcher's
/// connection and the service.
pub(super) type Queued = (Change, Held);

/// A watch: its prefix, its queue, and the account its queued changes are counted in.
struct Watcher {
    prefix: String,
    tx: SyncSender<Queued>,
    account: Arc<Account>,
}

/// The bytes a queued change holds.
fn change_bytes(change: &Change) -> u64 {
    let (key, value) = match change {
        Change::Put(k, v) => (k, v.len()),
        Change::Delete(k) => (k, 0),
    };
    (key.len() + value + 16) as u64
}

pub(super) struct State {
    entries: BTreeMap<String, (Vec<u8>, u64)>,
    leases: HashMap<u64, Lease>,
    /// Watches by id.
    watchers: BTreeMap<u64, Watcher>,
    next_watcher: u64,
    pub(super) limits: Limits,
}

impl Default for State {
    fn default() -> Self {
        Self::new(Limits::default())
    }
}

/// A new lease id: 64 bits from the OS's CSPRNG, never 0.
fn new_lease_id() -> u64 {
    loop {
        let mut bytes = [0u8; 8];
        if getrandom::fill(&mut bytes).is_err() {
            // No OS randomness (never seen on Linux): still unique per run, not secret.
            return fastrand::u64(1..);
        }
        let id = u64::from_le_bytes(bytes);
        if id != 0 {
            return id;
        }
    }
}

impl State {
    pub(super) fn new(limits: Limits) -> Self {
        Self {
            entries: BTreeMap::new(),
            leases: HashMap::new(),
            watchers: BTreeMap::new(),
            next_watcher: 0,
            limits,
        }
    }

    /// A new watch of `prefix` with its queue, unless the service serves its maximum; its
    /// id gives the slot back ([`end_watch`](Self::end_watch)).
    pub(super) fn start_watch(
        &mut self,
        prefix: String,
        tx: SyncSender<Queued>,
        account: Arc<Account>,
    ) -> Option<u64> {
        if self.watchers.len() >= self.limits.max_watchers {
            return None;
        }
        let id = self.next_watcher;
        self.next_watcher += 1;
        self.watchers.insert(
            id,
            Watcher {
                prefix,
                tx,
                account,
            },
        );
        Some(id)
    }

    /// Watches served now.
    pub(super) fn watching(&self) -> usize {
        self.watchers.len()
    }

    /// The watch ended (its stream broke, its client left, or it fell behind): its slot is
    /// free at once, whether or not a key under its prefix ever changes.
    pub(super) fn end_watch(&mut self, id: u64) {
        self.watchers.remove(&id);
    }

    fn notify(&mut self, change: &Change) {
        let key = match change {
            Change::Put(k, _) | Change::Delete(k) => k,
        };
        // A watcher whose queue is full, in changes or in bytes, has fallen behind: it is
        // cut off (its stream ends), not buffered for without bound.
        let bytes = change_bytes(change);
        self.watchers.retain(|_, w| {
            if !key.starts_with(w.prefix.as_str()) {
                return true;
            }
            // Past its connection's byte budget (or the service's), it is cut off too.
            let Ok(held) = w.account.reserve(bytes) else {
                return false;
            };
            match w.tx.try_send((change.clone(), held)) {
                Ok(()) => true,
                Err(TrySendError::Full(_) | TrySendError::Disconnected(_)) => false,
            }
        });
    }

    fn revoke(&mut self, lease: u64) {
        let Some(l) = self.leases.remove(&lease) else {
            return;
        };
        for key in l.keys {
            if self
                .entries
                .get(&key)
                .is_some_and(|(_, owner)| *owner == lease)
            {
                self.entries.remove(&key);
                self.notify(&Change::Delete(key));
            }
        }
    }

    /// The entries under `prefix`, where they lie: the server encodes a listing from these
    /// (within its byte budget) rather than cloning every value into an answer first.
    pub(super) fn list<'a>(
        &'a self,
        prefix: &'a str,
    ) -> impl Iterator<Item = (&'a str, &'a [u8])> + Clone + 'a {
        self.entries
            .range::<str, _>((
                std::ops::Bound::Included(prefix),
                std::ops::Bound::Unbounded,
            ))
            .take_while(move |(k, _)| k.starts_with(prefix))
            .map(|(k, (v, _))| (k.as_str(), v.as_slice()))
    }

    pub(super) fn handle(&mut self, req: Request) -> Response {
        match req {
            Request::Put {
                key,
                value,
                ttl_ms,
                owner,
            } => {
                if value.len() > MAX_VALUE {
                    return Response::Refused(format!(
                        "a value of {} bytes (at most {MAX_VALUE})",
                        value.len()
                    ));
                }
                if !self.entries.contains_key(&key) && self.entries.len() >= self.limits.max_entries
                {
                    return Response::Refused(format!(
                        "the service holds its maximum of {} keys",
                        self.limits.max_entries
                    ));
                }
                // A key belongs to the live lease that wrote it: only that lease's holder
                // (who alone knows its id) may write it again.
                if let Some(&(_, holder)) = self.entries.get(&key) {
                    if owner != Some(holder) {
                        return Response::Taken;
                    }
                    // The key moves to the new lease; the old one, now empty, ends quietly.
                    if let Some(l) = self.leases.get_mut(&holder) {
                        l.keys.remove(&key);
                        if l.keys.is_empty() {
                            self.leases.remove(&holder);
                        }
                    }
                }
                let lease = new_lease_id();
                let ttl = Duration::from_millis(ttl_ms.max(1)).min(MAX_TTL);
                self.leases.insert(
                    lease,
                    Lease {
                        ttl,
                        deadline: Instant::now() + ttl,
                        keys: BTreeSet::from([key.clone()]),
                    },
                );
                self.entries.insert(key.clone(), (value.clone(), lease));
                self.notify(&Change::Put(key, value));
                Response::Lease(lease)
            }
            Request::KeepAlive { lease } => match self.leases.get_mut(&lease) {
                Some(l) => {
                    l.deadline = Instant::now() + l.ttl;
                    Response::Ok
                }
                None => Response::NoLease,
            },
            Request::Revoke { lease } => {
                self.revoke(lease);
                Response::Ok
            }
            Request::Get { key } => Response::Value(self.entries.get(&key).map(|(v, _)| v.clone())),
            // The server answers listings itself, from `list`, within its byte budget; this
            // owned answer serves the tests.
            Request::List { prefix } => Response::Values(
                self.list(&prefix)
                    .map(|(k, v)| (k.to_owned(), v.to_vec()))
                    .collect(),
            ),
            Request::Watch { .. } => Response::Refused("watch on a request connection".into()),
            Request::Hello { .. } | Request::Prove { .. } => {
                Response::Refused("a greeting on a connection already greeted".into())
            }
        }
    }

    pub(super) fn expire(&mut self, now: Instant) {
        let expired: Vec<u64> = self
            .leases
            .iter()
            .filter(|(_, l)| l.deadline <= now)
            .map(|(id, _)| *id)
            .collect();
        for lease in expired {
            self.revoke(lease);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn leases_expire_and_a_replaced_key_outlives_its_old_lease() {
        let mut s = State::default();
        let Response::Lease(old) = s.handle(Request::Put {
            key: "/x/a".into(),
            value: b"1".to_vec(),
            ttl_ms: 10,
            owner: None,
        }) else {
            panic!()
        };
        let Response::Lease(_new) = s.handle(Request::Put {
            key: "/x/a".into(),
            value: b"2".to_vec(),
            ttl_ms: 60_000,
            owner: Some(old),
        }) else {
            panic!()
        };
        s.expire(Instant::now() + Duration::from_millis(20));
        assert!(matches!(
            s.handle(Request::KeepAlive { lease: old }),
            Response::NoLease
        ));
        assert!(
            matches!(s.handle(Request::Get { key: "/x/a".into() }), Response::Value(Some(v)) if v == b"2")
        );
        s.expire(Instant::now() + Duration::from_secs(61));
        assert!(matches!(
            s.handle(Request::Get { key: "/x/a".into() }),
            Response::Value(None)
        ));
    }

    fn put(s: &mut State, key: &str, value: &[u8], owner: Option<u64>) -> Response {
        s.handle(Request::Put {
            key: key.into(),
            value: value.to_vec(),
            ttl_ms: 1000,
            owner,
        })
    }

    /// Issue 25 §1: any client could put over another's key. A key belongs to the live lease
    /// that wrote it; its holder (who alone knows the lease id) may write it again; once the
    /// lease ends, anyone may take the name, and the old holder's stale claim is refused.
    #[test]
    fn a_key_belongs_to_the_lease_that_wrote_it() {
        let mut s = State::default();
        let Response::Lease(mine) = put(&mut s, "/x/a", b"mine", None) else {
            panic!()
        };
        assert!(matches!(
            put(&mut s, "/x/a", b"evil", None),
            Response::Taken
        ));
        assert!(matches!(
            put(&mut s, "/x/a", b"evil", Some(mine ^ 1)),
            Response::Taken
        ));
        let Response::Lease(again) = put(&mut s, "/x/a", b"mine-2", Some(mine)) else {
            panic!()
        };
        // The old lease ended with the move: it cannot be kept alive or claim the key.
        assert!(matches!(
            s.handle(Request::KeepAlive { lease: mine }),
            Response::NoLease
        ));
        assert!(matches!(
            put(&mut s, "/x/a", b"x", Some(mine)),
            Response::Taken
        ));
        // Its lease expired (the holder died): the name is free for anyone.
        s.expire(Instant::now() + Duration::from_secs(2));
        let Response::Lease(theirs) = put(&mut s, "/x/a", b"theirs", None) else {
            panic!()
        };
        // The old holder, re-publishing with the lease it knew, is told it was taken.
        assert!(matches!(
            put(&mut s, "/x/a", b"x", Some(again)),
            Response::Taken
        ));
        assert!(matches!(
            s.handle(Request::Revoke { lease: again }),
            Response::Ok
        ));
        assert!(
            matches!(s.handle(Request::Get { key: "/x/a".into() }), Response::Value(Some(v)) if v == b"theirs")
        );
        assert_ne!(theirs, again);
    }

    /// Issue 25: lease ids were sequential from 1 in every run, so a keeper of the old run
    /// got `Ok` for someone else's lease after a restart and its drop revoked another peer's
    /// record. Two runs never hand out the same id, and none is guessable from another.
    #[test]
    fn two_runs_never_hand_out_the_same_lease_id() {
        let leases = |s: &mut State| -> Vec<u64> {
            (0..100)
                .map(|i| {
                    match s.handle(Request::Put {
                        key: format!("/x/{i}"),
                        value: vec![],
                        ttl_ms: 1000,
                        owner: None,
                    }) {
                        Response::Lease(l) => l,
                        other => panic!("{other:?}"),
                    }
                })
                .collect()
        };
        let (first, second) = (leases(&mut State::default()), leases(&mut State::default()));
        assert!(
            first.iter().all(|l| !second.contains(l)),
            "{first:?} {second:?}"
        );
        // Not a counter: consecutive ids are not neighbours.
        assert!(first.windows(2).all(|w| w[1].abs_diff(w[0]) > 1_000_000));
    }

    /// Issue 25: a TTL has a ceiling, so a client cannot keep a name alive for ever without
    /// keeping it alive.
    #[test]
    fn ttls_have_a_ceiling() {
        let mut s = State::default();
        s.handle(Request::Put {
            key: "/x/forever".into(),
            value: vec![],
            ttl_ms: u64::MAX,
            owner: None,
        });
        s.expire(Instant::now() + MAX_TTL + Duration::from_secs(1));
        assert!(matches!(
            s.handle(Request::Get {
                key: "/x/forever".into()
            }),
            Response::Value(None)
        ));
    }

    /// Issue 42 §3: a watcher that does not take its changes is cut off when its queued
    /// bytes would pass its connection's budget, however few changes that is; what it held
    /// is given back when its queue goes.
    #[test]
    fn a_watch_queue_is_bounded_in_bytes() {
        let limits = Limits {
            max_pending_bytes_per_connection: 100_000,
            ..Limits::default()
        };
        let budget = crate::embedded::budget::Budget::new(&limits);
        let mut s = State::new(limits);
        let (tx, rx) = std::sync::mpsc::sync_channel(limits.watch_queue);
        let id = s
            .start_watch("/x/".into(), tx, budget.account())
            .expect("a slot");
        for i in 0..10 {
            put(&mut s, &format!("/x/{i}"), &[0; 30_000], None);
            assert!(budget.held() <= 100_000, "{} bytes", budget.held());
        }
        assert_eq!(s.watching(), 0, "cut off");
        assert_eq!(rx.try_iter().count(), 3);
        assert_eq!(budget.held(), 0);
        s.end_watch(id);
    }

    #[test]
    fn list_stays_inside_its_prefix() {
        let mut s = State::default();
        for k in ["/x/a", "/x/b", "/xa", "/y"] {
            s.handle(Request::Put {
                key: k.into(),
                value: vec![],
                ttl_ms: 1000,
                owner: None,
            });
        }
        let Response::Values(v) = s.handle(Request::List {
            prefix: "/x/".into(),
        }) else {
            panic!()
        };
        let keys: Vec<_> = v.into_iter().map(|(k, _)| k).collect();
        assert_eq!(keys, ["/x/a", "/x/b"]);
    }
}
