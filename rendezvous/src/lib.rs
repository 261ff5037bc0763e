//! Rendezvous: engines find each other by name.
//!
//! A process publishes "I am `prefill-3`: here is my address and my `kv-cache` region" under
//! a lease with a TTL, kept alive in the background; others look the name up (waiting until
//! it appears), list or watch who is published, and see a killed process disappear within
//! the TTL. Two services, one API and one test suite:
//!
//! - `xfer://host:port[/prefix]`: the embedded service (`xfer serve`, or [`Server`] in a
//!   test), for one machine or a quick set-up; small on purpose.
//! - `etcd://host:port[,host:port…][/prefix]`: etcd (feature `etcd`), for clusters.
//!
//! Keys are `{prefix}/peers/{name}` (prefix `/xfer` by default); values are [`record`]s: the
//! engine's own binary codecs, versioned, so anything malformed or written by another
//! program is a typed error naming the key, never a panic.

#![forbid(unsafe_code)]

pub mod embedded;
#[cfg(feature = "etcd")]
mod etcd;
pub mod record;
mod retry;
mod secret;

use std::time::{Duration, Instant};

use engine_core::{MrDesc, NetAddr};

pub use embedded::Server;
pub use record::Record;
pub use retry::DEFAULT_WAIT;
pub use secret::{Secret, SECRET_FILE_ENV};

/// How to reach a rendezvous service, beyond its URL.
#[derive(Clone, Debug)]
pub struct ConnectOptions {
    /// How long calls ride out a service that is not up yet or is restarting.
    pub wait: Duration,
    /// The cluster secret the embedded service asks for (etcd ignores it).
    pub secret: Option<Secret>,
    /// TLS and user authentication for etcd (the embedded service ignores them).
    pub etcd: EtcdSecurity,
}

impl Default for ConnectOptions {
    fn default() -> Self {
        Self {
            wait: DEFAULT_WAIT,
            secret: None,
            etcd: EtcdSecurity::default(),
        }
    }
}

/// etcd's TLS and user authentication, as files (PEM certificates and keys; a password in a
/// file of its own). Any TLS file turns TLS on, and then `ca_file` is required.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct EtcdSecurity {
    /// The CA that signed etcd's certificate.
    pub ca_file: Option<std::path::PathBuf>,
    /// This client's certificate, for etcd's `--client-cert-auth` (with `key_file`).
    pub cert_file: Option<std::path::PathBuf>,
    /// This client's key.
    pub key_file: Option<std::path::PathBuf>,
    /// The name etcd's certificate must carry (default: the endpoint's host).
    pub domain: Option<String>,
    /// The etcd user.
    pub user: Option<String>,
    /// A file holding the user's password.
    pub password_file: Option<std::path::PathBuf>,
}

