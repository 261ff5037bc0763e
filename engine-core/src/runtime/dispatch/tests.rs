//! The dispatch core's rules, one scenario each, on a virtual clock with NIC answers chosen
//! per request.

use super::*;
use crate::domain::DomainErrorKind;

impl Waiter for u32 {}

/// One request as a NIC saw it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
struct Req {
    nic: usize,
    wr_id: u64,
    peer: u8,
    local: u64,
}

/// What a NIC does with one request.
enum Verdict {
    Take,
    Busy,
    Fail(DomainErrorKind),
}

/// What a round of posting handed the NICs.
#[derive(Default, Debug)]
struct Round {
    /// Requests taken, in the order posted.
    posted: Vec<Req>,
    /// Each post: its kind and how many requests it offered.
    calls: Vec<(&'static str, usize)>,
}

fn peer(p: u8) -> NetAddr {
    NetAddr::new(&[p; 4]).unwrap()
}

fn flatten(post: &Post<'_>) -> (&'static str, Vec<Req>) {
    let req = |nic, r: &RdmaRequest<'_>| Req {
        nic,
        wr_id: r.wr_id,
        peer: r.peer.raw()[0],
        local: r.local_addr,
    };
    match post {
        Post::Rdma { nic, rdma } => {
            let kind = match rdma {
                RdmaPost::List(_) => "list",
                RdmaPost::Pages { .. } => "pages",
                RdmaPost::One(_) => "one",
                _ => unreachable!("the core makes lists, batches of pages and single posts"),
            };
            (kind, rdma.requests().map(|r| req(*nic, &r)).collect())
        }
        Post::Send {
            nic, wr_id, peer, ..
        } => (
            "send",
            vec![Req {
                nic: *nic,
                wr_id: *wr_id,
                peer: peer.raw()[0],
                local: 0,
            }],
        ),
    }
}

/// Carries out every post the core hands out, as a Domain would: requests in order until
/// the first one it does not take.
fn drive(core: &mut Dispatch<u32>, mut verdict: impl FnMut(&Req) -> Verdict) -> Round {
    let mut round = Round::default();
    loop {
        let answer = {
            let mut list = PostList::new();
            let Some(post) = core.poll_post(&mut list) else {
                break;
            };
            let (kind, reqs) = flatten(&post);
            round.calls.push((kind, reqs.len()));
            let mut answer = (reqs.len(), Ok(PostStatus::Posted));
            for (i, r) in reqs.iter().enumerate() {
                match verdict(r) {
                    Verdict::Take => round.posted.push(*r),
                    Verdict::Busy => {
                        answer = (i, Ok(PostStatus::Busy));
                        break;
                    }
                    Verdict::Fail(kind) => {
                        answer = (i, Err(DomainError::new(kind, "refused")));
                        break;
                    }
                }
            }
            answer
        };
        core.handle_posted(answer);
    }
    round
}

fn take_all(_: &Req) -> Verdict {
    Verdict::Take
}

fn core(nics: usize) -> Dispatch<u32> {
    Dispatch::new(
        "test".into(),
        vec![Capabilities::default(); nics],
        Duration::from_secs(1),
        Anchor::now(),
    )
}

fn ms(ms: u64) -> Stamp {
    Stamp::from_nanos(ms * 1_000_000)
}

fn write(nic: usize, to: u8, local: u64) -> RdmaWork {
    RdmaWork {
        op: RdmaOp::Write { imm: Some(7) },
        nic,
        peer: peer(to),
        local_addr: local,
        local_key: 1,
        remote_addr: local,
        remote_key: 2,
        remote_base: 0,
        len: 64,
    }
}

fn submit(core: &mut Dispatch<u32>, now: Stamp, waiter: u32, ops: &[RdmaWork]) -> u64 {
    core.handle_rdma(now, ops.iter().cloned().collect(), waiter, now)
        .expect("accepted")
}

fn deliveries(core: &mut Dispatch<u32>, now: Stamp) -> Vec<(u32, Result<(), Error>)> {
    core.poll_deliveries(now)
        .map(|(w, r)| (w, r.map_err(|e| *e)))
        .collect()
}

