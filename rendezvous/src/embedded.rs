//! The embedded rendezvous service (`xfer serve`): keys with leases and prefix watches over
//! TCP, in memory, with etcd's semantics for what the rendezvous uses — and nothing more.
//!
//! Frames are a 4-byte little-endian length and a postcard body. A watch has its own
//! connection, on which the server streams changes after the current entries.

use std::collections::{BTreeMap, BTreeSet, HashMap};
use std::io::{Read, Write};
use std::net::{SocketAddr, TcpListener, TcpStream};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::mpsc::{channel, Receiver, Sender};
use std::sync::{Arc, Mutex};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use serde::{Deserialize, Serialize};

use crate::{Change, Changes, Error, Keeper, Result, Store};

/// Largest frame either side accepts (a record is far smaller).
const MAX_FRAME: usize = 4 << 20;

#[derive(Debug, Serialize, Deserialize)]
enum Request {
    Put {
        key: String,
        value: Vec<u8>,
        ttl_ms: u64,
    },
    KeepAlive {
        lease: u64,
    },
    Revoke {
        lease: u64,
    },
    Get {
        key: String,
    },
    List {
        prefix: String,
    },
    Watch {
        prefix: String,
    },
}

#[derive(Debug, Serialize, Deserialize)]
enum Response {
    Lease(u64),
    Ok,
    NoLease,
    Value(Option<Vec<u8>>),
    Values(Vec<(String, Vec<u8>)>),
    Put(String, Vec<u8>),
    Delete(String),
    Refused(String),
}

fn write_frame<T: Serialize>(s: &mut TcpStream, msg: &T) -> std::io::Result<()> {
    let body = postcard::to_stdvec(msg).map_err(std::io::Error::other)?;
    let mut frame = (body.len() as u32).to_le_bytes().to_vec();
    frame.extend(body);
    s.write_all(&frame)
}

fn read_frame<T: for<'de> Deserialize<'de>>(s: &mut TcpStream) -> std::io::Result<T> {
    let mut len = [0u8; 4];
    s.read_exact(&mut len)?;
    let len = u32::from_le_bytes(len) as usize;
    if len > MAX_FRAME {
        return Err(std::io::Error::other(format!("a frame of {len} bytes")));
    }
    let mut body = vec![0u8; len];
    s.read_exact(&mut body)?;
    postcard::from_bytes(&body).map_err(std::io::Error::other)
}

struct Lease {
    ttl: Duration,
    deadline: Instant,
    keys: BTreeSet<String>,
}

#[derive(Default)]
struct State {
    entries: BTreeMap<String, (Vec<u8>, u64)>,
    leases: HashMap<u64, Lease>,
    next_lease: u64,
    watchers: Vec<(String, Sender<Change>)>,
}

impl State {
    fn notify(&mut self, change: &Change) {
        let key = match change {
            Change::Put(k, _) | Change::Delete(k) => k,
        };
        self.watchers.retain(|(prefix, tx)| {
            !key.starts_with(prefix.as_str()) || tx.send(change.clone()).is_ok()
        });
    }

    fn revoke(&mut self, lease: u64) {
        let Some(l) = self.leases.remove(&lease) else {
            return;
        };
        for key in l.keys {
            if self
                .entries
                .get(&key)
                .is_some_and(|(_, owner)| *owner == lease)
            {
                self.entries.remove(&key);
                self.notify(&Change::Delete(key));
            }
        }
    }

