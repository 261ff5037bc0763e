//! Where each row's bytes move between the caller's tensors and the registered buffers, and
//! the fp32 weighted reduction of combine: offsets from the plan, no I/O. The byte loops run
//! over `Cell` slices, so the bindings can hand in buffers Python also sees (numpy, torch)
//! without `unsafe`.

use std::cell::Cell;

use crate::plan::{Receive, SendPlan};
use crate::step::StepMachine;
use crate::{Layout, COMBINE_HEADER_BYTES};

/// Element types of a row as stored on the wire.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[non_exhaustive]
pub enum Dtype {
    /// bfloat16 (widened exactly: `bits << 16`).
    Bf16,
    /// IEEE half.
    F16,
    /// IEEE single.
    F32,
}

impl Dtype {
    /// Bytes of one element.
    pub fn size(self) -> usize {
        match self {
            Dtype::Bf16 | Dtype::F16 => 2,
            Dtype::F32 => 4,
        }
    }
}

/// IEEE half to single, exactly (subnormals, infinities and NaNs included).
pub fn f16_to_f32(h: u16) -> f32 {
    let sign = u32::from(h & 0x8000) << 16;
    let exp = u32::from((h >> 10) & 0x1f);
    let man = u32::from(h & 0x3ff);
    let bits = match (exp, man) {
        (0, 0) => sign,
        // Subnormal: value man × 2^-24, exact in f32.
        (0, m) => {
            // Subnormal: m × 2^-24, exact in f32.
            let v = m as f32 * f32::from_bits(0x3380_0000);
            return if sign == 0 { v } else { -v };
        }
        (0x1f, m) => sign | 0x7f80_0000 | (m << 13),
        (e, m) => sign | ((e + 127 - 15) << 23) | (m << 13),
    };
    f32::from_bits(bits)
}

/// Largest finite float8 e4m3fn value.
pub const E4M3_MAX: f32 = 448.0;
/// Channels per fp8 scale (DeepEP's low-latency blocks).
pub const FP8_BLOCK: usize = 128;

/// float8 e4m3fn (no infinities; 0x7f/0xff NaN) to f32, exactly.
pub fn e4m3_to_f32(c: u8) -> f32 {
    let sign = if c & 0x80 != 0 { -1.0 } else { 1.0 };
    let (exp, man) = (i32::from((c >> 3) & 0xf), f32::from(c & 7));
    if exp == 0xf && c & 7 == 7 {
        return f32::NAN;
    }
    if exp == 0 {
        return sign * man * 2f32.powi(-9);
    }
    sign * (1.0 + man / 8.0) * 2f32.powi(exp - 7)
}

/// f32 to float8 e4m3fn, rounded to nearest even, saturating at ±448 (as CUDA's
/// `__NV_SATFINITE` conversion DeepEP uses); NaN stays NaN.
pub fn f32_to_e4m3(v: f32) -> u8 {
    let sign = if v.is_sign_negative() { 0x80u8 } else { 0 };
    if v.is_nan() {
        return 0x7f;
    }
    let a = v.abs();
    if a >= E4M3_MAX {
        return sign | 0x7e;
    }
    // Below the smallest normal (2^-6) the step is 2^-9: m × 2^-9, m in 0..=8 (8 is 2^-6).
    if a < 0.015_625 {
        return sign | (a * 512.0).round_ties_even() as u8;
    }
    // Normal: keep 3 of f32's 23 mantissa bits, rounding to nearest even on the bits (a carry
    // moves into the exponent, as it should); rebias the exponent from 127 to 7.
    let bits = a.to_bits();
    let rounded = (bits + 0x7_ffff + ((bits >> 20) & 1)) >> 20;
    let code = u8::try_from(rounded - ((127 - 7) << 3)).unwrap_or(0x7e);
    sign | code.min(0x7e)
}

/// The bytes of an fp8 row for `hidden` channels: the e4m3 values, then one f32 scale per
/// block of 128 channels.
pub fn fp8_row_bytes(hidden: usize) -> usize {
    hidden + 4 * hidden.div_ceil(FP8_BLOCK)
}

