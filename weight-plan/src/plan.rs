//! Why one file: it is one pass — resolving each parameter's pieces, walking the holdings of
//! their tensors, assigning replicated bytes, merging runs, sizing and splitting the senders'
//! write lists over threads — whose steps share the per-parameter state (`Resolved`,
//! `Context`) and the write lists they fill; what needs none of that already lives apart
//! (`layout`, `holdings`, `runs`, `balance`); its property tests are in `tests/`.
//!
//! From a [`Layout`] to its [`Plan`]: each parameter's pieces cut along the holdings of their
//! tensors, bytes with one holder sent by it, replicated bytes split by [`balance`], and
//! neighbouring runs merged.

use std::collections::HashMap;
use std::num::NonZeroUsize;
use std::ops::Range;

use crate::balance::balance;
use crate::error::PlanError;
use crate::holdings::{Geometry, TensorHoldings};
use crate::layout::{Layout, Param, Select, Slice};
use crate::runs::{BoxCopy, Run, MAX_DIMS};

/// One strided write: `count` rows of `len` bytes; row `i` is read at
/// `src_offset + i * src_stride` of trainer shard `src_shard` (an index into
/// [`Layout::shards`], offsets within that shard's own buffer) and written at
/// `dst_offset + i * dst_stride` of parameter `dst_param` (an index into [`Layout::params`],
/// offsets within that parameter). A contiguous write has `count == 1` and strides equal to
/// `len`.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Write {
    /// The sending trainer rank (the shard's).
    pub src_rank: u32,
    /// Index into `Layout::shards`.
    pub src_shard: u32,
    /// Byte offset of the first row within the shard.
    pub src_offset: u64,
    /// The receiving inference rank (the parameter's).
    pub dst_rank: u32,
    /// Index into `Layout::params`.
    pub dst_param: u32,
    /// Byte offset of the first row within the parameter.
    pub dst_offset: u64,
    /// Bytes per row.
    pub len: u64,
    /// Rows.
    pub count: u64,
    /// Bytes from one row's start to the next's in the shard.
    pub src_stride: u64,
    /// Bytes from one row's start to the next's in the parameter.
    pub dst_stride: u64,
}

impl Write {
    /// Bytes it carries.
    pub fn bytes(&self) -> u64 {
        self.len * self.count
    }
}

/// Every write of one weight update: each byte of each parameter written exactly once, from a
/// trainer rank holding the tensor's byte it must hold.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct Plan {
    /// The writes of each trainer rank, by rank; each rank's by receiver, then parameter.
    pub by_sender: Vec<Vec<Write>>,
    /// Bytes each trainer rank sends, by rank.
    pub sent: Vec<u64>,
    /// Bytes each inference rank receives, by rank.
    pub received: Vec<u64>,
}

impl Plan {
    /// Every write, by sender, then receiver, then parameter.
    pub fn writes(&self) -> impl Iterator<Item = &Write> {
        self.by_sender.iter().flatten()
    }

    /// Trainer rank `rank`'s writes (none for a rank the layout does not name).
    pub fn writes_from(&self, rank: u32) -> &[Write] {
        self.by_sender.get(rank as usize).map_or(&[], Vec::as_slice)
    }

    /// The busiest rank's bytes (sent or received): with every rank's link at the same rate,
    /// the update takes at least this many bytes' time.
    pub fn bottleneck_bytes(&self) -> u64 {
        self.sent
            .iter()
            .chain(&self.received)
            .copied()
            .max()
            .unwrap_or(0)
    }
}

/// A piece of a parameter, resolved: its tensor, and the selected box in tensor coordinates.
struct Resolved<'a> {
    tensor: usize,
    at: Dims,
    extent: Dims,
    /// Where the box lands in the parameter (padded to its rank).
    dst_at: &'a [u64],
}

/// A coordinate or extent of at most [`MAX_DIMS`] dimensions, inline: every thread resolves
/// every parameter's pieces, and allocating and freeing two vectors per piece was about 2 % of
/// a large plan's instructions.
#[derive(Clone, Copy)]
struct Dims {
    values: [u64; MAX_DIMS],
    len: usize,
}

