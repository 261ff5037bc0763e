//! Why one file: it is one state machine. Every transition reads and writes the same per-peer
//! `State` and the rules depend on each other (prev, proof, candidates, the Ready echo, the
//! MAC); split, a rule would sit apart from the states it guards. A third of it is these docs.
//!
//! The connection handshake as a pure state machine, after quinn-proto's design: it reads no
//! clock, creates no QP, sends nothing and sleeps nowhere. The Domain feeds it datagrams, the
//! time and the outcome of what it asked for, and carries out the [`Action`]s it returns; the
//! Pair harness (`handshake/pair.rs`) does the same against a lossy, duplicating, reordering
//! network on a virtual clock, for thousands of seeds without a device.
//!
//! Three steps over the device's UD QP, each resent until `connect` passes — a request every
//! `retry`, a response with a doubling interval from `retry` (a lost response is recovered
//! by the requester's resends, each answered at once; the timer covers a lost `Ready`, and
//! without a secret a forged request's address gets 5 datagrams, not 15):
//!
//! 1. The requester creates its two RC QPs and sends `Request` (their numbers and first
//!    PSNs; `prev`: the id of the connection with that peer it replaces, 0 for none).
//! 2. The responder creates (or reuses) QPs, connects them to the request's, and answers
//!    `Response`. It posts nothing yet: the requester's QPs may not receive yet, and a packet
//!    sent early is dropped there and retransmitted only after the ack timeout.
//! 3. The requester connects its QPs to the response's and sends `Ready`; it may post now,
//!    and so may the responder once the `Ready` arrives.
//!
//! Without a cluster secret a request's `from` is its sender's word, so before step 2 the
//! responder checks **return routability**: a request that does not carry the cookie for its
//! `from` and id is answered with a `Cookie` (a MAC under a key this side drew at start and
//! never sends, over that address and request id) and nothing is kept; the requester repeats
//! its request with the cookie (and every resend carries it). Only a host that receives at
//! `from` learns the cookie, so a forged request in X's name costs the responder one datagram
//! of the request's size back to X and holds no slot and no QPs, and cannot make X's own
//! request wait (review 2026-12-07). One more round trip per connection; with the secret the
//! MAC proves the sender and no cookie is asked.
//!
//! Rules a datagram cannot break:
//! - Simultaneous connects: the smaller address answers, the larger keeps waiting.
//! - A repeated `Request` (the response was lost) is answered with the same response; a
//!   repeated `Response` (the `Ready` was lost) with `Ready` again — but only if it names the
//!   QPs we connected to: a response to our request naming others means the responder
//!   rebuilt its side (our answer there was displaced), so our connection is dead; it fails
//!   ([`Failure::Rebuilt`]) rather than confirm QPs we are not connected to — unless our
//!   connection is proven (the QPs we connected to answered, so they exist): then such a
//!   response is forged or replayed and ignored. Likewise a
//!   `Ready` counts only if it echoes the response it answers (a delayed duplicate confirming
//!   an earlier answer to the same request is ignored).
//! - A `Request` that would replace a *proven* connection — one that carried traffic (an RC
//!   completion or arrival on its QPs: the peer's QPs acked, so they exist and are connected
//!   to ours; the Domain reports it through [`Handshaker::proven`]) — must name it (`prev`):
//!   a stale or forged datagram cannot tear down a live connection. A request that does not
//!   name an established but unproven connection builds a *candidate* beside it: new QPs and
//!   a response, while the old connection keeps serving; the candidate replaces it only when
//!   its own `Ready` arrives ([`Action::Promote`]) and is dropped at its deadline otherwise
//!   ([`Action::DropCandidate`]). So a forged Request + Ready claiming to be X cannot lock the
//!   real X out (X, having lost its state, can only send `prev = 0`, and its handshake
//!   completes as a candidate), and forged or stale requests alone change nothing. A
//!   connection still waiting for its `Ready` is replaced only by a request naming it: a
//!   requester that gave up on it resends its new request, answered once the half-open entry's
//!   deadline passed (which comes first: it began before the new attempt), so a flood of
//!   forged requests in its name neither costs QPs nor keeps its own `Ready` from matching
//!   (issue 56). Chosen trade-off: a peer that restarted at the very
//!   same address (QPN reuse) while its old connection is proven is answered only once this
//!   side noticed that connection is dead (its next write fails: [`Handshaker::forget`]) —
//!   new processes get new QPNs.
//! - At most `max_half_open` handshakes wait for their `Ready` at once: a request from a new
//!   peer beyond that is dropped (a real requester resends it), so a flood of forged sources
//!   costs a bounded number of QPs, and a source whose answer is never confirmed leaves
//!   nothing behind after its deadline. Without a cluster secret such a flood can still delay
//!   new connections; it cannot tear down proven ones.
//! - With a cluster secret ([`Handshaker::with_secret`]) every message carries a MAC
//!   (HMAC-SHA256 over the message, truncated to [`MAC_LEN`] bytes, keyed by the handshake's
//!   own key derived from the secret) and a datagram whose MAC
//!   does not verify is dropped before any state is kept: only holders of the secret can
//!   take part. The MAC also covers the receiver's address and the sender's freshness: its
//!   epoch (the Domain gives the wall clock at its start, so a restarted process counts from
//!   later) and a count of the messages it sealed in it, carried between message and MAC.
//!   Each side keeps the newest (epoch, count) it took from each authentic sender and drops
//!   anything not newer: a recorded datagram replayed, to us or to another host, is dropped
//!   before any state is kept — without that, an old request replayed while our own request
//!   to its sender was under way took our QPs and our attempts never completed. Reordered
//!   honest datagrams drop too and are resent as lost ones are (every resend is sealed
//!   anew). A host whose clock steps back across its restart is refused by peers that
//!   remember its old epoch until they restart. An epoch more than [`MAX_EPOCH_AHEAD`] past
//!   the wall clock the Domain gives ([`Handshaker::handle_wall_clock`]) is refused: one
//!   datagram with a far-future epoch would make its sender's later ones stale for good.

