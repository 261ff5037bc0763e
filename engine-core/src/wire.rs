//! Wire formats: [`NetAddr`] and [`MrDesc`], the two things peers exchange out of band.
//!
//! Each has three forms: serde (for the caller's own RPC), a compact versioned binary form
//! (`to_bytes`/`from_bytes`) and its hex text (`Display`/`FromStr`). Decoders check the version,
//! reject truncation, trailing bytes and absurd lengths, and never panic: these bytes come from
//! another machine. [`NetAddr`] and the primitives live in the plugin kit (`xfer-plugin`), since
//! every backend hands addresses back.

use std::fmt;
use std::str::FromStr;

use serde::{Deserialize, Serialize};

use xfer_plugin::addr::{check_len, from_hex, Reader};
pub use xfer_plugin::addr::{DecodeError, NetAddr, MAX_ADDR_LEN, WIRE_VERSION};

/// Most NICs a DomainGroup (and so an `MrDesc`) can hold.
pub const MAX_NICS: usize = 4;

/// What a peer needs to write into a registered region: its start address, length, and one
/// (NIC address, rkey) pair per NIC of the owner's DomainGroup, in NIC order.
#[derive(Clone, Debug, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(try_from = "MrDescFields")]
pub struct MrDesc {
    ptr: u64,
    len: u64,
    rkeys: Vec<(NetAddr, u64)>,
}

/// The unchecked shape serde sees; turned into an `MrDesc` only through [`MrDesc::new`].
#[derive(Deserialize)]
struct MrDescFields {
    ptr: u64,
    len: u64,
    rkeys: Vec<(NetAddr, u64)>,
}

impl TryFrom<MrDescFields> for MrDesc {
    type Error = DecodeError;
    fn try_from(f: MrDescFields) -> Result<Self, DecodeError> {
        Self::new(f.ptr, f.len, f.rkeys)
    }
}

impl MrDesc {
    /// Builds a descriptor, checking that it names 1 to [`MAX_NICS`] NICs and a region that
    /// fits in the address space.
    pub fn new(ptr: u64, len: u64, rkeys: Vec<(NetAddr, u64)>) -> Result<Self, DecodeError> {
        check_len("NIC count", rkeys.len(), 1, MAX_NICS)?;
        if ptr.checked_add(len).is_none() {
            return Err(DecodeError::Overflow { ptr, len });
        }
        Ok(Self { ptr, len, rkeys })
    }

    /// Start address of the region in the owner's address space.
    pub fn ptr(&self) -> u64 {
        self.ptr
    }

    /// Length of the region in bytes.
    pub fn len(&self) -> u64 {
        self.len
    }

    /// Whether the region is empty (only zero-byte writes, such as barriers, can target it).
    pub fn is_empty(&self) -> bool {
        self.len == 0
    }

    /// One (NIC address, rkey) pair per NIC of the owner, in NIC order.
    pub fn rkeys(&self) -> &[(NetAddr, u64)] {
        &self.rkeys
    }

    /// The owner's first NIC: the address its engine's `main_address` returns.
    pub fn owner(&self) -> &NetAddr {
        &self.rkeys[0].0
    }

    /// The compact binary form.
    pub fn to_bytes(&self) -> Vec<u8> {
        let mut out = Vec::with_capacity(18 + self.rkeys.len() * (10 + MAX_ADDR_LEN));
        out.push(WIRE_VERSION);
        out.extend_from_slice(&self.ptr.to_le_bytes());
        out.extend_from_slice(&self.len.to_le_bytes());
        // new() bounds the count by MAX_NICS.
        out.push(self.rkeys.len() as u8);
        for (addr, rkey) in &self.rkeys {
            addr.encode_body(&mut out);
            out.extend_from_slice(&rkey.to_le_bytes());
        }
        out
    }

    /// Decodes [`to_bytes`](Self::to_bytes)' output, rejecting anything else.
    pub fn from_bytes(bytes: &[u8]) -> Result<Self, DecodeError> {
        let mut r = Reader::new(bytes);
        r.version()?;
        let ptr = r.u64()?;
        let len = r.u64()?;
        let count = usize::from(r.u8()?);
        check_len("NIC count", count, 1, MAX_NICS)?;
        let mut rkeys = Vec::with_capacity(count);
        for _ in 0..count {
            let addr = NetAddr::decode_body(&mut r)?;
            rkeys.push((addr, r.u64()?));
        }
        r.finish()?;
        Self::new(ptr, len, rkeys)
    }
}

/// Hex of the binary form.
impl fmt::Display for MrDesc {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&hex::encode(self.to_bytes()))
    }
}

impl FromStr for MrDesc {
    type Err = DecodeError;
    fn from_str(text: &str) -> Result<Self, DecodeError> {
        Self::from_bytes(&from_hex(text)?)
    }
}