/// Quantizes bf16 rows (`[tokens, hidden]`, little-endian bytes) to fp8 rows (see
/// [`fp8_row_bytes`]) as DeepEP's low-latency dispatch does: per token and block of 128
/// channels, `scale = amax / 448` (amax at least 1e-4), values `x × (448 / amax)`; with
/// `round_scale`, the scale is rounded up to a power of two (then `value × scale` is exactly
/// the bf16 input whenever the scaled value is an e4m3 value).
pub fn quantize_fp8(x: &[Cell<u8>], hidden: usize, round_scale: bool) -> Vec<u8> {
    let row_in = 2 * hidden;
    let row_out = fp8_row_bytes(hidden);
    let tokens = x.len() / row_in.max(1);
    let mut out = vec![0u8; tokens * row_out];
    let mut vals = vec![0f32; hidden];
    for (t, dst) in out.chunks_exact_mut(row_out).enumerate() {
        let src = &x[t * row_in..(t + 1) * row_in];
        for (v, b) in vals.iter_mut().zip(src.chunks_exact(2)) {
            *v = f32::from_bits(u32::from(u16::from_le_bytes([b[0].get(), b[1].get()])) << 16);
        }
        let (q, scales) = dst.split_at_mut(hidden);
        for (blk, (chunk, scale_out)) in vals
            .chunks(FP8_BLOCK)
            .zip(scales.chunks_exact_mut(4))
            .enumerate()
        {
            let amax = chunk.iter().fold(1e-4f32, |m, v| m.max(v.abs()));
            let (scale, inv) = if round_scale {
                let e = (amax / E4M3_MAX).log2().ceil() as i32;
                (2f32.powi(e), 2f32.powi(-e))
            } else {
                (amax / E4M3_MAX, E4M3_MAX / amax)
            };
            for (i, v) in chunk.iter().enumerate() {
                q[blk * FP8_BLOCK + i] = f32_to_e4m3(v * inv);
            }
            scale_out.copy_from_slice(&scale.to_le_bytes());
        }
    }
    out
}

/// `acc[i] += weight × row[i]` in fp32, for a row of `acc.len()` elements of `dtype`
/// (little-endian bytes).
pub fn accumulate(dtype: Dtype, acc: &mut [f32], weight: f32, row: &[Cell<u8>]) {
    let size = dtype.size();
    debug_assert_eq!(row.len(), acc.len() * size);
    match dtype {
        Dtype::Bf16 => {
            for (a, b) in acc.iter_mut().zip(row.chunks_exact(2)) {
                let bits = u32::from(u16::from_le_bytes([b[0].get(), b[1].get()])) << 16;
                *a += weight * f32::from_bits(bits);
            }
        }
        Dtype::F16 => {
            for (a, b) in acc.iter_mut().zip(row.chunks_exact(2)) {
                *a += weight * f16_to_f32(u16::from_le_bytes([b[0].get(), b[1].get()]));
            }
        }
        Dtype::F32 => {
            for (a, b) in acc.iter_mut().zip(row.chunks_exact(4)) {
                *a += weight * f32::from_le_bytes([b[0].get(), b[1].get(), b[2].get(), b[3].get()]);
            }
        }
    }
}

/// Copies `src` into `dst` (same length).
pub fn copy_cells(dst: &[Cell<u8>], src: &[Cell<u8>]) {
    debug_assert_eq!(dst.len(), src.len());
    for (d, s) in dst.iter().zip(src) {
        d.set(s.get());
    }
}

/// Where one received slot's bytes are: its row in the dispatch region, its expert output's
/// place in the combine send buffer, and its `position` among its expert's slots (sources in
/// rank order, each in its own order: token, then slot).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct RecvPlace {
    /// Byte offset of the row in the dispatch region (both sets).
    pub recv_offset: u64,
    /// Byte offset of the output in the combine send buffer (both sets); `None` when its
    /// source is weighted (the output goes into its row's partial sum:
    /// [`Receive::repack_partials`]).
    pub combine_offset: Option<u64>,
    /// The local expert.
    pub expert: u32,
    /// Index among the expert's slots.
    pub position: u64,
}

