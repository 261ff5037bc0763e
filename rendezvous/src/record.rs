//! What a name maps to: a peer's address and its named regions, in a versioned binary form
//! (the engine's own `NetAddr`/`MrDesc` codecs inside). Pure: no I/O.

use engine_core::wire::DecodeError;
use engine_core::{MrDesc, NetAddr};
use serde::{Deserialize, Serialize};

use crate::Error;

/// Version byte of a record; bumped when the layout changes.
pub const RECORD_VERSION: u8 = 1;
/// Longest name accepted (names are keys in etcd and in the embedded service).
pub const MAX_NAME: usize = 128;
/// Most regions one record may name.
pub const MAX_REGIONS: usize = 256;

/// One published peer.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Record {
    /// Its name (`prefill-3`).
    pub name: String,
    /// Random per publication: a restarted peer publishes a new one, so a watcher can tell a
    /// restart from a repeated announcement.
    pub incarnation: u64,
    /// The engine's main address.
    pub addr: NetAddr,
    /// Named regions (`kv-cache`), as peers address them.
    pub regions: Vec<(String, MrDesc)>,
}

impl Record {
    /// The region called `name`, if published.
    pub fn region(&self, name: &str) -> Option<&MrDesc> {
        self.regions.iter().find(|(n, _)| n == name).map(|(_, d)| d)
    }
}

#[derive(Serialize, Deserialize)]
struct Wire {
    name: String,
    incarnation: u64,
    addr: Vec<u8>,
    regions: Vec<(String, Vec<u8>)>,
}

/// Why a stored value is not a record this build reads (inside [`Error::BadRecord`], which
/// names the key).
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[non_exhaustive]
pub enum RecordError {
    /// A value of zero bytes.
    #[error("empty value")]
    Empty,
    /// A version byte this build does not read.
    #[error("record version {0}, this build reads {RECORD_VERSION}")]
    Version(u8),
    /// The body is not a postcard record (truncated, a bad length or tag, invalid UTF-8).
    #[error("not a record: {0}")]
    Malformed(postcard::Error),
    /// Bytes after the record.
    #[error("{0} trailing bytes")]
    Trailing(usize),
    /// A peer or region name outside 1 to 128 of `A-Z a-z 0-9 . _ -`.
    #[error("invalid {what} name {name:?}")]
    BadName {
        /// "peer" or "region".
        what: &'static str,
        /// The name, cut to a little past the longest allowed.
        name: String,
    },
    /// The record names another peer than its key does.
    #[error("the record names peer {0:?}, not the one its key names")]
    NotItsKey(String),
    /// More regions than [`MAX_REGIONS`].
    #[error("{0} regions (at most {MAX_REGIONS})")]
    TooManyRegions(usize),
    /// The peer's address does not decode.
    #[error("address: {0}")]
    Address(DecodeError),
    /// A region's descriptor does not decode.
    #[error("region {name}: {error}")]
    Region {
        /// The region's name.
        name: String,
        /// Why its descriptor does not decode.
        error: DecodeError,
    },
}

fn name_ok(name: &str) -> bool {
    !name.is_empty()
        && name.len() <= MAX_NAME
        && name
            .bytes()
            .all(|b| b.is_ascii_alphanumeric() || matches!(b, b'.' | b'_' | b'-'))
}

/// A name as an error shows it: never much longer than the longest valid one.
fn shown(name: &str) -> String {
    name.chars().take(MAX_NAME + 8).collect()
}

/// Checks a peer or region name: 1 to 128 of `A-Z a-z 0-9 . _ -`.
pub fn check_name(what: &'static str, name: &str) -> Result<(), Error> {
    if name_ok(name) {
        Ok(())
    } else {
        Err(Error::InvalidName {
            what,
            name: shown(name),
        })
    }
}

fn check_record_name(what: &'static str, name: &str) -> Result<(), RecordError> {
    if name_ok(name) {
        Ok(())
    } else {
        Err(RecordError::BadName {
            what,
            name: shown(name),
        })
    }
}

/// The record's value: the version byte, then postcard.
pub fn encode(record: &Record) -> Vec<u8> {
    let wire = Wire {
        name: record.name.clone(),
        incarnation: record.incarnation,
        addr: record.addr.to_bytes(),
        regions: record
            .regions
            .iter()
            .map(|(n, d)| (n.clone(), d.to_bytes()))
            .collect(),
    };
    let mut out = vec![RECORD_VERSION];
    out.extend(postcard::to_stdvec(&wire).expect("a record always serializes"));
    out
}

/// Decodes the value stored under `key`; anything malformed or foreign is an error naming
/// the key (it may have been written by another program).
pub fn decode(key: &str, value: &[u8]) -> Result<Record, Error> {
    decode_value(key, value).map_err(|why| Error::BadRecord {
        key: key.to_owned(),
        why,
    })
}

