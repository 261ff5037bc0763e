//! The service's threads: accepting (within the connection cap), serving each connection
//! (requests, or a watch stream), expiring leases.

use std::collections::HashMap;
use std::net::{SocketAddr, TcpListener, TcpStream};
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::mpsc::sync_channel;
use std::sync::{Arc, Mutex};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use super::state::State;
use super::wire::{write_frame, FrameReader, Request, Response};
use super::{Limits, MAX_REQUEST, READ_TICK};
use crate::{Change, Error, Result};

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
