//! The conformance suite on soft-RoCE devices: run inside the rxe guest with
//! `cargo xtask rxe --nics 2 -- <this test binary> --ignored` (cargo xtask test does).

struct Rxe;

impl xfer_conformance::Harness for Rxe {
    fn config(&self, nics: usize) -> engine_core::Config {
        backend_verbs::link();
        let names: Vec<String> = (0..nics).map(|i| format!("\"rxe{i}\"")).collect();
        let text = format!(
            "backend = \"verbs\"\n[[groups]]\nnics = [{}]\n[worker]\nidle_poll_us = 0\n",
            names.join(", ")
        );
        engine_core::Config::from_toml(&text, std::path::Path::new("<rxe test>")).unwrap()
    }

    fn max_nics(&self) -> usize {
        backend_verbs::devices()
            .iter()
            .filter(|d| d.starts_with("rxe"))
            .count()
            .clamp(1, 4)
    }
}

xfer_conformance::conformance_suite!(
    ignored = "needs soft-RoCE devices: runs in the rxe guest",
    Rxe
);

/// A well-formed address whose UD QP does not exist: the handshake is never answered, and
/// the transfer fails as unreachable within the connect deadline.
#[test]
#[ignore = "needs soft-RoCE devices: runs in the rxe guest"]
fn an_address_with_no_listening_qp_is_unreachable() {
    use std::time::{Duration, Instant};
    use xfer_conformance::Harness;
    let mut config = Rxe.config(1);
    // The engine's one handshake deadline, which it passes to the backend.
    config.timeouts.connect_ms = 500;
    let engine = std::sync::Arc::new(engine_core::TransferEngine::open(&config).unwrap());
    let src = engine_core::HostBuffer::new(&engine, 64).unwrap();
    let real = backend_verbs::wire::VerbsAddr::decode(engine.main_address().raw()).unwrap();
    let bogus = backend_verbs::wire::VerbsAddr {
        ud_qpn: real.ud_qpn + 1000,
        ..real
    };
    let peer = engine_core::NetAddr::new(&bogus.encode()).unwrap();
    let desc = engine_core::MrDesc::new(0x1000, 64, vec![(peer, 1)]).unwrap();
    let start = Instant::now();
    let f = engine_core::DoneFlag::new();
    engine
        .submit_single_write(64, Some(1), (src.mr(), 0), (&desc, 0), f.clone())
        .unwrap();
    let r = f.wait(Duration::from_secs(10));
    assert!(
        matches!(r, Err(engine_core::Error::PeerUnreachable(_))),
        "{r:?}"
    );
    assert!(
        start.elapsed() < Duration::from_secs(3),
        "within the 500 ms connect deadline"
    );
}

/// Workers that park with nothing in flight are woken by the device (its completion channel),
/// not by an idle poll: here the idle poll is an hour, so an arrival that does not wake the
/// receiver's worker is never seen (with `completion_channel = false` this fails at the first
/// write: the receiver's worker sleeps through the handshake request). Covers the handshake
/// (the receiver answers from a parked worker), writes with immediate each way after both
/// sides went idle, and messages.
#[test]
#[ignore = "needs soft-RoCE devices: runs in the rxe guest"]
fn arrivals_wake_a_parked_worker() {
    use std::sync::{Arc, Mutex};
    use std::time::Duration;
    use xfer_conformance::Harness;
    let mut config = Rxe.config(1);
    config.worker.idle_poll_us = 3_600_000_000;
    config.worker.spin_us = 0;
    let a = Arc::new(engine_core::TransferEngine::open(&config).unwrap());
    let b = Arc::new(engine_core::TransferEngine::open(&config).unwrap());
    let on_a = engine_core::HostBuffer::from_fn(&a, 4096, |i| i as u8).unwrap();
    let on_b = engine_core::HostBuffer::from_fn(&b, 4096, |i| (i * 7) as u8).unwrap();
    let got = Arc::new(Mutex::new(Vec::<Vec<u8>>::new()));
    let sink = got.clone();
    b.submit_recvs(64, 4, move |m| sink.lock().unwrap().push(m.to_vec()))
        .unwrap();
    for round in 0..3u32 {
        // Idle long enough for both workers to park.
        std::thread::sleep(Duration::from_millis(50));
        let (from, to, src, dst) = if round % 2 == 0 {
            (&a, &b, &on_a, &on_b)
        } else {
            (&b, &a, &on_b, &on_a)
        };
        let arrived = engine_core::DoneFlag::new();
        to.expect_imm_count(round, 1, arrived.clone()).unwrap();
        let written = engine_core::DoneFlag::new();
        from.submit_single_write(
            512,
            Some(round),
            (src.mr(), 0),
            (dst.desc(), 1024),
            written.clone(),
        )
        .unwrap();
        written
            .wait(Duration::from_secs(20))
            .unwrap_or_else(|e| panic!("round {round}: the write: {e}"));
        arrived
            .wait(Duration::from_secs(20))
            .unwrap_or_else(|e| panic!("round {round}: the arrival never woke the receiver: {e}"));
        assert!(dst.to_vec()[1024..1536] == src.to_vec()[..512]);
    }
    std::thread::sleep(Duration::from_millis(50));
    let sent = engine_core::DoneFlag::new();
    a.submit_send(&b.main_address(), b"while parked", sent.clone())
        .unwrap();
    sent.wait(Duration::from_secs(20)).unwrap();
    let deadline = std::time::Instant::now() + Duration::from_secs(20);
    while got.lock().unwrap().is_empty() && std::time::Instant::now() < deadline {
        std::thread::sleep(Duration::from_millis(1));
    }
    assert_eq!(*got.lock().unwrap(), vec![b"while parked".to_vec()]);
}