impl Dims {
    fn of(v: &[u64]) -> Dims {
        let mut values = [0; MAX_DIMS];
        values[..v.len()].copy_from_slice(v);
        Dims {
            values,
            len: v.len(),
        }
    }
}

impl std::ops::Deref for Dims {
    type Target = [u64];
    fn deref(&self) -> &[u64] {
        &self.values[..self.len]
    }
}

impl std::ops::DerefMut for Dims {
    fn deref_mut(&mut self) -> &mut [u64] {
        &mut self.values[..self.len]
    }
}

/// A fragment whose bytes several ranks hold: which holding, which parameter, what.
struct Shared {
    tensor: usize,
    holding: usize,
    param: u32,
    run: Run,
}

/// Computes the plan, or says what in the layout is wrong. A large layout's parameters are
/// planned on as many threads as the machine has cores, up to [`MAX_THREADS`], each making the
/// writes of its own range of senders; the plan is the same, write for write, as on one thread
/// ([`plan_with_threads`]).
pub fn plan(layout: &Layout) -> Result<Plan, PlanError> {
    plan_on(layout, Threads::Auto)
}

/// [`plan`] on at most `threads` threads (one per sender at most), however small the layout:
/// the plan does not depend on the number.
pub fn plan_with_threads(layout: &Layout, threads: NonZeroUsize) -> Result<Plan, PlanError> {
    plan_on(layout, Threads::Exactly(threads.get()))
}

/// The most threads [`plan`] starts: each resolves every parameter and searches every piece's
/// holdings (about 11 % of one thread's instructions for the Kimi-K2-shaped example), so past a
/// few threads that repeated work, not the writes, is what a thread spends its time on.
pub const MAX_THREADS: usize = 8;

enum Threads {
    /// The machine's cores, up to [`MAX_THREADS`], for a layout of at least
    /// [`PARALLEL_WRITES`] writes; else one.
    Auto,
    Exactly(usize),
}

/// The fewest expected writes worth planning on several threads: below it, starting them
/// costs more than they save.
const PARALLEL_WRITES: usize = 1 << 16;

/// The most runs a piece's box of a whole tensor may make for them to be clipped to each of
/// its byte-range holdings (one or two for a slice of a matrix); past it, each holding makes
/// its own, fewer.
const CLIPPED_RUNS: usize = 4;

/// What every thread reads: the layout, resolved and indexed.
struct Context<'a> {
    layout: &'a Layout,
    names: Names<'a>,
    geometry: Vec<Geometry<'a>>,
    holdings: Vec<TensorHoldings>,
    /// Each holding's class of replicated bytes (`usize::MAX` for a single holder's).
    class_of_holding: Vec<Vec<usize>>,
    /// Whether a tensor's holdings cover all of it (they are disjoint: their bytes add up to
    /// the tensor's), so that no piece of it can miss bytes and a thread may skip the holdings
    /// of other threads' senders without counting their bytes.
    fully_held: Vec<bool>,
    /// Each holding's single holder, [`REPLICATED`] where it has several: what a thread reads
    /// to skip other threads' holdings, 4 bytes each in a row instead of a holding each (the
    /// 256 row chunks of a matrix are every column slice's candidates).
    sender_of_holding: Vec<Vec<u32>>,
    classes: usize,
}

/// [`Context::sender_of_holding`] of bytes several ranks hold.
const REPLICATED: u32 = u32::MAX;

/// One thread's share of the parameters' writes: those of its senders, and (on the first
/// thread) the fragments of replicated bytes and each class's total.
struct Part {
    writes: Writes,
    class_bytes: Vec<u64>,
    class_fragments: Vec<Vec<Shared>>,
}