fn done(wr_id: u64, result: Result<(), DomainErrorKind>) -> Event {
    Event::Done {
        wr_id,
        result: result.map_err(|kind| DomainError::new(kind, "failed")),
    }
}

#[test]
fn a_busy_peer_holds_up_only_its_own_work_and_keeps_its_order() {
    let mut core = core(1);
    let t = ms(0);
    // P1 Q1 P2 Q2, all on NIC 0; the NIC has no room for peer 1.
    let ids: Vec<u64> = [(1, 0), (2, 1), (1, 2), (2, 3)]
        .iter()
        .map(|&(to, n)| submit(&mut core, t, n, &[write(0, to, n as u64)]))
        .collect();
    let round = drive(&mut core, |r| match r.peer {
        1 => Verdict::Busy,
        _ => Verdict::Take,
    });
    let posted: Vec<u64> = round.posted.iter().map(|r| r.wr_id).collect();
    assert_eq!(posted, [ids[1], ids[3]], "peer 2's work went on");
    assert!(core.has_queued());
    // Retried once per round, never in a loop, while the peer stays busy.
    core.retry_queued();
    let round = drive(&mut core, |r| match r.peer {
        1 => Verdict::Busy,
        _ => Verdict::Take,
    });
    assert_eq!(round.calls, [("one", 1)], "one offer per queue and round");
    assert!(!core.take_progress());
    // Room again: peer 1's work goes in submission order.
    core.retry_queued();
    let round = drive(&mut core, take_all);
    let posted: Vec<u64> = round.posted.iter().map(|r| r.wr_id).collect();
    assert_eq!(posted, [ids[0], ids[2]]);
    assert!(core.take_progress() && !core.has_queued());
}

#[test]
fn work_for_a_queued_peer_waits_behind_it_even_when_the_nic_has_room() {
    let mut core = core(1);
    let first = submit(&mut core, ms(0), 0, &[write(0, 1, 0)]);
    drive(&mut core, |_| Verdict::Busy);
    // The NIC has room now, but the first request waits: the second must not overtake it.
    let second = submit(&mut core, ms(0), 1, &[write(0, 1, 64)]);
    let round = drive(&mut core, take_all);
    assert!(round.posted.is_empty(), "{round:?}");
    core.retry_queued();
    let round = drive(&mut core, take_all);
    let posted: Vec<u64> = round.posted.iter().map(|r| r.wr_id).collect();
    assert_eq!(posted, [first, second]);
}

#[test]
fn the_root_cause_wins_over_the_flushes_it_caused() {
    use DomainErrorKind::{PeerUnreachable, RemoteAccess};
    for order in [
        [PeerUnreachable, RemoteAccess],
        [RemoteAccess, PeerUnreachable],
    ] {
        let mut core = core(2);
        let id = submit(&mut core, ms(0), 9, &[write(0, 1, 0), write(1, 1, 64)]);
        drive(&mut core, take_all);
        core.handle_events(&mut vec![done(id, Err(order[0]))]);
        assert_eq!(core.finished(), 0, "one request is still out");
        core.handle_events(&mut vec![done(id, Err(order[1]))]);
        let got = deliveries(&mut core, ms(1));
        assert!(
            matches!(got[..], [(9, Err(Error::RemoteAccess(_)))]),
            "{order:?}: {got:?}"
        );
    }
}

#[test]
fn a_refused_post_fails_its_transfer_and_the_list_goes_on_after_it() {
    let mut core = core(1);
    let bad = submit(&mut core, ms(0), 1, &[write(0, 1, 0)]);
    let good = submit(&mut core, ms(0), 2, &[write(0, 1, 64)]);
    let round = drive(&mut core, |r| match r.wr_id == bad {
        true => Verdict::Fail(DomainErrorKind::InvalidArgument),
        false => Verdict::Take,
    });
    assert_eq!(round.calls, [("list", 2), ("list", 1)]);
    assert_eq!(
        round.posted.iter().map(|r| r.wr_id).collect::<Vec<_>>(),
        [good]
    );
    let got = deliveries(&mut core, ms(0));
    assert!(
        matches!(got[..], [(1, Err(Error::Refused { .. }))]),
        "{got:?}"
    );
}

