//! One suite, run against the embedded service and a real etcd (started here on 127.0.0.1
//! with random ports and a temporary data directory; `cargo xtask test` installs
//! `etcd-server` and sets `XFER_REQUIRE_ETCD=1`, elsewhere the etcd half is skipped when
//! there is no `etcd` binary).

use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

use engine_core::{MrDesc, NetAddr};
use xfer_rendezvous::{Error, Event, Rendezvous, Server};

const TTL: Duration = Duration::from_secs(2);
const WAIT: Duration = Duration::from_secs(30);

trait Service: Send {
    fn url(&self) -> String;
    /// Stops the service (etcd keeps its data).
    fn stop(&mut self);
    /// Starts it again at the same address, returning once it answers.
    fn resume(&mut self);
    /// Stops the service and starts it again at the same address.
    fn restart(&mut self) {
        self.stop();
        self.resume();
    }
}

struct Embedded {
    server: Option<Server>,
    addr: std::net::SocketAddr,
}

impl Embedded {
    fn start() -> Option<Self> {
        let server = Server::start("127.0.0.1:0").unwrap();
        Some(Self {
            addr: server.addr(),
            server: Some(server),
        })
    }
}

impl Service for Embedded {
    fn url(&self) -> String {
        format!("xfer://{}", self.addr)
    }

    fn stop(&mut self) {
        drop(self.server.take());
    }

    fn resume(&mut self) {
        let deadline = Instant::now() + WAIT;
        loop {
            match Server::start(&self.addr.to_string()) {
                Ok(s) => return self.server = Some(s),
                Err(e) if Instant::now() < deadline => {
                    eprintln!("restart: {e}");
                    std::thread::sleep(Duration::from_millis(100));
                }
                Err(e) => panic!("{e}"),
            }
        }
    }
}

#[cfg(feature = "etcd")]
struct Etcd {
    child: Option<std::process::Child>,
    dir: std::path::PathBuf,
    client: u16,
    peer: u16,
    /// With TLS: the directory of `make_certs`' files (the server requires client
    /// certificates), and what a client needs to get in.
    tls: Option<std::path::PathBuf>,
    security: xfer_rendezvous::EtcdSecurity,
}

fn free_port() -> u16 {
    std::net::TcpListener::bind("127.0.0.1:0")
        .unwrap()
        .local_addr()
        .unwrap()
        .port()
}

#[cfg(feature = "etcd")]
impl Etcd {
    fn start() -> Option<Self> {
        Self::start_with(None)
    }

    fn start_with(tls: Option<std::path::PathBuf>) -> Option<Self> {
        if Command::new("etcd").arg("--version").output().is_err() {
            assert!(
                std::env::var_os("XFER_REQUIRE_ETCD").is_none(),
                "XFER_REQUIRE_ETCD is set but there is no etcd binary (Debian: etcd-server)"
            );
            eprintln!("etcd suite SKIPPED: no etcd binary (Debian package etcd-server)");
            return None;
        }
        let dir = std::env::temp_dir().join(format!(
            "xfer-etcd-{}-{}",
            std::process::id(),
            fastrand_u64()
        ));
        let security = match &tls {
            Some(certs) => xfer_rendezvous::EtcdSecurity {
                ca_file: Some(certs.join("ca.pem")),
                cert_file: Some(certs.join("client.pem")),
                key_file: Some(certs.join("client-key.pem")),
                ..Default::default()
            },
            None => Default::default(),
        };
        let mut e = Self {
            child: None,
            dir,
            client: free_port(),
            peer: free_port(),
            tls,
            security,
        };
        e.spawn();
        Some(e)
    }

    fn options(&self, wait: Duration) -> xfer_rendezvous::ConnectOptions {
        xfer_rendezvous::ConnectOptions {
            wait,
            secret: None,
            etcd: self.security.clone(),
        }
    }