fn plan_on(layout: &Layout, threads: Threads) -> Result<Plan, PlanError> {
    let tensors = &layout.tensors;
    let mut by_name: HashMap<&str, usize> = HashMap::with_capacity(tensors.len());
    let mut geometry = Vec::with_capacity(tensors.len());
    for (i, t) in tensors.iter().enumerate() {
        if by_name.insert(t.name.as_str(), i).is_some() {
            return Err(PlanError::DuplicateTensor {
                name: t.name.clone(),
            });
        }
        let bytes = t
            .shape
            .iter()
            .try_fold(t.elem_size, |a, &d| a.checked_mul(d))
            .filter(|_| t.elem_size > 0 && t.shape.len() <= MAX_DIMS)
            .ok_or_else(|| PlanError::BadTensor {
                name: t.name.clone(),
                shape: t.shape.clone(),
                elem_size: t.elem_size,
            })?;
        geometry.push(Geometry {
            shape: &t.shape,
            elem_size: t.elem_size,
            bytes,
        });
    }
    let names = Names(by_name);

    let mut shards_of: Vec<Vec<usize>> = vec![Vec::new(); tensors.len()];
    for (i, s) in layout.shards.iter().enumerate() {
        shards_of[names.find(&s.tensor, || format!("shard {i} (rank {})", s.rank))?].push(i);
    }
    let holdings = shards_of
        .iter()
        .enumerate()
        .map(|(t, shards)| {
            TensorHoldings::new(&tensors[t].name, geometry[t], &layout.shards, shards)
        })
        .collect::<Result<Vec<_>, _>>()?;

    // Each class of replicated bytes: the set of ranks holding them; each holding's class.
    let mut class_of: HashMap<Vec<u32>, usize> = HashMap::new();
    let mut classes: Vec<(Vec<u32>, u64)> = Vec::new();
    let class_of_holding: Vec<Vec<usize>> = holdings
        .iter()
        .map(|th| {
            th.holdings
                .iter()
                .map(|h| {
                    let ranks: Vec<u32> = h.holders.iter().map(|h| h.0).collect();
                    if ranks.len() < 2 {
                        return usize::MAX;
                    }
                    *class_of.entry(ranks.clone()).or_insert_with(|| {
                        classes.push((ranks, 0));
                        classes.len() - 1
                    })
                })
                .collect()
        })
        .collect();
    let fully_held = holdings
        .iter()
        .zip(&geometry)
        .map(|(th, g)| {
            let held: u64 = th.holdings.iter().map(|h| slice_bytes(&h.slice, g)).sum();
            held == g.bytes
        })
        .collect();
    let sender_of_holding = holdings
        .iter()
        .map(|th| {
            th.holdings
                .iter()
                .map(|h| h.single.map_or(REPLICATED, |(rank, _)| rank))
                .collect()
        })
        .collect();
    let expected = expected_writes(layout, &names, &holdings);
    let context = Context {
        layout,
        names,
        geometry,
        holdings,
        class_of_holding,
        fully_held,
        sender_of_holding,
        classes: classes.len(),
    };

    let threads = match threads {
        Threads::Exactly(n) => n,
        Threads::Auto if expected.iter().sum::<usize>() < PARALLEL_WRITES => 1,
        Threads::Auto => std::thread::available_parallelism()
            .map_or(1, NonZeroUsize::get)
            .min(MAX_THREADS),
    };
    let ranges = sender_ranges(&expected, threads);
    let context = &context;
    let expected = &expected;
    let parts: Vec<Result<Part, PlanError>> = std::thread::scope(|scope| {
        let spawned: Vec<_> = ranges
            .iter()
            .skip(1)
            .map(|r| {
                let r = r.clone();
                scope.spawn(move || visit(context, expected, r, false))
            })
            .collect();
        let first = visit(context, expected, ranges[0].clone(), true);
        std::iter::once(first)
            .chain(spawned.into_iter().map(|h| {
                h.join()
                    .unwrap_or_else(|panic| std::panic::resume_unwind(panic))
            }))
            .collect()
    });
    // Every thread visits every parameter and meets the same first refusal: the first
    // thread's is the one a single thread returns.
    let mut parts = parts.into_iter().collect::<Result<Vec<_>, _>>()?;
    let (holdings, layout) = (&context.holdings, context.layout);

    let mut writes = Writes {
        by_sender: vec![Vec::new(); expected.len()],
        sent: vec![0; expected.len()],
    };
    for (part, range) in parts.iter_mut().zip(&ranges) {
        for s in range.clone() {
            writes.by_sender[s] = std::mem::take(&mut part.writes.by_sender[s]);
            writes.sent[s] = part.writes.sent[s];
        }
    }
    let Part {
        class_bytes,
        mut class_fragments,
        ..
    } = parts.swap_remove(0);
    for (class, bytes) in classes.iter_mut().zip(class_bytes) {
        class.1 = bytes;
    }
    let amounts = balance(&writes.sent, &classes);
    for ((fragments, amounts), (holders, _)) in
        class_fragments.iter_mut().zip(&amounts).zip(&classes)
    {
        assign(fragments, holders, amounts, holdings, layout, &mut writes);
    }
    let Writes {
        mut by_sender,
        sent,
    } = writes;
    let receivers = layout
        .params
        .iter()
        .map(|p| p.rank as usize + 1)
        .max()
        .unwrap_or(0);
    // Each thread orders its senders' lists and counts what they send to each receiver.
    let mut lists: Vec<&mut [Vec<Write>]> = Vec::with_capacity(ranges.len());
    let mut rest = by_sender.as_mut_slice();
    for range in &ranges {
        let (mine, others) = rest.split_at_mut(range.len());
        lists.push(mine);
        rest = others;
    }
    let counts: Vec<Vec<u64>> = std::thread::scope(|scope| {
        let mut lists = lists.into_iter();
        let first = lists.next().unwrap_or_default();
        let spawned: Vec<_> = lists
            .map(|l| scope.spawn(move || order_and_count(l, receivers)))
            .collect();
        std::iter::once(order_and_count(first, receivers))
            .chain(spawned.into_iter().map(|h| {
                h.join()
                    .unwrap_or_else(|panic| std::panic::resume_unwind(panic))
            }))
            .collect()
    });
    let mut received = vec![0u64; receivers];
    for count in counts {
        for (r, c) in received.iter_mut().zip(count) {
            *r += c;
        }
    }
    Ok(Plan {
        by_sender,
        sent,
        received,
    })
}

