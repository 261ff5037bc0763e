//! `TransferEngine::stats()` (issue 27): what each kind of operation, each peer and the
//! registrations add to the counters, on the unordered mock.

mod common;

use std::sync::Arc;
use std::time::Duration;

use engine_core::{DoneCounter, DoneFlag, HostBuffer, OpKind, RemoteAccess, TransferEngine};

const WAIT: Duration = Duration::from_secs(10);

fn engine(extra: &str) -> Arc<TransferEngine> {
    Arc::new(TransferEngine::open(&common::mock_config(2, extra)).unwrap())
}

#[test]
fn writes_reads_sends_and_notifications_are_counted_with_their_bytes_and_peers() {
    let (a, b) = (engine(""), engine(""));
    let before = a.stats().unwrap();
    let src = HostBuffer::from_fn(&a, 1 << 16, |i| i as u8).unwrap();
    let dst = HostBuffer::new(&b, 1 << 16).unwrap();
    let done = DoneCounter::new();
    for i in 0..10u64 {
        a.submit_single_write(
            4096,
            None,
            (src.mr(), i * 4096),
            (dst.desc(), i * 4096),
            done.clone(),
        )
        .unwrap();
    }
    b.listen_notifications(4).unwrap();
    let note = a
        .notify_when_done(&b.main_address(), b"n", done.clone())
        .unwrap();
    a.submit_single_write(4096, None, (src.mr(), 0), (dst.desc(), 0), note)
        .unwrap();
    done.wait_for(11, WAIT).unwrap();
    b.wait_notification(WAIT).unwrap();

    let s = a.stats().unwrap();
    let w = s.op(OpKind::Write);
    assert_eq!(
        (w.started, w.completed, w.bytes),
        (11, 11, 11 * 4096),
        "{w:?}"
    );
    assert_eq!(w.latency.count(), 11, "one latency per finished write");
    assert_eq!(
        w.post_latency.count(),
        11,
        "one post latency per accepted write"
    );
    // Per NIC: every work request of every kind went to one of the two.
    let total: u64 = s.ops.values().map(|o| o.requests).sum();
    assert_eq!(s.nics.len(), 2, "{:?}", s.nics);
    assert_eq!(s.nics.iter().map(|n| n.requests).sum::<u64>(), total);
    assert_eq!((s.imm_idle, s.imm_owed, s.queued_requests), (0, 0, 0));
    let n = s.op(OpKind::Notification);
    assert_eq!((n.started, n.completed), (1, 1), "{n:?}");
    assert_eq!(s.stale_completions, 0);
    assert_eq!(
        s.registrations.registered - before.registrations.registered,
        1,
        "the source buffer"
    );
    assert_eq!(s.registrations.bytes - before.registrations.bytes, 1 << 16);
    // Every write went to b, over one of its two NICs.
    let to_b: u64 = b
        .nic_addresses()
        .iter()
        .filter_map(|nic| s.peers.get(nic))
        .map(|p| p.bytes)
        .sum();
    assert!(to_b >= 11 * 4096, "{:?}", s.peers);
    assert!(b.stats().unwrap().imm_arrivals == 0);
}

#[test]
fn failures_are_counted_by_kind_and_charged_to_their_peer() {
    let (a, b) = (engine(""), engine(""));
    let src = HostBuffer::from_fn(&a, 4096, |i| i as u8).unwrap();
    // Write-only at b: a read of it fails with RemoteAccess at b's NIC (the descriptor does
    // not say so, as an older engine's: one that says so is refused before posting).
    let dst = HostBuffer::with_access(&b, 4096, |_| 0, RemoteAccess::WRITE).unwrap();
    let unsaid = dst.desc().clone().with_access(None);
    let failed = DoneFlag::new();
    a.submit_single_read(4096, (src.mr(), 0), (&unsaid, 0), failed.clone())
        .unwrap();
    assert!(failed.wait(WAIT).is_err());
    let s = a.stats().unwrap();
    let r = s.op(OpKind::Read);
    assert_eq!(r.completed, 0);
    assert_eq!(r.failed.get("remote_access"), Some(&1), "{r:?}");
    let charged: Vec<_> = s.peers.values().filter(|p| p.failed == 1).collect();
    assert_eq!(charged.len(), 1, "{:?}", s.peers);
    assert!(charged[0].last_error.as_deref().unwrap().contains("access"));
}

