//! `xfer._xfer.EpStep`: one step of MoE dispatch and combine at one rank (crate
//! `xfer-ep-plan`), for `xfer.ep`, which carries out what it returns on an engine. The plan's
//! per-row data comes back as columns (`bytes` of little-endian `int64`, viewed with
//! `numpy.frombuffer`), its actions as tuples.

use std::cell::Cell;

use pyo3::buffer::PyBuffer;
use pyo3::prelude::*;
use pyo3::types::{PyBytes, PyDict};
use xfer_ep_plan::moves::{self, Dtype, ExpertLayout, RecvPlace};
use xfer_ep_plan::step::{Action, Stage};
use xfer_ep_plan::{ExpertMap, Layout, Phase, SendPlan, StepMachine};

use crate::errors;

fn phase_name(p: Phase) -> &'static str {
    match p {
        Phase::DispatchA => "dispatch_a",
        Phase::DispatchB => "dispatch_b",
        Phase::Combine => "combine",
    }
}

fn columns<'py>(py: Python<'py>, cols: &[Vec<i64>]) -> Vec<Bound<'py, PyBytes>> {
    cols.iter()
        .map(|c| {
            PyBytes::new_with(py, c.len() * 8, |buf| {
                for (chunk, v) in buf.chunks_exact_mut(8).zip(c) {
                    chunk.copy_from_slice(&v.to_le_bytes());
                }
                Ok(())
            })
            .expect("filling new bytes cannot fail")
        })
        .collect()
}

/// The layout from its Python description: `(ranks, experts_per_rank, top_k, max_tokens,
/// row_bytes, private_rows, overflow_rows, combine_row_bytes, partial_row_bytes)`.
type LayoutArgs = (u32, u32, u32, u32, u64, u32, u32, u64, u64);

fn layout_of(py: Python<'_>, a: LayoutArgs) -> PyResult<Layout> {
    let l = Layout {
        ranks: a.0,
        experts_per_rank: a.1,
        top_k: a.2,
        max_tokens: a.3,
        row_bytes: a.4,
        combine_row_bytes: a.7,
        partial_row_bytes: a.8,
        private_rows: a.5,
        overflow_rows: a.6,
    };
    l.validate()
        .map_err(|e| errors::invalid(py, e.to_string()))?;
    Ok(l)
}

/// Bytes per set of each region of a layout: `send`, `dispatch`, `combine_send`, `combine`;
/// the header sizes; a source's `slot` in the dispatch region and a row on the wire
/// (`wire_row`: the row, then its `route` record).
#[pyfunction]
pub(crate) fn ep_region_bytes<'py>(
    py: Python<'py>,
    layout: LayoutArgs,
) -> PyResult<Bound<'py, PyDict>> {
    let l = layout_of(py, layout)?;
    let d = PyDict::new(py);
    d.set_item("send", l.send_buffer_bytes())?;
    d.set_item("dispatch", l.dispatch_region_bytes())?;
    d.set_item("combine_send", l.combine_send_bytes())?;
    d.set_item("combine", l.combine_region_bytes())?;
    d.set_item("header", l.header_bytes())?;
    d.set_item("combine_header", xfer_ep_plan::COMBINE_HEADER_BYTES)?;
    d.set_item("capacity_rows", l.receive_capacity())?;
    d.set_item("slot", l.slot_bytes())?;
    d.set_item("wire_row", l.wire_row_bytes())?;
    d.set_item("route", l.route_bytes())?;
    Ok(d)
}

/// One step at one rank: the plan of its sends and the protocol's state machine.
#[pyclass(module = "xfer._xfer")]
pub(crate) struct EpStep {
    layout: Layout,
    machine: StepMachine,
    /// The received slots' places, once their routes are read.
    places: Option<Vec<RecvPlace>>,
}

/// A writable, C-contiguous buffer of exactly `len` elements (numpy arrays, torch tensors'
/// numpy views), as cells: Python may hold other views of it, so no `&mut`.
fn writable<'a, T: pyo3::buffer::Element>(
    py: Python<'_>,
    buf: &'a PyBuffer<T>,
    what: &str,
    len: usize,
) -> PyResult<&'a [Cell<T>]> {
    let cells = crate::ffi::buffer_cells(buf).ok_or_else(|| {
        errors::invalid(py, format!("{what} must be a writable, C-contiguous array"))
    })?;
    if cells.len() != len {
        return Err(errors::invalid(
            py,
            format!("{what} has {} elements, not {len}", cells.len()),
        ));
    }
    Ok(cells)
}