/// Senders cut into `threads` ranges (fewer where there are fewer senders) of about equal
/// expected writes; always at least one range, however empty.
fn sender_ranges(expected: &[usize], threads: usize) -> Vec<Range<usize>> {
    let threads = threads.clamp(1, expected.len().max(1));
    let total: usize = expected.iter().sum();
    let mut ranges = Vec::with_capacity(threads);
    let (mut start, mut so_far) = (0usize, 0usize);
    for (s, &n) in expected.iter().enumerate() {
        so_far += n;
        let k = ranges.len() + 1;
        // Close the range once it holds its share, leaving a sender for each range after it.
        let share = total / threads * k;
        if k < threads && so_far >= share && expected.len() - (s + 1) >= threads - k {
            ranges.push(start..s + 1);
            start = s + 1;
        }
    }
    ranges.push(start..expected.len());
    ranges
}

/// The parameters' writes from the senders in `senders`, in the order of their receivers;
/// with `shared`, also the fragments of replicated bytes.
fn visit(
    context: &Context<'_>,
    expected: &[usize],
    senders: Range<usize>,
    shared: bool,
) -> Result<Part, PlanError> {
    let Context {
        layout,
        names,
        geometry,
        holdings,
        class_of_holding,
        fully_held,
        sender_of_holding,
        classes,
    } = context;
    let tensors = &layout.tensors;
    let mut writes = Writes::new(expected, senders.clone());
    let mut class_bytes = vec![0u64; if shared { *classes } else { 0 }];
    let mut class_fragments: Vec<Vec<Shared>> = class_bytes.iter().map(|_| Vec::new()).collect();
    let mut candidates = Vec::new();
    let mut pieces = Vec::new();
    let mut whole_runs: Vec<Run> = Vec::new();
    let mine = |sender: u32| match sender {
        REPLICATED => shared,
        rank => senders.contains(&(rank as usize)),
    };

    // Parameters by receiver, so that each sender's writes come out grouped by receiver.
    let mut order: Vec<usize> = (0..layout.params.len()).collect();
    order.sort_by_key(|&i| layout.params[i].rank);
    for &pi in &order {
        let param = &layout.params[pi];
        resolve(pi, param, names, tensors, &mut pieces)?;
        for piece in &pieces {
            if piece.extent.contains(&0) {
                continue;
            }
            let g = &geometry[piece.tensor];
            let th = &holdings[piece.tensor];
            let whole = fully_held[piece.tensor];
            th.candidates(g, &piece.at, &piece.extent, &mut candidates);
            let mut found = 0u64;
            let mut whole_runs_made = false;
            let senders = &sender_of_holding[piece.tensor];
            for &h in &candidates {
                let keep = mine(senders[h]);
                if whole && !keep {
                    continue;
                }
                let holding = &th.holdings[h];
                let mut emit = |run: Run| {
                    found += run.bytes();
                    if !keep {
                        return;
                    }
                    if let Some((rank, shard)) = holding.single {
                        writes.push(write(rank, shard, pi, param, run));
                    } else {
                        let class = class_of_holding[piece.tensor][h];
                        class_bytes[class] += run.bytes();
                        class_fragments[class].push(Shared {
                            tensor: piece.tensor,
                            holding: h,
                            param: pi as u32,
                            run,
                        });
                    }
                };
                // A byte range of the tensor (a flat shard, or rows of its first dimension):
                // the piece's runs from the whole tensor, made once per piece, clipped to it —
                // where they are few; else each holding's own runs.
                let range = match holding.slice {
                    Slice::Flat { start, end } => Some((start, end)),
                    Slice::Dim { dim: 0, start, end } => {
                        let row = g.bytes / g.shape[0];
                        Some((start * row, end * row))
                    }
                    _ => None,
                };
                if let Some((start, end)) = range {
                    if !whole_runs_made {
                        whole_runs.clear();
                        piece_runs(param, piece, g, &Slice::Whole, &mut |r| whole_runs.push(r));
                        whole_runs_made = true;
                    }
                    if whole_runs.len() <= CLIPPED_RUNS {
                        for r in &whole_runs {
                            r.clip(start, end, &mut emit);
                        }
                        continue;
                    }
                }
                piece_runs(param, piece, g, &holding.slice, &mut emit);
            }
            let want = piece.extent.iter().product::<u64>() * g.elem_size;
            if !whole && found != want {
                debug_assert!(found < want, "holdings are disjoint");
                return Err(PlanError::NotHeld {
                    param: pi,
                    name: param.name.clone(),
                    rank: param.rank,
                    tensor: tensors[piece.tensor].name.clone(),
                    missing: want - found,
                });
            }
        }
    }
    Ok(Part {
        writes,
        class_bytes,
        class_fragments,
    })
}

