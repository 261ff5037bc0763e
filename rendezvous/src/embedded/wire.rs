//! The protocol: a 4-byte little-endian length and a postcard body per frame; the requests
//! and responses; a reader that keeps a partial frame across read timeouts.

use std::io::{Read, Write};
use std::net::TcpStream;

use serde::de::DeserializeOwned;
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
    /// A listing (or a watch's snapshot) of `bytes` is more than the service holds for one
    /// connection (`budget`): asking again does not help.
    TooLarge {
        bytes: u64,
        budget: u64,
    },
    /// The service holds `held` of its `budget` bytes for other clients' answers: a listing
    /// of `bytes` is refused until they take theirs (or are cut off).
    Busy {
        bytes: u64,
        held: u64,
        budget: u64,
    },
}

pub(super) fn write_frame<T: Serialize>(s: &mut TcpStream, msg: &T) -> std::io::Result<()> {
    let body = postcard::to_stdvec(msg).map_err(std::io::Error::other)?;
    let mut frame = (body.len() as u32).to_le_bytes().to_vec();
    frame.extend(body);
    s.write_all(&frame)
}

/// Why a frame was refused. The connection it came on is closed: its framing can no longer
/// be trusted.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub(super) enum FrameError {
    /// The announced length is past what this side reads.
    #[error("a frame of {len} bytes (at most {limit})")]
    TooLong { len: usize, limit: usize },
    /// The body is not a message (truncated inside, a bad tag or length, invalid UTF-8).
    #[error("a malformed frame: {0}")]
    Malformed(postcard::Error),
    /// The body holds a message and then more bytes.
    #[error("a frame with {0} bytes after its message")]
    Trailing(usize),
}

impl From<FrameError> for std::io::Error {
    fn from(e: FrameError) -> Self {
        std::io::Error::new(std::io::ErrorKind::InvalidData, e)
    }
}

/// A frame's body as a message: exactly one, nothing after it.
fn decode_body<T: DeserializeOwned>(body: &[u8]) -> Result<T, FrameError> {
    let (msg, rest) = postcard::take_from_bytes(body).map_err(FrameError::Malformed)?;
    match rest.len() {
        0 => Ok(msg),
        n => Err(FrameError::Trailing(n)),
    }
}

/// The first frame in `buf` and the bytes it took, or `None` while it is not whole. Pure:
/// [`FrameReader`] feeds it what arrived on a socket, the `frame` fuzz target any bytes.
pub(super) fn decode_frame<T: DeserializeOwned>(
    buf: &[u8],
    limit: usize,
) -> Result<Option<(T, usize)>, FrameError> {
    let Some(head) = buf.first_chunk::<4>() else {
        return Ok(None);
    };
    let len = u32::from_le_bytes(*head) as usize;
    if len > limit {
        return Err(FrameError::TooLong { len, limit });
    }
    match buf[4..].get(..len) {
        Some(body) => Ok(Some((decode_body(body)?, 4 + len))),
        None => Ok(None),
    }
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
    pub(super) fn next<T: DeserializeOwned>(
        &mut self,
        s: &mut TcpStream,
        deadline: std::time::Instant,
    ) -> std::io::Result<Option<T>> {
        loop {
            if let Some((msg, used)) = decode_frame(&self.buf, self.limit)? {
                self.buf.drain(..used);
                return Ok(Some(msg));
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

pub(super) fn read_frame<T: DeserializeOwned>(s: &mut impl Read) -> std::io::Result<T> {
    let mut len = [0u8; 4];
    s.read_exact(&mut len)?;
    let len = u32::from_le_bytes(len) as usize;
    if len > MAX_FRAME {
        return Err(FrameError::TooLong {
            len,
            limit: MAX_FRAME,
        }
        .into());
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
    Ok(decode_body(&body)?)
}

/// Entry points for the `frame` fuzz target (`fuzz/`). Public only because the fuzz crate is
/// another crate; hidden, and not an API: the frames and messages stay private.
#[doc(hidden)]
pub mod fuzzing {
    use super::{decode_frame, frame_of, read_frame, Request, Response};
    use crate::embedded::MAX_REQUEST;

    /// Reads `data` as the service reads a connection: `Request` frames one after another
    /// until one is not whole or is refused. Each request read comes back re-encoded as a
    /// frame, which must read back the same.
    pub fn service_frames(mut data: &[u8]) -> Vec<Vec<u8>> {
        let mut frames = Vec::new();
        while let Ok(Some((req, used))) = decode_frame::<Request>(data, MAX_REQUEST) {
            frames.push(frame_of(&req));
            data = &data[used..];
        }
        frames
    }

    /// Reads one `Response` frame from `data` as a client reads one from its socket.
    pub fn client_frame(data: &[u8]) -> bool {
        read_frame::<Response>(&mut std::io::Cursor::new(data)).is_ok()
    }
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

    /// A frame is one message and nothing else: a body with bytes after its message, or one
    /// announcing more than the limit, is refused (the connection is then closed); a frame
    /// not yet whole waits for its bytes.
    #[test]
    fn frames_are_decoded_whole_and_exactly() {
        let frame = request_frame_for_tests("k");
        let (req, used) = decode_frame::<Request>(&frame, 64).unwrap().unwrap();
        assert!(matches!(req, Request::Get { key } if key == "k"));
        assert_eq!(used, frame.len());
        for cut in 0..frame.len() {
            assert!(decode_frame::<Request>(&frame[..cut], 64)
                .unwrap()
                .is_none());
        }
        let mut padded = frame.clone();
        padded[0] += 1;
        padded.push(0);
        assert!(matches!(
            decode_frame::<Request>(&padded, 64),
            Err(FrameError::Trailing(1))
        ));
        assert!(matches!(
            decode_frame::<Request>(&frame, 2),
            Err(FrameError::TooLong { limit: 2, .. })
        ));
        assert!(matches!(
            decode_frame::<Request>(&[1, 0, 0, 0, 200], 64),
            Err(FrameError::Malformed(_))
        ));
        let two = [&frame[..], &frame[..]].concat();
        assert_eq!(fuzzing::service_frames(&two), vec![frame.clone(), frame]);
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
