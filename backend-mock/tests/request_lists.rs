//! `Domain::post_rdma` of a list on the inline mock (a burst of single writes and reads as
//! one Domain call) against the same requests posted one by one (`post_one_by_one`): random lists
//! to two peers — writes with and without immediates, reads, requests below the run's first
//! (wrapping offsets), ranges outside their regions, revoked remote keys, queues too small for
//! a run — must give the same completions in the same order, the same immediates at each
//! peer and the same bytes in every buffer. A list may stop early with `Busy` (its run did
//! not fit the queue, which one-by-one posting on an inline mock never sees); the driver then
//! posts the rest, as the engine's worker does.

use proptest::prelude::*;
use xfer_plugin::addr::NetAddr;
use xfer_plugin::domain::{
    post_one_by_one, Device, Domain, DomainConfig, DomainError, DomainErrorKind, Event,
    MemoryRegion, PostStatus, RdmaOp, RdmaPost, RdmaRequest,
};

use backend_mock::MockDomain;

const REGION: u64 = 256;

/// One request, abstractly: which peer, what, where (offsets may fall outside).
#[derive(Debug, Clone)]
struct Req {
    peer: usize,
    op: RdmaOp,
    local: u64,
    remote: u64,
    len: u64,
    revoked: bool,
}

fn req() -> impl Strategy<Value = Req> {
    let op = prop_oneof![
        Just(RdmaOp::Write { imm: None }),
        (0u32..4).prop_map(|i| RdmaOp::Write { imm: Some(i) }),
        Just(RdmaOp::Read),
    ];
    (
        0usize..2,
        op,
        0u64..REGION + 16,
        0u64..REGION + 16,
        prop_oneof![Just(8u64), Just(16), Just(24)],
        prop::bool::weighted(0.05),
    )
        .prop_map(|(peer, op, local, remote, len, revoked)| Req {
            peer,
            op,
            local,
            remote,
            len,
            revoked,
        })
}

/// A NIC with a source region, and two peers with one target region each.
struct Setup {
    ours: MockDomain,
    peers: [MockDomain; 2],
    /// Our buffer and its local key.
    local: (Vec<u8>, u64),
    /// Each peer's buffer, remote key and address.
    remote: [(Vec<u8>, u64, NetAddr); 2],
}

fn region(buf: &[u8]) -> MemoryRegion {
    MemoryRegion {
        ptr: buf.as_ptr() as u64,
        len: buf.len() as u64,
        device: Device::Host,
        remote_write: true,
        remote_read: true,
    }
}

fn setup(queue_depth: usize) -> Setup {
    let options =
        format!("inline = true\nreorder = false\njitter_us = 0\nqueue_depth = {queue_depth}\n");
    let open = || {
        MockDomain::open(&DomainConfig {
            nic: "mock0",
            options: &options,
        })
        .unwrap()
    };
    let (mut ours, mut peers) = (open(), [open(), open()]);
    let local = vec![0u8; REGION as usize];
    let local = {
        let mut l = local;
        l.iter_mut().enumerate().for_each(|(i, b)| *b = i as u8);
        let key = ours.register(&region(&l)).unwrap().local_key;
        (l, key)
    };
    let remote = [0, 1].map(|p| {
        let buf: Vec<u8> = (0..REGION).map(|i| (i as u8) ^ (0x40 << p)).collect();
        let key = peers[p].register(&region(&buf)).unwrap().remote_key;
        (buf, key, peers[p].address())
    });
    Setup {
        ours,
        peers,
        local,
        remote,
    }
}

/// What one list gave: each request's post error (by index) and completion, in order, the
/// immediates each peer counted, and every buffer's bytes.
#[derive(Debug, PartialEq)]
struct Outcome {
    refused: Vec<(usize, DomainErrorKind)>,
    done: Vec<(u64, Option<DomainErrorKind>)>,
    imms: [Vec<u32>; 2],
    bytes: Vec<Vec<u8>>,
}

