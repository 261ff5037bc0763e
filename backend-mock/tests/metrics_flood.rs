//! Issue 56: the `/metrics` endpoint against idle connections. Its own test binary: it
//! counts the process's threads.

mod common;

use std::io::{Read, Write};
use std::net::TcpStream;
use std::time::{Duration, Instant};

use engine_core::TransferEngine;

fn threads() -> usize {
    std::fs::read_dir("/proc/self/task").unwrap().count()
}

/// A GET of `/metrics`: the body, or why not (the endpoint may shed the connection).
fn scrape(addr: std::net::SocketAddr) -> Result<String, String> {
    let mut s = TcpStream::connect(addr).map_err(|e| e.to_string())?;
    s.set_read_timeout(Some(Duration::from_secs(10))).unwrap();
    s.write_all(b"GET /metrics HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n")
        .map_err(|e| e.to_string())?;
    let mut text = String::new();
    s.read_to_string(&mut text).map_err(|e| e.to_string())?;
    text.starts_with("HTTP/1.1 200")
        .then_some(text)
        .ok_or_else(|| "no 200".into())
}

/// 2,000 connections that never send a request: the endpoint's threads stay bounded (one
/// per connection before), idle connections are closed at its read deadline, and a scrape
/// is answered again once they are.
#[test]
fn idle_connections_to_the_metrics_endpoint_keep_its_threads_bounded() {
    let config = common::mock_config(1, "[metrics]\nlisten = \"127.0.0.1:0\"\n");
    let engine = TransferEngine::open(&config).unwrap();
    let addr = engine.metrics_address().unwrap();
    scrape(addr).unwrap();
    let before = threads();
    let mut idle: Vec<TcpStream> = (0..2000)
        .map(|_| TcpStream::connect(addr).unwrap())
        .collect();
    // Answered once the endpoint has taken every idle connection (accepts are in order)
    // and its read deadline freed it from them.
    let deadline = Instant::now() + Duration::from_secs(60);
    let text = loop {
        match scrape(addr) {
            Ok(text) => break text,
            Err(e) => assert!(Instant::now() < deadline, "no scrape answered: {e}"),
        }
    };
    assert!(text.contains("xfer_"), "{text}");
    let grew = threads().saturating_sub(before);
    assert!(grew <= 8, "{grew} threads more for 2,000 idle connections");
    // Each idle connection was closed by the endpoint (end of stream, or reset).
    for s in idle.iter_mut().take(20) {
        s.set_read_timeout(Some(Duration::from_secs(10))).unwrap();
        let mut byte = [0u8; 1];
        match s.read(&mut byte) {
            Ok(0) | Err(_) => {}
            Ok(_) => panic!("an idle connection got an answer"),
        }
    }
}
