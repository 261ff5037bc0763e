//! One mock NIC: checks like a NIC, copies like DMA, fails as configured.

use std::collections::HashMap;
use std::sync::atomic::Ordering;
use std::sync::{Arc, Weak};
use std::time::{Duration, Instant};

use engine_core::domain::{
    Device, Domain, DomainConfig, DomainError, DomainErrorKind, Event, MemoryRegion, PostStatus,
    Registration, Waker, WriteRequest,
};
use engine_core::NetAddr;

use crate::fabric::{self, accept_message, Nic, Region, WaitingSend};
use crate::options::MockOptions;

/// An operation as posted, kept until it lands when faults defer it.
#[derive(Debug)]
enum Op {
    Write {
        wr_id: u64,
        peer: NetAddr,
        local_addr: u64,
        local_key: u64,
        remote_addr: u64,
        remote_key: u64,
        len: u64,
        imm: Option<u32>,
    },
    Send {
        wr_id: u64,
        peer: NetAddr,
        data: Vec<u8>,
    },
}

impl Op {
    fn wr_id(&self) -> u64 {
        match self {
            Self::Write { wr_id, .. } | Self::Send { wr_id, .. } => *wr_id,
        }
    }
}

/// A mock NIC.
pub struct MockDomain {
    nic: Arc<Nic>,
    options: MockOptions,
    rng: fastrand::Rng,
    posted: u64,
    /// Operations held back by delay/reorder/queue-depth faults, with their due time.
    deferred: Vec<(Instant, Op)>,
    /// Completions of our own operations, returned by the next poll.
    done: Vec<Event>,
    peers: HashMap<NetAddr, Weak<Nic>>,
}

fn remote_access(message: String) -> DomainError {
    DomainError::new(DomainErrorKind::RemoteAccess, message)
}

impl MockDomain {
    /// Opens a NIC on the process's fabric (the name in the config is only a label).
    pub fn open(config: &DomainConfig<'_>) -> Result<Self, DomainError> {
        let options = MockOptions::parse(config.options)?;
        let nic = fabric::join();
        let rng =
            fastrand::Rng::with_seed(options.seed ^ nic.id.wrapping_mul(0x2545_f491_4f6c_dd1d));
        Ok(Self {
            nic,
            options,
            rng,
            posted: 0,
            deferred: Vec::new(),
            done: Vec::new(),
            peers: HashMap::new(),
        })
    }

    fn peer(&mut self, addr: &NetAddr) -> Result<Arc<Nic>, DomainError> {
        if let Some(nic) = self.peers.get(addr).and_then(Weak::upgrade) {
            if nic.alive.load(Ordering::Acquire) {
                return Ok(nic);
            }
        }
        let nic = fabric::lookup(addr).ok_or_else(|| fabric::unreachable(addr))?;
        self.peers.insert(addr.clone(), Arc::downgrade(&nic));
        Ok(nic)
    }

    fn check_alive(&self) -> Result<(), DomainError> {
        if self.nic.alive.load(Ordering::Acquire) {
            Ok(())
        } else {
            Err(DomainError::new(
                DomainErrorKind::PeerUnreachable,
                format!("mock NIC {} was dropped from the fabric", self.nic.addr),
            ))
        }
    }

    /// Counts a post and says whether fault injection fails it.
    fn injected_failure(&mut self) -> Option<DomainError> {
        self.posted += 1;
        let n = self.posted;
        let o = &self.options;
        let hit = n == o.fail_nth || (o.fail_every > 0 && n % o.fail_every == 0);
        hit.then(|| {
            DomainError::new(
                DomainErrorKind::Other,
                format!("injected failure of operation {n}"),
            )
        })
    }

    fn accept(&mut self, op: Op) -> Result<PostStatus, DomainError> {
        self.check_alive()?;
        if self.options.queue_depth > 0 && self.deferred.len() >= self.options.queue_depth {
            return Ok(PostStatus::Busy);
        }
        if let Some(e) = self.injected_failure() {
            self.done.push(Event::Done {
                wr_id: op.wr_id(),
                result: Err(e),
            });
            return Ok(PostStatus::Posted);
        }
        if self.options.defers() {
            let jitter = match self.options.jitter_us {
                0 => 0,
                max => self.rng.u64(0..=max),
            };
            let delay = Duration::from_micros(self.options.delay_us + jitter);
            self.deferred.push((Instant::now() + delay, op));
        } else {
            self.execute(op);
        }
        Ok(PostStatus::Posted)
    }