/// What can go wrong.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum Error {
    /// The URL is not `xfer://host:port[/prefix]` or `etcd://host:port[,…][/prefix]`.
    #[error("rendezvous URL {url:?}: {why}")]
    BadUrl {
        /// The URL given.
        url: String,
        /// What is wrong with it.
        why: String,
    },
    /// A peer or region name outside 1–128 of `A-Z a-z 0-9 . _ -`.
    #[error("invalid {what} name {name:?}: use 1 to 128 of A-Z a-z 0-9 . _ -")]
    InvalidName {
        /// "peer" or "region".
        what: &'static str,
        /// The name given.
        name: String,
    },
    /// The value under `key` is not a record this build reads.
    #[error("malformed record under {key}: {why}")]
    BadRecord {
        /// The key it was read from.
        key: String,
        /// What is wrong with it.
        why: record::RecordError,
    },
    /// Nothing was published under the name within the timeout.
    #[error("no peer named {name:?} was published within {timeout:?}")]
    NotFound {
        /// The name looked up.
        name: String,
        /// How long the lookup waited.
        timeout: Duration,
    },
    /// The service could not be reached (nothing listens there, or the connection broke)
    /// for as long as the caller was prepared to wait: connect's wait, or the lookup's
    /// timeout. Calls ride out a service that is starting or restarting until then.
    #[error("rendezvous service {service} not reachable within {waited:?}: {why} (is `xfer serve` or etcd running there?)")]
    Unreachable {
        /// Which service (its URL).
        service: String,
        /// How long the call kept trying.
        waited: Duration,
        /// The last failure.
        why: String,
    },
    /// The service answered, but not as asked (a refusal, or a reply this build does not
    /// expect).
    #[error("rendezvous service {service}: {why}")]
    Service {
        /// Which service.
        service: String,
        /// What happened.
        why: String,
    },
    /// The name is published by another live publisher: a key belongs to the lease that
    /// wrote it until that lease ends (revoked, or expired within its TTL when its process
    /// died). `publish` waits for that up to the connection's wait before failing with this.
    #[error("rendezvous service {service}: the name {name:?} is published by another live publisher (it frees when that publisher unpublishes, or within its TTL if it died)")]
    NameTaken {
        /// Which service.
        service: String,
        /// The name.
        name: String,
    },
    /// The service and this client do not share the cluster secret (either side has none,
    /// or they differ). Not retried: waiting does not change it.
    #[error("rendezvous service {service}: authentication failed: {why}")]
    Authentication {
        /// Which service.
        service: String,
        /// What did not match.
        why: String,
    },
    /// The embedded service refused an answer (a listing, or a watch's current entries) of
    /// `bytes`: more than it holds for one connection (`budget`, its
    /// `Limits::max_pending_bytes_per_connection`). Not retried: list a narrower prefix, or
    /// raise the service's limit.
    #[error("rendezvous service {service}: an answer of {bytes} bytes is more than the {budget} bytes the service holds for one connection (list a narrower prefix, or raise the service's max_pending_bytes_per_connection)")]
    AnswerTooLarge {
        /// Which service.
        service: String,
        /// The answer's size (a bound, counted before it was built).
        bytes: u64,
        /// What the service holds for one connection.
        budget: u64,
    },
    /// The embedded service holds its budget of bytes (`Limits::max_pending_bytes`) for
    /// answers other clients have not taken yet, so it refused one of `bytes`. It frees as
    /// they read or are cut off (within the service's write timeout): calls ride it out
    /// like an unreachable service, for as long as they wait, and then fail with this.
    #[error("rendezvous service {service}: busy: it holds {held} of its {budget} bytes for answers other clients have not taken, so an answer of {bytes} bytes was refused")]
    Busy {
        /// Which service.
        service: String,
        /// The answer's size (a bound, counted before it was built).
        bytes: u64,
        /// What the service held for others.
        held: u64,
        /// Its budget.
        budget: u64,
    },
    /// A credential file (an etcd CA, certificate, key or password) could not be used.
    #[error("rendezvous credentials {path}: {why}")]
    Credentials {
        /// The file named.
        path: std::path::PathBuf,
        /// What is wrong with it.
        why: String,
    },
    /// The cluster secret could not be read.
    #[error("cluster secret {path}: {why}")]
    Secret {
        /// The file named (by the config, `--secret-file` or `$XFER_SECRET_FILE`).
        path: std::path::PathBuf,
        /// What is wrong with it.
        why: String,
    },
    /// This build has no etcd client (feature `etcd`).
    #[error("this build of xfer has no etcd client: build with the `etcd` feature (needs protoc), or use the embedded service (xfer://)")]
    NoEtcd,
}

/// `Result` with this crate's [`Error`].
pub type Result<T, E = Error> = std::result::Result<T, E>;

/// A change of who is published.
#[derive(Debug)]
pub enum Event {
    /// A peer published (or re-published, with a new incarnation after a restart).
    Joined(Record),
    /// A peer unpublished, or its lease expired (the process died).
    Left {
        /// Its name.
        name: String,
    },
    /// A value under the prefix that is not a record (written by something else).
    Malformed(Error),
}

/// The key-value operations a service offers (both services implement them).
pub(crate) trait Store: Send + Sync {
    /// Stores `value` under `key` with a new lease of `ttl`, kept alive until the returned
    /// keeper is dropped (which revokes it).
    fn publish(&self, key: &str, value: Vec<u8>, ttl: Duration) -> Result<Box<dyn Keeper>>;
    fn get(&self, key: &str) -> Result<Option<Vec<u8>>>;
    fn list(&self, prefix: &str) -> Result<Vec<(String, Vec<u8>)>>;
    /// Current entries under `prefix` (as puts), then changes.
    fn watch(&self, prefix: &str) -> Result<Box<dyn Changes>>;
}

/// Keeps a lease alive; dropping it revokes the lease (the key disappears).
pub(crate) trait Keeper: Send {}

/// A stream of key changes under a prefix.
pub(crate) trait Changes: Send {
    /// The next change, or `None` if none came within `timeout`.
    fn next(&mut self, timeout: Duration) -> Result<Option<Change>>;
}

