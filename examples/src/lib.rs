//! Shared set-up for the example workloads: engines on the configured backend (the in-process
//! mock by default) with a chosen NIC count.
#![forbid(unsafe_code)]

use std::sync::Arc;

use engine_core::{Config, TransferEngine};

/// Engines on `$XFER_CONFIG` (default: the mock), with the first group's NIC count set to
/// `nics` when the backend is the mock.
pub fn open_engines(
    count: usize,
    nics: usize,
) -> Result<Vec<Arc<TransferEngine>>, engine_core::Error> {
    backend_mock::link();
    let mut config = Config::load(None)?;
    if config.backend == "mock" {
        config.groups[0].nics = (0..nics).map(|i| format!("mock{i}")).collect();
    }
    (0..count)
        .map(|_| TransferEngine::open(&config).map(Arc::new))
        .collect()
}

/// A byte that depends on every index it is given, to tell any two pages or tensors apart.
pub fn byte(a: usize, b: usize, c: usize) -> u8 {
    (a.wrapping_mul(131) ^ b.wrapping_mul(31) ^ c.wrapping_mul(7)) as u8
}

/// Exits non-zero with a message: the examples check their own results.
/// Logs to stderr, filtered by `RUST_LOG` (warnings and errors when unset): a process
/// waiting for its rendezvous service says so. Calling it twice is harmless.
pub fn init_logging() {
    let filter = tracing_subscriber::EnvFilter::try_from_default_env()
        .unwrap_or_else(|_| tracing_subscriber::EnvFilter::new("warn"));
    let _ = tracing_subscriber::fmt()
        .with_env_filter(filter)
        .with_writer(std::io::stderr)
        .with_ansi(std::io::IsTerminal::is_terminal(&std::io::stderr()))
        .try_init();
}

pub fn fail(message: impl std::fmt::Display) -> ! {
    eprintln!("FAILED: {message}");
    std::process::exit(1)
}

/// The value following `--flag` on the command line.
pub fn arg(flag: &str) -> Option<String> {
    let args: Vec<String> = std::env::args().collect();
    args.iter()
        .position(|a| a == flag)
        .and_then(|i| args.get(i + 1).cloned())
}

/// One process of a multi-process run: `--rank N --world W [--rendezvous URL] [--config
/// FILE]`. Its engine (on the config's backend) and the rendezvous it meets the others
/// through (`--rendezvous`, else the config's `[rendezvous] url`).
pub struct Member {
    /// This process's engine.
    pub engine: Arc<TransferEngine>,
    /// Where the processes find each other.
    pub rendezvous: xfer_rendezvous::Rendezvous,
    /// Lease of what this process publishes.
    pub ttl: std::time::Duration,
    /// This process's rank.
    pub rank: usize,
    /// How many processes take part.
    pub world: usize,
}

impl Member {
    /// `Some` when `--rank` was given (the multi-process mode), `None` otherwise.
    pub fn from_args() -> Option<Member> {
        let rank: usize = arg("--rank")?.parse().unwrap_or_else(|_| fail("--rank N"));
        let world: usize = arg("--world")
            .and_then(|w| w.parse().ok())
            .unwrap_or_else(|| fail("--world W is required with --rank"));
        if rank >= world {
            fail(format!("--rank {rank} is not below --world {world}"));
        }
        backend_mock::link();
        init_logging();
        let mut config = Config::load(arg("--config").as_deref().map(std::path::Path::new))
            .unwrap_or_else(|e| fail(e));
        // Several busy processes may share a couple of cores (as in CI): deadlines for the
        // whole run, not for one transfer on an idle machine.
        config.timeouts.transfer_ms = config.timeouts.transfer_ms.max(60_000);
        config.timeouts.expect_ms = config.timeouts.expect_ms.max(60_000);
        let engine = Arc::new(TransferEngine::open(&config).unwrap_or_else(|e| fail(e)));
        let (rendezvous, ttl) = match arg("--rendezvous") {
            Some(url) => (
                xfer_rendezvous::Rendezvous::connect_within(
                    &url,
                    xfer_rendezvous::connect_wait(&config),
                )
                .unwrap_or_else(|e| fail(e)),
                std::time::Duration::from_secs(5),
            ),
            None => xfer_rendezvous::Rendezvous::from_config(&config).unwrap_or_else(|e| fail(e)),
        };
        Some(Member {
            engine,
            rendezvous,
            ttl,
            rank,
            world,
        })
    }
}
