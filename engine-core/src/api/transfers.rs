//! Writes and reads: single and paged, striped over the NICs by the group's policy, scatters
//! and barriers over peer groups; bounds, handles and NICs checked before anything is queued.

use super::*;
use crate::runtime::Shift;

/// Where a plan's operations go: a `Vec` for many, [`Ops`] inline for a single write (each
/// path monomorphised, so the many-page loop pushes into a plain `Vec`).
pub(super) trait OpSink {
    fn push(&mut self, op: RdmaWork);
}

impl OpSink for Vec<RdmaWork> {
    fn push(&mut self, op: RdmaWork) {
        Vec::push(self, op);
    }
}

impl OpSink for Ops {
    fn push(&mut self, op: RdmaWork) {
        smallvec::SmallVec::push(self, op);
    }
}

thread_local! {
    /// `submit_single`'s chunks, reused (a large write's plan grows it once).
    static SINGLE_PLAN: std::cell::RefCell<Vec<Chunk>> = const { std::cell::RefCell::new(Vec::new()) };
}

/// How errors name the local range: the source of a write, the destination of a read.
fn local_side(op: RdmaOp) -> &'static str {
    match op {
        RdmaOp::Write { .. } => "source",
        RdmaOp::Read => "destination",
    }
}

fn remote_side(op: RdmaOp) -> &'static str {
    match op {
        RdmaOp::Write { .. } => "destination",
        RdmaOp::Read => "source",
    }
}

/// Refuses a read of a region whose descriptor says it was registered without
/// [`RemoteAccess::READ`]. A courtesy to the caller, not a protection (the holder of a
/// descriptor can change what it says): it makes the refusal the same on every backend,
/// including providers that do not enforce read access themselves (libfabric's shm and tcp).
fn check_readable(desc: &MrDesc) -> Result<()> {
    match desc.access() {
        Some(access) if !access.read => Err(Error::remote_access(format!(
            "the peer registered the region at {:#x} ({} bytes) without RemoteAccess::READ: it \
             cannot be read (refused before posting, as its descriptor says)",
            desc.ptr(),
            desc.len()
        ))),
        _ => Ok(()),
    }
}

pub(super) fn check_range(
    side: &'static str,
    offset: u64,
    len: u64,
    region_len: u64,
) -> Result<()> {
    match offset.checked_add(len) {
        Some(end) if end <= region_len => Ok(()),
        _ => Err(Error::OutOfBounds {
            side,
            offset,
            len,
            region_len,
        }),
    }
}

/// Where page number `index` starts, if that fits in 64 bits.
fn page_start(pages: &Pages, index: u32) -> Option<u64> {
    u64::from(index)
        .checked_mul(pages.stride)?
        .checked_add(pages.offset)
}

