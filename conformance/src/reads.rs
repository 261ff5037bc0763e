//! RDMA READ: reads of every size, of unreadable regions, from dead peers.

use super::*;

/// Memory registered readable by peers, with its owner's handle dropped at the end.
struct Readable {
    engine: Arc<TransferEngine>,
    data: Vec<u8>,
    mr: engine_core::MrHandle,
    desc: MrDesc,
}

impl Readable {
    fn new(
        engine: &Arc<TransferEngine>,
        len: usize,
        fill: impl Fn(usize) -> u8,
        access: RemoteAccess,
    ) -> Self {
        let mut data: Vec<u8> = (0..len).map(fill).collect();
        // SAFETY: `data` lives in the returned value and is deregistered in its Drop before
        // it is freed.
        #[allow(unsafe_code)]
        let (mr, desc) =
            unsafe { engine.reg_mr_with(data.as_mut_ptr(), len, Device::Host, access) }
                .unwrap_or_else(|e| panic!("registering {len} readable bytes failed: {e}"));
        Self {
            engine: Arc::clone(engine),
            data,
            mr,
            desc,
        }
    }
}

impl Drop for Readable {
    fn drop(&mut self) {
        let _ = self.engine.dereg_mr(self.mr);
        let _ = &self.data;
    }
}

/// RDMA READ: single reads of every size class (striped over every NIC count), at offsets,
/// and paged reads; the bytes arrive exactly, and the peer counts nothing.
pub fn reads(h: &dyn Harness) {
    for nics in 1..=h.max_nics() {
        let config = quick_config(h, nics);
        let (a, b) = (open(&config), open(&config));
        require_reads(&a);
        const LEN: usize = 3 << 20;
        let remote = Readable::new(&b, LEN, pattern(11), RemoteAccess::READ);
        let local = buffer(&a, LEN, |_| 0);
        for (len, at_local, at_remote) in [
            (1u64, 0u64, 0u64),
            (4000, 17, 4096),
            (65_536, 0, 100),
            (2 << 20, 4096, 8192),
        ] {
            let f = DoneFlag::new();
            a.submit_single_read(
                len,
                (local.mr(), at_local),
                (&remote.desc, at_remote),
                f.clone(),
            )
            .or_fail("posting it");
            f.wait(WAIT)
                .unwrap_or_else(|e| panic!("{nics} NICs: read of {len}: {e}"));
            let got = local.to_vec();
            let (l, r, n) = (at_local as usize, at_remote as usize, len as usize);
            assert_copied(
                &format!("{nics} NICs: read of {len}"),
                &got[l..l + n],
                &remote.data[r..r + n],
            );
        }
        // Paged: remote pages 9, 2, 5 into local pages 0, 1, 2.
        let pages = |indices: Vec<u32>| Pages {
            indices,
            stride: 8192,
            offset: 64,
        };
        let (lp, rp) = (pages(vec![0, 1, 2]), pages(vec![9, 2, 5]));
        let f = DoneFlag::new();
        a.submit_paged_reads(4096, (local.mr(), &lp), (&remote.desc, &rp), f.clone())
            .or_fail("posting it");
        f.wait(WAIT)
            .unwrap_or_else(|e| panic!("{nics} NICs: paged read: {e}"));
        let got = local.to_vec();
        for (l, r) in lp.indices.iter().zip(&rp.indices) {
            let (l, r) = (64 + *l as usize * 8192, 64 + *r as usize * 8192);
            assert_copied("paged read", &got[l..l + 4096], &remote.data[r..r + 4096]);
        }
        assert_eq!(b.imm_count(0), 0, "a read counts nothing at the peer");
        // Out of bounds on either side: refused before anything is posted.
        assert!(matches!(
            a.submit_single_read(
                64,
                (local.mr(), LEN as u64 - 1),
                (&remote.desc, 0),
                DoneFlag::new()
            ),
            Err(Error::OutOfBounds { .. })
        ));
        assert!(matches!(
            a.submit_single_read(
                64,
                (local.mr(), 0),
                (&remote.desc, LEN as u64),
                DoneFlag::new()
            ),
            Err(Error::OutOfBounds { .. })
        ));
    }
}

