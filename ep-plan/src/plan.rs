//! The writes of one step: what a rank sends ([`SendPlan`]), what every rank can derive from
//! the headers ([`CountMatrix`]), and what a rank receives and returns ([`Receive`]).
//!
//! Offsets are bytes from the start of a whole region (both buffer sets): set `s` starts at
//! `s ×` the region's bytes per set.
//!
//! One file for the three on purpose: the sender's offsets, the matrix every rank derives
//! from the headers and the receiver's reading of its regions are one set of formulas over one
//! layout (slots, overflow shares, route records, combine blocks) that must agree byte for
//! byte between ranks; the property test drives them together. Kept side by side, a change to
//! one formula is seen beside the others that must change with it.

use std::cell::Cell;

use crate::header::Header;
use crate::imm::{Imm, Phase};
use crate::layout::{ROUTE_NONE, SETS};
use crate::{ExpertMap, Layout, PlanError};

/// Bytes of the header in front of each block of combine rows: magic, epoch, the block's
/// sender, how many of its rows carry data (the rest were never received), padding.
pub const COMBINE_HEADER_BYTES: u64 = 64;
const COMBINE_MAGIC: u32 = 0x5845_5043; // "XEPC"

/// One RDMA write with an immediate.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Write {
    /// The rank written to.
    pub peer: u32,
    /// Which write of the step.
    pub phase: Phase,
    /// The immediate it carries.
    pub imm: u32,
    /// Offset in the sender's region (dispatch send buffer, or combine send buffer).
    pub src_offset: u64,
    /// Offset in the peer's region (dispatch region, or combine region).
    pub dst_offset: u64,
    /// Bytes.
    pub len: u64,
}

/// One row this rank sends: a token's copy for one rank it routes to, followed on the wire by
/// its route record.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct SendRow {
    /// The token.
    pub token: u32,
    /// The rank it goes to.
    pub peer: u32,
}

/// One routed slot this rank sends: a token's top-k slot, carried by the token's row to `peer`;
/// its expert output comes back as one combine row.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct SendSlot {
    /// The token.
    pub token: u32,
    /// Its top-k slot.
    pub slot: u32,
    /// The rank it goes to.
    pub peer: u32,
    /// The local expert there.
    pub expert: u32,
}

/// What one rank sends in a step, from its routing alone (before any header arrives).
#[derive(Debug, Clone)]
pub struct SendPlan {
    layout: Layout,
    /// This rank.
    pub rank: u32,
    /// The step.
    pub epoch: u32,
    /// Four bits for the immediates.
    pub tag: u8,
    /// Ranks this rank still talks to (`false`: masked).
    pub active: Vec<bool>,
    /// Rows in send order: by peer, then token.
    pub rows: Vec<SendRow>,
    /// `rows[peer_start[p]..peer_start[p + 1]]` go to peer `p`.
    pub peer_start: Vec<usize>,
    /// Slots in combine order: by peer, then token, then slot (so the slots of a peer's first
    /// `n` rows are its first slots).
    pub slots: Vec<SendSlot>,
    /// `slots[slot_start[p]..slot_start[p + 1]]` go to peer `p`.
    pub slot_start: Vec<usize>,
    /// `slots[row_slots[i]..row_slots[i + 1]]` travel in row `i`.
    pub row_slots: Vec<usize>,
    /// `slot_rows[j]`: the row slot `j` travels in.
    pub slot_rows: Vec<usize>,
    /// The weights given at dispatch (`tokens × top_k`, [`with_weights`](Self::with_weights)):
    /// they travel in the route records, and combine returns one partial sum per row.
    pub weights: Option<Vec<f32>>,
    /// For each `token × top_k + slot`: its index in `slots`, or `-1` (a `-1` slot, or routed
    /// to a masked rank).
    pub slot_index: Vec<i64>,
    /// Slots routed to a masked rank (their combine contribution is zero), as
    /// `token × top_k + slot`.
    pub masked_slots: Vec<u64>,
    /// This rank's header for the step.
    pub header: Header,
}

