//! A minimal raw libfabric write (or read) loop — no engine, no worker thread — as the
//! reference the engine's benchmark is compared against: two endpoints of one provider in this
//! process, one writing batches into the other (or reading batches from it).
//!
//! Like two peers (and like the engine's loopback bench, where each engine has its worker),
//! the target is progressed by a thread of its own that polls its CQ. An initiator that also
//! polled the target's CQ in its own loop would drive the receiver's progress (shm and EFA
//! progress only when the receiver polls) with no thread handoff at all — a reference no two
//! processes can reach, which made the ratios meaningless (0.05x at 4 KiB on 2 cores).

use std::time::{Duration, Instant};

use crate::ffi::{Endpoint, Posted};

/// Writes `batch` blocks of `block` bytes per trip for `duration`; returns (trips, elapsed).
pub fn write_loop(
    provider: &str,
    block: usize,
    batch: usize,
    duration: Duration,
) -> Result<(u64, Duration), String> {
    rma_loop(provider, block, batch, duration, false)
}

/// Reads `batch` blocks of `block` bytes per trip (`fi_readmsg`) for `duration`.
pub fn read_loop(
    provider: &str,
    block: usize,
    batch: usize,
    duration: Duration,
) -> Result<(u64, Duration), String> {
    rma_loop(provider, block, batch, duration, true)
}

fn rma_loop(
    provider: &str,
    block: usize,
    batch: usize,
    duration: Duration,
    read: bool,
) -> Result<(u64, Duration), String> {
    let mut initiator = Endpoint::open(provider, None, None, None).map_err(|e| e.message)?;
    let mut target = Endpoint::open(provider, None, None, None).map_err(|e| e.message)?;
    let span = block * batch;
    let src = vec![1u8; span.max(1)].into_boxed_slice();
    let dst = vec![0u8; span.max(1)].into_boxed_slice();
    // SAFETY: both buffers outlive their registrations (dropped at the end of this function,
    // after the registrations, which are declared later).
    let src_mr = unsafe { initiator.register(src.as_ptr(), src.len(), None, 1, (false, false)) }
        .map_err(|e| e.message)?;
    // SAFETY: as above.
    let dst_mr = unsafe { target.register(dst.as_ptr(), dst.len(), None, 2, (true, true)) }
        .map_err(|e| e.message)?;
    let dest = initiator
        .insert_peer(&target.name().map_err(|e| e.message)?)
        .map_err(|e| e.message)?;
    let base = if target.attr.mr_virt_addr != 0 {
        dst.as_ptr() as u64
    } else {
        0
    };
    let mut contexts = vec![[0usize; 8]; batch];
    let mut completions = Vec::with_capacity(64);
    let stop = std::sync::atomic::AtomicBool::new(false);
    std::thread::scope(|scope| -> Result<(u64, Duration), String> {
        let target = &mut target;
        let stop = &stop;
        scope.spawn(move || {
            let mut completions = Vec::with_capacity(64);
            while !stop.load(std::sync::atomic::Ordering::Relaxed) {
                completions.clear();
                // Yield when idle, as the engine's worker does: on a small machine the
                // initiator (and anything else running) needs the CPU.
                if matches!(target.read(&mut completions), Ok(0)) {
                    std::thread::yield_now();
                }
            }
        });
        let result = initiator_trips(
            &mut initiator,
            (&src, src_mr.desc),
            (dest, base, dst_mr.key),
            (block, batch, duration, read),
            (&mut contexts, &mut completions),
        );
        stop.store(true, std::sync::atomic::Ordering::Relaxed);
        result
    })
    .inspect(|_| drop((src_mr, dst_mr)))
}

/// The initiator's side: trips of `batch` posts, each trip waiting for its completions.
fn initiator_trips(
    initiator: &mut Endpoint,
    (src, src_desc): (&[u8], *mut std::ffi::c_void),
    (dest, base, key): (u64, u64, u64),
    (block, batch, duration, read): (usize, usize, Duration, bool),
    (contexts, completions): (&mut [[usize; 8]], &mut Vec<crate::ffi::Completion>),
) -> Result<(u64, Duration), String> {
    let start = Instant::now();
    let mut trips = 0u64;
    while trips == 0 || start.elapsed() < duration {
        let mut posted = 0;
        let mut done = 0;
        while done < batch {
            while posted < batch {
                let offset = posted * block;
                let ctx = contexts[posted].as_mut_ptr().cast();
                // SAFETY: the local range is inside `src_mr`'s region and the context slot
                // is not reused until this trip's completions are all read.
                let r = unsafe {
                    if read {
                        initiator.rdma_read(
                            src.as_ptr().add(offset).cast_mut(),
                            block,
                            src_desc,
                            dest,
                            base + offset as u64,
                            key,
                            ctx,
                        )
                    } else {
                        initiator.write(
                            src.as_ptr().add(offset),
                            block,
                            src_desc,
                            dest,
                            base + offset as u64,
                            key,
                            None,
                            ctx,
                        )
                    }
                };
                match r.map_err(|e| e.message)? {
                    Posted::Queued => posted += 1,
                    Posted::Again => break,
                }
            }
            completions.clear();
            match initiator.read(completions) {
                Ok(0) => std::thread::yield_now(),
                Ok(n) => done += n,
                Err(_) => return Err("a raw RMA operation failed".into()),
            }
        }
        trips += 1;
    }
    Ok((trips, start.elapsed()))
}
