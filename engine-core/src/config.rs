//! The TOML configuration: which backend, which NICs per group, pinning, timeouts, striping,
//! and each backend's own table. Unknown keys are errors that name the key and the file.
//!
//! Found via an explicit path, then `$XFER_CONFIG`, then [`DEFAULT_CONFIG`] (the mock).

use std::path::{Path, PathBuf};
use std::time::Duration;

use serde::Deserialize;

use crate::plan::StripePolicy;
use crate::wire::MAX_NICS;

/// Environment variable naming a config file.
pub const CONFIG_ENV: &str = "XFER_CONFIG";

/// Environment variable naming the cluster secret's file, for a config without
/// `[security] secret_file`: the same variable the rendezvous reads, so one setting secures
/// the control plane (rendezvous) and the data plane (the verbs handshake) alike.
pub const SECRET_FILE_ENV: &str = "XFER_SECRET_FILE";

/// The config used when none is given: one group of one mock NIC.
pub const DEFAULT_CONFIG: &str = r#"
backend = "mock"

[[groups]]
nics = ["mock0"]
"#;

/// Why a config is unusable.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[non_exhaustive]
pub enum ConfigError {
    /// The file could not be read.
    #[error("cannot read config {file}: {message}")]
    Read {
        /// The file.
        file: PathBuf,
        /// The OS error.
        message: String,
    },
    /// The TOML is malformed or has an unknown key or a wrong type.
    #[error("config {file}: {message}")]
    Parse {
        /// The file (or `<embedded default>` / `<string>`).
        file: PathBuf,
        /// The parser's message, naming the key and line.
        message: String,
    },
    /// The values are well-formed but inconsistent.
    #[error("config {file}: {message}")]
    Invalid {
        /// The file.
        file: PathBuf,
        /// What is wrong.
        message: String,
    },
}

/// How the first NIC of each transfer is chosen.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Deserialize, Default)]
#[serde(rename_all = "snake_case", deny_unknown_fields)]
pub enum NicSelection {
    /// Rotate the first NIC from one transfer to the next, spreading small transfers.
    #[default]
    RoundRobin,
    /// Start every transfer on this NIC (large transfers still stripe over all NICs).
    First(usize),
}

/// One DomainGroup: the NICs serving one GPU, and where its worker runs.
#[derive(Debug, Clone, PartialEq, Eq, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct GroupConfig {
    /// NIC names in the backend's terms, 1 to 4 of them; peers must use as many.
    pub nics: Vec<String>,
    /// CPU to pin the worker thread to (none: not pinned).
    #[serde(default)]
    pub worker_cpu: Option<usize>,
}

/// Deadlines, in milliseconds in the file.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct Timeouts {
    /// A transfer not complete after this fails with `Timeout`.
    pub transfer_ms: u64,
    /// An `expect_imm_count` not met after this fails with `Timeout`.
    pub expect_ms: u64,
    /// A backend's connection handshake gives up after this. The engine passes it to every
    /// backend as `connect_ms` in its options table; setting it there instead is an error.
    pub connect_ms: u64,
    /// A request to the worker thread (register, deregister) gives up after this.
    pub control_ms: u64,
}

impl Default for Timeouts {
    fn default() -> Self {
        Self {
            transfer_ms: 5_000,
            expect_ms: 10_000,
            connect_ms: 3_000,
            control_ms: 5_000,
        }
    }
}

impl Timeouts {
    /// `transfer_ms` as a duration.
    pub fn transfer(&self) -> Duration {
        Duration::from_millis(self.transfer_ms)
    }
    /// `expect_ms` as a duration.
    pub fn expect(&self) -> Duration {
        Duration::from_millis(self.expect_ms)
    }
    /// `control_ms` as a duration.
    pub fn control(&self) -> Duration {
        Duration::from_millis(self.control_ms)
    }
}

