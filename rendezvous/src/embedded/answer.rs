//! Answers as frames: encoded once, into the buffer that is written (a 4-byte little-endian
//! length, then the postcard body), so an answer is held once while a client takes it, and
//! counted while it is ([`Held`]). A listing is encoded from the entries where they lie (no
//! clone of every value first), after its bytes were reserved within the budget; past it,
//! the client is answered `TooLarge` or `Busy` instead.

use serde::ser::{SerializeSeq, Serializer};
use serde::Serialize;

use super::budget::{Account, Held, OverBudget};
use super::wire::{Request, Response};

/// A frame to write, and its bytes counted until it is dropped.
pub(super) struct Answer {
    pub(super) frame: Vec<u8>,
    _held: Held,
}

/// `msg` as a frame, counted but never refused: an answer of one value at most (or a
/// refusal), which the connection cap bounds.
pub(super) fn small(msg: &Response, account: &std::sync::Arc<Account>) -> Answer {
    let frame = frame(msg);
    Answer {
        _held: account.hold(frame.len() as u64),
        frame,
    }
}

/// The most a listing of `entries` takes as a frame: its lengths, and a varint's 10 bytes
/// for each length prefix (a bound, computed before a byte is copied).
fn listing_bound<'a>(entries: impl Iterator<Item = (&'a str, &'a [u8])>) -> u64 {
    entries.fold(4 + 1 + 10, |n, (k, v)| {
        n + 20 + k.len() as u64 + v.len() as u64
    })
}

/// The `Values` answer for `entries`, within `account`'s budget; past it, the refusal to
/// send instead.
pub(super) fn listing<'a, I>(
    entries: I,
    account: &std::sync::Arc<Account>,
) -> Result<Answer, Response>
where
    I: Iterator<Item = (&'a str, &'a [u8])> + Clone,
{
    let held = account
        .reserve(listing_bound(entries.clone()))
        .map_err(|over| match over {
            OverBudget::Connection { bytes, budget } => Response::TooLarge { bytes, budget },
            OverBudget::Service {
                bytes,
                held,
                budget,
            } => Response::Busy {
                bytes,
                held,
                budget,
            },
        })?;
    let len = entries.clone().count();
    Ok(Answer {
        frame: frame(&Values(entries, len)),
        _held: held,
    })
}

/// `Response::Values` serialized from borrowed entries: the same bytes as the owned answer
/// (a test holds them to it), without cloning the values into it.
struct Values<I>(I, usize);

/// `Values`' index among `Response`'s variants (declaration order, as serde derives it).
const VALUES_VARIANT: u32 = 7;

impl<'a, I> Serialize for Values<I>
where
    I: Iterator<Item = (&'a str, &'a [u8])> + Clone,
{
    fn serialize<S: Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
        s.serialize_newtype_variant("Response", VALUES_VARIANT, "Values", &Entries(self))
    }
}

struct Entries<'v, I>(&'v Values<I>);

impl<'a, I> Serialize for Entries<'_, I>
where
    I: Iterator<Item = (&'a str, &'a [u8])> + Clone,
{
    fn serialize<S: Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
        let mut seq = s.serialize_seq(Some(self.0 .1))?;
        for (k, v) in self.0 .0.clone() {
            seq.serialize_element(&(k, Bytes(v)))?;
        }
        seq.end()
    }
}

/// Bytes as one slice (postcard: the same length-prefixed bytes as a `Vec<u8>`'s sequence,
/// written at once rather than byte by byte).
struct Bytes<'a>(&'a [u8]);

impl Serialize for Bytes<'_> {
    fn serialize<S: Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
        s.serialize_bytes(self.0)
    }
}

/// `msg` as one frame.
pub(super) fn frame<T: Serialize + ?Sized>(msg: &T) -> Vec<u8> {
    let mut frame = postcard::to_extend(msg, vec![0u8; 4])
        .expect("a message of owned strings, bytes and numbers serializes");
    let len = (frame.len() - 4) as u32;
    frame[..4].copy_from_slice(&len.to_le_bytes());
    frame
}

