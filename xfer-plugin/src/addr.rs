//! [`NetAddr`], a NIC's address, and the wire primitives its encoding shares with the
//! engine's `MrDesc`.
//!
//! Each wire structure has three forms: serde (for the caller's own RPC), a compact versioned binary form
//! (`to_bytes`/`from_bytes`) and its hex text (`Display`/`FromStr`). Decoders check the version,
//! reject truncation, trailing bytes and absurd lengths, and never panic: these bytes come from
//! another machine.

use std::fmt;
use std::str::FromStr;
use std::sync::Arc;

use serde::{Deserialize, Serialize};

/// Version byte that starts every binary form; bumped when a layout changes.
pub const WIRE_VERSION: u8 = 1;
/// Longest NIC address any backend produces (EFA: 32 bytes; verbs: GID + QPN + QKey).
pub const MAX_ADDR_LEN: usize = 64;

/// Why a serialized address or descriptor was rejected.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[non_exhaustive]
pub enum DecodeError {
    /// The input ended before the structure did.
    #[error("truncated: needed {needed} more bytes at offset {at}")]
    Truncated {
        /// Where the read started.
        at: usize,
        /// How many bytes were missing.
        needed: usize,
    },
    /// The version byte is not one this build understands.
    #[error("wire version {found}, expected {expected}")]
    Version {
        /// The version found.
        found: u8,
        /// The version this build speaks.
        expected: u8,
    },
    /// Bytes were left over after a complete structure.
    #[error("{0} trailing bytes")]
    Trailing(usize),
    /// A length field is zero or larger than any valid value.
    #[error("{field} is {value}, allowed {min}..={max}")]
    Length {
        /// The field.
        field: &'static str,
        /// The value found.
        value: usize,
        /// Smallest valid value.
        min: usize,
        /// Largest valid value.
        max: usize,
    },
    /// `ptr + len` does not fit in 64 bits.
    #[error("region {ptr:#x}+{len} overflows the address space")]
    Overflow {
        /// Region start.
        ptr: u64,
        /// Region length.
        len: u64,
    },
    /// The hex text form has a non-hex character or an odd length.
    #[error("bad hex text: {0}")]
    Hex(String),
}

/// A byte reader that turns every short read into [`DecodeError::Truncated`].
#[doc(hidden)]
#[derive(Debug)]
pub struct Reader<'a> {
    bytes: &'a [u8],
    at: usize,
}

impl<'a> Reader<'a> {
    #[allow(missing_docs)]
    pub fn new(bytes: &'a [u8]) -> Self {
        Self { bytes, at: 0 }
    }

    #[allow(missing_docs)]
    pub fn take(&mut self, n: usize) -> Result<&'a [u8], DecodeError> {
        let rest = &self.bytes[self.at..];
        if rest.len() < n {
            return Err(DecodeError::Truncated {
                at: self.at,
                needed: n - rest.len(),
            });
        }
        self.at += n;
        Ok(&rest[..n])
    }

    #[allow(missing_docs)]
    pub fn u8(&mut self) -> Result<u8, DecodeError> {
        Ok(self.take(1)?[0])
    }

    #[allow(missing_docs)]
    pub fn u64(&mut self) -> Result<u64, DecodeError> {
        let b = self.take(8)?;
        Ok(u64::from_le_bytes(
            b.try_into().expect("take(8) returns 8 bytes"),
        ))
    }

    #[allow(missing_docs)]
    pub fn version(&mut self) -> Result<(), DecodeError> {
        match self.u8()? {
            WIRE_VERSION => Ok(()),
            found => Err(DecodeError::Version {
                found,
                expected: WIRE_VERSION,
            }),
        }
    }

    /// Bytes not read yet (for an optional trailing field).
    pub fn remaining(&self) -> usize {
        self.bytes.len() - self.at
    }

    #[allow(missing_docs)]
    pub fn finish(self) -> Result<(), DecodeError> {
        match self.bytes.len() - self.at {
            0 => Ok(()),
            n => Err(DecodeError::Trailing(n)),
        }
    }
}

#[doc(hidden)]
pub fn check_len(
    field: &'static str,
    value: usize,
    min: usize,
    max: usize,
) -> Result<(), DecodeError> {
    if (min..=max).contains(&value) {
        Ok(())
    } else {
        Err(DecodeError::Length {
            field,
            value,
            min,
            max,
        })
    }
}

#[doc(hidden)]
pub fn from_hex(text: &str) -> Result<Vec<u8>, DecodeError> {
    hex::decode(text.trim()).map_err(|e| DecodeError::Hex(e.to_string()))
}

/// The address of one NIC of an engine, as its backend defines it (opaque to the engine).
///
/// An engine's `main_address` is its first NIC's address;
/// the addresses of all its NICs travel inside every `MrDesc` it hands out. Cloning is cheap
/// (a reference count), since every write carries its peer's address.
#[derive(Clone, PartialOrd, Ord, Serialize, Deserialize)]
#[serde(try_from = "Vec<u8>", into = "Vec<u8>")]
pub struct NetAddr {
    // First: the derived order is the bytes' (the digest follows from them).
    bytes: Arc<[u8]>,
    /// A hash of the bytes, computed once: every work request looks its peer up in maps
    /// (the worker's and the backend's), and hashing the whole address each time cost more
    /// than a hundred instructions per page of a paged write.
    digest: u64,
}