    /// Carries an operation out and records its completion.
    fn execute(&mut self, op: Op) {
        let wr_id = op.wr_id();
        let result = match op {
            Op::Write {
                peer,
                local_addr,
                local_key,
                remote_addr,
                remote_key,
                len,
                imm,
                ..
            } => self.write(
                &peer,
                local_addr,
                local_key,
                remote_addr,
                remote_key,
                len,
                imm,
            ),
            Op::Send { peer, data, .. } => match self.send(&peer, data, wr_id) {
                // Completes when the receiver posts a buffer (from its side).
                Ok(false) => return,
                Ok(true) => Ok(()),
                Err(e) => Err(e),
            },
        };
        self.done.push(Event::Done { wr_id, result });
    }

    #[allow(clippy::too_many_arguments)]
    fn write(
        &mut self,
        peer: &NetAddr,
        local_addr: u64,
        local_key: u64,
        remote_addr: u64,
        remote_key: u64,
        len: u64,
        imm: Option<u32>,
    ) -> Result<(), DomainError> {
        let target = self.peer(peer)?;
        // Lock order: our regions, then the peer's (the same lock, read twice, for loopback).
        let ours = self.nic.regions();
        let mut src_gpu = false;
        if len > 0 {
            let src = ours.local.get(&local_key).ok_or_else(|| {
                DomainError::new(
                    DomainErrorKind::InvalidArgument,
                    format!(
                        "local key {local_key:#x} is not registered with mock NIC {}",
                        self.nic.addr
                    ),
                )
            })?;
            if !src.contains(local_addr, len) {
                return Err(DomainError::new(
                    DomainErrorKind::InvalidArgument,
                    format!(
                        "source {local_addr:#x}+{len} is outside its region {:#x}+{}",
                        src.ptr, src.len
                    ),
                ));
            }
            src_gpu = src.gpu;
        }
        let theirs = if Arc::ptr_eq(&target, &self.nic) {
            None
        } else {
            Some(target.regions())
        };
        let regions = theirs.as_deref().unwrap_or(&ours);
        let dst: Region = *regions.remote.get(&remote_key).ok_or_else(|| {
            remote_access(format!(
                "rkey {remote_key:#x} is not valid for remote write at mock NIC {peer}"
            ))
        })?;
        if !dst.contains(remote_addr, len) {
            return Err(remote_access(format!(
                "destination {remote_addr:#x}+{len} is outside the region {:#x}+{} of rkey {remote_key:#x} at mock NIC {peer}",
                dst.ptr, dst.len
            )));
        }
        if len > 0 && (src_gpu || dst.gpu) {
            // SAFETY: as below; the engine checked both GPU ranges with the driver when they
            // were registered, and the driver copies between any host/device addresses.
            unsafe { uvm_watcher::gpu::copy(remote_addr, local_addr, len as usize) }.map_err(
                |e| {
                    DomainError::new(
                        DomainErrorKind::Other,
                        format!("GPU copy at mock NIC {peer}: {e}"),
                    )
                },
            )?;
        } else if len > 0 {
            // SAFETY: both ranges were checked against live registrations, and the regions
            // locks are held, so neither can be deregistered during the copy. The owners
            // promised (TransferEngine::reg_mr's contract) the memory stays allocated while
            // registered; `copy` tolerates overlap (a loopback write within one region).
            unsafe {
                std::ptr::copy(
                    local_addr as *const u8,
                    remote_addr as *mut u8,
                    len as usize,
                )
            };
        }
        drop(theirs);
        drop(ours);
        if let Some(imm) = imm {
            target.deliver(Event::ImmArrival { imm });
        }
        Ok(())
    }

