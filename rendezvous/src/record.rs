//! What a name maps to: a peer's address and its named regions, in a versioned binary form
//! (the engine's own `NetAddr`/`MrDesc` codecs inside). Pure: no I/O.

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

/// Checks a peer or region name: 1 to 128 of `A-Z a-z 0-9 . _ -`.
pub fn check_name(what: &'static str, name: &str) -> Result<(), Error> {
    let ok = !name.is_empty()
        && name.len() <= MAX_NAME
        && name
            .bytes()
            .all(|b| b.is_ascii_alphanumeric() || matches!(b, b'.' | b'_' | b'-'));
    if ok {
        Ok(())
    } else {
        Err(Error::InvalidName {
            what,
            name: name.chars().take(MAX_NAME + 8).collect(),
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
    let bad = |why: String| Error::BadRecord {
        key: key.to_owned(),
        why,
    };
    let (&version, body) = value
        .split_first()
        .ok_or_else(|| bad("empty value".into()))?;
    if version != RECORD_VERSION {
        return Err(bad(format!(
            "record version {version}, this build reads {RECORD_VERSION}"
        )));
    }
    let (wire, rest): (Wire, &[u8]) =
        postcard::take_from_bytes(body).map_err(|e| bad(format!("not a record: {e}")))?;
    if !rest.is_empty() {
        return Err(bad(format!("{} trailing bytes", rest.len())));
    }
    check_name("peer", &wire.name).map_err(|e| bad(e.to_string()))?;
    // A record is published under its own name: one stored under another's key (a mistake,
    // or a peer posing as another in listings) is refused.
    if key.rsplit('/').next() != Some(wire.name.as_str()) {
        return Err(bad(format!(
            "the record names peer {:?}, not the one its key names",
            wire.name
        )));
    }
    if wire.regions.len() > MAX_REGIONS {
        return Err(bad(format!(
            "{} regions (at most {MAX_REGIONS})",
            wire.regions.len()
        )));
    }
    let addr = NetAddr::from_bytes(&wire.addr).map_err(|e| bad(format!("address: {e}")))?;
    let regions = wire
        .regions
        .into_iter()
        .map(|(n, d)| {
            check_name("region", &n).map_err(|e| bad(e.to_string()))?;
            let desc = MrDesc::from_bytes(&d).map_err(|e| bad(format!("region {n}: {e}")))?;
            Ok((n, desc))
        })
        .collect::<Result<_, Error>>()?;
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
        assert!(decode("k", b"").is_err());
        assert!(decode("k", b"\x01hello world").is_err());
        let mut long = encode(&record());
        long.push(0);
        assert!(decode("k", &long)
            .unwrap_err()
            .to_string()
            .contains("trailing"));
    }

    /// Issue 25: a record named `prefill-3` stored under another name's key would list as a
    /// second `prefill-3`; its name must be its key's.
    #[test]
    fn a_record_under_another_names_key_is_refused() {
        let e = decode("/xfer/peers/evil", &encode(&record())).unwrap_err();
        assert!(
            matches!(&e, Error::BadRecord { key, why } if key == "/xfer/peers/evil" && why.contains("prefill-3")),
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