/// How the worker spends its CPU.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct WorkerConfig {
    /// After the last piece of work, keep busy-polling this long before backing off.
    pub spin_us: u64,
    /// When idle, poll Domains that cannot wake the worker at this interval; 0 keeps polling
    /// (yielding the CPU between polls) instead of parking, for providers whose transfers only
    /// progress while the *receiver* polls (libfabric shm, tcp). Timed parks are coarse (the
    /// kernel's timer slack is about 50 µs), so small non-zero values are not much better
    /// than 1000.
    pub idle_poll_us: u64,
    /// Between polls of an awake, idle worker (within `spin_us`, or never parking): `true`
    /// gives the CPU to other threads (`sched_yield`), `false` spins on it with no system
    /// call. Spinning answers arrivals soonest when the worker has a core to itself (a
    /// yield costs a trip through the scheduler, about a microsecond natively and far more
    /// under emulation); on a machine with fewer cores than busy threads it takes CPU from
    /// the threads the worker waits for (submitters, callbacks, a software NIC).
    pub yield_when_idle: bool,
    /// Ignored since 2026-12-07 (issue 53): only the worker makes passes. Accepted so that
    /// configs that set it still load.
    pub drive_when_parked: bool,
    /// How long [`TransferEngine::wait`](crate::TransferEngine::wait) looks at what it waits
    /// for without sleeping (yielding between looks) before it sleeps: an outcome the worker
    /// delivers within it costs the waiter no wake-up. 0 sleeps at once. The default, 1 ms,
    /// covers a small transfer's round trip even on soft-RoCE under emulation (~50 µs); a
    /// wait that is not answered by then costs at most that much CPU.
    pub wait_poll_us: u64,
    /// Largest message `submit_send` accepts.
    pub max_message: usize,
    /// Most operations (transfers, sends) accepted and not yet finished; past it `submit_*`
    /// returns `Error::Busy`. Bounds the memory queued work can take.
    pub max_outstanding: usize,
    /// Most immediates that nobody waits for whose arrivals the ImmCounter keeps; arrivals
    /// beyond it are dropped and reported (see `engine_core::imm`).
    pub max_idle_imms: usize,
    /// Most of those immediates one peer engine's arrivals may have created (where the
    /// backend names senders: verbs, the mock, plugins that do), so one peer cannot fill the
    /// table. Backends name a sender by its NIC, and a peer has up to four: each NIC address
    /// gets a quarter of this (rounded up).
    pub max_idle_imms_per_peer: usize,
    /// Most notifications queued and not yet taken; arrivals past it are dropped, logged and
    /// counted (`TransferEngine::notifications_dropped`).
    pub max_notifications: usize,
    /// Most of those from one sender (its proven address where the transport proves one,
    /// else its claim), so one peer cannot fill the queue for all; past it its arrivals are
    /// dropped, logged and counted too.
    pub max_notifications_per_peer: usize,
}

impl Default for WorkerConfig {
    fn default() -> Self {
        Self {
            spin_us: 50,
            idle_poll_us: 1_000,
            yield_when_idle: true,
            drive_when_parked: false,
            wait_poll_us: 1_000,
            max_message: 64 << 10,
            max_outstanding: 1 << 16,
            max_idle_imms: crate::imm::DEFAULT_MAX_IDLE_IMMS,
            max_idle_imms_per_peer: crate::imm::DEFAULT_MAX_IDLE_IMMS / 4,
            max_notifications: 1 << 14,
            max_notifications_per_peer: 1 << 12,
        }
    }
}

/// The uvm-watcher pool.
#[derive(Debug, Clone, PartialEq, Eq, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct WatcherConfig {
    /// CPU to pin the polling thread to (none: not pinned).
    pub cpu: Option<usize>,
    /// Most watcher slots (rounded up to blocks of 512).
    pub max_slots: usize,
    /// Where slots live: `auto` (GPU memory through GDRCopy, else device-mapped host memory,
    /// else host memory), `host`, `device_mapped` or `gpu_gdrcopy` (a kind that cannot be had
    /// is an error naming why). See the `uvm_watcher` crate for what each costs.
    pub memory: String,
    /// Pause between polling passes, in microseconds (0: spin). GPU-memory slots cost an
    /// uncached PCIe read per block and pass; a pause makes the poller cheap at that much
    /// latency.
    pub pass_interval_us: u64,
}