/// A key that was put (with its value) or deleted.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) enum Change {
    Put(String, Vec<u8>),
    Delete(String),
}

/// A connection to a rendezvous service.
pub struct Rendezvous {
    store: Box<dyn Store>,
    prefix: String,
    url: String,
    /// How long a call rides out an unreachable service (lookups: their own timeout).
    wait: Duration,
}

impl std::fmt::Debug for Rendezvous {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Rendezvous")
            .field("url", &self.url)
            .finish()
    }
}

/// A published name; dropping it (or [`unpublish`](Self::unpublish)) removes it. If the
/// process dies, the service removes it when the lease's TTL passes.
pub struct Publication {
    _keeper: Box<dyn Keeper>,
    record: Record,
}

impl Publication {
    /// What was published.
    pub fn record(&self) -> &Record {
        &self.record
    }

    /// Removes the name now.
    pub fn unpublish(self) {}
}

/// Joins and leaves under the rendezvous prefix.
pub struct Watch {
    changes: Box<dyn Changes>,
    prefix: String,
}

impl Watch {
    /// The next event, or `None` if nothing happened within `timeout`. Events for the
    /// members already published come first (as joins).
    pub fn next(&mut self, timeout: Duration) -> Result<Option<Event>> {
        let Some(change) = self.changes.next(timeout)? else {
            return Ok(None);
        };
        Ok(Some(match change {
            Change::Put(key, value) => match record::decode(&key, &value) {
                Ok(r) => Event::Joined(r),
                Err(e) => Event::Malformed(e),
            },
            Change::Delete(key) => Event::Left {
                name: key.strip_prefix(&self.prefix).unwrap_or(&key).to_owned(),
            },
        }))
    }
}

/// A parsed rendezvous URL: the service kind, its endpoints and the key prefix.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) struct Url {
    pub(crate) etcd: bool,
    pub(crate) endpoints: Vec<String>,
    pub(crate) prefix: String,
}

pub(crate) fn parse_url(url: &str) -> Result<Url> {
    let bad = |why: &str| Error::BadUrl {
        url: url.to_owned(),
        why: why.to_owned(),
    };
    let (etcd, rest) = if let Some(r) = url.strip_prefix("etcd://") {
        (true, r)
    } else if let Some(r) = url.strip_prefix("xfer://") {
        (false, r)
    } else {
        return Err(bad(
            "expected xfer://host:port or etcd://host:port[,host:port]",
        ));
    };
    let (hosts, path) = rest.split_once('/').unwrap_or((rest, ""));
    let endpoints: Vec<String> = hosts.split(',').map(str::to_owned).collect();
    for e in &endpoints {
        let (host, port) = e
            .rsplit_once(':')
            .ok_or_else(|| bad(&format!("endpoint {e:?} has no port")))?;
        if host.is_empty() || port.parse::<u16>().is_err() {
            return Err(bad(&format!("endpoint {e:?} is not host:port")));
        }
    }
    if !etcd && endpoints.len() != 1 {
        return Err(bad("the embedded service has one endpoint"));
    }
    let path = path.trim_end_matches('/');
    for part in path.split('/').filter(|p| !p.is_empty()) {
        record::check_name("prefix", part).map_err(|e| bad(&e.to_string()))?;
    }
    let prefix = if path.is_empty() {
        "/xfer".to_owned()
    } else {
        format!("/{path}")
    };
    Ok(Url {
        etcd,
        endpoints,
        prefix,
    })
}

impl Rendezvous {
    /// Connects to `xfer://host:port[/prefix]` or `etcd://host:port[,host:port…][/prefix]`,
    /// waiting up to [`DEFAULT_WAIT`] for a service that is not up yet.
    pub fn connect(url: &str) -> Result<Self> {
        Self::connect_within(url, DEFAULT_WAIT)
    }

    /// Connects, riding out a service that is not up yet (or is restarting) for up to
    /// `wait`: refused or broken connections are retried with backoff, logged once, and
    /// end in [`Error::Unreachable`] naming the URL. Later calls on the connection
    /// (`publish`, `list`, `watch`) ride out a restarting service for as long; `lookup`
    /// for its own timeout. A zero `wait` tries once. The cluster secret, if any, comes
    /// from the file `$XFER_SECRET_FILE` names.
    pub fn connect_within(url: &str, wait: Duration) -> Result<Self> {
        Self::connect_with(
            url,
            &ConnectOptions {
                wait,
                secret: Secret::from_env()?,
                ..ConnectOptions::default()
            },
        )
    }

