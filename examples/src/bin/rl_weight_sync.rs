//! RL weight sync: one trainer pushes many tensors to several inference engines, then one
//! barrier tells each of them the new weights are complete.
//!
//! The barrier goes out only after the scatter's own completion: on a reliable but unordered
//! transport a write's completion at the sender means its data is placed at the receiver,
//! whereas a barrier posted alongside could overtake it.
//!
//! `--rank N --world W [--rendezvous URL] [--config FILE]`: each engine is its own process
//! (rank 0 the trainer, the others inference engines), meeting through the rendezvous; each
//! inference engine acknowledges a verified step with a message, and the trainer starts the
//! next step only then (it overwrites the replicas).
#![forbid(unsafe_code)]

use std::time::Duration;

use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;

use engine_core::{DoneFlag, HostBuffer, MrDesc, ScatterDst};
use examples::{byte, fail, open_engines};

const PEERS: usize = 3;
const STEPS: usize = 3;
const WAIT: Duration = Duration::from_secs(30);

/// Tensor sizes of a small model (embeddings, attention and MLP blocks, norms): offsets,
/// sizes and the total.
fn tensors() -> (Vec<u64>, Vec<u64>, usize) {
    let sizes: Vec<u64> = (0..40)
        .map(|i| [3 << 20, 1 << 20, 4096, 2 << 20, 512, 700_001][i % 6])
        .collect();
    let offsets: Vec<u64> = sizes
        .iter()
        .scan(0, |at, &s| {
            let o = *at;
            *at += s;
            Some(o)
        })
        .collect();
    let total = sizes.iter().sum::<u64>() as usize;
    (offsets, sizes, total)
}

/// The weights of `step`, tensor by tensor.
fn fill(weights: &HostBuffer, step: usize, offsets: &[u64], sizes: &[u64]) {
    for (t, (&off, &len)) in offsets.iter().zip(sizes).enumerate() {
        let bytes: Vec<u8> = (0..len as usize).map(|i| byte(step, t, i)).collect();
        weights
            .write(off as usize, &bytes)
            .unwrap_or_else(|e| fail(e));
    }
}

/// Every tensor (at `offsets`, of `sizes`) to the same place in each replica.
fn scatter_list(replicas: &[MrDesc], offsets: &[u64], sizes: &[u64]) -> Vec<ScatterDst> {
    replicas
        .iter()
        .flat_map(|r| {
            offsets.iter().zip(sizes).map(|(&off, &len)| ScatterDst {
                len,
                src_offset: off,
                dst: r.clone(),
                dst_offset: off,
            })
        })
        .collect()
}

/// One process of the multi-process mode.
fn member(m: examples::Member) {
    let (offsets, sizes, total) = tensors();
    let engine = &m.engine;
    let rdv = &m.rendezvous;
    if m.rank == 0 {
        let weights = HostBuffer::new(engine, total).unwrap_or_else(|e| fail(e));
        let acks = Arc::new(AtomicUsize::new(0));
        let counted = Arc::clone(&acks);
        engine
            .submit_recvs(64, 16, move |_| {
                counted.fetch_add(1, Ordering::SeqCst);
            })
            .unwrap_or_else(|e| fail(e));
        let _me = rdv
            .publish("trainer", &engine.main_address(), &[], m.ttl)
            .unwrap_or_else(|e| fail(e));
        let replicas: Vec<MrDesc> = (1..m.world)
            .map(|r| {
                let rec = rdv
                    .lookup(&format!("inference-{r}"), WAIT)
                    .unwrap_or_else(|e| fail(e));
                rec.region("weights")
                    .unwrap_or_else(|| fail(format!("inference-{r} published no weights")))
                    .clone()
            })
            .collect();
        let group = engine
            .add_peer_group(replicas.iter().map(|d| d.owner().clone()).collect())
            .unwrap_or_else(|e| fail(e));
        let dsts = scatter_list(&replicas, &offsets, &sizes);
        for step in 0..STEPS {
            fill(&weights, step, &offsets, &sizes);
            let scattered = DoneFlag::new();
            engine
                .submit_scatter(Some(group), scattered.clone(), None, weights.mr(), &dsts)
                .unwrap_or_else(|e| fail(e));
            scattered
                .wait(Duration::from_secs(90))
                .unwrap_or_else(|e| fail(e));
            let barrier = DoneFlag::new();
            engine
                .submit_barrier(Some(group), barrier.clone(), 1000 + step as u32, &replicas)
                .unwrap_or_else(|e| fail(e));
            barrier
                .wait(Duration::from_secs(90))
                .unwrap_or_else(|e| fail(e));
            let deadline = std::time::Instant::now() + Duration::from_secs(90);
            while acks.load(Ordering::SeqCst) < (step + 1) * (m.world - 1) {
                if std::time::Instant::now() > deadline {
                    fail(format!(
                        "step {step}: not every inference engine acknowledged"
                    ));
                }
                std::thread::sleep(Duration::from_millis(1));
            }
            println!(
                "trainer: step {step} synced to {} inference engines, each verified it",
                m.world - 1
            );
        }
    } else {
        let replica = HostBuffer::new(engine, total).unwrap_or_else(|e| fail(e));
        let expected = HostBuffer::new(engine, total).unwrap_or_else(|e| fail(e));
        let trainer = rdv.lookup("trainer", WAIT).unwrap_or_else(|e| fail(e));
        let _me = rdv
            .publish(
                &format!("inference-{}", m.rank),
                &engine.main_address(),
                &[("weights", replica.desc())],
                m.ttl,
            )
            .unwrap_or_else(|e| fail(e));
        for step in 0..STEPS {
            // The step's barrier is counted whenever it lands, before or after this.
            let f = DoneFlag::new();
            engine
                .expect_imm_count(1000 + step as u32, 1, f.clone())
                .unwrap_or_else(|e| fail(e));
            f.wait(Duration::from_secs(90))
                .unwrap_or_else(|e| fail(format!("step {step}: {e}")));
            fill(&expected, step, &offsets, &sizes);
            if replica.to_vec() != expected.to_vec() {
                fail(format!("inference {}: step {step} weights differ", m.rank));
            }
            let ack = DoneFlag::new();
            engine
                .submit_send(
                    &trainer.addr,
                    format!("{} {step}", m.rank).as_bytes(),
                    ack.clone(),
                )
                .unwrap_or_else(|e| fail(e));
            ack.wait(WAIT).unwrap_or_else(|e| fail(e));
        }
        println!("inference {}: {STEPS} steps verified", m.rank);
    }
}