#[test]
fn deadlines_expire_on_the_clock_passed_in_and_late_completions_are_stale() {
    let mut core = core(1);
    let late = submit(&mut core, ms(5), 1, &[write(0, 1, 0)]);
    drive(&mut core, take_all);
    // Queued behind a busy NIC: dropped once its transfer timed out, never posted.
    let queued = submit(&mut core, ms(10), 2, &[write(0, 2, 64)]);
    drive(&mut core, |_| Verdict::Busy);
    assert_eq!(core.poll_timeout(), Some(ms(1005)));
    core.handle_timeout(ms(1004));
    assert_eq!(core.finished(), 0, "not a moment early");
    core.handle_timeout(ms(1005));
    let got = deliveries(&mut core, ms(1005));
    assert!(matches!(got[..], [(1, Err(Error::Timeout(_)))]), "{got:?}");
    assert_eq!(core.poll_timeout(), Some(ms(1010)));
    core.handle_timeout(ms(1010));
    let got = deliveries(&mut core, ms(1010));
    assert!(matches!(got[..], [(2, Err(Error::Timeout(_)))]), "{got:?}");
    assert_eq!(core.poll_timeout(), None);
    // The late completion finishes nothing, and the queued request is dropped unposted.
    core.handle_events(&mut vec![done(late, Ok(()))]);
    assert_eq!(core.finished(), 0);
    assert_eq!(core.stats(ms(1010)).stale_completions, 1);
    core.retry_queued();
    let round = drive(&mut core, take_all);
    assert!(round.posted.is_empty() && !core.has_queued(), "{round:?}");
    assert!(core.take_progress());
    let _ = queued;
}

#[test]
fn a_cancelled_transfer_drops_its_queued_requests_and_ends_once_its_posted_ones_are_in() {
    let mut core = core(1);
    // Three requests to peer 1; the NIC takes one.
    let id = submit(
        &mut core,
        ms(0),
        1,
        &[write(0, 1, 0), write(0, 1, 64), write(0, 1, 128)],
    );
    let mut taken = 0;
    let round = drive(&mut core, |_| {
        taken += 1;
        if taken == 1 {
            Verdict::Take
        } else {
            Verdict::Busy
        }
    });
    assert_eq!(round.posted.len(), 1);
    core.cancel(id);
    assert!(!core.has_queued(), "the queued requests are dropped");
    assert_eq!(core.finished(), 0, "the posted one is still on the NIC");
    core.handle_events(&mut vec![done(id, Ok(()))]);
    let got = deliveries(&mut core, ms(1));
    assert_eq!(got, [(1, Err(Error::Cancelled))]);
    // Cancelling again, or a finished transfer, does nothing.
    core.cancel(id);
    assert_eq!(core.finished(), 0);
}

#[test]
fn a_transfer_cancelled_before_it_was_posted_never_reaches_a_nic() {
    let mut core = core(1);
    let id = submit(&mut core, ms(0), 1, &[write(0, 1, 0), write(0, 1, 64)]);
    core.cancel(id);
    let round = drive(&mut core, take_all);
    assert!(round.posted.is_empty(), "{round:?}");
    assert_eq!(deliveries(&mut core, ms(0)), [(1, Err(Error::Cancelled))]);
}

#[test]
fn a_failure_outranks_the_cancel() {
    let mut core = core(1);
    let id = submit(&mut core, ms(0), 1, &[write(0, 1, 0)]);
    drive(&mut core, take_all);
    core.cancel(id);
    core.handle_events(&mut vec![done(id, Err(DomainErrorKind::RemoteAccess))]);
    let got = deliveries(&mut core, ms(0));
    assert!(
        matches!(got[..], [(1, Err(Error::RemoteAccess(_)))]),
        "{got:?}"
    );
}

