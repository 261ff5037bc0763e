//! The raw Domain contract, without an engine in between: posted receives, an immediate after its data, the waker.

use super::*;

/// Two raw Domains of the harness's backend on its first NIC, driven here without an engine:
/// what the engine would smooth over (a late repost, a worker that polls anyway) shows.
struct RawPair {
    a: Box<dyn engine_core::domain::Domain>,
    b: Box<dyn engine_core::domain::Domain>,
    a_events: Vec<engine_core::domain::Event>,
    b_events: Vec<engine_core::domain::Event>,
    /// The suite's short deadline (`quick_config`'s transfer timeout).
    deadline: Duration,
}

impl RawPair {
    fn open(h: &dyn Harness) -> Self {
        let config = quick_config(h, 1);
        let backend = engine_core::plugin::find_backend(&config.backend, config.plugin.as_deref())
            .unwrap_or_else(|e| panic!("cannot find the backend: {e}"));
        let options = config.backend_options();
        let nic = &config.groups[0].nics[0];
        let open = || {
            backend
                .open(&engine_core::domain::DomainConfig {
                    nic,
                    options: &options,
                })
                .unwrap_or_else(|e| panic!("cannot open NIC {nic}: {e}"))
        };
        Self {
            a: open(),
            b: open(),
            a_events: Vec::new(),
            b_events: Vec::new(),
            deadline: config.timeouts.transfer(),
        }
    }

    fn poll(&mut self, poll_b: bool) {
        self.a.poll(&mut self.a_events).expect("polling the sender");
        if poll_b {
            self.b
                .poll(&mut self.b_events)
                .expect("polling the receiver");
        }
    }

    /// Polls both until `done` holds, for at most `limit`; returns whether it held.
    fn poll_until(&mut self, limit: Duration, done: impl Fn(&Self) -> bool) -> bool {
        let until = Instant::now() + limit;
        while Instant::now() < until {
            self.poll(true);
            if done(self) {
                return true;
            }
            std::thread::yield_now();
        }
        done(self)
    }

    fn messages(&self) -> Vec<Vec<u8>> {
        self.b_events
            .iter()
            .filter_map(|e| match e {
                engine_core::domain::Event::Message { data, .. } => Some(data.clone()),
                _ => None,
            })
            .collect()
    }

    fn register(
        domain: &mut dyn engine_core::domain::Domain,
        mem: &mut [u8],
    ) -> engine_core::domain::Registration {
        domain
            .register(&engine_core::domain::MemoryRegion {
                ptr: mem.as_mut_ptr() as u64,
                len: mem.len() as u64,
                device: Device::Host,
                remote_write: true,
                remote_read: false,
            })
            .unwrap_or_else(|e| panic!("registering {} bytes failed: {e}", mem.len()))
    }

    /// Posts a write of all of `src` (registered as `src_reg` on a) into `dst` (b's
    /// registration `dst_reg`), retrying while the queue is full.
    fn write(
        &mut self,
        src: &[u8],
        src_reg: engine_core::domain::Registration,
        dst: &[u8],
        dst_reg: engine_core::domain::Registration,
        imm: u32,
    ) {
        let peer = self.b.address();
        let wr = engine_core::domain::RdmaRequest {
            wr_id: 1,
            op: engine_core::domain::RdmaOp::Write { imm: Some(imm) },
            peer: &peer,
            local_addr: src.as_ptr() as u64,
            local_key: src_reg.local_key,
            remote_addr: dst.as_ptr() as u64,
            remote_key: dst_reg.remote_key,
            remote_base: dst.as_ptr() as u64,
            len: src.len() as u64,
        };
        let until = Instant::now() + WAIT;
        while self
            .a
            .post_rdma(engine_core::domain::RdmaPost::One(wr))
            .1
            .expect("posting a write")
            == engine_core::domain::PostStatus::Busy
        {
            assert!(Instant::now() < until, "the sender stayed busy");
            self.poll(true);
        }
    }
}

