//! Why one file: it is one harness — the fabric model, the ranks, the fault schedules and the
//! checks made at every step share one virtual clock and one world state; its parts are not
//! separable concerns but the pieces of a single simulation (the unit tests of the planner and
//! the decoders live beside their code).
//!
//! Seeded schedules: two to four ranks running [`StepMachine`]s step after step on one virtual
//! clock over a model of the fabric (every write lands after its own jitter, in any order;
//! bytes copied as they land), with a rank that dies before a step, one that dies half-way
//! through its dispatch, and one that hangs (its writes land long after every deadline, into
//! later steps). Checked at every step: each live rank finishes within its deadlines; every
//! row it reads is the byte-exact row of this step from the source the plan says; every row a
//! live rank sent a live rank comes back with its expert's output; the masks name exactly the
//! failed rank; the steps after it are exact.

use super::*;
use crate::plan::encode_combine_header;
use crate::{ExpertMap, SendPlan};
use std::cell::Cell;
use std::collections::BTreeMap;

const ROW: u64 = 16;
const TIMEOUT: u64 = 1_000;
const JITTER: u64 = 50;

#[derive(Debug, Clone, Copy, PartialEq)]
enum Fault {
    None,
    /// Gone from this step on: posts nothing, takes nothing.
    Dead {
        rank: u32,
        step: u32,
    },
    /// Posts its dispatch A of `step` to the ranks in the mask `reaches` only, then is gone.
    DiesInDispatch {
        rank: u32,
        step: u32,
        reaches: u32,
    },
    /// Finishes its dispatch of `step` (its writes land), then is gone before combine.
    DiesAfterDispatch {
        rank: u32,
        step: u32,
    },
    /// From this step on every write it posts lands `delay` later.
    Hung {
        rank: u32,
        step: u32,
        delay: u64,
    },
}

struct Landing {
    write: Write,
    data: Vec<u8>,
}

struct Rank {
    send: Vec<u8>,
    disp: Vec<u8>,
    csend: Vec<u8>,
    comb: Vec<u8>,
    membership: Membership,
    machine: Option<StepMachine>,
    combining: bool,

    counter: std::collections::HashMap<u32, u32>,
    expected: std::collections::HashSet<u32>,
    /// The step this rank is in (each rank goes on as soon as it finished the last one).
    step: u32,
    started_at: u64,
    /// Dead or dying: takes nothing, posts nothing more.
    gone: bool,
    finished: bool,
}

fn row(a: u32, b: u32, c: u32, d: u32) -> [u8; 16] {
    let mut out = [0u8; 16];
    for (i, w) in [a, b, c, d].into_iter().enumerate() {
        out[4 * i..4 * i + 4].copy_from_slice(&w.to_le_bytes());
    }
    out
}

fn read_row(buf: &[u8], at: u64) -> [u32; 4] {
    let at = at as usize;
    std::array::from_fn(|i| u32::from_le_bytes(buf[at + 4 * i..at + 4 * i + 4].try_into().unwrap()))
}

struct World {
    layout: Layout,
    map: ExpertMap,
    ranks: Vec<Rank>,
    fabric: BTreeMap<(u64, u64), Landing>,
    seq: u64,
    now: u64,
    rng: fastrand::Rng,
    fault: Fault,
    /// Writes that landed during a later step than the one that posted them.
    stale_landings: u64,
    /// `routings[step][rank]`.
    routings: Vec<Vec<Vec<i64>>>,
    /// `weighted[step][rank]`: the rank gives its weights at dispatch (partial sums back).
    weighted: Vec<Vec<bool>>,
}

impl World {
    fn new(seed: u64, layout: Layout, fault: Fault) -> Self {
        layout.validate().unwrap();
        let two = |n: u64| vec![0xAAu8; (2 * n) as usize];
        Self {
            map: ExpertMap::identity(&layout),
            ranks: (0..layout.ranks)
                .map(|_| Rank {
                    send: two(layout.send_buffer_bytes()),
                    disp: two(layout.dispatch_region_bytes()),
                    csend: two(layout.combine_send_bytes()),
                    comb: two(layout.combine_region_bytes()),
                    membership: Membership::new(layout.ranks),
                    machine: None,
                    combining: false,

                    counter: Default::default(),
                    expected: Default::default(),
                    step: 0,
                    started_at: 0,
                    gone: false,
                    finished: false,
                })
                .collect(),
            layout,
            fabric: BTreeMap::new(),
            seq: 0,
            now: 0,
            rng: fastrand::Rng::with_seed(seed),
            fault,
            stale_landings: 0,
            routings: Vec::new(),
            weighted: Vec::new(),
        }
    }