/// An asynchronous event reaches the engine, typed, while the receiver's worker idles: the
/// receiver's CQ is fixed at 256 entries (fault `cq_entries`) and its worker stalls at the
/// first arrival (fault `stall_on_first_arrival_ms`), so a burst of 2,000 writes with
/// immediate overruns the CQ; the device reports a CQ error, and the receiver's waiting
/// expectation fails with it, naming the completion queue — not at its 120 s deadline, and
/// not by hanging (an overrun CQ delivers nothing more that could wake the worker).
#[test]
#[ignore = "needs soft-RoCE devices: runs in the rxe guest"]
fn a_cq_overrun_fails_the_receiver_with_its_cause() {
    use std::time::Duration;
    use xfer_conformance::Harness;
    const WRITES: u32 = 2_000;
    let mut config = Rxe.config(1);
    config.timeouts.expect_ms = 120_000;
    config.timeouts.transfer_ms = 120_000;
    let a = std::sync::Arc::new(engine_core::TransferEngine::open(&config).unwrap());
    let mut receiver = config.clone();
    receiver.backends =
        toml::from_str("[verbs.faults]\ncq_entries = 256\nstall_on_first_arrival_ms = 3000\n")
            .unwrap();
    let b = std::sync::Arc::new(engine_core::TransferEngine::open(&receiver).unwrap());
    let src = engine_core::HostBuffer::new(&a, 8 * WRITES as usize).unwrap();
    let dst = engine_core::HostBuffer::new(&b, 8 * WRITES as usize).unwrap();
    let pages = engine_core::Pages {
        indices: (0..WRITES).collect(),
        stride: 8,
        offset: 0,
    };
    let arrived = engine_core::DoneFlag::new();
    b.expect_imm_count(5, WRITES.into(), arrived.clone())
        .unwrap();
    let sent = engine_core::DoneCounter::new();
    a.submit_paged_writes(
        8,
        Some(5),
        (src.mr(), &pages),
        (dst.desc(), &pages),
        sent.clone(),
    )
    .unwrap();
    let started = std::time::Instant::now();
    let r = arrived.wait(Duration::from_secs(100));
    let text = format!("{r:?}");
    assert!(
        r.is_err() && text.contains("completion queue of"),
        "the overrun must fail the receiver with its cause: {text}"
    );
    assert!(
        !matches!(r, Err(engine_core::Error::Timeout(_))),
        "failed by the deadline, not by the event: {text} after {:?}",
        started.elapsed()
    );
    let _ = sent.wait_for(1, Duration::from_secs(30));
}

/// A remote access error breaks the RC connection; the next transfer to the same peer
/// reconnects and succeeds.
#[test]
#[ignore = "needs soft-RoCE devices: runs in the rxe guest"]
fn the_next_transfer_after_a_failure_reconnects() {
    use std::time::Duration;
    use xfer_conformance::Harness;
    let config = Rxe.config(1);
    let a = std::sync::Arc::new(engine_core::TransferEngine::open(&config).unwrap());
    let b = std::sync::Arc::new(engine_core::TransferEngine::open(&config).unwrap());
    let src = engine_core::HostBuffer::from_fn(&a, 4096, |i| i as u8).unwrap();
    let dst = engine_core::HostBuffer::new(&b, 4096).unwrap();
    let (addr, rkey) = dst.desc().rkeys()[0].clone();
    let forged =
        engine_core::MrDesc::new(dst.desc().ptr(), 4096, vec![(addr, rkey ^ 0x77)]).unwrap();
    let f = engine_core::DoneFlag::new();
    a.submit_single_write(4096, None, (src.mr(), 0), (&forged, 0), f.clone())
        .unwrap();
    assert!(matches!(
        f.wait(Duration::from_secs(10)),
        Err(engine_core::Error::RemoteAccess(_))
    ));
    for round in 0..3 {
        let ok = engine_core::DoneFlag::new();
        a.submit_single_write(4096, Some(5), (src.mr(), 0), (dst.desc(), 0), ok.clone())
            .unwrap();
        ok.wait(Duration::from_secs(10))
            .unwrap_or_else(|e| panic!("round {round}: {e}"));
    }
    assert!(dst.to_vec() == src.to_vec());
}

/// A peer that vanished after connecting is declared unreachable — not left to the engine's
/// timeout, whatever the transport's own retries do (soft-RoCE retries forever at
/// `retry_cnt = 7`) — and well before `transfer_ms`.
#[test]
#[ignore = "needs soft-RoCE devices: runs in the rxe guest"]
fn a_vanished_peer_is_unreachable_before_the_deadline() {
    use std::time::{Duration, Instant};
    use xfer_conformance::Harness;
    let mut config = Rxe.config(1);
    config.timeouts.transfer_ms = 20_000;
    config.backends = toml::from_str("[verbs]\nunreachable_ms = 500\n").unwrap();
    let a = std::sync::Arc::new(engine_core::TransferEngine::open(&config).unwrap());
    let b = std::sync::Arc::new(engine_core::TransferEngine::open(&config).unwrap());
    let src = engine_core::HostBuffer::from_fn(&a, 4096, |i| i as u8).unwrap();
    let dst = engine_core::HostBuffer::new(&b, 4096).unwrap();
    let desc = dst.desc().clone();
    let first = engine_core::DoneFlag::new();
    a.submit_single_write(4096, None, (src.mr(), 0), (&desc, 0), first.clone())
        .unwrap();
    first.wait(Duration::from_secs(10)).unwrap();
    // B's process "dies": its QPs and registrations are gone, the device stays.
    drop(dst);
    drop(b);
    let start = Instant::now();
    let done = engine_core::DoneCounter::new();
    for _ in 0..8 {
        a.submit_single_write(4096, None, (src.mr(), 0), (&desc, 0), done.clone())
            .unwrap();
    }
    let _ = done.wait_for(8, Duration::from_secs(30));
    assert_eq!(done.failed(), 8);
    assert!(
        matches!(
            done.first_error(),
            Some(engine_core::Error::PeerUnreachable(_))
        ),
        "{:?}",
        done.first_error()
    );
    assert!(
        start.elapsed() < Duration::from_secs(10),
        "declared unreachable in {:?}, not at the 20 s deadline",
        start.elapsed()
    );
}

/// What a RoCE operator sets — traffic class, service level, the GID chosen by netdev, a port
/// per device — is accepted and the transfer works; what cannot work on RoCE is refused with
/// the option named.
#[test]
#[ignore = "needs soft-RoCE devices: runs in the rxe guest"]
fn operator_path_options_work_and_impossible_ones_are_named() {
    use std::time::Duration;
    use xfer_conformance::Harness;
    let mut config = Rxe.config(1);
    config.backends = toml::from_str(
        "[verbs]\ntraffic_class = 106\nservice_level = 3\ngid = \"rxenet0\"\nports = { rxe0 = 1 }\n",
    )
    .unwrap();
    let a = std::sync::Arc::new(engine_core::TransferEngine::open(&config).unwrap());
    let b = std::sync::Arc::new(engine_core::TransferEngine::open(&config).unwrap());
    let src = engine_core::HostBuffer::from_fn(&a, 4096, |i| i as u8).unwrap();
    let dst = engine_core::HostBuffer::new(&b, 4096).unwrap();
    let f = engine_core::DoneFlag::new();
    a.submit_single_write(4096, Some(2), (src.mr(), 0), (dst.desc(), 0), f.clone())
        .unwrap();
    f.wait(Duration::from_secs(10)).unwrap();
    assert!(dst.to_vec() == src.to_vec());
    for (table, needle) in [
        (
            "[verbs]\ngid = \"nosuchnetdev\"\n",
            "gid = \"nosuchnetdev\"",
        ),
        ("[verbs]\nglobal_routing = \"never\"\n", "global_routing"),
    ] {
        let mut bad = Rxe.config(1);
        bad.backends = toml::from_str(table).unwrap();
        let e = engine_core::TransferEngine::open(&bad)
            .unwrap_err()
            .to_string();
        assert!(e.contains(needle), "{table}: {e}");
    }
}

