//! One mock NIC: checks like a NIC, copies like DMA, fails as configured. Posting hands the
//! operation to the fabric (see `fabric.rs`), which lands it on its own clock.

use std::sync::atomic::Ordering;
use std::sync::Arc;
use std::time::{Duration, Instant};

use xfer_plugin::addr::NetAddr;
use xfer_plugin::domain::{
    post_one_by_one, Capabilities, Device, Domain, DomainConfig, DomainError, DomainErrorKind,
    Event, MemoryRegion, PostStatus, RdmaPost, RdmaRequest, Registration, Waker,
};

use crate::fabric::{self, Conn, Listed, Nic, Op, Pages, Posted, RdmaShape, Region};
use crate::options::MockOptions;

/// A mock NIC.
pub struct MockDomain {
    nic: Arc<Nic>,
    options: MockOptions,
    /// What the options declare, computed once (every post checks the engine keeps to it).
    capabilities: Capabilities,
    /// This NIC's connections, by peer.
    conns: foldhash::HashMap<NetAddr, Arc<Conn>>,
    rng: fastrand::Rng,
    posted: u64,
    /// The post that panicked (`panic_on_post`), after which nothing may be posted.
    panicked_in: Option<u64>,
    /// Sends whose `Done` is withheld (`lose_send_completions`).
    lost_sends: std::collections::HashSet<u64>,
    /// Vectors for an inline batch's events, kept between batches.
    batch_events: fabric::BatchEvents,
}

impl MockDomain {
    /// Opens a NIC on the process's fabric (the name in the config is only a label).
    pub fn open(config: &DomainConfig<'_>) -> Result<Self, DomainError> {
        let options = MockOptions::parse(config.options)?;
        if options.panic_on_open {
            panic!("mock NIC: injected panic while opening (panic_on_open)");
        }
        let nic = fabric::join();
        tracing::debug!(nic = %nic.addr, "mock NIC opened");
        let rng =
            fastrand::Rng::with_seed(options.seed ^ nic.id.wrapping_mul(0x2545_f491_4f6c_dd1d));
        Ok(Self {
            nic,
            capabilities: options.capabilities(),
            options,
            conns: Default::default(),
            rng,
            posted: 0,
            panicked_in: None,
            lost_sends: Default::default(),
            batch_events: Default::default(),
        })
    }

    fn check_alive(&self) -> Result<(), DomainError> {
        if self.nic.alive.load(Ordering::Acquire) {
            Ok(())
        } else {
            Err(fabric::dropped(&self.nic.addr))
        }
    }

    /// Counts a post and says whether fault injection fails it.
    fn injected_failure(&mut self) -> Option<DomainError> {
        self.posted += 1;
        let n = self.posted;
        let o = &self.options;
        if n == o.panic_on_post {
            self.panicked_in = Some(n);
            panic!(
                "mock NIC {}: injected panic in post {n} (panic_on_post)",
                self.nic.addr
            );
        }
        let hit = n == o.fail_nth || (o.fail_every > 0 && n % o.fail_every == 0);
        hit.then(|| {
            DomainError::new(
                DomainErrorKind::Other,
                format!("injected failure of operation {n}"),
            )
        })
    }

    /// The engine must never post what this Domain's declared capabilities rule out.
    fn check_declared(&self, op: &Op) -> Result<(), DomainError> {
        let caps = &self.capabilities;
        let broken = match op {
            Op::Rdma { shape, .. } => {
                caps.max_write_size.is_some_and(|m| shape.len > m)
                    || (shape.len == 0 && !caps.zero_byte_writes)
                    || (shape.op.imm().is_some() && !caps.immediates)
            }
            Op::Send { data, .. } => caps.max_message_size.is_some_and(|m| data.len() > m),
        };
        if broken {
            return Err(DomainError::new(
                DomainErrorKind::Fatal,
                format!(
                    "the engine posted {op:?} beyond this mock's declared capabilities {caps:?}"
                ),
            ));
        }
        Ok(())
    }

    /// Whether fault injection could touch any of the next `n` posts.
    fn faults_within(&self, n: u64) -> bool {
        let o = &self.options;
        let next = self.posted + 1..=self.posted + n;
        next.contains(&o.panic_on_post)
            || next.contains(&o.fail_nth)
            || (o.fail_every > 0 && self.posted / o.fail_every != (self.posted + n) / o.fail_every)
    }

