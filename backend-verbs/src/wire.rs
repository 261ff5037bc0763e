//! The verbs backend's wire formats: its `NetAddr` layout and the connection handshake
//! messages exchanged over the UD QP. Pure, decoded defensively (they come off the network).

/// Why bytes are not a verbs address or handshake. Every variant names what was wrong, so a
/// log line says whether a foreign, an older or a damaged datagram arrived.
#[derive(Debug, Clone, Copy, PartialEq, Eq, thiserror::Error)]
#[non_exhaustive]
pub enum WireError {
    /// Fewer bytes than the fixed layout of `what` needs.
    #[error("{what} of {found} bytes is short: expected {expected}")]
    Short {
        /// `"verbs address"` or `"handshake"`.
        what: &'static str,
        /// Bytes given.
        found: usize,
        /// Bytes the layout has.
        expected: usize,
    },
    /// More bytes than the fixed layout of `what` has.
    #[error("{what} with {extra} trailing bytes")]
    Trailing {
        /// `"verbs address"` or `"handshake"`.
        what: &'static str,
        /// Bytes past the layout.
        extra: usize,
    },
    /// The tag or magic is not ours: another backend's address or a stray datagram (what
    /// was expected, with its article).
    #[error("not {0}")]
    Foreign(&'static str),
    /// A version this build does not speak.
    #[error("{what} version {found}, expected {expected}")]
    Version {
        /// `"verbs address"` or `"handshake"`.
        what: &'static str,
        /// The version found.
        found: u8,
        /// The version this build speaks.
        expected: u8,
    },
    /// A handshake kind byte that is none of Request, Response, Ready.
    #[error("unknown handshake kind {0}")]
    Kind(u8),
    /// An MTU code outside `ibv_mtu`'s 1..=5.
    #[error("handshake MTU code {0} is not 1..=5")]
    Mtu(u8),
}

/// Checks that `raw` is exactly `expected` bytes long.
fn exact(what: &'static str, raw: &[u8], expected: usize) -> Result<(), WireError> {
    match raw.len() {
        n if n < expected => Err(WireError::Short {
            what,
            found: n,
            expected,
        }),
        n if n > expected => Err(WireError::Trailing {
            what,
            extra: n - expected,
        }),
        _ => Ok(()),
    }
}

/// Tag of a verbs address, so a foreign address is refused instead of misread.
const ADDR_TAG: u8 = b'V';
const ADDR_VERSION: u8 = 1;
/// Encoded address length.
pub const ADDR_LEN: usize = 24;

/// Where a verbs NIC listens for handshakes: its GID, LID (InfiniBand) and UD QP number.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct VerbsAddr {
    /// The GID the NIC uses.
    pub gid: [u8; 16],
    /// The port's LID (0 on RoCE).
    pub lid: u16,
    /// The UD QP that answers handshakes.
    pub ud_qpn: u32,
}

impl VerbsAddr {
    /// `[tag, version, gid(16), ud_qpn(4 LE), lid(2 LE)]`.
    pub fn encode(&self) -> [u8; ADDR_LEN] {
        let mut b = [0u8; ADDR_LEN];
        b[0] = ADDR_TAG;
        b[1] = ADDR_VERSION;
        b[2..18].copy_from_slice(&self.gid);
        b[18..22].copy_from_slice(&self.ud_qpn.to_le_bytes());
        b[22..24].copy_from_slice(&self.lid.to_le_bytes());
        b
    }

    /// Decodes [`encode`](Self::encode)'s output; anything else is an error naming why.
    pub fn decode(raw: &[u8]) -> Result<Self, WireError> {
        const WHAT: &str = "verbs address";
        if raw.first().is_some_and(|&t| t != ADDR_TAG) {
            return Err(WireError::Foreign("a verbs address"));
        }
        exact(WHAT, raw, ADDR_LEN)?;
        if raw[1] != ADDR_VERSION {
            return Err(WireError::Version {
                what: WHAT,
                found: raw[1],
                expected: ADDR_VERSION,
            });
        }
        Ok(Self {
            gid: raw[2..18].try_into().expect("16 bytes"),
            ud_qpn: u32::from_le_bytes(raw[18..22].try_into().expect("4 bytes")),
            lid: u16::from_le_bytes(raw[22..24].try_into().expect("2 bytes")),
        })
    }
}

const MSG_MAGIC: [u8; 4] = *b"XFRH";
const MSG_VERSION: u8 = 3;
/// Encoded handshake length.
pub const MSG_LEN: usize = 4 + 1 + 1 + 8 + ADDR_LEN + 4 * 4 + 1 + 8 + 8;