impl Receive {
    /// Every received slot's place, expert-major (DeepEP's low-latency order); a row routed
    /// to several local experts is in each of their places. Empty before the route records
    /// are read.
    pub fn places(&self) -> Vec<RecvPlace> {
        self.expert_order()
            .into_iter()
            .map(|j| {
                let sl = self.slots[j];
                let row = self.rows[sl.row as usize];
                RecvPlace {
                    recv_offset: row.offset,
                    combine_offset: (!self.weighted[row.source as usize])
                        .then(|| self.combine_send_slot_offset(j)),
                    expert: sl.expert,
                    position: sl.position,
                }
            })
            .collect()
    }

    /// For every row here from a weighted source, its partial sum into `csend` (the combine
    /// send buffer, both sets) as little-endian `f32`s: its slots' expert outputs (`out`, in
    /// the experts' layout `shape` of rows of `dtype`) weighted and summed in fp32, slots in
    /// order.
    pub fn repack_partials(
        &self,
        dtype: Dtype,
        shape: ExpertLayout,
        out: &[Cell<u8>],
        csend: &[Cell<u8>],
    ) {
        let l = self.layout();
        let row = l.combine_row_bytes;
        let hidden = row as usize / dtype.size();
        let starts: Vec<u64> = self
            .expert_counts
            .iter()
            .scan(0u64, |acc, &c| {
                let s = *acc;
                *acc += c;
                Some(s)
            })
            .collect();
        let mut acc = vec![0f32; hidden];
        for (i, r) in self.rows.iter().enumerate() {
            if !self.weighted[r.source as usize] {
                continue;
            }
            acc.iter_mut().for_each(|v| *v = 0.0);
            for sl in &self.slots[self.row_slots[i]..self.row_slots[i + 1]] {
                let place = RecvPlace {
                    recv_offset: r.offset,
                    combine_offset: None,
                    expert: sl.expert,
                    position: sl.position,
                };
                let at = expert_offset(l, shape, &starts, &place, row) as usize;
                accumulate(dtype, &mut acc, sl.weight, &out[at..at + row as usize]);
            }
            let at = self.combine_send_partial_offset(i) as usize;
            for (d, v) in csend[at..at + 4 * hidden].chunks_exact(4).zip(&acc) {
                for (c, b) in d.iter().zip(v.to_le_bytes()) {
                    c.set(b);
                }
            }
        }
    }
}

/// How the experts see the received rows.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ExpertLayout {
    /// `[experts_per_rank, ranks × max_tokens, row]` (DeepEP's low-latency layout).
    DeepEp,
    /// `[rows, row]`, expert-major.
    Flat,
}

/// Byte offset of `place` in the experts' layout of rows of `row` bytes.
pub fn expert_offset(
    layout: &Layout,
    shape: ExpertLayout,
    starts: &[u64],
    place: &RecvPlace,
    row: u64,
) -> u64 {
    let first = match shape {
        ExpertLayout::DeepEp => {
            u64::from(place.expert) * u64::from(layout.ranks) * u64::from(layout.max_tokens)
                + place.position
        }
        ExpertLayout::Flat => starts[place.expert as usize] + place.position,
    };
    first * row
}

/// Bytes the experts' layout of rows of `row` bytes needs.
pub fn expert_layout_bytes(
    layout: &Layout,
    shape: ExpertLayout,
    received_rows: u64,
    row: u64,
) -> u64 {
    match shape {
        ExpertLayout::DeepEp => {
            u64::from(layout.experts_per_rank)
                * u64::from(layout.ranks)
                * u64::from(layout.max_tokens)
                * row
        }
        ExpertLayout::Flat => received_rows * row,
    }
}

