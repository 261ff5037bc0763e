use super::*;

const SECRET: &[u8] = b"thirty-two bytes of cluster key.";
const NOW: u64 = 1_800_000_000_000_000_000;

fn addr(name: &str) -> NetAddr {
    NetAddr::new(name.as_bytes()).unwrap()
}

fn sealed(from: &str, to: &str, payload: &[u8], epoch: u64) -> (Senders, Vec<u8>) {
    let mut s = Senders::with_secret(addr(from), SECRET, epoch);
    let mut out = Vec::new();
    s.seal(&addr(to), payload, &mut out);
    (s, out)
}

fn delivered(from: Option<&str>, learn: Option<&str>, len: usize) -> Verdict {
    Verdict::Deliver {
        len,
        from: from.map(addr),
        learn: learn.map(addr),
    }
}

/// Without a secret the provider's source is the proof: a known source equal to the claim is
/// named; an unknown one is not (its claim is only learned); a known one that differs from the
/// claim names nobody — never the claim, never the source.
#[test]
fn without_a_secret_only_the_providers_source_names_a_sender() {
    let mut a = Senders::new(addr("a"));
    let mut msg = Vec::new();
    a.seal(&addr("b"), b"hello", &mut msg);
    let mut b = Senders::new(addr("b"));
    assert_eq!(
        b.open(&msg, &Source::Known(addr("a")), NOW),
        delivered(Some("a"), None, 5)
    );
    assert_eq!(
        b.open(&msg, &Source::Unknown, NOW),
        delivered(None, Some("a"), 5)
    );
    assert_eq!(
        b.open(&msg, &Source::Known(addr("x")), NOW),
        delivered(None, None, 5)
    );
    assert_eq!(&msg[..5], b"hello");
}

/// With the secret a sealed message names its claim, from a known source or an unknown one
/// (then learned); its payload is untouched.
#[test]
fn with_a_secret_a_sealed_message_names_its_sender() {
    let (_, msg) = sealed("a", "b", b"payload", NOW);
    let mut b = Senders::with_secret(addr("b"), SECRET, NOW);
    assert_eq!(
        b.open(&msg, &Source::Unknown, NOW),
        delivered(Some("a"), Some("a"), 7)
    );
    assert_eq!(&msg[..7], b"payload");
    let (_, msg) = sealed("c", "b", b"", NOW);
    assert_eq!(
        b.open(&msg, &Source::Known(addr("c")), NOW),
        delivered(Some("c"), None, 0)
    );
}

/// Every byte of a sealed message is covered: flipping any one drops it (as a bad tag, or as
/// unreadable where the flip hits the trailer's framing).
#[test]
fn with_a_secret_any_changed_byte_is_refused() {
    let (_, msg) = sealed("a", "b", b"some payload", NOW);
    for i in 0..msg.len() {
        let mut forged = msg.clone();
        forged[i] ^= 0x01;
        let mut b = Senders::with_secret(addr("b"), SECRET, NOW);
        let v = b.open(&forged, &Source::Unknown, NOW);
        assert!(matches!(v, Verdict::Drop(_)), "byte {i}: {v:?}");
    }
}

/// A spoofed sender: a message claiming `a` without the secret (a claim-only trailer, one
/// sealed with another secret, one sealed for another receiver) is dropped, and so is an
/// authentic one the provider says came from somewhere else.
#[test]
fn with_a_secret_forgeries_are_refused() {
    let mut b = Senders::with_secret(addr("b"), SECRET, NOW);
    let mut claim_only = Vec::new();
    Senders::new(addr("a")).seal(&addr("b"), b"x", &mut claim_only);
    assert_eq!(
        b.open(&claim_only, &Source::Unknown, NOW),
        Verdict::Drop(Refusal::BadTag)
    );
    let mut other_secret = Vec::new();
    Senders::with_secret(addr("a"), b"another cluster's 32-byte secret", NOW).seal(
        &addr("b"),
        b"x",
        &mut other_secret,
    );
    assert_eq!(
        b.open(&other_secret, &Source::Unknown, NOW),
        Verdict::Drop(Refusal::BadTag)
    );
    let (_, for_d) = sealed("a", "d", b"x", NOW);
    assert_eq!(
        b.open(&for_d, &Source::Unknown, NOW),
        Verdict::Drop(Refusal::BadTag)
    );
    let (_, msg) = sealed("a", "b", b"x", NOW);
    assert_eq!(
        b.open(&msg, &Source::Known(addr("x")), NOW),
        Verdict::Drop(Refusal::SpoofedSource)
    );
    // Refused before its freshness was taken: the real one still gets through.
    assert_eq!(
        b.open(&msg, &Source::Known(addr("a")), NOW),
        delivered(Some("a"), None, 1)
    );
}