    fn dead(&self, rank: u32) -> bool {
        self.ranks[rank as usize].gone
    }

    /// A rank whose results this step are not checked (dead, dying, hung).
    fn failed(&self, rank: u32, step: u32) -> bool {
        match self.fault {
            Fault::None => false,
            Fault::Dead { rank: r, step: s }
            | Fault::DiesInDispatch {
                rank: r, step: s, ..
            }
            | Fault::DiesAfterDispatch { rank: r, step: s }
            | Fault::Hung {
                rank: r, step: s, ..
            } => r == rank && step >= s,
        }
    }

    fn routing(&mut self, tokens: u32) -> Vec<i64> {
        let experts = self.map.logical_experts() as i64;
        let k = self.layout.top_k as usize;
        let mut ids = Vec::new();
        for _ in 0..tokens {
            let mut picked: Vec<i64> = Vec::new();
            for _ in 0..k {
                let e = if self.rng.u8(..) < 20 {
                    -1
                } else {
                    self.rng.i64(0..experts)
                };
                picked.push(if e >= 0 && picked.contains(&e) { -1 } else { e });
            }
            ids.extend(picked);
        }
        ids
    }

    fn pump_rank(&mut self, r: u32) {
        if self.dead(r) {
            return;
        }
        let step = self.ranks[r as usize].step;
        let mut dies = false;
        while let Some(a) = self.ranks[r as usize]
            .machine
            .as_mut()
            .and_then(StepMachine::poll_action)
        {
            let w = match a {
                Action::Post(w) => w,
                // The ImmCounter: arrivals before the expectation are counted, and consumed by it.
                Action::Expect { imm, .. } => {
                    let rk = &mut self.ranks[r as usize];
                    match rk.counter.get_mut(&imm) {
                        Some(n) if *n > 0 => {
                            *n -= 1;
                            self.notify(r, imm);
                        }
                        _ => {
                            rk.expected.insert(imm);
                        }
                    }
                    continue;
                }
            };
            if let Fault::DiesInDispatch {
                rank,
                step: s,
                reaches,
            } = self.fault
            {
                if rank == r && s == step {
                    dies = true;
                    if w.phase != Phase::DispatchA || reaches & (1 << w.peer) == 0 {
                        continue;
                    }
                }
            }
            let region = if w.phase == Phase::Combine {
                &self.ranks[r as usize].csend
            } else {
                &self.ranks[r as usize].send
            };
            let data = region[w.src_offset as usize..(w.src_offset + w.len) as usize].to_vec();
            let mut at = self.now + 1 + self.rng.u64(0..JITTER);
            if let Fault::Hung {
                rank,
                step: s,
                delay,
            } = self.fault
            {
                if rank == r && step >= s {
                    at += delay;
                }
            }
            self.seq += 1;
            self.fabric
                .insert((at, self.seq), Landing { write: w, data });
        }
        if dies {
            self.ranks[r as usize].gone = true;
        }
    }

    /// Hands rank `r`'s machine an arrival of `imm`, with the header it announces.
    fn notify(&mut self, r: u32, imm: u32) {
        let Some(i) = Imm::decode(0xE, imm) else {
            return;
        };
        let rk = &mut self.ranks[r as usize];
        let Some(m) = rk.machine.as_mut() else { return };
        let bytes: Vec<u8> = match i.phase {
            Phase::DispatchA => {
                let at = m.header_offset(i.source) as usize;
                rk.disp[at..at + self.layout.header_bytes() as usize].to_vec()
            }
            Phase::Combine => {
                let at = m.combine_header_offset(i.source) as usize;
                rk.comb[at..at + 64].to_vec()
            }
            Phase::DispatchB => Vec::new(),
        };
        m.handle_arrival(self.now, imm, &bytes);
    }