/// `engine.peers()` (issue 27): a dead peer's state says why; a live one stays healthy.
#[test]
fn peers_report_their_health_and_a_dead_one_says_why() {
    let (a, b, c) = (engine(""), engine(""), engine(""));
    let src = HostBuffer::from_fn(&a, 4096, |i| i as u8).unwrap();
    let (to_b, to_c) = (
        HostBuffer::new(&b, 4096).unwrap(),
        HostBuffer::new(&c, 4096).unwrap(),
    );
    let ok = DoneCounter::new();
    for dst in [&to_b, &to_c] {
        a.submit_single_write(64, None, (src.mr(), 0), (dst.desc(), 0), ok.clone())
            .unwrap();
    }
    ok.wait_for(2, WAIT).unwrap();
    assert!(a.peers().unwrap().iter().all(|(_, p)| p.healthy));
    // c dies (both its NICs); a write to it fails.
    let c_addrs: Vec<_> = to_c.desc().rkeys().iter().map(|(a, _)| a.clone()).collect();
    for addr in &c_addrs {
        assert!(backend_mock::kill(addr));
    }
    let failed = DoneFlag::new();
    a.submit_single_write(64, None, (src.mr(), 0), (to_c.desc(), 0), failed.clone())
        .unwrap();
    assert!(failed.wait(WAIT).is_err());
    let peers = a.peers().unwrap();
    let dead: Vec<_> = peers
        .iter()
        .filter(|(addr, p)| c_addrs.contains(addr) && p.failed > 0)
        .map(|(_, p)| p)
        .collect();
    assert_eq!(dead.len(), 1, "{peers:?}");
    assert!(!dead[0].healthy, "{peers:?}");
    assert!(
        dead[0]
            .last_error
            .as_deref()
            .unwrap()
            .contains("unreachable"),
        "{dead:?}"
    );
    assert!(dead[0].ms_since_activity.is_some());
    let b_addrs: Vec<_> = to_b.desc().rkeys().iter().map(|(a, _)| a.clone()).collect();
    let live: Vec<_> = peers
        .iter()
        .filter(|(addr, _)| b_addrs.contains(addr))
        .collect();
    assert!(
        !live.is_empty() && live.iter().all(|(_, p)| p.healthy),
        "{peers:?}"
    );
}

#[test]
fn stats_of_a_closed_engine_fail_loudly() {
    let a = engine("");
    a.shutdown();
    assert!(a.stats().is_err());
}

/// Parses Prometheus text into (`name{labels}`, value), skipping comments.
fn samples(text: &str) -> std::collections::HashMap<String, f64> {
    text.lines()
        .filter(|l| !l.starts_with('#') && !l.is_empty())
        .map(|l| {
            let (name, value) = l
                .rsplit_once(' ')
                .unwrap_or_else(|| panic!("bad line {l:?}"));
            (
                name.to_owned(),
                value
                    .parse()
                    .unwrap_or_else(|_| panic!("bad value in {l:?}")),
            )
        })
        .collect()
}

#[test]
fn the_metrics_endpoint_serves_a_fresh_scrape_to_a_real_http_client() {
    let a = engine("[metrics]\nlisten = \"127.0.0.1:0\"\n");
    let b = engine("");
    let url = format!("http://{}/metrics", a.metrics_address().expect("listening"));
    let src = HostBuffer::from_fn(&a, 8192, |i| i as u8).unwrap();
    let dst = HostBuffer::new(&b, 8192).unwrap();
    let done = DoneCounter::new();
    for i in 0..3u64 {
        a.submit_single_write(
            1024,
            None,
            (src.mr(), i * 1024),
            (dst.desc(), i * 1024),
            done.clone(),
        )
        .unwrap();
    }
    done.wait_for(3, WAIT).unwrap();
    let mut response = ureq::get(&url).call().unwrap();
    let text = response.body_mut().read_to_string().unwrap();
    let got = samples(&text);
    assert_eq!(
        got.get("xfer_operations_completed_total{kind=\"write\"}"),
        Some(&3.0),
        "{text}"
    );
    assert_eq!(
        got.get("xfer_bytes_total{kind=\"write\"}"),
        Some(&3072.0),
        "{text}"
    );
    assert_eq!(
        got.get("xfer_operation_duration_seconds_count{kind=\"write\"}"),
        Some(&3.0),
        "{text}"
    );
    assert_eq!(
        got.get("xfer_operation_duration_seconds_bucket{le=\"+Inf\",kind=\"write\"}")
            .or_else(
                || got.get("xfer_operation_duration_seconds_bucket{kind=\"write\",le=\"+Inf\"}")
            ),
        Some(&3.0),
        "{text}"
    );
    assert_eq!(
        got.get("xfer_post_duration_seconds_count{kind=\"write\"}"),
        Some(&3.0),
        "{text}"
    );
    assert_eq!(
        got.get("xfer_nic_bytes_total{nic=\"0\"}")
            .copied()
            .unwrap_or(0.0)
            + got
                .get("xfer_nic_bytes_total{nic=\"1\"}")
                .copied()
                .unwrap_or(0.0),
        3072.0,
        "{text}"
    );
    assert_eq!(got.get("xfer_imm_owed"), Some(&0.0), "{text}");
    assert_eq!(
        got.get("xfer_stale_completions_total"),
        Some(&0.0),
        "{text}"
    );
    assert!(
        got.get("xfer_registrations_total")
            .is_some_and(|&n| n >= 1.0),
        "{text}"
    );
    // Each scrape is fresh.
    let one_more = DoneFlag::new();
    a.submit_single_write(1024, None, (src.mr(), 0), (dst.desc(), 0), one_more.clone())
        .unwrap();
    one_more.wait(WAIT).unwrap();
    let text = ureq::get(&url)
        .call()
        .unwrap()
        .body_mut()
        .read_to_string()
        .unwrap();
    assert_eq!(
        samples(&text).get("xfer_operations_completed_total{kind=\"write\"}"),
        Some(&4.0)
    );
    // Anything but /metrics is 404; a closed engine stops serving.
    let other = format!("http://{}/other", a.metrics_address().unwrap());
    assert!(matches!(
        ureq::get(&other).call(),
        Err(ureq::Error::StatusCode(404))
    ));
    a.shutdown();
    assert!(ureq::get(&url).call().is_err());
}
