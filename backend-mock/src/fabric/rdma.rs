//! RDMA WRITE and READ between our local range and a peer's remote range, checked as a NIC
//! checks them: once per request, or once per batch of requests that share everything but
//! their addresses, ids and immediates (keys, length, direction, peer) — the pages of a paged
//! request, or a run of a burst's single writes to one peer. What the keys resolve to is
//! looked up once, and each request's range is checked against it (the mock's
//! per-request cost).
//!
//! Lock order: our regions, then the peer's (the same lock, read twice, for loopback); both
//! are held across the copies, so neither side can deregister mid-copy. A write that fails
//! part-way (an injected failure) has placed half its data and counts no immediate.

use std::sync::atomic::Ordering;
use std::sync::{Arc, RwLockReadGuard};

use xfer_plugin::domain::{DomainError, DomainErrorKind, Event, PageShift, RdmaOp, RdmaRequest};

use super::{unreachable, Conn, Nic, Region, Regions};

/// What a request (or every request of a batch) names, at offset 0 of both ranges.
#[derive(Debug, Clone, Copy)]
pub(crate) struct RdmaShape {
    pub(crate) op: RdmaOp,
    /// (address, key) of our range.
    pub(crate) local: (u64, u64),
    /// (address, key, registration start) of the peer's range.
    pub(crate) remote: (u64, u64, u64),
    pub(crate) len: u64,
}

/// At most this many pages are moved under one hold of the regions' locks, so that a
/// deregistration waits for a bounded amount of copying.
const PAGES_PER_HOLD: usize = 256;

/// The requests of a batch: request `i` is the shape moved by `shift(i)`, completes as
/// `wr_id(i)` and carries `imm(i)` (a write's). Shifts wrap: a request below the shape's
/// addresses is a shift past `u64::MAX`, which the room check sends through the full checks.
pub(crate) trait Batch {
    fn len(&self) -> usize;
    fn shift(&self, i: usize) -> PageShift;
    fn wr_id(&self, i: usize) -> u64;
    fn imm(&self, i: usize) -> Option<u32>;
}

/// A paged request's pages on one NIC: one id, one immediate, their offsets.
pub(crate) struct Pages<'a> {
    pub(crate) wr_id: u64,
    pub(crate) imm: Option<u32>,
    pub(crate) shifts: &'a [PageShift],
}

impl Batch for Pages<'_> {
    fn len(&self) -> usize {
        self.shifts.len()
    }
    fn shift(&self, i: usize) -> PageShift {
        self.shifts[i]
    }
    fn wr_id(&self, _: usize) -> u64 {
        self.wr_id
    }
    fn imm(&self, _: usize) -> Option<u32> {
        self.imm
    }
}

/// A run of listed requests that share their first one's shape but for addresses, ids and
/// immediates.
pub(crate) struct Listed<'a, 'p>(pub(crate) &'a [RdmaRequest<'p>]);

impl Batch for Listed<'_, '_> {
    fn len(&self) -> usize {
        self.0.len()
    }
    fn shift(&self, i: usize) -> PageShift {
        let (first, this) = (&self.0[0], &self.0[i]);
        PageShift::new(
            this.local_addr.wrapping_sub(first.local_addr),
            this.remote_addr.wrapping_sub(first.remote_addr),
        )
    }
    fn wr_id(&self, i: usize) -> u64 {
        self.0[i].wr_id
    }
    fn imm(&self, i: usize) -> Option<u32> {
        self.0[i].imm()
    }
}

/// Both sides' regions, locked, and what the shape's keys name in them.
struct Resolved<'a> {
    ours: RwLockReadGuard<'a, Regions>,
    /// The peer's regions; `None` for loopback (ours are theirs).
    theirs: Option<RwLockReadGuard<'a, Regions>>,
    /// Our region (`None` for a zero-byte write, which names no local range).
    local: Option<Region>,
    remote: Region,
    /// How far the shape's (local, remote) ranges can move and stay inside their regions, on
    /// host memory: a page within both is copied without checking more. `None`
    /// sends every page through the full checks (and a single request, which has one page).
    room: Option<(u64, u64)>,
}

/// How far `[addr, addr + len)` can move up and stay inside `region`.
fn room(region: &Region, addr: u64, len: u64) -> Option<u64> {
    let end = region.ptr.checked_add(region.len)?;
    let page_end = addr.checked_add(len)?;
    (region.contains(addr, len) && !region.gpu).then(|| end - page_end)
}

