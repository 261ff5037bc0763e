//! The protocol of one step at one rank, as a state machine: the caller posts what
//! [`StepMachine::poll_action`] returns, feeds arrivals ([`StepMachine::handle_arrival`]) and
//! the clock ([`StepMachine::handle_timeout`], due at [`StepMachine::poll_timeout`]); no
//! thread, no clock read, no engine.
//!
//! Every wait has a deadline: two `timeout`s after it was armed for a header, three for an
//! overflow write, five for a combine write (a live peer may enter the step up to one timeout
//! later, or be waiting out deadlines this rank was spared), so a step takes at most ten
//! timeouts beyond the caller's own compute. Every rank waits on every active peer in each
//! phase (combine writes go to every source, rows or not), so a rank dead between phases
//! delays all survivors alike and none falls behind another. A source that misses a
//! deadline, or whose header does not decode, is masked for the rest of the step and reported in
//! [`StepMachine::newly_masked`] for the caller's [`Membership`].

use std::cell::Cell;
use std::collections::VecDeque;

use crate::header::Header;
use crate::imm::{Imm, Phase};
use crate::plan::{decode_combine_header, CountMatrix, Receive, SendPlan, Write};
use crate::{Layout, PlanError};

/// Which ranks a rank still talks to, across steps: a rank masked in a step stays masked
/// until [`clean`](Self::clean).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Membership {
    active: Vec<bool>,
    /// Immediates whose expectations timed out (the engine still owes their arrivals).
    owed: Vec<u32>,
}

impl Membership {
    /// Every rank active.
    pub fn new(ranks: u32) -> Self {
        Self {
            active: vec![true; ranks as usize],
            owed: Vec::new(),
        }
    }

    /// `active[r]`: whether rank `r` is talked to.
    pub fn active(&self) -> &[bool] {
        &self.active
    }

    /// The mask as DeepEP's `query_active_mask` reports it: 1 for active, 0 for masked.
    pub fn mask(&self) -> Vec<u8> {
        self.active.iter().map(|&a| u8::from(a)).collect()
    }

    /// Takes in what a step found: ranks it masked and immediates it gave up on.
    pub fn handle_step(&mut self, step: &StepMachine) {
        for &r in step.newly_masked() {
            self.active[r as usize] = false;
        }
        self.owed.extend_from_slice(step.abandoned_imms());
    }

    /// Every rank active again; returns the immediates to clear (`reset_imm`) once the peers
    /// agree nothing is in flight (the caller's barrier).
    pub fn clean(&mut self) -> Vec<u32> {
        self.active.iter_mut().for_each(|a| *a = true);
        let mut owed = std::mem::take(&mut self.owed);
        owed.sort_unstable();
        owed.dedup();
        owed
    }
}

/// What the caller carries out.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Action {
    /// Post this write.
    Post(Write),
    /// Count one arrival of `imm` (from `source`, for `phase`) and report it.
    Expect {
        /// The immediate.
        imm: u32,
        /// Who sends it.
        source: u32,
        /// Which write.
        phase: Phase,
    },
}

/// Where a step is.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Stage {
    /// Waiting for the dispatch writes.
    Dispatching,
    /// Every dispatch write is here or masked: the rows can be read.
    Dispatched,
    /// Waiting for the combine writes.
    Combining,
    /// Every combine write is here or masked.
    Done,
    /// The step cannot go on (every rank fails alike: a capacity overflow).
    Failed(PlanError),
}

#[derive(Debug, Clone, Copy)]
struct Wait {
    source: u32,
    phase: Phase,
    deadline: u64,
}

/// One step of the protocol at one rank.
#[derive(Debug)]
pub struct StepMachine {
    layout: Layout,
    plan: SendPlan,
    timeout: u64,
    matrix: CountMatrix,
    active: Vec<bool>,
    newly_masked: Vec<u32>,
    abandoned: Vec<u32>,
    waits: Vec<Wait>,
    actions: VecDeque<Action>,
    stage: Stage,
    receive: Option<Receive>,
    /// Valid rows in each peer's combine block (`None` until it arrived).
    combined: Vec<Option<u64>>,
}

