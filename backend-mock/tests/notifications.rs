//! Notifications against careless and hostile peers (issue 25 §3): user messages are never
//! taken for engine messages, a notification names its sender and a receiver can restrict
//! who may notify it, the id limit is one number both sides know and is checked at submit,
//! the notification's send capacity is held from submit, and the queue is bounded.

mod common;

use std::sync::{Arc, Mutex};
use std::time::Duration;

use engine_core::domain::Domain;
use engine_core::{DoneCounter, DoneFlag, Error, HostBuffer, TransferEngine, NOTIFICATION_ID_MAX};

const WAIT: Duration = Duration::from_secs(10);

fn pair(extra: &str) -> (Arc<TransferEngine>, Arc<TransferEngine>) {
    let config = common::mock_config(1, extra);
    (
        Arc::new(TransferEngine::open(&config).unwrap()),
        Arc::new(TransferEngine::open(&config).unwrap()),
    )
}

/// Writes 4 KiB from `a` to `b` with notification `id` attached; returns the sender's flag.
fn write_with_notification(
    a: &Arc<TransferEngine>,
    b: &Arc<TransferEngine>,
    id: &[u8],
) -> Arc<DoneFlag> {
    let src = HostBuffer::from_fn(a, 4096, |i| i as u8).unwrap();
    let dst = HostBuffer::new(b, 4096).unwrap();
    let flag = DoneFlag::new();
    let done = a
        .notify_when_done(&b.main_address(), id, flag.clone())
        .unwrap();
    a.submit_single_write(4096, None, (src.mr(), 0), (dst.desc(), 0), done)
        .unwrap();
    flag.wait(WAIT).unwrap();
    // The buffers deregister on drop, after the transfer finished.
    drop((src, dst));
    flag
}

#[test]
fn a_user_message_that_looks_like_a_notification_reaches_the_handler() {
    let (a, b) = pair("");
    let got = Arc::new(Mutex::new(Vec::new()));
    let sink = Arc::clone(&got);
    b.submit_recvs(256, 4, move |m: &[u8]| {
        sink.lock().unwrap().push(m.to_vec())
    })
    .unwrap();
    // The bytes the engine once used to tag notifications, then an id.
    let mut forged = b"\xffXFNTF\x00\x01".to_vec();
    forged.extend_from_slice(b"req-1");
    let sent = DoneFlag::new();
    a.submit_send(&b.main_address(), &forged, sent.clone())
        .unwrap();
    sent.wait(WAIT).unwrap();
    let deadline = std::time::Instant::now() + WAIT;
    while got.lock().unwrap().is_empty() && std::time::Instant::now() < deadline {
        std::thread::yield_now();
    }
    assert_eq!(
        *got.lock().unwrap(),
        vec![forged],
        "the handler sees the user's bytes"
    );
    assert!(
        b.poll_notifications().is_empty(),
        "no notification was made of it"
    );
}

#[test]
fn a_notification_names_its_sender_and_a_receiver_can_refuse_others() {
    let (a, b) = pair("");
    let c = Arc::new(TransferEngine::open(&common::mock_config(1, "")).unwrap());
    b.listen_notifications(8).unwrap();
    write_with_notification(&a, &b, b"from-a");
    let note = b.wait_notification(WAIT).unwrap();
    assert_eq!(
        (note.id.as_slice(), &note.from),
        (&b"from-a"[..], &a.main_address())
    );

    b.restrict_notifications(Some(vec![c.main_address()]));
    write_with_notification(&a, &b, b"from-a-again");
    write_with_notification(&c, &b, b"from-c");
    let note = b.wait_notification(WAIT).unwrap();
    assert_eq!(
        (note.id.as_slice(), &note.from),
        (&b"from-c"[..], &c.main_address())
    );
    // Completions are unordered: a's may be handled at b after c's.
    let deadline = std::time::Instant::now() + WAIT;
    while b.notifications_dropped() == 0 && std::time::Instant::now() < deadline {
        std::thread::yield_now();
    }
    assert_eq!(
        b.notifications_dropped(),
        1,
        "a's second notification was refused"
    );
    assert!(b.poll_notifications().is_empty(), "and not queued");
}

#[test]
fn an_id_over_the_limit_is_refused_at_submit_naming_it() {
    // A sender whose messages could carry it: the limit is the protocol's, not the config's.
    let (a, b) = pair("[worker]\nmax_message = 65536\n");
    let too_long = vec![b'x'; NOTIFICATION_ID_MAX + 1];
    match a.notify_when_done(&b.main_address(), &too_long, DoneFlag::new()) {
        Err(Error::InvalidArgument(m)) => {
            assert!(m.contains(&NOTIFICATION_ID_MAX.to_string()), "{m}")
        }
        other => panic!("expected InvalidArgument, got {:?}", other.map(|_| ())),
    }
    // The longest id arrives whole at a receiver that only listens for notifications.
    b.listen_notifications(2).unwrap();
    let longest = vec![b'y'; NOTIFICATION_ID_MAX];
    write_with_notification(&a, &b, &longest);
    assert_eq!(b.wait_notification(WAIT).unwrap().id, longest);
}