/// The three steps of a connection: no side sends a packet before the other can receive it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Kind {
    /// "Here are my QPs; connect yours to them and answer." (requester)
    Request,
    /// "Mine are ready to receive; here they are." (responder; it sends nothing yet)
    Response,
    /// "Mine are connected too: send." (requester, once its QPs are ready to receive)
    Ready,
    /// "Ask again with this cookie." (responder, without a cluster secret, to a request that
    /// carries none: only a host that receives at the request's `from` learns it)
    Cookie,
}

/// One handshake message.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Handshake {
    /// Request or response.
    pub kind: Kind,
    /// Chosen by the requester; the response echoes it (retries reuse it).
    pub request_id: u64,
    /// The sender's address (where to answer).
    pub from: VerbsAddr,
    /// The sender's QP for one-sided writes, and its first PSN.
    pub data_qpn: u32,
    /// PSN of `data_qpn`'s first packet.
    pub data_psn: u32,
    /// The sender's QP for messages.
    pub msg_qpn: u32,
    /// PSN of `msg_qpn`'s first packet.
    pub msg_psn: u32,
    /// The sender's active MTU (`ibv_mtu`: 1 = 256 ... 5 = 4096); both sides use the smaller.
    pub mtu: u8,
    /// In a request: the `request_id` of the connection with the receiver that this one
    /// replaces (0 for none). A request that replaces a connection busy with work must name
    /// it — proof that it comes from the peer that has it, not a stale or forged datagram.
    pub prev: u64,
    /// In a `Cookie`, the cookie; in a request, the one its responder sent back (0: none).
    pub cookie: u64,
}

impl Handshake {
    /// Fixed-size little-endian encoding.
    pub fn encode(&self) -> [u8; MSG_LEN] {
        let mut b = [0u8; MSG_LEN];
        b[..4].copy_from_slice(&MSG_MAGIC);
        b[4] = MSG_VERSION;
        b[5] = match self.kind {
            Kind::Request => 1,
            Kind::Response => 2,
            Kind::Ready => 3,
            Kind::Cookie => 4,
        };
        b[6..14].copy_from_slice(&self.request_id.to_le_bytes());
        b[14..38].copy_from_slice(&self.from.encode());
        for (i, v) in [self.data_qpn, self.data_psn, self.msg_qpn, self.msg_psn]
            .into_iter()
            .enumerate()
        {
            b[38 + 4 * i..42 + 4 * i].copy_from_slice(&v.to_le_bytes());
        }
        b[54] = self.mtu;
        b[55..63].copy_from_slice(&self.prev.to_le_bytes());
        b[63..71].copy_from_slice(&self.cookie.to_le_bytes());
        b
    }

    /// Decodes a datagram (exactly [`MSG_LEN`] bytes); wrong magic, version, kind, length or
    /// MTU is an error naming which.
    pub fn decode(raw: &[u8]) -> Result<Self, WireError> {
        const WHAT: &str = "handshake";
        if raw.len() >= 4 && raw[..4] != MSG_MAGIC {
            return Err(WireError::Foreign("an xfer handshake"));
        }
        exact(WHAT, raw, MSG_LEN)?;
        if raw[4] != MSG_VERSION {
            return Err(WireError::Version {
                what: WHAT,
                found: raw[4],
                expected: MSG_VERSION,
            });
        }
        let kind = match raw[5] {
            1 => Kind::Request,
            2 => Kind::Response,
            3 => Kind::Ready,
            4 => Kind::Cookie,
            k => return Err(WireError::Kind(k)),
        };
        let word =
            |i: usize| u32::from_le_bytes(raw[38 + 4 * i..42 + 4 * i].try_into().expect("4 bytes"));
        let mtu = raw[54];
        if !(1..=5).contains(&mtu) {
            return Err(WireError::Mtu(mtu));
        }
        Ok(Self {
            kind,
            request_id: u64::from_le_bytes(raw[6..14].try_into().expect("8 bytes")),
            from: VerbsAddr::decode(&raw[14..38])?,
            data_qpn: word(0),
            data_psn: word(1),
            msg_qpn: word(2),
            msg_psn: word(3),
            mtu,
            prev: u64::from_le_bytes(raw[55..63].try_into().expect("8 bytes")),
            cookie: u64::from_le_bytes(raw[63..71].try_into().expect("8 bytes")),
        })
    }
}

