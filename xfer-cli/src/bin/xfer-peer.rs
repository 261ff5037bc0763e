//! A peer process for two-process tests: opens an engine from the config file given as its
//! argument (any backend linked into the xfer CLI), registers a buffer, prints `desc <hex>` and `addr <hex>`, then answers commands on stdin, one per line:
//! `expect <imm> <n>` (wait for n arrivals), `dump <offset> <len>` (print bytes as hex),
//! `fill <offset> <len> <seed>` (write a pattern, for the other side to read), `recv` (print
//! the next message), `quit`. The buffer is registered readable and writable by peers.

use std::io::BufRead;
use std::sync::{mpsc, Arc, Mutex};
use std::time::Duration;

use engine_core::{Config, DoneFlag, HostBuffer, RemoteAccess, TransferEngine};

fn main() {
    let path = std::env::args().nth(1).expect("usage: xfer-peer CONFIG");
    backend_mock::link();
    backend_efa::link();
    backend_verbs::link();
    let config = Config::from_file(std::path::Path::new(&path)).unwrap_or_else(|e| {
        println!("error {e}");
        std::process::exit(1)
    });
    let engine = Arc::new(TransferEngine::open(&config).unwrap_or_else(|e| {
        println!("error {e}");
        std::process::exit(1)
    }));
    let buffer = HostBuffer::with_access(&engine, 4 << 20, |_| 0, RemoteAccess::READ_WRITE)
        .expect("register");
    let (tx, rx) = mpsc::channel::<Vec<u8>>();
    let tx = Mutex::new(tx);
    engine
        .submit_recvs(4096, 16, move |m| {
            let _ = tx.lock().unwrap().send(m.to_vec());
        })
        .expect("recvs");
    println!("desc {}", buffer.desc());
    println!("addr {}", engine.main_address());
    for line in std::io::stdin().lock().lines() {
        let line = line.unwrap_or_default();
        let words: Vec<&str> = line.split_whitespace().collect();
        let reply = match words.as_slice() {
            ["expect", imm, n] => {
                let f = DoneFlag::new();
                engine
                    .expect_imm_count(imm.parse().unwrap(), n.parse().unwrap(), f.clone())
                    .unwrap();
                match f.wait(Duration::from_secs(20)) {
                    Ok(()) => "ok".to_owned(),
                    Err(e) => format!("err {e}"),
                }
            }
            ["dump", offset, len] => {
                let (offset, len): (usize, usize) = (offset.parse().unwrap(), len.parse().unwrap());
                format!(
                    "bytes {}",
                    hex::encode(&buffer.to_vec()[offset..offset + len])
                )
            }
            ["fill", offset, len, seed] => {
                let (offset, len, seed): (usize, usize, u64) = (
                    offset.parse().unwrap(),
                    len.parse().unwrap(),
                    seed.parse().unwrap(),
                );
                let bytes: Vec<u8> = (0..len).map(xfer_conformance::pattern(seed)).collect();
                match buffer.write(offset, &bytes) {
                    Ok(()) => "ok".to_owned(),
                    Err(e) => format!("err {e}"),
                }
            }
            ["recv"] => match rx.recv_timeout(Duration::from_secs(20)) {
                Ok(m) => format!("msg {}", String::from_utf8_lossy(&m)),
                Err(e) => format!("err {e}"),
            },
            ["quit"] => break,
            _ => format!("err unknown command {line:?}"),
        };
        println!("{reply}");
    }
}