impl SendPlan {
    /// Plans rank `rank`'s sends for step `epoch` from its `topk_idx` (`tokens × top_k`
    /// logical expert ids, `-1` for none), skipping ranks masked in `active`.
    pub fn new(
        layout: &Layout,
        map: &ExpertMap,
        rank: u32,
        epoch: u32,
        tag: u8,
        topk_idx: &[i64],
        active: &[bool],
    ) -> Result<Self, PlanError> {
        layout.validate()?;
        let k = layout.top_k as usize;
        let ranks = layout.ranks as usize;
        if rank >= layout.ranks || active.len() != ranks {
            return Err(PlanError::Shape(format!(
                "rank {rank} of {ranks}, active mask of {}",
                active.len()
            )));
        }
        if topk_idx.len() % k != 0 || topk_idx.len() / k > layout.max_tokens as usize {
            return Err(PlanError::Shape(format!(
                "{} ids is not tokens × {k} with at most {} tokens",
                topk_idx.len(),
                layout.max_tokens
            )));
        }
        let experts = map.logical_experts();
        let mut slots = Vec::with_capacity(topk_idx.len());
        let mut masked_slots = Vec::new();
        for (i, &e) in topk_idx.iter().enumerate() {
            let (token, slot) = (i / k, i % k);
            if e == -1 {
                continue;
            }
            if e < 0 || e as usize >= experts {
                return Err(PlanError::Expert {
                    token,
                    slot,
                    expert: e,
                    experts,
                });
            }
            let p = map.physical(e as usize, token, slot, k);
            let (peer, expert) = (p / layout.experts_per_rank, p % layout.experts_per_rank);
            if peer >= layout.ranks {
                return Err(PlanError::Map(format!(
                    "physical expert {p} is past rank {}",
                    layout.ranks
                )));
            }
            if !active[peer as usize] {
                masked_slots.push(i as u64);
                continue;
            }
            slots.push(SendSlot {
                token: token as u32,
                slot: slot as u32,
                peer,
                expert,
            });
        }
        slots.sort_unstable_by_key(|s| (s.peer, s.token, s.slot));
        // One row per (peer, token) run of slots.
        let mut rows: Vec<SendRow> = Vec::new();
        let mut row_slots = Vec::new();
        for (j, s) in slots.iter().enumerate() {
            if rows
                .last()
                .is_none_or(|r| (r.peer, r.token) != (s.peer, s.token))
            {
                rows.push(SendRow {
                    token: s.token,
                    peer: s.peer,
                });
                row_slots.push(j);
            }
        }
        row_slots.push(slots.len());
        let mut slot_rows = vec![0usize; slots.len()];
        for (i, w) in row_slots.windows(2).enumerate() {
            slot_rows[w[0]..w[1]].iter_mut().for_each(|r| *r = i);
        }
        let starts = |peers: &mut dyn Iterator<Item = u32>| {
            let mut start = vec![0usize; ranks + 1];
            for p in peers {
                start[p as usize + 1] += 1;
            }
            for p in 0..ranks {
                start[p + 1] += start[p];
            }
            start
        };
        let peer_start = starts(&mut rows.iter().map(|r| r.peer));
        let slot_start = starts(&mut slots.iter().map(|s| s.peer));
        let mut slot_index = vec![-1i64; topk_idx.len()];
        for (j, s) in slots.iter().enumerate() {
            slot_index[s.token as usize * k + s.slot as usize] = j as i64;
        }
        let count = |start: &[usize]| -> Vec<u32> {
            start.windows(2).map(|w| (w[1] - w[0]) as u32).collect()
        };
        let header = Header {
            epoch,
            source: rank,
            membership: crate::header::membership_digest(active),
            rows: count(&peer_start),
            slots: count(&slot_start),
            weighted: false,
        };
        Ok(Self {
            layout: layout.clone(),
            rank,
            epoch,
            tag,
            active: active.to_vec(),
            rows,
            peer_start,
            slots,
            slot_start,
            row_slots,
            slot_rows,
            weights: None,
            slot_index,
            masked_slots,
            header,
        })
    }