    fn maybe_combine(&mut self, r: u32) {
        if self.dead(r) {
            return;
        }
        let epoch = self.ranks[r as usize].step;
        let checked = !self.failed(r, epoch);
        let rk = &mut self.ranks[r as usize];
        let Some(m) = rk.machine.as_mut() else { return };
        if rk.combining || *m.stage() != Stage::Dispatched {
            return;
        }
        rk.combining = true;
        if let Fault::DiesAfterDispatch { rank, step } = self.fault {
            if rank == r && step == epoch {
                rk.gone = true;
                return;
            }
        }
        m.read_routes(Cell::from_mut(rk.disp.as_mut_slice()).as_slice_of_cells())
            .unwrap();
        let recv = m.receive().unwrap().clone();
        // What landed is exactly this step's row from the source the plan names, and each slot
        // its route record names goes to the expert the routing chose; the expert "computes"
        // its answer (the token and slot with the expert's rank and a marker) into the combine
        // send buffer.
        let k = self.layout.top_k as usize;
        for (j, sl) in recv.slots.iter().enumerate() {
            let rr = recv.rows[sl.row as usize];
            let weighted = recv.weighted[rr.source as usize];
            let got = read_row(&rk.disp, rr.offset);
            if checked {
                assert_eq!(
                    got[0], epoch,
                    "rank {r}: row {rr:?} is from step {} (step {epoch})",
                    got[0]
                );
                assert_eq!(
                    got[1], rr.source,
                    "rank {r}: row {rr:?} came from {}",
                    got[1]
                );
                let (token, slot) = (got[2] as usize, sl.slot as usize);
                let e = self.routings[epoch as usize][rr.source as usize][token * k + slot];
                let p = self.map.physical(e as usize, token, slot, k);
                assert_eq!(
                    (
                        p / self.layout.experts_per_rank,
                        p % self.layout.experts_per_rank
                    ),
                    (r, sl.expert),
                    "rank {r}: slot {sl:?} of row {rr:?}"
                );
            }
            // A weighted source gets one partial sum per row (marked as slot u32::MAX).
            let (out, at) = if weighted {
                let at = recv.combine_send_partial_offset(sl.row as usize);
                (row(epoch + 1_000_000, r, got[2], u32::MAX), at as usize)
            } else {
                let at = recv.combine_send_slot_offset(j);
                (row(epoch + 1_000_000, r, got[2], sl.slot), at as usize)
            };
            rk.csend[at..at + 16].copy_from_slice(&out);
        }
        for s in 0..self.layout.ranks {
            if recv.sources[s as usize] {
                let at = recv.combine_send_offset(s) as usize;
                rk.csend[at..at + 64].copy_from_slice(&encode_combine_header(
                    epoch,
                    r,
                    recv.combine_valid(s),
                ));
            }
        }
        m.start_combine(self.now).unwrap();
    }

    fn deliver(&mut self, landing: Landing) {
        let Landing { write: w, data } = landing;
        let dst = w.peer;
        if Imm::decode(0xE, w.imm).is_some_and(|i| i.epoch != self.ranks[dst as usize].step) {
            self.stale_landings += 1;
        }
        let rk = &mut self.ranks[dst as usize];
        let region = if w.phase == Phase::Combine {
            &mut rk.comb
        } else {
            &mut rk.disp
        };
        let end = (w.dst_offset + w.len) as usize;
        assert!(
            end <= region.len(),
            "a write past the end of rank {dst}'s region"
        );
        region[w.dst_offset as usize..end].copy_from_slice(&data);
        if self.dead(dst) {
            return;
        }
        if self.ranks[dst as usize].expected.remove(&w.imm) {
            self.notify(dst, w.imm);
        } else {
            *self.ranks[dst as usize].counter.entry(w.imm).or_default() += 1;
        }
    }

