//! Who sent a message on libfabric: the trailer every message carries and what the receiver
//! concludes from it together with the source address its CQ reported (pure: no FFI, no
//! clock read — `now` is passed in).
//!
//! RDM endpoints have no connection xfer set up, so the transport's own word is the source
//! address `fi_cq_readfrom` reports (`FI_SOURCE`), and only for senders already in this
//! endpoint's address vector: for any other it reports nothing (`FI_ADDR_NOTAVAIL`, tcp;ofi_rxm)
//! or, measured on libfabric 1.17's shm, address 0 — which is why every Domain inserts its own
//! address first, so that 0 names nobody. The source a provider reports can itself be chosen
//! by the sender on some providers (tcp;ofi_rxm takes the peer's address from its connection
//! request), so a message also carries a trailer naming the sending endpoint (its claim) and,
//! with a cluster secret, a MAC over the message, its claim, its receiver and the sender's
//! freshness. The receiver then names a sender only when:
//!
//! - without a secret: the reported source is a known address equal to the claim. A claim
//!   from an unknown source is unproven (`None`), never a guess; the claimed address is
//!   learned (inserted in the address vector, boundedly) so that later messages from that
//!   endpoint are named by the provider's source.
//! - with a secret: the MAC verifies (else the message is dropped), the freshness is new
//!   (else dropped as a replay), and the reported source, where the provider names one,
//!   equals the claim (else dropped as spoofed); a claim from an unknown source is then a
//!   secret holder's word, and named.
//!
//! Wire layout, read from the end (the payload stays where the engine put it):
//! `payload | claim | claim_len: u8 | [epoch: u64 LE | count: u64 LE | tag: 16] | kind: u8`.

use std::collections::HashMap;

use hmac::{KeyInit, Mac};
use xfer_plugin::addr::{NetAddr, MAX_ADDR_LEN};
use xfer_plugin::secret::{derive_key, KeyUse};

type HmacSha256 = hmac::Hmac<sha2::Sha256>;

/// `kind` of a trailer with a claim only.
const KIND_CLAIM: u8 = 0xc1;
/// `kind` of a trailer with a claim, freshness and tag.
const KIND_SEALED: u8 = 0xc2;
const TAG_LEN: usize = 16;
const FRESHNESS_LEN: usize = 16;

/// The most bytes a trailer adds to a message: receive buffers are this much longer than
/// the longest message the engine may send.
pub(crate) const MAX_TRAILER: usize = MAX_ADDR_LEN + 1 + FRESHNESS_LEN + TAG_LEN + 1;

/// How many sealed messages of one sender may overtake another of its messages before that
/// one is refused as stale. A sender never has more than the engine's `max_outstanding`
/// sends in flight (65,536 by default); RDM messages overtake each other only in flight.
pub(crate) const REPLAY_WINDOW: u64 = 1 << 16;

/// Most senders whose freshness a receiver remembers (only holders of the secret add one, 8
/// KiB each: 32 MiB at most); a sender beyond it is refused, counted and logged.
pub(crate) const MAX_REMEMBERED_SENDERS: usize = 4_096;

/// An epoch further ahead of the receiver's wall clock than this is refused: one authentic
/// message with a far-future epoch would otherwise make a sender's every later message stale.
const MAX_EPOCH_AHEAD_NS: u64 = 3_600 * 1_000_000_000;

/// What the receiver's CQ said about a message's source.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) enum Source {
    /// An address of this endpoint's address vector.
    Known(NetAddr),
    /// None the provider could name (not in the address vector, or no `FI_SOURCE`).
    Unknown,
}

/// Why a message was dropped.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Refusal {
    /// No trailer this backend writes (a peer of another version, or garbage).
    Malformed,
    /// With a secret: no tag, or a tag that does not verify.
    BadTag,
    /// With a secret: a freshness already seen, or older than the window or the sender's
    /// newest epoch (a replay, or a message overtaken by more than the window).
    Replayed,
    /// With a secret: the provider named a source other than the authenticated claim.
    SpoofedSource,
    /// With a secret: too many senders remembered already.
    TooManySenders,
}

/// What the receiver does with a message.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) enum Verdict {
    /// Hand the first `len` bytes over, naming `from`; `learn`: an address to put in the
    /// address vector so that its later messages are named by the provider's source.
    Deliver {
        len: usize,
        from: Option<NetAddr>,
        learn: Option<NetAddr>,
    },
    /// Drop it, counted and logged.
    Drop(Refusal),
}