impl Default for WatcherConfig {
    fn default() -> Self {
        Self {
            cpu: None,
            max_slots: 2048,
            memory: "auto".into(),
            pass_interval_us: 0,
        }
    }
}

impl WatcherConfig {
    /// The slot memory asked for.
    pub fn memory_choice(&self) -> Result<uvm_watcher::MemoryChoice, String> {
        uvm_watcher::MemoryChoice::parse(&self.memory).map_err(|e| format!("watcher.memory: {e}"))
    }
}

/// Registration.
#[derive(Debug, Clone, PartialEq, Eq, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct MemoryConfig {
    /// Share one NIC registration among every `reg_mr` of a range it covers (same memory
    /// kind and remote access), deregistering at the last `dereg_mr` (see
    /// `engine_core::regcache`). Off: each `reg_mr` registers, each `dereg_mr` revokes its
    /// keys at once.
    pub registration_cache: bool,
}

impl Default for MemoryConfig {
    fn default() -> Self {
        Self {
            registration_cache: true,
        }
    }
}

/// The metrics endpoint.
#[derive(Debug, Clone, PartialEq, Eq, Deserialize, Default)]
#[serde(deny_unknown_fields, default)]
pub struct MetricsConfig {
    /// Serve `GET /metrics` (Prometheus text of `TransferEngine::stats`) on this address
    /// (e.g. `127.0.0.1:9464`; port 0 picks one, see `metrics_address`). Off when unset.
    pub listen: Option<String>,
}

/// What the processes of one cluster share to recognise each other.
#[derive(Debug, Clone, PartialEq, Eq, Deserialize, Default)]
#[serde(deny_unknown_fields, default)]
pub struct SecurityConfig {
    /// A file holding the cluster secret, readable by its owner only (at least 16 bytes; 32
    /// random ones will do: `(umask 077; head -c 32 /dev/urandom > secret)`). Backends with a handshake authenticate it with
    /// the secret (verbs); peers without it cannot connect. Only the path is handed to
    /// backends, as `secret_file` in their table; never put a secret on a command line.
    /// Unset, `$XFER_SECRET_FILE` is used (see [`Config::secret_file`]).
    pub secret_file: Option<PathBuf>,
}

impl SecurityConfig {
    /// The cluster secret's file, given the value of `$XFER_SECRET_FILE` (`env`; empty counts
    /// as unset): the config's, else the variable's. Both set and naming different files
    /// (`same_file` says whether two paths are one file) is refused, naming both: the control
    /// and the data plane would prove different secrets and fail in ways that name neither.
    pub fn resolve(
        &self,
        env: Option<&std::ffi::OsStr>,
        same_file: impl Fn(&Path, &Path) -> bool,
    ) -> Result<Option<PathBuf>, String> {
        let env = env.filter(|v| !v.is_empty()).map(PathBuf::from);
        match (&self.secret_file, env) {
            (Some(own), Some(env)) if !same_file(own, &env) => Err(format!(
                "[security] secret_file names {} but ${SECRET_FILE_ENV} names {}: one cluster secret keys both the rendezvous and the backend's handshake; make them the same file (or unset one)",
                own.display(),
                env.display()
            )),
            (Some(own), _) => Ok(Some(own.clone())),
            (None, env) => Ok(env),
        }
    }
}