/// Looks the shape's keys up on both NICs and checks what does not depend on the page.
/// (Inlined: returned by value, the guards and regions cost a single request ~50
/// instructions of moving.)
#[inline(always)]
fn resolve<'a>(
    src: &'a Arc<Nic>,
    conn: &Conn,
    target: &'a Arc<Nic>,
    shape: &RdmaShape,
) -> Result<Resolved<'a>, DomainError> {
    let peer = &conn.peer;
    let ours = src.regions();
    if !src.alive.load(Ordering::Acquire) {
        return Err(unreachable(&src.addr));
    }
    let (_, local_key) = shape.local;
    // Zero-byte writes name no local range; a read always does.
    let local = if shape.len > 0 || shape.op == RdmaOp::Read {
        Some(*ours.local.get(&local_key).ok_or_else(|| {
            DomainError::new(
                DomainErrorKind::InvalidArgument,
                format!(
                    "local key {local_key:#x} is not registered with mock NIC {}",
                    src.addr
                ),
            )
        })?)
    } else {
        None
    };
    let theirs = if Arc::ptr_eq(target, src) {
        None
    } else {
        Some(target.regions())
    };
    let regions = theirs.as_deref().unwrap_or(&ours);
    if !target.alive.load(Ordering::Acquire) {
        return Err(unreachable(peer));
    }
    let (access, allowed): (&str, fn(&Region) -> bool) = match shape.op {
        RdmaOp::Write { .. } => ("write", |r| r.remote_write),
        RdmaOp::Read => ("read", |r| r.remote_read),
    };
    let (_, remote_key, remote_base) = shape.remote;
    let remote: Region = *regions
        .remote
        .get(&remote_key)
        .filter(|r| allowed(r))
        .ok_or_else(|| {
            DomainError::new(
                DomainErrorKind::RemoteAccess,
                format!("rkey {remote_key:#x} is not valid for remote {access} at mock NIC {peer}"),
            )
        })?;
    // Like a provider without FI_MR_VIRT_ADDR, the mock needs the registration's start: a
    // wrong `remote_base` (a region sharing a larger registration, issue 27) is refused.
    if remote_base != remote.ptr {
        return Err(DomainError::new(
            DomainErrorKind::RemoteAccess,
            format!(
                "remote_base {remote_base:#x} is not the start {:#x} of rkey {remote_key:#x}'s registration at mock NIC {peer}",
                remote.ptr
            ),
        ));
    }
    Ok(Resolved {
        ours,
        theirs,
        local,
        remote,
        room: None,
    })
}

impl Resolved<'_> {
    /// Checks one page's ranges and copies its bytes (half of them when `injected` fails it).
    #[inline(always)]
    fn move_page(
        &self,
        conn: &Conn,
        shape: &RdmaShape,
        PageShift {
            local: local_shift,
            remote: remote_shift,
        }: PageShift,
        injected: Option<DomainError>,
    ) -> Result<(), DomainError> {
        let len = shape.len;
        if let Some((local_room, remote_room)) = self.room {
            if injected.is_none() && local_shift <= local_room && remote_shift <= remote_room {
                // No wrap: the room was measured from these addresses up.
                let (local, remote) = (shape.local.0 + local_shift, shape.remote.0 + remote_shift);
                let (to, from) = match shape.op {
                    RdmaOp::Write { .. } => (remote, local),
                    RdmaOp::Read => (local, remote),
                };
                if len > 0 {
                    // SAFETY: both ranges lie inside live host registrations (the room was
                    // measured against them), and both regions' locks are held, as below.
                    unsafe { std::ptr::copy(from as *const u8, to as *mut u8, len as usize) };
                }
                return Ok(());
            }
        }
        // Wrapping: a listed request may lie below the batch's first (see `Batch`).
        let local_addr = shape.local.0.wrapping_add(local_shift);
        let (remote_addr, remote_key, _) = shape.remote;
        let remote_addr = remote_addr.wrapping_add(remote_shift);
        if let Some(region) = &self.local {
            if !region.contains(local_addr, len) {
                return Err(DomainError::new(
                    DomainErrorKind::InvalidArgument,
                    format!(
                        "local range {local_addr:#x}+{len} is outside its region {:#x}+{}",
                        region.ptr, region.len
                    ),
                ));
            }
        }
        let remote = &self.remote;
        if !remote.contains(remote_addr, len) {
            return Err(DomainError::new(
                DomainErrorKind::RemoteAccess,
                format!(
                    "remote range {remote_addr:#x}+{len} is outside the region {:#x}+{} of rkey {remote_key:#x} at mock NIC {}",
                    remote.ptr, remote.len, conn.peer
                ),
            ));
        }
        let (to, from) = match shape.op {
            RdmaOp::Write { .. } => (remote_addr, local_addr),
            RdmaOp::Read => (local_addr, remote_addr),
        };
        // A link failure part-way: part of the data is placed, no immediate is counted.
        let placed = if injected.is_some() { len / 2 } else { len };
        let local_gpu = self.local.is_some_and(|r| r.gpu);
        if placed > 0 && (local_gpu || remote.gpu) {
            // SAFETY: as below; the engine checked both GPU ranges with the driver when they
            // were registered, and the driver copies between any host/device addresses.
            unsafe { xfer_cuda::copy(to, from, placed as usize) }.map_err(|e| {
                DomainError::new(
                    DomainErrorKind::Other,
                    format!("GPU copy at mock NIC {}: {e}", conn.peer),
                )
            })?;
        } else if placed > 0 {
            // SAFETY: both ranges were checked against live registrations, and both regions'
            // locks are held (`self` holds them), so neither can be deregistered during the
            // copy. The owners promised (TransferEngine::reg_mr's contract) the memory stays
            // allocated while registered; `copy` tolerates overlap (a loopback transfer
            // within one region).
            unsafe { std::ptr::copy(from as *const u8, to as *mut u8, placed as usize) };
        }
        match injected {
            Some(e) => Err(e),
            None => Ok(()),
        }
    }

    /// Measures the room for a batch's pages (see `room`).
    fn with_room(mut self, shape: &RdmaShape) -> Self {
        let len = shape.len;
        let local_room = match &self.local {
            Some(region) => room(region, shape.local.0, len),
            None => Some(u64::MAX),
        };
        self.room = local_room.zip(room(&self.remote, shape.remote.0, len));
        self
    }

    /// Lets go of both regions' locks.
    fn release(self) {
        drop(self.theirs);
        drop(self.ours);
    }
}

