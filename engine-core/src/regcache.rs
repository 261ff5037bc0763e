//! The registration cache: one NIC registration shared by every `reg_mr` of a range it
//! covers, as pure bookkeeping (no NIC, no threads; the engine wraps it in a mutex).
//!
//! Registering pins memory and programs every NIC, which takes tens of microseconds to
//! milliseconds per region; serving and training stacks register the same tensors again and
//! again (an RL weight sync each step, a connector per layer view of one KV-cache
//! allocation). A request whose range lies inside a live registration of the same memory kind
//! and the same remote access reuses it: a new handle, a reference more, no NIC call.
//!
//! **Only live registrations are cached.** A registration is deregistered when its last
//! handle is (`dereg_mr` promises that no NIC touches the memory after it returns, and the
//! memory may be freed right after), so nothing lingers and the cache needs no size bound
//! beyond the registrations the application holds. A range that only partly overlaps live
//! registrations gets its own registration (NICs allow overlapping ones), cached in turn.
//! Access must match exactly: reusing a read-write registration for a write-only request
//! would hand peers a read they were not given.

use std::collections::BTreeMap;

use foldhash::HashMap;

/// What distinguishes registrations that may be shared: memory kind and remote access.
pub type Kind = (crate::domain::Device, bool, bool);

/// Registrations by kind and start address, with a reference count each.
#[derive(Debug)]
pub struct RegistrationCache<R> {
    entries: HashMap<u64, Entry<R>>,
    by_kind: HashMap<Kind, Ranges>,
    next_id: u64,
}

#[derive(Debug)]
struct Entry<R> {
    kind: Kind,
    ptr: u64,
    len: u64,
    refs: usize,
    value: R,
}

/// The live registrations of one kind, by start address.
#[derive(Debug, Default)]
struct Ranges {
    by_start: BTreeMap<u64, Vec<u64>>,
    /// The longest registration ever added, so a lookup scans only starts that could cover.
    max_len: u64,
}

/// A registration found or added: its cache id, where it starts, and the shared value.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Hit<R> {
    /// Pass to [`RegistrationCache::release`] when the handle goes.
    pub id: u64,
    /// Start of the registration (a covered request starts at or after it).
    pub base: u64,
    /// The registration (the NIC keys).
    pub value: R,
}

impl<R> Default for RegistrationCache<R> {
    fn default() -> Self {
        Self {
            entries: HashMap::default(),
            by_kind: HashMap::default(),
            next_id: 1,
        }
    }
}

impl<R: Clone> RegistrationCache<R> {
    /// An empty cache.
    pub fn new() -> Self {
        Self::default()
    }

    /// A live registration of `kind` covering `[ptr, ptr + len)`, with one reference more;
    /// `None` if no registration covers the whole range.
    pub fn acquire(&mut self, kind: Kind, ptr: u64, len: u64) -> Option<Hit<R>> {
        let end = ptr.checked_add(len)?;
        let ranges = self.by_kind.get(&kind)?;
        if len > ranges.max_len {
            return None;
        }
        let lowest = end.saturating_sub(ranges.max_len);
        let id = ranges
            .by_start
            .range(lowest..=ptr)
            .rev()
            .flat_map(|(_, ids)| ids.iter())
            .copied()
            .find(|id| {
                let e = &self.entries[id];
                e.ptr + e.len >= end
            })?;
        let e = self.entries.get_mut(&id).expect("indexed entries exist");
        e.refs += 1;
        Some(Hit {
            id,
            base: e.ptr,
            value: e.value.clone(),
        })
    }

    /// Adds a new registration of `kind` at `[ptr, ptr + len)` with one reference.
    pub fn insert(&mut self, kind: Kind, ptr: u64, len: u64, value: R) -> Hit<R> {
        let id = self.next_id;
        self.next_id += 1;
        let ranges = self.by_kind.entry(kind).or_default();
        ranges.by_start.entry(ptr).or_default().push(id);
        ranges.max_len = ranges.max_len.max(len);
        self.entries.insert(
            id,
            Entry {
                kind,
                ptr,
                len,
                refs: 1,
                value: value.clone(),
            },
        );
        Hit {
            id,
            base: ptr,
            value,
        }
    }

