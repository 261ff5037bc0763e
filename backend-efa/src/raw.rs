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

/// An endpoint that sends and receives bytes exactly as given — no trailer, no sealing — for
/// tests that play a forger or relay what another endpoint sent.
pub struct RawEndpoint {
    endpoint: Endpoint,
    // Boxed so each stays at its address while the provider holds it.
    #[allow(clippy::vec_box)]
    buffers: Vec<Box<([u8; 4096], [usize; 8])>>,
    received: Vec<Vec<u8>>,
    receive_at: Vec<usize>,
}

impl RawEndpoint {
    /// Opens an endpoint of `provider` with a few receive buffers posted.
    pub fn open(provider: &str) -> Result<Self, String> {
        let endpoint = Endpoint::open(provider, None, None, None).map_err(|e| e.message)?;
        if endpoint.attr.mr_local != 0 {
            return Err(format!(
                "{provider} needs local descriptors; RawEndpoint has none"
            ));
        }
        let mut raw = Self {
            endpoint,
            buffers: Vec::new(),
            received: Vec::new(),
            receive_at: Vec::new(),
        };
        for i in 0..4 {
            raw.buffers.push(Box::new(([0; 4096], [0; 8])));
            raw.receive_at.push(i);
            raw.post_receive(i)?;
        }
        Ok(raw)
    }

    fn post_receive(&mut self, i: usize) -> Result<(), String> {
        let (buf, ctx) = &mut *self.buffers[i];
        // SAFETY: the buffer and its context are boxed, kept until `self` drops (after the
        // endpoint closes) and not reused before this receive completes.
        unsafe {
            self.endpoint.recv(
                buf.as_mut_ptr(),
                buf.len(),
                std::ptr::null_mut(),
                ctx.as_mut_ptr().cast(),
            )
        }
        .map(drop)
        .map_err(|e| e.message)
    }

    /// Its address.
    pub fn address(&self) -> Vec<u8> {
        self.endpoint.name().unwrap_or_default()
    }

    /// Posts `bytes` (at most 4 KiB) to the endpoint at `to`; `progress` completes it.
    /// `Ok(false)`: the provider asks to retry once both sides progressed (a first contact).
    pub fn send(&mut self, to: &[u8], bytes: &[u8]) -> Result<bool, String> {
        let dest = self.endpoint.insert_peer(to).map_err(|e| e.message)?;
        let i = self.buffers.len();
        self.buffers.push(Box::new(([0; 4096], [0; 8])));
        let (buf, ctx) = &mut *self.buffers[i];
        buf[..bytes.len()].copy_from_slice(bytes);
        // SAFETY: the buffer and context stay boxed in `self` until it drops.
        let posted = unsafe {
            self.endpoint.send(
                buf.as_ptr(),
                bytes.len(),
                std::ptr::null_mut(),
                dest,
                ctx.as_mut_ptr().cast(),
            )
        }
        .map_err(|e| e.message)?;
        match posted {
            Posted::Queued => Ok(true),
            Posted::Again => {
                self.buffers.pop();
                Ok(false)
            }
        }
    }

    /// Reads its completions once; returns the messages received since the last call.
    pub fn progress(&mut self) -> Vec<Vec<u8>> {
        let mut completions = Vec::new();
        let _ = self.endpoint.read(&mut completions);
        for c in completions {
            let at = self
                .receive_at
                .iter()
                .position(|&i| self.buffers[i].1.as_ptr() as usize == c.context);
            if let (Some(at), crate::ffi::KIND_RECV) = (at, c.kind) {
                let i = self.receive_at[at];
                self.received.push(self.buffers[i].0[..c.len].to_vec());
                let _ = self.post_receive(i);
            }
        }
        std::mem::take(&mut self.received)
    }
}
