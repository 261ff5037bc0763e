//! `xfer topo | info | doctor`: what the machine looks like to xfer, which backends it has,
//! and why a set-up would fail. Every command takes `--json`.

#![forbid(unsafe_code)]

use std::collections::BTreeMap;
use std::path::PathBuf;
use std::process::ExitCode;

use clap::{Parser, Subcommand};
use engine_core::plugin::{abi, find_backend, Backend, PLUGIN_PATH_ENV};
use engine_core::Config;
use serde::Serialize;
use xfer_topology::{self as topo, doctor};

#[derive(Parser)]
#[command(
    name = "xfer",
    about = "xfer: topology, backends and set-up diagnostics"
)]
struct Cli {
    #[command(subcommand)]
    command: Command,
    /// Print JSON.
    #[arg(long, global = true)]
    json: bool,
    /// Config file (else $XFER_CONFIG, else the built-in mock config).
    #[arg(long, global = true)]
    config: Option<PathBuf>,
    /// sysfs root to read (a fixture tree in tests).
    #[arg(long, global = true, default_value = "/sys")]
    sysfs: PathBuf,
    /// /dev root to check (tests).
    #[arg(long, global = true, default_value = "/dev", hide = true)]
    dev: PathBuf,
    /// /proc root to read (tests).
    #[arg(long, global = true, default_value = "/proc", hide = true)]
    proc: PathBuf,
}

mod conformance;

#[derive(Subcommand)]
enum Command {
    /// The GPU/NIC matrix like `nvidia-smi topo -m`, and the proposed groups and CPUs.
    Topo {
        /// Most NICs per group.
        #[arg(long, default_value_t = 4)]
        max_nics: usize,
    },
    /// Backends (built in and plugins), devices per backend, and the effective config.
    Info,
    /// Checks that would make transfers fail, each with its fix; exits 1 if any fails.
    Doctor {
        /// Bytes the application will register (checked against the memlock limit).
        #[arg(long, default_value_t = 1 << 30)]
        register_bytes: u64,
    },
    /// Runs the embedded rendezvous service (peers find each other by name) until killed.
    Serve {
        /// Address to listen on (keep tests on 127.0.0.1).
        #[arg(long, default_value = "127.0.0.1:7420")]
        listen: String,
        /// Once listening, write the service's URL to this file (created whole, by rename),
        /// so a script can wait for readiness instead of for a fixed time. The URL is also
        /// the first line on stdout.
        #[arg(long)]
        ready_file: Option<PathBuf>,
        /// Test knob: wait this long before listening, as a slow start would.
        #[arg(long, default_value_t = 0, hide = true)]
        delay_listen_ms: u64,
        /// A file holding the cluster secret that clients must prove (else
        /// `$XFER_SECRET_FILE`; without either, only loopback addresses may be served).
        #[arg(long)]
        secret_file: Option<PathBuf>,
        #[command(flatten)]
        limits: ServeLimits,
    },
    /// Lists the peers published on a rendezvous (xfer://host:port or etcd://host:port).
    Peers {
        /// The rendezvous URL.
        #[arg(long)]
        rendezvous: String,
        /// How long to wait for a service that is not up yet, in milliseconds.
        #[arg(long, default_value_t = 5_000)]
        wait_ms: u64,
        /// A file holding the cluster secret the service asks for (else `$XFER_SECRET_FILE`).
        #[arg(long)]
        secret_file: Option<PathBuf>,
    },
    /// Runs the backend conformance suite (a plugin's, or the config's backend): one line per
    /// check; exits 1 if any fails.
    Conformance {
        /// The plugin library to test (else the config's `plugin`/backend).
        #[arg(long)]
        plugin: Option<PathBuf>,
        /// The backend name the plugin serves (default: from its file name, `lib<name>.so`).
        #[arg(long)]
        backend: Option<String>,
        /// A NIC name to open (repeat for more NICs; default: the config's first group).
        #[arg(long = "nic")]
        nics: Vec<String>,
        /// Run only the checks whose name contains this (repeat for more; each must match
        /// at least one check).
        #[arg(long = "check")]
        checks: Vec<String>,
    },
}

/// The service's bounds (docs/security.md, "Rendezvous"), each defaulting to
/// `xfer_rendezvous::embedded::Limits::default()`.
#[derive(clap::Args, Debug)]
struct ServeLimits {
    /// Connections served at once.
    #[arg(long)]
    max_connections: Option<usize>,
    /// Of those, connections still in their greeting (a newer one takes the oldest's place).
    #[arg(long)]
    max_unauthenticated: Option<usize>,
    /// Of those, connections from one address.
    #[arg(long)]
    max_unauthenticated_per_source: Option<usize>,
    /// MiB the service holds for its clients' answers and watches at once.
    #[arg(long)]
    max_pending_mib: Option<usize>,
    /// Of those, MiB one connection holds.
    #[arg(long)]
    max_pending_mib_per_connection: Option<usize>,
}