    fn spawn(&mut self) {
        let scheme = if self.tls.is_some() { "https" } else { "http" };
        let client = format!("{scheme}://127.0.0.1:{}", self.client);
        let peer = format!("http://127.0.0.1:{}", self.peer);
        let mut etcd = Command::new("etcd");
        if let Some(certs) = &self.tls {
            etcd.arg("--cert-file")
                .arg(certs.join("server.pem"))
                .arg("--key-file")
                .arg(certs.join("server-key.pem"))
                .arg("--trusted-ca-file")
                .arg(certs.join("ca.pem"))
                .arg("--client-cert-auth");
        }
        let child = etcd
            .args(["--name", "xfer-test", "--data-dir"])
            .arg(&self.dir)
            .args([
                "--listen-client-urls",
                &client,
                "--advertise-client-urls",
                &client,
            ])
            .args([
                "--listen-peer-urls",
                &peer,
                "--initial-advertise-peer-urls",
                &peer,
            ])
            .args(["--initial-cluster", &format!("xfer-test={peer}")])
            .args(["--log-level", "error"])
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .spawn()
            .unwrap();
        self.child = Some(child);
        let deadline = Instant::now() + WAIT;
        while Rendezvous::connect_with(&self.url(), &self.options(WAIT)).is_err() {
            assert!(
                Instant::now() < deadline,
                "etcd did not come up on {client}"
            );
            std::thread::sleep(Duration::from_millis(100));
        }
    }
}

#[cfg(feature = "etcd")]
fn fastrand_u64() -> u64 {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .unwrap()
        .subsec_nanos()
        .into()
}

#[cfg(feature = "etcd")]
impl Service for Etcd {
    fn url(&self) -> String {
        format!("etcd://127.0.0.1:{}/xfer-test", self.client)
    }

    fn stop(&mut self) {
        if let Some(mut c) = self.child.take() {
            let _ = c.kill();
            let _ = c.wait();
        }
    }

    fn resume(&mut self) {
        self.spawn();
    }
}

#[cfg(feature = "etcd")]
impl Drop for Etcd {
    fn drop(&mut self) {
        if let Some(mut c) = self.child.take() {
            let _ = c.kill();
            let _ = c.wait();
        }
        let _ = std::fs::remove_dir_all(&self.dir);
    }
}

fn addr(n: u8) -> NetAddr {
    NetAddr::new(&[n, 1, 2, 3, 4, 5]).unwrap()
}

fn desc(n: u8) -> MrDesc {
    MrDesc::new(0x1000 * u64::from(n), 4096, vec![(addr(n), 7)]).unwrap()
}

fn wait_for(what: &str, mut cond: impl FnMut() -> bool) {
    let deadline = Instant::now() + WAIT;
    while !cond() {
        assert!(Instant::now() < deadline, "timed out waiting for {what}");
        std::thread::sleep(Duration::from_millis(20));
    }
}

fn publish_lookup_list_and_unpublish(s: &mut dyn Service) {
    let r = Rendezvous::connect(&s.url()).unwrap();
    let p = r
        .publish("prefill-0", &addr(1), &[("kv-cache", &desc(1))], TTL)
        .unwrap();
    let got = r.lookup("prefill-0", WAIT).unwrap();
    assert_eq!(&got, p.record());
    assert_eq!(got.region("kv-cache"), Some(&desc(1)));
    let names: Vec<String> = r.list().unwrap().into_iter().map(|r| r.name).collect();
    assert!(names.contains(&"prefill-0".to_owned()), "{names:?}");
    p.unpublish();
    assert!(matches!(
        r.lookup("prefill-0", Duration::from_millis(100)),
        Err(Error::NotFound { .. })
    ));
    assert!(matches!(
        r.lookup("bad/name", WAIT),
        Err(Error::InvalidName { .. })
    ));
    assert!(matches!(
        r.publish("ok", &addr(1), &[("bad region", &desc(1))], TTL),
        Err(Error::InvalidName { .. })
    ));
}

fn lookup_waits_until_the_name_appears(s: &mut dyn Service) {
    let url = s.url();
    let late = std::thread::spawn(move || {
        std::thread::sleep(Duration::from_millis(300));
        let r = Rendezvous::connect(&url).unwrap();
        let p = r.publish("late-1", &addr(2), &[], TTL).unwrap();
        std::thread::sleep(Duration::from_secs(2));
        drop(p);
    });
    let r = Rendezvous::connect(&s.url()).unwrap();
    assert_eq!(r.lookup("late-1", WAIT).unwrap().addr, addr(2));
    late.join().unwrap();
}