/// One request: its outcome once landed (the immediate, if any, delivered to the peer).
pub(crate) fn rdma(
    src: &Arc<Nic>,
    conn: &Conn,
    shape: &RdmaShape,
    injected: Option<DomainError>,
) -> Result<(), DomainError> {
    let target = conn.target().ok_or_else(|| unreachable(&conn.peer))?;
    let resolved = resolve(src, conn, &target, shape)?;
    let moved = resolved.move_page(conn, shape, PageShift::default(), injected);
    resolved.release();
    moved?;
    if let Some(imm) = shape.op.imm() {
        target.deliver(Event::ImmArrival {
            imm,
            from: Some(src.addr.clone()),
        });
    }
    Ok(())
}

/// The requests of a batch landed in order (none fault-injected: the mock posts a batch that
/// injection could touch one by one). Each request's outcome is passed to `outcome` with its
/// index, in order; the peer's immediates go to its inbox a hold at a time, gathered in
/// `arrivals` (the posting Domain's own vector, empty, kept between batches).
pub(crate) fn rdma_batch(
    src: &Arc<Nic>,
    conn: &Conn,
    shape: &RdmaShape,
    batch: &impl Batch,
    arrivals: &mut Vec<Event>,
    mut outcome: impl FnMut(usize, Result<(), DomainError>),
) {
    let Some(target) = conn.target() else {
        (0..batch.len()).for_each(|i| outcome(i, Err(unreachable(&conn.peer))));
        return;
    };
    if shape.op.imm().is_some() {
        // Room for a hold's immediates at once (growing it cost a single write ~50
        // instructions).
        arrivals.reserve(batch.len().min(PAGES_PER_HOLD));
    }
    for start in (0..batch.len()).step_by(PAGES_PER_HOLD) {
        let hold = start..batch.len().min(start + PAGES_PER_HOLD);
        let resolved = match resolve(src, conn, &target, shape) {
            Ok(resolved) => resolved.with_room(shape),
            Err(e) => {
                // What the requests share is wrong: each fails alike, as it would alone.
                hold.for_each(|i| outcome(i, Err(e.clone())));
                continue;
            }
        };
        for i in hold {
            let moved = resolved.move_page(conn, shape, batch.shift(i), None);
            if moved.is_ok() {
                if let Some(imm) = batch.imm(i) {
                    arrivals.push(Event::ImmArrival {
                        imm,
                        from: Some(src.addr.clone()),
                    });
                }
            }
            outcome(i, moved);
        }
        resolved.release();
        target.deliver_all(arrivals);
    }
}
