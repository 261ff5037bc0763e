//! The decoders of what peers write into this rank's memory (the count header, the combine
//! header, immediates) over random and mutated bytes: the checks of the `ep_header` fuzz
//! target, run in `cargo test` on seeded inputs.

use std::cell::Cell;

use xfer_ep_plan::plan::{decode_combine_header, encode_combine_header};
use xfer_ep_plan::{membership_digest, CountMatrix, Header, Imm, Layout, Receive};

fn check(data: &[u8]) {
    if data.len() < 8 {
        return;
    }
    let (shape, rest) = data.split_at(8);
    let layout = Layout {
        ranks: u32::from(shape[0] % 16) + 1,
        experts_per_rank: u32::from(shape[1] % 8) + 1,
        top_k: u32::from(shape[2] % 8) + 1,
        max_tokens: u32::from(shape[3]),
        row_bytes: 16,
        combine_row_bytes: 16,
        partial_row_bytes: u64::from(shape[1] & 8) * 4,
        private_rows: 4,
        overflow_rows: 4,
    };
    let epoch = u32::from(shape[4]) | (u32::from(shape[5]) << 8);
    let source = u32::from(shape[6]) % layout.ranks;
    if let Ok(h) = Header::decode(&layout, epoch, source, rest) {
        let total = |c: &[u32]| c.iter().map(|&c| u64::from(c)).sum::<u64>();
        assert!(total(&h.rows) <= layout.max_send_rows());
        assert!(total(&h.slots) <= layout.max_send_slots());
        assert_eq!(h.rows.len() as u32, layout.ranks);
        assert_eq!(h.slots.len() as u32, layout.ranks);
        for (&n, &s) in h.rows.iter().zip(&h.slots) {
            assert!(
                n <= layout.max_tokens
                    && n <= s
                    && u64::from(s) <= u64::from(n) * u64::from(layout.top_k)
            );
        }
        assert_eq!(
            Header::decode(&layout, epoch, source, &h.encode(&layout)).unwrap(),
            h
        );
        // The route records behind the rows it announces to rank 0 (its private ones), from
        // the bytes that follow: reading them never panics, and what is kept is bounded.
        let mut matrix = CountMatrix::new(&layout);
        matrix.headers[source as usize] = Some(h);
        let none = vec![false; layout.ranks as usize];
        let all = vec![true; layout.ranks as usize];
        let mut recv = Receive::new(&layout, 0, epoch, 0xE, &matrix, &all, &none);
        let tail = &rest[layout.header_bytes() as usize..];
        let mut region = vec![0u8; 2 * layout.dispatch_region_bytes() as usize];
        for (d, s) in region.iter_mut().zip(tail.iter().cycle()) {
            *d = *s;
        }
        let bad = recv.read_routes(Cell::from_mut(region.as_mut_slice()).as_slice_of_cells());
        assert!(bad.len() <= 1);
        assert_eq!(
            recv.slots.len() as u64,
            recv.slots_valid.iter().sum::<u64>()
        );
        assert!(recv
            .slots
            .iter()
            .all(|sl| sl.expert < layout.experts_per_rank));
        if !recv.weighted[source as usize] {
            assert!(recv.slots.iter().all(|sl| sl.weight == 0.0));
        }
        for (s, &v) in recv.slots_valid.iter().enumerate() {
            assert!(v <= recv.slots_sent[s]);
        }
    }
    let rows = u64::from(shape[7]);
    if let Some(valid) = decode_combine_header(rest, epoch, source, rows) {
        assert!(valid <= rows);
    }
    if rest.len() >= 4 {
        let raw = u32::from_le_bytes([rest[0], rest[1], rest[2], rest[3]]);
        if let Some(imm) = Imm::decode(shape[7], raw) {
            assert_eq!(imm.encode(), raw);
        }
    }
}