/// The newest freshness taken from one sender, and which of the `REPLAY_WINDOW` counts
/// below it were taken.
struct Freshness {
    epoch: u64,
    top: u64,
    seen: Box<[u64]>,
}

impl Freshness {
    fn new(epoch: u64, count: u64) -> Self {
        let mut f = Self {
            epoch,
            top: count,
            seen: vec![0u64; (REPLAY_WINDOW / 64) as usize].into_boxed_slice(),
        };
        f.mark(count);
        f
    }

    fn bit(count: u64) -> (usize, u64) {
        let i = count % REPLAY_WINDOW;
        ((i / 64) as usize, 1u64 << (i % 64))
    }

    fn mark(&mut self, count: u64) {
        let (word, bit) = Self::bit(count);
        self.seen[word] |= bit;
    }

    /// Takes `(epoch, count)` if it is new, refusing it otherwise.
    fn take(&mut self, epoch: u64, count: u64) -> bool {
        if epoch < self.epoch {
            return false;
        }
        if epoch > self.epoch {
            // The sender restarted (its Domain opened later): its old messages are stale.
            *self = Self::new(epoch, count);
            return true;
        }
        if count > self.top {
            // Forget the counts that slide out of the window.
            if count - self.top >= REPLAY_WINDOW {
                self.seen.fill(0);
            } else {
                for c in self.top + 1..count {
                    let (word, bit) = Self::bit(c);
                    self.seen[word] &= !bit;
                }
            }
            self.top = count;
            self.mark(count);
            return true;
        }
        if self.top - count >= REPLAY_WINDOW {
            return false;
        }
        let (word, bit) = Self::bit(count);
        if self.seen[word] & bit != 0 {
            return false;
        }
        self.seen[word] |= bit;
        true
    }
}

/// The MAC key and the freshness state of a Domain with a cluster secret.
struct Keyed {
    key: HmacSha256,
    /// When this Domain opened (wall-clock ns): later than any epoch its address used before.
    epoch: u64,
    /// Messages sealed since.
    sealed: u64,
    senders: HashMap<NetAddr, Freshness>,
}

/// One Domain's side of message senders: seals what it sends, judges what it receives.
pub(crate) struct Senders {
    own: NetAddr,
    keyed: Option<Keyed>,
}

impl Senders {
    /// Without a secret: messages carry a claim only.
    pub(crate) fn new(own: NetAddr) -> Self {
        Self { own, keyed: None }
    }

    /// With the cluster secret: every message is sealed, and unsealed ones are refused.
    /// `epoch`: the wall clock's nanoseconds now (larger than any this address used before).
    pub(crate) fn with_secret(own: NetAddr, secret: &[u8], epoch: u64) -> Self {
        let key = HmacSha256::new_from_slice(&derive_key(secret, KeyUse::Messages))
            .expect("HMAC takes a key of any length");
        Self {
            own,
            keyed: Some(Keyed {
                key,
                epoch,
                sealed: 0,
                senders: HashMap::new(),
            }),
        }
    }

    fn tag(key: &HmacSha256, to: &NetAddr, covered: &[u8]) -> HmacSha256 {
        let mut mac = key.clone();
        mac.update(&[to.raw().len() as u8]);
        mac.update(to.raw());
        mac.update(covered);
        mac
    }

    /// Writes `payload` and its trailer for a message to `to` into `out` (cleared first).
    pub(crate) fn seal(&mut self, to: &NetAddr, payload: &[u8], out: &mut Vec<u8>) {
        out.clear();
        out.extend_from_slice(payload);
        out.extend_from_slice(self.own.raw());
        out.push(self.own.raw().len() as u8);
        match &mut self.keyed {
            None => out.push(KIND_CLAIM),
            Some(k) => {
                out.extend_from_slice(&k.epoch.to_le_bytes());
                out.extend_from_slice(&k.sealed.to_le_bytes());
                k.sealed += 1;
                let mut mac = Self::tag(&k.key, to, out);
                mac.update(&[KIND_SEALED]);
                out.extend_from_slice(&mac.finalize().into_bytes()[..TAG_LEN]);
                out.push(KIND_SEALED);
            }
        }
    }

