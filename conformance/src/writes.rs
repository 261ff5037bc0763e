//! Writes into a peer's memory: single, at offsets, striped, paged, scattered, barriers, zero-byte.

use super::*;

/// Single writes of several sizes land byte for byte, and the receiver counts exactly the
/// arrivals `expected_arrivals` predicts.
pub fn single_write(h: &dyn Harness) {
    let config = quick_config(h, 1);
    let (a, b) = (open(&config), open(&config));
    for (k, len) in [1usize, 4096, 65_536 + 17, 1 << 20].into_iter().enumerate() {
        let src = buffer(&a, len, pattern(k as u64 + 1));
        let dst = buffer(&b, len, |_| 0);
        let imm = 100 + k as u32;
        let n = b.expected_arrivals(TransferShape::Single { len: len as u64 });
        let landed = expect_arrivals(&b, imm, n);
        let sent = flag();
        a.submit_single_write(
            len as u64,
            Some(imm),
            (src.mr(), 0),
            (dst.desc(), 0),
            sent.clone(),
        )
        .or_fail("posting it");
        sent.wait(WAIT)
            .unwrap_or_else(|e| panic!("write of {len} bytes failed: {e}"));
        landed
            .wait(WAIT)
            .unwrap_or_else(|e| panic!("arrivals of {len} bytes: {e}"));
        assert_copied(
            &format!("single write of {len}"),
            &dst.to_vec(),
            &src.to_vec(),
        );
        assert_eq!(b.imm_count(imm), 0, "no arrivals beyond the expected {n}");
    }
}

/// Writes at offsets, and a write without an immediate (nothing counted).
pub fn write_at_offsets_without_imm(h: &dyn Harness) {
    let config = quick_config(h, 1);
    let (a, b) = (open(&config), open(&config));
    let src = buffer(&a, 8192, pattern(3));
    let dst = buffer(&b, 8192, |_| 0xee);
    let done = flag();
    a.submit_single_write(
        1000,
        None,
        (src.mr(), 100),
        (dst.desc(), 5000),
        done.clone(),
    )
    .or_fail("posting it");
    done.wait(WAIT)
        .or_fail("the write's completion at its sender");
    assert_copied(
        "offset write",
        &dst.to_vec()[5000..6000],
        &src.to_vec()[100..1100],
    );
    assert!(
        dst.to_vec()[..5000]
            .iter()
            .chain(&dst.to_vec()[6000..])
            .all(|&x| x == 0xee),
        "bytes outside the range were touched"
    );
    assert_eq!(b.imm_count(0), 0);
}

/// Large writes stripe over every NIC count and every first-NIC choice, with each chunk
/// carrying its own NIC's keys (a wrong pairing is a remote-access error on a real NIC).
pub fn striping(h: &dyn Harness) {
    for nics in 1..=h.max_nics() {
        let mut selections: Vec<NicSelection> = (0..nics).map(NicSelection::First).collect();
        selections.push(NicSelection::RoundRobin);
        for selection in selections {
            let mut config = quick_config(h, nics);
            config.nic_selection = selection;
            let (a, b) = (open(&config), open(&config));
            assert_eq!(a.nic_count(), nics);
            for (k, len) in [3 * (1 << 20) + 12_345, 100, 256 << 10]
                .into_iter()
                .enumerate()
            {
                let src = buffer(&a, len, pattern(nics as u64 * 10 + k as u64));
                let dst = buffer(&b, len, |_| 0);
                let n = b.expected_arrivals(TransferShape::Single { len: len as u64 });
                let landed = expect_arrivals(&b, 7, n);
                let sent = flag();
                a.submit_single_write(
                    len as u64,
                    Some(7),
                    (src.mr(), 0),
                    (dst.desc(), 0),
                    sent.clone(),
                )
                .or_fail("posting it");
                sent.wait(WAIT)
                    .unwrap_or_else(|e| panic!("{nics} NICs, {selection:?}, {len} bytes: {e}"));
                landed
                    .wait(WAIT)
                    .unwrap_or_else(|e| panic!("{nics} NICs, {selection:?}: arrivals: {e}"));
                assert_copied(
                    &format!("{nics} NICs {selection:?} {len} bytes"),
                    &dst.to_vec(),
                    &src.to_vec(),
                );
                assert_eq!(
                    b.imm_count(7),
                    0,
                    "{nics} NICs {selection:?}: more arrivals than predicted"
                );
            }
        }
    }
}

/// Paged writes move each source page to its destination page, in any page order.
pub fn paged_writes(h: &dyn Harness) {
    let nics = h.max_nics();
    let config = quick_config(h, nics);
    let (a, b) = (open(&config), open(&config));
    let (page_len, stride, pages) = (1000u64, 1024u64, 64u32);
    let src = buffer(&a, (stride * u64::from(pages) + 16) as usize, pattern(5));
    let dst = buffer(&b, (stride * u64::from(pages) + 64) as usize, |_| 0);
    let src_pages = Pages {
        indices: (0..pages).collect(),
        stride,
        offset: 16,
    };
    // Destination pages in a scrambled order, at a different base offset.
    let dst_pages = Pages {
        indices: (0..pages).map(|i| (i * 37) % pages).collect(),
        stride,
        offset: 64,
    };
    let n = b.expected_arrivals(TransferShape::Paged {
        page_len,
        pages: u64::from(pages),
    });
    let landed = expect_arrivals(&b, 9, n);
    let sent = flag();
    a.submit_paged_writes(
        page_len,
        Some(9),
        (src.mr(), &src_pages),
        (dst.desc(), &dst_pages),
        sent.clone(),
    )
    .or_fail("posting it");
    sent.wait(WAIT)
        .or_fail("the paged write's completion at its sender");
    landed
        .wait(WAIT)
        .or_fail("the immediates of the pages at the target");
    for i in 0..pages as usize {
        let s = (16 + u64::from(src_pages.indices[i]) * stride) as usize;
        let d = (64 + u64::from(dst_pages.indices[i]) * stride) as usize;
        assert_copied(
            &format!("page {i}"),
            &dst.to_vec()[d..d + page_len as usize],
            &src.to_vec()[s..s + page_len as usize],
        );
    }
}

