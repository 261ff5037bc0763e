//! The client of the embedded service: the `Store` the rendezvous API uses, over one kept
//! connection (reopened after a failure), keepers on threads, watches on their own
//! connections.

use std::collections::HashMap;
use std::net::{SocketAddr, TcpStream};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::mpsc::{channel, Receiver, Sender};
use std::sync::{Arc, Mutex};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use super::wire::{read_frame, write_frame, Request, Response};
use super::WATCH_SILENCE;
use crate::secret::{nonce, Role, Secret};
use crate::{retry, Change, Changes, Error, Keeper, Result, Store};

/// Keys and values under a prefix.
type Entries = Vec<(String, Vec<u8>)>;

/// A client of the embedded service. It opens its connection on first use and reopens it
/// after a failure; failures to reach the service are [`Error::Unreachable`], which the
/// caller's retry loop rides out. Every connection starts with the greeting (and, when
/// either side has a secret, the mutual proof).
pub(crate) struct Client {
    /// The URL, for errors.
    service: String,
    addr: String,
    secret: Option<Secret>,
    /// How long a watch rides out a broken stream, resubscribing, before it ends.
    wait: Duration,
    conn: Mutex<Option<TcpStream>>,
}

impl Client {
    pub(crate) fn new(service: &str, addr: &str, secret: Option<Secret>, wait: Duration) -> Self {
        Self {
            service: service.to_owned(),
            addr: addr.to_owned(),
            secret,
            wait,
            conn: Mutex::new(None),
        }
    }

    /// One round trip that changes nothing: the service is there and speaks our protocol.
    pub(crate) fn probe(&self) -> Result<()> {
        match self.call(Request::List {
            prefix: "\u{0}".into(),
        })? {
            Response::Values(_) => Ok(()),
            other => Err(self.error(format!("unexpected answer {other:?}"))),
        }
    }

    /// The service answered wrongly (not retried).
    fn error(&self, why: impl std::fmt::Display) -> Error {
        Error::Service {
            service: self.service.clone(),
            why: why.to_string(),
        }
    }

    /// The service could not be reached (retried by the caller until its deadline).
    fn unreachable(&self, why: impl std::fmt::Display) -> Error {
        Error::Unreachable {
            service: self.service.clone(),
            waited: Duration::ZERO,
            why: why.to_string(),
        }
    }

    fn open(&self) -> Result<TcpStream> {
        let addrs: Vec<SocketAddr> = std::net::ToSocketAddrs::to_socket_addrs(&self.addr)
            .map_err(|e| self.unreachable(format!("cannot resolve {}: {e}", self.addr)))?
            .collect();
        let mut last = format!("{} resolves to no address", self.addr);
        for a in &addrs {
            match TcpStream::connect_timeout(a, Duration::from_secs(2)) {
                Ok(mut s) => {
                    let _ = s.set_nodelay(true);
                    let _ = s.set_read_timeout(Some(Duration::from_secs(5)));
                    self.greet(&mut s)?;
                    return Ok(s);
                }
                Err(e) => last = format!("cannot connect to {a}: {e}"),
            }
        }
        Err(self.unreachable(last))
    }

    fn refused(&self, why: impl std::fmt::Display) -> Error {
        Error::Authentication {
            service: self.service.clone(),
            why: why.to_string(),
        }
    }

