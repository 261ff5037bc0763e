//! The DomainGroup: the NICs one worker drives as a unit, and how a transfer spreads over them.
//!
//! The worker drives a [`DomainGroup`] without knowing which one: it posts each planned write
//! on the Domain of its NIC and polls every Domain. The API plans on the caller's thread with
//! the group's [`SpreadPolicy`], and a receiver asks the same policy how many arrivals a shape
//! produces ([`TransferEngine::expected_arrivals`](crate::TransferEngine::expected_arrivals)).
//!
//! The built-in group is [`StripingGroup`]: the pure striping planner ([`crate::plan`]) over
//! the configured NICs. A backend whose hardware or library already spreads traffic over its
//! rails supplies its own group through a [`GroupRegistration`]: its own policy
//! (say, each unit whole on one rail), its own Domains.
//!
//! Both peers must use the same group and config: arrivals are counted from the sender's plan.

use std::fmt;
use std::sync::Arc;

use crate::config::Config;
use crate::plan::{expected_arrivals, split, stays_whole, Chunk, StripePolicy, TransferShape};
use xfer_plugin::domain::{Domain, DomainError};

/// How a group cuts one unit (a single write, a page, a scatter destination) into writes on
/// its NICs, and how many arrivals that makes. Pure: shared between the callers' threads
/// (planning) and receivers (counting).
pub trait SpreadPolicy: Send + Sync + fmt::Debug {
    /// Plans one unit of `len` bytes over `nics` NICs, starting at NIC `first` (rotated per
    /// transfer by the engine), appending its writes to `out`. Every byte of the unit must be
    /// covered exactly once; a zero-byte unit is one zero-byte write.
    fn split(&self, len: u64, nics: usize, first: usize, out: &mut Vec<Chunk>);

    /// How many immediates a receiver counts for a transfer of `shape` sent over `nics` NICs:
    /// the number of writes `split` plans for it.
    fn expected_arrivals(&self, shape: TransferShape<'_>, nics: usize) -> u64;

    /// Whether `split` plans a unit of `len` bytes over `nics` NICs as one write of the
    /// whole unit on its first NIC. A shortcut for the commonest unit (a small single write
    /// is then built without planning); `false`, the default, always plans.
    fn stays_whole(&self, len: u64, nics: usize) -> bool {
        let _ = (len, nics);
        false
    }
}

impl SpreadPolicy for StripePolicy {
    fn split(&self, len: u64, nics: usize, first: usize, out: &mut Vec<Chunk>) {
        split(len, nics, first, self, out);
    }

    fn expected_arrivals(&self, shape: TransferShape<'_>, nics: usize) -> u64 {
        expected_arrivals(shape, nics, self)
    }

    fn stays_whole(&self, len: u64, nics: usize) -> bool {
        stays_whole(len, nics, self)
    }
}

/// The NICs one worker drives as a unit.
pub trait DomainGroup: Send {
    /// The Domains, in NIC order: peers see one address and one remote key per NIC.
    fn domains(&self) -> &[Box<dyn Domain>];

    /// The same, to post on and poll; the worker closes the group by draining it.
    fn domains_mut(&mut self) -> &mut Vec<Box<dyn Domain>>;

    /// How transfers spread over these NICs and how many arrivals they make.
    fn spread(&self) -> Arc<dyn SpreadPolicy>;
}

/// Makes a backend's own group from the Domains the engine opened for the configured NICs.
pub type OpenGroupFn =
    fn(domains: Vec<Box<dyn Domain>>, config: &Config) -> Result<Box<dyn DomainGroup>, DomainError>;

/// A linked-in backend's own DomainGroup, submitted with `inventory::submit!` beside its
/// [`BackendRegistration`](crate::domain::BackendRegistration). Backends without one get the
/// built-in [`StripingGroup`]; so do plugins loaded through the C ABI (a plugin whose library
/// spreads over its rails by itself exposes the logical device as one NIC). Here, in the
/// engine, because a group is planned with the engine's config and policies.
#[derive(Debug)]
pub struct GroupRegistration {
    /// The backend's name.
    pub backend: &'static str,
    /// Makes the group from the Domains the engine opened.
    pub open: OpenGroupFn,
}

inventory::collect!(GroupRegistration);

/// How the engine makes backend `name`'s DomainGroup: its registered one, else the built-in
/// striping group.
pub fn group_opener(name: &str) -> OpenGroupFn {
    inventory::iter::<GroupRegistration>
        .into_iter()
        .find(|g| g.backend == name)
        .map_or(StripingGroup::open as OpenGroupFn, |g| g.open)
}

/// The built-in group: the configured NICs, with the config's [`StripePolicy`].
pub struct StripingGroup {
    domains: Vec<Box<dyn Domain>>,
    policy: Arc<StripePolicy>,
}

impl StripingGroup {
    /// Stripes over `domains` with `policy`.
    pub fn new(domains: Vec<Box<dyn Domain>>, policy: StripePolicy) -> Self {
        Self {
            domains,
            policy: Arc::new(policy),
        }
    }