    fn handle(&mut self, req: Request) -> Response {
        match req {
            Request::Put { key, value, ttl_ms } => {
                self.next_lease += 1;
                let lease = self.next_lease;
                let ttl = Duration::from_millis(ttl_ms.max(1));
                // The key moves to the new lease: the old one's expiry no longer removes it.
                if let Some((_, old)) = self.entries.get(&key) {
                    if let Some(l) = self.leases.get_mut(old) {
                        l.keys.remove(&key);
                    }
                }
                self.leases.insert(
                    lease,
                    Lease {
                        ttl,
                        deadline: Instant::now() + ttl,
                        keys: BTreeSet::from([key.clone()]),
                    },
                );
                self.entries.insert(key.clone(), (value.clone(), lease));
                self.notify(&Change::Put(key, value));
                Response::Lease(lease)
            }
            Request::KeepAlive { lease } => match self.leases.get_mut(&lease) {
                Some(l) => {
                    l.deadline = Instant::now() + l.ttl;
                    Response::Ok
                }
                None => Response::NoLease,
            },
            Request::Revoke { lease } => {
                self.revoke(lease);
                Response::Ok
            }
            Request::Get { key } => Response::Value(self.entries.get(&key).map(|(v, _)| v.clone())),
            Request::List { prefix } => Response::Values(
                self.entries
                    .range(prefix.clone()..)
                    .take_while(|(k, _)| k.starts_with(&prefix))
                    .map(|(k, (v, _))| (k.clone(), v.clone()))
                    .collect(),
            ),
            Request::Watch { .. } => Response::Refused("watch on a request connection".into()),
        }
    }

    fn expire(&mut self, now: Instant) {
        let expired: Vec<u64> = self
            .leases
            .iter()
            .filter(|(_, l)| l.deadline <= now)
            .map(|(id, _)| *id)
            .collect();
        for lease in expired {
            self.revoke(lease);
        }
    }
}

/// The embedded service, running on threads of this process until dropped.
pub struct Server {
    addr: SocketAddr,
    stop: Arc<AtomicBool>,
    threads: Vec<JoinHandle<()>>,
    /// Every accepted connection, shut down when the server stops: a stopped service must
    /// not keep answering from its old state on connections opened before.
    conns: Arc<Mutex<Vec<TcpStream>>>,
}

impl Server {
    /// Listens on `listen` (`127.0.0.1:0` picks a free port; see [`addr`](Self::addr)).
    pub fn start(listen: &str) -> Result<Self> {
        let service = |why: String| Error::Service {
            service: listen.to_owned(),
            why,
        };
        let listener =
            TcpListener::bind(listen).map_err(|e| service(format!("cannot listen: {e}")))?;
        let addr = listener.local_addr().map_err(|e| service(e.to_string()))?;
        listener
            .set_nonblocking(true)
            .map_err(|e| service(e.to_string()))?;
        let state = Arc::new(Mutex::new(State::default()));
        let stop = Arc::new(AtomicBool::new(false));
        let expiry = {
            let (state, stop) = (Arc::clone(&state), Arc::clone(&stop));
            std::thread::spawn(move || {
                while !stop.load(Ordering::Acquire) {
                    lock(&state).expire(Instant::now());
                    std::thread::sleep(Duration::from_millis(20));
                }
            })
        };
        let conns = Arc::new(Mutex::new(Vec::new()));
        let accept = {
            let stop = Arc::clone(&stop);
            let conns = Arc::clone(&conns);
            std::thread::spawn(move || {
                while !stop.load(Ordering::Acquire) {
                    match listener.accept() {
                        Ok((conn, _)) => {
                            if let Ok(c) = conn.try_clone() {
                                let mut all = conns.lock().unwrap_or_else(|p| p.into_inner());
                                // Forget connections already closed (their peers went away).
                                all.retain(|c: &TcpStream| c.peer_addr().is_ok());
                                all.push(c);
                            }
                            let state = Arc::clone(&state);
                            let stop = Arc::clone(&stop);
                            std::thread::spawn(move || serve(conn, &state, &stop));
                        }
                        Err(_) => std::thread::sleep(Duration::from_millis(10)),
                    }
                }
            })
        };
        Ok(Self {
            addr,
            stop,
            threads: vec![expiry, accept],
            conns,
        })
    }

    /// Where it listens.
    pub fn addr(&self) -> SocketAddr {
        self.addr
    }

