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

use crate::RemoteAccess;
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
    /// How far `ptr` lies past the start of the NIC registration the keys belong to: 0
    /// unless the region shares a larger registration (the registration cache). Backends
    /// that address remote memory by offset (libfabric without `FI_MR_VIRT_ADDR`) need it.
    // Always serialized: postcard (rendezvous records) is not self-describing.
    #[serde(default)]
    key_offset: u64,
    /// What the owner registered the region for, where the descriptor says (every one its
    /// engine made does): lets an initiator refuse a read of a write-only region before
    /// posting, on providers that do not enforce it themselves. A courtesy, not a
    /// protection: whoever holds the keys can forge this.
    #[serde(default)]
    access: Option<RemoteAccess>,
}

/// The unchecked shape serde sees; turned into an `MrDesc` only through [`MrDesc::new`].
#[derive(Deserialize)]
struct MrDescFields {
    ptr: u64,
    len: u64,
    rkeys: Vec<(NetAddr, u64)>,
    #[serde(default)]
    key_offset: u64,
    #[serde(default)]
    access: Option<RemoteAccess>,
}

impl TryFrom<MrDescFields> for MrDesc {
    type Error = DecodeError;
    fn try_from(f: MrDescFields) -> Result<Self, DecodeError> {
        Ok(Self::new(f.ptr, f.len, f.rkeys)?
            .within_registration_at(f.ptr.wrapping_sub(f.key_offset))?
            .with_access(f.access))
    }
}

/// The binary form's NIC-count byte also says, in bits the count (1 to 4) never uses, what
/// follows the keys and what the region was registered for: a key offset follows (marked,
/// so that cutting it off is refused as truncation), the descriptor says its access (absent
/// in older engines' descriptors, which still decode; older engines refuse these loudly),
/// and the two permissions.
const ACCESS_KNOWN: u8 = 0x80;
const KEY_OFFSET_FOLLOWS: u8 = 0x40;
const ACCESS_WRITE: u8 = 0x20;
const ACCESS_READ: u8 = 0x10;
const COUNT_BITS: u8 = 0x0f;

/// What a descriptor's count byte says.
struct CountByte {
    count: usize,
    key_offset_follows: bool,
    access: Option<RemoteAccess>,
}

impl CountByte {
    fn encode(&self) -> u8 {
        let access = self.access.map_or(0, |a| {
            ACCESS_KNOWN
                | if a.write { ACCESS_WRITE } else { 0 }
                | if a.read { ACCESS_READ } else { 0 }
        });
        let offset = if self.key_offset_follows {
            KEY_OFFSET_FOLLOWS
        } else {
            0
        };
        // new() bounds the count by MAX_NICS.
        self.count as u8 | access | offset
    }

    /// Permissions without the mark that says they are known are refused (no encoder writes
    /// them); the count is checked by the caller.
    fn decode(byte: u8) -> Result<Self, DecodeError> {
        let known = byte & ACCESS_KNOWN != 0;
        if !known && byte & (ACCESS_WRITE | ACCESS_READ) != 0 {
            return Err(DecodeError::Length {
                field: "MrDesc access bits without their mark",
                value: usize::from(byte),
                min: 0,
                max: usize::from(!(ACCESS_WRITE | ACCESS_READ)),
            });
        }
        Ok(Self {
            count: usize::from(byte & COUNT_BITS),
            key_offset_follows: byte & KEY_OFFSET_FOLLOWS != 0,
            access: known.then_some(RemoteAccess {
                write: byte & ACCESS_WRITE != 0,
                read: byte & ACCESS_READ != 0,
            }),
        })
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
        Ok(Self {
            ptr,
            len,
            rkeys,
            key_offset: 0,
            access: None,
        })
    }

    /// The same region, saying what its owner registered it for (`None`: unknown, as for
    /// descriptors from engines before descriptors carried it; the NIC alone decides).
    pub fn with_access(mut self, access: Option<RemoteAccess>) -> Self {
        self.access = access;
        self
    }

    /// What the owner registered the region for, if the descriptor says. Any holder of the
    /// keys can forge this; what a provider enforces is in docs/backends.md.
    pub fn access(&self) -> Option<RemoteAccess> {
        self.access
    }

