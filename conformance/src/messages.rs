//! Messages and notifications: sends into posted receives, notifications after their data, oversized messages.

use super::*;

/// Messages both ways, more than the receive pool holds (buffers are reposted), with content.
pub fn send_recv(h: &dyn Harness) {
    let config = quick_config(h, 1);
    let (a, b) = (open(&config), open(&config));
    let got = Arc::new(std::sync::Mutex::new(Vec::<Vec<u8>>::new()));
    let sink = Arc::clone(&got);
    b.submit_recvs(256, 4, move |m| sink.lock().unwrap().push(m.to_vec()))
        .unwrap();
    let replies = Arc::new(AtomicU64::new(0));
    let r = Arc::clone(&replies);
    a.submit_recvs(64, 2, move |m| {
        assert_eq!(m, b"pong");
        r.fetch_add(1, Ordering::SeqCst);
    })
    .unwrap();
    let sent = DoneCounter::new();
    for i in 0..20u32 {
        let msg = format!("message {i} {}", "x".repeat(i as usize * 7));
        a.submit_send(&b.main_address(), msg.as_bytes(), sent.clone())
            .or_fail("posting it");
    }
    sent.wait_for(20, WAIT).or_fail("the 20 sends' completions");
    let back = DoneCounter::new();
    for _ in 0..5 {
        b.submit_send(&a.main_address(), b"pong", back.clone())
            .or_fail("posting it");
    }
    back.wait_for(5, WAIT).or_fail("the 5 replies' completions");
    let deadline = Instant::now() + WAIT;
    while (got.lock().unwrap().len() < 20 || replies.load(Ordering::SeqCst) < 5)
        && Instant::now() < deadline
    {
        std::thread::sleep(Duration::from_millis(1));
    }
    let mut got = got.lock().unwrap().clone();
    got.sort();
    let mut want: Vec<Vec<u8>> = (0..20u32)
        .map(|i| format!("message {i} {}", "x".repeat(i as usize * 7)).into_bytes())
        .collect();
    want.sort();
    assert_eq!(got, want, "every message arrives once, intact");
    assert_eq!(replies.load(Ordering::SeqCst), 5);
    // Too large for the sender's limit: refused locally.
    let huge = vec![0u8; config.worker.max_message + 1];
    assert!(matches!(
        a.submit_send(&b.main_address(), &huge, flag()),
        Err(Error::InvalidArgument(_))
    ));
}

/// The sender a receive handler and a notification are told is the one that sent it, as the
/// transport proved it (the sending engine's main address), told apart between two senders.
/// Messages from senders the receiver never addressed (strangers) are named right or not at
/// all — never a guess: libfabric without a cluster secret can prove only a source already in
/// its address vector. Once the receiver has sent to both, every message names its sender. A
/// backend that names no sender at all (`EVENT_MESSAGE` rather than ABI 7's
/// `EVENT_MESSAGE_FROM`) is skipped, as naming it is optional in the ABI, unless its harness
/// says it names senders ([`Harness::names_senders`]).
pub fn messages_name_their_sender(h: &dyn Harness) {
    let config = quick_config(h, 1);
    let (a, b, c) = (open(&config), open(&config), open(&config));
    let got = Arc::new(std::sync::Mutex::new(Vec::new()));
    let sink = Arc::clone(&got);
    b.submit_recvs_with_sender(64, 8, move |m, from| {
        sink.lock().unwrap().push((m.to_vec(), from.cloned()))
    })
    .unwrap();
    let round = |tag: &str| {
        got.lock().unwrap().clear();
        let sent = DoneCounter::new();
        for (sender, name) in [(&a, "a"), (&c, "c")] {
            for i in 0..3 {
                sender
                    .submit_send(
                        &b.main_address(),
                        format!("{name}{tag}{i}").as_bytes(),
                        sent.clone(),
                    )
                    .or_fail("posting it");
            }
        }
        sent.wait_for(6, WAIT).or_fail("the 6 sends' completions");
        let deadline = Instant::now() + WAIT;
        while got.lock().unwrap().len() < 6 && Instant::now() < deadline {
            std::thread::sleep(Duration::from_millis(1));
        }
        let got = got.lock().unwrap().clone();
        assert_eq!(got.len(), 6, "every message arrives");
        for (data, from) in &got {
            let want = if data[0] == b'a' { &a } else { &c };
            if let Some(from) = from {
                assert_eq!(
                    from,
                    &want.main_address(),
                    "message {:?} names its sender",
                    String::from_utf8_lossy(data)
                );
            }
        }
        got
    };
    let strangers = round("s");
    // The receiver addresses both senders; from then on it has met them.
    for sender in [&a, &c] {
        sender.submit_recvs(64, 2, |_| {}).unwrap();
    }
    let replies = DoneCounter::new();
    for sender in [&a, &c] {
        b.submit_send(&sender.main_address(), b"hello", replies.clone())
            .or_fail("posting a reply");
    }
    replies
        .wait_for(2, WAIT)
        .or_fail("the 2 replies' completions");
    let met = round("m");
    if strangers.iter().chain(&met).all(|(_, from)| from.is_none()) {
        if h.names_senders() {
            panic!("no message names its sender, and this backend's harness says it names them");
        }
        skip_check("the backend does not name a message's sender (ABI 7's EVENT_MESSAGE_FROM)");
    }
    for (data, from) in &met {
        assert!(
            from.is_some(),
            "message {:?} from a sender the receiver addressed names it",
            String::from_utf8_lossy(data)
        );
    }
    let src = buffer(&a, 64, pattern(1));
    let dst = buffer(&b, 64, |_| 0);
    let flag = DoneFlag::new();
    let done = a
        .notify_when_done(&b.main_address(), b"note", flag.clone())
        .or_fail("attaching a notification");
    a.submit_single_write(64, None, (src.mr(), 0), (dst.desc(), 0), done)
        .or_fail("posting the write");
    flag.wait(WAIT).or_fail("the write and its notification");
    let note = b.wait_notification(WAIT).or_fail("the notification");
    assert_eq!(
        note.sender,
        Some(a.main_address()),
        "the notification's proven sender"
    );
}

