//! Who sent a message, on libfabric's shm and tcp;ofi_rxm (issue 56): the Domain names a
//! sender only as the provider's source proves it, or as the cluster secret's MAC does; a
//! forger's claim is never named, and with a secret it is dropped with the receive buffer
//! kept.

use std::collections::VecDeque;
use std::os::unix::fs::PermissionsExt;
use std::time::{Duration, Instant};

use backend_efa::raw::RawEndpoint;
use backend_efa::EfaDomain;
use xfer_plugin::addr::NetAddr;
use xfer_plugin::domain::{Domain, DomainConfig, Event, PostStatus};

const SECRET: &[u8] = b"thirty-two bytes of cluster key.";

fn secret_file(name: &str) -> String {
    let path = std::env::temp_dir().join(format!("xfer-efa-senders-{name}-{}", std::process::id()));
    std::fs::write(&path, SECRET).unwrap();
    std::fs::set_permissions(&path, std::fs::Permissions::from_mode(0o600)).unwrap();
    path.display().to_string()
}

fn domain(provider: &str, secret: Option<&str>) -> EfaDomain {
    std::env::set_var("FI_TCP_IFACE", "lo");
    let mut options = format!("provider = \"{provider}\"\n");
    if let Some(path) = secret {
        options.push_str(&format!("secret_file = \"{path}\"\n"));
    }
    let mut d = EfaDomain::open(&DomainConfig {
        nic: "auto",
        options: &options,
    })
    .unwrap();
    // Two: a refused message that took its buffer along would leave too few to go on.
    d.post_recvs(256, 2).unwrap();
    d
}

/// A receiving Domain and the messages its polls yielded, in order.
struct Receiver {
    domain: EfaDomain,
    inbox: VecDeque<(Vec<u8>, Option<NetAddr>)>,
}

type Message = (Vec<u8>, Option<NetAddr>);

impl Receiver {
    fn new(domain: EfaDomain) -> Self {
        Self {
            domain,
            inbox: VecDeque::new(),
        }
    }

    fn pump(&mut self) {
        let mut events = Vec::new();
        self.domain.poll(&mut events).unwrap();
        for e in events {
            if let Event::Message { data, from } = e {
                self.inbox.push_back((data, from));
                // As the engine does: a buffer back for each message handed over.
                self.domain.post_recvs(256, 1).unwrap();
            }
        }
    }

    /// The next message, polling it and `progress` (the senders) for up to 10 s.
    fn next(&mut self, progress: &mut dyn FnMut()) -> Option<Message> {
        let deadline = Instant::now() + Duration::from_secs(10);
        while self.inbox.is_empty() && Instant::now() < deadline {
            progress();
            self.pump();
            std::thread::yield_now();
        }
        self.inbox.pop_front()
    }
}

/// Posts a message, polling both sides while the provider asks to retry (its first contact
/// with a peer does), then waits for the message.
fn send(from: &mut EfaDomain, to: &mut Receiver, data: &[u8]) -> Option<Message> {
    let deadline = Instant::now() + Duration::from_secs(10);
    let at = to.domain.address();
    while from.post_send(1, &at, data).unwrap() == PostStatus::Busy {
        from.poll(&mut Vec::new()).unwrap();
        to.pump();
        assert!(Instant::now() < deadline, "the provider took the send");
    }
    to.next(&mut || from.poll(&mut Vec::new()).unwrap())
}

/// Has `raw` send `bytes` to `to`, progressing both until the provider took it.
fn raw_send(raw: &mut RawEndpoint, to: &mut Receiver, bytes: &[u8]) {
    let deadline = Instant::now() + Duration::from_secs(10);
    let at = to.domain.address();
    while !raw.send(at.raw(), bytes).unwrap() {
        raw.progress();
        to.pump();
        assert!(Instant::now() < deadline, "the provider took the raw send");
    }
}