    /// Connects as [`connect_within`](Self::connect_within) with `options`: the embedded
    /// service and this client prove `options.secret` to each other, etcd gets TLS and a
    /// user from `options.etcd`. A service and a client that do not share a secret, or an
    /// etcd that refuses the user or the certificate, fail at once with
    /// [`Error::Authentication`].
    pub fn connect_with(url: &str, options: &ConnectOptions) -> Result<Self> {
        let (wait, secret) = (options.wait, options.secret.clone());
        let parsed = parse_url(url)?;
        let store: Box<dyn Store> = if parsed.etcd {
            #[cfg(feature = "etcd")]
            {
                Box::new(etcd::EtcdStore::connect(
                    url,
                    &parsed.endpoints,
                    wait,
                    &options.etcd,
                )?)
            }
            #[cfg(not(feature = "etcd"))]
            {
                return Err(Error::NoEtcd);
            }
        } else {
            let client = embedded::Client::new(url, &parsed.endpoints[0], secret, wait);
            retry::until(url, wait, || client.probe())?;
            Box::new(client)
        };
        Ok(Self {
            store,
            prefix: format!("{}/peers/", parsed.prefix),
            url: url.to_owned(),
            wait,
        })
    }

    /// Runs one store call, riding out an unreachable service for `wait`.
    fn retrying<T>(&self, wait: Duration, call: impl FnMut() -> Result<T>) -> Result<T> {
        retry::until(&self.url, wait, call)
    }

    fn key(&self, name: &str) -> String {
        format!("{}{name}", self.prefix)
    }

    /// Publishes `name` → (`addr`, named regions) under a lease of `ttl` (at least 2 s:
    /// etcd's minimum), kept alive until the returned [`Publication`] is dropped. A name
    /// belongs to the live publication that holds it: publishing it again while another
    /// lease holds it waits (up to the connection's wait) for that lease to end — a
    /// restarted peer gets its name back within the dead process's TTL — and then fails
    /// with [`Error::NameTaken`] (a second live process with the same name).
    pub fn publish(
        &self,
        name: &str,
        addr: &NetAddr,
        regions: &[(&str, &MrDesc)],
        ttl: Duration,
    ) -> Result<Publication> {
        record::check_name("peer", name)?;
        for (r, _) in regions {
            record::check_name("region", r)?;
        }
        let record = Record {
            name: name.to_owned(),
            incarnation: fastrand::u64(1..),
            addr: addr.clone(),
            regions: regions
                .iter()
                .map(|(n, d)| ((*n).to_owned(), (*d).clone()))
                .collect(),
        };
        let ttl = ttl.max(Duration::from_secs(2));
        let (key, value) = (self.key(name), record::encode(&record));
        let started = Instant::now();
        let mut attempt = 0;
        let keeper = loop {
            match self.retrying(self.wait, || self.store.publish(&key, value.clone(), ttl)) {
                Err(Error::NameTaken { service, .. }) => {
                    let left = self.wait.saturating_sub(started.elapsed());
                    if left.is_zero() {
                        return Err(Error::NameTaken {
                            service,
                            name: name.to_owned(),
                        });
                    }
                    if attempt == 0 {
                        tracing::warn!("rendezvous {}: {name} is held by another publication; waiting up to {:?} for it to end", self.url, self.wait);
                    }
                    std::thread::sleep(retry::backoff(attempt).min(left));
                    attempt += 1;
                }
                other => break other?,
            }
        };
        Ok(Publication {
            _keeper: keeper,
            record,
        })
    }

    /// The record published under `name`, waiting up to `timeout` for it to appear (and
    /// for the service, if it is not reachable yet).
    pub fn lookup(&self, name: &str, timeout: Duration) -> Result<Record> {
        record::check_name("peer", name)?;
        let key = self.key(name);
        // A timeout too large to add to the clock waits without end.
        let deadline = Instant::now().checked_add(timeout);
        loop {
            let left = deadline.map_or(Duration::MAX, |d| {
                d.saturating_duration_since(Instant::now())
            });
            if let Some(v) = self.retrying(left, || self.store.get(&key))? {
                return record::decode(&key, &v);
            }
            if deadline.is_some_and(|d| Instant::now() >= d) {
                return Err(Error::NotFound {
                    name: name.to_owned(),
                    timeout,
                });
            }
            std::thread::sleep(Duration::from_millis(20));
        }
    }