    /// Starts rank `r`'s current step (or stops it, if it dies there).
    fn start_step(&mut self, r: u32) {
        let step = self.ranks[r as usize].step;
        if let Fault::Dead { rank, step: s } = self.fault {
            if rank == r && step >= s {
                self.ranks[r as usize].gone = true;
                return;
            }
        }
        let ids = self.routings[step as usize][r as usize].clone();
        let weighted = self.weighted[step as usize][r as usize];
        let rk = &mut self.ranks[r as usize];
        rk.combining = false;
        rk.started_at = self.now;
        let mut plan = SendPlan::new(
            &self.layout,
            &self.map,
            r,
            step,
            0xE,
            &ids,
            rk.membership.active(),
        )
        .unwrap();
        if weighted {
            plan = plan.with_weights(&vec![1.0; ids.len()]).unwrap();
        }
        // Each row says which step, source and token it is; its route record follows.
        for (i, sr) in plan.rows.iter().enumerate() {
            let at = plan.row_offset(i) as usize;
            rk.send[at..at + 16].copy_from_slice(&row(step, r, sr.token, 0));
            let route = plan.route_record(i);
            rk.send[at + 16..at + 16 + route.len()].copy_from_slice(&route);
        }
        let hb = plan.header.encode(&self.layout);
        for p in 0..self.layout.ranks {
            let at = plan.block_offset(p) as usize;
            rk.send[at..at + hb.len()].copy_from_slice(&hb);
        }
        rk.machine = Some(StepMachine::new(&self.layout, plan, self.now, TIMEOUT));
    }

    /// Runs `steps` steps; each rank goes on to its next step as soon as it finished one (so
    /// ranks lag one another as they would), `check(world, rank, step)` at each end.
    fn run_steps(&mut self, steps: u32, mut check: impl FnMut(&World, u32, u32)) {
        let tokens: Vec<Vec<u32>> = (0..steps)
            .map(|_| {
                (0..self.layout.ranks)
                    .map(|_| self.rng.u32(0..=self.layout.max_tokens))
                    .collect()
            })
            .collect();
        self.routings = tokens
            .iter()
            .map(|t| t.iter().map(|&n| self.routing(n)).collect())
            .collect();
        let partial = self.layout.partial_row_bytes > 0;
        self.weighted = tokens
            .iter()
            .map(|t| t.iter().map(|_| partial && self.rng.bool()).collect())
            .collect();
        for r in 0..self.layout.ranks {
            self.start_step(r);
        }
        for _ in 0..1_000_000 {
            for r in 0..self.layout.ranks {
                loop {
                    if self.dead(r) || self.ranks[r as usize].finished {
                        break;
                    }
                    self.pump_rank(r);
                    self.maybe_combine(r);
                    self.pump_rank(r);
                    if self.dead(r) {
                        break;
                    }
                    let rk = &mut self.ranks[r as usize];
                    let m = rk.machine.as_ref().unwrap();
                    if !matches!(m.stage(), Stage::Done | Stage::Failed(_)) {
                        break;
                    }
                    let took = self.now - rk.started_at;
                    assert!(
                        took <= 10 * TIMEOUT + 3 * JITTER,
                        "rank {r} took {took} (ten timeouts of {TIMEOUT})"
                    );
                    rk.membership.handle_step(m);
                    let step = rk.step;
                    check(self, r, step);
                    let rk = &mut self.ranks[r as usize];
                    rk.step += 1;
                    if rk.step == steps {
                        rk.finished = true;
                    } else {
                        self.start_step(r);
                    }
                }
            }
            let live: Vec<u32> = (0..self.layout.ranks)
                .filter(|&r| !self.dead(r) && !self.ranks[r as usize].finished)
                .collect();
            if live.is_empty() {
                return;
            }
            let next_landing = self.fabric.keys().next().map(|k| k.0);
            let next_timeout = live
                .iter()
                .filter_map(|&r| self.ranks[r as usize].machine.as_ref()?.poll_timeout())
                .min();
            let landing_first = match (next_landing, next_timeout) {
                (None, None) => panic!("nothing left to happen and not every rank finished"),
                (Some(l), Some(t)) => l <= t,
                (l, _) => l.is_some(),
            };
            if landing_first {
                let (key, landing) = self.fabric.pop_first().unwrap();
                self.now = self.now.max(key.0);
                self.deliver(landing);
            } else {
                self.now = self.now.max(next_timeout.unwrap());
                for r in live {
                    if let Some(m) = self.ranks[r as usize].machine.as_mut() {
                        m.handle_timeout(self.now);
                    }
                }
            }
        }
        panic!("the schedule did not end");
    }

