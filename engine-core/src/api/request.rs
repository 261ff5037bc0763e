//! [`Request`]: every RDMA transfer an engine submits, as one type matched in one place.
//!
//! Each kind names its fields, and they read the same way in every kind: what is done
//! (`op`), how many bytes (`len` / `page_len`), the local side, then the remote side. The
//! older `submit_*` calls (`submit_single_write`, `submit_paged_reads`, `submit_scatter`, …)
//! are thin wrappers over [`TransferEngine::submit`], kept for one release.

use super::*;

/// One RDMA transfer, given to [`TransferEngine::submit`].
///
/// ```
/// # use engine_core::{Config, DoneFlag, RdmaOp, Request, TransferEngine, Device};
/// # backend_mock::link();
/// # let config = Config::default();
/// # let (a, b) = (TransferEngine::open(&config)?, TransferEngine::open(&config)?);
/// # let (mut src, mut dst) = (vec![7u8; 64], vec![0u8; 64]);
/// # let (src_mr, _) = unsafe { a.reg_mr(src.as_mut_ptr(), 64, Device::Host)? };
/// # let (_dst_mr, dst_desc) = unsafe { b.reg_mr(dst.as_mut_ptr(), 64, Device::Host)? };
/// let done = DoneFlag::new();
/// a.submit(
///     Request::Single {
///         op: RdmaOp::Write { imm: Some(42) },
///         len: 64,
///         local: (src_mr, 0),
///         remote: (&dst_desc, 0),
///     },
///     done.clone(),
/// )?;
/// done.wait(std::time::Duration::from_secs(5))?;
/// # assert!(dst.iter().all(|&x| x == 7));
/// # let _ = &mut src;
/// # Ok::<(), engine_core::Error>(())
/// ```
#[derive(Debug, Clone, Copy)]
#[non_exhaustive]
pub enum Request<'a> {
    /// `len` bytes between one local range (handle, offset) and one remote range
    /// (descriptor, offset): a write sends the local bytes there, a read brings the remote
    /// bytes here. Large ranges stripe over the NICs; a write's immediate rides on every
    /// chunk (the receiver counts [`expected_arrivals`](crate::expected_arrivals) of them).
    Single {
        /// Write (with its immediate) or read.
        op: RdmaOp,
        /// Bytes to move.
        len: u64,
        /// The local region and the offset in it.
        local: (MrHandle, u64),
        /// The peer's region and the offset in it.
        remote: (&'a MrDesc, u64),
    },
    /// Pages of `page_len` bytes: local page `i` with remote page `i` (`local.1.indices[i]`
    /// with `remote.1.indices[i]`), spread over the NICs.
    Paged {
        /// Write (with its immediate, carried by every page) or read.
        op: RdmaOp,
        /// Bytes per page.
        page_len: u64,
        /// The local region and its pages.
        local: (MrHandle, &'a Pages),
        /// The peer's region and its pages.
        remote: (&'a MrDesc, &'a Pages),
    },
    /// Pieces of one local region written to many remote ranges (any peers, any sizes),
    /// each write carrying `imm`. With `group`, every destination's owner must be in it.
    Scatter {
        /// The immediate each write carries, if any.
        imm: Option<u32>,
        /// The source region.
        local: MrHandle,
        /// Where each piece comes from and goes.
        remote: &'a [ScatterDst],
        /// The peer group the destinations must belong to, if any.
        group: Option<PeerGroupHandle>,
    },
    /// A zero-byte write carrying `imm` to each region's owner: one arrival each, no data.
    Barrier {
        /// The immediate each owner counts once.
        imm: u32,
        /// One region per peer to tell.
        remote: &'a [MrDesc],
        /// The peer group the owners must belong to, if any.
        group: Option<PeerGroupHandle>,
    },
}

impl Request<'_> {
    /// What the request does: a read or a write (scatters and barriers write).
    pub fn op(&self) -> RdmaOp {
        match *self {
            Request::Single { op, .. } | Request::Paged { op, .. } => op,
            Request::Scatter { imm, .. } => RdmaOp::Write { imm },
            Request::Barrier { imm, .. } => RdmaOp::Write { imm: Some(imm) },
        }
    }
}

impl TransferEngine {
    /// Submits one transfer; `on_done` fires exactly once, when every byte has landed (on
    /// the peer for a write, here for a read) or with the first error. Everything that can
    /// be checked here (handles, bounds, NIC counts, peer groups, a read this backend cannot
    /// do or of a region registered write-only) is refused before anything is queued: when
    /// `submit` returns an error, nothing was queued and `on_done` never fires.
    pub fn submit(&self, request: Request<'_>, on_done: impl Into<OnDone>) -> Result<()> {
        let on_done = on_done.into();
        match request {
            Request::Single {
                op,
                len,
                local,
                remote,
            } => {
                if op == RdmaOp::Read {
                    self.check_reads(remote.0)?;
                }
                self.submit_single(op, len, local, remote, on_done)
            }
            Request::Paged {
                op,
                page_len,
                local,
                remote,
            } => {
                if op == RdmaOp::Read {
                    self.check_reads(remote.0)?;
                }
                self.submit_paged(op, page_len, local, remote, on_done)
            }
            Request::Scatter {
                imm,
                local,
                remote,
                group,
            } => self.submit_scattered(imm, local, remote, group, on_done),
            Request::Barrier { imm, remote, group } => {
                self.submit_barriers(imm, remote, group, on_done)
            }
        }
    }
}