    /// What every post checks first: the Domain is usable, the engine kept to the declared
    /// capabilities, the connection (opened on first use) has room. `None`: it has none.
    fn prepare(&mut self, op: &Op) -> Result<Option<Arc<Conn>>, DomainError> {
        if let Some(n) = self.panicked_in {
            // A Domain is not used again after a fatal error: make it visible if it is.
            return Err(DomainError::new(
                DomainErrorKind::InvalidArgument,
                format!(
                    "mock NIC {}: posted to after its fatal error (the panic in post {n})",
                    self.nic.addr
                ),
            ));
        }
        self.check_alive()?;
        self.check_declared(op)?;
        let conn = match self.conns.get(op.peer()) {
            Some(conn) => Arc::clone(conn),
            None => {
                let conn = Arc::new(Conn::new(op.peer().clone()));
                self.conns.insert(op.peer().clone(), Arc::clone(&conn));
                conn
            }
        };
        Ok(conn.try_occupy(self.options.queue_depth).then_some(conn))
    }

    /// Lands up to `n` requests shaped as `first` as one batch (`batch(accepted)` names the
    /// first `accepted` of them), as many as the connection's queue has room for; returns how
    /// many, with `Busy` if that was fewer than `n`.
    fn land_run<B: fabric::rdma::Batch>(
        &mut self,
        first: &RdmaRequest<'_>,
        n: usize,
        batch: impl FnOnce(usize) -> B,
    ) -> (usize, Result<PostStatus, DomainError>) {
        let shape = shape_of(first);
        let conn = match self.prepare(&Op::Rdma {
            wr_id: first.wr_id,
            peer: first.peer.clone(),
            shape,
        }) {
            Ok(Some(conn)) => conn,
            Ok(None) => return (0, Ok(PostStatus::Busy)),
            Err(e) => return (0, Err(e)),
        };
        // The queue has room for `accepted` requests (an inline mock's queue empties as it
        // lands, so only a depth below the batch's length cuts it short).
        let accepted = 1 + conn.occupy_up_to(self.options.queue_depth, n - 1);
        self.posted += accepted as u64;
        fabric::land_batch(
            &self.nic,
            &conn,
            &shape,
            &batch(accepted),
            &mut self.batch_events,
        );
        let status = if accepted == n {
            PostStatus::Posted
        } else {
            PostStatus::Busy
        };
        (accepted, Ok(status))
    }

    fn accept(&mut self, op: Op) -> Result<PostStatus, DomainError> {
        let Some(conn) = self.prepare(&op)? else {
            return Ok(PostStatus::Busy);
        };
        let epoch = conn.epoch();
        let injected = self.injected_failure();
        if self.options.inline {
            fabric::land_on(&self.nic, &conn, op, epoch, injected);
            return Ok(PostStatus::Posted);
        }
        let posted = Posted {
            src: Arc::clone(&self.nic),
            conn,
            op,
            epoch,
            injected,
        };
        let jitter = match self.options.jitter_us {
            0 => 0,
            max => self.rng.u64(0..=max),
        };
        let due = Instant::now() + Duration::from_micros(self.options.delay_us + jitter);
        let order = if self.options.reorder {
            self.rng.u64(..)
        } else {
            self.posted
        };
        fabric::schedule(posted, due, order);
        Ok(PostStatus::Posted)
    }

    /// One write or read, scheduled (or landed, inline) on its own.
    fn post_one(&mut self, req: &RdmaRequest<'_>) -> Result<PostStatus, DomainError> {
        self.accept(Op::Rdma {
            wr_id: req.wr_id,
            peer: req.peer.clone(),
            shape: shape_of(req),
        })
    }

    /// Lands each run of `requests` that [`same_batch`] groups as one batch (inline only).
    fn land_list(
        &mut self,
        requests: &[RdmaRequest<'_>],
    ) -> (usize, Result<PostStatus, DomainError>) {
        let mut posted = 0;
        while let Some(first) = requests.get(posted) {
            let run = requests[posted..]
                .iter()
                .take_while(|r| same_batch(first, r))
                .count();
            let (accepted, status) = self.land_run(first, run, |accepted| {
                Listed(&requests[posted..posted + accepted])
            });
            posted += accepted;
            if accepted < run {
                return (posted, status);
            }
        }
        (posted, Ok(PostStatus::Posted))
    }
}

/// Whether `other` can land in one batch with `first` (see `rdma::Batch`): everything the
/// batch checks once (`prepare`, the keys) is the same for both.
fn same_batch(first: &RdmaRequest<'_>, other: &RdmaRequest<'_>) -> bool {
    first.is_read() == other.is_read()
        && first.imm().is_some() == other.imm().is_some()
        && (
            first.local_key,
            first.remote_key,
            first.remote_base,
            first.len,
        ) == (
            other.local_key,
            other.remote_key,
            other.remote_base,
            other.len,
        )
        && first.peer == other.peer
}

/// What a request names, at offset 0 of both ranges.
fn shape_of(req: &RdmaRequest<'_>) -> RdmaShape {
    RdmaShape {
        op: req.op,
        local: (req.local_addr, req.local_key),
        remote: (req.remote_addr, req.remote_key, req.remote_base),
        len: req.len,
    }
}

impl Domain for MockDomain {
    fn address(&self) -> NetAddr {
        self.nic.addr.clone()
    }