fn watch_sees_joins_and_leaves(s: &mut dyn Service) {
    let r = Rendezvous::connect(&s.url()).unwrap();
    let early = r.publish("watch-early", &addr(3), &[], TTL).unwrap();
    let mut w = r.watch().unwrap();
    let mut joined = Vec::new();
    let p = r.publish("watch-late", &addr(4), &[], TTL).unwrap();
    drop(p);
    let mut left = Vec::new();
    let deadline = Instant::now() + WAIT;
    while !(joined.contains(&"watch-early".to_owned())
        && joined.contains(&"watch-late".to_owned())
        && left.contains(&"watch-late".to_owned()))
    {
        assert!(Instant::now() < deadline, "joined {joined:?} left {left:?}");
        match w.next(Duration::from_millis(200)).unwrap() {
            Some(Event::Joined(rec)) => joined.push(rec.name),
            Some(Event::Left { name }) => left.push(name),
            Some(Event::Malformed(e)) => panic!("{e}"),
            None => {}
        }
    }
    assert!(!left.contains(&"watch-early".to_owned()));
    drop(early);
}

/// A publisher in another process, killed outright: its name disappears within the TTL
/// (plus the service's own expiry granularity).
fn a_killed_process_disappears_within_the_ttl(s: &mut dyn Service) {
    let mut child = Command::new(std::env::current_exe().unwrap())
        .args(["--exact", "child_publisher", "--ignored", "--nocapture"])
        .env("XFER_RDV_CHILD_URL", s.url())
        .stdout(Stdio::null())
        .spawn()
        .unwrap();
    let r = Rendezvous::connect(&s.url()).unwrap();
    let rec = r.lookup("child-1", WAIT).unwrap();
    assert_eq!(rec.addr, addr(9));
    child.kill().unwrap();
    child.wait().unwrap();
    let killed = Instant::now();
    wait_for("the killed publisher to disappear", || {
        matches!(
            r.lookup("child-1", Duration::ZERO),
            Err(Error::NotFound { .. })
        )
    });
    // Semantics, not speed: it went away because its lease expired, not earlier.
    assert!(killed.elapsed() < WAIT);
}

/// Runs as the child process of `a_killed_process_disappears_within_the_ttl`.
#[test]
#[ignore = "the publisher process of a_killed_process_disappears_within_the_ttl"]
fn child_publisher() {
    let Some(url) = std::env::var_os("XFER_RDV_CHILD_URL") else {
        return;
    };
    let r = Rendezvous::connect(url.to_str().unwrap()).unwrap();
    let _p = r.publish("child-1", &addr(9), &[], TTL).unwrap();
    std::thread::sleep(Duration::from_secs(120));
}

/// A name belongs to the live publication holding it (issue 25 §1: anyone could take it
/// over): a second publisher is refused while the first lives, and gets the name once the
/// first ends (unpublished here; a killed process's lease ends within its TTL).
fn a_restarted_peer_takes_its_name_back_once_the_old_lease_ends(s: &mut dyn Service) {
    let r = Rendezvous::connect(&s.url()).unwrap();
    let first = r.publish("decode-7", &addr(5), &[], TTL).unwrap();
    let impatient = Rendezvous::connect_within(&s.url(), Duration::from_millis(300)).unwrap();
    match impatient.publish("decode-7", &addr(66), &[], TTL) {
        Err(Error::NameTaken { name, .. }) => assert_eq!(name, "decode-7"),
        other => panic!(
            "expected NameTaken, got {:?}",
            other.map(|p| p.record().clone())
        ),
    }
    assert_eq!(r.lookup("decode-7", WAIT).unwrap().addr, addr(5));
    // A publisher that waits gets the name as soon as the first lets go.
    let url = s.url();
    let waiting = std::thread::spawn(move || {
        let again = Rendezvous::connect(&url).unwrap();
        let p = again.publish("decode-7", &addr(6), &[], TTL).unwrap();
        (again, p)
    });
    std::thread::sleep(Duration::from_millis(300));
    let first_incarnation = first.record().incarnation;
    drop(first);
    let (_again, second) = waiting.join().unwrap();
    assert_ne!(first_incarnation, second.record().incarnation);
    let got = r.lookup("decode-7", WAIT).unwrap();
    assert_eq!(
        (got.addr, got.incarnation),
        (addr(6), second.record().incarnation)
    );
    std::thread::sleep(TTL + Duration::from_millis(500));
    assert_eq!(r.lookup("decode-7", WAIT).unwrap().addr, addr(6));
}

