//! The rendezvous on etcd (v3 API, through `etcd-client`), behind the same blocking API:
//! one small tokio runtime per connection runs the client; publications keep their lease
//! alive from a task that also survives etcd restarts (reconnecting, and re-publishing if
//! the lease was lost).

use std::sync::Arc;
use std::time::Duration;

use etcd_client::{
    Client, Compare, CompareOp, ConnectOptions, EventType, GetOptions, PutOptions, Txn, TxnOp,
    WatchOptions,
};
use tokio::runtime::Runtime;
use tokio::sync::{mpsc, oneshot};

use crate::{retry, Change, Changes, Error, EtcdSecurity, Keeper, Result, Store};

/// Every etcd call gives up after this (the service is down or unreachable).
const CALL_TIMEOUT: Duration = Duration::from_secs(5);

pub(crate) struct EtcdStore {
    rt: Arc<Runtime>,
    client: Client,
    service: String,
}

fn service_error(service: &str, why: impl std::fmt::Display) -> Error {
    Error::Service {
        service: service.to_owned(),
        why: why.to_string(),
    }
}

/// An etcd client error as ours: a refused user, password or certificate is
/// [`Error::Authentication`] (waiting does not change it); no connection (or one that
/// broke, or a member without a leader yet) is [`Error::Unreachable`], which callers ride
/// out until their deadline; anything else is an answer ([`Error::Service`]).
fn classify(service: &str, e: etcd_client::Error) -> Error {
    use etcd_client::Error as E;
    use tonic::Code;
    // The whole chain: a transport error's cause (a certificate) is in its sources.
    let mut why = e.to_string();
    let mut source = std::error::Error::source(&e);
    while let Some(s) = source {
        why = format!("{why}: {s}");
        source = s.source();
    }
    let refused = match &e {
        E::GRpcStatus(status) => {
            matches!(
                status.code(),
                Code::Unauthenticated | Code::PermissionDenied
            ) || status.message().contains("authentication failed")
        }
        E::TransportError(_) | E::IoError(_) => why.contains("certificate"),
        _ => false,
    };
    if refused {
        return Error::Authentication {
            service: service.to_owned(),
            why,
        };
    }
    let unreachable = match &e {
        E::TransportError(_) | E::IoError(_) => true,
        E::GRpcStatus(status) => matches!(
            status.code(),
            Code::Unavailable | Code::DeadlineExceeded | Code::Cancelled | Code::Unknown
        ),
        _ => false,
    };
    if unreachable {
        Error::Unreachable {
            service: service.to_owned(),
            waited: Duration::ZERO,
            why,
        }
    } else {
        service_error(service, e)
    }
}

impl EtcdStore {
    /// Connects to `endpoints` (of `url`), riding out an etcd that is not up yet for `wait`,
    /// with `security`'s TLS and user.
    pub(crate) fn connect(
        url: &str,
        endpoints: &[String],
        wait: Duration,
        security: &EtcdSecurity,
    ) -> Result<Self> {
        let service = url.to_owned();
        let rt = tokio::runtime::Builder::new_multi_thread()
            .worker_threads(1)
            .thread_name("xfer-etcd")
            .enable_all()
            .build()
            .map_err(|e| service_error(&service, format!("cannot start its runtime: {e}")))?;
        let secured = secure(security)?;
        let client = retry::until(url, wait, || {
            let options = secured(
                ConnectOptions::new()
                    .with_connect_timeout(CALL_TIMEOUT)
                    .with_timeout(CALL_TIMEOUT),
            );
            let mut client = rt
                .block_on(Client::connect(endpoints, Some(options)))
                .map_err(|e| classify(&service, e))?;
            // Fail now, with the reason, if nothing answers there.
            rt.block_on(client.get("/xfer-connect-check", None))
                .map_err(|e| classify(&service, e))?;
            Ok(client)
        })?;
        Ok(Self {
            rt: Arc::new(rt),
            client,
            service,
        })
    }

    fn err(&self, e: etcd_client::Error) -> Error {
        classify(&self.service, e)
    }
}

