//! [`Stats`] in Prometheus' text exposition format (through `prometheus-client`), and the
//! optional HTTP endpoint that serves it (`[metrics] listen = "127.0.0.1:9464"`).
//!
//! Each scrape asks the worker for a fresh snapshot; nothing is counted twice and nothing
//! is kept between scrapes.

use std::sync::{Arc, Weak};
use std::thread::JoinHandle;

use prometheus_client::collector::Collector;
use prometheus_client::encoding::{DescriptorEncoder, EncodeMetric, NoLabelSet};
use prometheus_client::metrics::counter::ConstCounter;
use prometheus_client::metrics::gauge::ConstGauge;
use prometheus_client::metrics::MetricType;
use prometheus_client::registry::Registry;

use crate::error::{Error, Result};
use crate::runtime::Shared;
use crate::stats::{Stats, LATENCY_BOUNDS_US};

/// `stats` as Prometheus text (OpenMetrics flavour, as `prometheus-client` writes it).
pub fn encode(stats: &Stats) -> String {
    let mut registry = Registry::default();
    registry.register_collector(Box::new(Snapshot(stats.clone())));
    let mut out = String::new();
    prometheus_client::encoding::text::encode(&mut out, &registry)
        .expect("writing to a String cannot fail");
    out
}

#[derive(Debug)]
struct Snapshot(Stats);