use std::time::{Duration, Instant};

use foldhash::HashMap;
use hmac::{KeyInit, Mac};
use rand::rngs::StdRng;
use rand::RngExt;
use xfer_plugin::addr::NetAddr;
use xfer_plugin::secret::{derive_key, KeyUse};

use crate::wire::{Handshake, Kind, VerbsAddr, MSG_LEN};

/// Bytes of MAC a keyed handshake message carries after the message and its freshness.
pub(crate) const MAC_LEN: usize = 16;

/// Bytes of freshness a keyed message carries between the message and its MAC: the sender's
/// epoch and the count of messages it sealed in it (little-endian u64s).
pub(crate) const FRESHNESS_LEN: usize = 16;

type HmacSha256 = hmac::Hmac<sha2::Sha256>;

/// Resend interval, deadline and limits of the handshakes.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct Settings {
    /// A request or response unanswered this long is sent again.
    pub retry: Duration,
    /// A handshake not finished this long after it began fails.
    pub connect: Duration,
    /// Most handshakes waiting for their `Ready` at once.
    pub max_half_open: usize,
    /// Most handshakes this side started and not yet answered at once: each holds a pair of
    /// QPs, and a component that answers whatever address a message names would otherwise
    /// build them for any address it is sent (issue 56).
    pub max_requesting: usize,
    /// Without a cluster secret, answer a request that carries no valid cookie with a
    /// `Cookie` and keep nothing (see the module docs). The Domain always sets it; rule tests
    /// of what comes after the cookie leave it off.
    pub cookies: bool,
}

/// Our end of a connection: the numbers of its two QPs and their first PSNs.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub(crate) struct Ends {
    pub data_qpn: u32,
    pub data_psn: u32,
    pub msg_qpn: u32,
    pub msg_psn: u32,
}

/// What the peer had with us when its request was accepted: what becomes of its QPs.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Prior {
    /// Nothing: create QPs.
    None,
    /// Our own request to it (we are the smaller address): reuse the QPs created for it.
    Requesting,
    /// A connection (established, or waiting for its `Ready`) that the request replaces:
    /// retire it (its QPs go to the error state) and create new QPs.
    Connected,
    /// An established connection that has not carried traffic and that the request does not
    /// name: keep it serving, and create the new QPs beside it as a candidate.
    Candidate,
}

/// Why a handshake failed.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) enum Failure {
    /// Our request was not answered within the deadline.
    NoAnswer { connect_ms: u64 },
    /// We answered, and the requester never confirmed with `Ready` within the deadline.
    NeverConfirmed { connect_ms: u64 },
    /// Creating or connecting the QPs failed (the Domain's words).
    Qps(String),
    /// The responder answered our established request again with other QPs: it rebuilt its
    /// side, and ours talks to QPs that are gone.
    Rebuilt,
}

impl std::fmt::Display for Failure {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Self::NoAnswer { connect_ms } => write!(f, "no answer to the connection handshake within {connect_ms} ms (is the peer up? same GID type and subnet?)"),
            Self::NeverConfirmed { connect_ms } => write!(f, "the peer answered the handshake but never confirmed its side (Ready) within {connect_ms} ms"),
            Self::Qps(why) => f.write_str(why),
            Self::Rebuilt => f.write_str("the peer rebuilt its side of the connection (answered our request again with other QPs)"),
        }
    }
}

/// What the Domain must do.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) enum Action {
    /// Send `msg` to `to` on the UD QP. If it cannot go now, tell [`Handshaker::unsent`].
    Send {
        peer: NetAddr,
        to: VerbsAddr,
        msg: Handshake,
    },
    /// Accept `request` from `peer`: get QPs as `prior` says, connect them to the request's
    /// with our first PSNs `psns` (data, msg), then call [`Handshaker::accepted`].
    Accept {
        peer: NetAddr,
        request: Handshake,
        psns: (u32, u32),
        prior: Prior,
    },
    /// Connect our QPs (`local`) to `response`'s, then call [`Handshaker::completed`].
    Complete {
        peer: NetAddr,
        response: Handshake,
        local: Ends,
    },
    /// The connection with `peer` may post.
    Ready { peer: NetAddr },
    /// The candidate's `Ready` came: retire the connection it stood beside (what it never
    /// posted moves over) and make the candidate's QPs the connection, ready to post.
    Promote { peer: NetAddr },
    /// The candidate was not confirmed in time, or the old connection proved itself: destroy
    /// the candidate's QPs; the connection goes on.
    DropCandidate { peer: NetAddr },
    /// The handshake with `peer` failed: fail its connection (what was queued fails).
    Fail { peer: NetAddr, why: Failure },
}

