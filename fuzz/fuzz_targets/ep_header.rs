//! MoE dispatch headers (`xfer_ep_plan::Header::decode`) and combine headers
//! (`decode_combine_header`), which any peer of an expert-parallel group writes into this
//! rank's memory: never panic, never claim more rows than a step can send, and what decodes
//! encodes back to the same header; the route records behind the rows a header announces
//! (from the bytes after it) are read without panicking, and only local experts, no more slots
//! than announced, are kept.
//!
//! Input: four bytes choose the layout (ranks, experts per rank, top-k, max tokens), four the
//! epoch and source the receiver expects; the rest is the header's bytes.
#![no_main]

use std::cell::Cell;

use libfuzzer_sys::fuzz_target;
use xfer_ep_plan::plan::decode_combine_header;
use xfer_ep_plan::{CountMatrix, Header, Imm, Layout, Receive};

fuzz_target!(|data: &[u8]| {
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
});