/// Orders each list by receiver, then parameter, and adds up what each receiver gets.
fn order_and_count(lists: &mut [Vec<Write>], receivers: usize) -> Vec<u64> {
    let mut received = vec![0u64; receivers];
    for bucket in lists {
        // Parameters were visited receiver by receiver, so a bucket is a few sorted runs
        // (what its rank holds alone, then its share of each class) that a stable sort merges
        // in linear time; a bucket of one run (a rank without replicated bytes) is left as is.
        // The write carries its parameter's rank: the key reads nothing else (looking the
        // parameter up for each of millions of writes was most of this loop's time).
        let key = |w: &Write| (w.dst_rank, w.dst_param);
        if !bucket.is_sorted_by_key(key) {
            bucket.sort_by_key(key);
        }
        for w in bucket.iter() {
            received[w.dst_rank as usize] += w.bytes();
        }
    }
    received
}

/// Bytes of the tensor a (fitting, non-empty) slice holds.
fn slice_bytes(slice: &Slice, g: &Geometry<'_>) -> u64 {
    match *slice {
        Slice::Whole => g.bytes,
        Slice::Flat { start, end } => end - start,
        Slice::Dim { dim, start, end } => g.bytes / g.shape[dim] * (end - start),
    }
}

/// The plan's writes as they are made, per sender, each joined to the one before it where it
/// continues it.
struct Writes {
    by_sender: Vec<Vec<Write>>,
    sent: Vec<u64>,
}

