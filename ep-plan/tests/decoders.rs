//! The decoders of what peers write into this rank's memory (the count header, the combine
//! header, immediates) over random and mutated bytes: the checks of the `ep_header` fuzz
//! target, run in `cargo test` on seeded inputs.

use xfer_ep_plan::plan::{decode_combine_header, encode_combine_header};
use xfer_ep_plan::{membership_digest, Header, Imm, Layout};

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
        private_rows: 4,
        overflow_rows: 4,
    };
    let epoch = u32::from(shape[4]) | (u32::from(shape[5]) << 8);
    let source = u32::from(shape[6]) % layout.ranks;
    if let Ok(h) = Header::decode(&layout, epoch, source, rest) {
        let total: u64 = h.counts.iter().map(|&c| u64::from(c)).sum();
        assert!(total <= layout.max_send_rows());
        assert_eq!(
            h.counts.len() as u32,
            layout.ranks * layout.experts_per_rank
        );
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
            private_rows: 4,
            overflow_rows: 4,
        };
        let epoch = u32::from(shape[4]) | (u32::from(shape[5]) << 8);
        let source = u32::from(shape[6]) % layout.ranks;
        let n = (layout.ranks * layout.experts_per_rank) as usize;
        let budget = layout.max_send_rows();
        let counts: Vec<u32> = (0..n)
            .map(|_| rng.u32(0..=(budget / n as u64).min(u64::from(u32::MAX)) as u32))
            .collect();
        let h = Header {
            epoch,
            source,
            membership: membership_digest(&vec![true; layout.ranks as usize]),
            counts,
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
