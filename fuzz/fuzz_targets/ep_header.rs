//! MoE dispatch headers (`xfer_ep_plan::Header::decode`) and combine headers
//! (`decode_combine_header`), which any peer of an expert-parallel group writes into this
//! rank's memory: never panic, never claim more rows than a step can send, and what decodes
//! encodes back to the same header.
//!
//! Input: four bytes choose the layout (ranks, experts per rank, top-k, max tokens), four the
//! epoch and source the receiver expects; the rest is the header's bytes.
#![no_main]

use libfuzzer_sys::fuzz_target;
use xfer_ep_plan::plan::decode_combine_header;
use xfer_ep_plan::{Header, Imm, Layout};

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
