//! The plan against a byte-level simulation, over random layouts and routings (empty ranks,
//! `-1` slots, EPLB replicas, overflow past the private slots, exactly at and one row past
//! capacity): every rank plans its step, the headers are exchanged, the overflow and combine
//! writes computed; then every write is applied to simulated memory.
//!
//! Checked: no two writes to a rank overlap and all stay inside their region's set; each rank
//! expects exactly the writes posted to it (one A from every rank, a B from exactly the ranks
//! that post one); at most two writes per peer per phase; every routed slot lands exactly once,
//! at the expert the map names, in source-major order; combine brings every row back to the
//! slot that sent it; a step past capacity fails on every rank.

use proptest::prelude::*;
use std::cell::Cell;

use xfer_ep_plan::moves::write_combine_headers;
use xfer_ep_plan::plan::decode_combine_header;
use xfer_ep_plan::{
    membership_digest, CountMatrix, ExpertMap, Header, Layout, Phase, PlanError, Receive, SendPlan,
    Write,
};

const ROW: u64 = 16;

#[derive(Debug, Clone)]
struct Case {
    ranks: u32,
    experts_per_rank: u32,
    top_k: u32,
    max_tokens: u32,
    private_rows: u32,
    /// Overflow rows relative to what the routing needs (`needed + slack`, at least 0).
    slack: i64,
    /// Logical experts' replicas (EPLB), or `None` for the identity map.
    eplb: Option<Vec<Vec<i64>>>,
    /// Per rank: token count and `tokens × top_k` ids.
    routing: Vec<Vec<i64>>,
    epoch: u32,
}

fn case() -> impl Strategy<Value = Case> {
    (
        1u32..=5,
        1u32..=4,
        1u32..=8,
        0u32..=6,
        0u32..=12,
        -2i64..=2,
        any::<bool>(),
        0u32..4,
    )
        .prop_flat_map(
            |(ranks, epr, top_k, max_tokens, private, slack, eplb, epoch)| {
                let physical = (ranks * epr) as i64;
                let logical = if eplb {
                    (physical / 2).max(1)
                } else {
                    physical
                };
                let eplb_table = if eplb {
                    prop::collection::vec(
                        prop::collection::vec(prop_oneof![Just(-1i64), 0..physical], 1..=3),
                        logical as usize,
                    )
                    .prop_map(move |mut t| {
                        for (e, row) in t.iter_mut().enumerate() {
                            if row.iter().all(|&p| p < 0) {
                                row.push(e as i64 % physical);
                            }
                        }
                        Some(t)
                    })
                    .boxed()
                } else {
                    Just(None).boxed()
                };
                let slot = prop_oneof![1 => Just(-1i64), 4 => 0..logical];
                // Some ranks send nothing; the rest up to max_tokens.
                let rank_routing = (0..=max_tokens).prop_flat_map(move |n| {
                    prop::collection::vec(slot.clone(), (n * top_k) as usize)
                });
                (
                    eplb_table,
                    prop::collection::vec(rank_routing, ranks as usize),
                )
                    .prop_map(move |(eplb, routing)| Case {
                        ranks,
                        experts_per_rank: epr,
                        top_k,
                        max_tokens,
                        private_rows: private,
                        slack,
                        eplb,
                        routing,
                        epoch,
                    })
            },
        )
}

fn cells(bytes: &mut [u8]) -> &[Cell<u8>] {
    Cell::from_mut(bytes).as_slice_of_cells()
}

fn row(a: u32, b: u32, c: u32, d: u32) -> [u8; 16] {
    let mut out = [0u8; 16];
    for (i, w) in [a, b, c, d].into_iter().enumerate() {
        out[4 * i..4 * i + 4].copy_from_slice(&w.to_le_bytes());
    }
    out
}

fn read(buf: &[u8], at: u64) -> [u32; 4] {
    let at = at as usize;
    std::array::from_fn(|i| u32::from_le_bytes(buf[at + 4 * i..at + 4 * i + 4].try_into().unwrap()))
}