/// A buffer read as values (copied when Python holds it read-only).
fn readable<T: pyo3::buffer::Element + Copy>(
    py: Python<'_>,
    buf: &PyBuffer<T>,
    what: &str,
    len: usize,
) -> PyResult<Vec<T>> {
    if buf.item_count() != len {
        return Err(errors::invalid(
            py,
            format!("{what} has {} elements, not {len}", buf.item_count()),
        ));
    }
    buf.to_vec(py)
}

fn expert_layout(py: Python<'_>, name: &str) -> PyResult<ExpertLayout> {
    match name {
        "deepep" => Ok(ExpertLayout::DeepEp),
        "flat" => Ok(ExpertLayout::Flat),
        other => Err(errors::invalid(py, format!("no layout {other:?}"))),
    }
}

fn dtype_of(py: Python<'_>, name: &str) -> PyResult<Dtype> {
    match name {
        "bfloat16" => Ok(Dtype::Bf16),
        "float16" => Ok(Dtype::F16),
        "float32" => Ok(Dtype::F32),
        other => Err(errors::invalid(py, format!("no dtype {other:?}"))),
    }
}

fn stage_name(s: &Stage) -> String {
    match s {
        Stage::Dispatching => "dispatching".into(),
        Stage::Dispatched => "dispatched".into(),
        Stage::Combining => "combining".into(),
        Stage::Done => "done".into(),
        Stage::Failed(e) => format!("failed: {e}"),
    }
}

impl EpStep {
    /// The received slots' places (computed once per step, after `read_routes`).
    fn places(&mut self, py: Python<'_>) -> PyResult<&[RecvPlace]> {
        if self.places.is_none() {
            let Some(r) = self.machine.receive().filter(|r| r.routed) else {
                return Err(errors::invalid(py, "the routes are not read (read_routes)"));
            };
            self.places = Some(r.places());
        }
        Ok(self.places.as_deref().unwrap_or_default())
    }
}

fn starts_of(counts: &[u64]) -> Vec<u64> {
    counts
        .iter()
        .scan(0u64, |acc, &c| {
            let s = *acc;
            *acc += c;
            Some(s)
        })
        .collect()
}

#[pymethods]
impl EpStep {
    /// Plans rank `rank`'s step `epoch` from `topk_idx` (little-endian `int64` bytes,
    /// `tokens × top_k`, `-1` for none) and starts its protocol at `now` (ns): the first
    /// actions are the dispatch A writes and the waits for every active source. `weights`
    /// (little-endian `float32` bytes, `tokens × top_k`): the weights travel with the rows
    /// and combine returns one partial sum per (token, rank).
    #[new]
    #[pyo3(signature = (layout, rank, epoch, topk_idx, active, now, timeout, *, tag = 0xE, eplb = None, weights = None))]
    #[allow(clippy::too_many_arguments)]
    fn new(
        py: Python<'_>,
        layout: LayoutArgs,
        rank: u32,
        epoch: u32,
        topk_idx: &[u8],
        active: Vec<bool>,
        now: u64,
        timeout: u64,
        tag: u8,
        eplb: Option<Vec<Vec<i64>>>,
        weights: Option<&[u8]>,
    ) -> PyResult<Self> {
        let layout = layout_of(py, layout)?;
        if topk_idx.len() % 8 != 0 {
            return Err(errors::invalid(py, "topk_idx must be int64 bytes"));
        }
        let ids: Vec<i64> = topk_idx
            .chunks_exact(8)
            .map(|c| i64::from_le_bytes(c.try_into().expect("chunks of 8")))
            .collect();
        let map = match eplb {
            Some(t) => {
                ExpertMap::eplb(&layout, &t).map_err(|e| errors::invalid(py, e.to_string()))?
            }
            None => ExpertMap::identity(&layout),
        };
        let mut plan = SendPlan::new(&layout, &map, rank, epoch, tag, &ids, &active)
            .map_err(|e| errors::invalid(py, e.to_string()))?;
        if let Some(w) = weights {
            if w.len() % 4 != 0 {
                return Err(errors::invalid(py, "weights must be float32 bytes"));
            }
            let w: Vec<f32> = w
                .chunks_exact(4)
                .map(|c| f32::from_le_bytes(c.try_into().expect("chunks of 4")))
                .collect();
            plan = plan
                .with_weights(&w)
                .map_err(|e| errors::invalid(py, e.to_string()))?;
        }
        let machine = StepMachine::new(&layout, plan, now, timeout);
        Ok(Self {
            layout,
            machine,
            places: None,
        })
    }