/// A scatter of variable-size pieces to two peers; each peer counts its own arrivals.
pub fn scatter(h: &dyn Harness) {
    let nics = h.max_nics();
    let config = quick_config(h, nics);
    let (a, b, c) = (open(&config), open(&config), open(&config));
    let src = buffer(&a, 1 << 20, pattern(11));
    let (db, dc) = (buffer(&b, 1 << 20, |_| 0), buffer(&c, 1 << 20, |_| 0));
    let group = a
        .add_peer_group(vec![b.main_address(), c.main_address()])
        .unwrap();
    let pieces: [(u64, u64, bool, u64); 5] = [
        (10, 0, true, 0),
        (70_000, 100, false, 4096),
        (1, 99_999, true, 500),
        (300_000, 200_000, true, 600_000),
        (4096, 0, false, 0),
    ];
    let dsts: Vec<ScatterDst> = pieces
        .iter()
        .map(|&(len, src_offset, to_b, dst_offset)| ScatterDst {
            len,
            src_offset,
            dst: if to_b {
                db.desc().clone()
            } else {
                dc.desc().clone()
            },
            dst_offset,
        })
        .collect();
    let lens =
        |to_b: bool| -> Vec<u64> { pieces.iter().filter(|p| p.2 == to_b).map(|p| p.0).collect() };
    let (lb, lc) = (lens(true), lens(false));
    let fb = expect_arrivals(
        &b,
        3,
        b.expected_arrivals(TransferShape::Scatter { lens: &lb }),
    );
    let fc = expect_arrivals(
        &c,
        3,
        c.expected_arrivals(TransferShape::Scatter { lens: &lc }),
    );
    let sent = flag();
    a.submit_scatter(Some(group), sent.clone(), Some(3), src.mr(), &dsts)
        .or_fail("posting it");
    sent.wait(WAIT)
        .or_fail("the scatter's completion at its sender");
    fb.wait(WAIT)
        .or_fail("the scatter's immediates at the first target");
    fc.wait(WAIT)
        .or_fail("the scatter's immediates at the second target");
    for &(len, so, to_b, d) in &pieces {
        let dst = if to_b { &db } else { &dc };
        let (len, so, d) = (len as usize, so as usize, d as usize);
        assert_copied(
            "scatter piece",
            &dst.to_vec()[d..d + len],
            &src.to_vec()[so..so + len],
        );
    }
    // A destination outside the group is refused before anything is posted.
    let stranger = open(&config);
    let ds = buffer(&stranger, 64, |_| 0);
    let bad = [ScatterDst {
        len: 8,
        src_offset: 0,
        dst: ds.desc().clone(),
        dst_offset: 0,
    }];
    assert!(matches!(
        a.submit_scatter(Some(group), flag(), None, src.mr(), &bad),
        Err(Error::InvalidArgument(_))
    ));
}

/// A barrier is one arrival at each peer.
pub fn barrier(h: &dyn Harness) {
    let nics = h.max_nics();
    let config = quick_config(h, nics);
    let (a, b, c) = (open(&config), open(&config), open(&config));
    let (db, dc) = (buffer(&b, 64, |_| 1), buffer(&c, 64, |_| 1));
    for round in 0..3 {
        let fb = expect_arrivals(&b, 77, 1);
        let fc = expect_arrivals(&c, 77, 1);
        let sent = flag();
        a.submit_barrier(
            None,
            sent.clone(),
            77,
            &[db.desc().clone(), dc.desc().clone()],
        )
        .or_fail("posting it");
        sent.wait(WAIT)
            .unwrap_or_else(|e| panic!("barrier round {round}: {e}"));
        fb.wait(WAIT)
            .or_fail("the barrier's immediate at the first peer");
        fc.wait(WAIT)
            .or_fail("the barrier's immediate at the second peer");
    }
    assert!(
        db.to_vec().iter().chain(&dc.to_vec()).all(|&x| x == 1),
        "a barrier wrote bytes"
    );
}

/// A zero-byte write with an immediate (a pure signal) arrives and is counted, unless the
/// backend declares it cannot (then the engine refuses it, typed).
pub fn zero_byte_write_with_imm(h: &dyn Harness) {
    let config = quick_config(h, 1);
    let (a, b) = (open(&config), open(&config));
    let src = buffer(&a, 64, |_| 1);
    let dst = buffer(&b, 64, |_| 0);
    let sent = flag();
    a.submit_single_write(0, Some(901), (src.mr(), 0), (dst.desc(), 0), sent.clone())
        .or_fail("posting it");
    if !a.capabilities()[0].zero_byte_writes {
        assert!(
            matches!(sent.wait(WAIT), Err(Error::Refused { .. })),
            "a backend without zero-byte writes must have them refused"
        );
        return;
    }
    let n = b.expected_arrivals(TransferShape::Single { len: 0 });
    let landed = expect_arrivals(&b, 901, n);
    sent.wait(WAIT)
        .unwrap_or_else(|e| panic!("a zero-byte write failed: {e}"));
    landed
        .wait(WAIT)
        .unwrap_or_else(|e| panic!("a zero-byte write's immediate was not counted: {e}"));
    assert!(
        dst.to_vec().iter().all(|&x| x == 0),
        "a zero-byte write wrote bytes"
    );
}