impl SendPlan {
    /// Packs the send buffer: every active peer's block gets this rank's header and, behind
    /// it, its rows copied from `x` (`[tokens, row]` bytes), each followed by its route record.
    pub fn pack(&self, layout: &Layout, x: &[Cell<u8>], send: &[Cell<u8>]) {
        let header = self.header.encode(layout);
        let row = layout.row_bytes as usize;
        let route = layout.route_bytes() as usize;
        for peer in 0..layout.ranks {
            let block = self.block_offset(peer) as usize;
            for (d, &b) in send[block..block + header.len()].iter().zip(&header) {
                d.set(b);
            }
        }
        for (i, r) in self.rows.iter().enumerate() {
            let at = self.row_offset(i) as usize;
            let t = r.token as usize * row;
            copy_cells(&send[at..at + row], &x[t..t + row]);
            for (d, b) in send[at + row..at + row + route]
                .iter()
                .zip(self.route_record(i))
            {
                d.set(b);
            }
        }
    }
}

impl StepMachine {
    /// `y[t] = Σ_slot weight[t × top_k + slot] · output(t, slot)` in fp32, slots in order, for
    /// `y` of `[tokens, hidden]`; a slot whose output did not come back (masked rank, row not
    /// received) contributes zero. `combine` is the combine region. A weighted step (weights
    /// given at dispatch, `weights` unused) adds each row's partial sum instead, ranks in
    /// order; a row whose partial sum did not come back contributes zero.
    pub fn reduce(&self, dtype: Dtype, combine: &[Cell<u8>], weights: &[f32], y: &[Cell<f32>]) {
        let plan = self.plan();
        let layout = self.layout();
        let top_k = layout.top_k as usize;
        let row = layout.combine_row_bytes as usize;
        let hidden = row / dtype.size();
        let tokens = plan.slot_index.len() / top_k;
        if plan.weighted() {
            for v in y.iter().take(tokens * hidden) {
                v.set(0.0);
            }
            // Rows are by peer, then token: each token's partial sums are added in rank order.
            for (i, r) in plan.rows.iter().enumerate() {
                if !self.row_combined(i) {
                    continue;
                }
                let at = plan.combine_partial_offset(i) as usize;
                let out = &y[r.token as usize * hidden..(r.token as usize + 1) * hidden];
                for (o, b) in out.iter().zip(combine[at..at + 4 * hidden].chunks_exact(4)) {
                    o.set(
                        o.get()
                            + f32::from_le_bytes([b[0].get(), b[1].get(), b[2].get(), b[3].get()]),
                    );
                }
            }
            return;
        }
        let mut acc = vec![0f32; hidden];
        for (t, out) in y.chunks_exact(hidden).take(tokens).enumerate() {
            acc.iter_mut().for_each(|v| *v = 0.0);
            for s in 0..top_k {
                let j = plan.slot_index[t * top_k + s];
                if j < 0 || !self.slot_combined(j as usize) {
                    continue;
                }
                let at = plan.combine_slot_offset(j as usize) as usize;
                accumulate(
                    dtype,
                    &mut acc,
                    weights[t * top_k + s],
                    &combine[at..at + row],
                );
            }
            for (o, &a) in out.iter().zip(&acc) {
                o.set(a);
            }
        }
    }
}

