/// Which write of a step an immediate announces.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub enum Phase {
    /// Dispatch, first write: the count header and the private rows.
    DispatchA = 0,
    /// Dispatch, second write: the rows past the private slot, into the overflow.
    DispatchB = 1,
    /// Combine: the expert outputs of a source's rows, back to it.
    Combine = 2,
}

/// Most ranks an immediate can name (14 bits).
pub(crate) const MAX_RANKS: u32 = 1 << 14;
/// Epochs an immediate tells apart (12 bits): a write of step `t` is never counted for a
/// step `t + k` unless `k` is a multiple of this.
pub const IMM_EPOCHS: u32 = 1 << 12;

/// An immediate of the protocol: `tag:4 | epoch:12 | phase:2 | source:14`, so every
/// (step, phase, source) has its own and the ImmCounter counts each alone; `tag` keeps the
/// protocol's immediates apart from others on the same engine.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct Imm {
    /// Four bits chosen by the application.
    pub tag: u8,
    /// The step, modulo [`IMM_EPOCHS`].
    pub epoch: u32,
    /// Which write.
    pub phase: Phase,
    /// The rank that posted it.
    pub source: u32,
}

impl Imm {
    /// The 32-bit immediate.
    pub fn encode(self) -> u32 {
        (u32::from(self.tag & 0xF) << 28)
            | ((self.epoch % IMM_EPOCHS) << 16)
            | ((self.phase as u32) << 14)
            | (self.source % MAX_RANKS)
    }

    /// Reads an immediate back; `None` for another tag or an unknown phase.
    pub fn decode(tag: u8, imm: u32) -> Option<Self> {
        if imm >> 28 != u32::from(tag & 0xF) {
            return None;
        }
        let phase = match (imm >> 14) & 3 {
            0 => Phase::DispatchA,
            1 => Phase::DispatchB,
            2 => Phase::Combine,
            _ => return None,
        };
        Some(Self {
            tag: tag & 0xF,
            epoch: (imm >> 16) & (IMM_EPOCHS - 1),
            phase,
            source: imm & (MAX_RANKS - 1),
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn every_field_round_trips_and_differs() {
        let mut seen = std::collections::HashSet::new();
        for epoch in [0, 1, 2, IMM_EPOCHS - 1] {
            for phase in [Phase::DispatchA, Phase::DispatchB, Phase::Combine] {
                for source in [0, 1, MAX_RANKS - 1] {
                    let imm = Imm {
                        tag: 0xE,
                        epoch,
                        phase,
                        source,
                    };
                    let raw = imm.encode();
                    assert!(seen.insert(raw));
                    assert_eq!(Imm::decode(0xE, raw), Some(imm));
                    assert_eq!(Imm::decode(0xD, raw), None);
                }
            }
        }
        assert_eq!(Imm::decode(0xE, 0xE000_C000), None, "phase 3 is not ours");
    }
}