impl ServeLimits {
    fn limits(&self) -> xfer_rendezvous::embedded::Limits {
        let mut l = xfer_rendezvous::embedded::Limits::default();
        let mib = |n: usize| n.saturating_mul(1 << 20);
        l.max_connections = self.max_connections.unwrap_or(l.max_connections);
        l.max_unauthenticated = self.max_unauthenticated.unwrap_or(l.max_unauthenticated);
        l.max_unauthenticated_per_source = self
            .max_unauthenticated_per_source
            .unwrap_or(l.max_unauthenticated_per_source);
        l.max_pending_bytes = self.max_pending_mib.map_or(l.max_pending_bytes, mib);
        l.max_pending_bytes_per_connection = self
            .max_pending_mib_per_connection
            .map_or(l.max_pending_bytes_per_connection, mib);
        l
    }
}

/// Logs to stderr, filtered by `RUST_LOG` (warnings and errors when unset), for the
/// rendezvous commands: a client waiting for its service says so.
fn init_logging() {
    let filter = tracing_subscriber::EnvFilter::try_from_default_env()
        .unwrap_or_else(|_| tracing_subscriber::EnvFilter::new("warn"));
    let _ = tracing_subscriber::fmt()
        .with_env_filter(filter)
        .with_writer(std::io::stderr)
        .with_ansi(std::io::IsTerminal::is_terminal(&std::io::stderr()))
        .try_init();
}

fn serve_cmd(
    listen: &str,
    ready_file: Option<&std::path::Path>,
    delay_ms: u64,
    secret_file: Option<&std::path::Path>,
    limits: xfer_rendezvous::embedded::Limits,
) -> ExitCode {
    init_logging();
    std::thread::sleep(std::time::Duration::from_millis(delay_ms));
    let started = xfer_rendezvous::Secret::from_file_or_env(secret_file)
        .and_then(|secret| xfer_rendezvous::Server::start_with(listen, limits, secret));
    match started {
        Ok(server) => {
            // Readiness: the URL on stdout (first line), so a script can start it with port 0
            // and read it, and in the ready file. Both only once the socket listens.
            println!("{}", server.url());
            if let Some(path) = ready_file {
                let partial = path.with_extension("partial");
                let written = std::fs::write(&partial, format!("{}\n", server.url()))
                    .and_then(|()| std::fs::rename(&partial, path));
                if let Err(e) = written {
                    eprintln!("xfer serve: cannot write {}: {e}", path.display());
                    return ExitCode::FAILURE;
                }
            }
            loop {
                std::thread::park();
            }
        }
        Err(e) => {
            eprintln!("xfer serve: {e}");
            ExitCode::FAILURE
        }
    }
}

fn peers_cmd(
    cli: &Cli,
    url: &str,
    wait_ms: u64,
    secret_file: Option<&std::path::Path>,
) -> ExitCode {
    init_logging();
    let wait = std::time::Duration::from_millis(wait_ms);
    let listing = xfer_rendezvous::Secret::from_file_or_env(secret_file)
        .and_then(|secret| {
            let options = xfer_rendezvous::ConnectOptions {
                wait,
                secret,
                ..Default::default()
            };
            xfer_rendezvous::Rendezvous::connect_with(url, &options)
        })
        .and_then(|r| r.list());
    match listing {
        Ok(records) => {
            if cli.json {
                let rows: Vec<serde_json::Value> = records
                    .iter()
                    .map(|r| {
                        serde_json::json!({
                            "name": r.name,
                            "incarnation": r.incarnation,
                            "addr": r.addr.to_string(),
                            "regions": r.regions.iter().map(|(n, d)| serde_json::json!({"name": n, "bytes": d.len()})).collect::<Vec<_>>(),
                        })
                    })
                    .collect();
                println!("{}", serde_json::Value::Array(rows));
            } else {
                for r in &records {
                    let regions: Vec<String> = r
                        .regions
                        .iter()
                        .map(|(n, d)| format!("{n} ({} bytes)", d.len()))
                        .collect();
                    println!(
                        "{}  {}  incarnation {:016x}  {}",
                        r.name,
                        r.addr,
                        r.incarnation,
                        regions.join(", ")
                    );
                }
                println!("{} peer(s) on {url}", records.len());
            }
            ExitCode::SUCCESS
        }
        Err(e) => {
            eprintln!("xfer peers: {e}");
            ExitCode::FAILURE
        }
    }
}