/// Reads `security`'s files once and returns what adds them to a connection's options.
fn secure(security: &EtcdSecurity) -> Result<impl Fn(ConnectOptions) -> ConnectOptions> {
    use etcd_client::{Certificate, Identity, TlsOptions};
    let read = |path: &std::path::Path| {
        std::fs::read(path).map_err(|e| Error::Credentials {
            path: path.to_owned(),
            why: e.to_string(),
        })
    };
    // The client's private key and the password: refused while other users may read them,
    // as the cluster secret is (issue 56), before they are read.
    let read_private = |path: &std::path::Path| {
        #[cfg(unix)]
        {
            use std::os::unix::fs::PermissionsExt;
            let mode = std::fs::metadata(path)
                .map_err(|e| Error::Credentials {
                    path: path.to_owned(),
                    why: e.to_string(),
                })?
                .permissions()
                .mode();
            if mode & 0o077 != 0 {
                return Err(Error::Credentials {
                    path: path.to_owned(),
                    why: format!(
                        "the file's mode is {:o}: other users may read it (`chmod 600` it, or \
                         `defaultMode: 0400` on a Kubernetes secret volume)",
                        mode & 0o777
                    ),
                });
            }
        }
        read(path)
    };
    let tls_asked = security.ca_file.is_some()
        || security.cert_file.is_some()
        || security.key_file.is_some()
        || security.domain.is_some();
    let tls = match &security.ca_file {
        None if tls_asked => {
            return Err(Error::Credentials {
                path: Default::default(),
                why: "etcd over TLS needs etcd_ca_file (the CA that signed etcd's certificate)"
                    .into(),
            })
        }
        None => None,
        Some(ca) => {
            let mut tls = TlsOptions::new().ca_certificate(Certificate::from_pem(read(ca)?));
            match (&security.cert_file, &security.key_file) {
                (Some(cert), Some(key)) => {
                    tls = tls.identity(Identity::from_pem(read(cert)?, read_private(key)?));
                }
                (None, None) => {}
                (Some(p), None) | (None, Some(p)) => {
                    return Err(Error::Credentials {
                        path: p.clone(),
                        why: "a client certificate needs both etcd_cert_file and etcd_key_file"
                            .into(),
                    })
                }
            }
            if let Some(domain) = &security.domain {
                tls = tls.domain_name(domain.clone());
            }
            Some(tls)
        }
    };
    let user = match (&security.user, &security.password_file) {
        (Some(_), Some(file)) if tls.is_none() => {
            return Err(Error::Credentials {
                path: file.clone(),
                why: "etcd_user's password would cross the network in cleartext: etcd's user \
                      authentication needs TLS (etcd_ca_file)"
                    .into(),
            })
        }
        (Some(user), Some(file)) => {
            let password =
                String::from_utf8(read_private(file)?).map_err(|_| Error::Credentials {
                    path: file.clone(),
                    why: "the password is not UTF-8".into(),
                })?;
            // A trailing newline (echo pw > file) is not part of the password.
            Some((
                user.clone(),
                password.trim_end_matches(['\n', '\r']).to_owned(),
            ))
        }
        (None, None) => None,
        (Some(_), None) => {
            return Err(Error::Credentials {
                path: Default::default(),
                why: "etcd_user needs etcd_password_file".into(),
            })
        }
        (None, Some(p)) => {
            return Err(Error::Credentials {
                path: p.clone(),
                why: "etcd_password_file needs etcd_user".into(),
            })
        }
    };
    Ok(move |mut options: ConnectOptions| {
        if let Some(tls) = &tls {
            options = options.with_tls(tls.clone());
        }
        if let Some((user, password)) = &user {
            options = options.with_user(user.clone(), password.clone());
        }
        options
    })
}

struct EtcdKeeper {
    stop: Option<oneshot::Sender<()>>,
    done: Option<std::sync::mpsc::Receiver<()>>,
}

impl Keeper for EtcdKeeper {}

impl Drop for EtcdKeeper {
    fn drop(&mut self) {
        if let Some(stop) = self.stop.take() {
            let _ = stop.send(());
        }
        // Wait (bounded) for the revoke, so a caller that unpublishes sees the name gone.
        if let Some(done) = self.done.take() {
            let _ = done.recv_timeout(CALL_TIMEOUT);
        }
    }
}