fn two_hundred_peers_publish_at_once(s: &mut dyn Service) {
    let url = s.url();
    let barrier = std::sync::Arc::new(std::sync::Barrier::new(200));
    let (tx, rx) = std::sync::mpsc::channel();
    let threads: Vec<_> = (0..200u32)
        .map(|i| {
            let (url, barrier, tx) = (url.clone(), barrier.clone(), tx.clone());
            std::thread::spawn(move || {
                let r = Rendezvous::connect(&url).unwrap();
                barrier.wait();
                let p = r
                    .publish(&format!("rank-{i}"), &addr(i as u8), &[], TTL)
                    .unwrap();
                tx.send(()).unwrap();
                std::thread::sleep(Duration::from_secs(2));
                drop(p);
            })
        })
        .collect();
    for _ in 0..200 {
        rx.recv_timeout(WAIT).unwrap();
    }
    let r = Rendezvous::connect(&url).unwrap();
    let ranks = r
        .list()
        .unwrap()
        .into_iter()
        .filter(|rec| rec.name.starts_with("rank-"))
        .count();
    assert_eq!(ranks, 200);
    for t in threads {
        t.join().unwrap();
    }
}

fn the_service_restarting_mid_run_is_survived(s: &mut dyn Service) {
    let r = Rendezvous::connect(&s.url()).unwrap();
    let p = r.publish("survivor", &addr(8), &[], TTL).unwrap();
    r.lookup("survivor", WAIT).unwrap();
    s.restart();
    // Calls during and after the restart return errors or answers, never panic; the
    // publication comes back (kept alive or re-published by its keeper).
    wait_for("the publication to be there after the restart", || {
        r.lookup("survivor", Duration::ZERO).is_ok()
    });
    let mut w = r.watch().unwrap();
    let mut seen = false;
    while let Some(ev) = w.next(Duration::from_millis(500)).unwrap() {
        seen |= matches!(ev, Event::Joined(ref rec) if rec.name == "survivor");
    }
    assert!(seen);
    drop(p);
}

/// Issue 23: while the service is down for two seconds, publish, lookup, list and watch
/// called in the gap ride it out, and a publisher keeps its name throughout.
fn calls_made_while_the_service_is_down_ride_it_out(s: &mut dyn Service) {
    let r = Rendezvous::connect(&s.url()).unwrap();
    let kept = r.publish("kept", &addr(2), &[], TTL).unwrap();
    s.stop();
    std::thread::scope(|scope| {
        scope.spawn(|| {
            std::thread::sleep(Duration::from_secs(2));
            s.resume();
        });
        // Called while nothing listens.
        let during = r.publish("during", &addr(3), &[], TTL).unwrap();
        assert_eq!(r.lookup("during", WAIT).unwrap().addr, addr(3));
        wait_for("the kept publication after the restart", || {
            r.lookup("kept", Duration::ZERO).is_ok()
        });
        let names: Vec<String> = r.list().unwrap().into_iter().map(|r| r.name).collect();
        assert!(names.contains(&"kept".to_owned()) && names.contains(&"during".to_owned()));
        let mut w = r.watch().unwrap();
        assert!(matches!(w.next(WAIT).unwrap(), Some(Event::Joined(_))));
        drop(during);
    });
    drop(kept);
}

macro_rules! suite {
    ($module:ident, $start:expr) => {
        mod $module {
            use super::*;
            fn run(check: fn(&mut dyn Service)) {
                if let Some(mut s) = $start {
                    check(&mut s);
                }
            }
            #[test]
            fn publish_lookup_list_and_unpublish() {
                run(super::publish_lookup_list_and_unpublish)
            }
            #[test]
            fn lookup_waits_until_the_name_appears() {
                run(super::lookup_waits_until_the_name_appears)
            }
            #[test]
            fn watch_sees_joins_and_leaves() {
                run(super::watch_sees_joins_and_leaves)
            }
            #[test]
            fn a_killed_process_disappears_within_the_ttl() {
                run(super::a_killed_process_disappears_within_the_ttl)
            }
            #[test]
            fn a_restarted_peer_takes_its_name_back_once_the_old_lease_ends() {
                run(super::a_restarted_peer_takes_its_name_back_once_the_old_lease_ends)
            }
            #[test]
            fn two_hundred_peers_publish_at_once() {
                run(super::two_hundred_peers_publish_at_once)
            }
            #[test]
            fn the_service_restarting_mid_run_is_survived() {
                run(super::the_service_restarting_mid_run_is_survived)
            }
            #[test]
            fn calls_made_while_the_service_is_down_ride_it_out() {
                run(super::calls_made_while_the_service_is_down_ride_it_out)
            }
        }
    };
}

