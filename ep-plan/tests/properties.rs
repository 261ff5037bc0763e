//! The plan against a byte-level simulation, over random layouts and routings (empty ranks,
//! `-1` slots, EPLB replicas, overflow past the private slots, exactly at and one row past
//! capacity): every rank plans its step, the headers are exchanged, the overflow and combine
//! writes computed; then every write is applied to simulated memory.
//!
//! Checked: dispatch posts exactly one row per (token, rank it routes to) and a header per
//! (source, receiver), no more bytes; no two writes to a rank overlap and all stay inside
//! their region's set; each rank expects exactly the writes posted to it (one A from every
//! rank, a B from exactly the ranks that post one); at most two writes per peer per phase;
//! every routed slot lands exactly once, at the expert the map names, in source-major order
//! (for each expert, sources in rank order, each source's tokens and slots in order); combine
//! brings every slot back to the slot that sent it; a step past capacity fails on every rank.

use proptest::prelude::*;
use std::cell::Cell;

use xfer_ep_plan::moves::write_combine_headers;
use xfer_ep_plan::plan::decode_combine_header;
use xfer_ep_plan::ROUTE_NONE;
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
    /// Whether the layout has room for partial sums, and which ranks give their weights at
    /// dispatch (bit `r`): combine returns them one partial sum per (token, rank).
    partial: bool,
    weighted: u8,
}

impl Case {
    fn weighted(&self, r: u32) -> bool {
        self.partial && self.weighted & (1 << r) != 0
    }

