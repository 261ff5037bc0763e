//! The embedded rendezvous service (`xfer serve`): keys with leases and prefix watches over
//! TCP, in memory, with etcd's semantics for what the rendezvous uses — and nothing more.
//!
//! Frames are a 4-byte little-endian length and a postcard body. A watch has its own
//! connection, on which the server streams changes after the current entries.
//!
//! No client can exhaust it ([`Limits`]): connections are capped and idle ones closed,
//! values, entries and watchers are bounded, a client that does not take what it is sent
//! is cut off, and a request split across reads keeps its framing. Lease ids come from the
//! OS's CSPRNG. It does not authenticate clients (see `docs/security.md`).

use std::collections::{BTreeMap, BTreeSet, HashMap};
use std::io::{Read, Write};
use std::net::{SocketAddr, TcpListener, TcpStream};
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::mpsc::{channel, sync_channel, Receiver, SyncSender, TrySendError};
use std::sync::{Arc, Mutex};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use serde::{Deserialize, Serialize};

use crate::{Change, Changes, Error, Keeper, Result, Store};

/// Largest frame a client accepts: a listing of `max_entries` (default) values of
/// [`MAX_VALUE`] fits, so a listing never fails because someone stored large values.
const MAX_FRAME: usize = 128 << 20;

/// Largest request the service reads (a key and a value).
const MAX_REQUEST: usize = MAX_VALUE + 4096;

/// Largest value stored under a key: the largest record (256 named regions of 4 NICs each)
/// is about 77 KiB; a typical one is under 200 bytes.
pub const MAX_VALUE: usize = 96 << 10;

/// Longest lease: a name cannot be kept alive without keeping it alive.
pub const MAX_TTL: Duration = Duration::from_secs(3600);

/// How often a served connection looks up from its read (for the stop flag and idleness).
const READ_TICK: Duration = Duration::from_millis(500);

/// What the service bounds.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Limits {
    /// Connections served at once (request and watch connections); more are closed at once.
    pub max_connections: usize,
    /// A request connection with no request for this long is closed (clients reopen theirs
    /// on their next call).
    pub idle: Duration,
    /// A client that does not take an answer or a watch event within this is cut off.
    pub write_timeout: Duration,
    /// Keys stored at once; a put of a new key beyond it is refused. The default keeps a
    /// full listing within what a client reads in one frame (for more peers, use etcd).
    pub max_entries: usize,
    /// Watches at once; more are refused.
    pub max_watchers: usize,
    /// Changes queued for one watcher; a watcher that falls this far behind is cut off (it
    /// sees its watch end) rather than grow the service without bound.
    pub watch_queue: usize,
}

impl Default for Limits {
    fn default() -> Self {
        Self {
            max_connections: 1024,
            idle: Duration::from_secs(60),
            write_timeout: Duration::from_secs(5),
            max_entries: 1024,
            max_watchers: 256,
            watch_queue: 4096,
        }
    }
}

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

/// Reads frames from a stream whose reads time out, keeping a partial frame across
/// timeouts (a timeout mid-frame used to drop what was read and desynchronise the stream).
struct FrameReader {
    buf: Vec<u8>,
    limit: usize,
}

impl FrameReader {
    fn new(limit: usize) -> Self {
        Self {
            buf: Vec::new(),
            limit,
        }
    }

    /// The next whole frame; `None` if the read timed out first (what arrived is kept).
    fn next<T: for<'de> Deserialize<'de>>(
        &mut self,
        s: &mut TcpStream,
    ) -> std::io::Result<Option<T>> {
        loop {
            if self.buf.len() >= 4 {
                let len = u32::from_le_bytes(self.buf[..4].try_into().expect("4 bytes")) as usize;
                if len > self.limit {
                    return Err(std::io::Error::other(format!(
                        "a frame of {len} bytes (at most {})",
                        self.limit
                    )));
                }
                if self.buf.len() >= 4 + len {
                    let msg =
                        postcard::from_bytes(&self.buf[4..4 + len]).map_err(std::io::Error::other);
                    self.buf.drain(..4 + len);
                    return msg.map(Some);
                }
            }
            let mut chunk = [0u8; 4096];
            match s.read(&mut chunk) {
                Ok(0) => return Err(std::io::ErrorKind::UnexpectedEof.into()),
                Ok(n) => self.buf.extend_from_slice(&chunk[..n]),
                Err(e)
                    if matches!(
                        e.kind(),
                        std::io::ErrorKind::WouldBlock | std::io::ErrorKind::TimedOut
                    ) =>
                {
                    return Ok(None)
                }
                Err(e) => return Err(e),
            }
        }
    }
}