    /// Everyone published now, by name. Values that are not records are skipped (and
    /// logged): a stray key must not hide everyone else.
    pub fn list(&self) -> Result<Vec<Record>> {
        let mut out = Vec::new();
        for (key, value) in self.retrying(self.wait, || self.store.list(&self.prefix))? {
            match record::decode(&key, &value) {
                Ok(r) => out.push(r),
                Err(e) => tracing::warn!("{e}"),
            }
        }
        out.sort_by(|a, b| a.name.cmp(&b.name));
        Ok(out)
    }

    /// Joins and leaves from now on (the current members first, as joins).
    pub fn watch(&self) -> Result<Watch> {
        Ok(Watch {
            changes: self.retrying(self.wait, || self.store.watch(&self.prefix))?,
            prefix: self.prefix.clone(),
        })
    }

    /// Connects to the config's `[rendezvous] url`; returns it with the config's TTL.
    pub fn from_config(config: &engine_core::Config) -> Result<(Self, Duration)> {
        let url = config
            .rendezvous
            .url
            .as_deref()
            .ok_or_else(|| Error::BadUrl {
                url: String::new(),
                why: format!("{} has no [rendezvous] url", config.source.display()),
            })?;
        let ttl = match config.rendezvous.ttl_ms {
            0 => Duration::from_secs(5),
            ms => Duration::from_millis(ms),
        };
        let r = &config.rendezvous;
        let options = ConnectOptions {
            wait: connect_wait(config),
            secret: Secret::from_file_or_env(config.security.secret_file.as_deref())?,
            etcd: EtcdSecurity {
                ca_file: r.etcd_ca_file.clone(),
                cert_file: r.etcd_cert_file.clone(),
                key_file: r.etcd_key_file.clone(),
                domain: r.etcd_domain.clone(),
                user: r.etcd_user.clone(),
                password_file: r.etcd_password_file.clone(),
            },
        };
        Ok((Self::connect_with(url, &options)?, ttl))
    }

    /// The URL this connects to.
    pub fn url(&self) -> &str {
        &self.url
    }
}

/// How long a client of `config` rides out an unreachable service: `[rendezvous]
/// connect_ms`, or [`DEFAULT_WAIT`] when it is 0 (unset).
pub fn connect_wait(config: &engine_core::Config) -> Duration {
    match config.rendezvous.connect_ms {
        0 => DEFAULT_WAIT,
        ms => Duration::from_millis(ms),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn urls_parse_and_bad_ones_say_why() {
        let u = parse_url("xfer://127.0.0.1:7000").unwrap();
        assert!(!u.etcd && u.endpoints == ["127.0.0.1:7000"] && u.prefix == "/xfer");
        let u = parse_url("etcd://a:1,b:2/cluster-1/").unwrap();
        assert!(u.etcd && u.endpoints == ["a:1", "b:2"] && u.prefix == "/cluster-1");
        for bad in [
            "http://a:1",
            "xfer://a",
            "xfer://a:port",
            "xfer://a:1,b:2",
            "etcd://:1",
            "etcd://a:1/bad prefix",
        ] {
            assert!(matches!(parse_url(bad), Err(Error::BadUrl { .. })), "{bad}");
        }
    }

    #[test]
    fn the_config_names_the_rendezvous() {
        let server = Server::start("127.0.0.1:0").unwrap();
        let text = format!(
            "backend = \"mock\"\n[[groups]]\nnics = [\"mock0\"]\n[rendezvous]\nurl = \"{}\"\nttl_ms = 3000\nconnect_ms = 1500\n",
            server.url()
        );
        let config = engine_core::Config::from_toml(&text, std::path::Path::new("t.toml")).unwrap();
        let (r, ttl) = Rendezvous::from_config(&config).unwrap();
        assert_eq!(
            (r.url(), ttl, connect_wait(&config)),
            (
                server.url().as_str(),
                Duration::from_secs(3),
                Duration::from_millis(1500)
            )
        );
        assert_eq!(connect_wait(&engine_core::Config::default()), DEFAULT_WAIT);
        let none = engine_core::Config::default();
        let e = Rendezvous::from_config(&none).unwrap_err().to_string();
        assert!(e.contains("no [rendezvous] url"), "{e}");
    }
}