#[test]
fn every_transfer_finishes_exactly_once_whatever_a_backend_reports_twice() {
    let mut core = core(1);
    let a = submit(&mut core, ms(0), 1, &[write(0, 1, 0), write(0, 1, 64)]);
    let b = submit(&mut core, ms(0), 2, &[write(0, 1, 128)]);
    drive(&mut core, take_all);
    // A's first request reported twice: that must not finish A early.
    core.handle_events(&mut vec![done(a, Ok(())), done(b, Ok(()))]);
    core.handle_events(&mut vec![done(b, Ok(()))]);
    assert_eq!(deliveries(&mut core, ms(0)), [(2, Ok(()))]);
    core.handle_events(&mut vec![done(a, Ok(())), done(a, Ok(()))]);
    assert_eq!(deliveries(&mut core, ms(0)), [(1, Ok(()))]);
    assert_eq!(core.stats(ms(0)).stale_completions, 2);
    assert_eq!(core.in_flight(), 0);
}

#[test]
fn a_paged_request_goes_in_batches_and_a_refused_page_fails_only_itself() {
    let mut core = core(1);
    let work = PagedWork {
        plans: vec![std::iter::once(write(0, 1, 0)).collect()],
        offsets: (0..10).map(|i| Shift::new(i * 64, i * 64)).collect(),
    };
    let id = core.handle_pages(ms(0), Box::new(work), 1, ms(0)).unwrap();
    assert!(core.has_urgent_posts());
    let round = drive(&mut core, |r| match r.local {
        192 => Verdict::Fail(DomainErrorKind::RemoteAccess),
        _ => Verdict::Take,
    });
    // One batch of ten; the refused page (the fourth) ends that call, the rest follow it.
    assert_eq!(round.calls, [("pages", 10), ("pages", 6)]);
    let locals: Vec<u64> = round.posted.iter().map(|r| r.local).collect();
    assert_eq!(locals, [0, 64, 128, 256, 320, 384, 448, 512, 576]);
    let mut events: Vec<Event> = (0..9).map(|_| done(id, Ok(()))).collect();
    core.handle_events(&mut events);
    let got = deliveries(&mut core, ms(0));
    assert!(
        matches!(got[..], [(1, Err(Error::RemoteAccess(_)))]),
        "{got:?}"
    );
}

#[test]
fn a_burst_goes_in_lists_of_up_to_32_and_before_the_next_kind_of_submission() {
    let mut core = core(1);
    for i in 0..31 {
        submit(&mut core, ms(0), i, &[write(0, 1, 64 * i as u64)]);
        assert!(!core.has_urgent_posts(), "a list is not full yet");
    }
    submit(&mut core, ms(0), 31, &[write(0, 1, 64 * 31)]);
    assert!(core.has_urgent_posts(), "a list's worth");
    for i in 32..35 {
        submit(&mut core, ms(0), i, &[write(0, 1, 64 * i as u64)]);
    }
    let send = core
        .handle_send(ms(0), peer(1), vec![0, 1, 2], 99, ms(0))
        .unwrap();
    let round = drive(&mut core, take_all);
    assert_eq!(round.calls, [("list", 32), ("list", 3), ("send", 1)]);
    let locals: Vec<u64> = round.posted.iter().take(35).map(|r| r.local).collect();
    assert_eq!(locals, (0..35).map(|i| 64 * i).collect::<Vec<u64>>());
    assert_eq!(round.posted[35].wr_id, send);
    // Completions of one run are counted at once; arrivals of one immediate from one
    // sender in a row form one run.
    let from = Some(peer(5));
    let arrivals = |imm| Event::ImmArrival {
        imm,
        from: from.clone(),
    };
    core.handle_events(&mut vec![
        arrivals(3),
        arrivals(3),
        arrivals(4),
        arrivals(3),
    ]);
    let runs: Vec<_> = core.poll_arrivals().collect();
    assert_eq!(
        runs,
        [(3, from.clone(), 2), (4, from.clone(), 1), (3, from, 1)]
    );
    assert_eq!(core.stats(ms(0)).imm_arrivals, 4);
}

#[test]
fn after_a_fatal_answer_nothing_more_is_handed_out() {
    let mut core = core(1);
    let first = submit(&mut core, ms(0), 1, &[write(0, 1, 0)]);
    submit(&mut core, ms(0), 2, &[write(0, 2, 64)]);
    let round = drive(&mut core, |r| match r.wr_id == first {
        true => Verdict::Fail(DomainErrorKind::Fatal),
        false => Verdict::Take,
    });
    assert!(round.posted.is_empty(), "{round:?}");
    assert!(core.fatal().is_some() && core.has_queued());
    core.retry_queued();
    assert!(drive(&mut core, take_all).posted.is_empty());
    core.fail_everything(&Error::WorkerFailed("fatal".into()));
    let got = deliveries(&mut core, ms(0));
    assert!(
        matches!(
            got[..],
            [
                (1, Err(Error::Backend { .. })),
                (2, Err(Error::WorkerFailed(_)))
            ]
        ),
        "{got:?}"
    );
    assert_eq!(core.in_flight(), 0);
}