    /// Its URL (`xfer://addr`).
    pub fn url(&self) -> String {
        format!("xfer://{}", self.addr)
    }
}

impl Drop for Server {
    fn drop(&mut self) {
        self.stop.store(true, Ordering::Release);
        for t in self.threads.drain(..) {
            let _ = t.join();
        }
        for c in self
            .conns
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .drain(..)
        {
            let _ = c.shutdown(std::net::Shutdown::Both);
        }
    }
}

fn lock(state: &Mutex<State>) -> std::sync::MutexGuard<'_, State> {
    state.lock().unwrap_or_else(|p| p.into_inner())
}

/// One client connection: requests until it closes, or a watch stream.
fn serve(mut conn: TcpStream, state: &Mutex<State>, stop: &AtomicBool) {
    let _ = conn.set_nonblocking(false);
    let _ = conn.set_nodelay(true);
    // A peer that stops mid-frame must not hold a thread forever.
    let _ = conn.set_read_timeout(Some(Duration::from_millis(500)));
    while !stop.load(Ordering::Acquire) {
        let req: Request = match read_frame(&mut conn) {
            Ok(r) => r,
            Err(e)
                if matches!(
                    e.kind(),
                    std::io::ErrorKind::WouldBlock | std::io::ErrorKind::TimedOut
                ) =>
            {
                continue
            }
            Err(_) => return,
        };
        if let Request::Watch { prefix } = req {
            return stream_watch(conn, state, stop, prefix);
        }
        let resp = lock(state).handle(req);
        if write_frame(&mut conn, &resp).is_err() {
            return;
        }
    }
}

fn stream_watch(mut conn: TcpStream, state: &Mutex<State>, stop: &AtomicBool, prefix: String) {
    let (tx, rx) = channel();
    let current = {
        let mut s = lock(state);
        s.watchers.push((prefix.clone(), tx));
        s.handle(Request::List { prefix })
    };
    if write_frame(&mut conn, &current).is_err() {
        return;
    }
    while !stop.load(Ordering::Acquire) {
        let change = match rx.recv_timeout(Duration::from_millis(200)) {
            Ok(c) => c,
            Err(std::sync::mpsc::RecvTimeoutError::Timeout) => continue,
            Err(_) => return,
        };
        let msg = match change {
            Change::Put(k, v) => Response::Put(k, v),
            Change::Delete(k) => Response::Delete(k),
        };
        if write_frame(&mut conn, &msg).is_err() {
            return;
        }
    }
}

/// A client of the embedded service. It opens its connection on first use and reopens it
/// after a failure; failures to reach the service are [`Error::Unreachable`], which the
/// caller's retry loop rides out.
pub(crate) struct Client {
    /// The URL, for errors.
    service: String,
    addr: String,
    conn: Mutex<Option<TcpStream>>,
}

impl Client {
    pub(crate) fn new(service: &str, addr: &str) -> Self {
        Self {
            service: service.to_owned(),
            addr: addr.to_owned(),
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
                Ok(s) => {
                    let _ = s.set_nodelay(true);
                    let _ = s.set_read_timeout(Some(Duration::from_secs(5)));
                    return Ok(s);
                }
                Err(e) => last = format!("cannot connect to {a}: {e}"),
            }
        }
        Err(self.unreachable(last))
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
                Ok(Response::Refused(why)) => return Err(self.error(why)),
                Ok(r) => return Ok(r),
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