/// Writes the combine headers a receive owes into the combine send buffer.
pub fn write_combine_headers(r: &Receive, csend: &[Cell<u8>]) {
    for s in 0..r.sources.len() as u32 {
        if !r.sources[s as usize] {
            continue;
        }
        let h = crate::plan::encode_combine_header(r.epoch, r.rank, r.combine_valid(s));
        let at = r.combine_send_offset(s) as usize;
        for (d, &b) in csend[at..at + COMBINE_HEADER_BYTES as usize].iter().zip(&h) {
            d.set(b);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn cells(bytes: &mut [u8]) -> &[Cell<u8>] {
        Cell::from_mut(bytes).as_slice_of_cells()
    }

    #[test]
    fn half_widens_exactly() {
        for (h, f) in [
            (0x3c00u16, 1.0f32),
            (0xc000, -2.0),
            (0x7bff, 65504.0),
            (0x0001, 2f32.powi(-24)),
            (0x8001, -(2f32.powi(-24))),
            (0x03ff, 1023.0 * 2f32.powi(-24)),
            (0x0400, 2f32.powi(-14)),
            (0x7c00, f32::INFINITY),
            (0xfc00, f32::NEG_INFINITY),
        ] {
            assert_eq!(f16_to_f32(h).to_bits(), f.to_bits(), "{h:#x}");
        }
        assert!(f16_to_f32(0x7e00).is_nan());
        assert_eq!(f16_to_f32(0x8000).to_bits(), (-0.0f32).to_bits());
    }

    #[test]
    fn every_e4m3_value_round_trips_and_others_round_to_nearest_even() {
        for c in 0..=255u8 {
            let v = e4m3_to_f32(c);
            if v.is_nan() {
                assert_eq!(f32_to_e4m3(v) & 0x7f, 0x7f);
                continue;
            }
            // -0 encodes as 0x80, +0 as 0x00: both round trip.
            assert_eq!(f32_to_e4m3(v), c, "{c:#x} = {v}");
        }
        let finite: Vec<f32> = (0..=0x7eu8).map(e4m3_to_f32).collect();
        for (i, w) in finite.windows(2).enumerate() {
            let mid = (w[0] + w[1]) / 2.0;
            // A tie goes to the even code; just off it, to the nearer value.
            let even = if i % 2 == 0 { i as u8 } else { i as u8 + 1 };
            assert_eq!(f32_to_e4m3(mid), even, "tie between {} and {}", w[0], w[1]);
            assert_eq!(f32_to_e4m3(mid * (1.0 - 1e-6)), i as u8);
            assert_eq!(f32_to_e4m3(mid * (1.0 + 1e-6)), i as u8 + 1);
        }
        assert_eq!(f32_to_e4m3(1e9), 0x7e);
        assert_eq!(f32_to_e4m3(-1e9), 0xfe);
    }

    #[test]
    fn quantized_rows_hold_values_and_scales() {
        // One token, 130 channels (two blocks: 128 and 2), integer values.
        let hidden = 130;
        let mut x: Vec<u8> = (0..hidden)
            .flat_map(|i| {
                let v = ((i % 17) as f32) - 8.0;
                ((v.to_bits() >> 16) as u16).to_le_bytes()
            })
            .collect();
        let q = quantize_fp8(cells(&mut x), hidden, true);
        assert_eq!(q.len(), fp8_row_bytes(hidden));
        let scale = |b: usize| {
            f32::from_le_bytes(q[hidden + 4 * b..hidden + 4 * b + 4].try_into().unwrap())
        };
        assert_eq!(scale(0), 1.0 / 32.0); // amax 8: 8 / 448 rounded up to 2^-5
        for (i, &c) in q[..hidden].iter().enumerate() {
            let v = ((i % 17) as f32) - 8.0;
            assert_eq!(e4m3_to_f32(c) * scale(i / FP8_BLOCK), v, "channel {i}");
        }
        let plain = quantize_fp8(cells(&mut x), hidden, false);
        assert_eq!(
            f32::from_le_bytes(plain[hidden..hidden + 4].try_into().unwrap()),
            8.0 / 448.0
        );
    }

    #[test]
    fn accumulate_weights_each_dtype() {
        let mut acc = vec![1.0f32, 2.0];
        let mut bf = [0x80u8, 0x3f, 0x00, 0xc0]; // bf16 1.0, -2.0
        accumulate(Dtype::Bf16, &mut acc, 0.5, cells(&mut bf));
        assert_eq!(acc, [1.5, 1.0]);
        let mut h = [0x00u8, 0x3c, 0x00, 0x44]; // f16 1.0, 4.0
        accumulate(Dtype::F16, &mut acc, 2.0, cells(&mut h));
        assert_eq!(acc, [3.5, 9.0]);
        let mut f: Vec<u8> = [3.0f32, -1.0]
            .iter()
            .flat_map(|v| v.to_le_bytes())
            .collect();
        accumulate(Dtype::F32, &mut acc, 1.0, cells(&mut f));
        assert_eq!(acc, [6.5, 8.0]);
    }

    #[test]
    fn weights_at_dispatch_come_back_as_one_partial_sum_per_token_and_rank() {
        use crate::step::{Action, Stage};
        use crate::{ExpertMap, Phase, SendPlan};
        // One rank (its writes are copies), two experts, top-2, two bf16 channels: token 0
        // goes to experts 0 and 1 (weights 0.5, 2), token 1 to expert 1 (weight 4; its other
        // slot is -1). Expert e returns x · (e + 1).
        let bf16 = |v: f32| ((v.to_bits() >> 16) as u16).to_le_bytes();
        let layout = Layout {
            partial_row_bytes: 8,
            ..Layout::worst_case(1, 2, 2, 2, 4)
        };
        let map = ExpertMap::identity(&layout);
        let plan = SendPlan::new(&layout, &map, 0, 0, 0xE, &[0, 1, 1, -1], &[true])
            .unwrap()
            .with_weights(&[0.5, 2.0, 4.0, 9.0])
            .unwrap();
        let two = |n: u64| vec![0u8; 2 * n as usize];
        let (mut send, mut disp) = (
            two(layout.send_buffer_bytes()),
            two(layout.dispatch_region_bytes()),
        );
        let (mut csend, mut comb) = (
            two(layout.combine_send_bytes()),
            two(layout.combine_region_bytes()),
        );
        let mut x: Vec<u8> = [1.0f32, -2.0, 3.0, 0.5]
            .iter()
            .flat_map(|&v| bf16(v))
            .collect();
        plan.pack(&layout, cells(&mut x), cells(&mut send));
        let mut m = StepMachine::new(&layout, plan, 0, 1_000);
        let carry = |m: &mut StepMachine, from: &[u8], to: &mut [u8], header: u64| {
            while let Some(a) = m.poll_action() {
                match a {
                    Action::Post(w) => {
                        let (s, d) = (w.src_offset as usize, w.dst_offset as usize);
                        to[d..d + w.len as usize].copy_from_slice(&from[s..s + w.len as usize]);
                    }
                    Action::Expect { imm, source, phase } => {
                        let at = if phase == Phase::Combine {
                            m.combine_header_offset(source)
                        } else {
                            m.header_offset(source)
                        } as usize;
                        let bytes = to[at..at + header as usize].to_vec();
                        assert!(m.handle_arrival(1, imm, &bytes));
                    }
                }
            }
        };
        carry(&mut m, &send, &mut disp, layout.header_bytes());
        assert_eq!(*m.stage(), Stage::Dispatched);
        m.read_routes(cells(&mut disp)).unwrap();
        let r = m.receive().unwrap().clone();
        assert_eq!(r.expert_counts, [1, 2]);
        // The experts' outputs in DeepEP's layout, from the rows as they arrived.
        let mut out = vec![0u8; expert_layout_bytes(&layout, ExpertLayout::DeepEp, 3, 4) as usize];
        for place in r.places() {
            assert_eq!(
                place.combine_offset, None,
                "a weighted source's slots are summed"
            );
            let at = expert_offset(&layout, ExpertLayout::DeepEp, &[], &place, 4) as usize;
            for c in 0..2 {
                let b = &disp[place.recv_offset as usize + 2 * c..][..2];
                let v = f32::from_bits(u32::from(u16::from_le_bytes([b[0], b[1]])) << 16);
                out[at + 2 * c..at + 2 * c + 2]
                    .copy_from_slice(&bf16(v * (place.expert + 1) as f32));
            }
        }
        r.repack_partials(
            Dtype::Bf16,
            ExpertLayout::DeepEp,
            cells(&mut out),
            cells(&mut csend),
        );
        write_combine_headers(&r, cells(&mut csend));
        m.start_combine(2).unwrap();
        carry(&mut m, &csend, &mut comb, 64);
        assert_eq!(*m.stage(), Stage::Done);
        let mut y = [f32::NAN; 4];
        m.reduce(
            Dtype::Bf16,
            cells(&mut comb),
            &[],
            Cell::from_mut(&mut y[..]).as_slice_of_cells(),
        );
        // Token 0: x · (0.5 · 1 + 2 · 2); token 1: x · 4 · 2.
        assert_eq!(y, [4.5, -9.0, 24.0, 4.0]);
        assert!((0..3).all(|j| m.slot_combined(j)));
    }
}