impl StepMachine {
    /// Starts a step at `now`: posts the dispatch A writes, arms a wait on every active source.
    /// `timeout` is in the caller's clock units (as `now`).
    pub fn new(layout: &Layout, plan: SendPlan, now: u64, timeout: u64) -> Self {
        let active = plan.active.clone();
        let mut m = Self {
            layout: layout.clone(),
            timeout,
            matrix: CountMatrix::new(layout),
            active,
            newly_masked: Vec::new(),
            abandoned: Vec::new(),
            waits: Vec::new(),
            actions: VecDeque::new(),
            stage: Stage::Dispatching,
            receive: None,
            combined: vec![None; layout.ranks as usize],
            plan,
        };
        for w in m.plan.writes_a() {
            m.actions.push_back(Action::Post(w));
        }
        for s in 0..layout.ranks {
            if m.active[s as usize] {
                m.arm(s, Phase::DispatchA, now);
            }
        }
        m.advance(now);
        m
    }

    fn imm(&self, source: u32, phase: Phase) -> u32 {
        Imm {
            tag: self.plan.tag,
            epoch: self.plan.epoch,
            phase,
            source,
        }
        .encode()
    }

    fn arm(&mut self, source: u32, phase: Phase, now: u64) {
        // Budgets in timeouts. A live peer may enter the step up to one timeout after this
        // rank (its previous step ended later); its headers may complete up to a header
        // budget after ours, so its overflow comes up to then; and its combine can follow its
        // own dispatch waits (headers and overflow) this rank was spared.
        let budget = match phase {
            Phase::DispatchA => 2,
            Phase::DispatchB => 3,
            Phase::Combine => 5,
        };
        self.waits.push(Wait {
            source,
            phase,
            deadline: now.saturating_add(budget * self.timeout),
        });
        self.actions.push_back(Action::Expect {
            imm: self.imm(source, phase),
            source,
            phase,
        });
    }

    /// The next thing to carry out.
    pub fn poll_action(&mut self) -> Option<Action> {
        self.actions.pop_front()
    }

    /// Where the step is.
    pub fn stage(&self) -> &Stage {
        &self.stage
    }

    /// The layout the step runs on.
    pub fn layout(&self) -> &Layout {
        &self.layout
    }

    /// The plan of this rank's sends.
    pub fn plan(&self) -> &SendPlan {
        &self.plan
    }

    /// What this rank received, once [`Stage::Dispatched`].
    pub fn receive(&self) -> Option<&Receive> {
        self.receive.as_ref()
    }

    /// The headers held.
    pub fn matrix(&self) -> &CountMatrix {
        &self.matrix
    }

    /// Ranks this step masked (missed a deadline, sent a bad header, or failed a write).
    pub fn newly_masked(&self) -> &[u32] {
        &self.newly_masked
    }

    /// Immediates whose waits were given up (their arrivals may still land).
    pub fn abandoned_imms(&self) -> &[u32] {
        &self.abandoned
    }

    /// The step's view of who is active (the membership's, less what this step masked).
    pub fn active(&self) -> &[bool] {
        &self.active
    }

    /// The earliest deadline of a wait, if any.
    pub fn poll_timeout(&self) -> Option<u64> {
        self.waits.iter().map(|w| w.deadline).min()
    }

    /// The source of the header that `handle_arrival` needs for an A arrival, and where it
    /// sits: the offset of `source`'s slot in the dispatch region.
    pub fn header_offset(&self, source: u32) -> u64 {
        u64::from(self.plan.set()) * self.layout.dispatch_region_bytes()
            + self.layout.slot_offset(source)
    }

    /// Where `peer`'s combine block header sits in this rank's combine region.
    pub fn combine_header_offset(&self, peer: u32) -> u64 {
        self.plan.combine_block_offset(peer)
    }