    /// The weights of every slot (`tokens × top_k`, as `topk_weights`), given at dispatch:
    /// they travel in the route records, each receiver sums its slots' outputs of a token
    /// with them (fp32, slots in order) and combine returns one partial sum per row, which
    /// the source adds in rank order. Needs `layout.partial_row_bytes > 0`.
    pub fn with_weights(mut self, weights: &[f32]) -> Result<Self, PlanError> {
        if self.layout.partial_row_bytes == 0 {
            return Err(PlanError::Layout(
                "weights at dispatch need partial_row_bytes > 0".into(),
            ));
        }
        if weights.len() != self.slot_index.len() {
            return Err(PlanError::Shape(format!(
                "{} weights for {} slots",
                weights.len(),
                self.slot_index.len()
            )));
        }
        self.weights = Some(weights.to_vec());
        self.header.weighted = true;
        Ok(self)
    }

    /// Whether combine returns one partial sum per row (weights given at dispatch).
    pub fn weighted(&self) -> bool {
        self.weights.is_some()
    }

    /// The buffer set of this step.
    pub fn set(&self) -> u32 {
        self.epoch % SETS
    }

    fn imm(&self, phase: Phase) -> u32 {
        Imm {
            tag: self.tag,
            epoch: self.epoch,
            phase,
            source: self.rank,
        }
        .encode()
    }

    /// Rows to `peer` (one per token routed there).
    pub fn rows_to(&self, peer: u32) -> u64 {
        (self.peer_start[peer as usize + 1] - self.peer_start[peer as usize]) as u64
    }

    /// Routed slots to `peer`.
    pub fn slots_to(&self, peer: u32) -> u64 {
        (self.slot_start[peer as usize + 1] - self.slot_start[peer as usize]) as u64
    }

    /// Combine rows `peer` sends back: a partial sum per row when weighted, else an output
    /// per slot.
    pub fn combine_rows_from(&self, peer: u32) -> u64 {
        combine_rows(&self.header, peer)
    }

    /// Row `i`'s route record: for each top-k slot, the local expert at the row's peer it goes
    /// to, or [`ROUTE_NONE`] (little-endian `u16`s); with partial sums enabled, then each
    /// slot's weight there (little-endian `f32`, zero for a slot routed elsewhere or without
    /// weights); zero padded to `layout.route_bytes()`.
    pub fn route_record(&self, i: usize) -> Vec<u8> {
        let k = self.layout.top_k as usize;
        let mut entries = vec![ROUTE_NONE; k];
        let mut weights = vec![0f32; k];
        for s in &self.slots[self.row_slots[i]..self.row_slots[i + 1]] {
            entries[s.slot as usize] = s.expert as u16;
            if let Some(w) = &self.weights {
                weights[s.slot as usize] = w[s.token as usize * k + s.slot as usize];
            }
        }
        let mut out: Vec<u8> = entries.iter().flat_map(|e| e.to_le_bytes()).collect();
        if self.layout.partial_row_bytes > 0 {
            out.extend(weights.iter().flat_map(|w| w.to_le_bytes()));
        }
        out.resize(self.layout.route_bytes() as usize, 0);
        out
    }

    /// Offset of `peer`'s block (its header copy, then its rows) in the send buffer.
    pub fn block_offset(&self, peer: u32) -> u64 {
        let l = &self.layout;
        u64::from(self.set()) * l.send_buffer_bytes()
            + u64::from(peer) * l.header_bytes()
            + self.peer_start[peer as usize] as u64 * l.wire_row_bytes()
    }

    /// Offset of row `i` (of [`rows`](Self::rows)) in the send buffer; its route record
    /// follows its `row_bytes`.
    pub fn row_offset(&self, i: usize) -> u64 {
        let peer = self.rows[i].peer;
        self.block_offset(peer)
            + self.layout.header_bytes()
            + (i - self.peer_start[peer as usize]) as u64 * self.layout.wire_row_bytes()
    }