/// Messages land only in receive buffers the engine posted: with one buffer posted and two
/// messages sent, one arrives; the second waits until a buffer is posted again, then arrives.
/// A backend that ignores `post_recvs` (delivering into buffers of its own) fails here — on a
/// real NIC that is a receiver-not-ready stall or a dropped message the engine never sees.
pub fn messages_use_posted_receives(h: &dyn Harness) {
    let mut pair = RawPair::open(h);
    pair.b
        .post_recvs(64, 1)
        .expect("posting one receive buffer");
    let peer = pair.b.address();
    for (id, text) in [(1u64, &b"first"[..]), (2, b"second")] {
        let until = Instant::now() + WAIT;
        while pair.a.post_send(id, &peer, text).expect("posting a send")
            == engine_core::domain::PostStatus::Busy
        {
            assert!(Instant::now() < until, "the sender stayed busy");
            pair.poll(true);
        }
    }
    assert!(
        pair.poll_until(WAIT, |p| !p.messages().is_empty()),
        "no message arrived in the posted buffer"
    );
    // Long enough for a second message to show up if it had somewhere to go.
    pair.poll_until(Duration::from_millis(300), |p| p.messages().len() > 1);
    assert_eq!(
        pair.messages().len(),
        1,
        "two messages arrived with one receive buffer posted: the backend ignores post_recvs"
    );
    pair.b
        .post_recvs(64, 1)
        .expect("posting a second receive buffer");
    assert!(
        pair.poll_until(WAIT, |p| p.messages().len() == 2),
        "the second message never arrived after a buffer was posted"
    );
    let mut got = pair.messages();
    got.sort();
    assert_eq!(got, vec![b"first".to_vec(), b"second".to_vec()]);
}

/// An immediate is reported only once its write's data is in the receiver's memory: checked
/// the moment the arrival event is seen, on a write large enough to take a while.
pub fn immediate_arrives_after_its_data(h: &dyn Harness) {
    let mut pair = RawPair::open(h);
    let len = 1 << 20;
    let mut src: Vec<u8> = (0..len).map(pattern(91)).collect();
    let mut dst = vec![0u8; len];
    let src_reg = RawPair::register(&mut *pair.a, &mut src);
    let dst_reg = RawPair::register(&mut *pair.b, &mut dst);
    pair.write(&src, src_reg, &dst, dst_reg, 4242);
    let arrived = |p: &RawPair| {
        p.b_events
            .iter()
            .any(|e| matches!(e, engine_core::domain::Event::ImmArrival { imm: 4242, .. }))
    };
    assert!(
        pair.poll_until(WAIT, arrived),
        "the immediate never arrived"
    );
    // `dst` is ours; the NIC is done with these bytes once their immediate arrived.
    assert_copied("data at the moment its immediate arrived", &dst, &src);
    pair.poll_until(WAIT, |p| {
        p.a_events
            .iter()
            .any(|e| matches!(e, engine_core::domain::Event::Done { .. }))
    });
    let _ = pair.a.deregister(src_reg.local_key);
    let _ = pair.b.deregister(dst_reg.local_key);
}

/// A Domain that promises to wake the engine (`set_waker` returns true) calls the waker when
/// an arrival is ready, without being polled first; an engine trusting the promise parks.
pub fn a_promised_waker_is_called(h: &dyn Harness) {
    let mut pair = RawPair::open(h);
    let woken = Arc::new(std::sync::atomic::AtomicBool::new(false));
    let w = Arc::clone(&woken);
    let will_wake = pair.b.set_waker(engine_core::domain::Waker::new(move || {
        w.store(true, Ordering::SeqCst)
    }));
    if !will_wake {
        return; // it will be polled on an interval instead; nothing was promised
    }
    let mut src = vec![5u8; 4096];
    let mut dst = vec![0u8; 4096];
    let src_reg = RawPair::register(&mut *pair.a, &mut src);
    let dst_reg = RawPair::register(&mut *pair.b, &mut dst);
    // Set-up work may have woken it already; only what follows the write counts.
    pair.poll(true);
    pair.b_events.clear();
    woken.store(false, Ordering::SeqCst);
    pair.write(&src, src_reg, &dst, dst_reg, 5151);
    let until = Instant::now() + pair.deadline;
    while !woken.load(Ordering::SeqCst) && Instant::now() < until {
        pair.poll(false); // the sender only: the receiver must wake us by itself
        std::thread::yield_now();
    }
    assert!(
        woken.load(Ordering::SeqCst),
        "set_waker returned true, but the Domain never called the waker for an arrival"
    );
    assert!(
        pair.poll_until(WAIT, |p| p.b_events.iter().any(|e| matches!(
            e,
            engine_core::domain::Event::ImmArrival { imm: 5151, .. }
        ))),
        "woken, but the arrival never came"
    );
    let _ = pair.a.deregister(src_reg.local_key);
    let _ = pair.b.deregister(dst_reg.local_key);
}
