//! RL weight sync: one trainer pushes many tensors to several inference engines, then one
//! barrier tells each of them the new weights are complete.
//!
//! The barrier goes out only after the scatter's own completion: on a reliable but unordered
//! transport a write's completion at the sender means its data is placed at the receiver,
//! whereas a barrier posted alongside could overtake it.

use std::time::Duration;

use engine_core::{DoneFlag, HostBuffer, ScatterDst};
use examples::{byte, fail, open_engines};

const PEERS: usize = 3;
const STEPS: usize = 3;
const WAIT: Duration = Duration::from_secs(30);

fn main() {
    let engines = open_engines(1 + PEERS, 2).unwrap_or_else(|e| fail(e));
    let (trainer, inference) = (&engines[0], &engines[1..]);
    // Tensor sizes of a small model: embeddings, attention and MLP blocks, norms.
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
    let weights = HostBuffer::new(trainer, total).unwrap_or_else(|e| fail(e));
    let replicas: Vec<HostBuffer> = inference
        .iter()
        .map(|e| HostBuffer::new(e, total).unwrap_or_else(|e| fail(e)))
        .collect();
    let group = trainer
        .add_peer_group(inference.iter().map(|e| e.main_address()).collect())
        .unwrap_or_else(|e| fail(e));

    for step in 0..STEPS {
        for (t, (&off, &len)) in offsets.iter().zip(&sizes).enumerate() {
            let fill: Vec<u8> = (0..len as usize).map(|i| byte(step, t, i)).collect();
            weights
                .write(off as usize, &fill)
                .unwrap_or_else(|e| fail(e));
        }
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
        let dsts: Vec<ScatterDst> = replicas
            .iter()
            .flat_map(|r| {
                offsets.iter().zip(&sizes).map(|(&off, &len)| ScatterDst {
                    len,
                    src_offset: off,
                    dst: r.desc().clone(),
                    dst_offset: off,
                })
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
        let descs: Vec<_> = replicas.iter().map(|r| r.desc().clone()).collect();
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
