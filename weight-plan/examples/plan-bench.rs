//! Plans a Kimi-K2-shaped update (DeepSeek-V3 architecture at Kimi K2's sizes: 61 layers, the
//! first dense, 384 routed experts of 7168x2048 x3 and one shared expert per layer, MLA
//! attention, 163,840-token embeddings and head; bf16, about 1.03 T parameters) from 256 FSDP
//! trainer ranks (each layer's routed experts one FSDP1 flat unit cut into 256 byte ranges;
//! every other matrix FSDP2-style, its rows chunked over the 256 ranks as `torch.chunk` does;
//! layer norms replicated on every rank) to 128 inference ranks (routed experts EP 128, three per rank, fused into
//! `w13`/`w2`; attention, shared experts, dense MLP, embeddings and head TP 8 with 16 data-
//! parallel replicas, `gate_up_proj` and `fused_qkv_a_proj` fused). Prints how long planning
//! took and the transfer time the plan predicts at 400 Gb/s per rank.
//!
//! `cargo run --release -p xfer-weight-plan --example plan-bench [THREADS]`: on THREADS
//! threads, or as many as the machine has cores without it.

use std::num::NonZeroUsize;
use std::time::Instant;

use xfer_weight_plan::{
    plan, plan_with_threads, Layout, Param, Piece, Select, Shard, Slice, Tensor,
};

const HIDDEN: u64 = 7168;
const VOCAB: u64 = 163_840;
const LAYERS: usize = 61;
const EXPERTS: u64 = 384;
const MOE_INTER: u64 = 2048;
const DENSE_INTER: u64 = 18_432;
const HEADS: u64 = 64;
const Q_LORA: u64 = 1536;
const KV_LORA: u64 = 512;
const ROPE: u64 = 64;
const NOPE: u64 = 128;
const V_HEAD: u64 = 128;
const BF16: u64 = 2;
const TRAINERS: u32 = 256;
const INFERENCE: u32 = 128;
const TP: u32 = 8;
/// 400 Gb/s per rank.
const RATE: f64 = 50e9;

struct Model {
    layout: Layout,
    /// Each FSDP unit: its tensors (indices), in order.
    units: Vec<Vec<usize>>,
}

impl Model {
    fn tensor(&mut self, name: String, shape: &[u64]) -> usize {
        self.layout.tensors.push(Tensor {
            name,
            shape: shape.to_vec(),
            elem_size: BF16,
        });
        self.layout.tensors.len() - 1
    }

    /// A tensor in the current FSDP1 flat unit.
    fn flat(&mut self, name: String, shape: &[u64]) -> usize {
        let t = self.tensor(name, shape);
        self.units.last_mut().expect("a unit").push(t);
        t
    }

    /// A tensor whose rows are chunked over the trainer ranks (FSDP2's `Shard(0)`).
    fn sharded(&mut self, name: String, shape: &[u64]) -> usize {
        let t = self.tensor(name.clone(), shape);
        let chunk = shape[0].div_ceil(TRAINERS as u64);
        for rank in 0..TRAINERS {
            let start = (rank as u64 * chunk).min(shape[0]);
            let end = (start + chunk).min(shape[0]);
            if start < end {
                self.layout.shards.push(Shard {
                    rank,
                    tensor: name.clone(),
                    slice: Slice::Dim { dim: 0, start, end },
                });
            }
        }
        t
    }

    /// A tensor every trainer rank holds whole.
    fn replicated(&mut self, name: String, shape: &[u64]) -> usize {
        let t = self.tensor(name.clone(), shape);
        for rank in 0..TRAINERS {
            self.layout.shards.push(Shard {
                rank,
                tensor: name.clone(),
                slice: Slice::Whole,
            });
        }
        t
    }