/// How a GID table entry may be used.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct GidEntry {
    /// Table index.
    pub index: u32,
    /// The GID.
    pub gid: [u8; 16],
    /// True for RoCE v2 (routable UDP), false for RoCE v1 / InfiniBand.
    pub roce_v2: bool,
}

/// Picks the GID index: RoCE v2 with a routable address first (IPv4-mapped or global IPv6),
/// then RoCE v2 link-local, then anything non-zero. Never a hard-coded 0.
pub fn choose_gid(entries: &[GidEntry]) -> Option<u32> {
    let usable = entries.iter().filter(|e| e.gid != [0; 16]);
    let link_local = |g: &[u8; 16]| g[0] == 0xfe && g[1] & 0xc0 == 0x80;
    let rank = |e: &GidEntry| match (e.roce_v2, link_local(&e.gid)) {
        (true, false) => 0,
        (true, true) => 1,
        (false, _) => 2,
    };
    usable.min_by_key(|e| (rank(e), e.index)).map(|e| e.index)
}

/// What `[backends.verbs] gid` asks for: the GID of an IP address, or a GID on a netdev.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum GidWanted {
    /// The GID carrying this address (IPv4 as an IPv4-mapped IPv6 GID).
    Address(std::net::IpAddr),
    /// The best GID (as `choose_gid` ranks them) among those on this netdev.
    Netdev(String),
}

impl GidWanted {
    /// An address if `text` parses as one, else a netdev name.
    pub fn parse(text: &str) -> Self {
        match text.parse::<std::net::IpAddr>() {
            Ok(ip) => Self::Address(ip),
            Err(_) => Self::Netdev(text.to_owned()),
        }
    }
}

/// The GID bytes of an IP address, as RoCE GID tables hold them.
pub fn gid_of(ip: std::net::IpAddr) -> [u8; 16] {
    match ip {
        std::net::IpAddr::V4(v4) => v4.to_ipv6_mapped().octets(),
        std::net::IpAddr::V6(v6) => v6.octets(),
    }
}

/// Picks the GID index `wanted` names among `entries`; `netdevs[i]` is the netdev of entry
/// `i` (from sysfs `gid_attrs/ndevs`). Among several matches, `choose_gid`'s order decides.
pub fn choose_gid_for(
    entries: &[GidEntry],
    netdevs: &[Option<String>],
    wanted: &GidWanted,
) -> Option<u32> {
    let matching: Vec<GidEntry> = entries
        .iter()
        .enumerate()
        .filter(|(i, e)| match wanted {
            GidWanted::Address(ip) => e.gid == gid_of(*ip),
            GidWanted::Netdev(name) => netdevs.get(*i).and_then(Option::as_deref) == Some(name),
        })
        .map(|(_, e)| *e)
        .collect();
    choose_gid(&matching)
}