/// Where peers find each other by name (the `xfer-rendezvous` crate reads it; the engine
/// itself does not), so the backend and the rendezvous come from one file.
#[derive(Debug, Clone, PartialEq, Eq, Deserialize, Default)]
#[serde(deny_unknown_fields, default)]
pub struct RendezvousConfig {
    /// `xfer://host:port[/prefix]` (the embedded service, `xfer serve`) or
    /// `etcd://host:port[,host:port…][/prefix]`.
    pub url: Option<String>,
    /// Lease of a published name, in milliseconds (at least 2000: etcd's minimum); a
    /// process that dies disappears within it. 0: the default, 5000.
    pub ttl_ms: u64,
    /// How long a client rides out a rendezvous service that is not up yet or is
    /// restarting (connect, publish, list, watch), in milliseconds, before it fails naming
    /// the URL. 0: the default, 30000.
    pub connect_ms: u64,
    /// etcd over TLS: the CA that signed etcd's certificate (PEM). Setting it turns TLS on.
    pub etcd_ca_file: Option<PathBuf>,
    /// etcd over TLS: this client's certificate and key (PEM), for etcd's
    /// `--client-cert-auth`. Both or neither.
    pub etcd_cert_file: Option<PathBuf>,
    /// See `etcd_cert_file`.
    pub etcd_key_file: Option<PathBuf>,
    /// etcd over TLS: the name etcd's certificate is checked against (default: the
    /// endpoint's host).
    pub etcd_domain: Option<String>,
    /// etcd authentication: the user name.
    pub etcd_user: Option<String>,
    /// etcd authentication: a file holding the user's password (never the password itself
    /// in the config).
    pub etcd_password_file: Option<PathBuf>,
}

/// A whole configuration.
#[derive(Debug, Clone, PartialEq, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Config {
    /// The backend's name (`mock`, `verbs`, `efa`, or a plugin's).
    pub backend: String,
    /// A plugin library to load for `backend` (else built-ins, then `$XFER_PLUGIN_PATH`).
    #[serde(default)]
    pub plugin: Option<PathBuf>,
    /// The DomainGroups of this process, one per GPU.
    pub groups: Vec<GroupConfig>,
    /// How the first NIC of a transfer is chosen.
    #[serde(default)]
    pub nic_selection: NicSelection,
    /// Deadlines.
    #[serde(default)]
    pub timeouts: Timeouts,
    /// Striping; both peers must agree.
    #[serde(default)]
    pub stripe: StripePolicy,
    /// Worker spinning and limits.
    #[serde(default)]
    pub worker: WorkerConfig,
    /// The uvm-watcher pool.
    #[serde(default)]
    pub watcher: WatcherConfig,
    /// Each backend's own table, `[backends.<name>]`, handed to it as TOML.
    #[serde(default)]
    pub backends: toml::Table,
    /// Where peers find each other (`[rendezvous] url = ...`).
    #[serde(default)]
    pub rendezvous: RendezvousConfig,
    /// The cluster secret (`[security] secret_file = ...`).
    #[serde(default)]
    pub security: SecurityConfig,
    /// The Prometheus endpoint (`[metrics] listen = ...`), off unless set.
    #[serde(default)]
    pub metrics: MetricsConfig,
    /// `[memory]`: registration.
    #[serde(default)]
    pub memory: MemoryConfig,
    /// Where this config came from, for error messages.
    #[serde(skip)]
    pub source: PathBuf,
}

impl Default for Config {
    fn default() -> Self {
        Self::from_toml(DEFAULT_CONFIG, Path::new("<embedded default>"))
            .expect("the embedded default config is valid")
    }
}

impl Config {
    /// Loads the config: `explicit` if given, else `$XFER_CONFIG`, else the default.
    pub fn load(explicit: Option<&Path>) -> Result<Self, ConfigError> {
        let from_env = std::env::var_os(CONFIG_ENV).map(PathBuf::from);
        match explicit.map(Path::to_path_buf).or(from_env) {
            Some(path) => Self::from_file(&path),
            None => Ok(Self::default()),
        }
    }

