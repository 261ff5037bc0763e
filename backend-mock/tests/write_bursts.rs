//! Bursts of single writes: the worker hands the writes it accepted in one pass to each NIC
//! as lists (`Domain::post_rdma` of `RdmaPost::List`). Whatever cuts a list short — a queue too
//! small for it, a peer that died, our own NIC dropped — every write is posted or failed
//! exactly once, lands where it should, and its immediate is counted once.

mod common;

use std::sync::Arc;
use std::time::{Duration, Instant};

use engine_core::{DoneCounter, DoneFlag, Error, HostBuffer, TransferEngine};

const WAIT: Duration = Duration::from_secs(20);
const LEN: u64 = 24;
/// A multiple of 16: each peer gets half, in turns of 8.
const WRITES: u64 = 640;

fn engine(extra: &str) -> Arc<TransferEngine> {
    let config = common::mock_config(
        1,
        &format!("[backends.mock]\ninline = true\nreorder = false\njitter_us = 0\n{extra}"),
    );
    Arc::new(TransferEngine::open(&config).unwrap())
}

fn wait_for_imms(engine: &TransferEngine, imm: u32, n: u64) {
    let deadline = Instant::now() + WAIT;
    while engine.imm_count(imm) < n {
        assert!(Instant::now() < deadline, "immediates {imm} missing");
        std::thread::yield_now();
    }
    assert_eq!(
        engine.imm_count(imm),
        n,
        "immediate {imm} counted once per write"
    );
}

/// Writes to two peers in turns of 8 (runs a list lands together), each peer's at falling
/// offsets (a run's later writes lie below its first), through queues of 2: lists are cut short, the rest waits per
/// peer and follows in order. Every write lands once, with its immediate.
#[test]
fn a_burst_to_two_peers_through_small_queues_lands_every_write_once() {
    let a = engine("queue_depth = 2\n");
    let peers = [engine(""), engine("")];
    let len = (WRITES * LEN) as usize;
    let src = HostBuffer::from_fn(&a, len, |i| (i * 13 + 1) as u8).unwrap();
    let dst = peers.each_ref().map(|p| HostBuffer::new(p, len).unwrap());
    let done = DoneCounter::new();
    for i in 0..WRITES {
        let to = (i / 8 % 2) as usize;
        let slot = WRITES - 1 - i;
        a.submit_single_write(
            LEN,
            Some(10 + to as u32),
            (src.mr(), i * LEN),
            (dst[to].desc(), slot * LEN),
            done.clone(),
        )
        .unwrap();
    }
    done.wait_for(WRITES, WAIT).unwrap();
    let (from, to) = (src.to_vec(), dst.each_ref().map(|d| d.to_vec()));
    for i in 0..WRITES {
        let (peer, slot) = ((i / 8 % 2) as usize, (WRITES - 1 - i) as usize);
        let l = LEN as usize;
        assert_eq!(
            &to[peer][slot * l..(slot + 1) * l],
            &from[i as usize * l..(i as usize + 1) * l],
            "write {i} landed"
        );
    }
    for (to, peer) in peers.iter().enumerate() {
        wait_for_imms(peer, 10 + to as u32, WRITES / 2);
    }
    assert_eq!(
        a.stats().unwrap().stale_completions,
        0,
        "no write completed twice"
    );
}

/// One peer of two died: in a burst to both, its writes fail (typed, naming the dead peer)
/// and the other's land, counted once; nothing hangs.
#[test]
fn a_burst_with_a_dead_peer_fails_its_writes_and_lands_the_others() {
    let a = engine("");
    let (alive, dead) = (engine(""), engine(""));
    let src = HostBuffer::from_fn(&a, (WRITES * LEN) as usize, |i| i as u8).unwrap();
    let (to_alive, to_dead) = (
        HostBuffer::new(&alive, (WRITES * LEN) as usize).unwrap(),
        HostBuffer::new(&dead, (WRITES * LEN) as usize).unwrap(),
    );
    let dead_desc = to_dead.desc().clone();
    assert!(backend_mock::kill(&dead.main_address()));
    // Turns of 8 writes per peer: runs of a list go to one peer, then the other.
    let to_dead_peer = |i: u64| i / 8 % 2 == 1;
    let (landed, mut failed) = (DoneCounter::new(), Vec::new());
    for i in 0..WRITES {
        let at = i * LEN;
        if to_dead_peer(i) {
            let flag = DoneFlag::new();
            a.submit_single_write(LEN, Some(3), (src.mr(), at), (&dead_desc, at), flag.clone())
                .unwrap();
            failed.push(flag);
        } else {
            a.submit_single_write(
                LEN,
                Some(3),
                (src.mr(), at),
                (to_alive.desc(), at),
                landed.clone(),
            )
            .unwrap();
        }
    }
    landed.wait_for(WRITES / 2, WAIT).unwrap();
    for flag in &failed {
        match flag.wait(WAIT) {
            Err(Error::PeerUnreachable(why)) => assert!(why.message.contains("mock"), "{why}"),
            other => panic!("expected the dead peer to be unreachable, got {other:?}"),
        }
    }
    wait_for_imms(&alive, 3, WRITES / 2);
    let (from, to) = (src.to_vec(), to_alive.to_vec());
    for i in (0..WRITES).filter(|&i| !to_dead_peer(i)) {
        let at = (i * LEN) as usize..((i + 1) * LEN) as usize;
        assert_eq!(&to[at.clone()], &from[at], "write {i} landed");
    }
}

/// Our own NIC was dropped from the fabric: every write of a burst is refused at its post
/// (the list stops at its first request each time, and the worker goes on past it), each
/// transfer fails once with a typed error.
#[test]
fn a_burst_on_a_dropped_nic_fails_every_write_once() {
    let a = engine("");
    let b = engine("");
    let src = HostBuffer::new(&a, (WRITES * LEN) as usize).unwrap();
    let dst = HostBuffer::new(&b, (WRITES * LEN) as usize).unwrap();
    assert!(backend_mock::kill(&a.main_address()));
    let flags: Vec<_> = (0..WRITES).map(|_| DoneFlag::new()).collect();
    for (i, flag) in flags.iter().enumerate() {
        let at = i as u64 * LEN;
        a.submit_single_write(LEN, None, (src.mr(), at), (dst.desc(), at), flag.clone())
            .unwrap();
    }
    for flag in &flags {
        let outcome = flag.wait(WAIT);
        assert!(
            matches!(&outcome, Err(e) if e.to_string().contains("dropped from the fabric")),
            "{outcome:?}"
        );
    }
    assert_eq!(a.stats().unwrap().stale_completions, 0);
}