/// The sender's QPs and first PSNs that a handshake message names.
fn ends_of(h: &Handshake) -> Ends {
    Ends {
        data_qpn: h.data_qpn,
        data_psn: h.data_psn,
        msg_qpn: h.msg_qpn,
        msg_psn: h.msg_psn,
    }
}

/// One peer's handshake state.
#[derive(Debug, Clone, Copy)]
enum State {
    /// We sent a request; waiting for its response.
    Requesting {
        request_id: u64,
        ends: Ends,
        deadline: Instant,
        last_sent: Instant,
        /// The responder's cookie for this request, once it sent one (0: none yet).
        cookie: u64,
    },
    /// We answered a request; waiting for the requester's `Ready`.
    AwaitingReady {
        request_id: u64,
        response: Handshake,
        deadline: Instant,
        last_sent: Instant,
        /// Traffic already arrived on its QPs (the requester posts once connected; its
        /// `Ready` may still be on the way).
        proven: bool,
    },
    /// Both sides can receive. `response`: ours, if we were the responder (a repeated
    /// request gets it again). `answered_by`: if we were the requester, the responder's QPs
    /// we connected to. `proven`: traffic flowed on its QPs.
    Established {
        request_id: u64,
        response: Option<Handshake>,
        answered_by: Option<Ends>,
        proven: bool,
        candidate: Option<Candidate>,
    },
}

/// A connection being built beside an unproven established one (see the module docs).
#[derive(Debug, Clone, Copy)]
struct Candidate {
    request_id: u64,
    response: Handshake,
    deadline: Instant,
    last_sent: Instant,
}

/// When a handshake under way in a state is due: its deadline and its last send (for an
/// established connection, its candidate's). `None`: nothing under way.
struct Timers<'a> {
    deadline: Instant,
    last_sent: &'a mut Instant,
    /// A response (ours to a request), resent with a doubling interval: a lost one is
    /// recovered by the requester's own resends, answered at once, so the timer is only for
    /// a lost `Ready` — and without a secret the request's address may be a forged one this
    /// side would otherwise send 15 datagrams (issue 56).
    backs_off: bool,
}

impl Timers<'_> {
    /// When the next resend is due: `retry` after the last, or for a response as long after
    /// it as it came after the handshake began (200, 400, 800, 1,600 ms with the defaults).
    fn next_send(&self, retry: Duration, connect: Duration) -> Instant {
        let interval = if self.backs_off {
            let began = self
                .deadline
                .checked_sub(connect)
                .unwrap_or(*self.last_sent);
            retry.max(self.last_sent.saturating_duration_since(began))
        } else {
            retry
        };
        *self.last_sent + interval
    }
}

impl State {
    fn timers(&mut self) -> Option<Timers<'_>> {
        match self {
            State::Requesting {
                deadline,
                last_sent,
                ..
            } => Some(Timers {
                deadline: *deadline,
                last_sent,
                backs_off: false,
            }),
            State::AwaitingReady {
                deadline,
                last_sent,
                ..
            }
            | State::Established {
                candidate:
                    Some(Candidate {
                        deadline,
                        last_sent,
                        ..
                    }),
                ..
            } => Some(Timers {
                deadline: *deadline,
                last_sent,
                backs_off: true,
            }),
            State::Established { .. } => None,
        }
    }

    /// Whether a handshake is under way (see [`timers`](Self::timers)).
    #[cfg(test)]
    fn under_way(&self) -> bool {
        !matches!(
            self,
            State::Established {
                candidate: None,
                ..
            }
        )
    }
}

/// Every peer's handshake (see the module docs).
pub(crate) struct Handshaker {
    me: VerbsAddr,
    /// `me` as the engine's address, compared byte-wise to break simultaneous connects.
    my_addr: NetAddr,
    mtu: u8,
    settings: Settings,
    /// Request ids and first PSNs: a CSPRNG, because without a secret their being
    /// unpredictable is what keeps an off-path host from completing a handshake in another's
    /// name.
    rng: StdRng,
    peers: HashMap<NetAddr, State>,
    /// The request id of the last connection established with each peer: what a request
    /// replacing it must name (`prev`). Kept when the connection fails.
    established: HashMap<NetAddr, u64>,
    /// The cluster secret's MAC key and the freshness it protects, when one is configured.
    keyed: Option<Keyed>,
    /// Keys the cookies this side hands out (drawn at start, never sent).
    cookie_key: HmacSha256,
    /// Requests answered with a cookie instead of state (no secret, no valid cookie).
    cookies_sent: u64,
    /// Datagrams dropped because their MAC did not verify (or was missing).
    unauthenticated: u64,
    /// Authentic datagrams dropped because they were not newer than one already taken from
    /// their sender (replays, or honest ones overtaken).
    stale: u64,
}

