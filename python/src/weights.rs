//! `xfer._xfer.plan_weights`: the RL weight-sync plan (crate `xfer-weight-plan`) from plain
//! Python values, its writes returned as columns (`bytes` of little-endian `uint64`, which
//! `xfer.weights` views with `numpy.frombuffer`): a real model's plan has millions of writes,
//! too many for a list of objects.

use pyo3::prelude::*;
use pyo3::types::{PyBytes, PyDict, PyTuple};
use xfer_weight_plan::{plan, Layout, Param, Piece, Select, Shard, Slice, Tensor, Write};

use crate::errors;

/// The column names, in the order of [`column`].
const COLUMNS: [&str; 10] = [
    "src_rank",
    "src_shard",
    "src_offset",
    "dst_rank",
    "dst_param",
    "dst_offset",
    "len",
    "count",
    "src_stride",
    "dst_stride",
];

fn column(w: &Write, i: usize) -> u64 {
    match i {
        0 => w.src_rank.into(),
        1 => w.src_shard.into(),
        2 => w.src_offset,
        3 => w.dst_rank.into(),
        4 => w.dst_param.into(),
        5 => w.dst_offset,
        6 => w.len,
        7 => w.count,
        8 => w.src_stride,
        _ => w.dst_stride,
    }
}

/// `None` → whole; `("flat", start, end)`; `("dim", dim, start, end)`.
fn slice_of(py: Python<'_>, what: &str, v: &Bound<'_, PyAny>) -> PyResult<Slice> {
    if v.is_none() {
        return Ok(Slice::Whole);
    }
    let bad = || {
        errors::invalid(
            py,
            format!(
                "{what}: a slice is None, (\"flat\", start, end) or (\"dim\", dim, start, end)"
            ),
        )
    };
    let t = v.cast::<PyTuple>().map_err(|_| bad())?;
    let kind: String = t.get_item(0).and_then(|k| k.extract()).map_err(|_| bad())?;
    match (kind.as_str(), t.len()) {
        ("flat", 3) => {
            let (_, start, end): (String, u64, u64) = t.extract().map_err(|_| bad())?;
            Ok(Slice::Flat { start, end })
        }
        ("dim", 4) => {
            let (_, dim, start, end): (String, usize, u64, u64) = t.extract().map_err(|_| bad())?;
            Ok(Slice::Dim { dim, start, end })
        }
        _ => Err(bad()),
    }
}

fn select_of(py: Python<'_>, what: &str, v: &Bound<'_, PyAny>) -> PyResult<Select> {
    match slice_of(py, what, v)? {
        Slice::Whole => Ok(Select::Whole),
        Slice::Dim { dim, start, end } => Ok(Select::Dim { dim, start, end }),
        Slice::Flat { .. } => Err(errors::invalid(
            py,
            format!("{what}: a piece selects a box (None or (\"dim\", dim, start, end)), not a flat range"),
        )),
    }
}

type PieceArgs<'py> = (String, Bound<'py, PyAny>, Vec<u64>);
type ParamArgs<'py> = (u32, String, Vec<u64>, u64, Vec<PieceArgs<'py>>);

/// Plans a weight update. `tensors`: `(name, shape, elem_size)`; `shards`: `(rank, tensor,
/// slice)` with slice `None` (whole), `("flat", start_byte, end_byte)` or `("dim", dim, start,
/// end)`; `params`: `(rank, name, shape, elem_size, pieces)` with pieces `(tensor, select,
/// at)`, select `None` or `("dim", dim, start, end)`. Returns a dict: each column of the
/// writes (see `xfer.weights`) as bytes of little-endian uint64, and `sent` / `received`
/// (bytes per trainer / inference rank). `sender` or `receiver` keeps only the writes of that
/// trainer rank, or to that inference rank. A layout the plan refuses raises
/// `InvalidArgumentError` naming the tensor, shard or parameter.
#[pyfunction]
#[pyo3(signature = (tensors, shards, params, *, sender=None, receiver=None))]
pub(crate) fn plan_weights<'py>(
    py: Python<'py>,
    tensors: Vec<(String, Vec<u64>, u64)>,
    shards: Vec<(u32, String, Bound<'py, PyAny>)>,
    params: Vec<ParamArgs<'py>>,
    sender: Option<u32>,
    receiver: Option<u32>,
) -> PyResult<Bound<'py, PyDict>> {
    let tensors = tensors
        .into_iter()
        .map(|(name, shape, elem_size)| Tensor {
            name,
            shape,
            elem_size,
        })
        .collect();
    let shards = shards
        .into_iter()
        .enumerate()
        .map(|(i, (rank, tensor, slice))| {
            Ok(Shard {
                rank,
                slice: slice_of(py, &format!("shard {i} ({tensor:?})"), &slice)?,
                tensor,
            })
        })
        .collect::<PyResult<_>>()?;
    let params = params
        .into_iter()
        .enumerate()
        .map(|(i, (rank, name, shape, elem_size, pieces))| {
            let pieces = pieces
                .into_iter()
                .enumerate()
                .map(|(k, (tensor, select, at))| {
                    Ok(Piece {
                        select: select_of(
                            py,
                            &format!("parameter {i} ({name:?}), piece {k}"),
                            &select,
                        )?,
                        tensor,
                        at,
                    })
                })
                .collect::<PyResult<_>>()?;
            Ok(Param {
                rank,
                name,
                shape,
                elem_size,
                pieces,
            })
        })
        .collect::<PyResult<_>>()?;
    let layout = Layout {
        tensors,
        shards,
        params,
    };
    let p = py
        .detach(|| plan(&layout))
        .map_err(|e| errors::invalid(py, e.to_string()))?;
    let keep = |w: &&Write| {
        sender.is_none_or(|s| w.src_rank == s) && receiver.is_none_or(|r| w.dst_rank == r)
    };
    let writes: Vec<&Write> = match sender {
        Some(s) => p.writes_from(s).iter().filter(keep).collect(),
        None => p.writes().filter(keep).collect(),
    };
    let out = PyDict::new(py);
    for (i, name) in COLUMNS.iter().enumerate() {
        let col = PyBytes::new_with(py, writes.len() * 8, |buf| {
            for (chunk, w) in buf.chunks_exact_mut(8).zip(&writes) {
                chunk.copy_from_slice(&column(w, i).to_le_bytes());
            }
            Ok(())
        })?;
        out.set_item(name, col)?;
    }
    out.set_item("sent", p.sent)?;
    out.set_item("received", p.received)?;
    Ok(out)
}