/// `Domain::post_rdma` of a list, or each request of it posted alone.
type PostList = fn(&mut MockDomain, &[RdmaRequest<'_>]) -> (usize, Result<PostStatus, DomainError>);

/// Posts `reqs` through `post` until every one is posted or refused, as the worker does:
/// past a refused request, and again after `Busy`.
fn drive(s: &mut Setup, reqs: &[Req], post: PostList) -> Outcome {
    let requests: Vec<RdmaRequest<'_>> = reqs
        .iter()
        .enumerate()
        .map(|(i, r)| {
            let (buf, key, addr) = &s.remote[r.peer];
            RdmaRequest {
                wr_id: i as u64,
                op: r.op,
                peer: addr,
                local_addr: s.local.0.as_ptr() as u64 + r.local,
                local_key: s.local.1,
                remote_addr: buf.as_ptr() as u64 + r.remote,
                remote_key: if r.revoked { 0xdead } else { *key },
                remote_base: buf.as_ptr() as u64,
                len: r.len,
            }
        })
        .collect();
    let mut refused = Vec::new();
    let mut next = 0;
    let mut rounds = 0;
    while next < requests.len() {
        rounds += 1;
        assert!(rounds < 10 * requests.len() + 10, "no progress");
        let (posted, status) = post(&mut s.ours, &requests[next..]);
        assert!(posted <= requests.len() - next);
        next += posted;
        match status {
            Ok(PostStatus::Posted) => assert_eq!(next, requests.len(), "all posted"),
            Ok(PostStatus::Busy) => {}
            Err(e) => {
                refused.push((next, e.kind));
                next += 1;
            }
        }
    }
    drop(requests);
    let mut events = Vec::new();
    s.ours.poll(&mut events).unwrap();
    let done = events
        .iter()
        .map(|e| match e {
            Event::Done { wr_id, result } => (*wr_id, result.as_ref().err().map(|e| e.kind)),
            other => panic!("unexpected {other:?}"),
        })
        .collect();
    let imms = [0, 1].map(|p| {
        let mut events = Vec::new();
        s.peers[p].poll(&mut events).unwrap();
        events
            .iter()
            .map(|e| match e {
                Event::ImmArrival { imm, .. } => *imm,
                other => panic!("unexpected {other:?}"),
            })
            .collect()
    });
    let bytes = std::iter::once(s.local.0.clone())
        .chain(s.remote.iter().map(|(b, ..)| b.clone()))
        .collect();
    Outcome {
        refused,
        done,
        imms,
        bytes,
    }
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 200, ..ProptestConfig::default() })]

    #[test]
    fn a_list_lands_as_its_requests_posted_one_by_one(
        reqs in prop::collection::vec(req(), 1..40),
        queue_depth in prop_oneof![Just(0usize), 1usize..5],
    ) {
        let listed = drive(&mut setup(queue_depth), &reqs, |d, r| d.post_rdma(RdmaPost::List(r)));
        let each = drive(&mut setup(queue_depth), &reqs, |d, r| {
            post_one_by_one(RdmaPost::List(r), |one| d.post_rdma(RdmaPost::One(*one)).1)
        });
        prop_assert_eq!(&listed, &each);
        // Every request completed exactly once, in order (none was refused at post time:
        // what a NIC checks per request arrives as a failed completion).
        let ids: Vec<u64> = listed.done.iter().map(|d| d.0).collect();
        prop_assert_eq!(ids, (0..reqs.len() as u64).collect::<Vec<_>>());
    }
}

/// The checks the property relies on can fail: a list whose middle request lies outside its
/// peer's region fails that request alone, and the rest land (here, explicitly).
#[test]
fn a_request_outside_its_region_inside_a_run_fails_alone() {
    let mut s = setup(0);
    let w = |remote| Req {
        peer: 0,
        op: RdmaOp::Write { imm: Some(1) },
        local: 0,
        remote,
        len: 8,
        revoked: false,
    };
    let reqs = [w(64), w(REGION), w(8)];
    let out = drive(&mut s, &reqs, |d, r| d.post_rdma(RdmaPost::List(r)));
    assert_eq!(
        out.done,
        [
            (0, None),
            (1, Some(DomainErrorKind::RemoteAccess)),
            (2, None)
        ]
    );
    assert_eq!(out.imms[0], [1, 1]);
    assert_eq!(&out.bytes[1][64..72], &out.bytes[0][0..8]);
    assert_eq!(&out.bytes[1][8..16], &out.bytes[0][0..8]);
}