    /// Every slot rank `r` sent a healthy rank in `step` came back with its expert's exact
    /// output when `exact`; what came back is never wrong.
    fn check_combine(&self, r: u32, step: u32, exact: bool) {
        let rk = &self.ranks[r as usize];
        let m = rk.machine.as_ref().unwrap();
        if matches!(m.stage(), Stage::Failed(_)) {
            return;
        }
        let plan = m.plan();
        if plan.weighted() {
            for (i, sr) in plan.rows.iter().enumerate() {
                let healthy = !self.failed(sr.peer, step);
                if m.row_combined(i) {
                    let got = read_row(&rk.comb, plan.combine_partial_offset(i));
                    assert_eq!(
                        got,
                        [step + 1_000_000, sr.peer, sr.token, u32::MAX],
                        "rank {r} row {i} of step {step}"
                    );
                } else if exact && healthy {
                    panic!(
                        "rank {r}: row {i} ({sr:?}) to a healthy rank did not come back in step {step} ({:?}, masks {:?})",
                        self.fault,
                        self.masks()
                    );
                }
            }
            return;
        }
        for (i, sr) in plan.slots.iter().enumerate() {
            let healthy = !self.failed(sr.peer, step);
            if m.slot_combined(i) {
                let got = read_row(&rk.comb, plan.combine_slot_offset(i));
                assert_eq!(
                    got,
                    [step + 1_000_000, sr.peer, sr.token, sr.slot],
                    "rank {r} row {i} of step {step}"
                );
            } else if exact && healthy {
                panic!(
                    "rank {r}: slot {i} ({sr:?}) to a healthy rank did not come back in step {step} ({:?}, masks {:?})",
                    self.fault,
                    self.masks()
                );
            }
        }
    }

    fn masks(&self) -> Vec<Vec<u8>> {
        self.ranks.iter().map(|r| r.membership.mask()).collect()
    }
}

fn run(seed: u64, fault: Fault, overflow: bool) -> u64 {
    let mut rng = fastrand::Rng::with_seed(seed);
    let ranks = rng.u32(2..=4);
    let experts_per_rank = [1, 4][rng.usize(..2)];
    let top_k = [1, 2, 8][rng.usize(..3)].min(ranks * experts_per_rank);
    let max_tokens = rng.u32(1..=6);
    let (private, overflow_rows) = if overflow {
        (rng.u32(0..=3), ranks * max_tokens)
    } else {
        (max_tokens, 0)
    };
    let fault = match fault {
        Fault::Dead { step, .. } => Fault::Dead {
            rank: rng.u32(0..ranks),
            step,
        },
        Fault::DiesInDispatch { step, .. } => Fault::DiesInDispatch {
            rank: rng.u32(0..ranks),
            step,
            reaches: rng.u32(..),
        },
        Fault::Hung { step, delay, .. } => Fault::Hung {
            rank: rng.u32(0..ranks),
            step,
            delay,
        },
        Fault::DiesAfterDispatch { step, .. } => Fault::DiesAfterDispatch {
            rank: rng.u32(0..ranks),
            step,
        },
        Fault::None => Fault::None,
    };
    let layout = Layout {
        ranks,
        experts_per_rank,
        top_k,
        max_tokens,
        row_bytes: ROW,
        combine_row_bytes: ROW,
        partial_row_bytes: ROW,
        private_rows: private,
        overflow_rows,
    };
    let mut w = World::new(seed, layout, fault);
    // A rank dying half-way through dispatch can leave survivors out of step with one
    // another (some masked it at its header, some waited for its combine): they may mask
    // each other (a conservative outcome) until clean(), so there only "never wrong" and
    // "the failed rank is masked" are checked.
    let exact_mask = !matches!(fault, Fault::DiesInDispatch { .. });
    w.run_steps(8, |w, r, step| match fault {
        Fault::None => {
            assert!(
                w.masks()[r as usize].iter().all(|&a| a == 1),
                "seed {seed}: a mask without a fault"
            );
            w.check_combine(r, step, true);
        }
        Fault::Dead { rank, step: s }
        | Fault::DiesInDispatch { rank, step: s, .. }
        | Fault::DiesAfterDispatch { rank, step: s }
        | Fault::Hung { rank, step: s, .. } => {
            if w.failed(r, step) {
                return;
            }
            // Exact from the step after the failure on: the failed rank masked, everyone
            // else's rows all there.
            w.check_combine(r, step, step > s && exact_mask);
            if step >= s {
                let mask = &w.masks()[r as usize];
                assert_eq!(
                    mask[rank as usize], 0,
                    "seed {seed}: rank {r} did not mask rank {rank} by step {step}"
                );
                if exact_mask {
                    let others: Vec<u32> = (0..ranks)
                        .filter(|&q| q != rank && mask[q as usize] == 0)
                        .collect();
                    assert!(
                        others.is_empty(),
                        "seed {seed}: rank {r} also masked {others:?} ({fault:?})"
                    );
                }
            }
        }
    });
    // clean(): everyone active again, the abandoned immediates handed back for reset_imm.
    if !matches!(fault, Fault::None) {
        let owed = w.ranks[0].membership.clone().clean();
        assert!(owed.windows(2).all(|p| p[0] < p[1]));
    }
    w.stale_landings
}