    /// Returns whether the message was delivered now (else it waits for a receive buffer).
    fn send(&mut self, peer: &NetAddr, data: Vec<u8>, wr_id: u64) -> Result<bool, DomainError> {
        let target = self.peer(peer)?;
        let mut inbox = target.inbox();
        let delivered = match inbox.recv_buffers.pop_front() {
            Some(buf_len) => {
                accept_message(&mut inbox, buf_len, data, peer)?;
                true
            }
            None => {
                let sender = Arc::downgrade(&self.nic);
                inbox.waiting_sends.push_back(WaitingSend {
                    data,
                    sender,
                    wr_id,
                });
                false
            }
        };
        drop(inbox);
        if delivered {
            target.wake();
        }
        Ok(delivered)
    }

    fn run_deferred(&mut self) {
        if !self.nic.alive.load(Ordering::Acquire) {
            let err = self.check_alive().expect_err("not alive");
            for (_, op) in self.deferred.drain(..) {
                self.done.push(Event::Done {
                    wr_id: op.wr_id(),
                    result: Err(err.clone()),
                });
            }
            return;
        }
        let now = Instant::now();
        let mut due = Vec::new();
        let mut i = 0;
        while i < self.deferred.len() {
            if self.deferred[i].0 <= now {
                due.push(self.deferred.swap_remove(i).1);
            } else {
                i += 1;
            }
        }
        if self.options.reorder {
            self.rng.shuffle(&mut due);
        }
        for op in due {
            self.execute(op);
        }
    }
}

impl Domain for MockDomain {
    fn address(&self) -> NetAddr {
        self.nic.addr.clone()
    }

    fn register(&mut self, region: &MemoryRegion) -> Result<Registration, DomainError> {
        // GPU memory (checked by the engine with the CUDA driver) is copied with the driver.
        let r = Region {
            ptr: region.ptr,
            len: region.len,
            gpu: region.device != Device::Host,
        };
        let local_key = fabric::new_key();
        let remote_key = if region.remote_write {
            fabric::new_key()
        } else {
            0
        };
        let mut regions = self.nic.regions.write().unwrap_or_else(|p| p.into_inner());
        regions.local.insert(local_key, r);
        if region.remote_write {
            regions.remote.insert(remote_key, r);
        }
        Ok(Registration {
            local_key,
            remote_key,
        })
    }

    fn deregister(&mut self, local_key: u64) -> Result<(), DomainError> {
        let mut regions = self.nic.regions.write().unwrap_or_else(|p| p.into_inner());
        let region = regions.local.remove(&local_key).ok_or_else(|| {
            DomainError::new(
                DomainErrorKind::InvalidArgument,
                format!("local key {local_key:#x} is not registered"),
            )
        })?;
        regions
            .remote
            .retain(|_, r| r.ptr != region.ptr || r.len != region.len);
        Ok(())
    }

    fn post_write(&mut self, wr: &WriteRequest<'_>) -> Result<PostStatus, DomainError> {
        self.accept(Op::Write {
            wr_id: wr.wr_id,
            peer: wr.peer.clone(),
            local_addr: wr.local_addr,
            local_key: wr.local_key,
            remote_addr: wr.remote_addr,
            remote_key: wr.remote_key,
            len: wr.len,
            imm: wr.imm,
        })
    }

    fn post_send(
        &mut self,
        wr_id: u64,
        peer: &NetAddr,
        data: &[u8],
    ) -> Result<PostStatus, DomainError> {
        self.accept(Op::Send {
            wr_id,
            peer: peer.clone(),
            data: data.to_vec(),
        })
    }

    fn post_recvs(&mut self, buf_len: usize, count: usize) -> Result<(), DomainError> {
        self.check_alive()?;
        self.nic
            .inbox()
            .recv_buffers
            .extend(std::iter::repeat_n(buf_len, count));
        self.nic.match_waiting_sends();
        Ok(())
    }

    fn poll(&mut self, events: &mut Vec<Event>) -> Result<(), DomainError> {
        if !self.deferred.is_empty() {
            self.run_deferred();
        }
        let start = events.len();
        events.append(&mut self.done);
        events.append(&mut self.nic.inbox().events);
        if self.options.reorder {
            self.rng.shuffle(&mut events[start..]);
        }
        Ok(())
    }

    fn set_waker(&mut self, waker: Waker) -> bool {
        self.nic.set_waker(waker);
        true
    }
}

impl Drop for MockDomain {
    fn drop(&mut self) {
        fabric::leave(&self.nic);
    }
}