    /// The dispatch A writes: to every active peer (itself included), its header copy and
    /// the rows that fit the private slot.
    pub fn writes_a(&self) -> Vec<Write> {
        let l = &self.layout;
        (0..l.ranks)
            .filter(|&p| self.active[p as usize])
            .map(|p| Write {
                peer: p,
                phase: Phase::DispatchA,
                imm: self.imm(Phase::DispatchA),
                src_offset: self.block_offset(p),
                dst_offset: u64::from(self.set()) * l.dispatch_region_bytes()
                    + l.slot_offset(self.rank),
                len: l.header_bytes()
                    + self.rows_to(p).min(u64::from(l.private_rows)) * l.wire_row_bytes(),
            })
            .collect()
    }

    /// The dispatch B writes to the peers in `to`, once every active rank's header is here:
    /// the rows past each peer's private slot, at this rank's place in the peer's overflow
    /// (masked ranks count as sending none). Fails alike on every rank with the same headers
    /// when any receiver would overflow.
    pub fn writes_b(&self, matrix: &CountMatrix, to: &[bool]) -> Result<Vec<Write>, PlanError> {
        let l = &self.layout;
        matrix.check_capacity()?;
        let mut out = Vec::new();
        for p in (0..l.ranks).filter(|&p| self.active[p as usize] && to[p as usize]) {
            let n = self.rows_to(p);
            let private = u64::from(l.private_rows);
            if n <= private {
                continue;
            }
            let start = matrix.overflow_start(self.rank, p);
            out.push(Write {
                peer: p,
                phase: Phase::DispatchB,
                imm: self.imm(Phase::DispatchB),
                src_offset: self.block_offset(p) + l.header_bytes() + private * l.wire_row_bytes(),
                dst_offset: u64::from(self.set()) * l.dispatch_region_bytes()
                    + l.overflow_offset()
                    + start * l.wire_row_bytes(),
                len: (n - private) * l.wire_row_bytes(),
            });
        }
        Ok(out)
    }

    /// Offset of `peer`'s block (a combine header, then an output per slot or a partial sum
    /// per row) in this rank's combine region: the peers' blocks in rank order, each as long
    /// as what comes back from it.
    pub fn combine_block_offset(&self, peer: u32) -> u64 {
        let before = (0..peer)
            .map(|p| self.combine_rows_from(p) * combine_row(&self.layout, &self.header))
            .sum();
        combine_block(&self.layout, self.set(), peer, before)
    }

    /// Offset of slot `j`'s expert output in the combine region (not weighted).
    pub fn combine_slot_offset(&self, j: usize) -> u64 {
        let peer = self.slots[j].peer;
        self.combine_block_offset(peer)
            + COMBINE_HEADER_BYTES
            + (j - self.slot_start[peer as usize]) as u64 * self.layout.combine_row_bytes
    }

    /// Offset of row `i`'s partial sum in the combine region (weighted).
    pub fn combine_partial_offset(&self, i: usize) -> u64 {
        let peer = self.rows[i].peer;
        self.combine_block_offset(peer)
            + COMBINE_HEADER_BYTES
            + (i - self.peer_start[peer as usize]) as u64 * self.layout.partial_row_bytes
    }

    /// The combine writes this rank expects: one from every active peer, rows or not (so
    /// that every rank waits on the same peers and a dead one delays all alike).
    pub fn combine_sources(&self) -> Vec<u32> {
        (0..self.layout.ranks)
            .filter(|&p| self.active[p as usize])
            .collect()
    }
}

fn combine_block(layout: &Layout, set: u32, peer: u32, bytes_before: u64) -> u64 {
    u64::from(set) * layout.combine_region_bytes()
        + u64::from(peer) * COMBINE_HEADER_BYTES
        + bytes_before
}

/// Combine rows `peer` returns to the source of `header`: a partial sum per row when it is
/// weighted, else an output per slot.
fn combine_rows(header: &Header, peer: u32) -> u64 {
    if header.weighted {
        header.rows_to(peer)
    } else {
        header.slots_to(peer)
    }
}