    /// An immediate landed here, with the bytes it announces the header of (the count header
    /// at [`header_offset`](Self::header_offset) for dispatch A, the combine header at
    /// [`combine_header_offset`](Self::combine_header_offset) for combine, nothing for
    /// dispatch B). Returns whether the step took it: another step's, another tag's, a masked
    /// source's or an unexpected immediate is ignored.
    pub fn handle_arrival(&mut self, now: u64, imm: u32, bytes: &[u8]) -> bool {
        let Some(i) = Imm::decode(self.plan.tag, imm) else {
            return false;
        };
        if i.epoch != self.plan.epoch % crate::IMM_EPOCHS {
            return false;
        }
        let Some(at) = self
            .waits
            .iter()
            .position(|w| w.source == i.source && w.phase == i.phase)
        else {
            return false;
        };
        self.waits.swap_remove(at);
        match i.phase {
            Phase::DispatchA => {
                match Header::decode(&self.layout, self.plan.epoch, i.source, bytes) {
                    Ok(h) => self.matrix.headers[i.source as usize] = Some(h),
                    Err(_) => self.mask(i.source),
                }
            }
            Phase::DispatchB => {}
            Phase::Combine => {
                let rows = self.plan.combine_rows_from(i.source);
                match decode_combine_header(bytes, self.plan.epoch, i.source, rows) {
                    Some(valid) => self.combined[i.source as usize] = Some(valid),
                    None => self.mask(i.source),
                }
            }
        }
        self.advance(now);
        true
    }

    /// A write this rank posted to `peer` failed: the peer is masked.
    pub fn handle_send_failed(&mut self, now: u64, peer: u32) {
        if self.active[peer as usize] {
            let waits: Vec<Wait> = self
                .waits
                .iter()
                .copied()
                .filter(|w| w.source == peer)
                .collect();
            for w in waits {
                self.abandoned.push(self.imm(w.source, w.phase));
            }
            self.waits.retain(|w| w.source != peer);
            self.mask(peer);
            self.advance(now);
        }
    }

    /// The clock reached `now`: every wait past its deadline masks its source.
    pub fn handle_timeout(&mut self, now: u64) {
        let (late, keep): (Vec<Wait>, Vec<Wait>) =
            self.waits.iter().partition(|w| w.deadline <= now);
        if late.is_empty() {
            return;
        }
        self.waits = keep;
        for w in late {
            self.abandoned.push(self.imm(w.source, w.phase));
            self.mask(w.source);
        }
        self.advance(now);
    }

    fn mask(&mut self, source: u32) {
        if self.active[source as usize] {
            self.active[source as usize] = false;
            self.newly_masked.push(source);
        }
        // Its header stays: the overflow offsets were computed with it.
        self.combined[source as usize] = None;
        // Its other waits end with it: a masked source is neither sent to nor waited for.
        let gone: Vec<Wait> = self
            .waits
            .iter()
            .copied()
            .filter(|w| w.source == source)
            .collect();
        for w in gone {
            self.abandoned.push(self.imm(w.source, w.phase));
        }
        self.waits.retain(|w| w.source != source);
    }

    fn waiting(&self, phase: Phase) -> bool {
        self.waits.iter().any(|w| w.phase == phase)
    }

    fn advance(&mut self, now: u64) {
        loop {
            match self.stage {
                Stage::Dispatching if self.receive.is_none() && !self.waiting(Phase::DispatchA) => {
                    self.headers_in(now);
                }
                Stage::Dispatching if self.receive.is_some() && !self.waiting(Phase::DispatchB) => {
                    self.rebuild_receive();
                    self.stage = Stage::Dispatched;
                }
                Stage::Combining if !self.waiting(Phase::Combine) => self.stage = Stage::Done,
                _ => return,
            }
        }
    }