/// Puts `value` under `key` with a new lease, if the key is free or held by `owner` (the
/// lease we held): a key belongs to the lease that wrote it, as on the embedded service.
/// `Ok(None)`: another live lease holds it.
async fn grant_and_put(
    client: &mut Client,
    key: &str,
    value: &[u8],
    ttl: Duration,
    owner: Option<i64>,
) -> std::result::Result<Option<i64>, etcd_client::Error> {
    let lease = client
        .lease_grant(ttl.as_secs().max(1) as i64, None)
        .await?
        .id();
    let mut claims = vec![Compare::create_revision(key, CompareOp::Equal, 0)];
    claims.extend(owner.map(|o| Compare::lease(key, CompareOp::Equal, o)));
    for claim in claims {
        let put = TxnOp::put(key, value, Some(PutOptions::new().with_lease(lease)));
        if client
            .txn(Txn::new().when([claim]).and_then([put]))
            .await?
            .succeeded()
        {
            return Ok(Some(lease));
        }
    }
    let _ = client.lease_revoke(lease).await;
    Ok(None)
}

impl Store for EtcdStore {
    fn publish(&self, key: &str, value: Vec<u8>, ttl: Duration) -> Result<Box<dyn Keeper>> {
        let mut client = self.client.clone();
        let Some(mut lease) = self
            .rt
            .block_on(grant_and_put(&mut client, key, &value, ttl, None))
            .map_err(|e| self.err(e))?
        else {
            return Err(Error::NameTaken {
                service: self.service.clone(),
                name: key.to_owned(),
            });
        };
        let (stop_tx, mut stop_rx) = oneshot::channel();
        let (done_tx, done_rx) = std::sync::mpsc::channel();
        let key = key.to_owned();
        let period = ttl / 3;
        self.rt.spawn(async move {
            let mut reported = false;
            loop {
                tokio::select! {
                    _ = &mut stop_rx => break,
                    () = tokio::time::sleep(period) => {}
                }
                // One keep-alive round trip per period; on any failure, re-publish (the
                // lease may be gone: etcd restarted past the TTL, or we were cut off).
                let alive = async {
                    let (mut keeper, mut stream) = client.lease_keep_alive(lease).await?;
                    keeper.keep_alive().await?;
                    Ok::<_, etcd_client::Error>(
                        stream.message().await?.is_some_and(|r| r.ttl() > 0),
                    )
                };
                match tokio::time::timeout(CALL_TIMEOUT, alive).await {
                    Ok(Ok(true)) => {}
                    _ => match tokio::time::timeout(
                        CALL_TIMEOUT,
                        grant_and_put(&mut client, &key, &value, ttl, Some(lease)),
                    )
                    .await
                    {
                        Ok(Ok(Some(l))) => {
                            lease = l;
                            reported = false;
                        }
                        Ok(Ok(None)) if !reported => {
                            tracing::error!("rendezvous: {key} was taken by another publisher after this one's lease was lost; retrying every {period:?}");
                            reported = true;
                        }
                        _ => {}
                    },
                }
            }
            let _ = tokio::time::timeout(CALL_TIMEOUT, client.lease_revoke(lease)).await;
            let _ = done_tx.send(());
        });
        Ok(Box::new(EtcdKeeper {
            stop: Some(stop_tx),
            done: Some(done_rx),
        }))
    }

    fn get(&self, key: &str) -> Result<Option<Vec<u8>>> {
        let mut client = self.client.clone();
        let resp = self
            .rt
            .block_on(client.get(key, None))
            .map_err(|e| self.err(e))?;
        Ok(resp.kvs().first().map(|kv| kv.value().to_vec()))
    }

    fn list(&self, prefix: &str) -> Result<Vec<(String, Vec<u8>)>> {
        let mut client = self.client.clone();
        let resp = self
            .rt
            .block_on(client.get(prefix, Some(GetOptions::new().with_prefix())))
            .map_err(|e| self.err(e))?;
        Ok(resp
            .kvs()
            .iter()
            .map(|kv| {
                (
                    String::from_utf8_lossy(kv.key()).into_owned(),
                    kv.value().to_vec(),
                )
            })
            .collect())
    }