    /// The same region, whose keys belong to a registration starting at `base` (at or before
    /// `ptr`): a range the registration cache served from a larger registration.
    pub fn within_registration_at(mut self, base: u64) -> Result<Self, DecodeError> {
        if base > self.ptr {
            return Err(DecodeError::Overflow {
                ptr: base,
                len: self.len,
            });
        }
        self.key_offset = self.ptr - base;
        Ok(self)
    }

    /// Where the NIC registration the keys belong to starts (`ptr` unless the region shares a
    /// larger registration).
    pub fn registration_base(&self) -> u64 {
        self.ptr - self.key_offset
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
        out.push(
            CountByte {
                count: self.rkeys.len(),
                key_offset_follows: self.key_offset != 0,
                access: self.access,
            }
            .encode(),
        );
        for (addr, rkey) in &self.rkeys {
            addr.encode_body(&mut out);
            out.extend_from_slice(&rkey.to_le_bytes());
        }
        // Only when non-zero (and then marked in the count byte).
        if self.key_offset != 0 {
            out.extend_from_slice(&self.key_offset.to_le_bytes());
        }
        out
    }

    /// Decodes [`to_bytes`](Self::to_bytes)' output, rejecting anything else.
    pub fn from_bytes(bytes: &[u8]) -> Result<Self, DecodeError> {
        let mut r = Reader::new(bytes);
        r.version()?;
        let ptr = r.u64()?;
        let len = r.u64()?;
        let CountByte {
            count,
            key_offset_follows,
            access,
        } = CountByte::decode(r.u8()?)?;
        check_len("NIC count", count, 1, MAX_NICS)?;
        let mut rkeys = Vec::with_capacity(count);
        for _ in 0..count {
            let addr = NetAddr::decode_body(&mut r)?;
            rkeys.push((addr, r.u64()?));
        }
        let key_offset = if key_offset_follows {
            match r.u64()? {
                // Written only when non-zero: an explicit zero would decode to a descriptor
                // that encodes otherwise, so it is refused (one encoding per descriptor).
                0 => return Err(DecodeError::Trailing(8)),
                k => k,
            }
        } else {
            0
        };
        r.finish()?;
        Ok(Self::new(ptr, len, rkeys)?
            .within_registration_at(ptr.wrapping_sub(key_offset))?
            .with_access(access))
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

/// Longest notification id, in bytes: one limit both sides know, checked when the sender
/// submits ([`TransferEngine::notify_when_done`](crate::TransferEngine::notify_when_done)), so
/// an id never fails after its transfer's data landed.
pub const NOTIFICATION_ID_MAX: usize = 256;

/// Every message between engines starts with one byte naming its channel, so the engine's
/// own messages travel where user payloads cannot reach: a user's bytes are never inspected.
const CHANNEL_USER: u8 = 0;
pub(crate) const CHANNEL_NOTIFICATION: u8 = 1;

/// Bytes the channel byte adds to every message.
pub const MESSAGE_HEADER_LEN: usize = 1;

/// Longest notification on the wire: channel, sender address (length + bytes), id.
pub const NOTIFICATION_WIRE_MAX: usize =
    MESSAGE_HEADER_LEN + 1 + MAX_ADDR_LEN + NOTIFICATION_ID_MAX;

/// The length of a receive buffer for user messages of up to `payload_max` bytes: room for
/// the channel byte, and never too short for a notification.
pub fn receive_buffer_len(payload_max: usize) -> usize {
    payload_max
        .saturating_add(MESSAGE_HEADER_LEN)
        .max(NOTIFICATION_WIRE_MAX)
}

/// A message as it arrives: a user's payload, or a notification naming its sender (the
/// sender's own claim: see docs/security.md).
#[derive(Debug, PartialEq, Eq)]
pub enum Message<'a> {
    /// Bytes a user sent with `submit_send`, for the receive handler.
    User(&'a [u8]),
    /// A notification attached to a finished transfer.
    Notification {
        /// The sender's main address.
        from: NetAddr,
        /// The id the sender attached, at most [`NOTIFICATION_ID_MAX`] bytes.
        id: &'a [u8],
    },
}

/// Why an arriving message was not understood (it is dropped and counted).
#[derive(Debug, PartialEq, Eq, thiserror::Error)]
pub enum MessageError {
    /// A message of zero bytes carries no channel.
    #[error("an empty message")]
    Empty,
    /// The channel byte names no channel this engine knows (a newer or a foreign peer).
    #[error("a message on unknown channel {0}")]
    UnknownChannel(u8),
    /// The notification's sender address does not decode.
    #[error("a notification with a bad sender address: {0}")]
    BadSender(DecodeError),
    /// The notification's id is longer than [`NOTIFICATION_ID_MAX`].
    #[error("a notification id of {0} bytes (at most {NOTIFICATION_ID_MAX})")]
    IdTooLong(usize),
}

/// A user's message on the wire.
pub fn encode_user_message(payload: &[u8]) -> Vec<u8> {
    let mut m = Vec::with_capacity(MESSAGE_HEADER_LEN + payload.len());
    m.push(CHANNEL_USER);
    m.extend_from_slice(payload);
    m
}

/// A notification on the wire. The caller checks `id` against [`NOTIFICATION_ID_MAX`].
pub fn encode_notification(from: &NetAddr, id: &[u8]) -> Vec<u8> {
    debug_assert!(id.len() <= NOTIFICATION_ID_MAX);
    let mut m = Vec::with_capacity(MESSAGE_HEADER_LEN + 1 + from.raw().len() + id.len());
    m.push(CHANNEL_NOTIFICATION);
    from.encode_body(&mut m);
    m.extend_from_slice(id);
    m
}

/// Reads a message's channel and, for a notification, its sender and id.
pub fn decode_message(message: &[u8]) -> Result<Message<'_>, MessageError> {
    let (&channel, body) = message.split_first().ok_or(MessageError::Empty)?;
    match channel {
        CHANNEL_USER => Ok(Message::User(body)),
        CHANNEL_NOTIFICATION => {
            let mut r = Reader::new(body);
            let from = NetAddr::decode_body(&mut r).map_err(MessageError::BadSender)?;
            let at = 1 + from.raw().len();
            let id = &body[at..];
            if id.len() > NOTIFICATION_ID_MAX {
                return Err(MessageError::IdTooLong(id.len()));
            }
            Ok(Message::Notification { from, id })
        }
        other => Err(MessageError::UnknownChannel(other)),
    }
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

    /// A region the registration cache served from a larger registration carries how far
    /// it starts into it (backends that address by offset need the registration's base); a
    /// plain descriptor's bytes are what they always were.
    #[test]
    fn a_shared_registration_keeps_its_base_in_every_form() {
        let a = NetAddr::new(&[1]).unwrap();
        let plain = MrDesc::new(0x1000, 64, vec![(a.clone(), 7)]).unwrap();
        let shared = plain.clone().within_registration_at(0x800).unwrap();
        assert_eq!(plain.registration_base(), 0x1000);
        assert_eq!(shared.registration_base(), 0x800);
        assert_eq!(shared.to_bytes().len(), plain.to_bytes().len() + 8);
        assert_eq!(MrDesc::from_bytes(&shared.to_bytes()).unwrap(), shared);
        assert_eq!(MrDesc::from_bytes(&plain.to_bytes()).unwrap(), plain);
        assert_eq!(shared.to_string().parse::<MrDesc>().unwrap(), shared);
        let pc = postcard::to_allocvec(&shared).unwrap();
        assert_eq!(postcard::from_bytes::<MrDesc>(&pc).unwrap(), shared);
        assert!(plain.clone().within_registration_at(0x1001).is_err());
        // An explicit zero offset is refused: every descriptor has one encoding (the fuzz
        // target found a zero trailer that decoded and re-encoded shorter).
        let mut zero = plain.to_bytes();
        zero.extend_from_slice(&0u64.to_le_bytes());
        assert_eq!(MrDesc::from_bytes(&zero), Err(DecodeError::Trailing(8)));
        // A key offset reaching before address 0 is refused, not wrapped.
        let mut bytes = plain.to_bytes();
        bytes.extend_from_slice(&0x2000u64.to_le_bytes());
        assert!(MrDesc::from_bytes(&bytes).is_err());
    }

    /// Issue 42 item 12: a descriptor says what its region was registered for, in every
    /// form, with one encoding each; one that does not say (an older engine's) still decodes.
    #[test]
    fn a_descriptor_carries_its_access_in_every_form() {
        let a = NetAddr::new(&[1]).unwrap();
        let plain = MrDesc::new(0x1000, 64, vec![(a, 7)]).unwrap();
        for access in [
            RemoteAccess::WRITE,
            RemoteAccess::READ,
            RemoteAccess::READ_WRITE,
        ] {
            for d in [
                plain.clone(),
                plain.clone().within_registration_at(0x800).unwrap(),
            ] {
                let d = d.with_access(Some(access));
                let bytes = d.to_bytes();
                assert_eq!(bytes.len(), d.clone().with_access(None).to_bytes().len());
                for cut in 1..bytes.len() {
                    assert!(MrDesc::from_bytes(&bytes[..cut]).is_err(), "cut at {cut}");
                }
                assert_eq!(MrDesc::from_bytes(&d.to_bytes()).unwrap(), d);
                assert_eq!(d.to_string().parse::<MrDesc>().unwrap(), d);
                let pc = postcard::to_allocvec(&d).unwrap();
                assert_eq!(postcard::from_bytes::<MrDesc>(&pc).unwrap(), d);
                assert_eq!(
                    MrDesc::from_bytes(&d.to_bytes()).unwrap().access(),
                    Some(access)
                );
            }
        }
        assert_eq!(
            MrDesc::from_bytes(&plain.to_bytes()).unwrap().access(),
            None
        );
        // Permissions without their mark, or unknown bits, are refused.
        let at = 1 + 8 + 8;
        for bad in [0x11, 0x21, 0x41, 0xc1, 0x05, 0x00] {
            let mut bytes = plain.to_bytes();
            bytes[at] = bad;
            assert!(MrDesc::from_bytes(&bytes).is_err(), "{bad:#x}");
        }
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
            key_offset: 0,
            access: None,
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
    fn messages_round_trip_and_user_bytes_are_never_taken_for_engine_messages() {
        let from = NetAddr::new(&[9; MAX_ADDR_LEN]).unwrap();
        let longest = [b'i'; NOTIFICATION_ID_MAX];
        let m = encode_notification(&from, &longest);
        assert_eq!(m.len(), NOTIFICATION_WIRE_MAX);
        assert_eq!(
            decode_message(&m),
            Ok(Message::Notification {
                from: from.clone(),
                id: &longest[..]
            })
        );
        assert_eq!(
            decode_message(&encode_notification(&from, b"")),
            Ok(Message::Notification { from, id: &b""[..] })
        );
        // Whatever a user sends, notification-shaped or not, stays a user message.
        let shaped = encode_notification(&NetAddr::new(&[1]).unwrap(), b"req");
        for payload in [&b""[..], b"req-42", &shaped, b"\xffXFNTF\x00\x01req"] {
            assert_eq!(
                decode_message(&encode_user_message(payload)),
                Ok(Message::User(payload))
            );
        }
    }

    #[test]
    fn malformed_messages_are_named() {
        assert_eq!(decode_message(b""), Err(MessageError::Empty));
        assert_eq!(
            decode_message(&[7, 1, 2]),
            Err(MessageError::UnknownChannel(7))
        );
        assert!(matches!(
            decode_message(&[CHANNEL_NOTIFICATION, 0]),
            Err(MessageError::BadSender(DecodeError::Length { .. }))
        ));
        assert!(matches!(
            decode_message(&[CHANNEL_NOTIFICATION, 5, 1]),
            Err(MessageError::BadSender(DecodeError::Truncated { .. }))
        ));
        let mut long = encode_notification(&NetAddr::new(&[1]).unwrap(), &[0; NOTIFICATION_ID_MAX]);
        long.push(0);
        assert_eq!(
            decode_message(&long),
            Err(MessageError::IdTooLong(NOTIFICATION_ID_MAX + 1))
        );
    }

    proptest! {
        #[test]
        fn the_message_decoder_never_panics(bytes in proptest::collection::vec(any::<u8>(), 0..400)) {
            let _ = decode_message(&bytes);
        }
    }
}