suite!(embedded, Embedded::start());
#[cfg(feature = "etcd")]
suite!(etcd, Etcd::start());

#[test]
fn an_unreachable_service_is_an_error_naming_it() {
    let port = free_port();
    let e = Rendezvous::connect_within(&format!("xfer://127.0.0.1:{port}"), Duration::ZERO)
        .unwrap_err();
    assert!(e.to_string().contains(&port.to_string()), "{e}");
    #[cfg(not(feature = "etcd"))]
    assert!(matches!(
        Rendezvous::connect("etcd://127.0.0.1:2379"),
        Err(Error::NoEtcd)
    ));
}

/// Issue 23: a serving system starts its processes in any order. A client that starts two
/// seconds before the embedded service connects, publishes and looks up once it is up.
#[test]
fn a_client_started_before_the_service_waits_for_it() {
    let port = free_port();
    let url = format!("xfer://127.0.0.1:{port}");
    let late_server = std::thread::spawn(move || {
        std::thread::sleep(Duration::from_secs(2));
        Server::start(&format!("127.0.0.1:{port}")).unwrap()
    });
    let r = Rendezvous::connect(&url).unwrap();
    let _p = r.publish("early-bird", &addr(1), &[], TTL).unwrap();
    assert_eq!(r.lookup("early-bird", WAIT).unwrap().addr, addr(1));
    drop(late_server.join().unwrap());
}

/// Issue 23: a service that never comes up is a typed error naming its URL once the
/// caller's wait is over, not at the first refused connection and not never.
#[test]
fn a_service_that_never_comes_up_fails_after_the_wait() {
    let port = free_port();
    let url = format!("xfer://127.0.0.1:{port}");
    let started = Instant::now();
    let e = Rendezvous::connect_within(&url, Duration::from_millis(600)).unwrap_err();
    assert!(
        started.elapsed() >= Duration::from_millis(600),
        "gave up early: {e}"
    );
    match &e {
        Error::Unreachable {
            service, waited, ..
        } => {
            assert_eq!(service, &url);
            assert!(*waited >= Duration::from_millis(600));
        }
        other => panic!("expected Unreachable, got {other:?}"),
    }
    assert!(e.to_string().contains(&url), "{e}");
}

fn open_descriptors() -> usize {
    std::fs::read_dir("/proc/self/fd").unwrap().count()
}

/// Runs the ignored test `name` of this binary in a process of its own (descriptor counts
/// are per process, and other tests of this binary open sockets in parallel) and checks it
/// passed there.
fn in_own_process(name: &str) {
    let status = Command::new(std::env::current_exe().unwrap())
        .args([
            "--exact",
            name,
            "--ignored",
            "--nocapture",
            "--test-threads",
            "1",
        ])
        .env("XFER_RDV_OWN_PROCESS", "1")
        // Its own summary must not be counted as this binary's (a panic goes to stderr).
        .stdout(Stdio::null())
        .status()
        .unwrap();
    assert!(status.success(), "{name} failed in its own process");
}

fn own_process() -> bool {
    std::env::var_os("XFER_RDV_OWN_PROCESS").is_some()
}

/// Issue 25: every connection used to leak one descriptor in the service (a clone kept until
/// `peer_addr()` failed, which a half-closed socket never does), until `accept` hit EMFILE.
#[test]
fn connect_and_close_cycles_leave_the_descriptor_count_flat() {
    in_own_process("descriptor_cycles");
}

#[test]
#[ignore = "run in its own process by connect_and_close_cycles_leave_the_descriptor_count_flat"]
fn descriptor_cycles() {
    if !own_process() {
        return;
    }
    let server = Server::start("127.0.0.1:0").unwrap();
    let url = server.url();
    // Warm up (threads, the first client's allocations).
    drop(Rendezvous::connect(&url).unwrap().list().unwrap());
    let before = open_descriptors();
    for _ in 0..300 {
        let r = Rendezvous::connect(&url).unwrap();
        r.list().unwrap();
    }
    wait_for("the service to close the 300 connections", || {
        server.connections() == 0 && open_descriptors() <= before + 2
    });
}