#[test]
fn a_notification_holds_its_send_capacity_from_submit() {
    let (a, b) = pair("[worker]\nmax_outstanding = 2\n");
    b.listen_notifications(2).unwrap();
    let before = a.outstanding();
    let done = a
        .notify_when_done(&b.main_address(), b"held", DoneFlag::new())
        .unwrap();
    assert_eq!(
        a.outstanding(),
        before + 1,
        "the send's capacity is taken at submit"
    );
    drop(done);
    assert_eq!(
        a.outstanding(),
        before,
        "and given back when the OnDone is dropped unused"
    );

    // Under saturation, no notification fails with Busy after its data landed: every one
    // either is refused at submit or is delivered.
    let sent = DoneCounter::new();
    let mut submitted = 0u64;
    let src = HostBuffer::from_fn(&a, 4096, |i| i as u8).unwrap();
    let dst = HostBuffer::new(&b, 4096).unwrap();
    for round in 0..200u32 {
        let id = round.to_le_bytes();
        let Ok(done) = a.notify_when_done(&b.main_address(), &id, sent.clone()) else {
            a.wait_for_capacity(WAIT).unwrap();
            continue;
        };
        match a.submit_single_write(4096, None, (src.mr(), 0), (dst.desc(), 0), done) {
            Ok(()) => submitted += 1,
            Err(Error::Busy { .. }) => a.wait_for_capacity(WAIT).unwrap(),
            Err(e) => panic!("{e}"),
        }
        while let Some(n) = b.poll_notifications().pop() {
            drop(n);
        }
    }
    sent.wait_for(submitted, WAIT).unwrap();
    assert_eq!(
        (sent.ok(), sent.failed()),
        (submitted, 0),
        "first error: {:?}",
        sent.first_error()
    );
}

#[test]
fn the_notification_queue_is_bounded_and_what_it_drops_is_counted() {
    let (a, b) = pair("[worker]\nmax_notifications = 4\n");
    b.listen_notifications(8).unwrap();
    for round in 0..6u8 {
        write_with_notification(&a, &b, &[round]);
    }
    // The sixth was sent after the fifth; wait until both were handled at b.
    let deadline = std::time::Instant::now() + WAIT;
    while b.notifications_dropped() < 2 && std::time::Instant::now() < deadline {
        std::thread::yield_now();
    }
    let kept: Vec<Vec<u8>> = b.poll_notifications().into_iter().map(|n| n.id).collect();
    assert_eq!(kept.len(), 4, "{kept:?}");
    assert_eq!(b.notifications_dropped(), 2);
}

/// Issue 42 item 13: a receiver that never listens (no `listen_notifications`, no
/// `submit_recvs`) made every notified transfer to it fail with a bare timeout that blamed the
/// transfer. The data lands; the error says the peer is not listening, names it, and says what
/// the receiver calls.
#[test]
fn a_notification_to_a_peer_that_is_not_listening_says_so() {
    let (a, b) = pair("[timeouts]\ntransfer_ms = 300\n");
    let src = HostBuffer::from_fn(&a, 4096, |i| i as u8).unwrap();
    let dst = HostBuffer::new(&b, 4096).unwrap();
    let flag = DoneFlag::new();
    let done = a
        .notify_when_done(&b.main_address(), b"req-42", flag.clone())
        .unwrap();
    a.submit_single_write(4096, None, (src.mr(), 0), (dst.desc(), 0), done)
        .unwrap();
    match flag.wait(WAIT) {
        Err(Error::NotListening { peer, waited }) => {
            assert_eq!(peer, b.main_address());
            assert_eq!(waited, Duration::from_millis(300));
        }
        other => panic!("expected NotListening, got {other:?}"),
    }
    let message = flag.wait(WAIT).unwrap_err().to_string();
    assert!(
        message.contains("listen_notifications") && message.contains("landed"),
        "{message}"
    );
    assert_eq!(dst.to_vec(), src.to_vec(), "the data itself landed");
}

/// A Domain of the mock fabric driven by hand: an endpoint that can address the engines and
/// send them any bytes, engine messages included (what a hostile host on the network is).
fn forger() -> backend_mock::MockDomain {
    backend_mock::link();
    backend_mock::MockDomain::open(&engine_core::domain::DomainConfig {
        nic: "forger",
        options: "",
    })
    .unwrap()
}

/// Sends `data` as one message from `domain` to `to`, and waits for its completion.
fn send_raw(domain: &mut backend_mock::MockDomain, to: &engine_core::NetAddr, data: &[u8]) {
    use engine_core::domain::{Event, PostStatus};
    assert_eq!(domain.post_send(7, to, data).unwrap(), PostStatus::Posted);
    let deadline = std::time::Instant::now() + WAIT;
    let mut events = Vec::new();
    loop {
        domain.poll(&mut events).unwrap();
        if let Some(Event::Done { result, .. }) = events
            .iter()
            .find(|e| matches!(e, Event::Done { wr_id: 7, .. }))
        {
            result.clone().unwrap();
            return;
        }
        assert!(
            std::time::Instant::now() < deadline,
            "the forged send never completed"
        );
        std::thread::yield_now();
    }
}