/// Bytes of a combine row returned to the source of `header`.
fn combine_row(layout: &Layout, header: &Header) -> u64 {
    if header.weighted {
        layout.partial_row_bytes
    } else {
        layout.combine_row_bytes
    }
}

/// The header in front of a block of combine rows.
pub fn encode_combine_header(
    epoch: u32,
    sender: u32,
    valid_rows: u64,
) -> [u8; COMBINE_HEADER_BYTES as usize] {
    let mut out = [0u8; COMBINE_HEADER_BYTES as usize];
    let valid = u32::try_from(valid_rows).unwrap_or(u32::MAX);
    for (i, w) in [COMBINE_MAGIC, epoch, sender, valid]
        .into_iter()
        .enumerate()
    {
        out[4 * i..4 * i + 4].copy_from_slice(&w.to_le_bytes());
    }
    out
}

/// Reads a combine header from `sender` for step `epoch`: how many of the block's `rows`
/// rows carry data; `None` when it is not that step's header from that sender or claims
/// more rows than the block has (untrusted bytes).
pub fn decode_combine_header(bytes: &[u8], epoch: u32, sender: u32, rows: u64) -> Option<u64> {
    if bytes.len() < 16 {
        return None;
    }
    let w = |i: usize| {
        u32::from_le_bytes([
            bytes[4 * i],
            bytes[4 * i + 1],
            bytes[4 * i + 2],
            bytes[4 * i + 3],
        ])
    };
    (w(0) == COMBINE_MAGIC && w(1) == epoch && w(2) == sender && u64::from(w(3)) <= rows)
        .then(|| u64::from(w(3)))
}

/// The headers a rank holds for a step: the count matrix, complete when every rank's arrived.
#[derive(Debug, Clone)]
pub struct CountMatrix {
    layout: Layout,
    /// Each source's header, `None` while it has not arrived (or the source is masked).
    pub headers: Vec<Option<Header>>,
}

impl CountMatrix {
    /// A matrix with no header yet.
    pub fn new(layout: &Layout) -> Self {
        Self {
            layout: layout.clone(),
            headers: vec![None; layout.ranks as usize],
        }
    }

    /// Whether every rank's header is here.
    pub fn complete(&self) -> bool {
        self.headers.iter().all(Option::is_some)
    }

    /// Rows `src` sends `dst`, if its header is here.
    pub fn rows(&self, src: u32, dst: u32) -> Option<u64> {
        self.headers[src as usize].as_ref().map(|h| h.rows_to(dst))
    }

    /// Where `src`'s overflow rows start in `dst`'s overflow: the overflow of every source
    /// before it whose header is here, in rank order (a rank agrees with its peers only when
    /// they hold the same headers: see [`Header::membership`]).
    pub fn overflow_start(&self, src: u32, dst: u32) -> u64 {
        let private = u64::from(self.layout.private_rows);
        (0..src)
            .filter_map(|s| self.rows(s, dst))
            .map(|n| n.saturating_sub(private))
            .sum()
    }

    /// Fails when some receiver gets more rows than its private slots and overflow hold (from
    /// the headers here: every rank with the complete matrix decides alike).
    pub fn check_capacity(&self) -> Result<(), PlanError> {
        let private = u64::from(self.layout.private_rows);
        for d in 0..self.layout.ranks {
            let over: u64 = (0..self.layout.ranks)
                .filter_map(|s| self.rows(s, d))
                .map(|n| n.saturating_sub(private))
                .sum();
            if over > u64::from(self.layout.overflow_rows) {
                let rows = (0..self.layout.ranks).filter_map(|s| self.rows(s, d)).sum();
                return Err(PlanError::Capacity {
                    receiver: d,
                    rows,
                    capacity: self.layout.receive_capacity(),
                });
            }
        }
        Ok(())
    }
}

/// One row a rank received: where it is and what it is.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct RecvRow {
    /// The rank that sent it.
    pub source: u32,
    /// Its index in the source's block for this rank (the source's send order: by token).
    pub index: u32,
    /// Its offset in the dispatch region (its route record follows its `row_bytes`).
    pub offset: u64,
}

