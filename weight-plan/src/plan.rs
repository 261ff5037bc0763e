//! From a [`Layout`] to its [`Plan`]: each parameter's pieces cut along the holdings of their
//! tensors, bytes with one holder sent by it, replicated bytes split by [`balance`], and
//! neighbouring runs merged.

use std::collections::HashMap;

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
    at: Vec<u64>,
    extent: Vec<u64>,
    /// Where the box lands in the parameter (padded to its rank).
    dst_at: &'a [u64],
}

/// A fragment whose bytes several ranks hold: which holding, which parameter, what.
struct Shared {
    tensor: usize,
    holding: usize,
    param: u32,
    run: Run,
}

/// Computes the plan, or says what in the layout is wrong.
pub fn plan(layout: &Layout) -> Result<Plan, PlanError> {
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
    let mut class_fragments: Vec<Vec<Shared>> = (0..classes.len()).map(|_| Vec::new()).collect();
    let mut writes = Writes::new(&expected_writes(layout, &names, &holdings));
    let mut candidates = Vec::new();

    // Parameters by receiver, so that each sender's writes come out grouped by receiver.
    let mut order: Vec<usize> = (0..layout.params.len()).collect();
    order.sort_by_key(|&i| layout.params[i].rank);
    for &pi in &order {
        let param = &layout.params[pi];
        let pieces = resolve(pi, param, &names, tensors)?;
        for piece in &pieces {
            if piece.extent.contains(&0) {
                continue;
            }
            let g = &geometry[piece.tensor];
            let th = &holdings[piece.tensor];
            th.candidates(g, &piece.at, &piece.extent, &mut candidates);
            let mut found = 0u64;
            for &h in &candidates {
                let holding = &th.holdings[h];
                let mut emit = |run: Run| {
                    found += run.bytes();
                    if let Some((rank, shard)) = holding.single {
                        writes.push(write(rank, shard, pi, param, run));
                    } else {
                        let class = class_of_holding[piece.tensor][h];
                        classes[class].1 += run.bytes();
                        class_fragments[class].push(Shared {
                            tensor: piece.tensor,
                            holding: h,
                            param: pi as u32,
                            run,
                        });
                    }
                };
                piece_runs(param, piece, g, &holding.slice, &mut emit);
            }
            let want = piece.extent.iter().product::<u64>() * g.elem_size;
            if found != want {
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

    let amounts = balance(&writes.sent, &classes);
    for ((fragments, amounts), (holders, _)) in
        class_fragments.iter_mut().zip(&amounts).zip(&classes)
    {
        assign(fragments, holders, amounts, &holdings, layout, &mut writes);
    }
    let Writes {
        mut by_sender,
        sent,
    } = writes;
    let receivers = layout.params.iter().map(|p| p.rank as usize + 1).max();
    let mut received = vec![0u64; receivers.unwrap_or(0)];
    for bucket in &mut by_sender {
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
    Ok(Plan {
        by_sender,
        sent,
        received,
    })
}

/// The plan's writes as they are made, per sender, each joined to the one before it where it
/// continues it.
struct Writes {
    by_sender: Vec<Vec<Write>>,
    sent: Vec<u64>,
}

impl Writes {
    /// Lists with room for about `expected[rank]` writes each: grown one doubling at a time
    /// from empty, a real model's millions of writes were a third of the plan's time
    /// (reallocation copies and their page faults).
    fn new(expected: &[usize]) -> Writes {
        Writes {
            by_sender: expected
                .iter()
                .map(|&n| Vec::with_capacity(n.min(MAX_RESERVED)))
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
) -> Result<Vec<Resolved<'a>>, PlanError> {
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
    let mut out: Vec<Resolved<'a>> = Vec::with_capacity(param.pieces.len());
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
            Select::Whole => (vec![0; n], tensor.shape.clone()),
            Select::Dim { dim, start, end }
                if dim < n && start <= end && end <= tensor.shape[dim] =>
            {
                let mut at = vec![0; n];
                let mut extent = tensor.shape.clone();
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
    Ok(out)
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