    /// Every header is here or masked: the overflow, exchanged with the peers that agree on
    /// it. This rank takes part only when every rank it talked to at the start of the step
    /// sent its header in time (so it holds the same headers as every such peer), and only
    /// with peers whose header carries its own membership (so they hold those headers too).
    fn headers_in(&mut self, now: u64) {
        let l = &self.layout;
        let whole = self.newly_masked.is_empty();
        let mine = self.plan.header.membership;
        let agree: Vec<bool> = (0..l.ranks)
            .map(|s| {
                whole
                    && self.matrix.headers[s as usize]
                        .as_ref()
                        .is_some_and(|h| h.membership == mine)
            })
            .collect();
        if whole {
            match self.plan.writes_b(&self.matrix, &agree) {
                Ok(writes) => self.actions.extend(writes.into_iter().map(Action::Post)),
                Err(e) => {
                    self.stage = Stage::Failed(e);
                    return;
                }
            }
        }
        self.receive = Some(Receive::new(
            l,
            self.plan.rank,
            self.plan.epoch,
            self.plan.tag,
            &self.matrix,
            &self.active,
            &agree,
        ));
        let expect = self
            .receive
            .as_ref()
            .map(|r| r.expect_b.clone())
            .unwrap_or_default();
        for s in expect {
            self.arm(s, Phase::DispatchB, now);
        }
    }

    /// A source masked while its overflow was awaited counts as zero tokens.
    fn rebuild_receive(&mut self) {
        let l = &self.layout;
        let Some(r) = &self.receive else { return };
        let take: Vec<bool> = (0..l.ranks).map(|s| r.expect_b.contains(&s)).collect();
        self.receive = Some(Receive::new(
            l,
            self.plan.rank,
            self.plan.epoch,
            self.plan.tag,
            &self.matrix,
            &self.active,
            &take,
        ));
    }

    /// Once [`Stage::Dispatched`]: reads the route record of every row here (`region`: the
    /// dispatch region, both sets), so that [`receive`](Self::receive) has its slots and
    /// expert counts. A source whose records do not decode is masked, as one whose header
    /// does not: its rows count as none.
    pub fn read_routes(&mut self, region: &[Cell<u8>]) -> Result<(), PlanError> {
        if self.stage != Stage::Dispatched {
            return Err(PlanError::Shape(format!(
                "routes read in stage {:?}",
                self.stage
            )));
        }
        loop {
            let Some(r) = self.receive.as_mut() else {
                return Ok(());
            };
            let bad = r.read_routes(region);
            if bad.is_empty() {
                return Ok(());
            }
            for s in bad {
                self.mask(s);
            }
            self.rebuild_receive();
        }
    }

    /// Starts combine at `now` (after [`Stage::Dispatched`] and
    /// [`read_routes`](Self::read_routes), once the expert outputs are in the combine send
    /// buffer with their headers): posts the combine writes and waits for every active peer.
    pub fn start_combine(&mut self, now: u64) -> Result<(), PlanError> {
        if self.stage != Stage::Dispatched || !self.receive.as_ref().is_some_and(|r| r.routed) {
            return Err(PlanError::Shape(format!(
                "combine started in stage {:?} (routes read first)",
                self.stage
            )));
        }
        let writes = self
            .receive
            .as_ref()
            .map(|r| r.writes_combine(&self.matrix))
            .unwrap_or_default();
        for w in writes.into_iter().filter(|w| self.active[w.peer as usize]) {
            self.actions.push_back(Action::Post(w));
        }
        self.stage = Stage::Combining;
        for p in self.plan.combine_sources() {
            if self.active[p as usize] {
                self.arm(p, Phase::Combine, now);
            }
        }
        self.advance(now);
        Ok(())
    }

    /// Whether slot `j` of the plan came back with its expert's output (its peer is active
    /// and its combine header counted it, or counted its row's partial sum when weighted).
    pub fn slot_combined(&self, j: usize) -> bool {
        if self.plan.weighted() {
            return self.row_combined(self.plan.slot_rows[j]);
        }
        let peer = self.plan.slots[j].peer;
        let first = self.plan.slot_start[peer as usize];
        self.active[peer as usize]
            && self.combined[peer as usize].is_some_and(|valid| ((j - first) as u64) < valid)
    }

    /// Whether row `i`'s partial sum came back (weighted steps).
    pub fn row_combined(&self, i: usize) -> bool {
        let peer = self.plan.rows[i].peer;
        let first = self.plan.peer_start[peer as usize];
        self.plan.weighted()
            && self.active[peer as usize]
            && self.combined[peer as usize].is_some_and(|valid| ((i - first) as u64) < valid)
    }
}

#[cfg(test)]
mod tests;
