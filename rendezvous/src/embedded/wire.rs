//! The protocol: a 4-byte little-endian length and a postcard body per frame; the requests
//! and responses; a reader that keeps a partial frame across read timeouts.

use std::io::{Read, Write};
use std::net::TcpStream;

use serde::{Deserialize, Serialize};

use super::MAX_FRAME;
use crate::secret::Proof;

#[derive(Debug, Serialize, Deserialize)]
pub(super) enum Request {
    /// The first request on every connection: the client's nonce.
    Hello {
        nonce: Proof,
    },
    /// The client's proof of the secret, when the service's `Welcome` carried a challenge.
    Prove {
        proof: Proof,
    },
    /// Stores `value` under `key`. A key held by a live lease is refused unless `owner` is
    /// that lease (its publisher re-publishing).
    Put {
        key: String,
        value: Vec<u8>,
        ttl_ms: u64,
        owner: Option<u64>,
    },
    KeepAlive {
        lease: u64,
    },
    Revoke {
        lease: u64,
    },
    Get {
        key: String,
    },
    List {
        prefix: String,
    },
    Watch {
        prefix: String,
    },
}

#[derive(Debug, Serialize, Deserialize)]
pub(super) enum Response {
    /// The answer to `Hello`: with a secret, the service's nonce and its proof.
    Welcome {
        challenge: Option<(Proof, Proof)>,
    },
    /// A put of a key another live lease holds.
    Taken,
    /// Sent on an idle watch stream, so both ends notice a dead peer.
    Heartbeat,
    Lease(u64),
    Ok,
    NoLease,
    Value(Option<Vec<u8>>),
    Values(Vec<(String, Vec<u8>)>),
    Put(String, Vec<u8>),
    Delete(String),
    Refused(String),
}

pub(super) fn write_frame<T: Serialize>(s: &mut TcpStream, msg: &T) -> std::io::Result<()> {
    let body = postcard::to_stdvec(msg).map_err(std::io::Error::other)?;
    let mut frame = (body.len() as u32).to_le_bytes().to_vec();
    frame.extend(body);
    s.write_all(&frame)
}

/// Reads frames from a stream whose reads time out, keeping a partial frame across
/// timeouts (a timeout mid-frame used to drop what was read and desynchronise the stream).
pub(super) struct FrameReader {
    buf: Vec<u8>,
    limit: usize,
}

impl FrameReader {
    pub(super) fn new(limit: usize) -> Self {
        Self {
            buf: Vec::new(),
            limit,
        }
    }

    /// The next whole frame; `None` if a read timed out first, or `deadline` passed while
    /// bytes kept arriving (what arrived is kept either way: the caller decides whether a
    /// frame that is not whole in time ends the connection).
    pub(super) fn next<T: for<'de> Deserialize<'de>>(
        &mut self,
        s: &mut TcpStream,
        deadline: std::time::Instant,
    ) -> std::io::Result<Option<T>> {
        loop {
            if self.buf.len() >= 4 {
                let len = u32::from_le_bytes(self.buf[..4].try_into().expect("4 bytes")) as usize;
                if len > self.limit {
                    return Err(std::io::Error::other(format!(
                        "a frame of {len} bytes (at most {})",
                        self.limit
                    )));
                }
                if self.buf.len() >= 4 + len {
                    let msg =
                        postcard::from_bytes(&self.buf[4..4 + len]).map_err(std::io::Error::other);
                    self.buf.drain(..4 + len);
                    return msg.map(Some);
                }
            }
            let mut chunk = [0u8; 4096];
            match s.read(&mut chunk) {
                Ok(0) => return Err(std::io::ErrorKind::UnexpectedEof.into()),
                Ok(n) => {
                    self.buf.extend_from_slice(&chunk[..n]);
                    if std::time::Instant::now() >= deadline {
                        return Ok(None);
                    }
                }
                Err(e)
                    if matches!(
                        e.kind(),
                        std::io::ErrorKind::WouldBlock | std::io::ErrorKind::TimedOut
                    ) =>
                {
                    return Ok(None)
                }
                Err(e) => return Err(e),
            }
        }
    }
}