    /// Judges a received message (`message`: its bytes as they arrived) whose CQ entry
    /// reported `source`; `now_ns`: the wall clock. No address counts as known (see
    /// [`open_checked`](Self::open_checked)).
    #[cfg(test)]
    pub(crate) fn open(&mut self, message: &[u8], source: &Source, now_ns: u64) -> Verdict {
        self.open_checked(message, source, now_ns, &|_| false)
    }

    /// [`open`](Self::open), where `known` says whether the provider names an address's
    /// messages by their source (one this Domain inserted to send to, not one it learned):
    /// with a secret, a claim of such an address from a source the provider could not name is
    /// not from it, and is dropped before its freshness is taken.
    pub(crate) fn open_checked(
        &mut self,
        message: &[u8],
        source: &Source,
        now_ns: u64,
        known: &dyn Fn(&NetAddr) -> bool,
    ) -> Verdict {
        let Some(parsed) = Trailer::parse(message) else {
            return Verdict::Drop(Refusal::Malformed);
        };
        let claim = match NetAddr::new(parsed.claim) {
            Ok(claim) => claim,
            Err(_) => return Verdict::Drop(Refusal::Malformed),
        };
        let Some(k) = &mut self.keyed else {
            // No secret: the provider's source is the only proof.
            return match source {
                Source::Known(s) if *s == claim => Verdict::Deliver {
                    len: parsed.payload_len,
                    from: Some(claim),
                    learn: None,
                },
                Source::Known(_) => Verdict::Deliver {
                    len: parsed.payload_len,
                    from: None,
                    learn: None,
                },
                Source::Unknown => Verdict::Deliver {
                    len: parsed.payload_len,
                    from: None,
                    learn: Some(claim),
                },
            };
        };
        let Some((epoch, count, tag)) = parsed.sealed else {
            return Verdict::Drop(Refusal::BadTag);
        };
        let mut mac = Self::tag(&k.key, &self.own, &message[..parsed.tag_at]);
        mac.update(&[KIND_SEALED]);
        if mac.verify_truncated_left(tag).is_err() {
            return Verdict::Drop(Refusal::BadTag);
        }
        let spoofed = match source {
            Source::Known(s) => *s != claim,
            Source::Unknown => known(&claim),
        };
        if spoofed {
            return Verdict::Drop(Refusal::SpoofedSource);
        }
        if epoch > now_ns.saturating_add(MAX_EPOCH_AHEAD_NS) {
            return Verdict::Drop(Refusal::Replayed);
        }
        let remembered = k.senders.len();
        let fresh = match k.senders.get_mut(&claim) {
            Some(f) => f.take(epoch, count),
            None if remembered >= MAX_REMEMBERED_SENDERS => {
                return Verdict::Drop(Refusal::TooManySenders)
            }
            None => {
                k.senders
                    .insert(claim.clone(), Freshness::new(epoch, count));
                true
            }
        };
        if !fresh {
            return Verdict::Drop(Refusal::Replayed);
        }
        let learn = (*source == Source::Unknown).then(|| claim.clone());
        Verdict::Deliver {
            len: parsed.payload_len,
            from: Some(claim),
            learn,
        }
    }
}

/// A trailer's parts, as read from the end of a message.
struct Trailer<'a> {
    payload_len: usize,
    claim: &'a [u8],
    /// Where the tag starts: what it covers is everything before it (and the kind byte).
    tag_at: usize,
    sealed: Option<(u64, u64, &'a [u8])>,
}

impl<'a> Trailer<'a> {
    fn parse(message: &'a [u8]) -> Option<Self> {
        let (&kind, rest) = message.split_last()?;
        let (rest, tag_at, sealed) = match kind {
            KIND_CLAIM => (rest, rest.len(), None),
            KIND_SEALED => {
                let tag_at = rest.len().checked_sub(TAG_LEN)?;
                let (rest, tag) = rest.split_at(tag_at);
                let at = rest.len().checked_sub(FRESHNESS_LEN)?;
                let (rest, freshness) = rest.split_at(at);
                let epoch = u64::from_le_bytes(freshness[..8].try_into().ok()?);
                let count = u64::from_le_bytes(freshness[8..].try_into().ok()?);
                (rest, tag_at, Some((epoch, count, tag)))
            }
            _ => return None,
        };
        let (&claim_len, rest) = rest.split_last()?;
        let at = rest.len().checked_sub(usize::from(claim_len))?;
        let (payload, claim) = rest.split_at(at);
        Some(Self {
            payload_len: payload.len(),
            claim,
            tag_at,
            sealed,
        })
    }
}

#[cfg(test)]
mod tests;