/// Both directions share a peer's QPs: A's bad write puts B's side of the connection in the
/// error state too. B's next (correct) write must not fail for it — B's caller did nothing
/// wrong — and must land exactly once.
#[test]
#[ignore = "needs soft-RoCE devices: runs in the rxe guest"]
fn the_other_sides_bad_write_does_not_fail_my_next_write() {
    use std::time::Duration;
    use xfer_conformance::Harness;
    let config = Rxe.config(1);
    let a = std::sync::Arc::new(engine_core::TransferEngine::open(&config).unwrap());
    let b = std::sync::Arc::new(engine_core::TransferEngine::open(&config).unwrap());
    let on_a = engine_core::HostBuffer::from_fn(&a, 4096, |i| i as u8).unwrap();
    let on_b = engine_core::HostBuffer::from_fn(&b, 4096, |i| (i * 7) as u8).unwrap();
    // Connect both directions with a good write each way.
    for (from, src, dst) in [(&a, &on_a, &on_b), (&b, &on_b, &on_a)] {
        let f = engine_core::DoneFlag::new();
        from.submit_single_write(16, None, (src.mr(), 0), (dst.desc(), 2048), f.clone())
            .unwrap();
        f.wait(Duration::from_secs(10)).unwrap();
    }
    // A's write with a forged key fails at A ...
    let (addr, rkey) = on_b.desc().rkeys()[0].clone();
    let forged =
        engine_core::MrDesc::new(on_b.desc().ptr(), 4096, vec![(addr, rkey ^ 0x55)]).unwrap();
    let f = engine_core::DoneFlag::new();
    a.submit_single_write(64, None, (on_a.mr(), 0), (&forged, 0), f.clone())
        .unwrap();
    assert!(f.wait(Duration::from_secs(10)).is_err());
    std::thread::sleep(Duration::from_millis(200));
    // ... and B's next correct write to A succeeds, landing once.
    let landed = engine_core::DoneFlag::new();
    a.expect_imm_count(77, 1, landed.clone()).unwrap();
    let f = engine_core::DoneFlag::new();
    b.submit_single_write(1024, Some(77), (on_b.mr(), 0), (on_a.desc(), 0), f.clone())
        .unwrap();
    f.wait(Duration::from_secs(10))
        .unwrap_or_else(|e| panic!("B's write failed for A's mistake: {e}"));
    landed.wait(Duration::from_secs(10)).unwrap();
    assert_eq!(a.imm_count(77), 0, "exactly one arrival");
    assert!(on_a.to_vec()[..1024] == on_b.to_vec()[..1024]);
}

/// Fan-out: one engine connects to 60 peers at once. KNOWN FAILING (issue #11, item 7): in the
/// TCG guest 56 of 60 (and 56 of 80) connect within 20 s, the rest never get an answer; not yet
/// understood. `cargo xtask test` skips it (see xtask); run it by name to work on it:
/// `cargo xtask rxe --nics 2 -- <conformance_rxe binary> --ignored fan_out`. More handshakes than the UD queue has
/// slots go out as slots free up (none is overwritten while the NIC reads it), and every
/// connection completes within `connect_ms`: every write lands.
#[test]
#[ignore = "needs soft-RoCE devices: runs in the rxe guest"]
fn fan_out_to_many_peers_connects_every_one() {
    use std::time::Duration;
    use xfer_conformance::Harness;
    const PEERS: usize = 60;
    let mut config = Rxe.config(1);
    config.timeouts.connect_ms = 20_000;
    config.timeouts.transfer_ms = 30_000;
    config.worker.idle_poll_us = 1_000;
    config.backends = toml::from_str("[verbs]\nimm_receives = 16\nsend_queue = 16\n").unwrap();
    let a = std::sync::Arc::new(engine_core::TransferEngine::open(&config).unwrap());
    let src = engine_core::HostBuffer::from_fn(&a, 64, |i| i as u8).unwrap();
    let peers: Vec<_> = (0..PEERS)
        .map(|_| {
            let e = std::sync::Arc::new(engine_core::TransferEngine::open(&config).unwrap());
            let b = engine_core::HostBuffer::new(&e, 64).unwrap();
            (e, b)
        })
        .collect();
    let done = engine_core::DoneCounter::new();
    let arrived = engine_core::DoneCounter::new();
    for (e, b) in &peers {
        e.expect_imm_count(1, 1, arrived.clone()).unwrap();
        a.submit_single_write(64, Some(1), (src.mr(), 0), (b.desc(), 0), done.clone())
            .unwrap();
    }
    let r = done.wait_for(PEERS as u64, Duration::from_secs(60));
    assert_eq!(done.ok(), PEERS as u64, "{r:?}");
    // The writer's completion says the data is placed, not that the receiver's engine has
    // polled the immediate yet: each receiver waits for its own arrival.
    let r = arrived.wait_for(PEERS as u64, Duration::from_secs(10));
    assert_eq!(arrived.ok(), PEERS as u64, "{r:?}");
    for (e, b) in &peers {
        assert_eq!(e.imm_count(1), 0, "exactly one arrival");
        assert!(b.to_vec() == src.to_vec());
    }
}