/// Applies `writes` (all to one rank's region of `set_bytes` per set) after checking they do
/// not overlap and stay in this step's set.
fn apply(region: &mut [u8], set: u32, set_bytes: u64, writes: &[(Write, Vec<u8>)]) {
    let mut spans: Vec<(u64, u64)> = writes
        .iter()
        .map(|(w, _)| (w.dst_offset, w.dst_offset + w.len))
        .collect();
    spans.sort_unstable();
    for s in &spans {
        assert!(
            s.0 >= u64::from(set) * set_bytes && s.1 <= u64::from(set + 1) * set_bytes,
            "write {s:?} outside set {set}"
        );
    }
    for p in spans.windows(2) {
        assert!(
            p[0].1 <= p[1].0,
            "overlapping writes {:?} and {:?}",
            p[0],
            p[1]
        );
    }
    for (w, data) in writes {
        region[w.dst_offset as usize..(w.dst_offset + w.len) as usize].copy_from_slice(data);
    }
}

fn check(c: Case) -> Result<(), TestCaseError> {
    let mut layout = Layout {
        ranks: c.ranks,
        experts_per_rank: c.experts_per_rank,
        top_k: c.top_k,
        max_tokens: c.max_tokens,
        row_bytes: ROW,
        // Combine rows differ from dispatch rows (as fp8 out, bf16 back).
        combine_row_bytes: ROW + 8,
        private_rows: c.private_rows,
        overflow_rows: 0,
    };
    let map = match &c.eplb {
        Some(t) => ExpertMap::eplb(&layout, t).unwrap(),
        None => ExpertMap::identity(&layout),
    };
    let active = vec![true; c.ranks as usize];
    let plan_all = |layout: &Layout| -> Vec<SendPlan> {
        (0..c.ranks)
            .map(|r| {
                SendPlan::new(
                    layout,
                    &map,
                    r,
                    c.epoch,
                    0xE,
                    &c.routing[r as usize],
                    &active,
                )
                .unwrap()
            })
            .collect()
    };
    // The overflow the routing needs at its busiest receiver; the layout gets that plus slack.
    let first = plan_all(&layout);
    let needed = (0..c.ranks)
        .map(|d| {
            first
                .iter()
                .map(|p| p.rows_to(d).saturating_sub(u64::from(c.private_rows)))
                .sum::<u64>()
        })
        .max()
        .unwrap_or(0);
    layout.overflow_rows = (needed as i64 + c.slack).max(0) as u32;
    let fits = u64::from(layout.overflow_rows) >= needed;
    let plans = plan_all(&layout);
    let set = c.epoch % 2;

    // Send buffers: each row says (source, token, slot, expert); each peer block starts with
    // the header.
    let mut send: Vec<Vec<u8>> =
        vec![vec![0; 2 * layout.send_buffer_bytes() as usize]; c.ranks as usize];
    for (r, p) in plans.iter().enumerate() {
        let h = p.header.encode(&layout);
        for peer in 0..c.ranks {
            let at = p.block_offset(peer) as usize;
            send[r][at..at + h.len()].copy_from_slice(&h);
        }
        for (i, sr) in p.rows.iter().enumerate() {
            let at = p.row_offset(i) as usize;
            send[r][at..at + 16].copy_from_slice(&row(r as u32, sr.token, sr.slot, sr.expert));
        }
        // `pack` lays out the same blocks from a token tensor: the header, then each row's
        // token.
        let tokens = c.routing[r].len() / c.top_k as usize;
        let x: Vec<u8> = (0..tokens as u32)
            .flat_map(|t| row(r as u32, t, 0, 0))
            .collect();
        let mut packed = vec![0u8; 2 * layout.send_buffer_bytes() as usize];
        p.pack(&layout, cells(&mut x.clone()), cells(&mut packed));
        for peer in 0..c.ranks {
            let at = p.block_offset(peer) as usize;
            prop_assert_eq!(&packed[at..at + h.len()], &h[..]);
        }
        for (i, sr) in p.rows.iter().enumerate() {
            prop_assert_eq!(read(&packed, p.row_offset(i)), [r as u32, sr.token, 0, 0]);
        }
        // Every routed slot is a row exactly once, at the expert the map names.
        let k = c.top_k as usize;
        for (i, &e) in c.routing[r].iter().enumerate() {
            let idx = p.slot_row[i];
            prop_assert_eq!(idx >= 0, e >= 0);
            if e >= 0 {
                let sr = p.rows[idx as usize];
                let phys = map.physical(e as usize, i / k, i % k, k);
                prop_assert_eq!(
                    (sr.peer, sr.expert),
                    (phys / c.experts_per_rank, phys % c.experts_per_rank)
                );
                prop_assert_eq!((sr.token as usize, sr.slot as usize), (i / k, i % k));
            }
        }
    }

    // Headers: every rank decodes every rank's, alike.
    let mut matrix = CountMatrix::new(&layout);
    for p in &plans {
        let h = Header::decode(&layout, c.epoch, p.rank, &p.header.encode(&layout)).unwrap();
        prop_assert_eq!(h.membership, membership_digest(&active));
        matrix.headers[p.rank as usize] = Some(h);
    }
    let everyone = vec![true; c.ranks as usize];
    let b: Vec<Result<Vec<Write>, PlanError>> = plans
        .iter()
        .map(|p| p.writes_b(&matrix, &everyone))
        .collect();
    if !fits {
        for r in &b {
            prop_assert!(
                matches!(r, Err(PlanError::Capacity { .. })),
                "past capacity every rank fails: {:?}",
                r
            );
        }
        return Ok(());
    }
    let b: Vec<Vec<Write>> = b.into_iter().map(Result::unwrap).collect();

    // Dispatch: apply every A and B write.
    let mut disp: Vec<Vec<u8>> =
        vec![vec![0xAA; 2 * layout.dispatch_region_bytes() as usize]; c.ranks as usize];
    let mut to: Vec<Vec<(Write, Vec<u8>)>> = vec![Vec::new(); c.ranks as usize];
    for (r, p) in plans.iter().enumerate() {
        let a = p.writes_a();
        prop_assert_eq!(a.len(), c.ranks as usize, "one A write to every rank");
        for w in a.iter().chain(&b[r]) {
            prop_assert!(w.src_offset + w.len <= 2 * layout.send_buffer_bytes());
            let data = send[r][w.src_offset as usize..(w.src_offset + w.len) as usize].to_vec();
            to[w.peer as usize].push((*w, data));
        }
        for peer in 0..c.ranks {
            prop_assert!(
                b[r].iter().filter(|w| w.peer == peer).count() <= 1,
                "at most 2 writes per peer per phase"
            );
        }
    }
    let mut receives = Vec::new();
    for d in 0..c.ranks {
        apply(
            &mut disp[d as usize],
            set,
            layout.dispatch_region_bytes(),
            &to[d as usize],
        );
        let recv = Receive::new(&layout, d, c.epoch, 0xE, &matrix, &everyone, &everyone);
        // Arrivals expected = writes posted: an A from every rank, a B from those that posted.
        let mut posted: Vec<(u32, Phase)> = to[d as usize]
            .iter()
            .map(|(w, _)| {
                (
                    plans
                        .iter()
                        .find(|p| {
                            w.src_offset < 2 * layout.send_buffer_bytes()
                                && p.writes_a().contains(w)
                                || b[p.rank as usize].contains(w)
                        })
                        .unwrap()
                        .rank,
                    w.phase,
                )
            })
            .collect();
        let mut expected: Vec<(u32, Phase)> = (0..c.ranks)
            .map(|s| (s, Phase::DispatchA))
            .chain(recv.expect_b.iter().map(|&s| (s, Phase::DispatchB)))
            .collect();
        posted.sort();
        expected.sort();
        prop_assert_eq!(posted, expected);
        // Every row here is the one its source sent, in source-major order, all of them.
        for rr in &recv.rows {
            let got = read(&disp[d as usize], rr.offset);
            let p = &plans[rr.source as usize];
            let sr = p.rows[p.peer_start[d as usize] + rr.index as usize];
            prop_assert_eq!(got, [rr.source, sr.token, sr.slot, sr.expert]);
            prop_assert_eq!(sr.expert, rr.expert);
        }
        prop_assert_eq!(
            recv.rows.len() as u64,
            plans.iter().map(|p| p.rows_to(d)).sum::<u64>()
        );
        prop_assert!(recv.rows.len() as u64 <= layout.receive_capacity());
        let order = recv.expert_order();
        for w in order.windows(2) {
            let (x, y) = (recv.rows[w[0]], recv.rows[w[1]]);
            prop_assert!((x.expert, x.source, x.index) < (y.expert, y.source, y.index));
        }
        // The runs cover every row once, expert-major, each at its place in both buffers.
        let mut covered = vec![0u64; layout.experts_per_rank as usize];
        let mut n = 0;
        for run in recv.runs() {
            prop_assert_eq!(run.position, covered[run.expert as usize]);
            covered[run.expert as usize] += run.rows;
            for j in 0..run.rows {
                let i = order[n];
                n += 1;
                prop_assert_eq!(recv.rows[i].expert, run.expert);
                prop_assert_eq!(recv.rows[i].offset, run.recv_offset + j * ROW);
                prop_assert_eq!(
                    recv.combine_send_row_offset(i),
                    run.combine_offset + j * layout.combine_row_bytes
                );
            }
        }
        prop_assert_eq!(n, recv.rows.len());
        prop_assert_eq!(&covered, &recv.expert_counts);
        receives.push(recv);
    }

    // Combine: each receiver answers every row with (receiver, token, slot, marker).
    let mut csend: Vec<Vec<u8>> =
        vec![vec![0; 2 * layout.combine_send_bytes() as usize]; c.ranks as usize];
    let mut comb: Vec<Vec<u8>> =
        vec![vec![0xAA; 2 * layout.combine_region_bytes() as usize]; c.ranks as usize];
    let mut back: Vec<Vec<(Write, Vec<u8>)>> = vec![Vec::new(); c.ranks as usize];
    for (d, recv) in receives.iter().enumerate() {
        for (i, rr) in recv.rows.iter().enumerate() {
            let got = read(&disp[d], rr.offset);
            let at = recv.combine_send_row_offset(i) as usize;
            csend[d][at..at + 16].copy_from_slice(&row(d as u32, got[1], got[2], 77));
        }
        write_combine_headers(recv, cells(&mut csend[d]));
        let writes = recv.writes_combine(&matrix);
        for s in 0..c.ranks {
            prop_assert!(writes.iter().filter(|w| w.peer == s).count() <= 1);
        }
        for w in writes {
            prop_assert!(w.src_offset + w.len <= 2 * layout.combine_send_bytes());
            let data = csend[d][w.src_offset as usize..(w.src_offset + w.len) as usize].to_vec();
            back[w.peer as usize].push((w, data));
        }
    }
    for (s, p) in plans.iter().enumerate() {
        apply(&mut comb[s], set, layout.combine_region_bytes(), &back[s]);
        let mut from: Vec<u32> = back[s]
            .iter()
            .map(|(w, _)| {
                receives
                    .iter()
                    .position(|r| r.writes_combine(&matrix).contains(w))
                    .unwrap() as u32
            })
            .collect();
        from.sort();
        prop_assert_eq!(
            from,
            p.combine_sources(),
            "combine arrivals expected = posted"
        );
        for peer in p.combine_sources() {
            let at = p.combine_block_offset(peer) as usize;
            prop_assert_eq!(
                decode_combine_header(&comb[s][at..at + 64], c.epoch, peer, p.rows_to(peer)),
                Some(p.rows_to(peer))
            );
        }
        for (i, sr) in p.rows.iter().enumerate() {
            prop_assert_eq!(
                read(&comb[s], p.combine_row_offset(i)),
                [sr.peer, sr.token, sr.slot, 77]
            );
        }
    }
    Ok(())
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 2000, ..ProptestConfig::default() })]
    #[test]
    fn every_routing_is_planned_exactly(c in case()) {
        check(c)?;
    }
}