fn decode_value(key: &str, value: &[u8]) -> Result<Record, RecordError> {
    let (&version, body) = value.split_first().ok_or(RecordError::Empty)?;
    if version != RECORD_VERSION {
        return Err(RecordError::Version(version));
    }
    // Lengths inside are bounded by the bytes given: postcard reads strings and byte
    // vectors from the input and serde preallocates at most a cautious size.
    let (wire, rest): (Wire, &[u8]) =
        postcard::take_from_bytes(body).map_err(RecordError::Malformed)?;
    if !rest.is_empty() {
        return Err(RecordError::Trailing(rest.len()));
    }
    check_record_name("peer", &wire.name)?;
    // A record is published under its own name: one stored under another's key (a mistake,
    // or a peer posing as another in listings) is refused.
    if key.rsplit('/').next() != Some(wire.name.as_str()) {
        return Err(RecordError::NotItsKey(wire.name));
    }
    if wire.regions.len() > MAX_REGIONS {
        return Err(RecordError::TooManyRegions(wire.regions.len()));
    }
    let addr = NetAddr::from_bytes(&wire.addr).map_err(RecordError::Address)?;
    let regions = wire
        .regions
        .into_iter()
        .map(|(name, d)| {
            check_record_name("region", &name)?;
            match MrDesc::from_bytes(&d) {
                Ok(desc) => Ok((name, desc)),
                Err(error) => Err(RecordError::Region { name, error }),
            }
        })
        .collect::<Result<_, RecordError>>()?;
    Ok(Record {
        name: wire.name,
        incarnation: wire.incarnation,
        addr,
        regions,
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    fn record() -> Record {
        let addr = NetAddr::new(&[1, 2, 3, 4]).unwrap();
        let desc = MrDesc::new(0x1000, 4096, vec![(addr.clone(), 7)]).unwrap();
        Record {
            name: "prefill-3".into(),
            incarnation: 42,
            addr,
            regions: vec![("kv-cache".into(), desc)],
        }
    }

    #[test]
    fn records_round_trip() {
        let r = record();
        assert_eq!(decode("/xfer/peers/prefill-3", &encode(&r)).unwrap(), r);
        assert!(r.region("kv-cache").is_some() && r.region("other").is_none());
    }

    #[test]
    fn foreign_and_malformed_values_name_their_key() {
        let mut v = encode(&record());
        v[0] = 9;
        let e = decode("/xfer/peers/x", &v).unwrap_err().to_string();
        assert!(
            e.contains("/xfer/peers/x") && e.contains("version 9"),
            "{e}"
        );
        let why = |value: &[u8]| match decode("/xfer/peers/prefill-3", value) {
            Err(Error::BadRecord { why, .. }) => why,
            other => panic!("{other:?}"),
        };
        assert_eq!(why(b""), RecordError::Empty);
        assert!(matches!(why(b"\x01hello world"), RecordError::Malformed(_)));
        let mut long = encode(&record());
        long.push(0);
        assert_eq!(why(&long), RecordError::Trailing(1));
        assert!(decode("k", &long)
            .unwrap_err()
            .to_string()
            .contains("trailing"));
        let mut r = record();
        r.regions[0].0 = "a/b".into();
        assert!(matches!(
            why(&encode(&r)),
            RecordError::BadName { what: "region", .. }
        ));
        let mut r = record();
        r.regions = vec![r.regions[0].clone(); MAX_REGIONS + 1];
        assert_eq!(
            why(&encode(&r)),
            RecordError::TooManyRegions(MAX_REGIONS + 1)
        );
    }

    /// Issue 25: a record named `prefill-3` stored under another name's key would list as a
    /// second `prefill-3`; its name must be its key's.
    #[test]
    fn a_record_under_another_names_key_is_refused() {
        let e = decode("/xfer/peers/evil", &encode(&record())).unwrap_err();
        assert!(
            matches!(&e, Error::BadRecord { key, why: RecordError::NotItsKey(name) } if key == "/xfer/peers/evil" && name == "prefill-3"),
            "{e}"
        );
    }

    #[test]
    fn names_are_checked() {
        for good in ["a", "prefill-3", "decode_7.x", &"n".repeat(128)] {
            check_name("peer", good).unwrap();
        }
        for bad in ["", "a/b", "a b", "ü", &"n".repeat(129), "..\n"] {
            assert!(check_name("peer", bad).is_err(), "{bad:?}");
        }
    }

    proptest! {
        #[test]
        fn decoding_never_panics(bytes in proptest::collection::vec(any::<u8>(), 0..300)) {
            let _ = decode("k", &bytes);
            let mut v = vec![RECORD_VERSION];
            v.extend(bytes);
            let _ = decode("k", &v);
        }
    }
}