/// One metric family: `(labels, value)` samples of counters.
fn counters(
    encoder: &mut DescriptorEncoder,
    name: &str,
    help: &str,
    samples: impl IntoIterator<Item = (Vec<(&'static str, String)>, u64)>,
) -> std::fmt::Result {
    let mut family = encoder.encode_descriptor(name, help, None, MetricType::Counter)?;
    for (labels, value) in samples {
        ConstCounter::new(value).encode(family.encode_family(&labels)?)?;
    }
    Ok(())
}

fn counter(
    encoder: &mut DescriptorEncoder,
    name: &str,
    help: &str,
    value: u64,
) -> std::fmt::Result {
    let metric = ConstCounter::new(value);
    metric.encode(encoder.encode_descriptor(name, help, None, metric.metric_type())?)
}

impl Collector for Snapshot {
    fn encode(&self, mut e: DescriptorEncoder) -> std::fmt::Result {
        let s = &self.0;
        let kind = |k: &crate::stats::OpKind| vec![("kind", k.name().to_owned())];
        counters(
            &mut e,
            "xfer_operations_started",
            "Operations the worker accepted",
            s.ops.iter().map(|(k, o)| (kind(k), o.started)),
        )?;
        counters(
            &mut e,
            "xfer_operations_completed",
            "Operations that completed successfully",
            s.ops.iter().map(|(k, o)| (kind(k), o.completed)),
        )?;
        counters(
            &mut e,
            "xfer_operations_failed",
            "Operations that failed, by error kind",
            s.ops.iter().flat_map(|(k, o)| {
                o.failed.iter().map(move |(err, n)| {
                    (
                        vec![("kind", k.name().to_owned()), ("error", (*err).to_owned())],
                        *n,
                    )
                })
            }),
        )?;
        counters(
            &mut e,
            "xfer_bytes",
            "Bytes of successfully completed operations",
            s.ops.iter().map(|(k, o)| (kind(k), o.bytes)),
        )?;
        counters(
            &mut e,
            "xfer_work_requests",
            "Work requests posted to NICs",
            s.ops.iter().map(|(k, o)| (kind(k), o.requests)),
        )?;
        for (name, help, histogram) in [
            (
                "xfer_operation_duration_seconds",
                "From submitting an operation to its completion",
                (|o: &crate::stats::OpStats| &o.latency) as fn(&_) -> &_,
            ),
            (
                "xfer_post_duration_seconds",
                "From submitting an operation to the worker handing it to the NICs",
                |o: &crate::stats::OpStats| &o.post_latency,
            ),
        ] {
            let mut family = e.encode_descriptor(name, help, None, MetricType::Histogram)?;
            for (k, o) in &s.ops {
                let h: &crate::stats::Histogram = histogram(o);
                // Per-bucket counts: the encoder makes them cumulative.
                let mut buckets: Vec<(f64, u64)> = LATENCY_BOUNDS_US
                    .iter()
                    .zip(&h.counts)
                    .map(|(&bound, &n)| (bound as f64 / 1e6, n))
                    .collect();
                buckets.push((f64::INFINITY, h.counts[LATENCY_BOUNDS_US.len()]));
                family
                    .encode_family(&kind(k))?
                    .encode_histogram::<NoLabelSet>(
                        h.sum_us as f64 / 1e6,
                        h.count(),
                        &buckets,
                        None,
                    )?;
            }
        }
        let peer = |a: &crate::wire::NetAddr| vec![("peer", a.to_string())];
        counters(
            &mut e,
            "xfer_peer_bytes",
            "Bytes posted to (or read from) each peer address",
            s.peers.iter().map(|(a, p)| (peer(a), p.bytes)),
        )?;
        counters(
            &mut e,
            "xfer_peer_work_requests",
            "Work requests posted to each peer address",
            s.peers.iter().map(|(a, p)| (peer(a), p.requests)),
        )?;
        counters(
            &mut e,
            "xfer_peer_failures",
            "Failed operations to each peer address",
            s.peers.iter().map(|(a, p)| (peer(a), p.failed)),
        )?;
        {
            let mut family = e.encode_descriptor(
                "xfer_peer_healthy",
                "1 unless the last operation to the peer alone that finished failed",
                None,
                MetricType::Gauge,
            )?;
            for (a, p) in &s.peers {
                ConstGauge::new(i64::from(p.healthy)).encode(family.encode_family(&peer(a))?)?;
            }
        }
        counter(
            &mut e,
            "xfer_stale_completions",
            "Completions for work requests not in flight (late after a timeout, or reported twice)",
            s.stale_completions,
        )?;
        counter(
            &mut e,
            "xfer_imm_arrivals",
            "Immediates that arrived",
            s.imm_arrivals,
        )?;
        counter(
            &mut e,
            "xfer_imm_dropped",
            "Arrivals dropped because the table of idle immediates was full",
            s.imm_dropped,
        )?;
        counter(
            &mut e,
            "xfer_notifications_dropped",
            "Notifications refused or dropped",
            s.notifications_dropped,
        )?;
        counter(
            &mut e,
            "xfer_registrations",
            "Successful registrations",
            s.registrations.registered,
        )?;
        counter(
            &mut e,
            "xfer_registered_bytes",
            "Bytes registered",
            s.registrations.bytes,
        )?;
        counter(
            &mut e,
            "xfer_registration_failures",
            "Registrations that failed",
            s.registrations.failed,
        )?;
        counter(
            &mut e,
            "xfer_deregistrations",
            "Deregistrations",
            s.registrations.deregistered,
        )?;
        counter(
            &mut e,
            "xfer_registration_cache_hits",
            "reg_mr calls served by a live registration covering them",
            s.registrations.cache_hits,
        )?;
        let secs = ConstCounter::new(s.registrations.time_us as f64 / 1e6);
        secs.encode(e.encode_descriptor(
            "xfer_registration_seconds",
            "Time spent registering",
            None,
            secs.metric_type(),
        )?)?;
        for (name, help, value) in [
            (
                "xfer_outstanding",
                "Operations accepted and not finished",
                s.outstanding,
            ),
            (
                "xfer_queued_requests",
                "Work requests held by the worker because their NIC's queue was full",
                s.queued_requests,
            ),
            (
                "xfer_imm_idle",
                "Immediates with arrivals nobody waits for yet",
                s.imm_idle,
            ),
            (
                "xfer_imm_owed",
                "Arrivals owed to expectations that timed out or were cancelled",
                s.imm_owed,
            ),
        ] {
            let gauge = ConstGauge::new(i64::try_from(value).unwrap_or(i64::MAX));
            gauge.encode(e.encode_descriptor(name, help, None, gauge.metric_type())?)?;
        }
        let nic = |i: usize| vec![("nic", i.to_string())];
        counters(
            &mut e,
            "xfer_nic_work_requests",
            "Work requests handed to each NIC of the group",
            s.nics.iter().enumerate().map(|(i, n)| (nic(i), n.requests)),
        )?;
        counters(
            &mut e,
            "xfer_nic_bytes",
            "Bytes of the work requests handed to each NIC",
            s.nics.iter().enumerate().map(|(i, n)| (nic(i), n.bytes)),
        )?;
        Ok(())
    }
}

/// How many connections the endpoint serves at once (one thread each), and how many accepted
/// ones may wait for a thread; a connection beyond both is closed at once. A scrape is one
/// short request: two threads serve any number of Prometheus servers.
const SERVING_THREADS: usize = 2;
const WAITING_CONNECTIONS: usize = 8;
/// The whole request (its line and headers) must arrive within this, and the answer be
/// taken within it: an idle or trickling connection holds a thread no longer.
const REQUEST_DEADLINE: std::time::Duration = std::time::Duration::from_secs(1);
/// The longest request read; a longer one is refused (a scrape's is a few hundred bytes).
const MAX_REQUEST: usize = 8 << 10;

/// The `[metrics] listen` endpoint: `GET /metrics` answers with [`encode`] of a fresh
/// snapshot; anything else is 404. Stops with the engine.
///
/// Bounded against careless or hostile clients (issue 56): one accepting thread and
/// [`SERVING_THREADS`] serving ones, whatever the number of connections (tiny_http, used
/// before, started a thread per connection and kept an idle one forever); each connection
/// gets [`REQUEST_DEADLINE`] for its request and is closed after its answer; connections that
/// find every thread busy and [`WAITING_CONNECTIONS`] waiting are closed unanswered. A flood
/// of idle connections can delay scrapes; it cannot exhaust threads or memory.
pub(crate) struct Endpoint {
    addr: std::net::SocketAddr,
    stop: Arc<std::sync::atomic::AtomicBool>,
    threads: Vec<JoinHandle<()>>,
}

impl Endpoint {
    pub(crate) fn start(listen: &str, shared: Weak<Shared>) -> Result<Self> {
        let refused = |e: std::io::Error| {
            Error::InvalidArgument(format!("[metrics] listen = {listen:?}: {e}"))
        };
        let listener = std::net::TcpListener::bind(listen).map_err(refused)?;
        let addr = listener.local_addr().map_err(refused)?;
        tracing::info!(listen, %addr, "serving metrics at /metrics");
        let stop = Arc::new(std::sync::atomic::AtomicBool::new(false));
        let (queue, waiting) =
            crossbeam_channel::bounded::<std::net::TcpStream>(WAITING_CONNECTIONS);
        let spawn_error = |e: std::io::Error| {
            Error::InvalidArgument(format!("cannot start the metrics thread: {e}"))
        };
        let mut threads = Vec::new();
        for i in 0..SERVING_THREADS {
            let (waiting, shared) = (waiting.clone(), shared.clone());
            threads.push(
                std::thread::Builder::new()
                    .name(format!("xfer-metrics-{i}"))
                    .spawn(move || {
                        for stream in waiting {
                            serve(stream, &shared);
                        }
                    })
                    .map_err(spawn_error)?,
            );
        }
        let stopping = Arc::clone(&stop);
        threads.push(
            std::thread::Builder::new()
                .name("xfer-metrics".into())
                .spawn(move || {
                    for stream in listener.incoming() {
                        if stopping.load(std::sync::atomic::Ordering::Acquire) {
                            break;
                        }
                        // Full: closed unanswered (dropped), never queued without bound.
                        if let Ok(stream) = stream {
                            let _ = queue.try_send(stream);
                        }
                    }
                    // Dropping `queue` ends the serving threads once they are done.
                })
                .map_err(spawn_error)?,
        );
        Ok(Self {
            addr,
            stop,
            threads,
        })
    }

    /// Where it listens (for a `:0` port).
    pub(crate) fn addr(&self) -> Option<std::net::SocketAddr> {
        Some(self.addr)
    }
}

/// Reads one request from `stream` (within [`REQUEST_DEADLINE`]) and answers it.
fn serve(mut stream: std::net::TcpStream, shared: &Weak<Shared>) {
    use std::io::Read;
    let deadline = std::time::Instant::now() + REQUEST_DEADLINE;
    let mut request = Vec::with_capacity(512);
    let mut chunk = [0u8; 1024];
    let head_end = loop {
        if let Some(end) = request.windows(4).position(|w| w == b"\r\n\r\n") {
            break end;
        }
        let left = deadline.saturating_duration_since(std::time::Instant::now());
        if left.is_zero() || request.len() > MAX_REQUEST {
            return;
        }
        // The deadline is for the whole request: each read waits only what is left of it.
        if stream.set_read_timeout(Some(left)).is_err() {
            return;
        }
        match stream.read(&mut chunk) {
            Ok(0) | Err(_) => return,
            Ok(n) => request.extend_from_slice(&chunk[..n]),
        }
    };
    let line = request[..head_end]
        .split(|&b| b == b'\r')
        .next()
        .unwrap_or(&[]);
    let mut words = line.split(|&b| b == b' ');
    let (status, content_type, body) = match (words.next(), words.next()) {
        (Some(b"GET"), Some(b"/metrics")) => match shared.upgrade().map(|s| s.stats()) {
            Some(Ok(stats)) => (
                "200 OK",
                "application/openmetrics-text; version=1.0.0; charset=utf-8",
                encode(&stats),
            ),
            Some(Err(e)) => ("503 Service Unavailable", "text/plain", e.to_string()),
            None => (
                "503 Service Unavailable",
                "text/plain",
                "the engine is closed".into(),
            ),
        },
        _ => (
            "404 Not Found",
            "text/plain",
            "not found: try /metrics".into(),
        ),
    };
    let head = format!(
        "HTTP/1.1 {status}\r\nContent-Type: {content_type}\r\nContent-Length: {}\r\nConnection: close\r\n\r\n",
        body.len()
    );
    let answer_deadline = std::time::Instant::now() + REQUEST_DEADLINE;
    let _ = write_before(
        &mut stream,
        &[head.as_bytes(), body.as_bytes()],
        answer_deadline,
    );
}

/// Writes `parts` in order, all of it by `deadline`. A socket write timeout bounds each
/// `write()`, and a client that takes a few bytes now and then lets every one succeed: so each
/// write waits only what is left of the deadline (review 56 M-E), and a client that has not
/// taken the answer by then is cut off.
fn write_before(
    stream: &mut std::net::TcpStream,
    parts: &[&[u8]],
    deadline: std::time::Instant,
) -> std::io::Result<()> {
    use std::io::{ErrorKind, Write};
    for part in parts {
        let mut rest = *part;
        while !rest.is_empty() {
            let left = deadline.saturating_duration_since(std::time::Instant::now());
            if left.is_zero() {
                return Err(ErrorKind::TimedOut.into());
            }
            stream.set_write_timeout(Some(left))?;
            match stream.write(rest) {
                Ok(0) => return Err(ErrorKind::WriteZero.into()),
                Ok(n) => rest = &rest[n..],
                // The timeout ran out (EAGAIN on Linux): the loop's check says so.
                Err(e)
                    if matches!(
                        e.kind(),
                        ErrorKind::Interrupted | ErrorKind::WouldBlock | ErrorKind::TimedOut
                    ) => {}
                Err(e) => return Err(e),
            }
        }
    }
    Ok(())
}

impl Drop for Endpoint {
    fn drop(&mut self) {
        self.stop.store(true, std::sync::atomic::Ordering::Release);
        // Wakes the accepting thread, which then sees `stop` (a wildcard address is reached
        // through loopback).
        let mut wake = self.addr;
        if wake.ip().is_unspecified() {
            wake.set_ip(match wake {
                std::net::SocketAddr::V4(_) => std::net::Ipv4Addr::LOCALHOST.into(),
                std::net::SocketAddr::V6(_) => std::net::Ipv6Addr::LOCALHOST.into(),
            });
        }
        let _ = std::net::TcpStream::connect_timeout(&wake, REQUEST_DEADLINE);
        for t in self.threads.drain(..).rev() {
            let _ = t.join();
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::io::Read;
    use std::time::{Duration, Instant};

    /// Review 56 M-E: a client that reads a few bytes at a time took an answer as long as it
    /// liked (each `write()` had its own timeout, and each one made progress). The answer now
    /// has one deadline: the writer gives up with the client still reading.
    #[test]
    fn a_trickling_reader_cannot_hold_an_answer_past_its_deadline() {
        let listener = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
        let mut client = std::net::TcpStream::connect(listener.local_addr().unwrap()).unwrap();
        let (mut server, _) = listener.accept().unwrap();
        let stop = Arc::new(std::sync::atomic::AtomicBool::new(false));
        let reading = Arc::clone(&stop);
        let reader = std::thread::spawn(move || {
            let mut taken = 0usize;
            let mut chunk = vec![0u8; 16 << 10];
            while !reading.load(std::sync::atomic::Ordering::Acquire) {
                match client.read(&mut chunk) {
                    Ok(0) | Err(_) => break,
                    Ok(n) => taken += n,
                }
                // A client that paces itself (about 800 KB/s: every write makes progress well
                // within a second); this pace is the attack, not a synchronisation.
                std::thread::sleep(Duration::from_millis(20));
            }
            taken
        });
        // Far more than loopback's socket buffers hold, so the writer depends on the reader.
        let body = vec![b'x'; 256 << 20];
        let (done, finished) = crossbeam_channel::bounded(1);
        let writer = std::thread::spawn(move || {
            let deadline = Instant::now() + Duration::from_millis(300);
            let _ = done.send(write_before(&mut server, &[b"head", &body], deadline));
        });
        // Not a timing assertion: a hang detector, two orders of magnitude past the deadline.
        let outcome = finished
            .recv_timeout(Duration::from_secs(60))
            .expect("the answer outlived its deadline while the client kept reading");
        assert_eq!(outcome.unwrap_err().kind(), std::io::ErrorKind::TimedOut);
        stop.store(true, std::sync::atomic::Ordering::Release);
        writer.join().unwrap();
        assert!(reader.join().unwrap() > 0, "the client read nothing");
    }
}