#[test]
fn exactly_at_capacity_fits_and_one_more_row_fails() {
    let layout = Layout {
        ranks: 2,
        experts_per_rank: 2,
        top_k: 2,
        max_tokens: 3,
        row_bytes: ROW,
        combine_row_bytes: ROW,
        private_rows: 2,
        overflow_rows: 0,
    };
    // Rank 0 sends 6 rows to rank 1 (4 past its private slot), rank 1 sends 3 (1 past).
    let routing = [vec![2, 3, 2, 3, 3, 2], vec![2, -1, 3, -1, 2, -1]];
    for (overflow_rows, fits) in [(5, true), (4, false)] {
        check(Case {
            ranks: 2,
            experts_per_rank: 2,
            top_k: 2,
            max_tokens: 3,
            private_rows: 2,
            slack: overflow_rows - 5,
            eplb: None,
            routing: routing.to_vec(),
            epoch: 1,
        })
        .unwrap();
        let l = Layout {
            overflow_rows: overflow_rows as u32,
            ..layout.clone()
        };
        let map = ExpertMap::identity(&l);
        let plans: Vec<SendPlan> = (0..2)
            .map(|r| {
                SendPlan::new(&l, &map, r, 1, 0xE, &routing[r as usize], &[true, true]).unwrap()
            })
            .collect();
        let mut m = CountMatrix::new(&l);
        for p in &plans {
            m.headers[p.rank as usize] = Some(p.header.clone());
        }
        assert_eq!(m.check_capacity().is_ok(), fits, "overflow {overflow_rows}");
    }
}