    fn register(&mut self, region: &MemoryRegion) -> Result<Registration, DomainError> {
        self.check_alive()?;
        if self.options.host_memory_only && region.device != Device::Host {
            return Err(DomainError::new(
                DomainErrorKind::Fatal,
                "the engine registered device memory with a mock that declared host memory only",
            ));
        }
        if self.options.register_delay_us > 0 {
            std::thread::sleep(Duration::from_micros(self.options.register_delay_us));
        }
        let local_key = fabric::new_key();
        // GPU memory (checked by the engine with the CUDA driver) is copied with the driver.
        let r = Region {
            ptr: region.ptr,
            len: region.len,
            gpu: region.device != Device::Host,
            owner: local_key,
            remote_write: region.remote_write,
            remote_read: region.remote_read,
        };
        let remote = region.remote_write || region.remote_read;
        let remote_key = if remote { fabric::new_key() } else { 0 };
        let mut regions = self.nic.regions.write().unwrap_or_else(|p| p.into_inner());
        regions.local.insert(local_key, r);
        if remote {
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
        // Only this registration's remote key goes; another registration of the same range
        // keeps its own.
        regions.remote.retain(|_, r| r.owner != region.owner);
        Ok(())
    }

    /// An inline mock lands the pages of a batch, and each run of a list's requests that
    /// share a peer and a shape but for their addresses, ids and immediates, as one batch:
    /// under one hold of each lock, checking what they share once. Otherwise (delayed,
    /// reordered) each request is scheduled on its own. Every request still counts as a post
    /// (for fault injection) and takes its place in the queue.
    fn post_rdma(&mut self, post: RdmaPost<'_>) -> (usize, Result<PostStatus, DomainError>) {
        // Fault injection counts posts one by one: a post it could touch is posted so.
        if !self.options.inline || self.faults_within(post.len() as u64) {
            return post_one_by_one(post, |r| self.post_one(r));
        }
        match post {
            RdmaPost::Pages { template, shifts } if !shifts.is_empty() => {
                self.land_run(&template, shifts.len(), |accepted| Pages {
                    wr_id: template.wr_id,
                    imm: template.imm(),
                    shifts: &shifts[..accepted],
                })
            }
            RdmaPost::List(requests) => self.land_list(requests),
            one_or_newer => post_one_by_one(one_or_newer, |r| self.post_one(r)),
        }
    }

    fn capabilities(&self) -> Capabilities {
        self.capabilities
    }

    fn post_send(
        &mut self,
        wr_id: u64,
        peer: &NetAddr,
        data: &[u8],
    ) -> Result<PostStatus, DomainError> {
        if self.options.lose_send_completions {
            self.lost_sends.insert(wr_id);
        }
        self.accept(Op::Send {
            wr_id,
            peer: peer.clone(),
            data: data.to_vec(),
        })
    }

    fn post_recvs(&mut self, buf_len: usize, count: usize) -> Result<(), DomainError> {
        self.check_alive()?;
        if buf_len == 0 {
            return Err(DomainError::new(
                DomainErrorKind::InvalidArgument,
                "receive buffers of 0 bytes",
            ));
        }
        self.nic.inbox().recv_buffers.extend(std::iter::repeat_n(
            buf_len,
            count * self.options.receives_multiplier.max(1),
        ));
        self.nic.match_waiting_sends();
        Ok(())
    }

    fn poll(&mut self, events: &mut Vec<Event>) -> Result<(), DomainError> {
        let start = events.len();
        fabric::move_events(events, &mut self.nic.inbox().events);
        if self.options.lose_immediates {
            let mut kept = events.split_off(start);
            kept.retain(|e| !matches!(e, Event::ImmArrival { .. }));
            events.append(&mut kept);
        }
        if !self.lost_sends.is_empty() {
            let mut kept = events.split_off(start);
            kept.retain(
                |e| !matches!(e, Event::Done { wr_id, .. } if self.lost_sends.remove(wr_id)),
            );
            events.append(&mut kept);
        }
        if self.options.duplicate_completions {
            let twice: Vec<Event> = events[start..]
                .iter()
                .filter_map(|e| match e {
                    Event::Done { wr_id, result } => Some(Event::Done {
                        wr_id: *wr_id,
                        result: result.clone(),
                    }),
                    _ => None,
                })
                .collect();
            events.extend(twice);
        }
        if self.options.reorder {
            self.rng.shuffle(&mut events[start..]);
        }
        Ok(())
    }

    fn set_waker(&mut self, waker: Waker) -> bool {
        if !self.options.silent_waker {
            self.nic.set_waker(waker);
        }
        true
    }
}

impl Drop for MockDomain {
    fn drop(&mut self) {
        fabric::leave(&self.nic);
        if self.options.panic_on_close {
            panic!(
                "mock NIC {}: injected panic while closing (panic_on_close)",
                self.nic.addr
            );
        }
    }
}