#[test]
fn schedules_without_faults_are_exact() {
    for seed in 0..300 {
        let _ = run(seed, Fault::None, seed % 2 == 0);
    }
}

#[test]
fn a_rank_dead_before_a_step_is_masked_by_exactly_everyone_else() {
    for seed in 0..300 {
        let _ = run(
            seed,
            Fault::Dead {
                rank: 0,
                step: (seed % 3) as u32,
            },
            seed % 2 == 0,
        );
    }
}

#[test]
fn a_rank_dying_between_dispatch_and_combine_delays_every_survivor_alike() {
    for seed in 0..300 {
        let _ = run(
            seed,
            Fault::DiesAfterDispatch {
                rank: 0,
                step: (seed % 3) as u32,
            },
            seed % 2 == 0,
        );
    }
}

#[test]
fn a_rank_dying_half_way_through_dispatch() {
    for seed in 0..300 {
        let _ = run(
            seed,
            Fault::DiesInDispatch {
                rank: 0,
                step: (seed % 3) as u32,
                reaches: 0,
            },
            seed % 2 == 0,
        );
    }
}

#[test]
fn a_hung_rank_whose_writes_land_steps_later_never_corrupts_them() {
    let mut stale = 0;
    for seed in 0..300 {
        stale += run(
            seed,
            Fault::Hung {
                rank: 0,
                step: 1,
                delay: 2 * TIMEOUT + 100 + (seed % 10) * 100,
            },
            seed % 2 == 0,
        );
    }
    assert!(
        stale > 100,
        "the hung rank's writes should land in later steps ({stale} did)"
    );
}

#[test]
fn a_header_that_does_not_decode_masks_its_source() {
    let layout = Layout::worst_case(2, 1, 1, 2, ROW);
    let map = ExpertMap::identity(&layout);
    let plan = SendPlan::new(&layout, &map, 0, 3, 0xE, &[1, 0], &[true, true]).unwrap();
    let mut m = StepMachine::new(&layout, plan, 0, TIMEOUT);
    let imm = |source| {
        Imm {
            tag: 0xE,
            epoch: 3,
            phase: Phase::DispatchA,
            source,
        }
        .encode()
    };
    // A late arrival of step 1 (same buffer set) is not this step's.
    assert!(!m.handle_arrival(
        1,
        Imm {
            tag: 0xE,
            epoch: 1,
            phase: Phase::DispatchA,
            source: 1
        }
        .encode(),
        &[]
    ));
    assert!(m.handle_arrival(2, imm(1), &[0u8; 128]));
    assert_eq!(m.newly_masked(), [1]);
    let own = Header {
        epoch: 3,
        source: 0,
        membership: crate::membership_digest(&[true, true]),
        rows: vec![1, 1],
        slots: vec![1, 1],
        weighted: false,
    }
    .encode(&layout);
    assert!(m.handle_arrival(3, imm(0), &own));
    assert_eq!(*m.stage(), Stage::Dispatched);
    assert_eq!(
        m.receive().unwrap().sent,
        [1, 0],
        "the masked source counts as zero tokens"
    );
}