/// One routed slot a rank received, from a row's route record.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct RecvSlot {
    /// The row that carried it (index into [`Receive::rows`]).
    pub row: u32,
    /// The top-k slot at its source.
    pub slot: u32,
    /// The local expert it is for.
    pub expert: u32,
    /// Its index among the slots its source sent this rank (the source's combine order).
    pub index: u32,
    /// Its index among its expert's slots (sources in rank order, each in its order).
    pub position: u64,
    /// Its weight, when its source gave weights at dispatch (else 0).
    pub weight: f32,
}

/// What one rank receives in a step and sends back in combine: the rows from the headers it
/// holds, the slots once their route records are read ([`Receive::read_routes`]).
#[derive(Debug, Clone)]
pub struct Receive {
    layout: Layout,
    /// This rank.
    pub rank: u32,
    /// The step.
    pub epoch: u32,
    /// Four bits for the immediates.
    pub tag: u8,
    /// Rows that are here, by source, then the source's order (token).
    pub rows: Vec<RecvRow>,
    /// The sources whose header is here and that are taken (active).
    pub sources: Vec<bool>,
    /// Rows each source sent (from its header; 0 for a masked source).
    pub sent: Vec<u64>,
    /// Rows of each source that are here (its private rows, and its overflow when taken).
    pub valid: Vec<u64>,
    /// Slots each source's rows carry to this rank (from its header).
    pub slots_sent: Vec<u64>,
    /// Sources that gave weights at dispatch (from their headers): combine returns them one
    /// partial sum per row.
    pub weighted: Vec<bool>,
    /// Sources whose overflow write (dispatch B) this rank waits for.
    pub expect_b: Vec<u32>,
    /// Whether the route records were read (`slots`, `slots_valid`, `expert_counts` are set).
    pub routed: bool,
    /// The slots the rows here carry, by source, row, slot.
    pub slots: Vec<RecvSlot>,
    /// `slots[row_slots[i]..row_slots[i + 1]]` came in row `i`.
    pub row_slots: Vec<usize>,
    /// Slots of each source that are here: the combine rows this rank sends it.
    pub slots_valid: Vec<u64>,
    /// `recv_count` per local expert.
    pub expert_counts: Vec<u64>,
}

impl Receive {
    pub(crate) fn layout(&self) -> &Layout {
        &self.layout
    }

    /// What rank `rank` receives from the sources whose header it holds and that `include`
    /// keeps. `overflow[s]` says whether it takes `s`'s overflow rows this step (only with the
    /// complete matrix and nobody masked, so that its offsets match every sender's).
    pub fn new(
        layout: &Layout,
        rank: u32,
        epoch: u32,
        tag: u8,
        matrix: &CountMatrix,
        include: &[bool],
        overflow: &[bool],
    ) -> Self {
        let l = layout;
        let set_base = u64::from(epoch % SETS) * l.dispatch_region_bytes();
        let private = u64::from(l.private_rows);
        let wire = l.wire_row_bytes();
        let mut rows = Vec::new();
        let mut sent = vec![0; l.ranks as usize];
        let mut sources = vec![false; l.ranks as usize];
        let mut valid = vec![0; l.ranks as usize];
        let mut slots_sent = vec![0; l.ranks as usize];
        let mut weighted = vec![false; l.ranks as usize];
        let mut expect_b = Vec::new();
        for s in 0..l.ranks {
            let Some(h) = matrix.headers[s as usize]
                .as_ref()
                .filter(|_| include[s as usize])
            else {
                continue;
            };
            let n = h.rows_to(rank);
            sent[s as usize] = n;
            slots_sent[s as usize] = h.slots_to(rank);
            weighted[s as usize] = h.weighted;
            sources[s as usize] = true;
            let start =
                (overflow[s as usize] && n > private).then(|| matrix.overflow_start(s, rank));
            if start.is_some() {
                expect_b.push(s);
            }
            let here = if start.is_some() { n } else { n.min(private) };
            valid[s as usize] = here;
            for index in 0..here {
                let offset = if index < private {
                    set_base + l.slot_offset(s) + l.header_bytes() + index * wire
                } else {
                    set_base + l.overflow_offset() + (start.unwrap_or(0) + index - private) * wire
                };
                rows.push(RecvRow {
                    source: s,
                    index: index as u32,
                    offset,
                });
            }
        }
        Self {
            layout: l.clone(),
            rank,
            epoch,
            tag,
            rows,
            sources,
            sent,
            valid,
            slots_sent,
            weighted,
            expect_b,
            routed: false,
            slots: Vec::new(),
            row_slots: Vec::new(),
            slots_valid: vec![0; l.ranks as usize],
            expert_counts: vec![0; l.experts_per_rank as usize],
        }
    }