/// Reading a region its owner registered only for writes is refused at submit with a remote
/// access error, on every backend (its descriptor says so: a courtesy check, since providers
/// such as libfabric's shm and tcp do not enforce it), and nothing is read; a region
/// registered for both can be read and written.
pub fn read_of_an_unreadable_region(h: &dyn Harness) {
    let config = quick_config(h, 1);
    let (a, b) = (open(&config), open(&config));
    require_reads(&a);
    let write_only = buffer(&b, 4096, pattern(3));
    let local = buffer(&a, 4096, |_| 0xaa);
    let refused = a.submit_single_read(
        4096,
        (local.mr(), 0),
        (write_only.desc(), 0),
        DoneFlag::new(),
    );
    assert!(
        matches!(&refused, Err(Error::RemoteAccess(m)) if m.message.contains("READ")),
        "a read of a write-only region must be refused at submit, naming RemoteAccess::READ: {refused:?}"
    );
    let pages = Pages {
        indices: vec![0],
        stride: 4096,
        offset: 0,
    };
    let refused = a.submit_paged_reads(
        4096,
        (local.mr(), &pages),
        (write_only.desc(), &pages),
        DoneFlag::new(),
    );
    assert!(
        matches!(refused, Err(Error::RemoteAccess(_))),
        "paged: {refused:?}"
    );
    assert!(
        local.to_vec().iter().all(|&x| x == 0xaa),
        "nothing may be read"
    );
    let both = Readable::new(&b, 4096, pattern(4), RemoteAccess::READ_WRITE);
    let f = DoneFlag::new();
    a.submit_single_read(4096, (local.mr(), 0), (&both.desc, 0), f.clone())
        .or_fail("posting it");
    f.wait(WAIT).or_fail("a read of a read-write region");
    assert_copied("read of a read-write region", &local.to_vec(), &both.data);
}

/// A descriptor forged to say a write-only region is readable gets past the initiator's
/// check; the provider then refuses the read (where it enforces access: not libfabric's shm
/// or tcp) and nothing is read.
pub fn read_of_an_unreadable_region_by_a_forged_descriptor(h: &dyn Harness) {
    let config = quick_config(h, 1);
    let (a, b) = (open(&config), open(&config));
    require_reads(&a);
    let write_only = buffer(&b, 4096, pattern(3));
    let forged = write_only
        .desc()
        .clone()
        .with_access(Some(RemoteAccess::READ_WRITE));
    let local = buffer(&a, 4096, |_| 0xaa);
    let f = DoneFlag::new();
    a.submit_single_read(4096, (local.mr(), 0), (&forged, 0), f.clone())
        .or_fail("posting it");
    let r = f.wait(WAIT);
    if h.typed_remote_access() {
        assert!(matches!(r, Err(Error::RemoteAccess(_))), "{r:?}");
    } else {
        assert!(r.is_err(), "a read of a write-only region succeeded");
    }
    assert!(
        local.to_vec().iter().all(|&x| x == 0xaa),
        "nothing may be read"
    );
}

/// A read from a peer that died fails (never hangs, never succeeds); reads from others go on.
pub fn read_from_a_dead_peer(h: &dyn Harness) {
    let config = quick_config(h, 1);
    let (a, b) = (open(&config), open(&config));
    require_reads(&a);
    let remote = Readable::new(&b, 4096, pattern(5), RemoteAccess::READ);
    let desc = remote.desc.clone();
    let local = buffer(&a, 4096, |_| 0);
    let f = DoneFlag::new();
    a.submit_single_read(4096, (local.mr(), 0), (&desc, 0), f.clone())
        .or_fail("posting it");
    f.wait(WAIT).or_fail("a read from a live peer");
    drop(remote);
    drop(b);
    let f = DoneFlag::new();
    a.submit_single_read(4096, (local.mr(), 0), (&desc, 0), f.clone())
        .or_fail("posting it");
    assert!(f.wait(WAIT).is_err(), "a read from a dead peer succeeded");
}
