//! Cost per peer (issue 29): one engine reaches 1,024 peer engines on the mock with the
//! default options and deadlines. Every write lands, every peer counts its immediate once,
//! and the engine reports each peer, healthy. (`peers-bench` measures the time it takes and
//! the memory each connected peer holds.)

mod common;

use std::sync::Arc;
use std::time::Duration;

use engine_core::{DoneCounter, DoneFlag, HostBuffer, TransferEngine};

const PEERS: usize = 1024;
const WAIT: Duration = Duration::from_secs(60);

#[test]
fn one_engine_writes_to_1024_peers_with_the_default_options() {
    let config = common::mock_config(1, "");
    let a = Arc::new(TransferEngine::open(&config).unwrap());
    let src = HostBuffer::from_fn(&a, 64, |i| i as u8 ^ 0x5a).unwrap();
    let peers: Vec<_> = (0..PEERS)
        .map(|_| {
            let engine = Arc::new(TransferEngine::open(&config).unwrap());
            let dst = HostBuffer::new(&engine, 64).unwrap();
            let arrived = DoneFlag::new();
            engine.expect_imm_count(7, 1, arrived.clone()).unwrap();
            (engine, dst, arrived)
        })
        .collect();
    let sent = DoneCounter::new();
    for (_, dst, _) in &peers {
        a.submit_single_write(64, Some(7), (src.mr(), 0), (dst.desc(), 0), sent.clone())
            .unwrap();
    }
    sent.wait_for(PEERS as u64, WAIT).unwrap();
    for (i, (engine, dst, arrived)) in peers.iter().enumerate() {
        arrived.wait(WAIT).unwrap();
        assert_eq!(dst.to_vec(), src.to_vec(), "peer {i}'s bytes");
        assert_eq!(engine.imm_owed(7), 0, "peer {i} counted its immediate once");
    }
    let seen = a.peers().unwrap();
    assert_eq!(seen.len(), PEERS, "one entry per peer NIC");
    assert!(seen.iter().all(|(_, p)| p.healthy && p.failed == 0));
}