/// A sender's freshness: its epoch and the count of messages it sealed in it, compared in
/// that order.
type Freshness = (u64, u64);

/// What a cluster secret adds (see the module docs).
struct Keyed {
    key: HmacSha256,
    /// Ours: later after each restart.
    epoch: u64,
    /// Messages we sealed in `epoch`.
    sealed: u64,
    /// The newest (epoch, count) taken from each authentic sender. One entry per peer
    /// process that ever reached us with the secret: only holders of it add one.
    newest: HashMap<NetAddr, Freshness>,
    /// The latest epoch taken (the wall clock the Domain last gave, plus
    /// [`MAX_EPOCH_AHEAD`]); `None` until it gives one (the Pair harness's virtual epochs).
    latest_epoch: Option<u64>,
}

/// How far ahead of our wall clock a sender's epoch may be (clock skew between hosts): one
/// datagram with a far-future epoch would otherwise make every later one of its sender stale
/// here until we restart (issue 56).
pub(crate) const MAX_EPOCH_AHEAD: Duration = Duration::from_secs(3600);

impl Keyed {
    /// The MAC of `msg` with its freshness, for `to`.
    fn tag(&self, msg: &[u8], freshness: &[u8], to: &VerbsAddr) -> HmacSha256 {
        let mut mac = self.key.clone();
        mac.update(msg);
        mac.update(freshness);
        mac.update(&to.encode());
        mac
    }
}

impl Handshaker {
    /// `me`: our handshake address; `mtu`: our port's active MTU code; `rng`: for request
    /// ids and PSNs (the Domain seeds it from the OS, the Pair harness per schedule).
    pub(crate) fn new(me: VerbsAddr, mtu: u8, settings: Settings, mut rng: StdRng) -> Self {
        let cookie_key = HmacSha256::new_from_slice(&rng.random::<[u8; 32]>())
            .expect("HMAC takes a key of any length");
        Self {
            me,
            my_addr: NetAddr::new(&me.encode()).expect("an encoded VerbsAddr is a NetAddr"),
            mtu,
            settings,
            rng,
            peers: HashMap::default(),
            established: HashMap::default(),
            keyed: None,
            cookie_key,
            cookies_sent: 0,
            unauthenticated: 0,
            stale: 0,
        }
    }

    /// Authenticates every message with `secret` (see the module docs); peers must hold the
    /// same secret. `epoch`: larger than any this address used before (the Domain gives the
    /// wall clock's nanoseconds at its start).
    pub(crate) fn with_secret(mut self, secret: &[u8], epoch: u64) -> Self {
        self.keyed = Some(Keyed {
            key: HmacSha256::new_from_slice(&derive_key(secret, KeyUse::Handshake))
                .expect("HMAC takes a key of any length"),
            epoch,
            sealed: 0,
            newest: HashMap::default(),
            latest_epoch: None,
        });
        self
    }

    /// The wall clock now (nanoseconds since the Unix epoch), which the Domain gives before
    /// each datagram: a sender's epoch past it by more than [`MAX_EPOCH_AHEAD`] is refused
    /// (counted as stale) before it could become that sender's newest.
    pub(crate) fn handle_wall_clock(&mut self, now_ns: u64) {
        if let Some(keyed) = &mut self.keyed {
            keyed.latest_epoch = Some(now_ns.saturating_add(MAX_EPOCH_AHEAD.as_nanos() as u64));
        }
    }

    /// `msg` as it goes on the wire to `to`: its encoding, and with a secret our freshness
    /// and the MAC after it.
    pub(crate) fn seal(&mut self, msg: &Handshake, to: &VerbsAddr) -> Vec<u8> {
        let mut bytes = msg.encode().to_vec();
        if let Some(keyed) = &mut self.keyed {
            keyed.sealed += 1;
            let mut freshness = [0u8; FRESHNESS_LEN];
            freshness[..8].copy_from_slice(&keyed.epoch.to_le_bytes());
            freshness[8..].copy_from_slice(&keyed.sealed.to_le_bytes());
            let tag = keyed.tag(&bytes, &freshness, to).finalize().into_bytes();
            bytes.extend_from_slice(&freshness);
            bytes.extend_from_slice(&tag[..MAC_LEN]);
        }
        bytes
    }