#[test]
fn capabilities_refuse_a_transfer_whole_before_anything_is_posted() {
    let mut core = Dispatch::<u32>::new(
        "test".into(),
        vec![Capabilities {
            max_write_size: Some(100),
            ..Capabilities::default()
        }],
        Duration::from_secs(1),
        Anchor::now(),
    );
    let mut big = write(0, 1, 0);
    big.len = 101;
    let ops = [write(0, 1, 0), big].into_iter().collect();
    let refused = core.handle_rdma(ms(0), ops, 1, ms(0));
    assert_eq!(refused, None);
    assert!(drive(&mut core, take_all).posted.is_empty());
    let got = deliveries(&mut core, ms(0));
    assert!(
        matches!(&got[..], [(1, Err(Error::Refused { backend, source }))]
            if backend == "test" && source.kind == DomainErrorKind::InvalidArgument && source.message.contains("limit of 100")),
        "{got:?}"
    );
}

/// `messages` arrive, sent by `peer(5)` as the transport tells.
fn arrive(core: &mut Dispatch<u32>, messages: &[Vec<u8>]) {
    let mut events = messages
        .iter()
        .map(|data| Event::Message {
            data: data.clone(),
            from: Some(peer(5)),
        })
        .collect();
    core.handle_events(&mut events);
}

/// Messages are routed in arrival order: a user's within the receive buffers to the handler
/// (which gives its buffer back itself), a notification to the inbox, each with the sender the
/// transport named (not the notification's claim); those and whatever is dropped give their
/// buffers back at once, counted for the worker.
#[test]
fn messages_are_routed_in_order_and_buffers_not_handed_on_are_given_back() {
    let mut core = core(1);
    let user = crate::wire::encode_user_message(b"hello");
    let too_large = crate::wire::encode_user_message(&[0; 9]);
    let note = crate::wire::encode_notification(&peer(3), b"done-7");
    let foreign = vec![0xee, 1, 2];
    arrive(
        &mut core,
        &[user.clone(), too_large, note, foreign, Vec::new()],
    );
    assert!(core.has_messages());
    let routed: Vec<Routed> = core.poll_messages(Some(8)).collect();
    assert_eq!(
        routed,
        [
            Routed::User {
                data: user,
                sender: Some(peer(5))
            },
            Routed::Dropped(Unrouted::TooLarge { len: 9, max: 8 }),
            Routed::Notification(Notification {
                id: b"done-7".to_vec(),
                from: peer(3),
                sender: Some(peer(5)),
            }),
            Routed::Dropped(Unrouted::Malformed(MessageError::UnknownChannel(0xee))),
            Routed::Dropped(Unrouted::Malformed(MessageError::Empty)),
        ]
    );
    assert!(!core.has_messages());
    assert_eq!(core.take_reposts(), 4, "all but the handler's");
    assert_eq!(core.take_reposts(), 0, "taken once");
}

/// With no receive handler set nothing is routed anywhere and no buffer is owed: none was
/// posted.
#[test]
fn messages_without_a_receive_handler_are_dropped_and_owe_no_buffer() {
    let mut core = core(1);
    let note = crate::wire::encode_notification(&peer(3), b"n");
    arrive(&mut core, &[crate::wire::encode_user_message(b"x"), note]);
    let routed: Vec<Routed> = core.poll_messages(None).collect();
    assert_eq!(
        routed,
        [
            Routed::Dropped(Unrouted::NoHandler),
            Routed::Dropped(Unrouted::NoHandler)
        ]
    );
    assert_eq!(core.take_reposts(), 0);
}

fn region(device: crate::domain::Device) -> crate::domain::MemoryRegion {
    crate::domain::MemoryRegion {
        ptr: 4096,
        len: 4096,
        device,
        remote_write: true,
        remote_read: false,
    }
}