fn wait_until(what: &str, done: impl Fn() -> bool) {
    let deadline = std::time::Instant::now() + WAIT;
    while !done() {
        assert!(
            std::time::Instant::now() < deadline,
            "waited 10 s for {what}"
        );
        std::thread::yield_now();
    }
}

/// Issue 56: a notification's `from` is a claim in its bytes; the transport knows who sent
/// it. One claiming an allowed peer, sent by another endpoint, is not what the receiver is
/// told: it is dropped and counted, and the real peer's notification carries its proven
/// sender.
#[test]
fn a_forged_sender_in_a_notification_is_not_what_the_receiver_is_told() {
    let (a, b) = pair("");
    b.listen_notifications(8).unwrap();
    b.restrict_notifications(Some(vec![a.main_address()]));
    let mut f = forger();
    let forged = engine_core::wire::encode_notification(&a.main_address(), b"forged");
    send_raw(&mut f, &b.main_address(), &forged);
    wait_until("the forged notification to be dropped", || {
        b.notifications_dropped() == 1
    });
    // Unrestricted, a claim that is not the sender's is dropped all the same.
    b.restrict_notifications(None);
    send_raw(&mut f, &b.main_address(), &forged);
    wait_until("the second forged notification to be dropped", || {
        b.notifications_dropped() == 2
    });
    write_with_notification(&a, &b, b"real");
    let note = b.wait_notification(WAIT).unwrap();
    assert_eq!(note.id, b"real");
    assert_eq!(note.from, a.main_address());
    assert_eq!(note.sender, Some(a.main_address()), "the proven sender");
    assert!(
        b.poll_notifications().is_empty(),
        "nothing forged was queued"
    );
    // A notification that names its real sender (the forger's own address) is queued, with
    // that sender proven: the engine tells who sent it, the application decides what to trust.
    let honest = engine_core::wire::encode_notification(&f.address(), b"self");
    send_raw(&mut f, &b.main_address(), &honest);
    let note = b.wait_notification(WAIT).unwrap();
    assert_eq!(
        (note.id.as_slice(), note.sender),
        (&b"self"[..], Some(f.address()))
    );
}

/// Issue 56: a receive handler is told who sent each message, as the fabric saw it: the
/// sending engine's main address (with several NICs too), or the hand-driven endpoint's.
#[test]
fn a_message_handler_is_told_the_real_sender() {
    let config = common::mock_config(2, "");
    let (a, b) = (
        TransferEngine::open(&config).unwrap(),
        TransferEngine::open(&config).unwrap(),
    );
    let got = Arc::new(Mutex::new(Vec::new()));
    let sink = Arc::clone(&got);
    b.submit_recvs_with_sender(
        64,
        4,
        move |m: &[u8], from: Option<&engine_core::NetAddr>| {
            sink.lock().unwrap().push((m.to_vec(), from.cloned()))
        },
    )
    .unwrap();
    let sent = DoneFlag::new();
    a.submit_send(&b.main_address(), b"hello", sent.clone())
        .unwrap();
    sent.wait(WAIT).unwrap();
    wait_until("the message", || got.lock().unwrap().len() == 1);
    let mut f = forger();
    send_raw(
        &mut f,
        &b.main_address(),
        &engine_core::wire::encode_user_message(b"from f"),
    );
    wait_until("the forger's message", || got.lock().unwrap().len() == 2);
    assert_eq!(
        *got.lock().unwrap(),
        vec![
            (b"hello".to_vec(), Some(a.main_address())),
            (b"from f".to_vec(), Some(f.address())),
        ]
    );
}

/// Issue 56: one peer holds at most `worker.max_notifications_per_peer` of the queue: its
/// notifications past that are dropped and counted, another peer's still get in.
#[test]
fn one_peer_cannot_fill_the_notification_queue() {
    let (a, b) = pair("[worker]\nmax_notifications_per_peer = 2\n");
    let c = Arc::new(TransferEngine::open(&common::mock_config(1, "")).unwrap());
    b.listen_notifications(8).unwrap();
    for id in [&b"a0"[..], b"a1", b"a2"] {
        write_with_notification(&a, &b, id);
    }
    wait_until("a's third notification to be dropped", || {
        b.notifications_dropped() == 1
    });
    write_with_notification(&c, &b, b"c0");
    let mut got = Vec::new();
    while got.len() < 3 {
        got.push(b.wait_notification(WAIT).unwrap().id);
    }
    got.sort();
    assert_eq!(got, vec![b"a0".to_vec(), b"a1".to_vec(), b"c0".to_vec()]);
    assert_eq!(b.notifications_dropped(), 1);
}