    /// Rank `r`'s weights: small integers, zero and negative ones included.
    fn weights(&self, r: u32) -> Vec<f32> {
        (0..self.routing[r as usize].len())
            .map(|i| ((r as usize * 97 + i) % 13) as f32 - 6.0)
            .collect()
    }
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
        any::<bool>(),
        any::<u8>(),
    )
        .prop_flat_map(
            |(ranks, epr, top_k, max_tokens, private, slack, eplb, epoch, partial, weighted)| {
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
                        partial,
                        weighted,
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
        // Partial sums (fp32) wider than either.
        partial_row_bytes: if c.partial { 2 * ROW } else { 0 },
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
                let p = SendPlan::new(
                    layout,
                    &map,
                    r,
                    c.epoch,
                    0xE,
                    &c.routing[r as usize],
                    &active,
                )
                .unwrap();
                if c.weighted(r) {
                    p.with_weights(&c.weights(r)).unwrap()
                } else {
                    p
                }
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

    // Send buffers, as `pack` lays them out from a token tensor whose rows say (source,
    // token): each peer block starts with the header, then its rows, each followed by its
    // route record.
    let k = c.top_k as usize;
    let route = layout.route_bytes() as usize;
    let mut send: Vec<Vec<u8>> =
        vec![vec![0; 2 * layout.send_buffer_bytes() as usize]; c.ranks as usize];
    for (r, p) in plans.iter().enumerate() {
        let h = p.header.encode(&layout);
        let tokens = c.routing[r].len() / k;
        let x: Vec<u8> = (0..tokens as u32)
            .flat_map(|t| row(r as u32, t, 0, 0))
            .collect();
        p.pack(&layout, cells(&mut x.clone()), cells(&mut send[r]));
        for peer in 0..c.ranks {
            let at = p.block_offset(peer) as usize;
            prop_assert_eq!(&send[r][at..at + h.len()], &h[..]);
        }
        for (i, sr) in p.rows.iter().enumerate() {
            let at = p.row_offset(i);
            prop_assert_eq!(read(&send[r], at), [r as u32, sr.token, 0, 0]);
            let at = (at + ROW) as usize;
            prop_assert_eq!(&send[r][at..at + route], &p.route_record(i)[..]);
        }
        // Every routed slot is planned exactly once, at the expert the map names, and travels
        // in the one row of its (token, peer); every row carries a slot.
        for (i, &e) in c.routing[r].iter().enumerate() {
            let idx = p.slot_index[i];
            prop_assert_eq!(idx >= 0, e >= 0);
            if e >= 0 {
                let sl = p.slots[idx as usize];
                let phys = map.physical(e as usize, i / k, i % k, k);
                prop_assert_eq!(
                    (sl.peer, sl.expert),
                    (phys / c.experts_per_rank, phys % c.experts_per_rank)
                );
                prop_assert_eq!((sl.token as usize, sl.slot as usize), (i / k, i % k));
            }
        }
        for (i, sr) in p.rows.iter().enumerate() {
            let carried = &p.slots[p.row_slots[i]..p.row_slots[i + 1]];
            prop_assert!(!carried.is_empty(), "a row without a slot");
            prop_assert!(carried
                .iter()
                .all(|sl| (sl.token, sl.peer) == (sr.token, sr.peer)));
            let record = p.route_record(i);
            let weights = c.weights(r as u32);
            for slot in 0..k {
                let entry = u16::from_le_bytes([record[2 * slot], record[2 * slot + 1]]);
                let here = carried.iter().find(|sl| sl.slot as usize == slot);
                prop_assert_eq!(entry, here.map_or(ROUTE_NONE, |sl| sl.expert as u16));
                if c.partial {
                    let w = f32::from_le_bytes(
                        record[2 * k + 4 * slot..2 * k + 4 * slot + 4]
                            .try_into()
                            .unwrap(),
                    );
                    let want = match here {
                        Some(sl) if c.weighted(r as u32) => weights[sl.token as usize * k + slot],
                        _ => 0.0,
                    };
                    prop_assert_eq!(w, want);
                }
            }
        }
        prop_assert!(p
            .rows
            .windows(2)
            .all(|w| (w[0].peer, w[0].token) < (w[1].peer, w[1].token)));
        prop_assert_eq!(p.row_slots.last().copied(), Some(p.slots.len()));
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
    // The minimum on the wire: one row per (token, rank it routes to), behind one header per
    // (source, receiver).
    let k = c.top_k as usize;
    let pairs: u64 = (0..c.ranks as usize)
        .map(|r| {
            let mut pairs: Vec<(usize, u32)> = c.routing[r]
                .iter()
                .enumerate()
                .filter(|&(_, &e)| e >= 0)
                .map(|(i, &e)| {
                    let phys = map.physical(e as usize, i / k, i % k, k);
                    (i / k, phys / c.experts_per_rank)
                })
                .collect();
            pairs.sort_unstable();
            pairs.dedup();
            pairs.len() as u64
        })
        .sum();
    let posted: u64 = plans
        .iter()
        .flat_map(|p| p.writes_a().into_iter().chain(b[p.rank as usize].clone()))
        .map(|w| w.len)
        .sum();
    prop_assert_eq!(
        posted,
        u64::from(c.ranks * c.ranks) * layout.header_bytes() + pairs * layout.wire_row_bytes(),
        "dispatch moves one row per (token, rank), no more"
    );
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
        // Every row here is the one its source sent, in source order, all of them.
        for rr in &recv.rows {
            let got = read(&disp[d as usize], rr.offset);
            let p = &plans[rr.source as usize];
            let sr = p.rows[p.peer_start[d as usize] + rr.index as usize];
            prop_assert_eq!(got, [rr.source, sr.token, 0, 0]);
        }
        prop_assert_eq!(
            recv.rows.len() as u64,
            plans.iter().map(|p| p.rows_to(d)).sum::<u64>()
        );
        prop_assert!(recv.rows.len() as u64 <= layout.receive_capacity());
        // The route records expand them into every slot the sources routed here, each at the
        // expert the map names, in each source's combine order.
        let mut recv = recv;
        prop_assert!(recv.read_routes(cells(&mut disp[d as usize])).is_empty());
        let mut next = vec![0usize; c.ranks as usize];
        for sl in &recv.slots {
            let rr = recv.rows[sl.row as usize];
            let p = &plans[rr.source as usize];
            let token = p.rows[p.peer_start[d as usize] + rr.index as usize].token as usize;
            let weight = if c.weighted(rr.source) {
                c.weights(rr.source)[token * k + sl.slot as usize]
            } else {
                0.0
            };
            prop_assert_eq!(sl.weight, weight, "the weight travelled with its slot");
            let want = p.slots[p.slot_start[d as usize] + next[rr.source as usize]];
            next[rr.source as usize] += 1;
            prop_assert_eq!(sl.index as usize + 1, next[rr.source as usize]);
            prop_assert_eq!(
                (want.token, want.slot, want.expert),
                (
                    p.rows[p.peer_start[d as usize] + rr.index as usize].token,
                    sl.slot,
                    sl.expert
                )
            );
        }
        for p in &plans {
            prop_assert_eq!(next[p.rank as usize] as u64, p.slots_to(d));
            prop_assert_eq!(recv.slots_valid[p.rank as usize], p.slots_to(d));
        }
        prop_assert!(recv.slots.len() as u64 <= layout.receive_slot_capacity());
        // Expert-major, then source, token and slot: DeepEP's order, as per-(token, expert)
        // rows had it.
        let order = recv.expert_order();
        let key = |j: usize| {
            let sl = recv.slots[j];
            let rr = recv.rows[sl.row as usize];
            let token = plans[rr.source as usize].rows
                [plans[rr.source as usize].peer_start[d as usize] + rr.index as usize]
                .token;
            (sl.expert, rr.source, token, sl.slot)
        };
        for w in order.windows(2) {
            prop_assert!(key(w[0]) < key(w[1]));
        }
        // The places cover every slot once, expert-major, each at its row and at its output's
        // place in the combine send buffer.
        let mut covered = vec![0u64; layout.experts_per_rank as usize];
        let places = recv.places();
        prop_assert_eq!(places.len(), order.len());
        for (place, &j) in places.iter().zip(&order) {
            prop_assert_eq!(place.position, covered[place.expert as usize]);
            covered[place.expert as usize] += 1;
            let sl = recv.slots[j];
            prop_assert_eq!(sl.expert, place.expert);
            prop_assert_eq!(recv.rows[sl.row as usize].offset, place.recv_offset);
            let source = recv.rows[sl.row as usize].source;
            prop_assert_eq!(
                (!recv.weighted[source as usize]).then(|| recv.combine_send_slot_offset(j)),
                place.combine_offset
            );
            prop_assert_eq!(sl.position, place.position);
        }
        prop_assert_eq!(&covered, &recv.expert_counts);
        receives.push(recv);
    }

    // Combine: each receiver answers every slot with (receiver, token, slot, marker), or a
    // weighted source's every row with one partial sum (receiver, token, MAX, marker).
    let mut csend: Vec<Vec<u8>> =
        vec![vec![0; 2 * layout.combine_send_bytes() as usize]; c.ranks as usize];
    let mut comb: Vec<Vec<u8>> =
        vec![vec![0xAA; 2 * layout.combine_region_bytes() as usize]; c.ranks as usize];
    let mut back: Vec<Vec<(Write, Vec<u8>)>> = vec![Vec::new(); c.ranks as usize];
    for (d, recv) in receives.iter().enumerate() {
        for (j, sl) in recv.slots.iter().enumerate() {
            let rr = recv.rows[sl.row as usize];
            let got = read(&disp[d], rr.offset);
            let (at, out) = if recv.weighted[rr.source as usize] {
                let at = recv.combine_send_partial_offset(sl.row as usize);
                (at as usize, row(d as u32, got[1], u32::MAX, 78))
            } else {
                let at = recv.combine_send_slot_offset(j);
                (at as usize, row(d as u32, got[1], sl.slot, 77))
            };
            csend[d][at..at + 16].copy_from_slice(&out);
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
            let rows = p.combine_rows_from(peer);
            prop_assert_eq!(
                decode_combine_header(&comb[s][at..at + 64], c.epoch, peer, rows),
                Some(rows)
            );
        }
        // What came back: one output per slot, or one partial sum per (token, rank), no more.
        let (back_rows, back_row) = if p.weighted() {
            (p.rows.len() as u64, layout.partial_row_bytes)
        } else {
            (p.slots.len() as u64, layout.combine_row_bytes)
        };
        prop_assert_eq!(
            back[s].iter().map(|(w, _)| w.len).sum::<u64>(),
            u64::from(c.ranks) * 64 + back_rows * back_row
        );
        if p.weighted() {
            for (i, sr) in p.rows.iter().enumerate() {
                prop_assert_eq!(
                    read(&comb[s], p.combine_partial_offset(i)),
                    [sr.peer, sr.token, u32::MAX, 78]
                );
            }
        } else {
            for (j, sl) in p.slots.iter().enumerate() {
                prop_assert_eq!(
                    read(&comb[s], p.combine_slot_offset(j)),
                    [sl.peer, sl.token, sl.slot, 77]
                );
            }
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
        max_tokens: 6,
        row_bytes: ROW,
        combine_row_bytes: ROW,
        partial_row_bytes: 0,
        private_rows: 2,
        overflow_rows: 0,
    };
    // Rank 0 sends 6 rows to rank 1 (4 past its private slot; each row carries two slots),
    // rank 1 sends 3 (1 past).
    let routing = [
        vec![2, 3, 2, 3, 3, 2, 2, 3, 3, 2, 2, 3],
        vec![2, -1, 3, -1, 2, -1],
    ];
    for (overflow_rows, fits) in [(5, true), (4, false)] {
        check(Case {
            ranks: 2,
            experts_per_rank: 2,
            top_k: 2,
            max_tokens: 6,
            private_rows: 2,
            slack: overflow_rows - 5,
            eplb: None,
            routing: routing.to_vec(),
            epoch: 1,
            partial: true,
            weighted: 1,
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