/// A registration every NIC cannot take is refused before any NIC is asked, naming the
/// memory and the first NIC that rules it out.
#[test]
fn registrations_are_checked_against_every_nics_memory_kinds() {
    use crate::domain::Device;
    let host_only = Capabilities {
        cuda_memory: false,
        dmabuf: false,
        ..Capabilities::default()
    };
    let no_host = Capabilities {
        host_memory: false,
        ..Capabilities::default()
    };
    let dmabuf_only = Capabilities {
        cuda_memory: false,
        dmabuf: true,
        ..Capabilities::default()
    };
    let core = |caps: Vec<Capabilities>| -> Dispatch<u32> {
        Dispatch::new("test".into(), caps, Duration::from_secs(1), Anchor::now())
    };
    let mixed = core(vec![Capabilities::default(), host_only]);
    assert!(mixed.check_registration(&region(Device::Host)).is_ok());
    let refused = mixed
        .check_registration(&region(Device::Cuda(3)))
        .unwrap_err()
        .to_string();
    assert!(
        refused.contains("GPU 3") && refused.contains("NIC 1"),
        "{refused}"
    );
    assert!(core(vec![dmabuf_only])
        .check_registration(&region(Device::Cuda(0)))
        .is_ok());
    let refused = core(vec![Capabilities::default(), no_host])
        .check_registration(&region(Device::Host))
        .unwrap_err();
    assert!(
        matches!(&refused, Error::Refused { backend, source }
            if backend == "test" && source.message.contains("host memory")),
        "{refused}"
    );
}

/// Registrations are counted from what the worker reports: bytes and time of those that
/// succeeded, failures, deregistrations.
#[test]
fn registrations_are_counted_as_reported() {
    let mut core = core(1);
    core.handle_registered(Some((4096, 7)));
    core.handle_registered(Some((100, 3)));
    core.handle_registered(None);
    core.handle_deregistered();
    let r = core.stats(ms(0)).registrations;
    assert_eq!(
        (r.registered, r.bytes, r.time_us, r.failed, r.deregistered),
        (2, 4196, 10, 1, 1)
    );
}

/// Statistics of a burst counted per run of one shape show in a snapshot taken in the
/// middle of a pass (accepted, not yet delivered) and after it, exactly.
#[test]
fn a_snapshot_mid_pass_counts_what_the_pass_accepted_and_delivered() {
    let mut core = core(2);
    let ids: Vec<u64> = (0..3)
        .map(|n| submit(&mut core, ms(1), n, &[write(0, 1, 64 * n as u64)]))
        .collect();
    let send = core
        .handle_send(ms(2), peer(2), vec![0, 1, 2], 9, ms(2))
        .unwrap();
    let mid = core.stats(ms(2));
    let w = mid.op(OpKind::Write);
    assert_eq!((w.started, w.requests, w.completed), (3, 3, 0));
    assert_eq!((mid.nics[0].requests, mid.nics[0].bytes), (4, 3 * 64 + 3));
    assert_eq!(mid.peers[&peer(1)].bytes, 3 * 64);
    assert_eq!(mid.op(OpKind::Send).started, 1);
    drive(&mut core, take_all);
    let mut events: Vec<Event> = ids.iter().map(|&id| done(id, Ok(()))).collect();
    events.push(done(send, Ok(())));
    core.handle_events(&mut events);
    assert_eq!(deliveries(&mut core, ms(3)).len(), 4);
    // Another shape (a write on NIC 1), counted beside the open runs.
    submit(&mut core, ms(4), 5, &[write(1, 1, 0)]);
    let after = core.stats(ms(4));
    let w = after.op(OpKind::Write);
    assert_eq!((w.started, w.completed, w.bytes), (4, 3, 3 * 64));
    assert_eq!((w.latency.count(), w.latency.sum_us), (3, 3 * 2_000));
    assert_eq!(after.op(OpKind::Send).completed, 1);
    assert_eq!(
        (after.nics[1].requests, after.peers[&peer(1)].requests),
        (1, 4)
    );
    assert_eq!(after.peers[&peer(2)].ms_since_activity, Some(1));
}