/// `ibv_mtu` code to bytes.
pub fn mtu_bytes(code: u8) -> u32 {
    128 << code.clamp(1, 5)
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    fn addr() -> VerbsAddr {
        VerbsAddr {
            gid: [0xfe, 0x80, 0, 0, 0, 0, 0, 0, 1, 2, 3, 4, 5, 6, 7, 8],
            lid: 7,
            ud_qpn: 0x123456,
        }
    }

    #[test]
    fn a_gid_is_chosen_by_address_or_netdev() {
        let v4 = gid_of("192.0.2.7".parse().unwrap());
        let entries = [
            GidEntry {
                index: 0,
                gid: [0xfe, 0x80, 0, 0, 0, 0, 0, 0, 1, 2, 3, 4, 5, 6, 7, 8],
                roce_v2: false,
            },
            GidEntry {
                index: 1,
                gid: [0xfe, 0x80, 0, 0, 0, 0, 0, 0, 1, 2, 3, 4, 5, 6, 7, 8],
                roce_v2: true,
            },
            GidEntry {
                index: 3,
                gid: v4,
                roce_v2: true,
            },
        ];
        let netdevs = [
            Some("eth0".to_owned()),
            Some("eth0".to_owned()),
            Some("eth1".to_owned()),
        ];
        let by = |w: &str| choose_gid_for(&entries, &netdevs, &GidWanted::parse(w));
        assert_eq!(by("192.0.2.7"), Some(3));
        assert_eq!(by("eth0"), Some(1), "RoCE v2 first among the netdev's GIDs");
        assert_eq!(by("eth1"), Some(3));
        assert_eq!(by("198.51.100.1"), None);
        assert_eq!(by("eth9"), None);
        assert_eq!(v4[10..12], [0xff, 0xff]);
    }

    #[test]
    fn addresses_and_handshakes_round_trip() {
        assert_eq!(VerbsAddr::decode(&addr().encode()).unwrap(), addr());
        let h = Handshake {
            cookie: 0,
            kind: Kind::Response,
            request_id: u64::MAX - 3,
            from: addr(),
            data_qpn: 17,
            data_psn: 0xabcdef,
            msg_qpn: 18,
            msg_psn: 5,
            mtu: 3,
            prev: 0x1122_3344_5566_7788,
        };
        assert_eq!(Handshake::decode(&h.encode()).unwrap(), h);
        let c = Handshake {
            kind: Kind::Cookie,
            cookie: 0x99aa_bbcc_ddee_ff01,
            ..h
        };
        assert_eq!(Handshake::decode(&c.encode()).unwrap(), c);
    }

    #[test]
    fn malformed_handshakes_are_refused() {
        let h = Handshake {
            cookie: 0,
            kind: Kind::Request,
            request_id: 1,
            from: addr(),
            data_qpn: 1,
            data_psn: 2,
            msg_qpn: 3,
            msg_psn: 4,
            mtu: 5,
            prev: 0,
        }
        .encode();
        assert_eq!(
            Handshake::decode(&h[..MSG_LEN - 1]),
            Err(WireError::Short {
                what: "handshake",
                found: MSG_LEN - 1,
                expected: MSG_LEN
            })
        );
        // A keyed datagram (freshness and tag after the message) read without a secret, or
        // anything else longer than a handshake, is refused rather than read in part.
        let mut long = h.to_vec();
        long.push(0);
        assert_eq!(
            Handshake::decode(&long),
            Err(WireError::Trailing {
                what: "handshake",
                extra: 1
            })
        );
        let mut bad = h;
        bad[0] = b'Y';
        assert_eq!(
            Handshake::decode(&bad),
            Err(WireError::Foreign("an xfer handshake"))
        );
        assert!(Handshake::decode(&bad)
            .unwrap_err()
            .to_string()
            .contains("not an xfer handshake"));
        let mut bad = h;
        bad[4] = 1;
        assert!(matches!(
            Handshake::decode(&bad),
            Err(WireError::Version { found: 1, .. })
        ));
        let mut bad = h;
        bad[5] = 9;
        assert_eq!(Handshake::decode(&bad), Err(WireError::Kind(9)));
        let mut bad = h;
        bad[54] = 6;
        assert_eq!(Handshake::decode(&bad), Err(WireError::Mtu(6)));
        let mut bad = h;
        bad[14] = b'M'; // the sender's address tag
        assert_eq!(
            Handshake::decode(&bad),
            Err(WireError::Foreign("a verbs address"))
        );
        assert_eq!(
            VerbsAddr::decode(b"mock\x01\0\0\0\0\0\0\0"),
            Err(WireError::Foreign("a verbs address"))
        );
        let a = addr().encode();
        assert!(matches!(
            VerbsAddr::decode(&a[..5]),
            Err(WireError::Short { found: 5, .. })
        ));
        assert!(matches!(
            VerbsAddr::decode(&[&a[..], b"x"].concat()),
            Err(WireError::Trailing { extra: 1, .. })
        ));
        assert_eq!(
            VerbsAddr::decode(&[]).map_err(|e| e.to_string()),
            Err("verbs address of 0 bytes is short: expected 24".into())
        );
    }

    #[test]
    fn gid_choice_prefers_routable_roce_v2() {
        let ll = [0xfe, 0x80, 0, 0, 0, 0, 0, 0, 1, 2, 3, 4, 5, 6, 7, 8];
        let v4 = [0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0xff, 0xff, 10, 0, 0, 1];
        let e = |index, gid, roce_v2| GidEntry {
            index,
            gid,
            roce_v2,
        };
        assert_eq!(
            choose_gid(&[
                e(0, ll, false),
                e(1, ll, true),
                e(2, v4, false),
                e(3, v4, true)
            ]),
            Some(3)
        );
        assert_eq!(choose_gid(&[e(0, ll, false), e(1, ll, true)]), Some(1));
        assert_eq!(choose_gid(&[e(0, [0; 16], true), e(4, ll, false)]), Some(4));
        assert_eq!(choose_gid(&[]), None);
        assert_eq!(mtu_bytes(3), 1024);
    }

    proptest! {
        #[test]
        fn decoding_never_panics(bytes in proptest::collection::vec(any::<u8>(), 0..80)) {
            let _ = Handshake::decode(&bytes);
            let _ = VerbsAddr::decode(&bytes);
        }
    }
}