#[derive(Serialize)]
struct TopoReport {
    devices: Vec<String>,
    matrix: Vec<Vec<String>>,
    numa: Vec<Option<u32>>,
    groups: Vec<topo::GroupProposal>,
}

fn topo_cmd(cli: &Cli, max_nics: usize) -> ExitCode {
    let t = topo::sysfs::read(&cli.sysfs);
    let devices: Vec<String> = t
        .gpus
        .iter()
        .chain(&t.nics)
        .map(|d| d.name.clone())
        .collect();
    let matrix: Vec<Vec<String>> = topo::matrix(&t)
        .iter()
        .map(|r| r.iter().map(|l| l.to_string()).collect())
        .collect();
    let numa = t.gpus.iter().chain(&t.nics).map(|d| d.numa).collect();
    let report = TopoReport {
        devices,
        matrix,
        numa,
        groups: topo::propose(&t, max_nics.min(engine_core::wire::MAX_NICS)),
    };
    if cli.json {
        println!(
            "{}",
            serde_json::to_string_pretty(&report).expect("serializes")
        );
        return ExitCode::SUCCESS;
    }
    if report.devices.is_empty() {
        println!("no GPU and no RDMA NIC under {}", cli.sysfs.display());
    } else {
        print!("{:>10}", "");
        report.devices.iter().for_each(|d| print!("{d:>10}"));
        println!("{:>10}", "NUMA");
        for (d, (row, numa)) in report
            .devices
            .iter()
            .zip(report.matrix.iter().zip(&report.numa))
        {
            print!("{d:>10}");
            row.iter().for_each(|l| print!("{l:>10}"));
            println!("{:>10}", numa.map_or("-".into(), |n| n.to_string()));
        }
        println!("\nLegend: X = self, PIX = one PCIe bridge/switch, PXB = several bridges, PHB = PCIe host bridge, NODE = between host bridges of a NUMA node (or a virtual NIC), SYS = across NUMA nodes");
    }
    println!("\nProposed groups:");
    if report.groups.is_empty() {
        println!("  none: no RDMA NIC found");
    }
    for g in &report.groups {
        let link = g.link.map_or("-".into(), |l| l.to_string());
        let cpu = g.worker_cpu.map_or("-".into(), |c| c.to_string());
        println!(
            "  {:>6}: nics {:?} (link {link}), worker_cpu {cpu}",
            g.gpu.as_deref().unwrap_or("host"),
            g.nics
        );
        if let Some(n) = &g.note {
            println!("          note: {n}");
        }
    }
    ExitCode::SUCCESS
}

#[derive(Serialize)]
struct PluginInfo {
    path: String,
    backend: Option<String>,
    abi_version: Option<u32>,
    error: Option<String>,
}

#[derive(Serialize)]
struct InfoReport {
    builtin_backends: Vec<String>,
    plugin_abi_version: u32,
    plugins: Vec<PluginInfo>,
    rdma_ports: Vec<doctor::Port>,
    libfabric: Result<BTreeMap<String, Vec<String>>, String>,
    /// The libfabric API version the efa backend requests (headers and loaded library).
    libfabric_api: String,
    /// What `[watcher] memory` gives here: (kind, why better kinds were passed over).
    watcher_memory: Result<(String, Vec<String>), String>,
    config: String,
}

/// What the configured watcher memory gives on this machine (see `uvm_watcher::probe`).
fn watcher_memory(config: &engine_core::Config) -> Result<(String, Vec<String>), String> {
    let choice = config.watcher.memory_choice()?;
    uvm_watcher::probe(choice, 0).map(|(kind, why)| (kind.name().to_owned(), why))
}

/// Plugins on `$XFER_PLUGIN_PATH`, each loaded and checked as the engine would.
fn plugins() -> Vec<PluginInfo> {
    let dirs: Vec<PathBuf> = std::env::var_os(PLUGIN_PATH_ENV)
        .map(|v| std::env::split_paths(&v).collect())
        .unwrap_or_default();
    let mut out = Vec::new();
    for dir in dirs {
        let Ok(entries) = std::fs::read_dir(&dir) else {
            continue;
        };
        for entry in entries.flatten() {
            let path = entry.path();
            let Some(file) = path.file_name().and_then(|f| f.to_str()) else {
                continue;
            };
            let Some(stem) = file.strip_prefix("lib").and_then(|f| f.strip_suffix(".so")) else {
                continue;
            };
            let name = stem
                .trim_start_matches("xfer_")
                .trim_start_matches("backend_");
            let info = match find_backend(name, Some(&path)) {
                Ok(b) => PluginInfo {
                    path: path.display().to_string(),
                    backend: Some(b.name().to_owned()),
                    abi_version: Some(abi::ABI_VERSION),
                    error: None,
                },
                Err(engine_core::plugin::PluginError::AbiMismatch { found, .. }) => PluginInfo {
                    path: path.display().to_string(),
                    backend: Some(name.to_owned()),
                    abi_version: Some(found),
                    error: Some("ABI version mismatch".into()),
                },
                Err(e) => PluginInfo {
                    path: path.display().to_string(),
                    backend: None,
                    abi_version: None,
                    error: Some(e.to_string()),
                },
            };
            out.push(info);
        }
    }
    out
}