    /// Drops one reference to registration `id`; returns its value when that was the last
    /// (the caller deregisters it), `None` while other handles use it or if `id` is unknown.
    pub fn release(&mut self, id: u64) -> Option<R> {
        let e = self.entries.get_mut(&id)?;
        e.refs -= 1;
        if e.refs > 0 {
            return None;
        }
        let e = self.entries.remove(&id).expect("just found");
        let ranges = self.by_kind.get_mut(&e.kind).expect("indexed by kind");
        if let Some(ids) = ranges.by_start.get_mut(&e.ptr) {
            ids.retain(|&x| x != id);
            if ids.is_empty() {
                ranges.by_start.remove(&e.ptr);
            }
        }
        if ranges.by_start.is_empty() {
            self.by_kind.remove(&e.kind);
        }
        Some(e.value)
    }

    /// Live registrations.
    pub fn len(&self) -> usize {
        self.entries.len()
    }

    /// Whether no registration is live.
    pub fn is_empty(&self) -> bool {
        self.entries.is_empty()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::domain::Device;

    const WRITE: Kind = (Device::Host, true, false);
    const READ: Kind = (Device::Host, false, true);

    #[test]
    fn a_covered_range_shares_the_registration_until_the_last_release() {
        let mut c = RegistrationCache::new();
        let whole = c.insert(WRITE, 1000, 100, "keys");
        let part = c.acquire(WRITE, 1010, 50).expect("covered");
        assert_eq!((part.id, part.base, part.value), (whole.id, 1000, "keys"));
        let again = c.acquire(WRITE, 1000, 100).expect("the same range");
        assert_eq!(again.id, whole.id);
        assert_eq!(c.release(whole.id), None);
        assert_eq!(c.release(whole.id), None);
        assert_eq!(
            c.release(whole.id),
            Some("keys"),
            "the last release deregisters"
        );
        assert!(c.is_empty());
        assert_eq!(c.acquire(WRITE, 1010, 50), None, "nothing lingers");
    }

    #[test]
    fn partial_overlaps_other_access_and_other_devices_do_not_match() {
        let mut c = RegistrationCache::new();
        c.insert(WRITE, 1000, 100, 1);
        assert_eq!(c.acquire(WRITE, 1050, 100), None, "runs past the end");
        assert_eq!(c.acquire(WRITE, 990, 20), None, "starts before");
        assert_eq!(c.acquire(READ, 1010, 10), None, "other access");
        assert_eq!(c.acquire((Device::Cuda(0), true, false), 1010, 10), None);
        assert_eq!(c.acquire(WRITE, u64::MAX - 1, 10), None, "overflow");
    }

    proptest::proptest! {
        /// Against a model (a list of live registrations): a hit always covers the request
        /// with the same kind, a miss means none does, and a registration's value comes back
        /// exactly when its last reference is released.
        #[test]
        fn matches_a_model_of_live_registrations(
            ops in proptest::collection::vec((0u8..3, 0u64..64, 1u64..32, proptest::bool::ANY), 1..200)
        ) {
            let mut c = RegistrationCache::new();
            // (id, kind_read, ptr, len, refs)
            let mut model: Vec<(u64, bool, u64, u64, usize)> = Vec::new();
            let mut handles: Vec<u64> = Vec::new();
            for (op, ptr, len, read) in ops {
                let kind = if read { READ } else { WRITE };
                match op {
                    0 | 1 => {
                        let covering = model.iter().any(|m| {
                            m.1 == read && m.2 <= ptr && m.2 + m.3 >= ptr + len
                        });
                        match c.acquire(kind, ptr, len) {
                            Some(hit) => {
                                let m = model.iter_mut().find(|m| m.0 == hit.id).unwrap();
                                proptest::prop_assert!(m.1 == read && m.2 <= ptr && m.2 + m.3 >= ptr + len);
                                proptest::prop_assert_eq!(hit.value, (m.2, m.3));
                                m.4 += 1;
                                handles.push(hit.id);
                            }
                            None => {
                                proptest::prop_assert!(!covering);
                                let hit = c.insert(kind, ptr, len, (ptr, len));
                                model.push((hit.id, read, ptr, len, 1));
                                handles.push(hit.id);
                            }
                        }
                    }
                    _ if !handles.is_empty() => {
                        let id = handles.remove(ptr as usize % handles.len());
                        let i = model.iter().position(|m| m.0 == id).unwrap();
                        model[i].4 -= 1;
                        let last = model[i].4 == 0;
                        let released = c.release(id);
                        proptest::prop_assert_eq!(released.is_some(), last);
                        if last {
                            model.remove(i);
                        }
                    }
                    _ => {}
                }
                proptest::prop_assert_eq!(c.len(), model.len());
            }
        }
    }
}