/// The digest of an address's bytes (in-process only: never sent or stored).
fn digest(bytes: &[u8]) -> u64 {
    use std::hash::BuildHasher;
    foldhash::fast::FixedState::default().hash_one(bytes)
}

/// By the bytes' digest, consistent with equality (equal bytes, equal digests).
impl std::hash::Hash for NetAddr {
    fn hash<H: std::hash::Hasher>(&self, state: &mut H) {
        state.write_u64(self.digest);
    }
}

impl PartialEq for NetAddr {
    fn eq(&self, other: &Self) -> bool {
        // Clones share one allocation, and most comparisons (a map lookup per work request)
        // are between clones: they end here without reading the bytes.
        Arc::ptr_eq(&self.bytes, &other.bytes)
            || (self.digest == other.digest && self.bytes == other.bytes)
    }
}

impl Eq for NetAddr {}

impl NetAddr {
    /// Wraps a backend's raw address bytes (1 to [`MAX_ADDR_LEN`] bytes).
    pub fn new(raw: &[u8]) -> Result<Self, DecodeError> {
        check_len("address length", raw.len(), 1, MAX_ADDR_LEN)?;
        Ok(Self::wrap(raw))
    }

    fn wrap(raw: &[u8]) -> Self {
        Self {
            bytes: raw.into(),
            digest: digest(raw),
        }
    }

    /// The backend's raw address bytes.
    pub fn raw(&self) -> &[u8] {
        &self.bytes
    }

    /// The compact binary form: version, length, bytes.
    pub fn to_bytes(&self) -> Vec<u8> {
        let mut out = Vec::with_capacity(2 + self.bytes.len());
        out.push(WIRE_VERSION);
        self.encode_body(&mut out);
        out
    }

    /// Decodes [`to_bytes`](Self::to_bytes)' output, rejecting anything else.
    pub fn from_bytes(bytes: &[u8]) -> Result<Self, DecodeError> {
        let mut r = Reader::new(bytes);
        r.version()?;
        let addr = Self::decode_body(&mut r)?;
        r.finish()?;
        Ok(addr)
    }

    #[doc(hidden)]
    pub fn encode_body(&self, out: &mut Vec<u8>) {
        // new() bounds the length by MAX_ADDR_LEN, which fits in a byte.
        out.push(self.bytes.len() as u8);
        out.extend_from_slice(&self.bytes);
    }

    #[doc(hidden)]
    pub fn decode_body(r: &mut Reader<'_>) -> Result<Self, DecodeError> {
        let len = usize::from(r.u8()?);
        check_len("address length", len, 1, MAX_ADDR_LEN)?;
        Ok(Self::wrap(r.take(len)?))
    }
}

impl TryFrom<Vec<u8>> for NetAddr {
    type Error = DecodeError;
    fn try_from(raw: Vec<u8>) -> Result<Self, DecodeError> {
        Self::new(&raw)
    }
}

impl From<NetAddr> for Vec<u8> {
    fn from(addr: NetAddr) -> Vec<u8> {
        addr.bytes.to_vec()
    }
}

/// Hex of the binary form.
impl fmt::Display for NetAddr {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&hex::encode(self.to_bytes()))
    }
}

impl fmt::Debug for NetAddr {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "NetAddr({})", hex::encode(&self.bytes))
    }
}

impl FromStr for NetAddr {
    type Err = DecodeError;
    fn from_str(text: &str) -> Result<Self, DecodeError> {
        Self::from_bytes(&from_hex(text)?)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::collections::hash_map::DefaultHasher;
    use std::hash::{Hash, Hasher};

    fn hash(a: &NetAddr) -> u64 {
        let mut h = DefaultHasher::new();
        a.hash(&mut h);
        h.finish()
    }

    /// Equality is by bytes whether or not two addresses share an allocation (the fast path
    /// for clones must not change what is equal), and equal addresses hash alike.
    #[test]
    fn addresses_are_equal_by_their_bytes() {
        let a = NetAddr::new(b"nic-a").unwrap();
        let clone = a.clone();
        let same_bytes = NetAddr::new(b"nic-a").unwrap();
        let other = NetAddr::new(b"nic-b").unwrap();
        assert!(a == clone && a == same_bytes && same_bytes == clone);
        assert!(a != other && other != same_bytes);
        assert_eq!(hash(&a), hash(&same_bytes));
        // Decoded addresses carry the same digest; the order is still the bytes'.
        let decoded = NetAddr::from_bytes(&a.to_bytes()).unwrap();
        assert!(decoded == a && hash(&decoded) == hash(&a));
        let (low, high) = (
            NetAddr::new(&[1, 255]).unwrap(),
            NetAddr::new(&[2, 0]).unwrap(),
        );
        assert!(low < high && a < other);
    }
}