fn main() {
    if let Some(m) = examples::Member::from_args() {
        return member(m);
    }
    let engines = open_engines(1 + PEERS, 2).unwrap_or_else(|e| fail(e));
    let (trainer, inference) = (&engines[0], &engines[1..]);
    let (offsets, sizes, total) = tensors();
    let weights = HostBuffer::new(trainer, total).unwrap_or_else(|e| fail(e));
    let replicas: Vec<HostBuffer> = inference
        .iter()
        .map(|e| HostBuffer::new(e, total).unwrap_or_else(|e| fail(e)))
        .collect();
    let group = trainer
        .add_peer_group(inference.iter().map(|e| e.main_address()).collect())
        .unwrap_or_else(|e| fail(e));
    let descs: Vec<MrDesc> = replicas.iter().map(|r| r.desc().clone()).collect();
    // The same destinations every step: each tensor to its place in every replica.
    let dsts = scatter_list(&descs, &offsets, &sizes);

    for step in 0..STEPS {
        fill(&weights, step, &offsets, &sizes);
        // Every peer waits for the step's barrier before it loads the weights.
        let ready: Vec<_> = inference
            .iter()
            .map(|e| {
                let f = DoneFlag::new();
                e.expect_imm_count(1000 + step as u32, 1, f.clone())
                    .unwrap_or_else(|e| fail(e));
                f
            })
            .collect();
        let start = std::time::Instant::now();
        let scattered = DoneFlag::new();
        trainer
            .submit_scatter(Some(group), scattered.clone(), None, weights.mr(), &dsts)
            .unwrap_or_else(|e| fail(e));
        scattered
            .wait(WAIT)
            .unwrap_or_else(|e| fail(format!("step {step} scatter: {e}")));
        let barrier = DoneFlag::new();
        trainer
            .submit_barrier(Some(group), barrier.clone(), 1000 + step as u32, &descs)
            .unwrap_or_else(|e| fail(e));
        barrier.wait(WAIT).unwrap_or_else(|e| fail(e));
        for (p, f) in ready.iter().enumerate() {
            f.wait(WAIT)
                .unwrap_or_else(|e| fail(format!("peer {p} step {step}: {e}")));
        }
        let elapsed = start.elapsed();
        for (p, r) in replicas.iter().enumerate() {
            if r.to_vec() != weights.to_vec() {
                fail(format!("peer {p} has different weights after step {step}"));
            }
        }
        println!(
            "rl-weight-sync step {step}: {} tensors ({:.1} MiB) to {PEERS} peers in {:.1} ms; all replicas verified",
            sizes.len(),
            total as f64 / (1 << 20) as f64,
            elapsed.as_secs_f64() * 1e3
        );
    }
}