/// Issue 25: connections are capped, and idle ones are shed: 1,000 clients that connect and
/// say nothing never hold more than the cap, are closed after the idle time, and a real
/// client is served afterwards.
#[test]
fn idle_connections_stay_within_the_cap_and_are_shed() {
    in_own_process("idle_connections");
}

#[test]
#[ignore = "run in its own process by idle_connections_stay_within_the_cap_and_are_shed"]
fn idle_connections() {
    if !own_process() {
        return;
    }
    use xfer_rendezvous::embedded::Limits;
    let limits = Limits {
        max_connections: 64,
        idle: Duration::from_millis(1500),
        ..Limits::default()
    };
    let server = Server::start_with("127.0.0.1:0", limits, None).unwrap();
    let mut idle = Vec::new();
    for _ in 0..1000 {
        if let Ok(s) = std::net::TcpStream::connect(server.addr()) {
            idle.push(s);
        }
        assert!(
            server.connections() <= 64,
            "{} served",
            server.connections()
        );
    }
    wait_for("the idle connections to be shed", || {
        server.connections() == 0
    });
    drop(idle);
    let r = Rendezvous::connect_within(&server.url(), WAIT).unwrap();
    let _p = r.publish("after-the-flood", &addr(1), &[], TTL).unwrap();
    assert_eq!(r.lookup("after-the-flood", WAIT).unwrap().addr, addr(1));
}

/// Issue 25: a request split across the service's read timeout (a slow or stalled client)
/// is still read whole; the stream never loses its framing.
#[test]
fn a_request_split_across_a_read_timeout_keeps_its_framing() {
    use std::io::{Read, Write};
    let server = Server::start("127.0.0.1:0").unwrap();
    let r = Rendezvous::connect(&server.url()).unwrap();
    let _p = r.publish("split", &addr(4), &[], TTL).unwrap();
    let frame = xfer_rendezvous::embedded::request_frame_for_tests("/xfer/peers/split");
    let mut s = std::net::TcpStream::connect(server.addr()).unwrap();
    s.set_read_timeout(Some(WAIT)).unwrap();
    // The greeting (no secret: the welcome carries no challenge).
    s.write_all(&xfer_rendezvous::embedded::hello_frame_for_tests())
        .unwrap();
    let mut len = [0u8; 4];
    s.read_exact(&mut len).unwrap();
    s.read_exact(&mut vec![0u8; u32::from_le_bytes(len) as usize])
        .unwrap();
    let (head, tail) = frame.split_at(frame.len() / 2);
    s.write_all(head).unwrap();
    // Longer than the service's own read timeout (500 ms): it must keep what it has.
    std::thread::sleep(Duration::from_millis(1200));
    s.write_all(tail).unwrap();
    let mut len = [0u8; 4];
    s.read_exact(&mut len).unwrap();
    let mut body = vec![0u8; u32::from_le_bytes(len) as usize];
    s.read_exact(&mut body).unwrap();
    let value = xfer_rendezvous::embedded::value_of_response_for_tests(&body)
        .expect("an answer to the split request");
    assert_eq!(
        xfer_rendezvous::record::decode("/xfer/peers/split", &value)
            .unwrap()
            .addr,
        addr(4)
    );
}

/// Makes a CA, a server certificate for 127.0.0.1 and a client certificate (CN `root`) in
/// `dir` with openssl, at test time.
#[cfg(feature = "etcd")]
fn make_certs(dir: &std::path::Path) {
    std::fs::create_dir_all(dir).unwrap();
    std::fs::write(
        dir.join("san.ext"),
        "subjectAltName=IP:127.0.0.1,DNS:localhost\n",
    )
    .unwrap();
    let openssl = |args: &[&str]| {
        let out = Command::new("openssl")
            .args(args)
            .current_dir(dir)
            .output()
            .expect("openssl (Debian: openssl) makes the test certificates");
        assert!(
            out.status.success(),
            "openssl {args:?}: {}",
            String::from_utf8_lossy(&out.stderr)
        );
    };
    let ec = [
        "-newkey",
        "ec",
        "-pkeyopt",
        "ec_paramgen_curve:prime256v1",
        "-nodes",
    ];
    openssl(
        &[
            &["req", "-x509"][..],
            &ec,
            &[
                "-keyout",
                "ca-key.pem",
                "-out",
                "ca.pem",
                "-days",
                "2",
                "-subj",
                "/CN=xfer-test-ca",
            ],
        ]
        .concat(),
    );
    for (name, cn) in [("server", "127.0.0.1"), ("client", "root")] {
        let (key, csr, pem) = (
            format!("{name}-key.pem"),
            format!("{name}.csr"),
            format!("{name}.pem"),
        );
        openssl(
            &[
                &["req"][..],
                &ec,
                &["-keyout", &key, "-out", &csr, "-subj", &format!("/CN={cn}")],
            ]
            .concat(),
        );
        // As an operator keeps a private key (the client refuses one others may read).
        private(&dir.join(&key));
        openssl(&[
            "x509",
            "-req",
            "-in",
            &csr,
            "-CA",
            "ca.pem",
            "-CAkey",
            "ca-key.pem",
            "-CAcreateserial",
            "-out",
            &pem,
            "-days",
            "2",
            "-extfile",
            "san.ext",
        ]);
    }
}