fn load_config(cli: &Cli) -> Result<Config, String> {
    Config::load(cli.config.as_deref()).map_err(|e| e.to_string())
}

fn info_cmd(cli: &Cli) -> ExitCode {
    let config = match load_config(cli) {
        Ok(c) => c,
        Err(e) => {
            eprintln!("xfer: {e}");
            return ExitCode::FAILURE;
        }
    };
    let mut libfabric: BTreeMap<String, Vec<String>> = BTreeMap::new();
    let providers = efa::providers().map(|list| {
        for (p, d) in list {
            libfabric.entry(p).or_default().push(d);
        }
        libfabric
    });
    let report = InfoReport {
        builtin_backends: Backend::builtin_names(),
        plugin_abi_version: abi::ABI_VERSION,
        plugins: plugins(),
        rdma_ports: doctor::ports(&cli.sysfs),
        libfabric: providers,
        libfabric_api: efa::api_version(),
        watcher_memory: watcher_memory(&config),
        config: format!("{config:#?}"),
    };
    if cli.json {
        println!(
            "{}",
            serde_json::to_string_pretty(&report).expect("serializes")
        );
        return ExitCode::SUCCESS;
    }
    println!(
        "Built-in backends: {} (plugin ABI version {})",
        report.builtin_backends.join(", "),
        report.plugin_abi_version
    );
    if report.plugins.is_empty() {
        println!("Plugins on ${PLUGIN_PATH_ENV}: none");
    }
    for p in &report.plugins {
        println!(
            "Plugin {}: backend {:?}, ABI {:?}{}",
            p.path,
            p.backend,
            p.abi_version,
            p.error
                .as_ref()
                .map_or(String::new(), |e| format!(" — {e}"))
        );
    }
    match &report.watcher_memory {
        Ok((kind, passed_over)) if passed_over.is_empty() => {
            println!(
                "Watcher slots ([watcher] memory = {:?}): {kind}",
                config.watcher.memory
            )
        }
        Ok((kind, passed_over)) => println!(
            "Watcher slots ([watcher] memory = {:?}): {kind} ({})",
            config.watcher.memory,
            passed_over.join("; ")
        ),
        Err(why) => println!(
            "Watcher slots ([watcher] memory = {:?}): unavailable: {why}",
            config.watcher.memory
        ),
    }
    println!("\nverbs devices (sysfs):");
    if report.rdma_ports.is_empty() {
        println!("  none (no /sys/class/infiniband entries)");
    }
    for p in &report.rdma_ports {
        let mtu = p.netdev_mtu.map_or("-".into(), |m| {
            format!("{} (netdev {m})", doctor::roce_mtu(m))
        });
        println!(
            "  {} port {}: {}, {}, MTU {mtu}",
            p.device, p.port, p.state, p.link_layer
        );
        for (i, gid, kind) in &p.gids {
            println!("    GID[{i}] {gid} {kind}");
        }
    }
    println!(
        "\nlibfabric (RDM endpoints with RMA; API {} requested):",
        report.libfabric_api
    );
    match &report.libfabric {
        Ok(map) => map
            .iter()
            .for_each(|(p, d)| println!("  {p}: domains {d:?}")),
        Err(e) => println!("  unavailable: {e}"),
    }
    println!(
        "\nEffective config ({}):\n{}",
        config.source.display(),
        report.config
    );
    ExitCode::SUCCESS
}