    /// Reads the route record behind every row here (`region`: the dispatch region, both
    /// sets) into [`slots`](Self::slots), [`slots_valid`](Self::slots_valid) and
    /// [`expert_counts`](Self::expert_counts). The records are a peer's bytes: a source
    /// whose records do not decode — an entry neither a local expert nor [`ROUTE_NONE`], a
    /// row with no slot, more slots than its header announced (all of them when every row is
    /// here) — is returned, and its slots are left out.
    pub fn read_routes(&mut self, region: &[Cell<u8>]) -> Vec<u32> {
        let l = &self.layout;
        let (k, e) = (l.top_k as usize, l.experts_per_rank);
        let mut bad = Vec::new();
        let mut slots: Vec<RecvSlot> = Vec::with_capacity(self.rows.len());
        let weights_at = 2 * k;
        let with_weights = l.partial_row_bytes > 0;
        let mut slots_valid = vec![0u64; l.ranks as usize];
        let mut first = 0;
        while first < self.rows.len() {
            let s = self.rows[first].source;
            let end = first
                + self.rows[first..]
                    .iter()
                    .take_while(|r| r.source == s)
                    .count();
            let keep = slots.len();
            let mut ok = true;
            'rows: for (i, r) in self.rows.iter().enumerate().take(end).skip(first) {
                let at = (r.offset + l.row_bytes) as usize;
                let record = region
                    .get(at..at + l.route_bytes() as usize)
                    .unwrap_or_default();
                if record.len() != l.route_bytes() as usize {
                    ok = false;
                    break;
                }
                let weight = |slot: usize| {
                    if !with_weights || !self.weighted[s as usize] {
                        return 0.0;
                    }
                    let w = &record[weights_at + 4 * slot..weights_at + 4 * slot + 4];
                    f32::from_le_bytes([w[0].get(), w[1].get(), w[2].get(), w[3].get()])
                };
                let before = slots.len();
                for (slot, b) in record[..2 * k].chunks_exact(2).enumerate() {
                    let entry = u16::from_le_bytes([b[0].get(), b[1].get()]);
                    if entry == ROUTE_NONE {
                        continue;
                    }
                    if u32::from(entry) >= e {
                        ok = false;
                        break 'rows;
                    }
                    slots.push(RecvSlot {
                        row: i as u32,
                        slot: slot as u32,
                        expert: u32::from(entry),
                        index: (slots.len() - keep) as u32,
                        position: 0,
                        weight: weight(slot),
                    });
                }
                if slots.len() == before {
                    ok = false;
                    break;
                }
            }
            let got = (slots.len() - keep) as u64;
            let announced = self.slots_sent[s as usize];
            let all_here = self.valid[s as usize] == self.sent[s as usize];
            if !ok || got > announced || (all_here && got != announced) {
                slots.truncate(keep);
                bad.push(s);
            } else {
                slots_valid[s as usize] = got;
            }
            first = end;
        }
        // Positions: `slots` is by source, row, slot, so each expert's slots come in the order
        // its place lists them.
        let mut expert_counts = vec![0u64; e as usize];
        for sl in &mut slots {
            sl.position = expert_counts[sl.expert as usize];
            expert_counts[sl.expert as usize] += 1;
        }
        let mut row_slots = vec![0usize; self.rows.len() + 1];
        for sl in &slots {
            row_slots[sl.row as usize + 1] += 1;
        }
        for i in 0..self.rows.len() {
            row_slots[i + 1] += row_slots[i];
        }
        self.row_slots = row_slots;
        self.slots = slots;
        self.slots_valid = slots_valid;
        self.expert_counts = expert_counts;
        self.routed = true;
        bad
    }

    /// The slots in expert-major, source-major order (DeepEP's low-latency layout and the
    /// flat one): for each local expert, each source's in its order (token, then slot).
    /// Indices into [`slots`](Self::slots).
    pub fn expert_order(&self) -> Vec<usize> {
        let mut order: Vec<usize> = (0..self.slots.len()).collect();
        // Stable: `slots` is by source, row, slot already.
        order.sort_by_key(|&j| self.slots[j].expert);
        order
    }

    /// Combine rows this rank returns to source `s`: a partial sum per row here when `s` is
    /// weighted, else an output per slot here.
    pub fn combine_valid(&self, s: u32) -> u64 {
        if self.weighted[s as usize] {
            self.valid[s as usize]
        } else {
            self.slots_valid[s as usize]
        }
    }

    fn combine_len(&self, s: u32) -> u64 {
        let row = if self.weighted[s as usize] {
            self.layout.partial_row_bytes
        } else {
            self.layout.combine_row_bytes
        };
        self.combine_valid(s) * row
    }

    /// Offset of source `s`'s block (combine header, then its slots' outputs or its rows'
    /// partial sums) in this rank's combine send buffer: the sources' blocks in rank order.
    pub fn combine_send_offset(&self, s: u32) -> u64 {
        let before: u64 = (0..s).map(|q| self.combine_len(q)).sum();
        u64::from(self.epoch % SETS) * self.layout.combine_send_bytes()
            + u64::from(s) * COMBINE_HEADER_BYTES
            + before
    }

    /// Offset of received row `i`'s partial sum in the combine send buffer (its source is
    /// weighted).
    pub fn combine_send_partial_offset(&self, i: usize) -> u64 {
        let r = self.rows[i];
        self.combine_send_offset(r.source)
            + COMBINE_HEADER_BYTES
            + u64::from(r.index) * self.layout.partial_row_bytes
    }

    /// Offset of received slot `j`'s expert output in the combine send buffer (its source is
    /// not weighted).
    pub fn combine_send_slot_offset(&self, j: usize) -> u64 {
        let sl = self.slots[j];
        let source = self.rows[sl.row as usize].source;
        self.combine_send_offset(source)
            + COMBINE_HEADER_BYTES
            + u64::from(sl.index) * self.layout.combine_row_bytes
    }

    /// The combine writes: to every source taken (rows or not), its block (a header saying
    /// how many of its slots, or rows when it is weighted, were received, then their outputs
    /// or partial sums, in its order), at its combine region's block for this rank. `matrix`
    /// gives where that block sits.
    pub fn writes_combine(&self, matrix: &CountMatrix) -> Vec<Write> {
        let l = &self.layout;
        let mut out = Vec::new();
        for s in 0..l.ranks {
            if !self.sources[s as usize] {
                continue;
            }
            let Some(h) = &matrix.headers[s as usize] else {
                continue;
            };
            let before: u64 = (0..self.rank)
                .map(|d| combine_rows(h, d) * combine_row(l, h))
                .sum();
            out.push(Write {
                peer: s,
                phase: Phase::Combine,
                imm: Imm {
                    tag: self.tag,
                    epoch: self.epoch,
                    phase: Phase::Combine,
                    source: self.rank,
                }
                .encode(),
                src_offset: self.combine_send_offset(s),
                dst_offset: combine_block(l, self.epoch % SETS, self.rank, before),
                len: COMBINE_HEADER_BYTES + self.combine_len(s),
            });
        }
        out
    }
}