/// A `Get` request as bytes on the wire (tests that speak the protocol by hand).
#[doc(hidden)]
pub fn request_frame_for_tests(key: &str) -> Vec<u8> {
    let body = postcard::to_stdvec(&Request::Get {
        key: key.to_owned(),
    })
    .expect("a request serializes");
    let mut frame = (body.len() as u32).to_le_bytes().to_vec();
    frame.extend(body);
    frame
}

/// The value in a `Get` answer's body (tests that speak the protocol by hand).
#[doc(hidden)]
pub fn value_of_response_for_tests(body: &[u8]) -> Option<Vec<u8>> {
    match postcard::from_bytes(body).ok()? {
        Response::Value(v) => v,
        _ => None,
    }
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

struct State {
    entries: BTreeMap<String, (Vec<u8>, u64)>,
    leases: HashMap<u64, Lease>,
    watchers: Vec<(String, SyncSender<Change>)>,
    limits: Limits,
}

impl Default for State {
    fn default() -> Self {
        Self::new(Limits::default())
    }
}

/// A new lease id: 64 bits from the OS's CSPRNG, never 0.
fn new_lease_id() -> u64 {
    loop {
        let mut bytes = [0u8; 8];
        if getrandom::fill(&mut bytes).is_err() {
            // No OS randomness (never seen on Linux): still unique per run, not secret.
            return fastrand::u64(1..);
        }
        let id = u64::from_le_bytes(bytes);
        if id != 0 {
            return id;
        }
    }
}

impl State {
    fn new(limits: Limits) -> Self {
        Self {
            entries: BTreeMap::new(),
            leases: HashMap::new(),
            watchers: Vec::new(),
            limits,
        }
    }

    fn notify(&mut self, change: &Change) {
        let key = match change {
            Change::Put(k, _) | Change::Delete(k) => k,
        };
        // A watcher whose queue is full has fallen behind: it is cut off (its stream ends),
        // not buffered for without bound.
        self.watchers.retain(|(prefix, tx)| {
            !key.starts_with(prefix.as_str())
                || match tx.try_send(change.clone()) {
                    Ok(()) => true,
                    Err(TrySendError::Full(_) | TrySendError::Disconnected(_)) => false,
                }
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
                if value.len() > MAX_VALUE {
                    return Response::Refused(format!(
                        "a value of {} bytes (at most {MAX_VALUE})",
                        value.len()
                    ));
                }
                if !self.entries.contains_key(&key) && self.entries.len() >= self.limits.max_entries
                {
                    return Response::Refused(format!(
                        "the service holds its maximum of {} keys",
                        self.limits.max_entries
                    ));
                }
                let lease = new_lease_id();
                let ttl = Duration::from_millis(ttl_ms.max(1)).min(MAX_TTL);
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

/// The connections being served, by id: each serving thread removes its own when it ends,
/// and a stopping service shuts them all down.
#[derive(Default)]
struct Connections {
    open: Mutex<HashMap<u64, TcpStream>>,
    next: AtomicU64,
}

impl Connections {
    fn lock(&self) -> std::sync::MutexGuard<'_, HashMap<u64, TcpStream>> {
        self.open.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// Registers `conn` (a clone of it, to shut it down at stop) unless `max` are served.
    fn admit(self: &Arc<Self>, conn: &TcpStream, max: usize) -> Option<Admitted> {
        let mut open = self.lock();
        if open.len() >= max {
            return None;
        }
        let clone = conn.try_clone().ok()?;
        let id = self.next.fetch_add(1, Ordering::Relaxed);
        open.insert(id, clone);
        Some(Admitted {
            id,
            all: Arc::clone(self),
        })
    }
}

/// A served connection's place in [`Connections`], given up (with its descriptor) when the
/// serving thread ends, however it ends.
struct Admitted {
    id: u64,
    all: Arc<Connections>,
}

impl Drop for Admitted {
    fn drop(&mut self) {
        self.all.lock().remove(&self.id);
    }
}

/// The embedded service, running on threads of this process until dropped.
pub struct Server {
    addr: SocketAddr,
    stop: Arc<AtomicBool>,
    threads: Vec<JoinHandle<()>>,
    /// Every served connection, shut down when the server stops: a stopped service must
    /// not keep answering from its old state on connections opened before.
    conns: Arc<Connections>,
}

impl Server {
    /// Listens on `listen` (`127.0.0.1:0` picks a free port; see [`addr`](Self::addr)) with
    /// the default [`Limits`].
    pub fn start(listen: &str) -> Result<Self> {
        Self::start_with(listen, Limits::default())
    }

    /// Listens on `listen` with `limits`.
    pub fn start_with(listen: &str, limits: Limits) -> Result<Self> {
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
        let state = Arc::new(Mutex::new(State::new(limits)));
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
        let conns = Arc::new(Connections::default());
        let accept = {
            let stop = Arc::clone(&stop);
            let conns = Arc::clone(&conns);
            std::thread::spawn(move || {
                let mut refused = 0u64;
                while !stop.load(Ordering::Acquire) {
                    match listener.accept() {
                        Ok((conn, peer)) => {
                            let Some(admitted) = conns.admit(&conn, limits.max_connections) else {
                                // Over the cap: closed at once (dropped here).
                                refused += 1;
                                if refused.is_power_of_two() {
                                    tracing::warn!(%peer, refused, max = limits.max_connections, "xfer serve: connection refused: the service serves its maximum");
                                }
                                continue;
                            };
                            let state = Arc::clone(&state);
                            let stop = Arc::clone(&stop);
                            std::thread::spawn(move || {
                                let _admitted = admitted;
                                serve(conn, &state, &stop, &limits);
                            });
                        }
                        // Nothing to accept, or out of descriptors for a moment: look again
                        // shortly (the served connections give theirs back as they end).
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

    /// Connections being served now.
    pub fn connections(&self) -> usize {
        self.conns.lock().len()
    }
}

impl Drop for Server {
    fn drop(&mut self) {
        self.stop.store(true, Ordering::Release);
        for t in self.threads.drain(..) {
            let _ = t.join();
        }
        for (_, c) in self.conns.lock().drain() {
            let _ = c.shutdown(std::net::Shutdown::Both);
        }
    }
}

fn lock(state: &Mutex<State>) -> std::sync::MutexGuard<'_, State> {
    state.lock().unwrap_or_else(|p| p.into_inner())
}

/// One client connection: requests until it closes or idles out, or a watch stream.
fn serve(mut conn: TcpStream, state: &Mutex<State>, stop: &AtomicBool, limits: &Limits) {
    let _ = conn.set_nonblocking(false);
    let _ = conn.set_nodelay(true);
    // Reads look up every tick (stop, idleness); a client that does not take its answers
    // is cut off.
    let _ = conn.set_read_timeout(Some(READ_TICK));
    let _ = conn.set_write_timeout(Some(limits.write_timeout));
    let mut reader = FrameReader::new(MAX_REQUEST);
    let mut last = Instant::now();
    while !stop.load(Ordering::Acquire) {
        let req: Request = match reader.next(&mut conn) {
            Ok(Some(r)) => r,
            Ok(None) if last.elapsed() >= limits.idle => return,
            Ok(None) => continue,
            Err(_) => return,
        };
        last = Instant::now();
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
    let current = {
        let mut s = lock(state);
        if s.watchers.len() >= s.limits.max_watchers {
            let max = s.limits.max_watchers;
            drop(s);
            let _ = write_frame(
                &mut conn,
                &Response::Refused(format!("the service serves its maximum of {max} watches")),
            );
            return;
        }
        let (tx, rx) = sync_channel(s.limits.watch_queue);
        s.watchers.push((prefix.clone(), tx));
        (s.handle(Request::List { prefix }), rx)
    };
    let (snapshot, rx) = current;
    if write_frame(&mut conn, &snapshot).is_err() {
        return;
    }
    while !stop.load(Ordering::Acquire) {
        let change = match rx.recv_timeout(Duration::from_millis(200)) {
            Ok(c) => c,
            Err(std::sync::mpsc::RecvTimeoutError::Timeout) => continue,
            // Cut off (fell behind) or the service is stopping.
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

    /// Issue 25: lease ids were sequential from 1 in every run, so a keeper of the old run
    /// got `Ok` for someone else's lease after a restart and its drop revoked another peer's
    /// record. Two runs never hand out the same id, and none is guessable from another.
    #[test]
    fn two_runs_never_hand_out_the_same_lease_id() {
        let leases = |s: &mut State| -> Vec<u64> {
            (0..100)
                .map(|i| {
                    match s.handle(Request::Put {
                        key: format!("/x/{i}"),
                        value: vec![],
                        ttl_ms: 1000,
                    }) {
                        Response::Lease(l) => l,
                        other => panic!("{other:?}"),
                    }
                })
                .collect()
        };
        let (first, second) = (leases(&mut State::default()), leases(&mut State::default()));
        assert!(
            first.iter().all(|l| !second.contains(l)),
            "{first:?} {second:?}"
        );
        // Not a counter: consecutive ids are not neighbours.
        assert!(first.windows(2).all(|w| w[1].abs_diff(w[0]) > 1_000_000));
    }

    /// Issue 25: a TTL has a ceiling, so a client cannot keep a name alive for ever without
    /// keeping it alive.
    #[test]
    fn ttls_have_a_ceiling() {
        let mut s = State::default();
        s.handle(Request::Put {
            key: "/x/forever".into(),
            value: vec![],
            ttl_ms: u64::MAX,
        });
        s.expire(Instant::now() + MAX_TTL + Duration::from_secs(1));
        assert!(matches!(
            s.handle(Request::Get {
                key: "/x/forever".into()
            }),
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