    /// Each unit's concatenation cut into `TRAINERS` equal byte ranges (FSDP1 flat params).
    fn shard_units(&mut self) {
        for unit in &self.units {
            let sizes: Vec<u64> = unit
                .iter()
                .map(|&t| self.layout.tensors[t].shape.iter().product::<u64>() * BF16)
                .collect();
            let total: u64 = sizes.iter().sum();
            let per = total.div_ceil(TRAINERS as u64);
            let mut start = 0u64;
            for (&t, &size) in unit.iter().zip(&sizes) {
                let end = start + size;
                for rank in (start / per)..=((end - 1) / per) {
                    let (lo, hi) = ((rank * per).max(start), ((rank + 1) * per).min(end));
                    self.layout.shards.push(Shard {
                        rank: rank as u32,
                        tensor: self.layout.tensors[t].name.clone(),
                        slice: Slice::Flat {
                            start: lo - start,
                            end: hi - start,
                        },
                    });
                }
                start = end;
            }
        }
    }

    fn param(&mut self, rank: u32, name: &str, shape: &[u64], pieces: Vec<Piece>) {
        self.layout.params.push(Param {
            rank,
            name: name.into(),
            shape: shape.to_vec(),
            elem_size: BF16,
            pieces,
        });
    }

    fn whole_on(&mut self, rank: u32, t: usize) {
        let p = Param::of(rank, &self.layout.tensors[t], Select::Whole);
        self.layout.params.push(p);
    }

    /// TP slice `tp` of 8 along `dim`.
    fn tp_on(&mut self, rank: u32, t: usize, dim: usize) {
        let tensor = &self.layout.tensors[t];
        let part = tensor.shape[dim] / TP as u64;
        let tp = (rank % TP) as u64;
        let p = Param::of(
            rank,
            tensor,
            Select::Dim {
                dim,
                start: tp * part,
                end: (tp + 1) * part,
            },
        );
        self.layout.params.push(p);
    }

    /// `gate_up_proj`: this TP rank's rows of gate then up, fused along rows.
    fn gate_up_on(&mut self, rank: u32, gate: usize, up: usize, name: &str) {
        let rows = self.layout.tensors[gate].shape[0] / TP as u64;
        let tp = (rank % TP) as u64;
        let sel = Select::Dim {
            dim: 0,
            start: tp * rows,
            end: (tp + 1) * rows,
        };
        let pieces = vec![
            piece(&self.layout.tensors[gate].name, sel.clone(), &[0, 0]),
            piece(&self.layout.tensors[up].name, sel, &[rows, 0]),
        ];
        self.param(rank, name, &[2 * rows, HIDDEN], pieces);
    }
}

fn piece(tensor: &str, select: Select, at: &[u64]) -> Piece {
    Piece {
        tensor: tensor.into(),
        select,
        at: at.to_vec(),
    }
}