/// Each page's (local, remote) offset, every page checked against its side's region
/// (`(pages, region length, side's name)`), refused at the first page out of range.
///
/// A page's offset only grows with its number, so when each side's largest page number
/// fits, every page does: then the offsets are computed without a check per page (the checks
/// were a quarter of the engine's cost per page). Otherwise the pages are walked
/// in order to name the first that does not fit.
fn page_offsets(
    page_len: u64,
    local: (&Pages, u64, &'static str),
    remote: (&Pages, u64, &'static str),
) -> Result<Vec<Shift>> {
    let fits = |(pages, region_len, _): (&Pages, u64, &str)| {
        pages.indices.iter().max().is_none_or(|&max| {
            page_start(pages, max)
                .and_then(|start| start.checked_add(page_len))
                .is_some_and(|end| end <= region_len)
        })
    };
    let (l, r) = (local.0, remote.0);
    if fits(local) && fits(remote) {
        // No product or sum here exceeds the largest page's, which fit.
        return Ok(l
            .indices
            .iter()
            .zip(&r.indices)
            .map(|(&li, &ri)| {
                Shift::new(
                    u64::from(li) * l.stride + l.offset,
                    u64::from(ri) * r.stride + r.offset,
                )
            })
            .collect());
    }
    let check = |(pages, region_len, side): (&Pages, u64, &'static str), index| {
        // A match, not `ok_or`: that builds (and drops) an error for every page.
        let Some(offset) = page_start(pages, index) else {
            return Err(Error::OutOfBounds {
                side,
                offset: u64::MAX,
                len: page_len,
                region_len: 0,
            });
        };
        check_range(side, offset, page_len, region_len).map(|()| offset)
    };
    l.indices
        .iter()
        .zip(&r.indices)
        .map(|(&li, &ri)| Ok(Shift::new(check(local, li)?, check(remote, ri)?)))
        .collect()
}

impl TransferEngine {
    pub(super) fn check_peer_nics(&self, desc: &MrDesc) -> Result<()> {
        if desc.rkeys().len() != self.nic_count() {
            return Err(Error::InvalidArgument(format!(
                "the destination MrDesc has {} NICs but this engine has {}; peers must use the same NIC count",
                desc.rkeys().len(),
                self.nic_count()
            )));
        }
        Ok(())
    }

    pub(super) fn first_nic(&self) -> usize {
        match self.shared.config.nic_selection {
            NicSelection::First(n) => n,
            NicSelection::RoundRobin => {
                self.next_first_nic.fetch_add(1, Ordering::Relaxed) % self.nic_count()
            }
        }
    }

    /// Plans one contiguous unit and appends its writes, pairing each chunk with *its* NIC's
    /// local key, remote key and peer address (the one place where they are paired).
    #[allow(clippy::too_many_arguments)]
    pub(super) fn plan_unit(
        &self,
        ops: &mut impl OpSink,
        chunks: &mut Vec<Chunk>,
        first: usize,
        src: &LocalRegion,
        src_offset: u64,
        dst: &MrDesc,
        dst_offset: u64,
        len: u64,
        op: RdmaOp,
    ) {
        chunks.clear();
        self.spread.split(len, self.nic_count(), first, chunks);
        push_ops(ops, chunks, src, src_offset, dst, dst_offset, op);
    }

    /// Writes `len` bytes from `src` (handle, offset) to `dst` (descriptor, offset); large
    /// writes stripe over the NICs. With `imm`, each write carries it: the receiver counts
    /// [`expected_arrivals`](crate::expected_arrivals) of them.
    ///
    /// Kept for one release: [`submit`](Self::submit) with [`Request::Single`] is the call.
    pub fn submit_single_write(
        &self,
        len: u64,
        imm: Option<u32>,
        src: (MrHandle, u64),
        dst: (&MrDesc, u64),
        on_done: impl Into<OnDone>,
    ) -> Result<()> {
        self.submit(
            Request::Single {
                op: RdmaOp::Write { imm },
                len,
                local: src,
                remote: dst,
            },
            on_done,
        )
    }

    /// Writes pages of `page_len` bytes: source page `i` of `src` to destination page `i` of
    /// `dst`. Pages are spread over the NICs; each write carries `imm`.
    ///
    /// Kept for one release: [`submit`](Self::submit) with [`Request::Paged`] is the call.
    pub fn submit_paged_writes(
        &self,
        page_len: u64,
        imm: Option<u32>,
        src: (MrHandle, &Pages),
        dst: (&MrDesc, &Pages),
        on_done: impl Into<OnDone>,
    ) -> Result<()> {
        self.submit(
            Request::Paged {
                op: RdmaOp::Write { imm },
                page_len,
                local: src,
                remote: dst,
            },
            on_done,
        )
    }

    /// Reads `len` bytes of a peer's region (descriptor, offset) into `local` (handle,
    /// offset); large reads stripe over the NICs like writes. `on_done` fires when the bytes
    /// are in local memory. There is no immediate: the peer is not told, and counts nothing.
    /// The peer's region must have been registered readable ([`RemoteAccess::READ`]);
    /// otherwise the read is refused with `RemoteAccess` (at submit where its descriptor says
    /// so, as every descriptor an engine makes does; else by the peer's NIC) and nothing is
    /// read.
    ///
    /// Kept for one release: [`submit`](Self::submit) with [`Request::Single`] is the call.
    pub fn submit_single_read(
        &self,
        len: u64,
        local: (MrHandle, u64),
        remote: (&MrDesc, u64),
        on_done: impl Into<OnDone>,
    ) -> Result<()> {
        self.submit(
            Request::Single {
                op: RdmaOp::Read,
                len,
                local,
                remote,
            },
            on_done,
        )
    }

    /// Reads pages of `page_len` bytes: remote page `i` of `remote` into local page `i` of
    /// `local`, spread over the NICs (see [`submit_single_read`](Self::submit_single_read)).
    ///
    /// Kept for one release: [`submit`](Self::submit) with [`Request::Paged`] is the call.
    pub fn submit_paged_reads(
        &self,
        page_len: u64,
        local: (MrHandle, &Pages),
        remote: (&MrDesc, &Pages),
        on_done: impl Into<OnDone>,
    ) -> Result<()> {
        self.submit(
            Request::Paged {
                op: RdmaOp::Read,
                page_len,
                local,
                remote,
            },
            on_done,
        )
    }

    /// Whether this engine's backend performs RDMA READ (plugins before ABI version 2, and
    /// backends that declare none, do not: reads fail with `NotAvailable`).
    pub fn supports_reads(&self) -> bool {
        self.reads
    }

    /// Refuses a read this backend cannot do, or of a region its descriptor says is not
    /// readable.
    pub(super) fn check_reads(&self, remote: &MrDesc) -> Result<()> {
        if self.reads {
            check_readable(remote)
        } else {
            Err(Error::NotAvailable(format!(
                "backend {} does not support RDMA READ (a plugin built before ABI version 2, or a backend without reads)",
                self.shared.backend
            )))
        }
    }

    /// One contiguous write or read between a local and a remote range.
    pub(super) fn submit_single(
        &self,
        op: RdmaOp,
        len: u64,
        local: (MrHandle, u64),
        remote: (&MrDesc, u64),
        on_done: OnDone,
    ) -> Result<()> {
        let region = self.local_region(local.0)?;
        check_range(local_side(op), local.1, len, region.len)?;
        check_range(remote_side(op), remote.1, len, remote.0.len())?;
        self.check_peer_nics(remote.0)?;
        let first = self.first_nic();
        if self.spread.stays_whole(len, self.nic_count()) {
            // The commonest case, without planning: one write of the whole range, made in
            // its place (pushing it cost ~50 instructions of the small vector's growth path).
            let whole = Chunk {
                nic: first,
                offset: 0,
                len,
            };
            let ops = Ops::from_buf([work_for(&whole, &region, local.1, remote.0, remote.1, op)]);
            return self.submit_ops(ops, on_done);
        }
        let mut ops = Ops::new();
        // The plan's scratch space is kept per thread: a single write allocates nothing.
        SINGLE_PLAN.with_borrow_mut(|chunks| {
            self.plan_unit(
                &mut ops, chunks, first, &region, local.1, remote.0, remote.1, len, op,
            )
        });
        self.submit_ops(ops, on_done)
    }

    /// Queues a listed transfer for the worker.
    #[inline]
    fn submit_ops(&self, ops: Ops, on_done: OnDone) -> Result<()> {
        self.shared.submit_stamped(|submitted| Command::Listed {
            ops,
            on_done,
            submitted,
        })
    }

    /// Pages of `page_len` bytes: local page `i` with remote page `i`, spread over the NICs.
    pub(super) fn submit_paged(
        &self,
        op: RdmaOp,
        page_len: u64,
        local: (MrHandle, &Pages),
        remote: (&MrDesc, &Pages),
        on_done: OnDone,
    ) -> Result<()> {
        let (local_pages, remote_pages) = (local.1, remote.1);
        if local_pages.indices.len() != remote_pages.indices.len() {
            return Err(Error::InvalidArgument(format!(
                "{} {} pages but {} {} pages",
                local_pages.indices.len(),
                local_side(op),
                remote_pages.indices.len(),
                remote_side(op)
            )));
        }
        let region = self.local_region(local.0)?;
        self.check_peer_nics(remote.0)?;
        let first = self.first_nic();
        let nics = self.nic_count();
        // Every page has the same length, so its split depends only on the NIC it starts at:
        // planned once per NIC (at most four), at offset 0 of both regions; the worker moves
        // a plan to each page's offsets as it posts (no per-page work request is built here).
        let mut chunks = Vec::new();
        let plans: Vec<Ops> = (0..nics.min(local_pages.indices.len()))
            .map(|k| {
                chunks.clear();
                self.spread
                    .split(page_len, nics, (first + k) % nics, &mut chunks);
                let mut plan = Ops::new();
                push_ops(&mut plan, &chunks, &region, 0, remote.0, 0, op);
                plan
            })
            .collect();
        let offsets = page_offsets(
            page_len,
            (local_pages, region.len, local_side(op)),
            (remote_pages, remote.0.len(), remote_side(op)),
        )?;
        let work = Box::new(PagedWork { plans, offsets });
        self.shared.submit_stamped(|submitted| Command::Pages {
            work,
            on_done,
            submitted,
        })
    }

    /// Registers a set of peers (by main address) that scatters and barriers may be checked
    /// against.
    pub fn add_peer_group(&self, addrs: Vec<NetAddr>) -> Result<PeerGroupHandle> {
        if addrs.is_empty() {
            return Err(Error::InvalidArgument(
                "a peer group needs at least one peer".into(),
            ));
        }
        let id = self.next_id.fetch_add(1, Ordering::Relaxed);
        self.peer_groups
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .insert(id, addrs.into_iter().collect());
        Ok(PeerGroupHandle {
            engine: self.id,
            id,
        })
    }

    pub(super) fn check_group<'a>(
        &self,
        group: Option<PeerGroupHandle>,
        owners: impl Iterator<Item = &'a NetAddr>,
    ) -> Result<()> {
        let Some(group) = group else { return Ok(()) };
        self.check_owner("peer group", group.engine, group.id)?;
        let groups = self.peer_groups.lock().unwrap_or_else(|p| p.into_inner());
        let members = groups
            .get(&group.id)
            .ok_or(Error::UnknownPeerGroup(group.id))?;
        for owner in owners {
            if !members.contains(owner) {
                return Err(Error::InvalidArgument(format!(
                    "peer {owner} is not in peer group {}",
                    group.id
                )));
            }
        }
        Ok(())
    }

    /// Writes pieces of one source region to many destinations (any peers, any sizes).
    ///
    /// Kept for one release: [`submit`](Self::submit) with [`Request::Scatter`] is the call.
    pub fn submit_scatter(
        &self,
        group: Option<PeerGroupHandle>,
        on_done: impl Into<OnDone>,
        imm: Option<u32>,
        src: MrHandle,
        dsts: &[ScatterDst],
    ) -> Result<()> {
        self.submit(
            Request::Scatter {
                imm,
                local: src,
                remote: dsts,
                group,
            },
            on_done,
        )
    }

    pub(super) fn submit_scattered(
        &self,
        imm: Option<u32>,
        src: MrHandle,
        dsts: &[ScatterDst],
        group: Option<PeerGroupHandle>,
        on_done: OnDone,
    ) -> Result<()> {
        let region = self.local_region(src)?;
        self.check_group(group, dsts.iter().map(|d| d.dst.owner()))?;
        let first = self.first_nic();
        let mut ops = Vec::with_capacity(dsts.len());
        let mut chunks = Vec::new();
        for (j, d) in dsts.iter().enumerate() {
            check_range("source", d.src_offset, d.len, region.len)?;
            check_range("destination", d.dst_offset, d.len, d.dst.len())?;
            self.check_peer_nics(&d.dst)?;
            self.plan_unit(
                &mut ops,
                &mut chunks,
                (first + j) % self.nic_count(),
                &region,
                d.src_offset,
                &d.dst,
                d.dst_offset,
                d.len,
                RdmaOp::Write { imm },
            );
        }
        self.submit_ops(Ops::from_vec(ops), on_done)
    }

    /// A zero-byte write carrying `imm` to each destination region's owner (one arrival each).
    ///
    /// Kept for one release: [`submit`](Self::submit) with [`Request::Barrier`] is the call.
    pub fn submit_barrier(
        &self,
        group: Option<PeerGroupHandle>,
        on_done: impl Into<OnDone>,
        imm: u32,
        dsts: &[MrDesc],
    ) -> Result<()> {
        self.submit(
            Request::Barrier {
                imm,
                remote: dsts,
                group,
            },
            on_done,
        )
    }

    pub(super) fn submit_barriers(
        &self,
        imm: u32,
        dsts: &[MrDesc],
        group: Option<PeerGroupHandle>,
        on_done: OnDone,
    ) -> Result<()> {
        self.check_group(group, dsts.iter().map(MrDesc::owner))?;
        let first = self.first_nic();
        let mut ops = Vec::with_capacity(dsts.len());
        for (j, d) in dsts.iter().enumerate() {
            self.check_peer_nics(d)?;
            let nic = (first + j) % self.nic_count();
            let (peer, remote_key) = &d.rkeys()[nic];
            // Zero-byte writes still name a valid destination and key: EFA refuses them
            // otherwise, and a NIC checks the key even for no bytes.
            ops.push(RdmaWork {
                op: RdmaOp::Write { imm: Some(imm) },
                nic,
                peer: peer.clone(),
                local_addr: 0,
                local_key: 0,
                remote_addr: d.ptr(),
                remote_key: *remote_key,
                remote_base: d.registration_base(),
                len: 0,
            });
        }
        self.submit_ops(Ops::from_vec(ops), on_done)
    }
}

/// The work requests of one planned unit: each chunk pairs NIC `k`'s local key with the peer's
/// NIC-`k` address and rkey (the one place they are paired).
#[allow(clippy::too_many_arguments)]
fn push_ops(
    ops: &mut impl OpSink,
    chunks: &[Chunk],
    src: &LocalRegion,
    src_offset: u64,
    dst: &MrDesc,
    dst_offset: u64,
    op: RdmaOp,
) {
    for c in chunks {
        ops.push(work_for(c, src, src_offset, dst, dst_offset, op));
    }
}

/// The work request of chunk `c`, paired with its NIC's local key, remote key and peer.
#[inline(always)]
fn work_for(
    c: &Chunk,
    src: &LocalRegion,
    src_offset: u64,
    dst: &MrDesc,
    dst_offset: u64,
    op: RdmaOp,
) -> RdmaWork {
    let (peer, remote_key) = &dst.rkeys()[c.nic];
    RdmaWork {
        op,
        nic: c.nic,
        peer: peer.clone(),
        local_addr: src.ptr + src_offset + c.offset,
        local_key: src.keys[c.nic].local_key,
        remote_addr: dst.ptr() + dst_offset + c.offset,
        remote_key: *remote_key,
        remote_base: dst.registration_base(),
        len: c.len,
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    /// The reference: page by page in 128-bit arithmetic, where nothing overflows, so a
    /// start past 64 bits is seen directly rather than through checked operations.
    fn page_by_page(
        page_len: u64,
        local: (&Pages, u64, &'static str),
        remote: (&Pages, u64, &'static str),
    ) -> Result<Vec<Shift>> {
        let one = |(pages, region_len, side): (&Pages, u64, &'static str), i: usize| {
            let start =
                u128::from(pages.indices[i]) * u128::from(pages.stride) + u128::from(pages.offset);
            match u64::try_from(start) {
                Err(_) => Err(Error::OutOfBounds {
                    side,
                    offset: u64::MAX,
                    len: page_len,
                    region_len: 0,
                }),
                Ok(offset) if start + u128::from(page_len) <= u128::from(region_len) => Ok(offset),
                Ok(offset) => Err(Error::OutOfBounds {
                    side,
                    offset,
                    len: page_len,
                    region_len,
                }),
            }
        };
        (0..local.0.indices.len())
            .map(|i| Ok(Shift::new(one(local, i)?, one(remote, i)?)))
            .collect()
    }

    fn pages() -> impl Strategy<Value = Pages> {
        (
            proptest::collection::vec(prop_oneof![0u32..64, Just(u32::MAX)], 0..20),
            prop_oneof![0u64..4096, Just(u64::MAX / 2)],
            prop_oneof![0u64..4096, Just(u64::MAX - 10)],
        )
            .prop_map(|(indices, stride, offset)| Pages {
                indices,
                stride,
                offset,
            })
    }

    proptest! {
        /// The bulk check accepts exactly what the page-by-page check accepts, computes the
        /// same offsets, and refuses with the same error (the first page out of range).
        #[test]
        fn page_offsets_agree_with_checking_each_page(
            local in pages(), remote_seed in pages(), page_len in 0u64..512,
            local_len in prop_oneof![0u64..300_000, Just(u64::MAX)],
            remote_len in prop_oneof![0u64..300_000, Just(u64::MAX)],
        ) {
            // Both sides list as many pages (the caller checks that first).
            let mut remote = remote_seed;
            remote.indices.resize(local.indices.len(), 1);
            let l = (&local, local_len, "source");
            let r = (&remote, remote_len, "destination");
            prop_assert_eq!(page_offsets(page_len, l, r), page_by_page(page_len, l, r));
        }
    }
}