    fn clone_client(&self) -> Self {
        Self::new(&self.service, &self.addr)
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
        let put = |c: &Client| match c.call(Request::Put {
            key: key.to_owned(),
            value: value.clone(),
            ttl_ms: ttl.as_millis() as u64,
        })? {
            Response::Lease(l) => Ok(l),
            other => Err(c.error(format!("unexpected answer {other:?}"))),
        };
        let mut lease = put(self)?;
        let stop = Arc::new(AtomicBool::new(false));
        let client = self.clone_client();
        let (key, stopping) = (key.to_owned(), Arc::clone(&stop));
        let thread = std::thread::spawn(move || {
            let put = |c: &Client| match c.call(Request::Put {
                key: key.clone(),
                value: value.clone(),
                ttl_ms: ttl.as_millis() as u64,
            }) {
                Ok(Response::Lease(l)) => Some(l),
                _ => None,
            };
            let period = ttl / 3;
            let mut next = Instant::now() + period;
            while !stopping.load(Ordering::Acquire) {
                std::thread::sleep(Duration::from_millis(20).min(period));
                if Instant::now() < next {
                    continue;
                }
                next = Instant::now() + period;
                match client.call(Request::KeepAlive { lease }) {
                    Ok(Response::Ok) => {}
                    // Forgotten (the service restarted, or we were cut off past the TTL).
                    Ok(Response::NoLease) => {
                        if let Some(l) = put(&client) {
                            lease = l;
                        }
                    }
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
        let mut s = self.open()?;
        write_frame(
            &mut s,
            &Request::Watch {
                prefix: prefix.to_owned(),
            },
        )
        .map_err(|e| self.unreachable(e))?;
        let initial = match read_frame::<Response>(&mut s).map_err(|e| self.unreachable(e))? {
            Response::Values(v) => v,
            other => return Err(self.error(format!("unexpected answer {other:?}"))),
        };
        let (tx, rx) = channel();
        for (k, v) in initial {
            let _ = tx.send(Ok(Change::Put(k, v)));
        }
        let service = self.service.clone();
        let _ = s.set_read_timeout(None);
        std::thread::spawn(move || loop {
            let change = match read_frame::<Response>(&mut s) {
                Ok(Response::Put(k, v)) => Ok(Change::Put(k, v)),
                Ok(Response::Delete(k)) => Ok(Change::Delete(k)),
                Ok(other) => Err(format!("unexpected frame {other:?}")),
                Err(e) => Err(format!("the watch connection broke: {e}")),
            };
            let end = change.is_err();
            if tx.send(change).is_err() || end {
                return;
            }
        });
        Ok(Box::new(EmbeddedChanges { rx, service }))
    }
}

struct EmbeddedChanges {
    rx: Receiver<std::result::Result<Change, String>>,
    service: String,
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

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn leases_expire_and_a_replaced_key_outlives_its_old_lease() {
        let mut s = State::default();
        let Response::Lease(old) = s.handle(Request::Put {
            key: "/x/a".into(),
            value: b"1".to_vec(),
            ttl_ms: 10,
        }) else {
            panic!()
        };
        let Response::Lease(_new) = s.handle(Request::Put {
            key: "/x/a".into(),
            value: b"2".to_vec(),
            ttl_ms: 60_000,
        }) else {
            panic!()
        };
        s.expire(Instant::now() + Duration::from_millis(20));
        assert!(matches!(
            s.handle(Request::KeepAlive { lease: old }),
            Response::NoLease
        ));
        assert!(
            matches!(s.handle(Request::Get { key: "/x/a".into() }), Response::Value(Some(v)) if v == b"2")
        );
        s.expire(Instant::now() + Duration::from_secs(61));
        assert!(matches!(
            s.handle(Request::Get { key: "/x/a".into() }),
            Response::Value(None)
        ));
    }

    #[test]
    fn list_stays_inside_its_prefix() {
        let mut s = State::default();
        for k in ["/x/a", "/x/b", "/xa", "/y"] {
            s.handle(Request::Put {
                key: k.into(),
                value: vec![],
                ttl_ms: 1000,
            });
        }
        let Response::Values(v) = s.handle(Request::List {
            prefix: "/x/".into(),
        }) else {
            panic!()
        };
        let keys: Vec<_> = v.into_iter().map(|(k, _)| k).collect();
        assert_eq!(keys, ["/x/a", "/x/b"]);
    }
}
