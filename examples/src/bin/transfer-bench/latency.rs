//! Write-with-immediate ping-pong: answered by application threads, or on the worker itself
//! (`--reactive`), and the percentiles of the one-way time.

use super::*;

/// Which side of the `--reactive` ping-pong an arrival is for.
#[derive(Debug, Clone, Copy)]
pub(crate) enum Side {
    /// The pinger: a PONG arrived.
    A,
    /// The answerer: a PING arrived.
    B,
}

/// What the wakers of `--latency --reactive` share. Engines are held weakly and buffers by
/// handle: a waker runs on a worker and may hold the last reference to this, and dropping an
/// engine or a buffer there would wait for that same worker.
pub(crate) struct Reactive {
    a: std::sync::Weak<TransferEngine>,
    b: std::sync::Weak<TransferEngine>,
    /// A's source and B's target of each PING; B's source and A's target of each PONG.
    ping: (engine_core::MrHandle, MrDesc),
    pong: (engine_core::MrHandle, MrDesc),
    warmup: u64,
    total: u64,
    answered: AtomicU64,
    received: AtomicU64,
    started: std::sync::Mutex<Instant>,
    samples: std::sync::Mutex<Vec<f64>>,
    sent: Arc<DoneCounter>,
    end: std::sync::mpsc::SyncSender<Result<(), String>>,
}

pub(crate) const PING: u32 = 0x7a11;

pub(crate) const PONG: u32 = 0x7a12;

impl Reactive {
    /// Expects the next arrival for `side`; its flag's waker calls [`arrived`](Self::arrived).
    fn arm(self: &Arc<Self>, side: Side) {
        let state = Arc::clone(self);
        let flag = engine_core::DoneFlag::with_flag_waker(move |flag| match flag.result() {
            Some(Ok(())) => state.arrived(side),
            other => state.finish(Err(format!("{side:?}'s expectation ended: {other:?}"))),
        });
        let (engine, imm) = match side {
            Side::A => (&self.a, PONG),
            Side::B => (&self.b, PING),
        };
        let armed = engine
            .upgrade()
            .ok_or_else(|| "the engine is gone".to_owned())
            .and_then(|e| e.expect_imm_count(imm, 1, flag).map_err(|e| e.to_string()));
        if let Err(e) = armed {
            self.finish(Err(format!("arming {side:?}: {e}")));
        }
    }

    fn arrived(self: &Arc<Self>, side: Side) {
        match side {
            Side::B => {
                if self.answered.fetch_add(1, Ordering::SeqCst) + 1 < self.total {
                    self.arm(Side::B);
                }
                self.write(&self.b, PONG, &self.pong);
            }
            Side::A => {
                let elapsed = self
                    .started
                    .lock()
                    .unwrap_or_else(|p| p.into_inner())
                    .elapsed();
                let n = self.received.fetch_add(1, Ordering::SeqCst) + 1;
                if n > self.warmup {
                    self.samples
                        .lock()
                        .unwrap_or_else(|p| p.into_inner())
                        .push(elapsed.as_secs_f64() * 1e6 / 2.0);
                }
                if n == self.total {
                    self.finish(Ok(()));
                } else {
                    self.ping();
                }
            }
        }
    }

    fn ping(self: &Arc<Self>) {
        self.arm(Side::A);
        *self.started.lock().unwrap_or_else(|p| p.into_inner()) = Instant::now();
        self.write(&self.a, PING, &self.ping);
    }

    fn write(
        &self,
        engine: &std::sync::Weak<TransferEngine>,
        imm: u32,
        (src, dst): &(engine_core::MrHandle, MrDesc),
    ) {
        let submitted = engine
            .upgrade()
            .ok_or_else(|| "the engine is gone".to_owned())
            .and_then(|e| {
                e.submit_single_write(8, Some(imm), (*src, 0), (dst, 0), self.sent.clone())
                    .map_err(|e| e.to_string())
            });
        if let Err(e) = submitted {
            self.finish(Err(format!("submitting {imm:#x}: {e}")));
        }
    }

    fn finish(&self, outcome: Result<(), String>) {
        let _ = self.end.try_send(outcome);
    }
}

