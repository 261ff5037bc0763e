//! Endpoints of libfabric's `shm` provider that close while others in this process live.
//!
//! `shm` reaches a peer endpoint *of the same process* through a pointer into that endpoint's
//! own shared region, not through a mapping of its own (libfabric 1.17 and 2.1). When the
//! peer closes, the region is freed and the survivor's next operation towards it — or its
//! next CQ read — takes a spin lock in freed memory and crashes the process.
//! And `shm` checks no remote key, so a write to a closed peer would land in whatever its
//! deregistered memory has become.
//!
//! So, on `shm` only: a closed Domain's endpoint is *parked* (kept open, never polled) while
//! any other `shm` Domain of this process lives, and its address is remembered as closed, so
//! an operation towards it fails at once with `PeerUnreachable` instead of reaching the
//! provider. The last `shm` Domain of the process to close closes everything parked.
//! Endpoints in other processes are unaffected (they map the region themselves).

use std::collections::HashSet;
use std::sync::{Mutex, MutexGuard, PoisonError};

use xfer_plugin::addr::NetAddr;

use crate::ffi::Endpoint;

/// The provider this applies to.
const SHM: &str = "shm";

#[derive(Default)]
struct Graveyard {
    /// `shm` Domains of this process that are open.
    live: usize,
    /// Addresses of this process's `shm` endpoints that closed.
    closed: HashSet<NetAddr>,
    /// Their endpoints, kept open while `live > 0`.
    parked: Vec<Endpoint>,
}

static GRAVEYARD: Mutex<Option<Graveyard>> = Mutex::new(None);

fn graveyard() -> MutexGuard<'static, Option<Graveyard>> {
    GRAVEYARD.lock().unwrap_or_else(PoisonError::into_inner)
}

/// Whether `provider`'s in-process peers need this care.
pub(crate) fn applies(provider: &str) -> bool {
    provider == SHM
}

/// A Domain of `provider` opened.
pub(crate) fn opened(provider: &str) {
    if applies(provider) {
        graveyard().get_or_insert_with(Graveyard::default).live += 1;
    }
}

/// Whether `peer` is an endpoint of this process that closed (always false off `shm`).
pub(crate) fn is_closed(provider: &str, peer: &NetAddr) -> bool {
    applies(provider)
        && graveyard()
            .as_ref()
            .is_some_and(|g| g.closed.contains(peer))
}

/// A Domain of `provider` at `address` closes. Returns its endpoint when the caller closes
/// it now (off `shm`, or the last `shm` Domain of the process, which also closes every parked
/// endpoint); `None` when it was parked.
pub(crate) fn close(provider: &str, address: &NetAddr, endpoint: Endpoint) -> Option<Endpoint> {
    if !applies(provider) {
        return Some(endpoint);
    }
    let parked = {
        let mut guard = graveyard();
        let g = guard.get_or_insert_with(Graveyard::default);
        g.live = g.live.saturating_sub(1);
        if g.live > 0 {
            g.closed.insert(address.clone());
            g.parked.push(endpoint);
            return None;
        }
        g.closed.clear();
        std::mem::take(&mut g.parked)
    };
    // Closed outside the lock (closing waits for the provider); their Domains' registrations
    // went when those Domains closed.
    for mut gone in parked {
        gone.close_endpoint();
    }
    Some(endpoint)
}

/// The Domain's endpoint, which its `Drop` may hand to [`close`] (a field that can be moved
/// out of a `Drop`; everything else reaches the endpoint through it as before).
pub(crate) struct EndpointSlot(Option<Endpoint>);

impl EndpointSlot {
    pub(crate) fn new(endpoint: Endpoint) -> Self {
        Self(Some(endpoint))
    }

    pub(crate) fn take(&mut self) -> Option<Endpoint> {
        self.0.take()
    }

    pub(crate) fn put(&mut self, endpoint: Endpoint) {
        self.0 = Some(endpoint);
    }
}

impl std::ops::Deref for EndpointSlot {
    type Target = Endpoint;
    fn deref(&self) -> &Endpoint {
        self.0.as_ref().expect("taken only in the Domain's drop")
    }
}

impl std::ops::DerefMut for EndpointSlot {
    fn deref_mut(&mut self) -> &mut Endpoint {
        self.0.as_mut().expect("taken only in the Domain's drop")
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn only_shm_is_affected() {
        assert!(applies("shm"));
        assert!(!applies("tcp;ofi_rxm") && !applies("efa"));
        let a = NetAddr::new(b"a").unwrap();
        assert!(!is_closed("tcp;ofi_rxm", &a));
    }
}
