use crate::{Layout, PlanError};

/// Where each logical expert runs: its physical replicas (EPLB). Physical expert `p` is local
/// expert `p % experts_per_rank` of rank `p / experts_per_rank`.
///
/// A token's slot picks among an expert's replicas by `(token × top_k + slot) mod replicas`:
/// deterministic, the same on every rank, and spread evenly over a batch.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ExpertMap {
    replicas: Vec<Vec<u32>>,
}

impl ExpertMap {
    /// One replica per expert: logical expert `e` is physical expert `e`.
    pub fn identity(layout: &Layout) -> Self {
        Self {
            replicas: (0..layout.physical_experts()).map(|e| vec![e]).collect(),
        }
    }

    /// The EPLB table: for each logical expert, its physical experts (`-1` entries pad a row,
    /// as vLLM's `logical_to_physical_map` does, and are skipped).
    pub fn eplb(layout: &Layout, logical_to_physical: &[Vec<i64>]) -> Result<Self, PlanError> {
        let physical = i64::from(layout.physical_experts());
        let mut replicas = Vec::with_capacity(logical_to_physical.len());
        for (e, row) in logical_to_physical.iter().enumerate() {
            let mut r = Vec::new();
            for &p in row.iter().filter(|&&p| p >= 0) {
                if p >= physical {
                    return Err(PlanError::Map(format!(
                        "logical expert {e}: physical expert {p} is not in 0..{physical}"
                    )));
                }
                r.push(p as u32);
            }
            if r.is_empty() {
                return Err(PlanError::Map(format!("logical expert {e} has no replica")));
            }
            replicas.push(r);
        }
        Ok(Self { replicas })
    }

    /// Logical experts.
    pub fn logical_experts(&self) -> usize {
        self.replicas.len()
    }

    /// The physical expert serving `expert` for a token's slot.
    pub fn physical(&self, expert: usize, token: usize, slot: usize, top_k: usize) -> u32 {
        let r = &self.replicas[expert];
        r[(token * top_k + slot) % r.len()]
    }
}