/// A handshake QP that fails (soft-RoCE puts it in the error state under load: the cause of
/// the fan-out failures) is reset with the same QP number and handshakes resume: both peers'
/// handshake QPs fail right after their first datagram, and they still connect, and a third
/// engine connects to both afterwards.
#[test]
#[ignore = "needs soft-RoCE devices: runs in the rxe guest"]
fn a_failed_handshake_qp_is_reset_and_peers_still_connect() {
    use std::time::Duration;
    use xfer_conformance::Harness;
    let mut config = Rxe.config(1);
    config.timeouts.connect_ms = 10_000;
    config.backends = toml::from_str("[verbs.faults]\nud_error_after_sends = 1\n").unwrap();
    let a = std::sync::Arc::new(engine_core::TransferEngine::open(&config).unwrap());
    let b = std::sync::Arc::new(engine_core::TransferEngine::open(&config).unwrap());
    let c = std::sync::Arc::new(engine_core::TransferEngine::open(&Rxe.config(1)).unwrap());
    let src = engine_core::HostBuffer::from_fn(&a, 4096, |i| i as u8).unwrap();
    let dst = engine_core::HostBuffer::new(&b, 4096).unwrap();
    let ok = engine_core::DoneFlag::new();
    let arrived = engine_core::DoneFlag::new();
    b.expect_imm_count(3, 1, arrived.clone()).unwrap();
    a.submit_single_write(4096, Some(3), (src.mr(), 0), (dst.desc(), 0), ok.clone())
        .unwrap();
    ok.wait(Duration::from_secs(20)).unwrap();
    // A's completion can come before B's engine polls the immediate (CI saw it): wait for it.
    arrived.wait(Duration::from_secs(10)).unwrap();
    assert!(dst.to_vec() == src.to_vec());
    assert_eq!(b.imm_count(3), 0, "exactly one arrival");
    let csrc = engine_core::HostBuffer::from_fn(&c, 4096, |i| (i * 3) as u8).unwrap();
    let adst = engine_core::HostBuffer::new(&a, 4096).unwrap();
    for (to, n) in [(&adst, 0u64), (&dst, 1)] {
        let ok = engine_core::DoneFlag::new();
        c.submit_single_write(4096, Some(4), (csrc.mr(), 0), (to.desc(), 0), ok.clone())
            .unwrap();
        ok.wait(Duration::from_secs(20))
            .unwrap_or_else(|e| panic!("third engine to peer {n}: {e}"));
        assert!(to.to_vec() == csrc.to_vec());
    }
}

/// Simultaneous connects where the requester is slow to bring its QPs up (a fault delays
/// it by 3 s, longer than the responder's retransmission budget): the responder must post
/// nothing before the requester's `Ready`, or its writes are dropped until they fail.
#[test]
#[ignore = "needs soft-RoCE devices: runs in the rxe guest"]
fn a_responder_sends_nothing_before_the_requester_is_ready() {
    use std::time::Duration;
    use xfer_conformance::Harness;
    let mut config = Rxe.config(1);
    config.timeouts.connect_ms = 30_000;
    config.timeouts.transfer_ms = 40_000;
    config.backends = toml::from_str(
        "[verbs]\nack_timeout = 10\nretry_cnt = 2\n[verbs.faults]\ndelay_response_ms = 3000\n",
    )
    .unwrap();
    let a = std::sync::Arc::new(engine_core::TransferEngine::open(&config).unwrap());
    let b = std::sync::Arc::new(engine_core::TransferEngine::open(&config).unwrap());
    let (sa, sb) = (
        engine_core::HostBuffer::from_fn(&a, 65536, |i| i as u8).unwrap(),
        engine_core::HostBuffer::from_fn(&b, 65536, |i| (i * 7) as u8).unwrap(),
    );
    let (da, db) = (
        engine_core::HostBuffer::new(&a, 65536).unwrap(),
        engine_core::HostBuffer::new(&b, 65536).unwrap(),
    );
    // Both directions at once: one side answers the other's request with writes queued.
    let (fa, fb) = (engine_core::DoneFlag::new(), engine_core::DoneFlag::new());
    a.submit_single_write(65536, Some(1), (sa.mr(), 0), (db.desc(), 0), fa.clone())
        .unwrap();
    b.submit_single_write(65536, Some(1), (sb.mr(), 0), (da.desc(), 0), fb.clone())
        .unwrap();
    fa.wait(Duration::from_secs(60)).expect("a to b");
    fb.wait(Duration::from_secs(60)).expect("b to a");
    assert!(db.to_vec() == sa.to_vec() && da.to_vec() == sb.to_vec());
}

/// Deregistering a region while a write from it is still queued (its peer slow to answer
/// the handshake): that write fails at once, naming the deregistration, and is never posted
/// with the dead key — which used to break the connection and fail the other region's write
/// queued behind it.
#[test]
#[ignore = "needs soft-RoCE devices: runs in the rxe guest"]
fn deregistering_a_region_fails_its_queued_writes_and_spares_the_others() {
    use std::time::Duration;
    use xfer_conformance::Harness;
    let mut config = Rxe.config(1);
    config.timeouts.connect_ms = 20_000;
    config.timeouts.transfer_ms = 30_000;
    let a = std::sync::Arc::new(engine_core::TransferEngine::open(&config).unwrap());
    let mut slow = config.clone();
    slow.backends = toml::from_str("[verbs.faults]\ndelay_request_ms = 1500\n").unwrap();
    let b = std::sync::Arc::new(engine_core::TransferEngine::open(&slow).unwrap());
    let r1 = engine_core::HostBuffer::from_fn(&a, 4096, |i| i as u8).unwrap();
    let r2 = engine_core::HostBuffer::from_fn(&a, 4096, |i| (i * 3) as u8).unwrap();
    let dst = engine_core::HostBuffer::new(&b, 8192).unwrap();
    let (f1, f2) = (engine_core::DoneFlag::new(), engine_core::DoneFlag::new());
    a.submit_single_write(4096, None, (r1.mr(), 0), (dst.desc(), 0), f1.clone())
        .unwrap();
    a.submit_single_write(4096, Some(2), (r2.mr(), 0), (dst.desc(), 4096), f2.clone())
        .unwrap();
    let r1_bytes = r1.to_vec();
    drop(r1); // deregisters while both writes wait for the handshake
    let e = f1.wait(Duration::from_secs(30)).unwrap_err();
    assert!(
        matches!(&e, engine_core::Error::Backend { source, .. } | engine_core::Error::Refused { source, .. } if source.message.contains("deregistered")),
        "{e:?}"
    );
    f2.wait(Duration::from_secs(30))
        .expect("the other region's write");
    let got = dst.to_vec();
    assert!(got[4096..] == r2.to_vec()[..], "the second write landed");
    assert!(
        got[..4096].iter().all(|&b| b == 0),
        "the deregistered region's write never ran"
    );
    drop(r1_bytes);
}