fn doctor_cmd(cli: &Cli, register_bytes: u64) -> ExitCode {
    let config = match load_config(cli) {
        Ok(c) => c,
        Err(e) => {
            eprintln!("xfer: {e}");
            return ExitCode::FAILURE;
        }
    };
    let mut facts = doctor::gather(&cli.sysfs, &cli.dev, &cli.proc);
    facts.backend = config.backend.clone();
    facts.nics = config.groups.iter().flat_map(|g| g.nics.clone()).collect();
    facts.register_bytes = register_bytes;
    facts.watcher_memory_request = config.watcher.memory.clone();
    facts.watcher_memory = watcher_memory(&config);
    facts.cuda_devices = Some(xfer_cuda::devices());
    if config.backend == "efa" {
        efa::doctor_facts(&config, &mut facts);
    }
    let checks = doctor::evaluate(&facts);
    let failed = checks.iter().any(|c| c.status == doctor::Status::Fail);
    if cli.json {
        #[derive(Serialize)]
        struct Out<'a> {
            backend: &'a str,
            ok: bool,
            checks: &'a [doctor::Check],
        }
        let out = Out {
            backend: &facts.backend,
            ok: !failed,
            checks: &checks,
        };
        println!(
            "{}",
            serde_json::to_string_pretty(&out).expect("serializes")
        );
    } else {
        println!(
            "xfer doctor: backend {}, NICs {:?}",
            facts.backend, facts.nics
        );
        for c in &checks {
            println!(
                "  [{:>4}] {:<24} {}",
                format!("{:?}", c.status).to_uppercase(),
                c.name,
                c.detail
            );
            if let Some(fix) = &c.fix {
                println!("         {:<24} fix: {fix}", "");
            }
        }
        println!(
            "{}",
            if failed {
                "verdict: transfers would FAIL on this set-up"
            } else {
                "verdict: OK"
            }
        );
    }
    if failed {
        ExitCode::FAILURE
    } else {
        ExitCode::SUCCESS
    }
}

fn main() -> ExitCode {
    backend_mock::link();
    #[cfg(feature = "efa")]
    backend_efa::link();
    #[cfg(feature = "verbs")]
    backend_verbs::link();
    let cli = Cli::parse();
    match &cli.command {
        Command::Topo { max_nics } => topo_cmd(&cli, *max_nics),
        Command::Info => info_cmd(&cli),
        Command::Doctor { register_bytes } => doctor_cmd(&cli, *register_bytes),
        Command::Serve {
            listen,
            ready_file,
            delay_listen_ms,
            secret_file,
            limits,
        } => serve_cmd(
            listen,
            ready_file.as_deref(),
            *delay_listen_ms,
            secret_file.as_deref(),
            limits.limits(),
        ),
        Command::Peers {
            rendezvous,
            wait_ms,
            secret_file,
        } => peers_cmd(&cli, rendezvous, *wait_ms, secret_file.as_deref()),
        Command::Conformance {
            plugin,
            backend,
            nics,
            checks,
        } => {
            // A plugin's logs reach stderr through the engine (set_log gets this level):
            // warnings and errors by default, more with RUST_LOG=debug.
            init_logging();
            conformance::run(&conformance::Request {
                config: cli.config.as_deref(),
                plugin: plugin.as_deref(),
                backend: backend.as_deref(),
                nics,
                only: checks,
                json: cli.json,
            })
        }
    }
}

/// What the CLI asks of the efa backend, when it is linked in (feature `efa`); without it
/// the answers say so instead of needing libfabric.
#[cfg(feature = "efa")]
mod efa {
    pub(crate) fn providers() -> Result<Vec<(String, String)>, String> {
        backend_efa::providers()
    }

    pub(crate) fn api_version() -> String {
        backend_efa::api_version()
    }

    pub(crate) fn doctor_facts(
        config: &engine_core::Config,
        facts: &mut xfer_topology::doctor::Facts,
    ) {
        let options = backend_efa::EfaOptions::parse(&config.backend_options());
        facts.libfabric_endpoint = Some(
            options
                .as_ref()
                .map_err(|e| e.message.clone())
                .and_then(backend_efa::probe),
        );
        facts.libfabric_provider =
            Some(options.map(|o| o.provider).unwrap_or_else(|_| "efa".into()));
        facts.libfabric_providers = backend_efa::providers().ok().map(|l| {
            let mut v: Vec<String> = l.into_iter().map(|(p, _)| p).collect();
            v.dedup();
            v
        });
    }
}

#[cfg(not(feature = "efa"))]
mod efa {
    const ABSENT: &str = "this xfer was built without the efa backend (cargo feature efa)";

    pub(crate) fn providers() -> Result<Vec<(String, String)>, String> {
        Err(ABSENT.into())
    }

    pub(crate) fn api_version() -> String {
        "none".into()
    }

    pub(crate) fn doctor_facts(_: &engine_core::Config, facts: &mut xfer_topology::doctor::Facts) {
        facts.libfabric_endpoint = Some(Err(ABSENT.into()));
    }
}
