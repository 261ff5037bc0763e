//! The client of the embedded service: the `Store` the rendezvous API uses, over one kept
//! connection (reopened after a failure), keepers on threads, watches on their own
//! connections.

use std::net::{SocketAddr, TcpStream};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::mpsc::{channel, Receiver};
use std::sync::{Arc, Mutex};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use super::wire::{read_frame, write_frame, Request, Response};
use crate::{Change, Changes, Error, Keeper, Result, Store};

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