    /// The message part of `raw` and its freshness if it is authentic and for us (always,
    /// and no freshness, without a secret).
    fn authentic<'a>(&self, raw: &'a [u8]) -> Option<(&'a [u8], Option<Freshness>)> {
        let Some(keyed) = &self.keyed else {
            return Some((raw, None));
        };
        if raw.len() != MSG_LEN + FRESHNESS_LEN + MAC_LEN {
            return None;
        }
        let (msg, rest) = raw.split_at(MSG_LEN);
        let (freshness, tag) = rest.split_at(FRESHNESS_LEN);
        keyed
            .tag(msg, freshness, &self.me)
            .verify_truncated_left(tag)
            .ok()?;
        let word = |b: &[u8]| u64::from_le_bytes(b.try_into().expect("8 bytes"));
        Some((msg, Some((word(&freshness[..8]), word(&freshness[8..])))))
    }

    /// Authentic datagrams dropped as not newer than their sender's last (replays) so far.
    #[cfg(test)]
    pub(crate) fn stale(&self) -> u64 {
        self.stale
    }

    /// Datagrams dropped as unauthenticated so far.
    pub(crate) fn unauthenticated(&self) -> u64 {
        self.unauthenticated
    }

    fn psn(&mut self) -> u32 {
        self.rng.random::<u32>() & 0x00ff_ffff
    }

    /// A message of ours naming our QPs `ends`.
    fn message(&self, kind: Kind, request_id: u64, prev: u64, ends: &Ends) -> Handshake {
        Handshake {
            cookie: 0,
            kind,
            request_id,
            prev,
            from: self.me,
            data_qpn: ends.data_qpn,
            data_psn: ends.data_psn,
            msg_qpn: ends.msg_qpn,
            msg_psn: ends.msg_psn,
            mtu: self.mtu,
        }
    }

    fn request(&self, peer: &NetAddr, request_id: u64, ends: &Ends, cookie: u64) -> Handshake {
        let prev = self.established.get(peer).copied().unwrap_or(0);
        Handshake {
            cookie,
            ..self.message(Kind::Request, request_id, prev, ends)
        }
    }

    /// The cookie this side hands the requester at `from` for `request_id`: a MAC under a
    /// key only this side knows, so only a host that receives at `from` can present it (never
    /// 0, which means "none").
    fn cookie_for(&self, from: &VerbsAddr, request_id: u64) -> u64 {
        let mut mac = self.cookie_key.clone();
        mac.update(&from.encode());
        mac.update(&request_id.to_le_bytes());
        let tag = mac.finalize().into_bytes();
        u64::from_le_bytes(tag[..8].try_into().expect("8 bytes")).max(1)
    }

    /// Requests answered with a cookie so far (tests).
    #[cfg(test)]
    pub(crate) fn cookies_sent(&self) -> u64 {
        self.cookies_sent
    }

    /// Starts connecting to `peer` with the QPs `(data_qpn, msg_qpn)` just created for it,
    /// replacing whatever handshake was under way. Refuses an address that is not a verbs
    /// address.
    pub(crate) fn connect(
        &mut self,
        now: Instant,
        peer: &NetAddr,
        (data_qpn, msg_qpn): (u32, u32),
        out: &mut Vec<Action>,
    ) -> Result<(), String> {
        let to = VerbsAddr::decode(peer.raw()).map_err(|e| format!("{peer}: {e}"))?;
        if self.requesting_full() {
            return Err(self.requesting_refusal(peer));
        }
        let ends = Ends {
            data_qpn,
            data_psn: self.psn(),
            msg_qpn,
            msg_psn: self.psn(),
        };
        // Never 0: a `prev` of 0 means "replaces nothing".
        let request_id = self.rng.random_range(1..=u64::MAX);
        let msg = self.request(peer, request_id, &ends, 0);
        self.peers.insert(
            peer.clone(),
            State::Requesting {
                request_id,
                ends,
                deadline: now + self.settings.connect,
                last_sent: now,
                cookie: 0,
            },
        );
        out.push(Action::Send {
            peer: peer.clone(),
            to,
            msg,
        });
        Ok(())
    }

    /// A handshake datagram arrived. Malformed ones are ignored (the UD QP receives whatever
    /// anyone sends it).
    pub(crate) fn handle_datagram(&mut self, raw: &[u8], out: &mut Vec<Action>) {
        let Some((msg, freshness)) = self.authentic(raw) else {
            self.unauthenticated += 1;
            return;
        };
        let Ok(h) = Handshake::decode(msg) else {
            return;
        };
        let peer = NetAddr::new(&h.from.encode()).expect("an encoded VerbsAddr is a NetAddr");
        if let (Some(fresh), Some(keyed)) = (freshness, &mut self.keyed) {
            if keyed.latest_epoch.is_some_and(|latest| fresh.0 > latest) {
                self.stale += 1;
                return;
            }
            match keyed.newest.get_mut(&peer) {
                Some(newest) if *newest >= fresh => {
                    self.stale += 1;
                    return;
                }
                Some(newest) => *newest = fresh,
                None => {
                    keyed.newest.insert(peer.clone(), fresh);
                }
            }
        }
        match h.kind {
            Kind::Request => self.on_request(peer, h, out),
            Kind::Response => self.on_response(peer, h, out),
            Kind::Ready => self.on_ready(peer, &h, out),
            Kind::Cookie => self.on_cookie(peer, &h, out),
        }
    }

    fn on_request(&mut self, peer: NetAddr, h: Handshake, out: &mut Vec<Action>) {
        let prior = match self.peers.get(&peer) {
            None => Prior::None,
            Some(State::Requesting { .. }) => {
                if self.my_addr.raw() > peer.raw() {
                    return;
                }
                Prior::Requesting
            }
            Some(
                State::AwaitingReady {
                    request_id,
                    response,
                    ..
                }
                | State::Established {
                    request_id,
                    response: Some(response),
                    ..
                },
            ) if *request_id == h.request_id => {
                out.push(Action::Send {
                    peer,
                    to: h.from,
                    msg: *response,
                });
                return;
            }
            Some(State::Established {
                candidate: Some(c), ..
            }) if c.request_id == h.request_id => {
                out.push(Action::Send {
                    peer,
                    to: h.from,
                    msg: c.response,
                });
                return;
            }
            Some(State::Established {
                request_id, proven, ..
            }) => {
                if h.prev == *request_id {
                    Prior::Connected
                } else if *proven {
                    return;
                } else {
                    Prior::Candidate
                }
            }
            // Only a request naming it replaces a handshake waiting for its `Ready`. Once
            // traffic flowed on it, it is as live as an established connection; before, a
            // request that does not name it is a forged or replayed one — replacing cost QPs
            // outside the `max_half_open` cap, and a flood in the peer's name kept its `Ready`
            // from ever matching — or a requester that gave up on it, which resends and is
            // answered once this entry's deadline passed (it began before the requester's
            // new attempt did, so it ends first).
            Some(State::AwaitingReady { request_id, .. }) => {
                if h.prev != *request_id {
                    return;
                }
                Prior::Connected
            }
        };
        // Return routability: without a secret a request's `from` is its sender's word, so
        // state (a half-open slot, QPs) is kept only for a request that echoes the cookie
        // sent to that address. A forged one costs one datagram back and holds nothing.
        if self.settings.cookies && self.keyed.is_none() {
            let cookie = self.cookie_for(&h.from, h.request_id);
            if h.cookie != cookie {
                self.cookies_sent += 1;
                out.push(Action::Send {
                    peer,
                    to: h.from,
                    msg: Handshake {
                        cookie,
                        ..self.message(Kind::Cookie, h.request_id, 0, &Ends::default())
                    },
                });
                return;
            }
        }
        if matches!(prior, Prior::None | Prior::Candidate)
            && self.half_open() >= self.settings.max_half_open
        {
            return;
        }
        let psns = (self.psn(), self.psn());
        out.push(Action::Accept {
            peer,
            request: h,
            psns,
            prior,
        });
    }

    /// The Domain carried out [`Action::Accept`] for `request`: `Ok` with our QPs connected to
    /// the request's (with the action's PSNs), or why it could not.
    pub(crate) fn accepted(
        &mut self,
        now: Instant,
        peer: &NetAddr,
        request: &Handshake,
        prior: Prior,
        result: Result<Ends, String>,
        out: &mut Vec<Action>,
    ) {
        let ends = match result {
            // A candidate that could not be built leaves the connection as it was.
            Err(_) if prior == Prior::Candidate => return,
            Ok(ends) => ends,
            Err(why) => {
                self.peers.remove(peer);
                out.push(Action::Fail {
                    peer: peer.clone(),
                    why: Failure::Qps(why),
                });
                return;
            }
        };
        let response = self.message(Kind::Response, request.request_id, 0, &ends);
        if prior == Prior::Candidate {
            if let Some(State::Established { candidate, .. }) = self.peers.get_mut(peer) {
                *candidate = Some(Candidate {
                    request_id: request.request_id,
                    response,
                    deadline: now + self.settings.connect,
                    last_sent: now,
                });
                out.push(Action::Send {
                    peer: peer.clone(),
                    to: request.from,
                    msg: response,
                });
            }
            return;
        }
        self.established.insert(peer.clone(), request.request_id);
        self.peers.insert(
            peer.clone(),
            State::AwaitingReady {
                request_id: request.request_id,
                response,
                deadline: now + self.settings.connect,
                last_sent: now,
                proven: false,
            },
        );
        out.push(Action::Send {
            peer: peer.clone(),
            to: request.from,
            msg: response,
        });
    }

    fn ready_for(&self, response: &Handshake) -> Handshake {
        Handshake {
            kind: Kind::Ready,
            from: self.me,
            ..*response
        }
    }

    fn on_response(&mut self, peer: NetAddr, h: Handshake, out: &mut Vec<Action>) {
        match self.peers.get(&peer) {
            Some(State::Requesting {
                request_id, ends, ..
            }) if *request_id == h.request_id => out.push(Action::Complete {
                peer,
                response: h,
                local: *ends,
            }),
            Some(State::Established {
                request_id,
                answered_by: Some(ends),
                proven,
                ..
            }) if *request_id == h.request_id => {
                if *ends == ends_of(&h) {
                    // Our `Ready` was lost (the responder repeats its response): again.
                    out.push(Action::Send {
                        peer,
                        to: h.from,
                        msg: self.ready_for(&h),
                    });
                } else if *proven {
                    // Traffic flowed on the QPs we connected to, so they are still there: a
                    // Response naming others is forged (an on-path host saw the request id)
                    // or replayed. A real rebuild shows as failing posts instead.
                } else {
                    self.peers.remove(&peer);
                    out.push(Action::Fail {
                        peer,
                        why: Failure::Rebuilt,
                    });
                }
            }
            _ => {}
        }
    }

    /// The Domain carried out [`Action::Complete`]: `Ok` with our QPs connected to the
    /// response's, or why not.
    pub(crate) fn completed(
        &mut self,
        peer: &NetAddr,
        response: &Handshake,
        result: Result<(), String>,
        out: &mut Vec<Action>,
    ) {
        match self.peers.get(peer) {
            Some(State::Requesting { request_id, .. }) if *request_id == response.request_id => {}
            _ => return,
        }
        match result {
            Ok(()) => {
                self.established.insert(peer.clone(), response.request_id);
                self.peers.insert(
                    peer.clone(),
                    State::Established {
                        request_id: response.request_id,
                        response: None,
                        answered_by: Some(ends_of(response)),
                        proven: false,
                        candidate: None,
                    },
                );
                // Our QPs can receive now: the responder may send.
                out.push(Action::Send {
                    peer: peer.clone(),
                    to: response.from,
                    msg: self.ready_for(response),
                });
                out.push(Action::Ready { peer: peer.clone() });
            }
            Err(why) => {
                self.peers.remove(peer);
                out.push(Action::Fail {
                    peer: peer.clone(),
                    why: Failure::Qps(why),
                });
            }
        }
    }

    /// The responder asks us to repeat our request with its cookie: at once, and in every
    /// resend after (a cookie for a request of ours that is not under way is ignored).
    fn on_cookie(&mut self, peer: NetAddr, h: &Handshake, out: &mut Vec<Action>) {
        let Some(State::Requesting {
            request_id,
            ends,
            cookie,
            ..
        }) = self.peers.get_mut(&peer)
        else {
            return;
        };
        if *request_id != h.request_id || h.cookie == 0 || *cookie == h.cookie {
            return;
        }
        *cookie = h.cookie;
        let (request_id, ends) = (*request_id, *ends);
        let msg = self.request(&peer, request_id, &ends, h.cookie);
        out.push(Action::Send {
            peer,
            to: h.from,
            msg,
        });
    }

    fn on_ready(&mut self, peer: NetAddr, h: &Handshake, out: &mut Vec<Action>) {
        if let Some(State::Established {
            candidate: Some(c), ..
        }) = self.peers.get(&peer)
        {
            // A `Ready` echoes the response it confirms: one for an earlier answer to the same
            // request (a duplicate, delayed) confirms QPs that are gone.
            if c.request_id == h.request_id && ends_of(h) == ends_of(&c.response) {
                let c = *c;
                self.established.insert(peer.clone(), c.request_id);
                self.peers.insert(
                    peer.clone(),
                    State::Established {
                        request_id: c.request_id,
                        response: Some(c.response),
                        answered_by: None,
                        proven: false,
                        candidate: None,
                    },
                );
                out.push(Action::Promote { peer });
            }
            return;
        }
        if let Some(State::AwaitingReady {
            request_id,
            response,
            proven,
            ..
        }) = self.peers.get(&peer)
        {
            if *request_id == h.request_id && ends_of(h) == ends_of(response) {
                let (request_id, response, proven) = (*request_id, *response, *proven);
                self.peers.insert(
                    peer.clone(),
                    State::Established {
                        request_id,
                        response: Some(response),
                        answered_by: None,
                        proven,
                        candidate: None,
                    },
                );
                out.push(Action::Ready { peer });
            }
        }
    }

    /// A [`Action::Send`] of a request could not go now (no free send slot): due again at
    /// the next check rather than a whole retry interval later.
    pub(crate) fn unsent(&mut self, now: Instant, peer: &NetAddr) {
        if let Some(State::Requesting { last_sent, .. }) = self.peers.get_mut(peer) {
            *last_sent = now.checked_sub(self.settings.retry).unwrap_or(now);
        }
    }

    /// Traffic flowed on the connection with `peer` (the first completion or arrival on its
    /// QPs): from now on only a request naming it (`prev`) replaces it.
    pub(crate) fn proven(&mut self, peer: &NetAddr, out: &mut Vec<Action>) {
        match self.peers.get_mut(peer) {
            Some(State::AwaitingReady { proven, .. }) => *proven = true,
            Some(State::Established {
                proven, candidate, ..
            }) => {
                *proven = true;
                // The connection is real: whoever asked for the candidate was not its peer.
                if candidate.take().is_some() {
                    out.push(Action::DropCandidate { peer: peer.clone() });
                }
            }
            _ => {}
        }
    }

    /// Handshakes waiting for their `Ready` (candidates included).
    /// Whether `max_requesting` handshakes of ours wait for their answer: a new one is
    /// refused ([`connect`](Self::connect) fails) until one ends.
    pub(crate) fn requesting_full(&self) -> bool {
        self.peers
            .values()
            .filter(|s| matches!(s, State::Requesting { .. }))
            .count()
            >= self.settings.max_requesting
    }

    /// Why a connection to `peer` is refused while [`requesting_full`](Self::requesting_full).
    pub(crate) fn requesting_refusal(&self, peer: &NetAddr) -> String {
        format!(
            "cannot connect to {peer}: {} handshakes to other peers are unanswered (max_requesting)",
            self.settings.max_requesting
        )
    }

    fn half_open(&self) -> usize {
        self.peers
            .values()
            .filter(|s| {
                matches!(
                    s,
                    State::AwaitingReady { .. }
                        | State::Established {
                            candidate: Some(_),
                            ..
                        }
                )
            })
            .count()
    }

    /// The connection with `peer` failed for a reason of the Domain's (a QP error, a stalled
    /// queue): its handshake state goes; the id of the last established connection stays,
    /// for the next request's `prev`.
    pub(crate) fn forget(&mut self, peer: &NetAddr) {
        self.peers.remove(peer);
    }

    /// Whether any handshake is under way (resends and deadlines need [`handle_timeout`]);
    /// false in the steady state. The Domain asks [`poll_timeout`](Self::poll_timeout),
    /// which is `None` exactly then.
    ///
    /// [`handle_timeout`]: Self::handle_timeout
    #[cfg(test)]
    pub(crate) fn pending(&self) -> bool {
        self.peers.values().any(State::under_way)
    }

    /// When [`handle_timeout`](Self::handle_timeout) next has something to do.
    pub(crate) fn poll_timeout(&self) -> Option<Instant> {
        let (retry, connect) = (self.settings.retry, self.settings.connect);
        self.peers
            .values()
            .filter_map(|s| {
                // A copy, to read its timers (plain data: no allocation).
                let mut s = *s;
                let t = s.timers()?;
                Some(t.deadline.min(t.next_send(retry, connect)))
            })
            .min()
    }

    /// Resends what is due and fails what passed its deadline.
    pub(crate) fn handle_timeout(&mut self, now: Instant, out: &mut Vec<Action>) {
        let (retry, connect) = (self.settings.retry, self.settings.connect);
        let mut expired = Vec::new();
        let mut resend = Vec::new();
        for (peer, state) in &mut self.peers {
            let Some(t) = state.timers() else { continue };
            if now >= t.deadline {
                expired.push(peer.clone());
            } else if now >= t.next_send(retry, connect) {
                *t.last_sent = now;
                resend.push(peer.clone());
            }
        }
        for peer in resend {
            let msg = match &self.peers[&peer] {
                State::Requesting {
                    request_id,
                    ends,
                    cookie,
                    ..
                } => self.request(&peer, *request_id, ends, *cookie),
                State::AwaitingReady { response, .. } => *response,
                State::Established {
                    candidate: Some(c), ..
                } => c.response,
                State::Established {
                    candidate: None, ..
                } => continue,
            };
            if let Ok(to) = VerbsAddr::decode(peer.raw()) {
                out.push(Action::Send { peer, to, msg });
            }
        }
        let connect_ms = self.settings.connect.as_millis() as u64;
        for peer in expired {
            let why = match self.peers.get_mut(&peer) {
                // An unconfirmed candidate goes; the connection it stood beside stays.
                Some(State::Established { candidate, .. }) => {
                    *candidate = None;
                    out.push(Action::DropCandidate { peer });
                    continue;
                }
                Some(State::Requesting { .. }) => Failure::NoAnswer { connect_ms },
                Some(State::AwaitingReady { .. }) => {
                    // Never confirmed, it named nothing we could name back: a source that
                    // only ever sent requests (a forger's made-up address) leaves nothing.
                    self.established.remove(&peer);
                    Failure::NeverConfirmed { connect_ms }
                }
                None => continue,
            };
            self.peers.remove(&peer);
            out.push(Action::Fail { peer, why });
        }
    }

    /// Whether the connection with `peer` is established (tests and assertions).
    #[cfg(test)]
    pub(crate) fn is_established(&self, peer: &NetAddr) -> bool {
        matches!(self.peers.get(peer), Some(State::Established { .. }))
    }

    /// Peers the machine keeps anything for: handshake state or the id of the last
    /// established connection (tests: what a flood of forged sources leaves behind).
    #[cfg(test)]
    pub(crate) fn remembered(&self) -> usize {
        let mut peers: std::collections::HashSet<&NetAddr> = self.peers.keys().collect();
        peers.extend(self.established.keys());
        peers.len()
    }

    /// The request id of the connection with `peer`, in whatever state (tests).
    #[cfg(test)]
    pub(crate) fn request_id(&self, peer: &NetAddr) -> Option<u64> {
        self.peers.get(peer).map(|s| match s {
            State::Requesting { request_id, .. }
            | State::AwaitingReady { request_id, .. }
            | State::Established { request_id, .. } => *request_id,
        })
    }
}

#[cfg(test)]
mod pair;