/// A recorded message replayed is dropped; messages overtaking each other within the window
/// are all taken once; one overtaken by a whole window, or from an earlier epoch than the
/// sender's newest, is stale; a restarted sender (later epoch) is read again.
#[test]
fn with_a_secret_replays_are_refused_and_reordering_is_not() {
    let mut a = Senders::with_secret(addr("a"), SECRET, NOW);
    let mut b = Senders::with_secret(addr("b"), SECRET, NOW);
    let msgs: Vec<Vec<u8>> = (0..100)
        .map(|i| {
            let mut m = Vec::new();
            a.seal(&addr("b"), &[i as u8], &mut m);
            m
        })
        .collect();
    // Taken in a shuffled order (odd ones first, backwards), each once.
    let order: Vec<usize> = (0..100)
        .rev()
        .filter(|i| i % 2 == 1)
        .chain((0..100).filter(|i| i % 2 == 0))
        .collect();
    for &i in &order {
        assert_eq!(
            b.open(&msgs[i], &Source::Unknown, NOW),
            delivered(Some("a"), Some("a"), 1),
            "message {i}"
        );
    }
    for &i in &order {
        assert_eq!(
            b.open(&msgs[i], &Source::Unknown, NOW),
            Verdict::Drop(Refusal::Replayed),
            "replay of {i}"
        );
    }
    // Overtaken by a whole window of later messages: stale.
    let mut late = Vec::new();
    a.seal(&addr("b"), b"late", &mut late);
    a.keyed.as_mut().unwrap().sealed += REPLAY_WINDOW;
    let mut newest = Vec::new();
    a.seal(&addr("b"), b"new", &mut newest);
    assert!(matches!(
        b.open(&newest, &Source::Unknown, NOW),
        Verdict::Deliver { .. }
    ));
    assert_eq!(
        b.open(&late, &Source::Unknown, NOW),
        Verdict::Drop(Refusal::Replayed)
    );
    // A restart: a later epoch is taken, and the old epoch's messages are stale from then on.
    let (_, restarted) = sealed("a", "b", b"again", NOW + 1);
    assert!(matches!(
        b.open(&restarted, &Source::Unknown, NOW),
        Verdict::Deliver { .. }
    ));
    let mut old = Vec::new();
    a.seal(&addr("b"), b"old", &mut old);
    assert_eq!(
        b.open(&old, &Source::Unknown, NOW),
        Verdict::Drop(Refusal::Replayed)
    );
}

/// One authentic message with a far-future epoch cannot make its sender stale until restart.
#[test]
fn with_a_secret_a_far_future_epoch_is_refused() {
    let mut b = Senders::with_secret(addr("b"), SECRET, NOW);
    let (_, far) = sealed("a", "b", b"x", u64::MAX);
    assert_eq!(
        b.open(&far, &Source::Unknown, NOW),
        Verdict::Drop(Refusal::Replayed)
    );
    let (_, now) = sealed("a", "b", b"x", NOW);
    assert!(matches!(
        b.open(&now, &Source::Unknown, NOW),
        Verdict::Deliver { .. }
    ));
}

/// Untrusted bytes: every truncation and a spread of garbage are judged without a panic, and
/// nothing without a well-formed trailer is delivered.
#[test]
fn any_bytes_are_judged_without_panicking() {
    let (_, msg) = sealed("a", "b", b"payload", NOW);
    let mut plain = Vec::new();
    Senders::new(addr("a")).seal(&addr("b"), b"payload", &mut plain);
    for m in [&msg, &plain] {
        for n in 0..m.len() {
            for keyed in [false, true] {
                let mut b = if keyed {
                    Senders::with_secret(addr("b"), SECRET, NOW)
                } else {
                    Senders::new(addr("b"))
                };
                if let Verdict::Deliver { len, .. } = b.open(&m[..n], &Source::Unknown, NOW) {
                    assert!(len <= n);
                }
            }
        }
    }
    let mut x = 0x9e37_79b9_7f4a_7c15u64;
    for len in 0..400 {
        let garbage: Vec<u8> = (0..len)
            .map(|_| {
                x ^= x << 13;
                x ^= x >> 7;
                x ^= x << 17;
                x as u8
            })
            .collect();
        let mut b = Senders::with_secret(addr("b"), SECRET, NOW);
        assert!(matches!(
            b.open(&garbage, &Source::Unknown, NOW),
            Verdict::Drop(_)
        ));
        let mut b = Senders::new(addr("b"));
        if let Verdict::Deliver { len: n, .. } = b.open(&garbage, &Source::Unknown, NOW) {
            assert!(n <= len);
        }
    }
}

/// The trailer never outgrows what receive buffers add for it.
#[test]
fn a_trailer_fits_the_room_receive_buffers_keep_for_it() {
    let long = NetAddr::new(&[7u8; MAX_ADDR_LEN]).unwrap();
    let mut s = Senders::with_secret(long.clone(), SECRET, NOW);
    let mut out = Vec::new();
    s.seal(&long, b"abc", &mut out);
    assert_eq!(out.len() - 3, MAX_TRAILER);
}

/// Review M7: a secret holder's sealed message from a source the provider cannot name, claiming
/// an address this receiver knows (whose messages the provider would name), is not from that
/// endpoint: dropped before its freshness is taken, so a far-ahead epoch in that member's name
/// cannot make the member's own messages stale.
#[test]
fn with_a_secret_a_known_address_claimed_from_an_unknown_source_is_refused() {
    let mut b = Senders::with_secret(addr("b"), SECRET, NOW);
    let known = |a: &NetAddr| *a == addr("a");
    let (_, ahead) = sealed("a", "b", b"x", NOW + 3_000_000_000_000);
    assert_eq!(
        b.open_checked(&ahead, &Source::Unknown, NOW, &known),
        Verdict::Drop(Refusal::SpoofedSource)
    );
    // The member's own messages, from its known source, still get through.
    let (_, own) = sealed("a", "b", b"y", NOW);
    assert_eq!(
        b.open_checked(&own, &Source::Known(addr("a")), NOW, &known),
        delivered(Some("a"), None, 1)
    );
    // An address it does not know yet is the secret holder's word, as before.
    let (_, stranger) = sealed("c", "b", b"z", NOW);
    assert_eq!(
        b.open_checked(&stranger, &Source::Unknown, NOW, &known),
        delivered(Some("c"), Some("c"), 1)
    );
}