/// A `Get` request as bytes on the wire (tests that speak the protocol by hand).
#[doc(hidden)]
pub fn request_frame_for_tests(key: &str) -> Vec<u8> {
    frame_of(&Request::Get {
        key: key.to_owned(),
    })
}

/// A `Hello` as bytes on the wire (tests that speak the protocol by hand).
#[doc(hidden)]
pub fn hello_frame_for_tests() -> Vec<u8> {
    frame_of(&Request::Hello { nonce: [7; 32] })
}

/// A `Put` of `key` claiming no lease (tests that try to take a name over by hand).
#[doc(hidden)]
pub fn takeover_frame_for_tests(key: &str) -> Vec<u8> {
    frame_of(&Request::Put {
        key: key.to_owned(),
        value: b"evil".to_vec(),
        ttl_ms: 60_000,
        owner: None,
    })
}

/// Whether a response body is `Taken` (tests that speak the protocol by hand).
#[doc(hidden)]
pub fn is_taken_for_tests(body: &[u8]) -> bool {
    matches!(postcard::from_bytes(body), Ok(Response::Taken))
}

fn frame_of(req: &Request) -> Vec<u8> {
    let body = postcard::to_stdvec(req).expect("a request serializes");
    let mut frame = (body.len() as u32).to_le_bytes().to_vec();
    frame.extend(body);
    frame
}

/// The value in a `Get` answer's body (tests that speak the protocol by hand).
#[doc(hidden)]
pub fn value_of_response_for_tests(body: &[u8]) -> Option<Vec<u8>> {
    match postcard::from_bytes(body).ok()? {
        Response::Value(v) => v,
        _ => None,
    }
}

/// What a frame's body is first read into (most frames are smaller).
const FIRST_READ: usize = 64 << 10;

pub(super) fn read_frame<T: for<'de> Deserialize<'de>>(s: &mut impl Read) -> std::io::Result<T> {
    let mut len = [0u8; 4];
    s.read_exact(&mut len)?;
    let len = u32::from_le_bytes(len) as usize;
    if len > MAX_FRAME {
        return Err(std::io::Error::other(format!("a frame of {len} bytes")));
    }
    // Grown as the bytes arrive, not allocated from the announced length: whatever answers
    // at the service's address costs this client only what it actually sends.
    let mut body = Vec::with_capacity(len.min(FIRST_READ));
    s.by_ref().take(len as u64).read_to_end(&mut body)?;
    if body.len() < len {
        return Err(std::io::Error::new(
            std::io::ErrorKind::UnexpectedEof,
            format!(
                "the connection closed {} bytes into a frame of {len}",
                body.len()
            ),
        ));
    }
    postcard::from_bytes(&body).map_err(std::io::Error::other)
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A peer that announces a frame and sends only part of it, recording the largest
    /// buffer it was asked to fill (what the reader allocated ahead of the bytes).
    struct Announcer {
        bytes: std::io::Cursor<Vec<u8>>,
        largest_read: usize,
    }

    impl Read for Announcer {
        fn read(&mut self, buf: &mut [u8]) -> std::io::Result<usize> {
            self.largest_read = self.largest_read.max(buf.len());
            self.bytes.read(buf)
        }
    }

    /// A service (or anything at its address) that announces a frame near the limit and sends
    /// a few bytes costs the client memory for those bytes only, not for the announcement.
    #[test]
    fn an_announced_length_is_not_allocated_before_its_bytes_arrive() {
        let announced = (MAX_FRAME as u32).to_le_bytes();
        let mut peer = Announcer {
            bytes: std::io::Cursor::new([&announced[..], &[0u8; 16]].concat()),
            largest_read: 0,
        };
        let err = read_frame::<Response>(&mut peer).unwrap_err();
        assert_eq!(err.kind(), std::io::ErrorKind::UnexpectedEof, "{err}");
        assert!(peer.largest_read <= 1 << 20, "{} bytes", peer.largest_read);
    }
}
