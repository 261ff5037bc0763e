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

/// The `[metrics] listen` endpoint: `GET /metrics` answers with [`encode`] of a fresh
/// snapshot; anything else is 404. Stops with the engine.
pub(crate) struct Endpoint {
    server: Arc<tiny_http::Server>,
    thread: Option<JoinHandle<()>>,
}

impl Endpoint {
    pub(crate) fn start(listen: &str, shared: Weak<Shared>) -> Result<Self> {
        let server = tiny_http::Server::http(listen)
            .map(Arc::new)
            .map_err(|e| Error::InvalidArgument(format!("[metrics] listen = {listen:?}: {e}")))?;
        tracing::info!(listen, "serving metrics at /metrics");
        let serving = Arc::clone(&server);
        let thread = std::thread::Builder::new()
            .name("xfer-metrics".into())
            .spawn(move || {
                for request in serving.incoming_requests() {
                    let response = match (request.method(), request.url()) {
                        (tiny_http::Method::Get, "/metrics") => {
                            match shared.upgrade().map(|s| s.stats()) {
                                Some(Ok(stats)) => tiny_http::Response::from_string(encode(&stats))
                                    .with_header(
                                        "Content-Type: application/openmetrics-text; version=1.0.0; charset=utf-8"
                                            .parse::<tiny_http::Header>()
                                            .expect("a valid header"),
                                    ),
                                Some(Err(e)) => tiny_http::Response::from_string(e.to_string())
                                    .with_status_code(503),
                                None => tiny_http::Response::from_string("the engine is closed")
                                    .with_status_code(503),
                            }
                        }
                        _ => tiny_http::Response::from_string("not found: try /metrics")
                            .with_status_code(404),
                    };
                    let _ = request.respond(response);
                }
            })
            .map_err(|e| Error::InvalidArgument(format!("cannot start the metrics thread: {e}")))?;
        Ok(Self {
            server,
            thread: Some(thread),
        })
    }

    /// Where it listens (for a `:0` port).
    pub(crate) fn addr(&self) -> Option<std::net::SocketAddr> {
        self.server.server_addr().to_ip()
    }
}

impl Drop for Endpoint {
    fn drop(&mut self) {
        self.server.unblock();
        if let Some(t) = self.thread.take() {
            let _ = t.join();
        }
    }
}