/// A burst of arrivals larger than the old fixed 8,192-entry CQ (16,383 on rxe, which rounds up) while the receiver's worker
/// is stalled (a fault: 20 s at its first arrival): 8,000 writes with immediate and 9,000
/// messages complete on its CQ meanwhile. The CQ is sized from what can be outstanding, so
/// nothing overruns and every arrival is counted.
#[test]
#[ignore = "needs soft-RoCE devices: runs in the rxe guest"]
fn a_stalled_receiver_loses_no_completion_to_a_cq_overrun() {
    use std::time::Duration;
    use xfer_conformance::Harness;
    const WRITES: u64 = 8_000;
    const MESSAGES: usize = 9_000;
    let mut config = Rxe.config(1);
    config.timeouts.transfer_ms = 120_000;
    config.timeouts.expect_ms = 120_000;
    let a = std::sync::Arc::new(engine_core::TransferEngine::open(&config).unwrap());
    let mut receiver = config.clone();
    receiver.backends = toml::from_str(
        "[verbs]\nimm_receives = 8100\n[verbs.faults]\nstall_on_first_arrival_ms = 20000\n",
    )
    .unwrap();
    let b = std::sync::Arc::new(engine_core::TransferEngine::open(&receiver).unwrap());
    let got = std::sync::Arc::new(std::sync::atomic::AtomicUsize::new(0));
    let seen = std::sync::Arc::clone(&got);
    b.submit_recvs(64, MESSAGES, move |_| {
        seen.fetch_add(1, std::sync::atomic::Ordering::SeqCst);
    })
    .unwrap();
    let src = engine_core::HostBuffer::from_fn(&a, 8 * WRITES as usize, |i| i as u8).unwrap();
    let dst = engine_core::HostBuffer::new(&b, 8 * WRITES as usize).unwrap();
    let pages = engine_core::Pages {
        indices: (0..WRITES as u32).collect(),
        stride: 8,
        offset: 0,
    };
    let arrived = engine_core::DoneFlag::new();
    b.expect_imm_count(7, WRITES, arrived.clone()).unwrap();
    let sent = engine_core::DoneCounter::new();
    a.submit_paged_writes(
        8,
        Some(7),
        (src.mr(), &pages),
        (dst.desc(), &pages),
        sent.clone(),
    )
    .unwrap();
    for _ in 0..MESSAGES {
        a.submit_send(&b.main_address(), b"burst", sent.clone())
            .unwrap();
    }
    sent.wait_for(1 + MESSAGES as u64, Duration::from_secs(120))
        .unwrap();
    arrived.wait(Duration::from_secs(120)).unwrap();
    assert!(dst.to_vec() == src.to_vec());
    let deadline = std::time::Instant::now() + Duration::from_secs(60);
    while got.load(std::sync::atomic::Ordering::SeqCst) < MESSAGES {
        assert!(std::time::Instant::now() < deadline, "messages lost");
        std::thread::sleep(Duration::from_millis(10));
    }
}

/// Requests that name no connection (stale or forged datagrams: a fault on A sends one to
/// every connected peer every 30 ms) must not replace a live connection — busy or idle — so
/// no write in either direction fails.
#[test]
#[ignore = "needs soft-RoCE devices: runs in the rxe guest"]
fn unproven_requests_do_not_replace_a_live_connection() {
    use std::time::Duration;
    use xfer_conformance::Harness;
    let config = Rxe.config(1);
    let mut forging = config.clone();
    forging.backends = toml::from_str("[verbs.faults]\nforge_requests_every_ms = 30\n").unwrap();
    let a = std::sync::Arc::new(engine_core::TransferEngine::open(&forging).unwrap());
    let b = std::sync::Arc::new(engine_core::TransferEngine::open(&config).unwrap());
    let (sa, sb) = (
        engine_core::HostBuffer::from_fn(&a, 65536, |i| i as u8).unwrap(),
        engine_core::HostBuffer::from_fn(&b, 65536, |i| (i * 5) as u8).unwrap(),
    );
    let (da, db) = (
        engine_core::HostBuffer::new(&a, 65536).unwrap(),
        engine_core::HostBuffer::new(&b, 65536).unwrap(),
    );
    for round in 0..4 {
        let done = engine_core::DoneCounter::new();
        for _ in 0..50 {
            b.submit_single_write(65536, None, (sb.mr(), 0), (da.desc(), 0), done.clone())
                .unwrap();
            a.submit_single_write(65536, None, (sa.mr(), 0), (db.desc(), 0), done.clone())
                .unwrap();
        }
        let r = done.wait_for(100, Duration::from_secs(60));
        assert_eq!(
            done.ok(),
            100,
            "round {round}: {r:?} {:?}",
            done.first_error()
        );
        // Idle for a while: forged requests keep coming.
        std::thread::sleep(Duration::from_millis(300));
    }
    assert!(da.to_vec() == sb.to_vec() && db.to_vec() == sa.to_vec());
}

/// Small writes go inline (`IBV_SEND_INLINE`, up to `inline_bytes`) and land byte for byte
/// with their immediates counted, on both sides of the inline limit; a size the device
/// refuses gets QPs without inline data instead of no QPs.
#[test]
#[ignore = "needs soft-RoCE devices: runs in the rxe guest"]
fn small_writes_inline_and_an_inline_size_the_device_refuses_falls_back() {
    use std::time::Duration;
    use xfer_conformance::Harness;
    for inline_bytes in [64u32, 1 << 20] {
        let mut config = Rxe.config(1);
        let mut verbs = toml::Table::new();
        verbs.insert(
            "inline_bytes".into(),
            toml::Value::Integer(inline_bytes.into()),
        );
        config
            .backends
            .insert("verbs".into(), toml::Value::Table(verbs));
        let a = std::sync::Arc::new(engine_core::TransferEngine::open(&config).unwrap());
        let b = std::sync::Arc::new(engine_core::TransferEngine::open(&config).unwrap());
        let src = engine_core::HostBuffer::from_fn(&a, 8192, |i| (i * 7 + 3) as u8).unwrap();
        let dst = engine_core::HostBuffer::new(&b, 8192).unwrap();
        let sizes = [1u64, 8, 63, 64, 65, 4096];
        let landed = engine_core::DoneFlag::new();
        b.expect_imm_count(9, sizes.len() as u64, landed.clone())
            .unwrap();
        let sent = engine_core::DoneCounter::new();
        let mut at = 0;
        for len in sizes {
            a.submit_single_write(len, Some(9), (src.mr(), at), (dst.desc(), at), sent.clone())
                .unwrap();
            at += len;
        }
        sent.wait_for(sizes.len() as u64, Duration::from_secs(20))
            .unwrap_or_else(|e| panic!("inline_bytes {inline_bytes}: {e}"));
        landed
            .wait(Duration::from_secs(20))
            .unwrap_or_else(|e| panic!("inline_bytes {inline_bytes}: arrivals: {e}"));
        let at = at as usize;
        assert!(
            dst.to_vec()[..at] == src.to_vec()[..at],
            "inline_bytes {inline_bytes}: data"
        );
    }
}

