//! `xfer._xfer.EpStep`: one step of MoE dispatch and combine at one rank (crate
//! `xfer-ep-plan`), for `xfer.ep`, which carries out what it returns on an engine. The plan's
//! per-row data comes back as columns (`bytes` of little-endian `int64`, viewed with
//! `numpy.frombuffer`), its actions as tuples.

use pyo3::prelude::*;
use pyo3::types::{PyBytes, PyDict};
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
/// row_bytes, private_rows, overflow_rows)`.
type LayoutArgs = (u32, u32, u32, u32, u64, u32, u32);

fn layout_of(py: Python<'_>, a: LayoutArgs) -> PyResult<Layout> {
    let l = Layout {
        ranks: a.0,
        experts_per_rank: a.1,
        top_k: a.2,
        max_tokens: a.3,
        row_bytes: a.4,
        private_rows: a.5,
        overflow_rows: a.6,
    };
    l.validate()
        .map_err(|e| errors::invalid(py, e.to_string()))?;
    Ok(l)
}

/// Bytes per set of each region of a layout: `send`, `dispatch`, `combine_send`, `combine`,
/// and the header sizes.
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
    Ok(d)
}

/// One step at one rank: the plan of its sends and the protocol's state machine.
#[pyclass(module = "xfer._xfer")]
pub(crate) struct EpStep {
    layout: Layout,
    machine: StepMachine,
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

#[pymethods]
impl EpStep {
    /// Plans rank `rank`'s step `epoch` from `topk_idx` (little-endian `int64` bytes,
    /// `tokens × top_k`, `-1` for none) and starts its protocol at `now` (ns): the first
    /// actions are the dispatch A writes and the waits for every active source.
    #[new]
    #[pyo3(signature = (layout, rank, epoch, topk_idx, active, now, timeout, *, tag = 0xE, eplb = None))]
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
        let plan = SendPlan::new(&layout, &map, rank, epoch, tag, &ids, &active)
            .map_err(|e| errors::invalid(py, e.to_string()))?;
        let machine = StepMachine::new(&layout, plan, now, timeout);
        Ok(Self { layout, machine })
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

    /// Columns of the rows this rank sends, in send order: `token`, `slot`, `peer`, `expert`
    /// (local at the peer).
    fn send_rows<'py>(&self, py: Python<'py>) -> Vec<Bound<'py, PyBytes>> {
        let rows = &self.machine.plan().rows;
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

    /// Once dispatched: the received rows as runs, columns `recv_offset` (dispatch region),
    /// `combine_offset` (combine send buffer), `count`, `expert`, `position` (in the expert's
    /// rows: sources in rank order, each in its order), and the rows per local expert.
    fn recv_runs<'py>(&self, py: Python<'py>) -> PyResult<(Vec<Bound<'py, PyBytes>>, Vec<u64>)> {
        let Some(r) = self.machine.receive() else {
            return Err(errors::invalid(
                py,
                "recv_runs before the step is dispatched",
            ));
        };
        let row = self.layout.row_bytes;
        let mut cols: [Vec<i64>; 5] = Default::default();
        let mut position = vec![0u64; self.layout.experts_per_rank as usize];
        for i in r.expert_order() {
            let rr = r.rows[i];
            let (recv, comb) = (rr.offset, r.combine_send_row_offset(i));
            let pos = position[rr.expert as usize];
            position[rr.expert as usize] += 1;
            let n = cols[2].len();
            // Extend the last run when this row follows it in both buffers and the expert.
            if n > 0 {
                let c = cols[2][n - 1] as u64;
                if cols[3][n - 1] == i64::from(rr.expert)
                    && cols[0][n - 1] as u64 + c * row == recv
                    && cols[1][n - 1] as u64 + c * row == comb
                {
                    cols[2][n - 1] += 1;
                    continue;
                }
            }
            for (col, v) in cols.iter_mut().zip([
                recv as i64,
                comb as i64,
                1,
                i64::from(rr.expert),
                pos as i64,
            ]) {
                col.push(v);
            }
        }
        Ok((columns(py, &cols), r.expert_counts.clone()))
    }

    /// Once dispatched: the combine headers to write into the combine send buffer, as
    /// `(offset, bytes)`.
    fn combine_headers<'py>(&self, py: Python<'py>) -> PyResult<Vec<(u64, Bound<'py, PyBytes>)>> {
        let Some(r) = self.machine.receive() else {
            return Err(errors::invalid(
                py,
                "combine_headers before the step is dispatched",
            ));
        };
        Ok((0..self.layout.ranks)
            .filter(|&s| r.sources[s as usize])
            .map(|s| {
                let h =
                    xfer_ep_plan::plan::encode_combine_header(r.epoch, r.rank, r.valid[s as usize]);
                (r.combine_send_offset(s), PyBytes::new(py, &h))
            })
            .collect())
    }

    /// Starts combine at `now` (ns), once the expert outputs and the combine headers are in
    /// the combine send buffer.
    fn start_combine(&mut self, py: Python<'_>, now: u64) -> PyResult<()> {
        self.machine
            .start_combine(now)
            .map_err(|e| errors::invalid(py, e.to_string()))
    }

    /// Once done: each peer's block of combine rows, `(peer, rows_offset, rows)`, and for every
    /// row in send order whether its expert's output came back.
    fn combine_blocks(&self) -> (Vec<(u32, u64, u64)>, Vec<bool>) {
        let p = self.machine.plan();
        let blocks = (0..self.layout.ranks)
            .map(|peer| {
                (
                    peer,
                    p.combine_block_offset(peer) + xfer_ep_plan::COMBINE_HEADER_BYTES,
                    p.rows_to(peer),
                )
            })
            .collect();
        let valid = (0..p.rows.len())
            .map(|i| self.machine.row_combined(i))
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