    /// The greeting: our nonce, the service's welcome and, when it has a secret, its proof
    /// checked and ours sent. A service and a client that do not share a secret (either
    /// has none, or they differ) are [`Error::Authentication`], not retried.
    fn greet(&self, s: &mut TcpStream) -> Result<()> {
        let broke = |e: std::io::Error| self.unreachable(format!("the greeting broke: {e}"));
        let client_nonce = nonce();
        write_frame(
            s,
            &Request::Hello {
                nonce: client_nonce,
            },
        )
        .map_err(broke)?;
        let (service_nonce, proof) = match read_frame::<Response>(s).map_err(broke)? {
            Response::Welcome { challenge: None } => {
                return match self.secret {
                    None => Ok(()),
                    Some(_) => Err(self.refused(
                        "the service has no cluster secret, but this client has one: refusing a service that anyone could be running",
                    )),
                };
            }
            Response::Welcome { challenge: Some(c) } => c,
            Response::Refused(why) => return Err(self.error(why)),
            other => return Err(self.error(format!("unexpected greeting {other:?}"))),
        };
        let Some(secret) = &self.secret else {
            return Err(self.refused(format!(
                "the service requires the cluster secret; give this client one ([security] secret_file, or ${})",
                crate::SECRET_FILE_ENV
            )));
        };
        if !secret.verify(Role::Service, &client_nonce, &service_nonce, &proof) {
            return Err(self.refused(
                "the service did not prove the cluster secret (its secret differs from this client's)",
            ));
        }
        let mine = secret.client_proof(&client_nonce, &service_nonce);
        write_frame(s, &Request::Prove { proof: mine }).map_err(broke)?;
        match read_frame::<Response>(s) {
            Ok(Response::Ok) => Ok(()),
            Ok(Response::Refused(why)) => Err(self.refused(why)),
            Ok(other) => Err(self.error(format!("unexpected greeting {other:?}"))),
            // A service that closes on our proof did not take it.
            Err(e) => Err(self.refused(format!(
                "the service closed the connection on our proof: {e}"
            ))),
        }
    }

    /// One request and its response. A kept connection that fails is reopened at once (the
    /// service may have restarted since it was opened); a fresh one that fails is
    /// [`Error::Unreachable`].
    fn call(&self, req: Request) -> Result<Response> {
        let mut conn = self.conn.lock().unwrap_or_else(|p| p.into_inner());
        let kept = conn.is_some();
        for fresh in [!kept, true] {
            if conn.is_none() {
                *conn = Some(self.open()?);
            }
            let s = conn.as_mut().expect("opened above");
            match write_frame(s, &req).and_then(|()| read_frame::<Response>(s)) {
                Ok(r) => return self.answer(r),
                Err(e) => {
                    *conn = None;
                    if fresh {
                        return Err(self.unreachable(format!("the connection broke: {e}")));
                    }
                }
            }
        }
        unreachable!("the second pass uses a fresh connection and returns")
    }

    /// An answer, or the error its refusal names.
    fn answer(&self, r: Response) -> Result<Response> {
        match r {
            Response::Refused(why) => Err(self.error(why)),
            Response::TooLarge { bytes, budget } => Err(Error::AnswerTooLarge {
                service: self.service.clone(),
                bytes,
                budget,
            }),
            Response::Busy {
                bytes,
                held,
                budget,
            } => Err(Error::Busy {
                service: self.service.clone(),
                bytes,
                held,
                budget,
            }),
            r => Ok(r),
        }
    }

    fn clone_client(&self) -> Self {
        Self::new(&self.service, &self.addr, self.secret.clone(), self.wait)
    }

    /// Puts `value` under `key` with a new lease, claiming `owner` (the lease that holds it,
    /// if we do): `Ok(None)` when another live lease holds the key.
    fn put(
        &self,
        key: &str,
        value: &[u8],
        ttl: Duration,
        owner: Option<u64>,
    ) -> Result<Option<u64>> {
        match self.call(Request::Put {
            key: key.to_owned(),
            value: value.to_vec(),
            ttl_ms: ttl.as_millis() as u64,
            owner,
        })? {
            Response::Lease(l) => Ok(Some(l)),
            Response::Taken => Ok(None),
            other => Err(self.error(format!("unexpected answer {other:?}"))),
        }
    }

    /// A watch connection on `prefix`: greeted, subscribed, and the current entries.
    fn subscribe(&self, prefix: &str) -> Result<(TcpStream, Entries)> {
        let mut s = self.open()?;
        write_frame(
            &mut s,
            &Request::Watch {
                prefix: prefix.to_owned(),
            },
        )
        .map_err(|e| self.unreachable(e))?;
        match self.answer(read_frame::<Response>(&mut s).map_err(|e| self.unreachable(e))?)? {
            Response::Values(v) => {
                // The service heartbeats an idle stream: silence this long means it is gone.
                let _ = s.set_read_timeout(Some(WATCH_SILENCE));
                Ok((s, v))
            }
            other => Err(self.error(format!("unexpected answer {other:?}"))),
        }
    }
}