fn kimi() -> Layout {
    let mut m = Model {
        layout: Layout::default(),
        units: vec![Vec::new()],
    };
    let embed = m.sharded("embed_tokens".into(), &[VOCAB, HIDDEN]);
    let mut layers = Vec::new();
    for l in 0..LAYERS {
        m.units.push(Vec::new());
        let n = |s: &str| format!("layers.{l}.{s}");
        let norms = [
            m.replicated(n("input_layernorm"), &[HIDDEN]),
            m.replicated(n("post_attention_layernorm"), &[HIDDEN]),
            m.replicated(n("q_a_layernorm"), &[Q_LORA]),
            m.replicated(n("kv_a_layernorm"), &[KV_LORA]),
        ];
        let q_a = m.sharded(n("q_a_proj"), &[Q_LORA, HIDDEN]);
        let q_b = m.sharded(n("q_b_proj"), &[HEADS * (NOPE + ROPE), Q_LORA]);
        let kv_a = m.sharded(n("kv_a_proj_with_mqa"), &[KV_LORA + ROPE, HIDDEN]);
        let kv_b = m.sharded(n("kv_b_proj"), &[HEADS * (NOPE + V_HEAD), KV_LORA]);
        let o = m.sharded(n("o_proj"), &[HIDDEN, HEADS * V_HEAD]);
        let mlp = if l == 0 {
            let g = m.sharded(n("mlp.gate_proj"), &[DENSE_INTER, HIDDEN]);
            let u = m.sharded(n("mlp.up_proj"), &[DENSE_INTER, HIDDEN]);
            let d = m.sharded(n("mlp.down_proj"), &[HIDDEN, DENSE_INTER]);
            (vec![(g, u, d)], None)
        } else {
            let router = m.sharded(n("mlp.gate"), &[EXPERTS, HIDDEN]);
            let g = m.sharded(n("mlp.shared_experts.gate_proj"), &[MOE_INTER, HIDDEN]);
            let u = m.sharded(n("mlp.shared_experts.up_proj"), &[MOE_INTER, HIDDEN]);
            let d = m.sharded(n("mlp.shared_experts.down_proj"), &[HIDDEN, MOE_INTER]);
            let experts: Vec<(usize, usize, usize)> = (0..EXPERTS)
                .map(|e| {
                    (
                        m.flat(
                            n(&format!("mlp.experts.{e}.gate_proj")),
                            &[MOE_INTER, HIDDEN],
                        ),
                        m.flat(n(&format!("mlp.experts.{e}.up_proj")), &[MOE_INTER, HIDDEN]),
                        m.flat(
                            n(&format!("mlp.experts.{e}.down_proj")),
                            &[HIDDEN, MOE_INTER],
                        ),
                    )
                })
                .collect();
            (vec![(g, u, d)], Some((router, experts)))
        };
        layers.push((norms, [q_a, q_b, kv_a, kv_b, o], mlp));
    }
    m.units.push(Vec::new());
    let norm = m.replicated("norm".into(), &[HIDDEN]);
    let head = m.sharded("lm_head".into(), &[VOCAB, HIDDEN]);
    m.shard_units();

    let per_rank = EXPERTS / INFERENCE as u64;
    for rank in 0..INFERENCE {
        m.tp_on(rank, embed, 0);
        m.tp_on(rank, head, 0);
        m.whole_on(rank, norm);
        for (l, (norms, [q_a, q_b, kv_a, kv_b, o], (mlps, moe))) in layers.iter().enumerate() {
            for &t in norms {
                m.whole_on(rank, t);
            }
            let fused = vec![
                piece(&m.layout.tensors[*q_a].name, Select::Whole, &[0, 0]),
                piece(&m.layout.tensors[*kv_a].name, Select::Whole, &[Q_LORA, 0]),
            ];
            m.param(
                rank,
                &format!("layers.{l}.fused_qkv_a_proj"),
                &[Q_LORA + KV_LORA + ROPE, HIDDEN],
                fused,
            );
            m.tp_on(rank, *q_b, 0);
            m.tp_on(rank, *kv_b, 0);
            m.tp_on(rank, *o, 1);
            for &(g, u, d) in mlps {
                m.gate_up_on(rank, g, u, &format!("layers.{l}.gate_up_proj"));
                m.tp_on(rank, d, 1);
            }
            if let Some((router, experts)) = moe {
                m.whole_on(rank, *router);
                let mut w13 = Vec::new();
                let mut w2 = Vec::new();
                for j in 0..per_rank {
                    let (g, u, d) = experts[(rank as u64 * per_rank + j) as usize];
                    let name = |t: usize| m.layout.tensors[t].name.clone();
                    w13.push(piece(&name(g), Select::Whole, &[j, 0, 0]));
                    w13.push(piece(&name(u), Select::Whole, &[j, MOE_INTER, 0]));
                    w2.push(piece(&name(d), Select::Whole, &[j, 0, 0]));
                }
                m.param(
                    rank,
                    &format!("layers.{l}.experts.w13"),
                    &[per_rank, 2 * MOE_INTER, HIDDEN],
                    w13,
                );
                m.param(
                    rank,
                    &format!("layers.{l}.experts.w2"),
                    &[per_rank, HIDDEN, MOE_INTER],
                    w2,
                );
            }
        }
    }
    m.layout
}

