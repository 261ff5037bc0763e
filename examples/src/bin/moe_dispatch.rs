//! MoE dispatch and combine between ranks whose routing is only known at run time, on the
//! engine's primitives alone (messages, scatter, barriers). MoE as a component — fixed
//! capacity, at most two writes per peer per phase, deadlines and masking, DeepEP's layout —
//! is `xfer-ep-plan` and `xfer.ep` (docs/moe.md); this example stays as the multi-process
//! rendezvous check `cargo xtask test` runs.
//!
//! 1. Each rank routes its tokens to experts (random here), and tells every rank how many
//!    tokens it will get with a small message (`submit_send` / `submit_recvs`).
//! 2. Dispatch: each rank scatters its variable-size token blocks into the owners' receive
//!    buffers (a slot per source rank), then sends a barrier once the scatter completed.
//! 3. Each owner "runs the expert" (adds its expert id to every byte) and combines: it scatters
//!    the results back to where each token came from, then a barrier again.
//! 4. Every rank checks each of its tokens came back transformed by the right expert.
//!
//! `--rank N --world W [--rendezvous URL] [--config FILE]`: each rank is its own process,
//! publishing `moe-N` with its inbox and results regions and finding the others through the
//! rendezvous; the count messages then also carry each token's index, since no rank knows
//! another's routing.
#![forbid(unsafe_code)]

use std::collections::HashMap;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use engine_core::{DoneFlag, HostBuffer, ScatterDst, TransferEngine};
use examples::{byte, fail, open_engines};

const RANKS: usize = 3;
const EXPERTS_PER_RANK: usize = 2;
const TOKENS: usize = 200;
const HIDDEN: usize = 256; // bytes per token
/// The experts rank `r`'s tokens need on rank `o`, keyed by `(r, o)`, as told by messages.
type ExpertLists = HashMap<(usize, usize), Vec<u8>>;

/// The (token, expert) pairs each source rank routed to this rank (multi-process mode).
type RoutedHere = HashMap<usize, Vec<(usize, u8)>>;

const WAIT: Duration = Duration::from_secs(30);

fn wait_all(flags: &[Arc<DoneFlag>], what: &str) {
    for f in flags {
        f.wait(WAIT)
            .unwrap_or_else(|e| fail(format!("{what}: {e}")));
    }
}

fn barrier_all(engines: &[Arc<TransferEngine>], bufs: &[HostBuffer], imm: u32) {
    let landed: Vec<_> = engines
        .iter()
        .map(|e| {
            let f = DoneFlag::new();
            e.expect_imm_count(imm, (RANKS - 1) as u64, f.clone())
                .unwrap_or_else(|e| fail(e));
            f
        })
        .collect();
    for (r, e) in engines.iter().enumerate() {
        let others: Vec<_> = (0..RANKS)
            .filter(|&o| o != r)
            .map(|o| bufs[o].desc().clone())
            .collect();
        let f = DoneFlag::new();
        e.submit_barrier(None, f.clone(), imm, &others)
            .unwrap_or_else(|e| fail(e));
        f.wait(WAIT).unwrap_or_else(|e| fail(e));
    }
    wait_all(&landed, "barrier");
}