/// The tag that starts a notification message (see
/// [`TransferEngine::notify_when_done`](crate::TransferEngine::notify_when_done)): eight bytes
/// no text message starts with. Messages that start with it are notifications; user messages
/// must not.
pub const NOTIFY_TAG: [u8; 8] = *b"\xffXFNTF\x00\x01";

/// A notification's message: the tag, then the caller's id bytes.
pub fn encode_notification(id: &[u8]) -> Vec<u8> {
    let mut m = Vec::with_capacity(NOTIFY_TAG.len() + id.len());
    m.extend_from_slice(&NOTIFY_TAG);
    m.extend_from_slice(id);
    m
}

/// The id of a notification message, or `None` for any other message.
pub fn decode_notification(message: &[u8]) -> Option<&[u8]> {
    message.strip_prefix(&NOTIFY_TAG[..])
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    fn desc() -> MrDesc {
        let nic0 = NetAddr::new(&[1, 2, 3]).unwrap();
        let nic1 = NetAddr::new(&[4; 32]).unwrap();
        MrDesc::new(0x1000, 4096, vec![(nic0, 7), (nic1, u64::MAX)]).unwrap()
    }

    #[test]
    fn every_form_round_trips() {
        let d = desc();
        assert_eq!(MrDesc::from_bytes(&d.to_bytes()).unwrap(), d);
        assert_eq!(d.to_string().parse::<MrDesc>().unwrap(), d);
        assert_eq!(
            postcard::from_bytes::<MrDesc>(&postcard::to_allocvec(&d).unwrap()).unwrap(),
            d
        );
        let a = d.owner().clone();
        assert_eq!(a.to_string().parse::<NetAddr>().unwrap(), a);
        assert_eq!(NetAddr::from_bytes(&a.to_bytes()).unwrap(), a);
    }

    #[test]
    fn every_truncation_is_rejected() {
        let bytes = desc().to_bytes();
        for cut in 0..bytes.len() {
            let err = MrDesc::from_bytes(&bytes[..cut]).unwrap_err();
            assert!(
                matches!(err, DecodeError::Truncated { .. }),
                "cut {cut}: {err}"
            );
        }
    }

    #[test]
    fn trailing_bytes_wrong_version_and_absurd_lengths_are_rejected() {
        let mut bytes = desc().to_bytes();
        bytes.push(0);
        assert_eq!(MrDesc::from_bytes(&bytes), Err(DecodeError::Trailing(1)));

        let mut bytes = desc().to_bytes();
        bytes[0] = 9;
        assert!(matches!(
            MrDesc::from_bytes(&bytes),
            Err(DecodeError::Version { found: 9, .. })
        ));

        let mut bytes = desc().to_bytes();
        bytes[17] = 200; // NIC count
        assert!(matches!(
            MrDesc::from_bytes(&bytes),
            Err(DecodeError::Length {
                field: "NIC count",
                ..
            })
        ));

        let mut bytes = desc().to_bytes();
        bytes[18] = 255; // first address length
        assert!(matches!(
            MrDesc::from_bytes(&bytes),
            Err(DecodeError::Length {
                field: "address length",
                ..
            })
        ));

        assert!(matches!(
            NetAddr::from_bytes(&[WIRE_VERSION, 0]),
            Err(DecodeError::Length { .. })
        ));
        assert!(matches!("zz".parse::<NetAddr>(), Err(DecodeError::Hex(_))));
    }

    #[test]
    fn overflowing_region_is_rejected_in_every_form() {
        let a = NetAddr::new(&[1]).unwrap();
        assert!(matches!(
            MrDesc::new(u64::MAX, 2, vec![(a.clone(), 1)]),
            Err(DecodeError::Overflow { .. })
        ));
        let bad = MrDesc {
            ptr: u64::MAX,
            len: 2,
            rkeys: vec![(a, 1)],
        };
        assert!(MrDesc::from_bytes(&bad.to_bytes()).is_err());
        assert!(postcard::from_bytes::<MrDesc>(&postcard::to_allocvec(&bad).unwrap()).is_err());
    }

    proptest! {
        #[test]
        fn decoders_never_panic(bytes in proptest::collection::vec(any::<u8>(), 0..200)) {
            let _ = MrDesc::from_bytes(&bytes);
            let _ = NetAddr::from_bytes(&bytes);
            let _ = postcard::from_bytes::<MrDesc>(&bytes);
        }
    }

    #[test]
    fn notifications_round_trip_and_other_messages_are_not_taken_for_them() {
        let m = encode_notification(b"req-42");
        assert_eq!(decode_notification(&m), Some(&b"req-42"[..]));
        assert_eq!(
            decode_notification(&encode_notification(b"")),
            Some(&b""[..])
        );
        assert_eq!(decode_notification(b"req-42"), None);
        assert_eq!(decode_notification(&NOTIFY_TAG[..7]), None);
        assert_eq!(decode_notification(b""), None);
    }
}