fn main() {
    let threads: Option<NonZeroUsize> = std::env::args().nth(1).map(|a| {
        a.parse()
            .unwrap_or_else(|_| panic!("THREADS is a positive count, not {a:?}"))
    });
    let built = Instant::now();
    let layout = kimi();
    let params: u64 = layout
        .tensors
        .iter()
        .map(|t| t.shape.iter().product::<u64>())
        .sum();
    println!(
        "layout: {} tensors ({:.3} T parameters), {} trainer shards, {} inference parameters (built in {:.2} s)",
        layout.tensors.len(),
        params as f64 / 1e12,
        layout.shards.len(),
        layout.params.len(),
        built.elapsed().as_secs_f64()
    );
    let (start, cpu) = (Instant::now(), cpu_seconds());
    let p = match threads {
        Some(n) => plan_with_threads(&layout, n),
        None => plan(&layout),
    }
    .unwrap_or_else(|e| panic!("{e}"));
    let took = start.elapsed().as_secs_f64();
    let cpu = cpu_seconds().zip(cpu).map(|(b, a)| b - a);
    let rows: u64 = p.writes().map(|w| w.count).sum();
    let total: u64 = p.received.iter().sum();
    let max_sent = p.sent.iter().copied().max().unwrap_or(0);
    let max_received = p.received.iter().copied().max().unwrap_or(0);
    println!(
        "plan on {}: {took:.3} s ({}); {} strided writes ({rows} rows), {:.1} GB in all",
        threads.map_or("the machine's cores".into(), |n| format!("{n} thread(s)")),
        cpu.map_or("CPU time unknown".into(), |c| format!("{c:.2} s of CPU")),
        p.writes().count(),
        total as f64 / 1e9
    );
    // Every field of every write, in order, folded (FNV-1a over the words): two builds print
    // the same digest only if they make the same plan.
    let digest = p.writes().fold(0xcbf2_9ce4_8422_2325u64, |h, w| {
        [
            w.src_rank.into(),
            w.src_shard.into(),
            w.src_offset,
            w.dst_rank.into(),
            w.dst_param.into(),
            w.dst_offset,
            w.len,
            w.count,
            w.src_stride,
            w.dst_stride,
        ]
        .iter()
        .fold(h, |h, &x: &u64| (h ^ x).wrapping_mul(0x100_0000_01b3))
    });
    println!("digest of the writes: {digest:016x}");
    println!(
        "per rank: sent ≤ {:.2} GB (mean {:.2}), received ≤ {:.2} GB (mean {:.2})",
        max_sent as f64 / 1e9,
        total as f64 / TRAINERS as f64 / 1e9,
        max_received as f64 / 1e9,
        total as f64 / INFERENCE as f64 / 1e9
    );
    println!(
        "predicted at 400 Gb/s per rank: {:.3} s (the busiest rank's {:.2} GB at 50 GB/s)",
        p.bottleneck_bytes() as f64 / RATE,
        p.bottleneck_bytes() as f64 / 1e9
    );
}

/// This process's user and system CPU time (Linux: /proc/self/stat, in clock ticks of 10 ms),
/// so that a figure taken on a busy machine can be told apart from the wall time.
fn cpu_seconds() -> Option<f64> {
    let stat = std::fs::read_to_string("/proc/self/stat").ok()?;
    let fields: Vec<&str> = stat.rsplit_once(')')?.1.split_whitespace().collect();
    let ticks = |i: usize| fields.get(i)?.parse::<f64>().ok();
    // Fields 14 and 15 of stat(5), counted from the state (field 3) at index 0.
    Some((ticks(11)? + ticks(12)?) / 100.0)
}