    /// Reads and checks one file.
    pub fn from_file(path: &Path) -> Result<Self, ConfigError> {
        let text = std::fs::read_to_string(path).map_err(|e| ConfigError::Read {
            file: path.to_owned(),
            message: e.to_string(),
        })?;
        let mut config = Self::from_toml(&text, path)?;
        // A relative `plugin` means "next to this file", not "next to wherever the program
        // happens to run".
        if let (Some(plugin), Some(dir)) = (&config.plugin, path.parent()) {
            if plugin.is_relative() {
                config.plugin = Some(dir.join(plugin));
            }
        }
        Ok(config)
    }

    /// Parses and checks TOML text; `source` names it in errors.
    pub fn from_toml(text: &str, source: &Path) -> Result<Self, ConfigError> {
        let parse = |e: toml::de::Error| ConfigError::Parse {
            file: source.to_owned(),
            message: e.to_string(),
        };
        let with_groups;
        let mut text = text;
        let table: toml::Table = toml::from_str(text).map_err(parse)?;
        if !table.contains_key("groups") {
            with_groups = Self::with_default_groups(table, source)?;
            text = &with_groups;
        }
        let mut config: Config = toml::from_str(text).map_err(parse)?;
        config.source = source.to_owned();
        config.validate()?;
        Ok(config)
    }

    /// A config without `groups`, given what `xfer topo` would choose where that needs no
    /// hardware to know: the mock's one NIC, libfabric's first domain (`auto`). A verbs or
    /// plugin backend's NICs are the operator's to name: refused with what to write.
    fn with_default_groups(mut table: toml::Table, source: &Path) -> Result<String, ConfigError> {
        let backend = table.get("backend").and_then(|b| b.as_str()).unwrap_or("");
        let nic = match backend {
            "mock" => "mock0",
            "efa" => "auto",
            _ => {
                return Err(ConfigError::Invalid {
                    file: source.to_owned(),
                    message: format!(
                        "no `groups`: backend {backend:?} needs its NICs named, e.g. [[groups]] nics = [\"mlx5_0\"] (`xfer topo` lists this machine's NICs and the groups it would choose)"
                    ),
                })
            }
        };
        let mut group = toml::Table::new();
        group.insert("nics".into(), toml::Value::Array(vec![nic.into()]));
        table.insert("groups".into(), toml::Value::Array(vec![group.into()]));
        Ok(toml::to_string(&table).expect("a table serialises"))
    }

    fn invalid(&self, message: String) -> ConfigError {
        ConfigError::Invalid {
            file: self.source.clone(),
            message,
        }
    }

    /// Checks that the values are consistent. [`TransferEngine::open`](crate::TransferEngine)
    /// runs it too, so a `Config` built or changed in code gets the same checks as a file.
    pub fn validate(&self) -> Result<(), ConfigError> {
        if self.groups.is_empty() {
            return Err(self.invalid("`groups` is empty: add one [[groups]] with `nics`".into()));
        }
        let width = self.groups[0].nics.len();
        for (i, g) in self.groups.iter().enumerate() {
            if g.nics.is_empty() || g.nics.len() > MAX_NICS {
                return Err(self.invalid(format!(
                    "groups[{i}] has {} NICs; a group has 1 to {MAX_NICS}",
                    g.nics.len()
                )));
            }
            if g.nics.len() != width {
                return Err(self.invalid(format!(
                    "groups[{i}] has {} NICs but groups[0] has {width}; all groups must be the same size so peers agree on striping",
                    g.nics.len()
                )));
            }
        }
        if let NicSelection::First(n) = self.nic_selection {
            if n >= width {
                return Err(self.invalid(format!(
                    "nic_selection.first = {n}, but groups have {width} NICs"
                )));
            }
        }
        self.stripe.validate().map_err(|m| self.invalid(m))?;
        let t = &self.timeouts;
        if [t.transfer_ms, t.expect_ms, t.connect_ms, t.control_ms].contains(&0) {
            return Err(self.invalid("every timeout must be at least 1 ms".into()));
        }
        // Deadlines are computed as `now + timeout`: keep them far from overflowing.
        const MAX_TIMEOUT_MS: u64 = 1 << 40;
        if [t.transfer_ms, t.expect_ms, t.connect_ms, t.control_ms]
            .iter()
            .any(|&ms| ms > MAX_TIMEOUT_MS)
        {
            return Err(self.invalid(format!(
                "a timeout is longer than {MAX_TIMEOUT_MS} ms (about 35 years)"
            )));
        }
        for (name, table) in &self.backends {
            if let toml::Value::Table(t) = table {
                if t.contains_key("connect_ms") {
                    return Err(self.invalid(format!(
                        "[backends.{name}] connect_ms: the handshake deadline is [timeouts] connect_ms, which every backend receives"
                    )));
                }
            }
        }
        self.watcher.memory_choice().map_err(|m| self.invalid(m))?;
        let w = &self.worker;
        if w.max_message == 0
            || w.max_outstanding == 0
            || w.max_idle_imms == 0
            || w.max_idle_imms_per_peer == 0
            || w.max_notifications == 0
            || w.max_notifications_per_peer == 0
        {
            return Err(self.invalid(
                "worker.max_message, worker.max_outstanding, worker.max_idle_imms, worker.max_idle_imms_per_peer worker.max_notifications and worker.max_notifications_per_peer must be at least 1".into(),
            ));
        }
        self.secret_file().map_err(|m| self.invalid(m))?;
        self.check_backend_options()
    }

