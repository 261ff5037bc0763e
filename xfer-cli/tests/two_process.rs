//! Two engines in two processes on one host — over libfabric's shm and tcp;ofi_rxm (127.0.0.1)
//! here, over soft-RoCE in the rxe guest: single, paged, scatter and barrier writes,
//! send/recv, single and paged reads, ImmCounter counts, data verified; and a peer process
//! killed mid-transfer.

use std::io::{BufRead, BufReader, Write};
use std::path::{Path, PathBuf};
use std::process::{Child, ChildStdin, ChildStdout, Command, Stdio};
use std::sync::Arc;
use std::time::{Duration, Instant};

use engine_core::{
    expected_arrivals, DoneCounter, DoneFlag, Error, MrDesc, NetAddr, Pages, ScatterDst,
    TransferEngine, TransferShape,
};
use xfer_conformance::{buffer, pattern};

const WAIT: Duration = Duration::from_secs(20);

struct Peer {
    child: Child,
    input: ChildStdin,
    output: BufReader<ChildStdout>,
    desc: MrDesc,
    addr: NetAddr,
}

impl Peer {
    fn spawn(config: &Path) -> Peer {
        let mut child = Command::new(env!("CARGO_BIN_EXE_xfer-peer"))
            .arg(config)
            .env("FI_TCP_IFACE", "lo")
            .stdin(Stdio::piped())
            .stdout(Stdio::piped())
            .spawn()
            .expect("spawn the peer");
        let input = child.stdin.take().unwrap();
        let mut output = BufReader::new(child.stdout.take().unwrap());
        let mut field = |name: &str| {
            let mut line = String::new();
            output.read_line(&mut line).unwrap();
            line.trim()
                .strip_prefix(name)
                .unwrap_or_else(|| panic!("peer said {line:?}"))
                .trim()
                .to_owned()
        };
        let desc = field("desc").parse().unwrap();
        let addr = field("addr").parse().unwrap();
        Peer {
            child,
            input,
            output,
            desc,
            addr,
        }
    }

    fn ask(&mut self, command: &str) -> String {
        writeln!(self.input, "{command}").unwrap();
        let mut line = String::new();
        self.output.read_line(&mut line).unwrap();
        line.trim().to_owned()
    }

    fn bytes(&mut self, offset: usize, len: usize) -> Vec<u8> {
        let reply = self.ask(&format!("dump {offset} {len}"));
        hex::decode(
            reply
                .strip_prefix("bytes ")
                .unwrap_or_else(|| panic!("{reply}")),
        )
        .unwrap()
    }
}