/// One rank of the multi-process mode.
fn member(m: examples::Member) {
    let (me, world, engine) = (m.rank, m.world, &m.engine);
    if world > 255 || TOKENS > 255 {
        fail("this example numbers ranks and tokens with one byte");
    }
    let mut rng = fastrand::Rng::with_seed(7 + me as u64);
    let routes: Vec<usize> = (0..TOKENS)
        .map(|_| rng.usize(0..world * EXPERTS_PER_RANK))
        .collect();
    let tokens = HostBuffer::new(engine, TOKENS * HIDDEN).unwrap_or_else(|e| fail(e));
    let fill: Vec<u8> = (0..tokens.len())
        .map(|i| byte(me, i / HIDDEN, i % HIDDEN))
        .collect();
    tokens.write(0, &fill).unwrap_or_else(|e| fail(e));
    let inbox = HostBuffer::new(engine, world * TOKENS * HIDDEN).unwrap_or_else(|e| fail(e));
    let results = HostBuffer::new(engine, TOKENS * HIDDEN).unwrap_or_else(|e| fail(e));
    // (token, expert) pairs each source rank routed here, from its count message.
    let told: Arc<Mutex<RoutedHere>> = Arc::default();
    let sink = Arc::clone(&told);
    engine
        .submit_recvs(1024, 8, move |msg| {
            let pairs = msg[1..].chunks(2).map(|p| (p[0] as usize, p[1])).collect();
            sink.lock().unwrap().insert(msg[0] as usize, pairs);
        })
        .unwrap_or_else(|e| fail(e));
    let _me = m
        .rendezvous
        .publish(
            &format!("moe-{me}"),
            &engine.main_address(),
            &[("inbox", inbox.desc()), ("results", results.desc())],
            m.ttl,
        )
        .unwrap_or_else(|e| fail(e));
    let peers: Vec<xfer_rendezvous::Record> = (0..world)
        .map(|r| {
            m.rendezvous
                .lookup(&format!("moe-{r}"), WAIT)
                .unwrap_or_else(|e| fail(e))
        })
        .collect();
    let region = |r: usize, name: &str| -> engine_core::MrDesc {
        peers[r]
            .region(name)
            .unwrap_or_else(|| fail(format!("moe-{r} published no {name}")))
            .clone()
    };
    let owner = |x: usize| x / EXPERTS_PER_RANK;
    // 1. Counts (with token indices) to every other rank.
    let mut sends = Vec::new();
    for o in (0..world).filter(|&o| o != me) {
        let mut msg = vec![me as u8];
        for (t, &x) in routes.iter().enumerate().filter(|&(_, &x)| owner(x) == o) {
            msg.extend([t as u8, x as u8]);
        }
        let f = DoneFlag::new();
        engine
            .submit_send(&peers[o].addr, &msg, f.clone())
            .unwrap_or_else(|e| fail(e));
        sends.push(f);
    }
    wait_all(&sends, "count messages");
    let deadline = Instant::now() + WAIT;
    while told.lock().unwrap().len() < world - 1 {
        if Instant::now() > deadline {
            fail("count messages did not all arrive");
        }
        std::thread::sleep(Duration::from_millis(1));
    }
    let mut told = told.lock().unwrap().clone();
    told.insert(
        me,
        routes
            .iter()
            .enumerate()
            .filter(|&(_, &x)| owner(x) == me)
            .map(|(t, &x)| (t, x as u8))
            .collect(),
    );
    // The barrier of one phase: a zero-byte write with `imm` to every other rank's `region`.
    let barrier = |imm: u32, region_name: &str| {
        let landed = DoneFlag::new();
        engine
            .expect_imm_count(imm, (world - 1) as u64, landed.clone())
            .unwrap_or_else(|e| fail(e));
        let others: Vec<_> = (0..world)
            .filter(|&o| o != me)
            .map(|o| region(o, region_name))
            .collect();
        let sent = DoneFlag::new();
        engine
            .submit_barrier(None, sent.clone(), imm, &others)
            .unwrap_or_else(|e| fail(e));
        wait_all(&[sent, landed], "barrier");
    };
    // 2. Dispatch into slot `me` of each owner's inbox, in token order.
    let mut filled = vec![0usize; world];
    let dsts: Vec<ScatterDst> = routes
        .iter()
        .enumerate()
        .map(|(t, &x)| {
            let o = owner(x);
            let at = (me * TOKENS + filled[o]) * HIDDEN;
            filled[o] += 1;
            ScatterDst {
                len: HIDDEN as u64,
                src_offset: (t * HIDDEN) as u64,
                dst: region(o, "inbox"),
                dst_offset: at as u64,
            }
        })
        .collect();
    let f = DoneFlag::new();
    engine
        .submit_scatter(None, f.clone(), None, tokens.mr(), &dsts)
        .unwrap_or_else(|e| fail(e));
    wait_all(&[f], "dispatch");
    barrier(1, "inbox");
    // 3. Run the experts on what arrived, and send each result home.
    let mut computed = inbox.to_vec();
    let mut dsts = Vec::new();
    for (&r, pairs) in &told {
        for (k, &(t, x)) in pairs.iter().enumerate() {
            let at = (r * TOKENS + k) * HIDDEN;
            computed[at..at + HIDDEN]
                .iter_mut()
                .for_each(|b| *b = b.wrapping_add(x));
            dsts.push(ScatterDst {
                len: HIDDEN as u64,
                src_offset: at as u64,
                dst: region(r, "results"),
                dst_offset: (t * HIDDEN) as u64,
            });
        }
    }
    let outbox = HostBuffer::new(engine, world * TOKENS * HIDDEN).unwrap_or_else(|e| fail(e));
    outbox.write(0, &computed).unwrap_or_else(|e| fail(e));
    let f = DoneFlag::new();
    engine
        .submit_scatter(None, f.clone(), None, outbox.mr(), &dsts)
        .unwrap_or_else(|e| fail(e));
    wait_all(&[f], "combine");
    barrier(2, "results");
    // 4. Every token of this rank is back, transformed by its expert.
    let back = results.to_vec();
    for (t, &x) in routes.iter().enumerate() {
        if back[t * HIDDEN..(t + 1) * HIDDEN]
            .iter()
            .enumerate()
            .any(|(i, &b)| b != byte(me, t, i).wrapping_add(x as u8))
        {
            fail(format!("rank {me} token {t} (expert {x}) came back wrong"));
        }
    }
    let per_owner: Vec<usize> = (0..world)
        .map(|o| routes.iter().filter(|&&x| owner(x) == o).count())
        .collect();
    println!("moe rank {me}/{world}: {TOKENS} tokens routed {per_owner:?} by owner; dispatch + combine verified");
}