/// Keeps one embedded lease alive from a thread; re-publishes if the service forgot it
/// (restarted); revokes it when dropped.
struct EmbeddedKeeper {
    stop: Arc<AtomicBool>,
    thread: Option<JoinHandle<()>>,
}

impl Keeper for EmbeddedKeeper {}

impl Drop for EmbeddedKeeper {
    fn drop(&mut self) {
        self.stop.store(true, Ordering::Release);
        if let Some(t) = self.thread.take() {
            let _ = t.join();
        }
    }
}

impl Store for Client {
    fn publish(&self, key: &str, value: Vec<u8>, ttl: Duration) -> Result<Box<dyn Keeper>> {
        let Some(mut lease) = self.put(key, &value, ttl, None)? else {
            return Err(Error::NameTaken {
                service: self.service.clone(),
                name: key.to_owned(),
            });
        };
        let stop = Arc::new(AtomicBool::new(false));
        let client = self.clone_client();
        let (key, stopping) = (key.to_owned(), Arc::clone(&stop));
        let thread = std::thread::spawn(move || {
            let period = ttl / 3;
            let mut next = Instant::now() + period;
            let mut reported = false;
            while !stopping.load(Ordering::Acquire) {
                std::thread::sleep(Duration::from_millis(20).min(period));
                if Instant::now() < next {
                    continue;
                }
                next = Instant::now() + period;
                match client.call(Request::KeepAlive { lease }) {
                    Ok(Response::Ok) => {}
                    // Forgotten (the service restarted, or we were cut off past the TTL):
                    // re-assert the name, claiming the lease we held.
                    Ok(Response::NoLease) => match client.put(&key, &value, ttl, Some(lease)) {
                        Ok(Some(l)) => {
                            lease = l;
                            reported = false;
                        }
                        Ok(None) if !reported => {
                            // Someone took the name while our lease was lost: say so once,
                            // and take it back if their lease ends.
                            tracing::error!("rendezvous: {key} was taken by another publisher after this one's lease was lost; retrying every {period:?}");
                            reported = true;
                        }
                        _ => {}
                    },
                    // Unreachable: keep trying; the lease may still be alive.
                    _ => next = Instant::now() + Duration::from_millis(100),
                }
            }
            let _ = client.call(Request::Revoke { lease });
        });
        Ok(Box::new(EmbeddedKeeper {
            stop,
            thread: Some(thread),
        }))
    }

    fn get(&self, key: &str) -> Result<Option<Vec<u8>>> {
        match self.call(Request::Get {
            key: key.to_owned(),
        })? {
            Response::Value(v) => Ok(v),
            other => Err(self.error(format!("unexpected answer {other:?}"))),
        }
    }

    fn list(&self, prefix: &str) -> Result<Vec<(String, Vec<u8>)>> {
        match self.call(Request::List {
            prefix: prefix.to_owned(),
        })? {
            Response::Values(v) => Ok(v),
            other => Err(self.error(format!("unexpected answer {other:?}"))),
        }
    }

    fn watch(&self, prefix: &str) -> Result<Box<dyn Changes>> {
        let (stream, initial) = self.subscribe(prefix)?;
        let (tx, rx) = channel();
        let mut known = HashMap::new();
        for (k, v) in initial {
            let _ = tx.send(Ok(Change::Put(k.clone(), v.clone())));
            known.insert(k, v);
        }
        let current = Arc::new(Mutex::new(stream.try_clone().ok()));
        let stop = Arc::new(AtomicBool::new(false));
        let follower = WatchFollower {
            client: self.clone_client(),
            prefix: prefix.to_owned(),
            tx,
            known,
            current: Arc::clone(&current),
            stop: Arc::clone(&stop),
        };
        std::thread::spawn(move || follower.run(stream));
        Ok(Box::new(EmbeddedChanges {
            rx,
            service: self.service.clone(),
            current,
            stop,
        }))
    }
}