/// A `List` request as bytes on the wire (tests that speak the protocol by hand).
#[doc(hidden)]
pub fn list_frame_for_tests(prefix: &str) -> Vec<u8> {
    frame(&Request::List {
        prefix: prefix.to_owned(),
    })
}

/// A `Watch` request as bytes on the wire (tests that speak the protocol by hand).
#[doc(hidden)]
pub fn watch_frame_for_tests(prefix: &str) -> Vec<u8> {
    frame(&Request::Watch {
        prefix: prefix.to_owned(),
    })
}

/// A `Put` of `value` under `key` claiming no lease, with a TTL of a minute (tests that
/// store values by hand).
#[doc(hidden)]
pub fn put_frame_for_tests(key: &str, value: &[u8]) -> Vec<u8> {
    frame(&Request::Put {
        key: key.to_owned(),
        value: value.to_vec(),
        ttl_ms: 60_000,
        owner: None,
    })
}

/// Whether a response body is a `Lease` (tests that store values by hand).
#[doc(hidden)]
pub fn is_lease_for_tests(body: &[u8]) -> bool {
    matches!(postcard::from_bytes(body), Ok(Response::Lease(_)))
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::embedded::budget::Budget;
    use crate::embedded::Limits;

    /// The borrowed listing is byte for byte the owned `Response::Values` a client decodes
    /// (this fails if `Response`'s variants are reordered).
    #[test]
    fn a_listing_is_encoded_as_the_owned_answer() {
        let entries: Vec<(String, Vec<u8>)> = vec![
            ("/x/a".into(), vec![]),
            ("/x/b".into(), vec![1; 200]),
            ("/x/ü".into(), vec![2; 70_000]),
        ];
        let borrowed = entries.iter().map(|(k, v)| (k.as_str(), v.as_slice()));
        let account = Budget::new(&Limits::default()).account();
        let answer = listing(borrowed.clone(), &account).unwrap_or_else(|r| panic!("{r:?}"));
        assert_eq!(answer.frame, frame(&Response::Values(entries.clone())));
        assert!(listing_bound(borrowed) >= answer.frame.len() as u64);
        let empty = listing(std::iter::empty(), &account).unwrap_or_else(|r| panic!("{r:?}"));
        assert_eq!(empty.frame, frame(&Response::Values(vec![])));
    }

    /// Past the connection's budget, or the service's, the answer is the refusal naming it.
    #[test]
    fn a_listing_past_a_budget_is_refused_by_name() {
        let budget = Budget::new(&Limits {
            max_pending_bytes: 3000,
            max_pending_bytes_per_connection: 2000,
            ..Limits::default()
        });
        let value = vec![0u8; 1500];
        let one = [("/x/a", value.as_slice())];
        let two = [("/x/a", value.as_slice()), ("/x/b", value.as_slice())];
        let (a, b) = (budget.account(), budget.account());
        assert!(matches!(
            listing(two.iter().copied(), &a),
            Err(Response::TooLarge { budget: 2000, .. })
        ));
        let held = listing(one.iter().copied(), &a).unwrap_or_else(|r| panic!("{r:?}"));
        assert!(matches!(
            listing(one.iter().copied(), &b),
            Err(Response::Busy { budget: 3000, .. })
        ));
        drop(held);
        assert!(listing(one.iter().copied(), &b).is_ok());
        assert_eq!(budget.held(), 0);
    }

    #[test]
    fn a_frame_is_its_length_and_its_body() {
        let msg = Response::Values(vec![("/x/a".into(), vec![7; 300])]);
        let f = frame(&msg);
        let body = postcard::to_stdvec(&msg).unwrap();
        assert_eq!(f[..4], (body.len() as u32).to_le_bytes());
        assert_eq!(f[4..], body[..]);
    }
}