    /// The cluster secret's file this process uses: `[security] secret_file`, else
    /// `$XFER_SECRET_FILE` (what docs/serving.md tells operators to set for the rendezvous),
    /// so the rendezvous and the backend's handshake are keyed by one file. Refused when the
    /// two name different files (see [`SecurityConfig::resolve`]).
    pub fn secret_file(&self) -> Result<Option<PathBuf>, String> {
        self.security
            .resolve(std::env::var_os(SECRET_FILE_ENV).as_deref(), |a, b| {
                a == b
                    || matches!(
                        (std::fs::canonicalize(a), std::fs::canonicalize(b)),
                        (Ok(x), Ok(y)) if x == y
                    )
            })
    }

    /// Checks the selected backend's own table with the backend's parser, when the backend is
    /// linked into this binary (a plugin's is checked when an engine loads it, through its
    /// `check_options` entry).
    fn check_backend_options(&self) -> Result<(), ConfigError> {
        let Some(backend) = xfer_plugin::registry::find(&self.backend) else {
            return Ok(());
        };
        (backend.check_options)(&self.backend_options()).map_err(|why| self.invalid(why))
    }

    /// The selected backend's own table as TOML text, with the engine-wide settings every
    /// backend receives (`connect_ms`, and `secret_file`: the config's or
    /// `$XFER_SECRET_FILE`'s, see [`secret_file`](Self::secret_file)) added.
    pub fn backend_options(&self) -> String {
        // `validate` refused two different files; were it skipped, the config's is used.
        let secret = self
            .secret_file()
            .unwrap_or_else(|_| self.security.secret_file.clone());
        self.backend_options_with(secret.as_deref())
    }

    /// [`backend_options`](Self::backend_options) with the secret's file given.
    fn backend_options_with(&self, secret_file: Option<&Path>) -> String {
        let mut table = match self.backends.get(&self.backend) {
            Some(toml::Value::Table(t)) => t.clone(),
            _ => toml::Table::new(),
        };
        table.insert(
            "connect_ms".into(),
            toml::Value::Integer(i64::try_from(self.timeouts.connect_ms).unwrap_or(i64::MAX)),
        );
        // The path only, never the secret: this text may be shown (`xfer info`).
        if let Some(path) = secret_file {
            table.insert(
                "secret_file".into(),
                toml::Value::String(path.display().to_string()),
            );
        }
        toml::to_string(&table).unwrap_or_default()
    }
}

#[cfg(test)]
mod tests;