    fn watch(&self, prefix: &str) -> Result<Box<dyn Changes>> {
        // The current members first, then changes from the next revision on.
        let mut client = self.client.clone();
        let current = self
            .rt
            .block_on(client.get(prefix, Some(GetOptions::new().with_prefix())))
            .map_err(|e| self.err(e))?;
        let revision = current.header().map_or(0, |h| h.revision());
        let (tx, rx) = mpsc::unbounded_channel();
        for kv in current.kvs() {
            let _ = tx.send(Ok(Change::Put(
                String::from_utf8_lossy(kv.key()).into_owned(),
                kv.value().to_vec(),
            )));
        }
        let mut stream = self
            .rt
            .block_on(
                client.watch(
                    prefix,
                    Some(
                        WatchOptions::new()
                            .with_prefix()
                            .with_start_revision(revision + 1),
                    ),
                ),
            )
            .map_err(|e| self.err(e))?;
        let service = self.service.clone();
        self.rt.spawn(async move {
            loop {
                let msg = match stream.message().await {
                    Ok(Some(m)) => m,
                    Ok(None) => {
                        let _ = tx.send(Err("the watch ended".to_owned()));
                        return;
                    }
                    Err(e) => {
                        let _ = tx.send(Err(format!("the watch broke: {e}")));
                        return;
                    }
                };
                for ev in msg.events() {
                    let Some(kv) = ev.kv() else { continue };
                    let key = String::from_utf8_lossy(kv.key()).into_owned();
                    let change = match ev.event_type() {
                        EventType::Put => Change::Put(key, kv.value().to_vec()),
                        EventType::Delete => Change::Delete(key),
                    };
                    if tx.send(Ok(change)).is_err() {
                        return;
                    }
                }
            }
        });
        Ok(Box::new(EtcdChanges {
            rt: Arc::clone(&self.rt),
            rx,
            service,
        }))
    }
}

struct EtcdChanges {
    rt: Arc<Runtime>,
    rx: mpsc::UnboundedReceiver<std::result::Result<Change, String>>,
    service: String,
}

impl Changes for EtcdChanges {
    fn next(&mut self, timeout: Duration) -> Result<Option<Change>> {
        let rx = &mut self.rx;
        match self
            .rt
            .block_on(async { tokio::time::timeout(timeout, rx.recv()).await })
        {
            Ok(Some(Ok(c))) => Ok(Some(c)),
            Ok(Some(Err(why))) => Err(service_error(&self.service, why)),
            Ok(None) => Err(service_error(&self.service, "the watch ended")),
            Err(_) => Ok(None),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Issue 56: a client key or a password file other users may read is refused, naming
    /// its mode, before it is read.
    #[test]
    fn a_key_or_password_file_open_to_others_is_refused_by_mode() {
        use std::os::unix::fs::PermissionsExt;
        let dir = std::env::temp_dir().join(format!("xfer-etcd-modes-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let file = |name: &str, mode: u32| {
            let path = dir.join(name);
            std::fs::write(&path, "x\n").unwrap();
            std::fs::set_permissions(&path, std::fs::Permissions::from_mode(mode)).unwrap();
            path
        };
        let open_key = EtcdSecurity {
            ca_file: Some(file("ca.pem", 0o644)),
            cert_file: Some(file("client.pem", 0o644)),
            key_file: Some(file("client-key.pem", 0o644)),
            ..EtcdSecurity::default()
        };
        let text = secure(&open_key).err().expect("refused").to_string();
        assert!(
            text.contains("client-key.pem") && text.contains("644"),
            "{text}"
        );
        let open_password = EtcdSecurity {
            ca_file: Some(file("ca.pem", 0o644)),
            user: Some("root".into()),
            password_file: Some(file("password", 0o640)),
            ..EtcdSecurity::default()
        };
        let text = secure(&open_password).err().expect("refused").to_string();
        assert!(text.contains("password") && text.contains("640"), "{text}");
        let _ = std::fs::remove_dir_all(&dir);
    }

    /// Issue 42 §8: a user's password is never sent where the connection is not TLS.
    #[test]
    fn a_password_without_tls_is_refused_by_name() {
        let dir = std::env::temp_dir().join(format!("xfer-etcd-pw-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let file = dir.join("password");
        std::fs::write(&file, "hunter2\n").unwrap();
        let security = EtcdSecurity {
            user: Some("root".into()),
            password_file: Some(file),
            ..EtcdSecurity::default()
        };
        let err = secure(&security).err().expect("refused");
        let text = err.to_string();
        assert!(
            text.contains("cleartext") && text.contains("etcd_ca_file"),
            "{text}"
        );
        let _ = std::fs::remove_dir_all(&dir);
    }
}