impl Writes {
    /// Lists with room for about `expected[rank]` writes each for the ranks in `senders`
    /// (empty for the others): grown one doubling at a time from empty, a real model's
    /// millions of writes were a third of the plan's time (reallocation copies and their page
    /// faults).
    fn new(expected: &[usize], senders: Range<usize>) -> Writes {
        Writes {
            by_sender: expected
                .iter()
                .enumerate()
                .map(|(s, &n)| {
                    let n = if senders.contains(&s) { n } else { 0 };
                    Vec::with_capacity(n.min(MAX_RESERVED))
                })
                .collect(),
            sent: vec![0; expected.len()],
        }
    }

    fn push(&mut self, w: Write) {
        self.sent[w.src_rank as usize] += w.bytes();
        let bucket = &mut self.by_sender[w.src_rank as usize];
        if let Some(last) = bucket.last_mut() {
            if join(last, &w) {
                return;
            }
        }
        bucket.push(w);
    }
}

/// The most writes reserved for one sender up front (256 MiB of them); past it, a list grows.
const MAX_RESERVED: usize = 1 << 22;

/// About how many writes each trainer rank will make: for each of its shards, the pieces that
/// place the shard's tensor, shared among the shard's replicas. Exact when every piece meets
/// every shard of its tensor once (row-chunked matrices read in column slices, whole tensors);
/// only a hint for the lists' capacity otherwise.
fn expected_writes(layout: &Layout, names: &Names<'_>, holdings: &[TensorHoldings]) -> Vec<usize> {
    let mut pieces_of = vec![0usize; holdings.len()];
    for piece in layout.params.iter().flat_map(|p| &p.pieces) {
        if let Some(&t) = names.0.get(piece.tensor.as_str()) {
            pieces_of[t] += 1;
        }
    }
    let mut expected = vec![0usize; sender_count(layout)];
    for (t, th) in holdings.iter().enumerate() {
        for h in &th.holdings {
            let share = pieces_of[t].div_ceil(h.holders.len().max(1));
            for &(rank, _) in &h.holders {
                expected[rank as usize] = expected[rank as usize].saturating_add(share);
            }
        }
    }
    expected
}

/// Tensor indices by name.
struct Names<'a>(HashMap<&'a str, usize>);

impl Names<'_> {
    fn find(&self, name: &str, user: impl FnOnce() -> String) -> Result<usize, PlanError> {
        self.0
            .get(name)
            .copied()
            .ok_or_else(|| PlanError::UnknownTensor {
                name: name.to_owned(),
                user: user(),
            })
    }
}

fn sender_count(layout: &Layout) -> usize {
    layout
        .shards
        .iter()
        .map(|s| s.rank as usize + 1)
        .max()
        .unwrap_or(0)
}

fn write(rank: u32, shard: usize, pi: usize, param: &Param, run: Run) -> Write {
    Write {
        src_rank: rank,
        src_shard: shard as u32,
        src_offset: run.src,
        dst_rank: param.rank,
        dst_param: pi as u32,
        dst_offset: run.dst,
        len: run.len,
        count: run.count,
        src_stride: run.src_stride,
        dst_stride: run.dst_stride,
    }
}