/// The thread behind a watch: reads its stream, and when the stream breaks or goes silent
/// (the service restarted or hangs), subscribes again and reports what changed meanwhile.
struct WatchFollower {
    client: Client,
    prefix: String,
    tx: Sender<std::result::Result<Change, String>>,
    /// What the consumer has been told is there, to tell it the difference after a
    /// resubscription.
    known: HashMap<String, Vec<u8>>,
    /// The stream being read, for the consumer's drop to shut down.
    current: Arc<Mutex<Option<TcpStream>>>,
    stop: Arc<AtomicBool>,
}

impl WatchFollower {
    fn run(mut self, mut stream: TcpStream) {
        while !self.stop.load(Ordering::Acquire) {
            let change = match read_frame::<Response>(&mut stream) {
                Ok(Response::Put(k, v)) => {
                    self.known.insert(k.clone(), v.clone());
                    Change::Put(k, v)
                }
                Ok(Response::Delete(k)) => {
                    self.known.remove(&k);
                    Change::Delete(k)
                }
                Ok(Response::Heartbeat) => continue,
                Ok(other) => return self.end(format!("unexpected frame {other:?}")),
                Err(e) => match self.resubscribe(&e) {
                    Some(s) => {
                        stream = s;
                        continue;
                    }
                    None => return,
                },
            };
            if self.tx.send(Ok(change)).is_err() {
                return;
            }
        }
    }

    /// A new stream after `broke`, with the difference to what was known sent; `None`
    /// when the watch is over (dropped, or the service stayed away past the wait).
    fn resubscribe(&mut self, broke: &std::io::Error) -> Option<TcpStream> {
        if self.stop.load(Ordering::Acquire) {
            return None;
        }
        tracing::warn!(
            "rendezvous {}: the watch stream broke ({broke}); subscribing again",
            self.client.service
        );
        let (stream, now) = match retry::until(&self.client.service, self.client.wait, || {
            if self.stop.load(Ordering::Acquire) {
                return Err(self.client.error("the watch was dropped"));
            }
            self.client.subscribe(&self.prefix)
        }) {
            Ok(s) => s,
            Err(e) => {
                self.end(format!("the watch broke and could not resubscribe: {e}"));
                return None;
            }
        };
        *self.current.lock().unwrap_or_else(|p| p.into_inner()) = stream.try_clone().ok();
        let now: HashMap<String, Vec<u8>> = now.into_iter().collect();
        let mut changes: Vec<Change> = self
            .known
            .keys()
            .filter(|k| !now.contains_key(*k))
            .map(|k| Change::Delete(k.clone()))
            .collect();
        changes.extend(
            now.iter()
                .filter(|(k, v)| self.known.get(*k) != Some(v))
                .map(|(k, v)| Change::Put(k.clone(), v.clone())),
        );
        self.known = now;
        for c in changes {
            if self.tx.send(Ok(c)).is_err() {
                return None;
            }
        }
        Some(stream)
    }

    fn end(&self, why: String) {
        let _ = self.tx.send(Err(why));
    }
}

struct EmbeddedChanges {
    rx: Receiver<std::result::Result<Change, String>>,
    service: String,
    current: Arc<Mutex<Option<TcpStream>>>,
    stop: Arc<AtomicBool>,
}

/// A dropped watch ends its thread and its connection now (the service's thread follows
/// on its next write), not at the next change.
impl Drop for EmbeddedChanges {
    fn drop(&mut self) {
        self.stop.store(true, Ordering::Release);
        if let Some(s) = self
            .current
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .take()
        {
            let _ = s.shutdown(std::net::Shutdown::Both);
        }
    }
}

impl Changes for EmbeddedChanges {
    fn next(&mut self, timeout: Duration) -> Result<Option<Change>> {
        match self.rx.recv_timeout(timeout) {
            Ok(Ok(c)) => Ok(Some(c)),
            Ok(Err(why)) => Err(Error::Service {
                service: self.service.clone(),
                why,
            }),
            Err(std::sync::mpsc::RecvTimeoutError::Timeout) => Ok(None),
            Err(std::sync::mpsc::RecvTimeoutError::Disconnected) => Err(Error::Service {
                service: self.service.clone(),
                why: "the watch ended".into(),
            }),
        }
    }
}