/// `chmod 600`: how an operator keeps a key or password file.
#[cfg(feature = "etcd")]
fn private(path: &std::path::Path) {
    use std::os::unix::fs::PermissionsExt;
    std::fs::set_permissions(path, std::fs::Permissions::from_mode(0o600)).unwrap();
}

/// Issue 25 §2: etcd as a cluster operator runs it — TLS with client certificates and user
/// authentication, configured through `[rendezvous]`. The right user gets in; a wrong
/// password is refused at once with a clear error; a client without TLS never gets in.
#[cfg(feature = "etcd")]
#[test]
fn etcd_with_tls_and_authentication() {
    let certs = std::env::temp_dir().join(format!(
        "xfer-etcd-certs-{}-{}",
        std::process::id(),
        fastrand_u64()
    ));
    make_certs(&certs);
    let Some(mut etcd) = Etcd::start_with(Some(certs.clone())) else {
        return;
    };
    // Turn authentication on, as an operator would (etcdctl user add / auth enable).
    let rt = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .unwrap();
    rt.block_on(async {
        let tls = etcd_client::TlsOptions::new()
            .ca_certificate(etcd_client::Certificate::from_pem(
                std::fs::read(certs.join("ca.pem")).unwrap(),
            ))
            .identity(etcd_client::Identity::from_pem(
                std::fs::read(certs.join("client.pem")).unwrap(),
                std::fs::read(certs.join("client-key.pem")).unwrap(),
            ));
        let endpoint = format!("127.0.0.1:{}", etcd.client);
        let mut c = etcd_client::Client::connect(
            [endpoint],
            Some(etcd_client::ConnectOptions::new().with_tls(tls)),
        )
        .await
        .unwrap();
        c.user_add("root", "right-password", None).await.unwrap();
        let _ = c.role_add("root").await;
        let _ = c.user_grant_role("root", "root").await;
        c.auth_enable().await.unwrap();
    });
    let password = |text: &str| {
        let path = certs.join(format!("password-{}", fastrand_u64()));
        std::fs::write(&path, format!("{text}\n")).unwrap();
        private(&path);
        path
    };
    etcd.security.user = Some("root".into());
    etcd.security.password_file = Some(password("right-password"));
    let r = Rendezvous::connect_with(&etcd.url(), &etcd.options(WAIT)).unwrap();
    let _p = r.publish("tls-peer", &addr(7), &[], TTL).unwrap();
    assert_eq!(r.lookup("tls-peer", WAIT).unwrap().addr, addr(7));

    let mut wrong = etcd.options(WAIT);
    wrong.etcd.password_file = Some(password("wrong-password"));
    let started = Instant::now();
    match Rendezvous::connect_with(&etcd.url(), &wrong) {
        Err(Error::Authentication { why, .. }) => {
            assert!(why.contains("authentication failed"), "{why}")
        }
        other => panic!("expected Authentication, got {:?}", other.map(|_| ())),
    }
    assert!(
        started.elapsed() < WAIT,
        "a refusal is an answer, not an outage"
    );

    // Without TLS the client never gets an answer from a TLS-only etcd.
    let plain = xfer_rendezvous::ConnectOptions {
        wait: Duration::from_millis(500),
        ..Default::default()
    };
    assert!(Rendezvous::connect_with(&etcd.url(), &plain).is_err());
    etcd.stop();
    let _ = std::fs::remove_dir_all(&certs);
}