/// Checks a parameter's pieces (their tensors, element sizes, fit, overlaps and coverage) and
/// resolves each to a box of its tensor.
fn resolve<'a>(
    pi: usize,
    param: &'a Param,
    names: &Names<'_>,
    tensors: &[crate::layout::Tensor],
    out: &mut Vec<Resolved<'a>>,
) -> Result<(), PlanError> {
    out.clear();
    let bad = |piece: usize, reason: String| PlanError::BadPiece {
        param: pi,
        name: param.name.clone(),
        rank: param.rank,
        piece,
        reason,
    };
    let rank = param.shape.len();
    if rank > MAX_DIMS {
        return Err(bad(
            0,
            format!("{rank} dimensions, more than the {MAX_DIMS} supported"),
        ));
    }
    let mut covered = 0u64;
    for (k, piece) in param.pieces.iter().enumerate() {
        let t = names.find(&piece.tensor, || {
            format!(
                "parameter {pi} ({:?} on rank {}), piece {k}",
                param.name, param.rank
            )
        })?;
        let tensor = &tensors[t];
        if tensor.elem_size != param.elem_size {
            return Err(bad(
                k,
                format!(
                    "{:?} has {}-byte elements, the parameter {}-byte ones",
                    tensor.name, tensor.elem_size, param.elem_size
                ),
            ));
        }
        let n = tensor.shape.len();
        if n > rank || piece.at.len() != rank {
            return Err(bad(
                k,
                format!(
                    "a {n}-dimensional tensor placed at {:?} in a {rank}-dimensional parameter",
                    piece.at
                ),
            ));
        }
        let (at, extent) = match piece.select {
            Select::Whole => (Dims::of(&[0; MAX_DIMS][..n]), Dims::of(&tensor.shape)),
            Select::Dim { dim, start, end }
                if dim < n && start <= end && end <= tensor.shape[dim] =>
            {
                let mut at = Dims::of(&[0; MAX_DIMS][..n]);
                let mut extent = Dims::of(&tensor.shape);
                at[dim] = start;
                extent[dim] = end - start;
                (at, extent)
            }
            ref s => {
                return Err(bad(
                    k,
                    format!(
                        "{s:?} is not inside {:?}'s shape {:?}",
                        tensor.name, tensor.shape
                    ),
                ))
            }
        };
        let padded = &padded(&extent, rank, 1)[..rank];
        for j in 0..rank {
            if piece.at[j]
                .checked_add(padded[j])
                .is_none_or(|e| e > param.shape[j])
            {
                return Err(bad(
                    k,
                    format!(
                        "a box of {padded:?} at {:?} does not fit the parameter's shape {:?}",
                        piece.at, param.shape
                    ),
                ));
            }
        }
        let volume = padded.iter().product::<u64>();
        if volume > 0 {
            for (m, other) in out.iter().enumerate() {
                let other_extent = padded_of(other, rank);
                let disjoint = (0..rank).any(|j| {
                    piece.at[j] + padded[j] <= other.dst_at[j]
                        || other.dst_at[j] + other_extent[j] <= piece.at[j]
                });
                if !disjoint && other_extent.iter().product::<u64>() > 0 {
                    return Err(PlanError::OverlappingPieces {
                        param: pi,
                        name: param.name.clone(),
                        rank: param.rank,
                        first: m,
                        second: k,
                    });
                }
            }
        }
        covered += volume;
        out.push(Resolved {
            tensor: t,
            at,
            extent,
            dst_at: &piece.at,
        });
    }
    let size = param.shape.iter().product::<u64>();
    if covered != size {
        return Err(PlanError::Uncovered {
            param: pi,
            name: param.name.clone(),
            rank: param.rank,
            covered: covered * param.elem_size,
            size: size * param.elem_size,
        });
    }
    Ok(())
}

/// `v` with `fill` prepended up to `rank` entries (the first `rank` of the array count).
fn padded(v: &[u64], rank: usize, fill: u64) -> [u64; MAX_DIMS] {
    let mut p = [fill; MAX_DIMS];
    p[rank - v.len()..rank].copy_from_slice(v);
    p
}

fn padded_of(r: &Resolved<'_>, rank: usize) -> [u64; MAX_DIMS] {
    padded(&r.extent, rank, 1)
}

/// The runs of `piece` held by a holding of `slice`: sources relative to the holding's buffer,
/// destinations relative to the parameter.
fn piece_runs(
    param: &Param,
    piece: &Resolved<'_>,
    g: &Geometry<'_>,
    slice: &Slice,
    out: &mut impl FnMut(Run),
) {
    let rank = param.shape.len();
    let n = piece.at.len();
    match *slice {
        Slice::Whole | Slice::Flat { .. } => {
            let src_shape = padded(g.shape, rank, 1);
            let src_at = padded(&piece.at, rank, 0);
            let extent = padded(&piece.extent, rank, 1);
            let copy = BoxCopy {
                extent: &extent[..rank],
                src_shape: &src_shape[..rank],
                src_at: &src_at[..rank],
                dst_shape: &param.shape,
                dst_at: piece.dst_at,
                elem_size: g.elem_size,
            };
            match *slice {
                Slice::Flat { start, end } => copy.runs(&mut |run: Run| run.clip(start, end, out)),
                _ => copy.runs(out),
            }
        }
        Slice::Dim { dim, start, end } => {
            // The box ∩ the slab, in the slab's own coordinates.
            let lo = piece.at[dim].max(start);
            let hi = (piece.at[dim] + piece.extent[dim]).min(end);
            if lo >= hi {
                return;
            }
            let mut extent = padded(&piece.extent, rank, 1);
            let mut src_at = padded(&piece.at, rank, 0);
            let mut src_shape = padded(g.shape, rank, 1);
            let mut dst_at = padded(piece.dst_at, rank, 0);
            let d = rank - n + dim;
            extent[d] = hi - lo;
            src_at[d] = lo - start;
            src_shape[d] = end - start;
            dst_at[d] += lo - piece.at[dim];
            BoxCopy {
                extent: &extent[..rank],
                src_shape: &src_shape[..rank],
                src_at: &src_at[..rank],
                dst_shape: &param.shape,
                dst_at: &dst_at[..rank],
                elem_size: g.elem_size,
            }
            .runs(out);
        }
    }
}