/// A notification attached to a transfer reaches the peer only after every byte of that
/// transfer is in the peer's memory: many writes in flight at once, notifications taken in
/// whatever order they come, each one's data checked the moment it is seen.
pub fn notifications_follow_their_data(h: &dyn Harness) {
    const CHUNK: usize = 128 << 10;
    const ROUNDS: usize = 16;
    let config = quick_config(h, h.max_nics().min(2));
    let (a, b) = (open(&config), open(&config));
    b.listen_notifications(ROUNDS).unwrap();
    let src = buffer(&a, CHUNK * ROUNDS, pattern(77));
    let dst = buffer(&b, CHUNK * ROUNDS, |_| 0);
    let sent = DoneCounter::new();
    for round in 0..ROUNDS {
        let id = format!("req-{round}");
        let done = a
            .notify_when_done(&b.main_address(), id.as_bytes(), sent.clone())
            .unwrap();
        let at = (round * CHUNK) as u64;
        a.submit_single_write(CHUNK as u64, None, (src.mr(), at), (dst.desc(), at), done)
            .or_fail("posting it");
    }
    let want = src.to_vec();
    let mut seen = Vec::new();
    for _ in 0..ROUNDS {
        let note = b
            .wait_notification(WAIT)
            .expect("every notification arrives");
        assert_eq!(
            note.from,
            a.main_address(),
            "a notification names its sender"
        );
        let id = note.id;
        let round: usize = std::str::from_utf8(&id)
            .ok()
            .and_then(|t| t.strip_prefix("req-"))
            .and_then(|n| n.parse().ok())
            .unwrap_or_else(|| panic!("unexpected notification {id:?}"));
        let range = round * CHUNK..(round + 1) * CHUNK;
        let got = dst.to_vec();
        assert_copied(
            &format!("chunk {round} when its notification arrived"),
            &got[range.clone()],
            &want[range],
        );
        seen.push(round);
    }
    let r = sent.wait_for(ROUNDS as u64, WAIT);
    assert!(
        r.is_ok(),
        "{r:?}: ok {} failed {} first {:?}",
        sent.ok(),
        sent.failed(),
        sent.first_error()
    );
    seen.sort_unstable();
    assert_eq!(
        seen,
        (0..ROUNDS).collect::<Vec<_>>(),
        "each notification exactly once"
    );
    assert!(b.poll_notifications().is_empty());
    // An id longer than the protocol's limit is refused before anything is sent.
    let long = vec![b'x'; engine_core::NOTIFICATION_ID_MAX + 1];
    assert!(matches!(
        a.notify_when_done(&b.main_address(), &long, flag()),
        Err(Error::InvalidArgument(_))
    ));
}

/// A message larger than the receive buffer fails (or is dropped) without costing the
/// receiver its buffer: the next message that fits arrives, and no truncated one is delivered.
pub fn oversized_message_keeps_the_buffer(h: &dyn Harness) {
    let config = quick_config(h, 1);
    let (a, b) = (open(&config), open(&config));
    let got = Arc::new(std::sync::Mutex::new(Vec::new()));
    let g = Arc::clone(&got);
    b.submit_recvs(64, 1, move |m| g.lock().unwrap().push(m.to_vec()))
        .unwrap();
    let big = flag();
    a.submit_send(&b.main_address(), &[7; 4096], big.clone())
        .unwrap();
    let _ = big.wait(WAIT);
    let deadline = Instant::now() + WAIT;
    let mut sent = false;
    while got.lock().unwrap().is_empty() && Instant::now() < deadline {
        if !sent {
            let small = flag();
            a.submit_send(&b.main_address(), b"fits", small.clone())
                .or_fail("posting it");
            // A connection the oversized message broke fails this send; the next reconnects.
            sent = small.wait(WAIT).is_ok();
        }
        std::thread::sleep(Duration::from_millis(5));
    }
    let got = got.lock().unwrap().clone();
    assert_eq!(
        got,
        vec![b"fits".to_vec()],
        "the buffer came back and only the small message was delivered"
    );
}
