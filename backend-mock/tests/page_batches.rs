//! Paged writes posted as batches (`Domain::post_rdma` of `RdmaPost::Pages`): an inline mock
//! lands a batch under one hold of each lock, checking what its pages share once. Whatever cuts
//! a batch short — a full queue, a revoked key, an injected failure inside it — every page is
//! still posted or failed exactly once, its data lands where it should, and the transfer
//! completes once.

mod common;

use std::sync::Arc;
use std::time::Duration;

use engine_core::{DoneFlag, Error, HostBuffer, TransferEngine, TransferShape};

const WAIT: Duration = Duration::from_secs(20);
const PAGE: u64 = 48;

fn pair(nics: usize, extra: &str) -> (Arc<TransferEngine>, Arc<TransferEngine>) {
    let config = common::mock_config(
        nics,
        &format!("[backends.mock]\ninline = true\nreorder = false\njitter_us = 0\n{extra}"),
    );
    (
        Arc::new(TransferEngine::open(&config).unwrap()),
        Arc::new(TransferEngine::open(&config).unwrap()),
    )
}

/// `n` pages from `src` (in order) into `dst` (scattered), with immediate `imm`; the result.
fn paged_write(
    a: &TransferEngine,
    src: &HostBuffer,
    dst: &HostBuffer,
    n: u32,
    imm: u32,
) -> Result<(), Error> {
    let (src_pages, dst_pages) = xfer_conformance::scattered_pages(n, PAGE);
    let done = DoneFlag::new();
    a.submit_paged_writes(
        PAGE,
        Some(imm),
        (src.mr(), &src_pages),
        (dst.desc(), &dst_pages),
        done.clone(),
    )?;
    done.wait(WAIT)
}

/// Whether every page of `n` but those in `except` landed (see `paged_write`).
fn assert_landed(src: &HostBuffer, dst: &HostBuffer, n: u32, except: &[usize]) {
    let (from, to) = xfer_conformance::scattered_pages(n, PAGE);
    xfer_conformance::assert_pages_landed(&src.to_vec(), &dst.to_vec(), (&from, &to), PAGE, except);
}

fn buffers(a: &Arc<TransferEngine>, b: &Arc<TransferEngine>, n: u32) -> (HostBuffer, HostBuffer) {
    let len = (u64::from(n) * PAGE) as usize;
    (
        HostBuffer::from_fn(a, len, |i| (i * 7 + 3) as u8).unwrap(),
        HostBuffer::new(b, len).unwrap(),
    )
}

/// A queue of 3 cuts every batch short: the rest waits in the worker's queue and is posted
/// as room comes, on one NIC and with pages alternating over two (batches of 32 pages each).
#[test]
fn a_batch_cut_short_by_a_full_queue_lands_every_page_once() {
    for nics in [1, 2] {
        let (a, b) = pair(nics, "queue_depth = 3\n");
        let n = 1000;
        let (src, dst) = buffers(&a, &b, n);
        paged_write(&a, &src, &dst, n, 5).unwrap();
        assert_landed(&src, &dst, n, &[]);
        let arrivals = b.expected_arrivals(TransferShape::Paged {
            page_len: PAGE,
            pages: u64::from(n),
        });
        let deadline = std::time::Instant::now() + WAIT;
        while b.imm_count(5) < arrivals {
            assert!(
                std::time::Instant::now() < deadline,
                "{nics} NICs: immediates missing"
            );
            std::thread::yield_now();
        }
        assert_eq!(
            b.imm_count(5),
            arrivals,
            "{nics} NICs: one immediate per page"
        );
        assert_eq!(
            a.stats().unwrap().stale_completions,
            0,
            "{nics} NICs: no page completed twice"
        );
    }
}

/// A batch whose destination key was revoked fails as a whole (each page as it would alone),
/// the transfer completes once with the NIC's refusal, and the next batch to the same peer
/// lands (the connection was rebuilt).
#[test]
fn a_batch_to_a_revoked_key_fails_once_and_the_next_one_lands() {
    let (a, b) = pair(1, "");
    let n = 300;
    let (src, dst) = buffers(&a, &b, n);
    let desc = dst.desc().clone();
    drop(dst);
    let (src_pages, dst_pages) = xfer_conformance::scattered_pages(n, PAGE);
    let done = DoneFlag::new();
    a.submit_paged_writes(
        PAGE,
        None,
        (src.mr(), &src_pages),
        (&desc, &dst_pages),
        done.clone(),
    )
    .unwrap();
    match done.wait(WAIT) {
        Err(Error::RemoteAccess(why)) => assert!(why.message.contains("rkey"), "{why}"),
        other => panic!("expected the NIC's refusal of the revoked key, got {other:?}"),
    }
    let dst = HostBuffer::new(&b, (u64::from(n) * PAGE) as usize).unwrap();
    paged_write(&a, &src, &dst, n, 6).unwrap();
    assert_landed(&src, &dst, n, &[]);
    assert_eq!(a.stats().unwrap().stale_completions, 0);
}

/// An injected failure in the middle of a request's pages: the mock posts that batch page
/// by page, so the failure hits exactly post 1 + 150 (the first post is the warm-up write),
/// the transfer fails with it, and every other page lands — the connection went to the
/// error state and the pages after it were posted on the fresh one.
#[test]
fn an_injected_failure_inside_a_batch_fails_its_page_and_the_rest_land() {
    let (a, b) = pair(1, "fail_nth = 152\n");
    let n = 400;
    let (src, dst) = buffers(&a, &b, n);
    // One ordinary write first: the batch does not start at post 1.
    let warm = DoneFlag::new();
    a.submit_single_write(PAGE, None, (src.mr(), 0), (dst.desc(), 0), warm.clone())
        .unwrap();
    warm.wait(WAIT).unwrap();
    match paged_write(&a, &src, &dst, n, 7) {
        Err(Error::Backend { source, .. }) => {
            assert!(
                source.message.contains("injected failure of operation 152"),
                "{source}"
            )
        }
        other => panic!("expected the injected failure, got {other:?}"),
    }
    // Page 150 (the 151st of the batch, post 152) placed half its bytes and no immediate.
    assert_landed(&src, &dst, n, &[150]);
    let deadline = std::time::Instant::now() + WAIT;
    while b.imm_count(7) < u64::from(n) - 1 {
        assert!(std::time::Instant::now() < deadline, "immediates missing");
        std::thread::yield_now();
    }
    assert_eq!(
        b.imm_count(7),
        u64::from(n) - 1,
        "no immediate for the failed page"
    );
}
