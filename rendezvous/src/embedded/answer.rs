//! Answers as frames: encoded once, into the buffer that is written (a 4-byte little-endian
//! length, then the postcard body), so an answer is held once while a client takes it.

use serde::Serialize;

use super::wire::{Request, Response};

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

    #[test]
    fn a_frame_is_its_length_and_its_body() {
        let msg = Response::Values(vec![("/x/a".into(), vec![7; 300])]);
        let f = frame(&msg);
        let body = postcard::to_stdvec(&msg).unwrap();
        assert_eq!(f[..4], (body.len() as u32).to_le_bytes());
        assert_eq!(f[4..], body[..]);
    }
}