/// What a forger puts on the wire: `payload` with a claim-only trailer naming `claim` (the
/// layout of src/sender.rs).
fn claiming(payload: &[u8], claim: &NetAddr) -> Vec<u8> {
    let mut m = payload.to_vec();
    m.extend_from_slice(claim.raw());
    m.push(claim.raw().len() as u8);
    m.push(0xc1);
    m
}

fn without_a_secret(provider: &str) {
    let mut a = domain(provider, None);
    let mut b = Receiver::new(domain(provider, None));
    let mut forger = RawEndpoint::open(provider).unwrap();
    let a_addr = a.address();
    // A stranger's first message: unproven (the provider names no source for it).
    let got = send(&mut a, &mut b, b"first").expect("the first message");
    assert_eq!(got, (b"first".to_vec(), None));
    // Its claim was learned: the provider now names the same endpoint's messages.
    let got = send(&mut a, &mut b, b"second").expect("the second message");
    assert_eq!(got, (b"second".to_vec(), Some(a_addr.clone())));
    // A forger claiming to be `a`, whom `b` knows now: never named `a`.
    raw_send(&mut forger, &mut b, &claiming(b"forged", &a_addr));
    let got = b
        .next(&mut || {
            forger.progress();
        })
        .expect("the forged message");
    assert_eq!(
        got,
        (b"forged".to_vec(), None),
        "a forged claim is never named"
    );
    assert_eq!(b.domain.messages_refused(), 0);
}

fn with_a_secret(provider: &str) {
    let path = secret_file(&provider.replace(';', "-"));
    let mut a = domain(provider, Some(&path));
    let mut b = Receiver::new(domain(provider, Some(&path)));
    let mut relay = RawEndpoint::open(provider).unwrap();
    let a_addr = a.address();
    // The MAC proves a stranger's first message.
    let got = send(&mut a, &mut b, b"first").expect("the first message");
    assert_eq!(got, (b"first".to_vec(), Some(a_addr.clone())));
    // A forger's claim without the MAC: dropped, counted.
    raw_send(&mut relay, &mut b, &claiming(b"forged", &a_addr));
    // A message `a` sealed for the relay, sent on to `b` by it: dropped (it names its
    // receiver).
    let relay_addr = NetAddr::new(&relay.address()).unwrap();
    let deadline = Instant::now() + Duration::from_secs(10);
    while a.post_send(2, &relay_addr, b"for the relay").unwrap() == PostStatus::Busy {
        a.poll(&mut Vec::new()).unwrap();
        relay.progress();
        b.pump();
        assert!(Instant::now() < deadline, "the provider took the send");
    }
    let sealed_for_relay = loop {
        a.poll(&mut Vec::new()).unwrap();
        b.pump();
        if let Some(m) = relay.progress().pop() {
            break m;
        }
        assert!(Instant::now() < deadline, "the relay got a's message");
    };
    raw_send(&mut relay, &mut b, &sealed_for_relay);
    // Neither arrives, and b's receive buffers are kept: a's next messages still do.
    while b.domain.messages_refused() < 2 {
        relay.progress();
        b.pump();
        assert!(Instant::now() < deadline, "both forgeries refused");
    }
    assert!(
        b.inbox.is_empty(),
        "a forged or relayed message was delivered: {:?}",
        b.inbox
    );
    for _ in 0..10 {
        let got = send(&mut a, &mut b, b"after").expect("a's next message");
        assert_eq!(got, (b"after".to_vec(), Some(a_addr.clone())));
    }
    let _ = std::fs::remove_file(path);
}

#[test]
fn shm_without_a_secret() {
    without_a_secret("shm");
}

#[test]
fn tcp_without_a_secret() {
    without_a_secret("tcp;ofi_rxm");
}

#[test]
fn shm_with_a_secret() {
    with_a_secret("shm");
}

#[test]
fn tcp_with_a_secret() {
    with_a_secret("tcp;ofi_rxm");
}