/// Hands a class's fragments to its holders, each taking its amount in turn, in the order of
/// their tensors: each holder sends a contiguous stretch of the tensors (to every receiver that
/// needs them), so it reads — and stages, when it transforms — about its share of the data
/// rather than all of it.
fn assign(
    fragments: &mut [Shared],
    holders: &[u32],
    amounts: &[u64],
    holdings: &[TensorHoldings],
    layout: &Layout,
    writes: &mut Writes,
) {
    fragments.sort_by_key(|f| (f.tensor, f.holding));
    let mut who = 0usize;
    let mut left = amounts.first().copied().unwrap_or(0);
    let (mut head, mut tail) = (Vec::new(), Vec::new());
    for f in fragments.iter() {
        let shard_of = |i: usize| {
            let hs = &holdings[f.tensor].holdings[f.holding].holders;
            debug_assert_eq!(hs[i].0, holders[i]);
            hs[i].1
        };
        let param = &layout.params[f.param as usize];
        let mut pending = vec![f.run];
        while let Some(run) = pending.pop() {
            while left == 0 {
                who += 1;
                left = amounts[who];
            }
            if run.bytes() <= left {
                left -= run.bytes();
                writes.push(write(
                    holders[who],
                    shard_of(who),
                    f.param as usize,
                    param,
                    run,
                ));
            } else {
                head.clear();
                tail.clear();
                run.split(left, &mut head, &mut tail);
                for &r in &head {
                    writes.push(write(
                        holders[who],
                        shard_of(who),
                        f.param as usize,
                        param,
                        r,
                    ));
                }
                left = 0;
                pending.extend(tail.iter().rev());
            }
        }
    }
}

/// Joins `x` onto `w` where it continues it (same shard and parameter): contiguous bytes into
/// one longer row, a next row (or rows at the same strides) into a strided run.
fn join(w: &mut Write, x: &Write) -> bool {
    if w.src_shard != x.src_shard || w.dst_param != x.dst_param {
        return false;
    }
    if w.count == 1
        && x.count == 1
        && x.src_offset == w.src_offset + w.len
        && x.dst_offset == w.dst_offset + w.len
    {
        w.len += x.len;
        w.src_stride = w.len;
        w.dst_stride = w.len;
        return true;
    }
    if x.len != w.len {
        return false;
    }
    let (ss, ds) = if w.count > 1 {
        (w.src_stride, w.dst_stride)
    } else if x.count > 1 {
        (x.src_stride, x.dst_stride)
    } else {
        (
            x.src_offset.wrapping_sub(w.src_offset),
            x.dst_offset.wrapping_sub(w.dst_offset),
        )
    };
    let agrees = |c: u64, s: u64, d: u64| c == 1 || (s, d) == (ss, ds);
    let next = |base: u64, stride: u64| {
        stride
            .checked_mul(w.count)
            .and_then(|o| o.checked_add(base))
    };
    if ss >= w.len
        && ds >= w.len
        && agrees(w.count, w.src_stride, w.dst_stride)
        && agrees(x.count, x.src_stride, x.dst_stride)
        && next(w.src_offset, ss) == Some(x.src_offset)
        && next(w.dst_offset, ds) == Some(x.dst_offset)
    {
        w.count += x.count;
        w.src_stride = ss;
        w.dst_stride = ds;
        return true;
    }
    false
}