#[test]
fn random_and_mutated_headers_never_panic_and_round_trip() {
    let mut rng = fastrand::Rng::with_seed(5);
    let mut decoded = 0;
    for _ in 0..20_000 {
        // Start from a valid header of a random layout, then flip a few bytes (or not).
        let shape: [u8; 8] = std::array::from_fn(|_| rng.u8(..));
        let layout = Layout {
            ranks: u32::from(shape[0] % 16) + 1,
            experts_per_rank: u32::from(shape[1] % 8) + 1,
            top_k: u32::from(shape[2] % 8) + 1,
            max_tokens: u32::from(shape[3]),
            row_bytes: 16,
            combine_row_bytes: 16,
            partial_row_bytes: u64::from(shape[1] & 8) * 4,
            private_rows: 4,
            overflow_rows: 4,
        };
        let epoch = u32::from(shape[4]) | (u32::from(shape[5]) << 8);
        let source = u32::from(shape[6]) % layout.ranks;
        // Rows within a fair share of the tokens per rank, each with 1 to top-k slots.
        let rows: Vec<u32> = (0..layout.ranks)
            .map(|_| rng.u32(0..=layout.max_tokens / layout.ranks))
            .collect();
        let slots: Vec<u32> = rows
            .iter()
            .map(|&n| n * rng.u32(1..=layout.top_k))
            .collect();
        let h = Header {
            epoch,
            source,
            membership: membership_digest(&vec![true; layout.ranks as usize]),
            rows,
            slots,
            weighted: layout.partial_row_bytes > 0 && rng.bool(),
        };
        let mut data = shape.to_vec();
        let mut bytes = if rng.bool() {
            h.encode(&layout)
        } else {
            encode_combine_header(epoch, source, u64::from(shape[7])).to_vec()
        };
        for _ in 0..rng.usize(0..3) {
            if !bytes.is_empty() {
                let i = rng.usize(..bytes.len());
                bytes[i] = rng.u8(..);
            }
        }
        if rng.u8(..) < 20 {
            bytes.truncate(rng.usize(..=bytes.len()));
        }
        data.extend_from_slice(&bytes);
        if Header::decode(&layout, epoch, source, &bytes).is_ok() {
            decoded += 1;
        }
        check(&data);
    }
    assert!(
        decoded > 1_000,
        "the inputs reach the decoders' success path ({decoded})"
    );
}

/// Route records are a peer's bytes too: over random and mutated records, reading them never
/// panics, a source whose records do not decode is left out, and what is kept names only local
/// experts, at least one slot per row, and no more slots than the header announced.
#[test]
fn random_and_mutated_route_records_are_bounded() {
    use xfer_ep_plan::{ExpertMap, SendPlan};
    let mut rng = fastrand::Rng::with_seed(9);
    let (mut kept, mut refused) = (0, 0);
    for _ in 0..2_000 {
        let ranks = rng.u32(1..=3);
        let layout = Layout {
            ranks,
            experts_per_rank: rng.u32(1..=4),
            top_k: rng.u32(1..=4),
            max_tokens: rng.u32(0..=4),
            row_bytes: 16,
            combine_row_bytes: 16,
            partial_row_bytes: 0,
            private_rows: rng.u32(0..=4),
            overflow_rows: 64,
        };
        let map = ExpertMap::identity(&layout);
        let experts = i64::from(ranks * layout.experts_per_rank);
        let plans: Vec<SendPlan> = (0..ranks)
            .map(|r| {
                let tokens = rng.u32(0..=layout.max_tokens);
                let ids: Vec<i64> = (0..tokens * layout.top_k)
                    .map(|_| rng.i64(-1..experts))
                    .collect();
                SendPlan::new(&layout, &map, r, 0, 0xE, &ids, &vec![true; ranks as usize]).unwrap()
            })
            .collect();
        let mut matrix = CountMatrix::new(&layout);
        for p in &plans {
            matrix.headers[p.rank as usize] = Some(p.header.clone());
        }
        let everyone = vec![true; ranks as usize];
        let mut region = vec![0u8; 2 * layout.dispatch_region_bytes() as usize];
        let mut recv = Receive::new(&layout, 0, 0, 0xE, &matrix, &everyone, &everyone);
        // The records as their sources wrote them, then a few bytes flipped.
        for rr in &recv.rows {
            let p = &plans[rr.source as usize];
            let route = p.route_record(p.peer_start[0] + rr.index as usize);
            let at = (rr.offset + layout.row_bytes) as usize;
            region[at..at + route.len()].copy_from_slice(&route);
            if rng.u8(..) < 40 {
                let i = rng.usize(..route.len());
                region[at + i] = rng.u8(..);
            }
        }
        let bad = recv.read_routes(Cell::from_mut(region.as_mut_slice()).as_slice_of_cells());
        refused += bad.len();
        for s in 0..ranks {
            if bad.contains(&s) {
                assert_eq!(recv.slots_valid[s as usize], 0);
                continue;
            }
            kept += 1;
            assert!(recv.slots_valid[s as usize] <= recv.slots_sent[s as usize]);
        }
        for (i, _) in recv.rows.iter().enumerate() {
            let carried = recv.slots.iter().filter(|sl| sl.row as usize == i).count();
            let source = recv.rows[i].source;
            assert!(carried >= 1 || bad.contains(&source));
        }
        assert!(recv
            .slots
            .iter()
            .all(|sl| sl.expert < layout.experts_per_rank));
        let total: u64 = recv.slots_valid.iter().sum();
        assert_eq!(total, recv.slots.len() as u64);
        assert_eq!(recv.expert_counts.iter().sum::<u64>(), total);
    }
    assert!(
        kept > 1_000 && refused > 100,
        "kept {kept}, refused {refused}"
    );
}