    /// [`OpenGroupFn`] of the built-in group.
    pub fn open(
        domains: Vec<Box<dyn Domain>>,
        config: &Config,
    ) -> Result<Box<dyn DomainGroup>, DomainError> {
        Ok(Box::new(Self::new(domains, config.stripe)))
    }
}

impl DomainGroup for StripingGroup {
    fn domains(&self) -> &[Box<dyn Domain>] {
        &self.domains
    }

    fn domains_mut(&mut self) -> &mut Vec<Box<dyn Domain>> {
        &mut self.domains
    }

    fn spread(&self) -> Arc<dyn SpreadPolicy> {
        self.policy.clone()
    }
}

/// A policy for groups whose rails are used whole: each unit goes to one NIC (the transfer's
/// rotating first NIC), cut only at `max_chunk`. One arrival per unit (per `max_chunk`), on
/// any number of NICs. A building block for backends that spread load by unit rather than by
/// byte range, and the vendor group the conformance suite runs on.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct WholeUnits {
    /// No single write is longer than this.
    pub max_chunk: u64,
}

impl SpreadPolicy for WholeUnits {
    fn split(&self, len: u64, nics: usize, first: usize, out: &mut Vec<Chunk>) {
        debug_assert!(nics >= 1 && first < nics);
        let writes = len.div_ceil(self.max_chunk).max(1);
        for w in 0..writes {
            let offset = w * self.max_chunk;
            out.push(Chunk {
                nic: first,
                offset,
                len: self.max_chunk.min(len - offset),
            });
        }
    }

    fn expected_arrivals(&self, shape: TransferShape<'_>, _nics: usize) -> u64 {
        shape.arrivals(|len| len.div_ceil(self.max_chunk).max(1))
    }

    fn stays_whole(&self, len: u64, _nics: usize) -> bool {
        len <= self.max_chunk
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    fn count(policy: &dyn SpreadPolicy, len: u64, nics: usize, first: usize) -> Vec<Chunk> {
        let mut out = Vec::new();
        policy.split(len, nics, first, &mut out);
        out
    }

    #[test]
    fn the_whole_unit_shortcut_matches_the_plan_at_its_boundaries() {
        let stripe = StripePolicy::default();
        let units = WholeUnits { max_chunk: 4096 };
        for (policy, len, nics) in [
            (&stripe as &dyn SpreadPolicy, stripe.min_stripe_len - 1, 2),
            (&stripe, stripe.min_stripe_len, 2),
            (&stripe, stripe.max_chunk, 1),
            (&stripe, stripe.max_chunk + 1, 1),
            (&units, 4096, 3),
            (&units, 4097, 3),
            (&units, 0, 1),
        ] {
            let chunks = count(policy, len, nics, nics - 1);
            let one_whole_chunk = chunks.len() == 1 && chunks[0].len == len;
            assert_eq!(
                policy.stays_whole(len, nics),
                one_whole_chunk,
                "{policy:?} {len} {nics}"
            );
        }
    }

    proptest! {
        /// For both policies: the writes cover the unit exactly once, on valid NICs, and
        /// their number is what a receiver is told to expect.
        #[test]
        fn plans_cover_each_byte_once_and_match_the_arrival_count(
            len in 0u64..(1 << 22),
            nics in 1usize..=4,
            first_seed in 0usize..4,
            max_chunk_pow in 12u32..22,
            whole in any::<bool>(),
        ) {
            let first = first_seed % nics;
            let stripe = StripePolicy { max_chunk: 1 << max_chunk_pow, ..StripePolicy::default() };
            let units = WholeUnits { max_chunk: 1 << max_chunk_pow };
            let policy: &dyn SpreadPolicy = if whole { &units } else { &stripe };
            let chunks = count(policy, len, nics, first);
            let mut at = 0;
            for c in &chunks {
                prop_assert!(c.nic < nics);
                prop_assert_eq!(c.offset, at);
                at += c.len;
            }
            prop_assert_eq!(at, len);
            prop_assert_eq!(
                chunks.len() as u64,
                policy.expected_arrivals(TransferShape::Single { len }, nics)
            );
            if whole {
                prop_assert!(chunks.iter().all(|c| c.nic == first), "whole units stay on one rail");
            }
            // The shortcut the engine takes for a single write says exactly what the plan is.
            let one_whole_chunk = chunks.len() == 1 && chunks[0].nic == first && chunks[0].len == len;
            prop_assert_eq!(policy.stays_whole(len, nics), one_whole_chunk);
        }
    }
}
