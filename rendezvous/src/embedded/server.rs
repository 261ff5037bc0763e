//! The service's threads: accepting (within the connection cap), serving each connection
//! (requests, or a watch stream), expiring leases.

use std::collections::HashMap;
use std::io::Write;
use std::net::{IpAddr, SocketAddr, TcpListener, TcpStream};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::mpsc::sync_channel;
use std::sync::{Arc, Mutex};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use super::admission::{Admission, Admit};
use super::answer;
use super::budget::{Account, Budget};
use super::state::State;
use super::wire::{write_frame, FrameReader, Request, Response};
use super::{Limits, GREETING, HEARTBEAT, MAX_REQUEST, READ_TICK};
use crate::secret::{nonce, Role, Secret, SECRET_FILE_ENV};
use crate::{Change, Error, Result};

/// The connections being served: which ones ([`Admission`]) and their streams, by id.
/// Each serving thread gives its own back when it ends; an evicted one is shut down here
/// (its thread sees the end of its stream); a stopping service shuts them all down.
struct Connections {
    served: Mutex<Open>,
}

struct Open {
    admission: Admission,
    streams: HashMap<u64, TcpStream>,
}

impl Connections {
    fn new(limits: &Limits) -> Self {
        Self {
            served: Mutex::new(Open {
                admission: Admission::new(limits),
                streams: HashMap::new(),
            }),
        }
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, Open> {
        self.served.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// Registers `conn` from `source` (a clone of it, to shut it down at stop or when a
    /// newer connection takes its place), shutting down the connection it displaces, if
    /// any (then `.1` is `true`); `None`: refused.
    fn admit(self: &Arc<Self>, conn: &TcpStream, source: IpAddr) -> Option<(Admitted, bool)> {
        let clone = conn.try_clone().ok()?;
        let mut served = self.lock();
        let Admit::Yes { id, evict } = served.admission.handle_arrival(source) else {
            return None;
        };
        if let Some(victim) = evict.and_then(|v| served.streams.remove(&v)) {
            let _ = victim.shutdown(std::net::Shutdown::Both);
        }
        served.streams.insert(id, clone);
        let admitted = Admitted {
            id,
            all: Arc::clone(self),
        };
        Some((admitted, evict.is_some()))
    }
}

/// A served connection's place in [`Connections`], given up (with its descriptor) when the
/// serving thread ends, however it ends.
struct Admitted {
    id: u64,
    all: Arc<Connections>,
}

impl Admitted {
    /// Its greeting is done: from now on no newcomer takes its place. `false`: one already
    /// did (it is being shut down).
    fn authenticated(&self) -> bool {
        self.all.lock().admission.handle_authenticated(self.id)
    }
}

impl Drop for Admitted {
    fn drop(&mut self) {
        let mut served = self.all.lock();
        served.admission.handle_close(self.id);
        served.streams.remove(&self.id);
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
    /// The bytes held for clients (answers being written, watch changes queued).
    budget: Arc<Budget>,
}

impl Server {
    /// Listens on `listen` (`127.0.0.1:0` picks a free port; see [`addr`](Self::addr)) with
    /// the default [`Limits`] and no secret: loopback addresses only.
    pub fn start(listen: &str) -> Result<Self> {
        Self::start_with(listen, Limits::default(), None)
    }

    /// Listens on `listen` with `limits`. With a `secret`, every client must prove it (and
    /// the service proves it to them) before any request; without one, the service binds
    /// loopback addresses only (anyone who can connect can publish and read every record).
    pub fn start_with(listen: &str, limits: Limits, secret: Option<Secret>) -> Result<Self> {
        let service = |why: String| Error::Service {
            service: listen.to_owned(),
            why,
        };
        if let Some(why) = limits.unusable() {
            return Err(service(why));
        }
        let addrs: Vec<SocketAddr> = std::net::ToSocketAddrs::to_socket_addrs(listen)
            .map_err(|e| service(format!("cannot resolve: {e}")))?
            .collect();
        if secret.is_none() && addrs.iter().any(|a| !a.ip().is_loopback()) {
            return Err(service(format!(
                "without a cluster secret the service listens on loopback addresses only (anyone who can connect can publish and read every record); set one (--secret-file, ${SECRET_FILE_ENV}) or listen on 127.0.0.1"
            )));
        }
        match &secret {
            Some(_) => tracing::info!("xfer serve: clients must prove the cluster secret"),
            None => tracing::info!("xfer serve: no cluster secret: serving loopback only"),
        }
        let listener =
            TcpListener::bind(&addrs[..]).map_err(|e| service(format!("cannot listen: {e}")))?;
        let addr = listener.local_addr().map_err(|e| service(e.to_string()))?;
        listener
            .set_nonblocking(true)
            .map_err(|e| service(e.to_string()))?;
        let state = Arc::new(Mutex::new(State::new(limits)));
        let budget = Budget::new(&limits);
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
        let conns = Arc::new(Connections::new(&limits));
        let accept = {
            let stop = Arc::clone(&stop);
            let conns = Arc::clone(&conns);
            let budget = Arc::clone(&budget);
            std::thread::spawn(move || {
                let (mut refused, mut displaced) = (0u64, 0u64);
                while !stop.load(Ordering::Acquire) {
                    match listener.accept() {
                        Ok((conn, peer)) => {
                            let Some((admitted, evicted)) = conns.admit(&conn, peer.ip()) else {
                                // Every slot holds an authenticated connection: closed at
                                // once (dropped here).
                                refused += 1;
                                if refused.is_power_of_two() {
                                    tracing::warn!(%peer, refused, max = limits.max_connections, "xfer serve: connection refused: the service serves its maximum");
                                }
                                continue;
                            };
                            if evicted {
                                displaced += 1;
                                if displaced.is_power_of_two() {
                                    tracing::warn!(%peer, displaced, "xfer serve: a connection that had not greeted was closed to make room (the unauthenticated share, or this address's, is full)");
                                }
                            }
                            let state = Arc::clone(&state);
                            let stop = Arc::clone(&stop);
                            let secret = secret.clone();
                            let account = budget.account();
                            std::thread::spawn(move || {
                                let served = Served {
                                    admitted: &admitted,
                                    state: &state,
                                    stop: &stop,
                                    limits: &limits,
                                    account,
                                };
                                served.serve(conn, secret.as_ref());
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
            budget,
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
        self.conns.lock().admission.len()
    }

    /// Bytes held now for clients: answers being written (until each client takes its
    /// answer, or is cut off) and watch changes queued ([`Limits::max_pending_bytes`]).
    pub fn pending_bytes(&self) -> u64 {
        self.budget.held()
    }
}

impl Drop for Server {
    fn drop(&mut self) {
        self.stop.store(true, Ordering::Release);
        for t in self.threads.drain(..) {
            let _ = t.join();
        }
        for (_, c) in self.conns.lock().streams.drain() {
            let _ = c.shutdown(std::net::Shutdown::Both);
        }
    }
}

fn lock(state: &Mutex<State>) -> std::sync::MutexGuard<'_, State> {
    state.lock().unwrap_or_else(|p| p.into_inner())
}

/// The next request, whole by `deadline` (`None`: not in time — however many bytes
/// trickled in —, broken, or the service is stopping).
fn next_request(
    conn: &mut TcpStream,
    reader: &mut FrameReader,
    stop: &AtomicBool,
    deadline: Instant,
) -> Option<Request> {
    while !stop.load(Ordering::Acquire) {
        match reader.next(conn, deadline) {
            Ok(Some(r)) => return Some(r),
            Ok(None) if Instant::now() >= deadline => return None,
            Ok(None) => continue,
            Err(_) => return None,
        }
    }
    None
}

/// The greeting every connection starts with: the client's `Hello`, the service's
/// `Welcome` and, with a secret, the mutual proof. `false`: the connection is to be closed.
fn greet(
    conn: &mut TcpStream,
    reader: &mut FrameReader,
    stop: &AtomicBool,
    limits: &Limits,
    secret: Option<&Secret>,
) -> bool {
    // One deadline for the whole greeting, before any proof: an unauthenticated client
    // holds its connection slot this long at most.
    let deadline = Instant::now() + limits.idle.min(GREETING);
    let Some(Request::Hello {
        nonce: client_nonce,
    }) = next_request(conn, reader, stop, deadline)
    else {
        let _ = write_frame(
            conn,
            &Response::Refused("a connection starts with Hello".into()),
        );
        return false;
    };
    let Some(secret) = secret else {
        return write_frame(conn, &Response::Welcome { challenge: None }).is_ok();
    };
    let service_nonce = nonce();
    let proof = secret.service_proof(&client_nonce, &service_nonce);
    if write_frame(
        conn,
        &Response::Welcome {
            challenge: Some((service_nonce, proof)),
        },
    )
    .is_err()
    {
        return false;
    }
    match next_request(conn, reader, stop, deadline) {
        Some(Request::Prove { proof })
            if secret.verify(Role::Client, &client_nonce, &service_nonce, &proof) =>
        {
            write_frame(conn, &Response::Ok).is_ok()
        }
        _ => {
            let peer = conn.peer_addr().map(|a| a.to_string()).unwrap_or_default();
            tracing::warn!(%peer, "xfer serve: a client did not prove the cluster secret; closed");
            let _ = write_frame(
                conn,
                &Response::Refused("the client did not prove the cluster secret".into()),
            );
            false
        }
    }
}

/// One served connection's context: its place, the state, the stop flag, the limits and
/// its account of bytes held.
struct Served<'a> {
    admitted: &'a Admitted,
    state: &'a Mutex<State>,
    stop: &'a AtomicBool,
    limits: &'a Limits,
    account: Arc<Account>,
}

/// A watch's slot in the state, given back when its stream ends, however it ends.
struct WatchSlot<'a> {
    state: &'a Mutex<State>,
    id: u64,
}

impl Drop for WatchSlot<'_> {
    fn drop(&mut self) {
        lock(self.state).end_watch(self.id);
    }
}

impl Served<'_> {
    /// Writes all of `frame`, which the client must take within `write_timeout`, whole:
    /// `SO_SNDTIMEO` alone bounds each `send()`, so a client that reads a little now and then
    /// kept an answer (and its share of the byte budget) for as long as it liked.
    fn write_whole(&self, conn: &mut TcpStream, frame: &[u8]) -> std::io::Result<()> {
        let deadline = Instant::now() + self.limits.write_timeout;
        let mut rest = frame;
        while !rest.is_empty() {
            let left = deadline.saturating_duration_since(Instant::now());
            if left.is_zero() {
                return Err(std::io::ErrorKind::TimedOut.into());
            }
            conn.set_write_timeout(Some(left))?;
            match conn.write(rest) {
                Ok(0) => return Err(std::io::ErrorKind::WriteZero.into()),
                Ok(n) => rest = &rest[n..],
                Err(e) if e.kind() == std::io::ErrorKind::Interrupted => {}
                Err(e) => return Err(e),
            }
        }
        Ok(())
    }

    /// The greeting, then requests until the client closes or idles out, or a watch stream.
    fn serve(&self, mut conn: TcpStream, secret: Option<&Secret>) {
        let _ = conn.set_nonblocking(false);
        let _ = conn.set_nodelay(true);
        // Reads look up every tick (stop, idleness); a client that does not take its answers
        // is cut off.
        let _ = conn.set_read_timeout(Some(READ_TICK));
        let _ = conn.set_write_timeout(Some(self.limits.write_timeout));
        let mut reader = FrameReader::new(MAX_REQUEST);
        if !greet(&mut conn, &mut reader, self.stop, self.limits, secret)
            || !self.admitted.authenticated()
        {
            return;
        }
        while let Some(req) = next_request(
            &mut conn,
            &mut reader,
            self.stop,
            Instant::now() + self.limits.idle,
        ) {
            if let Request::Watch { prefix } = req {
                return self.stream_watch(conn, prefix);
            }
            let answer = match req {
                Request::List { prefix } => {
                    let s = lock(self.state);
                    answer::listing(s.list(&prefix), &self.account)
                        .unwrap_or_else(|refusal| answer::small(&refusal, &self.account))
                }
                req => {
                    let resp = lock(self.state).handle(req);
                    answer::small(&resp, &self.account)
                }
            };
            // Held (and counted) until the client has taken it, or is cut off.
            if self.write_whole(&mut conn, &answer.frame).is_err() {
                return;
            }
        }
    }

    fn stream_watch(&self, mut conn: TcpStream, prefix: String) {
        let state = self.state;
        // The snapshot and the registration under one lock: no change falls between them.
        let started = {
            let mut s = lock(state);
            let (tx, rx) = sync_channel(s.limits.watch_queue);
            let max = s.limits.max_watchers;
            let full =
                || Response::Refused(format!("the service serves its maximum of {max} watches"));
            if s.watching() >= max {
                Err(full())
            } else {
                answer::listing(s.list(&prefix), &self.account).and_then(|snapshot| {
                    s.start_watch(prefix.clone(), tx, Arc::clone(&self.account))
                        .map(|id| (id, snapshot, rx))
                        .ok_or_else(full)
                })
            }
        };
        let (id, snapshot, rx) = match started {
            Ok(started) => started,
            Err(refusal) => {
                let _ = write_frame(&mut conn, &refusal);
                return;
            }
        };
        let _slot = WatchSlot { state, id };
        if self.write_whole(&mut conn, &snapshot.frame).is_err() {
            return;
        }
        drop(snapshot);
        // A heartbeat on an idle stream: a client that went away fails the write (and this
        // thread, its descriptor and its watcher slot end); a client sees a service that went
        // silent by the heartbeats stopping.
        let mut last_write = Instant::now();
        while !self.stop.load(Ordering::Acquire) {
            // A change's bytes stay counted until it is written.
            let (msg, _held) = match rx.recv_timeout(Duration::from_millis(200)) {
                Ok((Change::Put(k, v), held)) => (Response::Put(k, v), Some(held)),
                Ok((Change::Delete(k), held)) => (Response::Delete(k), Some(held)),
                Err(std::sync::mpsc::RecvTimeoutError::Timeout)
                    if last_write.elapsed() >= HEARTBEAT =>
                {
                    (Response::Heartbeat, None)
                }
                Err(std::sync::mpsc::RecvTimeoutError::Timeout) => continue,
                // Cut off (fell behind) or the service is stopping.
                Err(_) => return,
            };
            let frame = answer::frame(&msg);
            drop(msg);
            if self.write_whole(&mut conn, &frame).is_err() {
                return;
            }
            last_write = Instant::now();
        }
    }
}