fn main() {
    if let Some(m) = examples::Member::from_args() {
        return member(m);
    }
    let engines = open_engines(RANKS, 2).unwrap_or_else(|e| fail(e));
    let mut rng = fastrand::Rng::with_seed(7);
    // Each token goes to one expert; expert x lives on rank x / EXPERTS_PER_RANK.
    let routes: Vec<Vec<usize>> = (0..RANKS)
        .map(|_| {
            (0..TOKENS)
                .map(|_| rng.usize(0..RANKS * EXPERTS_PER_RANK))
                .collect()
        })
        .collect();
    let tokens: Vec<HostBuffer> = engines
        .iter()
        .map(|e| HostBuffer::new(e, TOKENS * HIDDEN).unwrap_or_else(|e| fail(e)))
        .collect();
    for (r, t) in tokens.iter().enumerate() {
        let fill: Vec<u8> = (0..t.len())
            .map(|i| byte(r, i / HIDDEN, i % HIDDEN))
            .collect();
        t.write(0, &fill).unwrap_or_else(|e| fail(e));
    }
    // Receive area: one slot of up to TOKENS tokens per source rank.
    let inboxes: Vec<HostBuffer> = engines
        .iter()
        .map(|e| HostBuffer::new(e, RANKS * TOKENS * HIDDEN).unwrap_or_else(|e| fail(e)))
        .collect();

    // 1. Counts: rank r tells rank o which experts its tokens need, as a message.
    let told: Arc<Mutex<ExpertLists>> = Arc::default();
    for (o, e) in engines.iter().enumerate() {
        let told = Arc::clone(&told);
        e.submit_recvs(1024, 8, move |m| {
            told.lock()
                .unwrap()
                .insert((m[0] as usize, o), m[1..].to_vec());
        })
        .unwrap_or_else(|e| fail(e));
    }
    let mut sends = Vec::new();
    for (r, e) in engines.iter().enumerate() {
        for (o, peer) in engines.iter().enumerate().filter(|&(o, _)| o != r) {
            let mut msg = vec![r as u8];
            msg.extend(
                routes[r]
                    .iter()
                    .filter(|&&x| x / EXPERTS_PER_RANK == o)
                    .map(|&x| x as u8),
            );
            let f = DoneFlag::new();
            e.submit_send(&peer.main_address(), &msg, f.clone())
                .unwrap_or_else(|e| fail(e));
            sends.push(f);
        }
    }
    wait_all(&sends, "count messages");
    let deadline = Instant::now() + WAIT;
    while told.lock().unwrap().len() < RANKS * (RANKS - 1) {
        if Instant::now() > deadline {
            fail("count messages did not all arrive");
        }
        std::thread::sleep(Duration::from_millis(1));
    }

    // 2. Dispatch: rank r's tokens for owner o go, in token order, into o's slot r.
    let mut done = Vec::new();
    for (r, e) in engines.iter().enumerate() {
        let mut filled = [0usize; RANKS];
        let dsts: Vec<ScatterDst> = routes[r]
            .iter()
            .enumerate()
            .map(|(t, &x)| {
                let o = x / EXPERTS_PER_RANK;
                let at = (r * TOKENS + filled[o]) * HIDDEN;
                filled[o] += 1;
                ScatterDst {
                    len: HIDDEN as u64,
                    src_offset: (t * HIDDEN) as u64,
                    dst: inboxes[o].desc().clone(),
                    dst_offset: at as u64,
                }
            })
            .collect();
        let f = DoneFlag::new();
        e.submit_scatter(None, f.clone(), None, tokens[r].mr(), &dsts)
            .unwrap_or_else(|e| fail(e));
        done.push(f);
    }
    wait_all(&done, "dispatch");
    barrier_all(&engines, &inboxes, 1);

    // 3. Experts run on the owners; results go back to the tokens' home slots.
    let told = told.lock().unwrap().clone();
    let mut outboxes: Vec<HostBuffer> = Vec::new();
    for (o, e) in engines.iter().enumerate() {
        let out = HostBuffer::new(e, RANKS * TOKENS * HIDDEN).unwrap_or_else(|e| fail(e));
        let mut computed = inboxes[o].to_vec();
        for r in 0..RANKS {
            let experts: Vec<u8> = if r == o {
                routes[r]
                    .iter()
                    .filter(|&&x| x / EXPERTS_PER_RANK == o)
                    .map(|&x| x as u8)
                    .collect()
            } else {
                told[&(r, o)].clone()
            };
            for (k, &x) in experts.iter().enumerate() {
                let at = (r * TOKENS + k) * HIDDEN;
                computed[at..at + HIDDEN]
                    .iter_mut()
                    .for_each(|b| *b = b.wrapping_add(x));
            }
        }
        out.write(0, &computed).unwrap_or_else(|e| fail(e));
        outboxes.push(out);
    }
    let results: Vec<HostBuffer> = engines
        .iter()
        .map(|e| HostBuffer::new(e, TOKENS * HIDDEN).unwrap_or_else(|e| fail(e)))
        .collect();
    let mut done = Vec::new();
    for (o, e) in engines.iter().enumerate() {
        let mut dsts = Vec::new();
        for r in 0..RANKS {
            let homes = routes[r]
                .iter()
                .enumerate()
                .filter(|&(_, &x)| x / EXPERTS_PER_RANK == o)
                .map(|(t, _)| t);
            for (k, t) in homes.enumerate() {
                dsts.push(ScatterDst {
                    len: HIDDEN as u64,
                    src_offset: ((r * TOKENS + k) * HIDDEN) as u64,
                    dst: results[r].desc().clone(),
                    dst_offset: (t * HIDDEN) as u64,
                });
            }
        }
        let f = DoneFlag::new();
        e.submit_scatter(None, f.clone(), None, outboxes[o].mr(), &dsts)
            .unwrap_or_else(|e| fail(e));
        done.push(f);
    }
    wait_all(&done, "combine");
    barrier_all(&engines, &results, 2);

    // 4. Every token is back, transformed by its expert.
    for r in 0..RANKS {
        for (t, &x) in routes[r].iter().enumerate() {
            let got = &results[r].to_vec()[t * HIDDEN..(t + 1) * HIDDEN];
            if got
                .iter()
                .enumerate()
                .any(|(i, &b)| b != byte(r, t, i).wrapping_add(x as u8))
            {
                fail(format!("rank {r} token {t} (expert {x}) came back wrong"));
            }
        }
    }
    let per_rank: Vec<Vec<usize>> = (0..RANKS)
        .map(|r| {
            (0..RANKS)
                .map(|o| {
                    routes[r]
                        .iter()
                        .filter(|&&x| x / EXPERTS_PER_RANK == o)
                        .count()
                })
                .collect()
        })
        .collect();
    println!("moe: {RANKS} ranks x {TOKENS} tokens of {HIDDEN} B routed {per_rank:?} (rows: source, columns: owner); dispatch + combine verified");
}