/// `--latency N --reactive`: the ping-pong of [`latency()`], answered on the workers.
pub(crate) fn latency_reactive(config: &Config, iterations: u64) -> Result<Latency, BoxError> {
    let pair = Pair::open(config, 64)?;
    let back = HostBuffer::with_access(&pair.a, 64, |_| 0, RemoteAccess::READ_WRITE)?;
    let b_src = HostBuffer::new(&pair.b, 64)?;
    let warmup = (iterations / 10).max(10);
    let (end, ended) = std::sync::mpsc::sync_channel(1);
    let state = Arc::new(Reactive {
        a: Arc::downgrade(&pair.a),
        b: Arc::downgrade(&pair.b),
        ping: (pair.src.mr(), pair.dst.desc().clone()),
        pong: (b_src.mr(), back.desc().clone()),
        warmup,
        total: warmup + iterations,
        answered: AtomicU64::new(0),
        received: AtomicU64::new(0),
        started: std::sync::Mutex::new(Instant::now()),
        samples: std::sync::Mutex::new(Vec::with_capacity(iterations as usize)),
        sent: DoneCounter::new(),
        end,
    });
    state.arm(Side::B);
    state.ping();
    let outcome = ended
        .recv_timeout(Duration::from_secs(60))
        .map_err(|_| "the ping-pong did not finish within 60 s".to_owned())?;
    outcome?;
    if let Some(e) = state.sent.first_error() {
        return Err(format!("a ping-pong write failed: {e}").into());
    }
    let mut samples = std::mem::take(&mut *state.samples.lock().unwrap_or_else(|p| p.into_inner()));
    latency_figures(iterations, &mut samples)
}

/// p50, p99 and the minimum of one-way samples.
pub(crate) fn latency_figures(iterations: u64, samples: &mut [f64]) -> Result<Latency, BoxError> {
    if samples.is_empty() {
        return Err("no latency samples".into());
    }
    samples.sort_by(f64::total_cmp);
    let at = |q: f64| samples[((samples.len() - 1) as f64 * q).round() as usize];
    Ok(Latency {
        iterations,
        latency_us_p50: at(0.5),
        latency_us_p99: at(0.99),
        latency_us_min: samples[0],
    })
}

/// One-way latency figures of `--latency`, in microseconds.
#[derive(Debug, Serialize)]
pub(crate) struct Latency {
    pub(crate) iterations: u64,
    pub(crate) latency_us_p50: f64,
    pub(crate) latency_us_p99: f64,
    pub(crate) latency_us_min: f64,
}

/// `--latency N`: 8-byte write-with-immediate ping-pongs. B waits for A's next arrival (an
/// `expect_imm_count` of one) and answers; A times each round trip until B's answer arrives,
/// as an application would wait for arrivals.
pub(crate) fn latency(config: &Config, iterations: u64) -> Result<Latency, BoxError> {
    let pair = Pair::open(config, 64)?;
    let back = HostBuffer::with_access(&pair.a, 64, |_| 0, RemoteAccess::READ_WRITE)?;
    let b_src = HostBuffer::new(&pair.b, 64)?;
    let warmup = (iterations / 10).max(10);
    let total = warmup + iterations;
    let stop = std::sync::atomic::AtomicBool::new(false);
    // Each side waits for the next arrival with an expectation (it consumes one arrival)
    // through `TransferEngine::wait`: it looks without sleeping for up to
    // `worker.wait_poll_us`, and then sleeps.
    let wait_one = |engine: &TransferEngine, imm: u32| -> Result<(), BoxError> {
        if stop.load(std::sync::atomic::Ordering::Relaxed) {
            return Err("the other side stopped".into());
        }
        let arrived = engine_core::DoneFlag::new();
        engine.expect_imm_count(imm, 1, arrived.clone())?;
        // Looking for `worker.wait_poll_us` first, then asleep on the flag.
        engine.wait(&arrived, Duration::from_secs(10))?;
        Ok(())
    };
    let (a_sent, b_sent) = (DoneCounter::new(), DoneCounter::new());
    let mut samples = Vec::with_capacity(iterations as usize);
    std::thread::scope(|scope| -> Result<(), BoxError> {
        let answerer = scope.spawn(|| -> Result<(), String> {
            for _ in 1..=total {
                wait_one(&pair.b, PING).map_err(|e| e.to_string())?;
                pair.b
                    .submit_single_write(
                        8,
                        Some(PONG),
                        (b_src.mr(), 0),
                        (back.desc(), 0),
                        b_sent.clone(),
                    )
                    .map_err(|e| e.to_string())?;
            }
            Ok(())
        });
        let pinged = (|| -> Result<(), BoxError> {
            for i in 1..=total {
                let start = Instant::now();
                pair.a.submit_single_write(
                    8,
                    Some(PING),
                    (pair.src.mr(), 0),
                    (pair.dst.desc(), 0),
                    a_sent.clone(),
                )?;
                wait_one(&pair.a, PONG)?;
                if i > warmup {
                    samples.push(start.elapsed().as_secs_f64() * 1e6 / 2.0);
                }
            }
            Ok(())
        })();
        if pinged.is_err() {
            stop.store(true, std::sync::atomic::Ordering::Relaxed);
        }
        let answered = answerer
            .join()
            .map_err(|_| "the answering thread panicked")?;
        pinged?;
        answered.map_err(Into::into)
    })?;
    if let Some(e) = a_sent.first_error().or_else(|| b_sent.first_error()) {
        return Err(format!("a ping-pong write failed: {e}").into());
    }
    latency_figures(iterations, &mut samples)
}