impl Drop for Peer {
    fn drop(&mut self) {
        let _ = writeln!(self.input, "quit");
        let deadline = Instant::now() + Duration::from_secs(5);
        while Instant::now() < deadline {
            if let Ok(Some(_)) = self.child.try_wait() {
                return;
            }
            std::thread::sleep(Duration::from_millis(10));
        }
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

/// A config from `configs/`, with the short deadlines tests use.
fn config_file(name: &str) -> (PathBuf, engine_core::Config) {
    backend_mock::link();
    backend_efa::link();
    backend_verbs::link();
    // tcp;ofi_rxm must stay on loopback; harmless for the others (and inherited by the peer).
    std::env::set_var("FI_TCP_IFACE", "lo");
    let path = Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("../configs")
        .join(name);
    let mut config = engine_core::Config::from_file(&path).unwrap();
    config.timeouts.transfer_ms = config.timeouts.transfer_ms.min(3_000);
    (path, config)
}

fn every_primitive_across_processes(config_name: &str) {
    let (path, config) = config_file(config_name);
    let engine = Arc::new(TransferEngine::open(&config).unwrap());
    let mut peer = Peer::spawn(&path);
    let stripe = &config.stripe;
    let src = buffer(&engine, 4 << 20, pattern(3));

    // Single write of 1 MiB + 5 with an immediate.
    let len = (1 << 20) + 5;
    let sent = DoneFlag::new();
    engine
        .submit_single_write(len, Some(1), (src.mr(), 0), (&peer.desc, 0), sent.clone())
        .unwrap();
    sent.wait(WAIT).unwrap();
    let n = expected_arrivals(TransferShape::Single { len }, 1, stripe);
    assert_eq!(peer.ask(&format!("expect 1 {n}")), "ok");
    assert!(
        peer.bytes(0, len as usize) == src.to_vec()[..len as usize],
        "single write data"
    );

    // Paged: 16 pages of 4000 bytes into scattered destination pages of a 4096 stride.
    let src_pages = Pages {
        indices: (0..16).collect(),
        stride: 4000,
        offset: 0,
    };
    let dst_pages = Pages {
        indices: (0..16).map(|i| (i * 5) % 16 + 300).collect(),
        stride: 4096,
        offset: 0,
    };
    let sent = DoneFlag::new();
    engine
        .submit_paged_writes(
            4000,
            Some(2),
            (src.mr(), &src_pages),
            (&peer.desc, &dst_pages),
            sent.clone(),
        )
        .unwrap();
    sent.wait(WAIT).unwrap();
    let n = expected_arrivals(
        TransferShape::Paged {
            page_len: 4000,
            pages: 16,
        },
        1,
        stripe,
    );
    assert_eq!(peer.ask(&format!("expect 2 {n}")), "ok");
    for i in 0..16usize {
        let d = dst_pages.indices[i] as usize * 4096;
        assert!(
            peer.bytes(d, 4000) == src.to_vec()[i * 4000..i * 4000 + 4000],
            "page {i}"
        );
    }

    // Scatter to the peer process and to a second, local engine; then a barrier to both.
    let local = Arc::new(TransferEngine::open(&config).unwrap());
    let local_dst = buffer(&local, 1 << 20, |_| 0);
    let group = engine
        .add_peer_group(vec![peer.addr.clone(), local.main_address()])
        .unwrap();
    let dsts = [
        ScatterDst {
            len: 70_000,
            src_offset: 10,
            dst: peer.desc.clone(),
            dst_offset: 2 << 20,
        },
        ScatterDst {
            len: 123,
            src_offset: 99,
            dst: local_dst.desc().clone(),
            dst_offset: 7,
        },
        ScatterDst {
            len: 5000,
            src_offset: 500_000,
            dst: peer.desc.clone(),
            dst_offset: 3 << 20,
        },
    ];
    let local_landed = DoneFlag::new();
    local.expect_imm_count(3, 1, local_landed.clone()).unwrap();
    let sent = DoneFlag::new();
    engine
        .submit_scatter(Some(group), sent.clone(), Some(3), src.mr(), &dsts)
        .unwrap();
    sent.wait(WAIT).unwrap();
    let n = expected_arrivals(
        TransferShape::Scatter {
            lens: &[70_000, 5000],
        },
        1,
        stripe,
    );
    assert_eq!(peer.ask(&format!("expect 3 {n}")), "ok");
    local_landed.wait(WAIT).unwrap();
    assert!(peer.bytes(2 << 20, 70_000) == src.to_vec()[10..70_010]);
    assert!(peer.bytes(3 << 20, 5000) == src.to_vec()[500_000..505_000]);
    assert!(local_dst.to_vec()[7..130] == src.to_vec()[99..222]);
    let local_barrier = DoneFlag::new();
    local.expect_imm_count(4, 1, local_barrier.clone()).unwrap();
    let sent = DoneFlag::new();
    engine
        .submit_barrier(
            Some(group),
            sent.clone(),
            4,
            &[peer.desc.clone(), local_dst.desc().clone()],
        )
        .unwrap();
    sent.wait(WAIT).unwrap();
    assert_eq!(peer.ask("expect 4 1"), "ok");
    local_barrier.wait(WAIT).unwrap();
    assert_eq!(local.imm_count(4), 0, "exactly one barrier arrival");

    // A message.
    let sent = DoneFlag::new();
    engine
        .submit_send(&peer.addr, b"hello from the other process", sent.clone())
        .unwrap();
    sent.wait(WAIT).unwrap();
    assert_eq!(peer.ask("recv"), "msg hello from the other process");

    // Reads: pull from the other process's readable buffer, single and paged.
    assert_eq!(peer.ask("fill 1048576 200000 21"), "ok");
    let want: Vec<u8> = (0..200_000).map(pattern(21)).collect();
    let pulled = DoneFlag::new();
    engine
        .submit_single_read(
            200_000,
            (src.mr(), 0),
            (&peer.desc, 1 << 20),
            pulled.clone(),
        )
        .unwrap();
    pulled.wait(WAIT).unwrap();
    assert!(src.to_vec()[..200_000] == want[..], "single read");
    let remote = Pages {
        indices: vec![3, 0, 7],
        stride: 8192,
        offset: 1 << 20,
    };
    let here = Pages {
        indices: vec![0, 1, 2],
        stride: 8192,
        offset: 300_000,
    };
    let pulled = DoneFlag::new();
    engine
        .submit_paged_reads(
            8192,
            (src.mr(), &here),
            (&peer.desc, &remote),
            pulled.clone(),
        )
        .unwrap();
    pulled.wait(WAIT).unwrap();
    let got = src.to_vec();
    for (h, r) in here.indices.iter().zip(&remote.indices) {
        let (h, r) = (300_000 + *h as usize * 8192, *r as usize * 8192);
        assert!(
            got[h..h + 8192] == want[r..r + 8192],
            "paged read of page {r}"
        );
    }
}

fn killed_peer_fails_within_the_timeout(config_name: &str) {
    let (path, config) = config_file(config_name);
    let engine = Arc::new(TransferEngine::open(&config).unwrap());
    let mut peer = Peer::spawn(&path);
    let src = buffer(&engine, 1 << 20, pattern(4));
    // Traffic in flight while the peer dies.
    let before = DoneCounter::new();
    for _ in 0..200 {
        engine
            .submit_single_write(
                64 << 10,
                Some(9),
                (src.mr(), 0),
                (&peer.desc, 0),
                before.clone(),
            )
            .unwrap();
    }
    peer.child.kill().unwrap();
    peer.child.wait().unwrap();
    // Everything submitted before finishes (either way) and everything after fails, within
    // the transfer deadline: nothing hangs.
    let start = Instant::now();
    let after = DoneCounter::new();
    for _ in 0..20 {
        engine
            .submit_single_write(
                64 << 10,
                Some(9),
                (src.mr(), 0),
                (&peer.desc, 0),
                after.clone(),
            )
            .unwrap();
    }
    let limit = Duration::from_millis(config.timeouts.transfer_ms) + Duration::from_secs(5);
    let _ = before.wait_for(200, limit);
    assert_eq!(
        before.finished(),
        200,
        "every transfer in flight when the peer died finished"
    );
    let r = after.wait_for(20, limit);
    assert_eq!(after.finished(), 20);
    assert!(
        matches!(
            r,
            Err(Error::PeerUnreachable(_) | Error::Timeout(_) | Error::Backend { .. })
        ),
        "{r:?}"
    );
    assert!(start.elapsed() < limit);
    // The engine still serves a live peer.
    let other = Arc::new(TransferEngine::open(&config).unwrap());
    let dst = buffer(&other, 4096, |_| 0);
    let ok = DoneFlag::new();
    engine
        .submit_single_write(4096, None, (src.mr(), 0), (dst.desc(), 0), ok.clone())
        .unwrap();
    ok.wait(WAIT).unwrap();
    assert!(dst.to_vec() == src.to_vec()[..4096]);
}

#[test]
fn shm_every_primitive_across_processes() {
    every_primitive_across_processes("efa-shm.toml");
}

#[test]
fn tcp_every_primitive_across_processes() {
    every_primitive_across_processes("efa-tcp.toml");
}

#[test]
fn shm_killed_peer() {
    killed_peer_fails_within_the_timeout("efa-shm.toml");
}

#[test]
fn tcp_killed_peer() {
    killed_peer_fails_within_the_timeout("efa-tcp.toml");
}

#[test]
#[ignore = "needs soft-RoCE devices: runs in the rxe guest (cargo xtask test does)"]
fn verbs_every_primitive_across_processes() {
    every_primitive_across_processes("verbs-rxe0.toml");
}

#[test]
#[ignore = "needs soft-RoCE devices: runs in the rxe guest (cargo xtask test does)"]
fn verbs_killed_peer() {
    killed_peer_fails_within_the_timeout("verbs-rxe0.toml");
}

#[test]
fn an_unknown_provider_lists_what_libfabric_offers() {
    let (_, mut config) = config_file("efa-shm.toml");
    config.backends = toml::from_str("[efa]\nprovider = \"nosuchprovider\"\n").unwrap();
    let err = TransferEngine::open(&config).unwrap_err().to_string();
    assert!(
        err.contains("nosuchprovider") && err.contains("libfabric offers") && err.contains("shm"),
        "{err}"
    );
}