#[test]
fn an_overflowing_step_fails_alike_everywhere() {
    let layout = Layout {
        ranks: 2,
        experts_per_rank: 1,
        top_k: 1,
        max_tokens: 3,
        row_bytes: ROW,
        combine_row_bytes: ROW,
        partial_row_bytes: 0,
        private_rows: 1,
        overflow_rows: 1,
    };
    let map = ExpertMap::identity(&layout);
    // Both ranks send three rows to rank 1: two each past the private slot, one overflow row.
    let plans: Vec<SendPlan> = (0..2)
        .map(|r| SendPlan::new(&layout, &map, r, 0, 0xE, &[1, 1, 1], &[true, true]).unwrap())
        .collect();
    let mut machines: Vec<StepMachine> = plans
        .iter()
        .map(|p| StepMachine::new(&layout, p.clone(), 0, TIMEOUT))
        .collect();
    for m in &mut machines {
        for p in &plans {
            let imm = Imm {
                tag: 0xE,
                epoch: 0,
                phase: Phase::DispatchA,
                source: p.rank,
            }
            .encode();
            m.handle_arrival(1, imm, &p.header.encode(&layout));
        }
        assert!(
            matches!(
                m.stage(),
                Stage::Failed(PlanError::Capacity {
                    receiver: 1,
                    rows: 6,
                    capacity: 3
                })
            ),
            "{:?}",
            m.stage()
        );
    }
}

#[test]
fn a_route_record_that_does_not_decode_masks_its_source() {
    // Two ranks, two experts each, top-2: rank 1 sends rank 0 one row carrying two slots.
    let layout = Layout::worst_case(2, 2, 2, 1, ROW);
    let map = ExpertMap::identity(&layout);
    let plans: Vec<SendPlan> = [[2, 3], [0, 1]]
        .iter()
        .enumerate()
        .map(|(r, ids)| SendPlan::new(&layout, &map, r as u32, 0, 0xE, ids, &[true, true]).unwrap())
        .collect();
    let route_at =
        |m: &StepMachine| (m.header_offset(1) + layout.header_bytes() + layout.row_bytes) as usize;
    for (record, masked) in [
        (vec![0u8, 0, 1, 0], false),
        // Local expert 2 of 2, a row with no slot, one slot fewer than announced.
        (vec![2, 0, 1, 0], true),
        (vec![0xff, 0xff, 0xff, 0xff], true),
        (vec![0, 0, 0xff, 0xff], true),
    ] {
        let mut m = StepMachine::new(&layout, plans[0].clone(), 0, TIMEOUT);
        let mut disp = vec![0u8; 2 * layout.dispatch_region_bytes() as usize];
        for p in &plans {
            let imm = Imm {
                tag: 0xE,
                epoch: 0,
                phase: Phase::DispatchA,
                source: p.rank,
            }
            .encode();
            assert!(m.handle_arrival(1, imm, &p.header.encode(&layout)));
        }
        assert_eq!(*m.stage(), Stage::Dispatched);
        let at = route_at(&m);
        disp[at..at + 4].copy_from_slice(&record);
        m.read_routes(Cell::from_mut(disp.as_mut_slice()).as_slice_of_cells())
            .unwrap();
        let r = m.receive().unwrap();
        if masked {
            assert_eq!(m.newly_masked(), [1], "{record:?}");
            assert_eq!((r.sent[1], r.slots.len()), (0, 0));
        } else {
            assert!(m.newly_masked().is_empty());
            assert_eq!(r.expert_counts, [1, 1]);
            assert_eq!(r.slots_valid, [0, 2]);
        }
        assert!(m.start_combine(2).is_ok());
    }
}