    /// Whether the weights were given at dispatch (combine returns partial sums).
    #[getter]
    fn weighted(&self) -> bool {
        self.machine.plan().weighted()
    }

    /// The step's buffer set (0 or 1).
    #[getter]
    fn set(&self) -> u32 {
        self.machine.plan().set()
    }

    /// `"dispatching"`, `"dispatched"`, `"combining"`, `"done"` or `"failed: why"`.
    #[getter]
    fn stage(&self) -> String {
        stage_name(self.machine.stage())
    }

    /// This rank's count header (written in front of every peer's block).
    fn header<'py>(&self, py: Python<'py>) -> Bound<'py, PyBytes> {
        PyBytes::new(py, &self.machine.plan().header.encode(&self.layout))
    }

    /// Each peer's block in the send buffer: `(peer, block_offset, rows)`; the rows follow
    /// the header, in the order of `send_rows`.
    fn send_blocks(&self) -> Vec<(u32, u64, u64)> {
        let p = self.machine.plan();
        (0..self.layout.ranks)
            .map(|peer| (peer, p.block_offset(peer), p.rows_to(peer)))
            .collect()
    }

    /// Columns of the routed slots this rank sends (one row per token and peer carries them),
    /// in combine order: `token`, `slot`, `peer`, `expert` (local at the peer).
    fn send_rows<'py>(&self, py: Python<'py>) -> Vec<Bound<'py, PyBytes>> {
        let rows = &self.machine.plan().slots;
        columns(
            py,
            &[
                rows.iter().map(|r| i64::from(r.token)).collect(),
                rows.iter().map(|r| i64::from(r.slot)).collect(),
                rows.iter().map(|r| i64::from(r.peer)).collect(),
                rows.iter().map(|r| i64::from(r.expert)).collect(),
            ],
        )
    }

    /// Slots (`token × top_k + slot`) routed to a masked rank.
    fn masked_slots(&self) -> Vec<u64> {
        self.machine.plan().masked_slots.clone()
    }

    /// The next actions: `("post", peer, phase, imm, src_offset, dst_offset, len)` (the
    /// regions: dispatch phases from the send buffer to the peer's dispatch region, combine
    /// from the combine send buffer to its combine region) and `("expect", imm, source,
    /// phase)`.
    fn poll_actions<'py>(
        &mut self,
        py: Python<'py>,
    ) -> PyResult<Vec<Bound<'py, pyo3::types::PyTuple>>> {
        let mut out = Vec::new();
        while let Some(a) = self.machine.poll_action() {
            out.push(match a {
                Action::Post(w) => (
                    "post",
                    w.peer,
                    phase_name(w.phase),
                    w.imm,
                    w.src_offset,
                    w.dst_offset,
                    w.len,
                )
                    .into_pyobject(py)?,
                Action::Expect { imm, source, phase } => {
                    ("expect", imm, source, phase_name(phase)).into_pyobject(py)?
                }
            });
        }
        Ok(out)
    }

    /// An immediate landed, with the header bytes it announces (see `header_offset`,
    /// `combine_header_offset`); whether the step took it.
    fn handle_arrival(&mut self, now: u64, imm: u32, header: &[u8]) -> bool {
        self.machine.handle_arrival(now, imm, header)
    }

    /// The clock (ns) reached `now`.
    fn handle_timeout(&mut self, now: u64) {
        self.machine.handle_timeout(now)
    }

    /// A write posted to `peer` failed.
    fn handle_send_failed(&mut self, now: u64, peer: u32) {
        self.machine.handle_send_failed(now, peer)
    }

    /// The earliest deadline (ns) of a wait.
    fn poll_timeout(&self) -> Option<u64> {
        self.machine.poll_timeout()
    }

    /// Offset of `source`'s count header in the dispatch region.
    fn header_offset(&self, source: u32) -> u64 {
        self.machine.header_offset(source)
    }

    /// Offset of `peer`'s combine header in the combine region.
    fn combine_header_offset(&self, peer: u32) -> u64 {
        self.machine.combine_header_offset(peer)
    }

    /// Packs the send buffer (`send`: the whole region, both sets, `uint8`) from `x`
    /// (`[tokens, hidden]` as bytes): every peer's block gets this rank's header, then its
    /// rows in send order (one per token routed there), each with its route record. `fp8`: `x` is bf16 and each row is quantized once, as DeepEP's
    /// low-latency dispatch does (`"e4m3"`; `"e4m3_pow2"` rounds each scale up to a power of
    /// two), into the layout's fp8 rows (values, then a float32 scale per 128 channels).
    #[pyo3(signature = (x, send, *, fp8 = None))]
    fn pack(
        &self,
        py: Python<'_>,
        x: PyBuffer<u8>,
        send: PyBuffer<u8>,
        fp8: Option<&str>,
    ) -> PyResult<()> {
        let l = &self.layout;
        let tokens = self.machine.plan().slot_index.len() / l.top_k as usize;
        let row = l.row_bytes as usize;
        let send = writable(
            py,
            &send,
            "the send buffer",
            2 * l.send_buffer_bytes() as usize,
        )?;
        let round_scale = match fp8 {
            None => None,
            Some("e4m3") => Some(false),
            Some("e4m3_pow2") => Some(true),
            Some(other) => return Err(errors::invalid(py, format!("no fp8 format {other:?}"))),
        };
        let x_row = match round_scale {
            None => row,
            Some(_) => {
                let hidden = l.combine_row_bytes as usize / 2;
                if moves::fp8_row_bytes(hidden) != row {
                    return Err(errors::invalid(
                        py,
                        "fp8 rows need row_bytes = hidden + 4 x ceil(hidden / 128), combine_row_bytes = 2 x hidden",
                    ));
                }
                2 * hidden
            }
        };
        let mut owned;
        let x = match crate::ffi::buffer_cells(&x) {
            Some(c) if c.len() == tokens * x_row => c,
            _ => {
                owned = readable(py, &x, "x", tokens * x_row)?;
                Cell::from_mut(owned.as_mut_slice()).as_slice_of_cells()
            }
        };
        let mut quantized;
        let x = match round_scale {
            None => x,
            Some(round) => {
                quantized = moves::quantize_fp8(x, x_row / 2, round);
                Cell::from_mut(quantized.as_mut_slice()).as_slice_of_cells()
            }
        };
        self.machine.plan().pack(l, x, send);
        Ok(())
    }

    /// Once dispatched: reads the route record of every row here from `region` (the dispatch
    /// region, both sets, `uint8`) — a source whose records do not decode is masked — and
    /// returns the rows per local expert (`recv_count`).
    fn read_routes(&mut self, py: Python<'_>, region: PyBuffer<u8>) -> PyResult<Vec<u64>> {
        let region = writable(
            py,
            &region,
            "the dispatch region",
            2 * self.layout.dispatch_region_bytes() as usize,
        )?;
        self.machine
            .read_routes(region)
            .map_err(|e| errors::invalid(py, e.to_string()))?;
        self.places = None;
        self.expert_counts(py)
    }

    /// Once the routes are read: the rows per local expert (`recv_count`).
    fn expert_counts(&self, py: Python<'_>) -> PyResult<Vec<u64>> {
        self.machine
            .receive()
            .filter(|r| r.routed)
            .map(|r| r.expert_counts.clone())
            .ok_or_else(|| errors::invalid(py, "the routes are not read (read_routes)"))
    }

    /// Once the routes are read: copies the received rows from `region` (the dispatch region,
    /// both sets, `uint8`) into `out` (bytes of `[experts_per_rank, ranks × max_tokens, row]`
    /// for `"deepep"`, `[rows, row]` for `"flat"`), each into the place of every local expert
    /// its route names: for each local expert, the sources in rank order, each source's
    /// tokens in its order. Rows past an expert's count are left.
    /// With `scales` (fp8 rows), each row is split at `hidden`: its e4m3 values into `out`
    /// (rows of `hidden` bytes), its scales into `scales` (rows of the rest), both contiguous
    /// as DeepEP returns them.
    #[pyo3(signature = (region, out, layout, *, scales = None, hidden = 0))]
    fn unpack(
        &mut self,
        py: Python<'_>,
        region: PyBuffer<u8>,
        out: PyBuffer<u8>,
        layout: &str,
        scales: Option<PyBuffer<u8>>,
        hidden: usize,
    ) -> PyResult<()> {
        let shape = expert_layout(py, layout)?;
        let l = self.layout.clone();
        let counts = self.expert_counts(py)?;
        let starts = starts_of(&counts);
        let rows: u64 = counts.iter().sum();
        let region = writable(
            py,
            &region,
            "the dispatch region",
            2 * l.dispatch_region_bytes() as usize,
        )?;
        let row = l.row_bytes as usize;
        let Some(scales) = scales else {
            let need = moves::expert_layout_bytes(&l, shape, rows, l.row_bytes);
            let out = writable(py, &out, "out", need as usize)?;
            for place in self.places(py)? {
                let src = place.recv_offset as usize;
                let dst = moves::expert_offset(&l, shape, &starts, place, l.row_bytes) as usize;
                moves::copy_cells(&out[dst..dst + row], &region[src..src + row]);
            }
            return Ok(());
        };
        if hidden == 0 || hidden >= row {
            return Err(errors::invalid(py, "hidden must split a row in two"));
        }
        let rest = row - hidden;
        let need =
            |width: usize| moves::expert_layout_bytes(&l, shape, rows, width as u64) as usize;
        let out = writable(py, &out, "out", need(hidden))?;
        let scales = writable(py, &scales, "scales", need(rest))?;
        for place in self.places(py)? {
            let a = moves::expert_offset(&l, shape, &starts, place, hidden as u64) as usize;
            let b = moves::expert_offset(&l, shape, &starts, place, rest as u64) as usize;
            let src = place.recv_offset as usize;
            moves::copy_cells(&out[a..a + hidden], &region[src..src + hidden]);
            moves::copy_cells(&scales[b..b + rest], &region[src + hidden..src + row]);
        }
        Ok(())
    }

    /// Once the routes are read: copies the experts' outputs (`expert_out`, bytes in the
    /// layout the rows were unpacked to, elements of `dtype`) back into `csend` (the combine
    /// send buffer, both sets) in each source's order (token, then slot), with the combine
    /// headers; for a source that gave its weights at dispatch, each row's slots weighted and
    /// summed in fp32 (slots in order) instead, one partial sum per row.
    #[pyo3(signature = (expert_out, csend, layout, *, dtype = "bfloat16"))]
    fn repack(
        &mut self,
        py: Python<'_>,
        expert_out: PyBuffer<u8>,
        csend: PyBuffer<u8>,
        layout: &str,
        dtype: &str,
    ) -> PyResult<()> {
        let dtype = dtype_of(py, dtype)?;
        let shape = expert_layout(py, layout)?;
        let l = self.layout.clone();
        let counts = self.expert_counts(py)?;
        let starts = starts_of(&counts);
        let csend = writable(
            py,
            &csend,
            "the combine send buffer",
            2 * l.combine_send_bytes() as usize,
        )?;
        let need = moves::expert_layout_bytes(&l, shape, counts.iter().sum(), l.combine_row_bytes)
            as usize;
        let mut owned;
        let src = match crate::ffi::buffer_cells(&expert_out) {
            Some(c) if c.len() == need => c,
            _ => {
                owned = readable(py, &expert_out, "expert_out", need)?;
                Cell::from_mut(owned.as_mut_slice()).as_slice_of_cells()
            }
        };
        let row = l.combine_row_bytes as usize;
        for place in self.places(py)? {
            let Some(dst) = place.combine_offset else {
                continue;
            };
            let dst = dst as usize;
            let at = moves::expert_offset(&l, shape, &starts, place, l.combine_row_bytes) as usize;
            moves::copy_cells(&csend[dst..dst + row], &src[at..at + row]);
        }
        if let Some(r) = self.machine.receive() {
            if r.weighted.iter().any(|&w| w) {
                if l.partial_row_bytes != 4 * (l.combine_row_bytes / dtype.size() as u64) {
                    return Err(errors::invalid(
                        py,
                        "partial sums need partial_row_bytes = 4 x hidden",
                    ));
                }
                r.repack_partials(dtype, shape, src, csend);
            }
            moves::write_combine_headers(r, csend);
        }
        Ok(())
    }

    /// Once done: `y` (`[tokens, hidden]` float32) gets each token's outputs from `combine`
    /// (the combine region, both sets) weighted by `weights` (`[tokens, top_k]` float32) and
    /// summed in fp32, slots in order; slots whose output did not come back count zero. When
    /// the weights were given at dispatch (`weights` is then not needed), the partial sums
    /// of each token's ranks are added in rank order.
    fn reduce(
        &self,
        py: Python<'_>,
        combine: PyBuffer<u8>,
        weights: Option<PyBuffer<f32>>,
        y: PyBuffer<f32>,
        dtype: &str,
    ) -> PyResult<()> {
        let dtype = dtype_of(py, dtype)?;
        let l = &self.layout;
        if l.combine_row_bytes % dtype.size() as u64 != 0 {
            return Err(errors::invalid(
                py,
                "rows are not whole elements of the dtype",
            ));
        }
        let slots = self.machine.plan().slot_index.len();
        let hidden = (l.combine_row_bytes / dtype.size() as u64) as usize;
        let tokens = slots / l.top_k as usize;
        let combine = writable(
            py,
            &combine,
            "the combine region",
            2 * l.combine_region_bytes() as usize,
        )?;
        let weights = match weights {
            Some(w) => readable(py, &w, "topk_weights", slots)?,
            None if self.machine.plan().weighted() => Vec::new(),
            None => {
                return Err(errors::invalid(
                    py,
                    "topk_weights are needed (none given at dispatch)",
                ))
            }
        };
        let y = writable(py, &y, "y", tokens * hidden)?;
        self.machine.reduce(dtype, combine, &weights, y);
        Ok(())
    }

    /// Starts combine at `now` (ns), once the expert outputs and the combine headers are in
    /// the combine send buffer.
    fn start_combine(&mut self, py: Python<'_>, now: u64) -> PyResult<()> {
        self.machine
            .start_combine(now)
            .map_err(|e| errors::invalid(py, e.to_string()))
    }

    /// Once done: each peer's block of combine rows, `(peer, rows_offset, rows)`, and for every
    /// slot of `send_rows` whether its expert's output came back.
    fn combine_blocks(&self) -> (Vec<(u32, u64, u64)>, Vec<bool>) {
        let p = self.machine.plan();
        let blocks = (0..self.layout.ranks)
            .map(|peer| {
                (
                    peer,
                    p.combine_block_offset(peer) + xfer_ep_plan::COMBINE_HEADER_BYTES,
                    p.combine_rows_from(peer),
                )
            })
            .collect();
        let valid = (0..p.slots.len())
            .map(|j| self.machine.slot_combined(j))
            .collect();
        (blocks, valid)
    }

    /// Ranks this step masked.
    fn newly_masked(&self) -> Vec<u32> {
        self.machine.newly_masked().to_vec()
    }

    /// Immediates whose waits this step gave up (for `reset_imm` at `clean`).
    fn abandoned_imms(&self) -> Vec<u32> {
        self.machine.abandoned_imms().to_vec()
    }

    /// The step's view of who is active.
    fn active(&self) -> Vec<bool> {
        self.machine.active().to_vec()
    }

    /// Rows each source sent this rank, and how many of them are here.
    fn received(&self) -> Option<(Vec<u64>, Vec<u64>)> {
        self.machine
            .receive()
            .map(|r| (r.sent.clone(), r.valid.clone()))
    }
}