/// Issue 25 §5: with `[security] secret_file`, engines holding the same secret connect and
/// move data; one holding another secret, or none, gets no answer to its handshake (its
/// write fails as unreachable) — on real QPs, the handshake datagrams sealed and checked.
#[test]
#[ignore = "needs soft-RoCE devices: runs in the rxe guest"]
fn a_cluster_secret_admits_only_its_holders() {
    use std::time::Duration;
    use xfer_conformance::Harness;
    let dir = std::env::temp_dir().join(format!("xfer-secret-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let (ours, theirs) = (dir.join("ours"), dir.join("theirs"));
    std::fs::write(&ours, b"32 bytes of the cluster's secret").unwrap();
    std::fs::write(&theirs, b"another cluster's secret, longer").unwrap();
    for f in [&ours, &theirs] {
        // Only its owner may read a secret file (others' access is refused).
        use std::os::unix::fs::PermissionsExt;
        std::fs::set_permissions(f, std::fs::Permissions::from_mode(0o600)).unwrap();
    }
    let with = |secret: Option<&std::path::Path>| {
        let mut c = Rxe.config(1);
        c.security.secret_file = secret.map(std::path::Path::to_path_buf);
        c.timeouts.connect_ms = 2_000;
        c.timeouts.transfer_ms = 20_000;
        std::sync::Arc::new(engine_core::TransferEngine::open(&c).unwrap())
    };
    let (a, b) = (with(Some(&ours)), with(Some(&ours)));
    let dst = engine_core::HostBuffer::new(&b, 4096).unwrap();
    let send = |from: &std::sync::Arc<engine_core::TransferEngine>| {
        let src = engine_core::HostBuffer::from_fn(from, 4096, |i| i as u8).unwrap();
        let f = engine_core::DoneFlag::new();
        from.submit_single_write(4096, None, (src.mr(), 0), (dst.desc(), 0), f.clone())
            .unwrap();
        f.wait(Duration::from_secs(30))
    };
    send(&a).unwrap();
    assert_eq!(dst.to_vec()[..16], (0..16u8).collect::<Vec<_>>()[..]);
    for (who, stranger) in [
        ("another secret", with(Some(&theirs))),
        ("no secret", with(None)),
    ] {
        let r = send(&stranger);
        assert!(
            matches!(r, Err(engine_core::Error::PeerUnreachable(_))),
            "a peer with {who} got: {r:?}"
        );
    }
    let _ = std::fs::remove_dir_all(&dir);
}

/// Writes one 64-byte write with immediate from an engine with `[backends.verbs]` options
/// `options` to each of `peers` fresh engines; returns how many landed (every byte checked)
/// and the first error.
fn write_to_many_peers(options: &str, peers: usize) -> (u64, Option<engine_core::Error>) {
    use std::time::Duration;
    use xfer_conformance::Harness;
    let mut config = Rxe.config(1);
    config.timeouts.connect_ms = 60_000;
    config.timeouts.transfer_ms = 120_000;
    config.worker.idle_poll_us = 1_000;
    let mut writer = config.clone();
    writer.backends = toml::from_str(&format!("[verbs]\n{options}")).unwrap();
    // The peers are small (each holds one connection); the writer is what is measured.
    config.backends = toml::from_str("[verbs]\nimm_receives = 16\nsend_queue = 16\n").unwrap();
    let a = std::sync::Arc::new(engine_core::TransferEngine::open(&writer).unwrap());
    let src = engine_core::HostBuffer::from_fn(&a, 64, |i| i as u8).unwrap();
    let peers: Vec<_> = (0..peers)
        .map(|_| {
            let e = std::sync::Arc::new(engine_core::TransferEngine::open(&config).unwrap());
            let b = engine_core::HostBuffer::new(&e, 64).unwrap();
            (e, b)
        })
        .collect();
    let done = engine_core::DoneCounter::new();
    for (_, b) in &peers {
        a.submit_single_write(64, Some(1), (src.mr(), 0), (b.desc(), 0), done.clone())
            .unwrap();
    }
    let _ = done.wait_for(peers.len() as u64, Duration::from_secs(150));
    for (e, b) in &peers {
        if b.to_vec() == src.to_vec() {
            // Landed: its immediate arrives exactly once.
            let arrived = engine_core::DoneFlag::new();
            e.expect_imm_count(1, 1, arrived.clone()).unwrap();
            arrived.wait(Duration::from_secs(10)).unwrap();
        }
    }
    let landed = peers
        .iter()
        .filter(|(_, b)| b.to_vec() == src.to_vec())
        .count();
    assert_eq!(
        landed as u64,
        done.ok(),
        "every write reported done landed, and only those"
    );
    (done.ok(), done.first_error())
}

/// 256 peers of one engine with the default options (issue 29): each QP holds completion-queue
/// room only for what it may have outstanding — a data QP its window (32, doubled on demand),
/// a message QP its 16 — so soft-RoCE's 32k-entry CQ holds hundreds of peers. (Reserving each
/// QP's whole send queue, 1,024 + 256, refused the 16th peer: see the next test.)
#[test]
#[ignore = "needs soft-RoCE devices: runs in the rxe guest"]
fn two_hundred_fifty_six_peers_with_the_default_options() {
    let (ok, first) = write_to_many_peers("", 256);
    assert_eq!(ok, 256, "first error: {first:?}");
}

/// The defect the previous test guards against, kept visible: with the old reservations
/// (every data QP its 1,024-entry send queue, every message QP 256) the writer's CQ is full
/// after a few dozen peers, and the writes to the rest fail — typed, naming the cause — instead
/// of landing.
#[test]
#[ignore = "needs soft-RoCE devices: runs in the rxe guest"]
fn reserving_whole_send_queues_runs_out_of_completion_queue_room() {
    let (ok, first) = write_to_many_peers("send_window = 1024\nmessage_queue = 256\n", 64);
    assert!(
        ok < 64,
        "all 64 peers fit: the CQ is larger than this test assumes"
    );
    let text = format!("{first:?}");
    assert!(
        text.contains("No space left"),
        "the failure names the full CQ: {text}"
    );
}

/// `cycles` cycles of a refused write (the connection breaks) and a good one (it
/// reconnects), from an engine with `[backends.verbs]` options `options`; the first cycle whose
/// good write failed, with why.
fn failure_and_reconnect_cycles(options: &str, cycles: usize) -> Result<(), String> {
    use std::time::Duration;
    use xfer_conformance::Harness;
    let config = Rxe.config(1);
    let mut writer = config.clone();
    writer.backends = toml::from_str(&format!("[verbs]\n{options}")).unwrap();
    let a = std::sync::Arc::new(engine_core::TransferEngine::open(&writer).unwrap());
    let b = std::sync::Arc::new(engine_core::TransferEngine::open(&config).unwrap());
    let src = engine_core::HostBuffer::from_fn(&a, 64, |i| i as u8).unwrap();
    let dst = engine_core::HostBuffer::new(&b, 64).unwrap();
    let (addr, rkey) = dst.desc().rkeys()[0].clone();
    let forged = engine_core::MrDesc::new(dst.desc().ptr(), 64, vec![(addr, rkey ^ 0x77)]).unwrap();
    for cycle in 0..cycles {
        let refused = engine_core::DoneFlag::new();
        a.submit_single_write(64, None, (src.mr(), 0), (&forged, 0), refused.clone())
            .unwrap();
        let r = refused.wait(Duration::from_secs(20));
        assert!(
            r.is_err(),
            "cycle {cycle}: the forged key must be refused, got {r:?}"
        );
        let ok = engine_core::DoneFlag::new();
        a.submit_single_write(64, None, (src.mr(), 0), (dst.desc(), 0), ok.clone())
            .unwrap();
        ok.wait(Duration::from_secs(20))
            .map_err(|e| format!("cycle {cycle}: {e}"))?;
    }
    assert!(dst.to_vec() == src.to_vec());
    Ok(())
}

/// Fast failure/reconnect cycles do not run the CQ out of room (issue 29): a retired
/// connection's QPs keep their CQ reservation until they are destroyed seconds later; with
/// the default options (48 entries per connection) 40 cycles in a few seconds all reconnect.
#[test]
#[ignore = "needs soft-RoCE devices: runs in the rxe guest"]
fn forty_fast_failure_and_reconnect_cycles() {
    failure_and_reconnect_cycles("", 40).unwrap();
}

/// The defect the previous test guards against, kept visible: with whole send queues
/// reserved (1,024 + 256 per connection) the retired connections' reservations fill the CQ
/// within 40 cycles and a reconnect fails, naming it.
#[test]
#[ignore = "needs soft-RoCE devices: runs in the rxe guest"]
fn whole_send_queue_reservations_fail_fast_reconnect_cycles() {
    let e = failure_and_reconnect_cycles("send_window = 1024\nmessage_queue = 256\n", 40)
        .expect_err("40 cycles fitted: the CQ is larger than this test assumes");
    assert!(
        e.contains("No space left"),
        "the failure names the full CQ: {e}"
    );
}

/// One NIC of `rxe0`, with a send queue of `depth` entries per connection.
fn rxe_config_with_send_queue(depth: i64) -> engine_core::Config {
    use xfer_conformance::Harness;
    let mut config = Rxe.config(1);
    let mut verbs = toml::Table::new();
    verbs.insert("send_queue".into(), toml::Value::Integer(depth));
    config
        .backends
        .insert("verbs".into(), toml::Value::Table(verbs));
    config
}

/// Issue 29: a paged write's pages reach the verbs Domain as batches (one connection lookup,
/// chains of 4 per doorbell, the tail posted at once). With a send queue of 16, every batch of
/// 3,000 pages is cut short by a full queue: the rest waits in the engine and is posted as
/// completions free room. Every page lands once, with its immediate, both on a fresh
/// connection (the first page connects) and on the live one.
#[test]
#[ignore = "needs soft-RoCE devices: runs in the rxe guest"]
fn a_paged_write_larger_than_the_send_queue_lands_every_page_once() {
    use std::time::Duration;
    let config = rxe_config_with_send_queue(16);
    let a = std::sync::Arc::new(engine_core::TransferEngine::open(&config).unwrap());
    let b = std::sync::Arc::new(engine_core::TransferEngine::open(&config).unwrap());
    let (n, page) = (3000u32, 64u64);
    let len = (u64::from(n) * page) as usize;
    let src = engine_core::HostBuffer::from_fn(&a, len, |i| (i * 13 + 5) as u8).unwrap();
    let dst = engine_core::HostBuffer::new(&b, len).unwrap();
    let (from, to) = xfer_conformance::scattered_pages(n, page);
    for round in 0..2u32 {
        let landed = engine_core::DoneFlag::new();
        b.expect_imm_count(20 + round, u64::from(n), landed.clone())
            .unwrap();
        let sent = engine_core::DoneFlag::new();
        a.submit_paged_writes(
            page,
            Some(20 + round),
            (src.mr(), &from),
            (dst.desc(), &to),
            sent.clone(),
        )
        .unwrap();
        sent.wait(Duration::from_secs(60))
            .unwrap_or_else(|e| panic!("round {round}: {e}"));
        landed
            .wait(Duration::from_secs(60))
            .unwrap_or_else(|e| panic!("round {round}: arrivals: {e}"));
        xfer_conformance::assert_pages_landed(
            &src.to_vec(),
            &dst.to_vec(),
            (&from, &to),
            page,
            &[],
        );
        assert_eq!(
            b.imm_count(20 + round),
            0,
            "round {round}: no extra arrival"
        );
        assert_eq!(a.stats().unwrap().stale_completions, 0, "round {round}");
    }
}

/// Issue 29: a burst of single writes reaches the verbs Domain as lists; each run to one peer
/// shares one connection lookup and is chained. Writes go to two peers in turns of 8 (each
/// peer's at falling offsets), through a send queue of 16 that cuts runs short: every write
/// lands once with its immediate, on fresh connections (the first writes connect) and on live
/// ones.
#[test]
#[ignore = "needs soft-RoCE devices: runs in the rxe guest"]
fn a_burst_of_single_writes_to_two_peers_lands_every_write_once() {
    use std::time::Duration;
    let config = rxe_config_with_send_queue(16);
    let open = || std::sync::Arc::new(engine_core::TransferEngine::open(&config).unwrap());
    let (a, peers) = (open(), [open(), open()]);
    let (n, len) = (2000u64, 32u64);
    let size = (n * len) as usize;
    let src = engine_core::HostBuffer::from_fn(&a, size, |i| (i * 11 + 7) as u8).unwrap();
    let dst = peers
        .each_ref()
        .map(|p| engine_core::HostBuffer::new(p, size).unwrap());
    for round in 0..2u32 {
        let landed = peers.each_ref().map(|p| {
            let flag = engine_core::DoneFlag::new();
            p.expect_imm_count(30 + round, n / 2, flag.clone()).unwrap();
            flag
        });
        let sent = engine_core::DoneCounter::new();
        for i in 0..n {
            let (to, slot) = ((i / 8 % 2) as usize, n - 1 - i);
            a.submit_single_write(
                len,
                Some(30 + round),
                (src.mr(), i * len),
                (dst[to].desc(), slot * len),
                sent.clone(),
            )
            .unwrap();
        }
        sent.wait_for(n, Duration::from_secs(60))
            .unwrap_or_else(|e| panic!("round {round}: {e}"));
        for flag in &landed {
            flag.wait(Duration::from_secs(60))
                .unwrap_or_else(|e| panic!("round {round}: arrivals: {e}"));
        }
        let (from, to) = (src.to_vec(), dst.each_ref().map(|d| d.to_vec()));
        let l = len as usize;
        for i in 0..n as usize {
            let (peer, slot) = (i / 8 % 2, n as usize - 1 - i);
            assert_eq!(
                &to[peer][slot * l..(slot + 1) * l],
                &from[i * l..(i + 1) * l],
                "round {round}: write {i}"
            );
        }
        for (p, peer) in peers.iter().enumerate() {
            assert_eq!(
                peer.imm_count(30 + round),
                0,
                "round {round}: peer {p}: no extra arrival"
            );
        }
        assert_eq!(a.stats().unwrap().stale_completions, 0, "round {round}");
    }
}

/// The QPs on `rxe0` now, as the kernel counts them (`rdma resource show`: every process's;
/// the guest runs one, and this suite one test at a time).
fn qps_on_rxe0() -> u32 {
    let out = std::process::Command::new("rdma")
        .args(["resource", "show"])
        .output()
        .expect("`rdma` (iproute2) runs in the guest");
    let text = String::from_utf8_lossy(&out.stdout);
    // "0: rxe0: pd 3 cq 3 qp 11 cm_id 0 mr 2 ctx 0 srq 4"
    let line = text
        .lines()
        .find(|l| l.split_whitespace().nth(1) == Some("rxe0:"))
        .unwrap_or_else(|| panic!("no rxe0 in `rdma resource show`: {text}"));
    let words: Vec<&str> = line.split_whitespace().collect();
    let at = words
        .iter()
        .position(|w| *w == "qp")
        .unwrap_or_else(|| panic!("no qp count in {line:?}"));
    words[at + 1].parse().expect("a QP count")
}

/// Retired connections' QPs are freed while the engine idles (issue 43): each failure and
/// reconnect retires two QPs on each side, kept a few seconds so their last flushes can be
/// read. Their freeing is a deadline the Domain wakes the worker for — not a side effect of
/// being polled, which a parked worker never is (over 29 cycles the QPs on one device grew
/// from 11 to 127 and stayed there). Both workers park here (nothing polls them on an
/// interval), and the device's QP count must come back to what one live connection holds.
#[test]
#[ignore = "needs soft-RoCE devices: runs in the rxe guest"]
fn retired_qps_are_freed_while_the_engine_idles() {
    use std::time::{Duration, Instant};
    use xfer_conformance::Harness;
    const CYCLES: usize = 12;
    let mut config = Rxe.config(1);
    config.worker.idle_poll_us = 3_600_000_000;
    config.worker.spin_us = 0;
    let a = std::sync::Arc::new(engine_core::TransferEngine::open(&config).unwrap());
    let b = std::sync::Arc::new(engine_core::TransferEngine::open(&config).unwrap());
    let src = engine_core::HostBuffer::from_fn(&a, 64, |i| i as u8).unwrap();
    let dst = engine_core::HostBuffer::new(&b, 64).unwrap();
    let write = |desc: &engine_core::MrDesc| {
        let f = engine_core::DoneFlag::new();
        a.submit_single_write(64, None, (src.mr(), 0), (desc, 0), f.clone())
            .unwrap();
        f.wait(Duration::from_secs(20))
    };
    write(dst.desc()).expect("the first write connects");
    let baseline = qps_on_rxe0();
    let (addr, rkey) = dst.desc().rkeys()[0].clone();
    let forged = engine_core::MrDesc::new(dst.desc().ptr(), 64, vec![(addr, rkey ^ 0x77)]).unwrap();
    // The most QPs seen, each read just after a failure retired a connection (a cycle may
    // take longer than retired QPs are kept on a loaded machine: read at the end, they can
    // all be gone already).
    let mut grown = baseline;
    for cycle in 0..CYCLES {
        assert!(
            write(&forged).is_err(),
            "cycle {cycle}: the forged key is refused"
        );
        grown = grown.max(qps_on_rxe0());
        write(dst.desc()).unwrap_or_else(|e| panic!("cycle {cycle}: the reconnect: {e}"));
    }
    assert!(
        grown > baseline,
        "the retired QPs are kept a while first ({baseline} before, at most {grown} during)"
    );
    // Idle from here on. The count is read until it is back, within a deadline well past
    // the few seconds retired QPs are kept.
    let idle = Instant::now();
    let deadline = idle + Duration::from_secs(30);
    let mut now = qps_on_rxe0();
    while now != baseline && Instant::now() < deadline {
        std::thread::sleep(Duration::from_millis(50));
        now = qps_on_rxe0();
    }
    eprintln!(
        "QPs on rxe0: {baseline} with one connection, up to {grown} over {CYCLES} failures and \
         reconnects, {now} after {:.1} s idle",
        idle.elapsed().as_secs_f64()
    );
    assert_eq!(
        now, baseline,
        "QPs on rxe0: {baseline} with one connection, up to {grown} over {CYCLES} failures \
         and reconnects, still {now} after 30 s idle"
    );
    write(dst.desc()).expect("the live connection was kept");
}
