//! # xfer-conformance: the backend conformance suite
//!
//! Why one file: it is one suite. `CHECKS` lists every check by name, the `conformance_suite!`
//! macro turns that list into tests, and the checks share the small helpers at the top; a vendor
//! reads a failing check next to its neighbours.
//!
//! The backend conformance suite: one battery of tests every backend runs against engines of
//! its own. A backend is "supported" exactly when it passes.
//!
//! A backend's test file implements [`Harness`] (how to configure engines with `n` NICs) and
//! invokes [`conformance_suite!`], which expands to one `#[test]`
//! per check:
//!
//! ```ignore
//! struct Mock;
//! impl xfer_conformance::Harness for Mock {
//!     fn config(&self, nics: usize) -> engine_core::Config { /* ... */ }
//!     fn max_nics(&self) -> usize { 4 }
//! }
//! xfer_conformance::conformance_suite!(Mock);
//! ```
//!
//! Its own crate, apart from the engine it tests: backends (as a dev-dependency), vendors and
//! the `xfer conformance` command use it; the engine does not.
//!
//! Every check panics with a message naming what broke. Deadlines are taken from the
//! harness's config with the transfer and expectation timeouts capped at two seconds, so a
//! broken backend fails fast instead of hanging.

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use engine_core::config::NicSelection;
use engine_core::{
    Config, Device, DoneCounter, DoneFlag, Error, HostBuffer, MrDesc, OnDone, Pages, RemoteAccess,
    ScatterDst, TransferEngine, TransferShape,
};

/// How a backend's engines are configured for the suite.
pub trait Harness: Sync {
    /// A config for engines with `nics` NICs (1 ..= `max_nics()`); each call may return the
    /// same config, since several engines are opened from it in one process.
    fn config(&self, nics: usize) -> Config;
    /// The most NICs per engine this backend can offer here.
    fn max_nics(&self) -> usize;

    /// Why the named check cannot pass on this backend, if it cannot: a documented
    /// limitation of the transport. Skipped checks are printed, never silently passed.
    fn skip(&self, check: &str) -> Option<&'static str> {
        let _ = check;
        None
    }

    /// Whether a write with a bad rkey reports `Error::RemoteAccess` (true for NICs that
    /// check keys and say so). When false the check still requires an error, with nothing
    /// written and nothing counted, but accepts any error kind.
    fn typed_remote_access(&self) -> bool {
        true
    }
}

/// Long enough for any engine deadline to fire first.
const WAIT: Duration = Duration::from_secs(20);

/// Environment variable overriding the suite's short deadlines (milliseconds): runs under
/// valgrind or on a loaded machine are tens of times slower, and a 2 s deadline there fails
/// a correct backend.
pub const DEADLINE_ENV: &str = "XFER_CONFORMANCE_DEADLINE_MS";

/// The harness's config with short deadlines (2 s, or `$XFER_CONFORMANCE_DEADLINE_MS`).
pub fn quick_config<H: Harness + ?Sized>(h: &H, nics: usize) -> Config {
    let mut c = h.config(nics);
    let deadline = std::env::var(DEADLINE_ENV)
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(2_000);
    c.timeouts.transfer_ms = c.timeouts.transfer_ms.min(deadline);
    c.timeouts.expect_ms = c.timeouts.expect_ms.min(deadline);
    c
}

fn open(config: &Config) -> Arc<TransferEngine> {
    Arc::new(
        TransferEngine::open(config).unwrap_or_else(|e| panic!("opening an engine failed: {e}")),
    )
}

/// A registered buffer filled with `fill(i)`; panics if registration fails.
pub fn buffer(engine: &Arc<TransferEngine>, len: usize, fill: impl Fn(usize) -> u8) -> HostBuffer {
    HostBuffer::from_fn(engine, len, fill)
        .unwrap_or_else(|e| panic!("registering {len} bytes failed: {e}"))
}

/// A deterministic byte pattern that differs per seed and position.
pub fn pattern(seed: u64) -> impl Fn(usize) -> u8 {
    move |i| {
        ((i as u64)
            .wrapping_mul(31)
            .wrapping_add(seed.wrapping_mul(7919))
            % 251) as u8
    }
}

/// The basics every check relies on, each given a short deadline: a write completes at its
/// sender (rule 1), its bytes are at the target, and its immediate arrives (rule 2). `Err`
/// names what broke, so a runner can stop at once with the cause instead of letting every
/// check wait out its own timeout for the same reason (a plugin that never delivered
/// immediates took 74 s to fail, check by check, with messages that did not say why).
pub fn probe(h: &dyn Harness) -> Result<(), String> {
    const WITHIN: Duration = Duration::from_secs(2);
    let config = quick_config(h, 1);
    let open = |c: &Config| {
        TransferEngine::open(c)
            .map(Arc::new)
            .map_err(|e| format!("opening an engine failed: {e}"))
    };
    let (a, b) = (open(&config)?, open(&config)?);
    let registered = |e: &Arc<TransferEngine>, fill: &dyn Fn(usize) -> u8| {
        HostBuffer::from_fn(e, 4096, fill).map_err(|e| format!("registering 4 KiB failed: {e}"))
    };
    let (src, dst) = (registered(&a, &pattern(5))?, registered(&b, &|_| 0)?);
    let immediates = a.capabilities()[0].immediates;
    let landed = flag();
    if immediates {
        b.expect_imm_count(4242, 1, landed.clone())
            .map_err(|e| format!("expect_imm_count failed: {e}"))?;
    }
    let sent = flag();
    let imm = immediates.then_some(4242);
    a.submit_single_write(4096, imm, (src.mr(), 0), (dst.desc(), 0), sent.clone())
        .map_err(|e| format!("submitting a 4 KiB write failed: {e}"))?;
    sent.wait(WITHIN).map_err(|e| {
        format!("a 4 KiB write did not complete at its sender ({e}): the plugin reports no Done for a posted write (rule 1), or never makes progress")
    })?;
    if dst.to_vec() != src.to_vec() {
        return Err("a 4 KiB write completed at its sender but its bytes are not at the target: Done came before the data was placed (rule 2), or the write went elsewhere".into());
    }
    if immediates {
        landed.wait(WITHIN).map_err(|e| {
            format!("a write's bytes landed but its immediate never arrived ({e}): the plugin reports no ImmArrival (rule 2), or declares immediates it does not deliver")
        })?;
    }
    Ok(())
}

/// A failed step of a check, said so a vendor can act on it: what the check was waiting for,
/// the engine's error, and which rule of docs/plugins.md that error usually means was broken
/// (instead of `unwrap() on an Err value: Timeout(2s)`).
trait OrFail<T> {
    fn or_fail(self, step: &str) -> T;
}

impl<T> OrFail<T> for Result<T, engine_core::Error> {
    #[track_caller]
    fn or_fail(self, step: &str) -> T {
        self.unwrap_or_else(|e| panic!("{}", failed_step(step, &e)))
    }
}

/// The message of a failed step: `step`, the error, and the rule it points at.
pub fn failed_step(step: &str, error: &engine_core::Error) -> String {
    use engine_core::Error as E;
    let rule = match error {
        E::Timeout(_) => "nothing reported it in time: the plugin must finish every posted request with one Done (rule 1), report an ImmArrival once a write's bytes are in place (rule 2), and call the waker whenever it promised one (rule 8)",
        E::PeerUnreachable(_) => "the plugin could not reach an engine that is open: do peers post to the address `address()` returns, and is a live peer found by it?",
        E::RemoteAccess(_) => "the plugin refused a key, range or permission the engine registered: is each remote key checked against its own region (rule 5)?",
        E::Backend { .. } => "the plugin reported this failure",
        E::InvalidArgument(_) | E::OutOfBounds { .. } | E::NotAvailable(_) => "the engine refused the request before the plugin saw it: do the plugin's capabilities say what it supports?",
        _ => "",
    };
    if rule.is_empty() {
        format!("{step}: {error}")
    } else {
        format!("{step}: {error} — {rule}")
    }
}

fn flag() -> Arc<DoneFlag> {
    DoneFlag::new()
}

fn expect_arrivals(engine: &TransferEngine, imm: u32, n: u64) -> Arc<DoneFlag> {
    let f = flag();
    engine
        .expect_imm_count(imm, n, f.clone())
        .expect("expect_imm_count");
    f
}

fn assert_copied(what: &str, dst: &[u8], src: &[u8]) {
    if dst != src {
        let at = dst.iter().zip(src).position(|(a, b)| a != b).unwrap_or(0);
        panic!("{what}: data differs at byte {at} of {}", dst.len());
    }
}

/// `n` pages of `page` bytes from offset 0: the source in order, the destination scattered
/// (source page `i` to destination page `(7·i + 3) mod n`, a permutation when 7 does not
/// divide `n`), as a KV-cache request scatters its blocks.
pub fn scattered_pages(n: u32, page: u64) -> (Pages, Pages) {
    assert!(n % 7 != 0, "(7·i + 3) mod {n} is not a permutation");
    let pages = |indices: Vec<u32>| Pages {
        indices,
        stride: page,
        offset: 0,
    };
    (
        pages((0..n).collect()),
        pages((0..n).map(|i| (i * 7 + 3) % n).collect()),
    )
}

/// That every destination page of a paged write holds its source page, but the pages
/// numbered in `except` (`from` and `to` list the pages in the same order; both offset 0).
pub fn assert_pages_landed(
    src: &[u8],
    dst: &[u8],
    (from, to): (&Pages, &Pages),
    page: u64,
    except: &[usize],
) {
    let at = |pages: &Pages, i: usize| (u64::from(pages.indices[i]) * pages.stride) as usize;
    let len = page as usize;
    for i in (0..from.indices.len()).filter(|i| !except.contains(i)) {
        let (s, d) = (at(from, i), at(to, i));
        assert_copied(&format!("page {i}"), &dst[d..d + len], &src[s..s + len]);
    }
}

/// Single writes of several sizes land byte for byte, and the receiver counts exactly the
/// arrivals `expected_arrivals` predicts.
pub fn single_write(h: &dyn Harness) {
    let config = quick_config(h, 1);
    let (a, b) = (open(&config), open(&config));
    for (k, len) in [1usize, 4096, 65_536 + 17, 1 << 20].into_iter().enumerate() {
        let src = buffer(&a, len, pattern(k as u64 + 1));
        let dst = buffer(&b, len, |_| 0);
        let imm = 100 + k as u32;
        let n = b.expected_arrivals(TransferShape::Single { len: len as u64 });
        let landed = expect_arrivals(&b, imm, n);
        let sent = flag();
        a.submit_single_write(
            len as u64,
            Some(imm),
            (src.mr(), 0),
            (dst.desc(), 0),
            sent.clone(),
        )
        .or_fail("posting it");
        sent.wait(WAIT)
            .unwrap_or_else(|e| panic!("write of {len} bytes failed: {e}"));
        landed
            .wait(WAIT)
            .unwrap_or_else(|e| panic!("arrivals of {len} bytes: {e}"));
        assert_copied(
            &format!("single write of {len}"),
            &dst.to_vec(),
            &src.to_vec(),
        );
        assert_eq!(b.imm_count(imm), 0, "no arrivals beyond the expected {n}");
    }
}

/// Writes at offsets, and a write without an immediate (nothing counted).
pub fn write_at_offsets_without_imm(h: &dyn Harness) {
    let config = quick_config(h, 1);
    let (a, b) = (open(&config), open(&config));
    let src = buffer(&a, 8192, pattern(3));
    let dst = buffer(&b, 8192, |_| 0xee);
    let done = flag();
    a.submit_single_write(
        1000,
        None,
        (src.mr(), 100),
        (dst.desc(), 5000),
        done.clone(),
    )
    .or_fail("posting it");
    done.wait(WAIT)
        .or_fail("the write's completion at its sender");
    assert_copied(
        "offset write",
        &dst.to_vec()[5000..6000],
        &src.to_vec()[100..1100],
    );
    assert!(
        dst.to_vec()[..5000]
            .iter()
            .chain(&dst.to_vec()[6000..])
            .all(|&x| x == 0xee),
        "bytes outside the range were touched"
    );
    assert_eq!(b.imm_count(0), 0);
}

/// Large writes stripe over every NIC count and every first-NIC choice, with each chunk
/// carrying its own NIC's keys (a wrong pairing is a remote-access error on a real NIC).
pub fn striping(h: &dyn Harness) {
    for nics in 1..=h.max_nics() {
        let mut selections: Vec<NicSelection> = (0..nics).map(NicSelection::First).collect();
        selections.push(NicSelection::RoundRobin);
        for selection in selections {
            let mut config = quick_config(h, nics);
            config.nic_selection = selection;
            let (a, b) = (open(&config), open(&config));
            assert_eq!(a.nic_count(), nics);
            for (k, len) in [3 * (1 << 20) + 12_345, 100, 256 << 10]
                .into_iter()
                .enumerate()
            {
                let src = buffer(&a, len, pattern(nics as u64 * 10 + k as u64));
                let dst = buffer(&b, len, |_| 0);
                let n = b.expected_arrivals(TransferShape::Single { len: len as u64 });
                let landed = expect_arrivals(&b, 7, n);
                let sent = flag();
                a.submit_single_write(
                    len as u64,
                    Some(7),
                    (src.mr(), 0),
                    (dst.desc(), 0),
                    sent.clone(),
                )
                .or_fail("posting it");
                sent.wait(WAIT)
                    .unwrap_or_else(|e| panic!("{nics} NICs, {selection:?}, {len} bytes: {e}"));
                landed
                    .wait(WAIT)
                    .unwrap_or_else(|e| panic!("{nics} NICs, {selection:?}: arrivals: {e}"));
                assert_copied(
                    &format!("{nics} NICs {selection:?} {len} bytes"),
                    &dst.to_vec(),
                    &src.to_vec(),
                );
                assert_eq!(
                    b.imm_count(7),
                    0,
                    "{nics} NICs {selection:?}: more arrivals than predicted"
                );
            }
        }
    }
}

/// Paged writes move each source page to its destination page, in any page order.
pub fn paged_writes(h: &dyn Harness) {
    let nics = h.max_nics();
    let config = quick_config(h, nics);
    let (a, b) = (open(&config), open(&config));
    let (page_len, stride, pages) = (1000u64, 1024u64, 64u32);
    let src = buffer(&a, (stride * u64::from(pages) + 16) as usize, pattern(5));
    let dst = buffer(&b, (stride * u64::from(pages) + 64) as usize, |_| 0);
    let src_pages = Pages {
        indices: (0..pages).collect(),
        stride,
        offset: 16,
    };
    // Destination pages in a scrambled order, at a different base offset.
    let dst_pages = Pages {
        indices: (0..pages).map(|i| (i * 37) % pages).collect(),
        stride,
        offset: 64,
    };
    let n = b.expected_arrivals(TransferShape::Paged {
        page_len,
        pages: u64::from(pages),
    });
    let landed = expect_arrivals(&b, 9, n);
    let sent = flag();
    a.submit_paged_writes(
        page_len,
        Some(9),
        (src.mr(), &src_pages),
        (dst.desc(), &dst_pages),
        sent.clone(),
    )
    .or_fail("posting it");
    sent.wait(WAIT)
        .or_fail("the paged write's completion at its sender");
    landed
        .wait(WAIT)
        .or_fail("the immediates of the pages at the target");
    for i in 0..pages as usize {
        let s = (16 + u64::from(src_pages.indices[i]) * stride) as usize;
        let d = (64 + u64::from(dst_pages.indices[i]) * stride) as usize;
        assert_copied(
            &format!("page {i}"),
            &dst.to_vec()[d..d + page_len as usize],
            &src.to_vec()[s..s + page_len as usize],
        );
    }
}

/// A scatter of variable-size pieces to two peers; each peer counts its own arrivals.
pub fn scatter(h: &dyn Harness) {
    let nics = h.max_nics();
    let config = quick_config(h, nics);
    let (a, b, c) = (open(&config), open(&config), open(&config));
    let src = buffer(&a, 1 << 20, pattern(11));
    let (db, dc) = (buffer(&b, 1 << 20, |_| 0), buffer(&c, 1 << 20, |_| 0));
    let group = a
        .add_peer_group(vec![b.main_address(), c.main_address()])
        .unwrap();
    let pieces: [(u64, u64, bool, u64); 5] = [
        (10, 0, true, 0),
        (70_000, 100, false, 4096),
        (1, 99_999, true, 500),
        (300_000, 200_000, true, 600_000),
        (4096, 0, false, 0),
    ];
    let dsts: Vec<ScatterDst> = pieces
        .iter()
        .map(|&(len, src_offset, to_b, dst_offset)| ScatterDst {
            len,
            src_offset,
            dst: if to_b {
                db.desc().clone()
            } else {
                dc.desc().clone()
            },
            dst_offset,
        })
        .collect();
    let lens =
        |to_b: bool| -> Vec<u64> { pieces.iter().filter(|p| p.2 == to_b).map(|p| p.0).collect() };
    let (lb, lc) = (lens(true), lens(false));
    let fb = expect_arrivals(
        &b,
        3,
        b.expected_arrivals(TransferShape::Scatter { lens: &lb }),
    );
    let fc = expect_arrivals(
        &c,
        3,
        c.expected_arrivals(TransferShape::Scatter { lens: &lc }),
    );
    let sent = flag();
    a.submit_scatter(Some(group), sent.clone(), Some(3), src.mr(), &dsts)
        .or_fail("posting it");
    sent.wait(WAIT)
        .or_fail("the scatter's completion at its sender");
    fb.wait(WAIT)
        .or_fail("the scatter's immediates at the first target");
    fc.wait(WAIT)
        .or_fail("the scatter's immediates at the second target");
    for &(len, so, to_b, d) in &pieces {
        let dst = if to_b { &db } else { &dc };
        let (len, so, d) = (len as usize, so as usize, d as usize);
        assert_copied(
            "scatter piece",
            &dst.to_vec()[d..d + len],
            &src.to_vec()[so..so + len],
        );
    }
    // A destination outside the group is refused before anything is posted.
    let stranger = open(&config);
    let ds = buffer(&stranger, 64, |_| 0);
    let bad = [ScatterDst {
        len: 8,
        src_offset: 0,
        dst: ds.desc().clone(),
        dst_offset: 0,
    }];
    assert!(matches!(
        a.submit_scatter(Some(group), flag(), None, src.mr(), &bad),
        Err(Error::InvalidArgument(_))
    ));
}

/// A barrier is one arrival at each peer.
pub fn barrier(h: &dyn Harness) {
    let nics = h.max_nics();
    let config = quick_config(h, nics);
    let (a, b, c) = (open(&config), open(&config), open(&config));
    let (db, dc) = (buffer(&b, 64, |_| 1), buffer(&c, 64, |_| 1));
    for round in 0..3 {
        let fb = expect_arrivals(&b, 77, 1);
        let fc = expect_arrivals(&c, 77, 1);
        let sent = flag();
        a.submit_barrier(
            None,
            sent.clone(),
            77,
            &[db.desc().clone(), dc.desc().clone()],
        )
        .or_fail("posting it");
        sent.wait(WAIT)
            .unwrap_or_else(|e| panic!("barrier round {round}: {e}"));
        fb.wait(WAIT)
            .or_fail("the barrier's immediate at the first peer");
        fc.wait(WAIT)
            .or_fail("the barrier's immediate at the second peer");
    }
    assert!(
        db.to_vec().iter().chain(&dc.to_vec()).all(|&x| x == 1),
        "a barrier wrote bytes"
    );
}

/// Messages both ways, more than the receive pool holds (buffers are reposted), with content.
pub fn send_recv(h: &dyn Harness) {
    let config = quick_config(h, 1);
    let (a, b) = (open(&config), open(&config));
    let got = Arc::new(std::sync::Mutex::new(Vec::<Vec<u8>>::new()));
    let sink = Arc::clone(&got);
    b.submit_recvs(256, 4, move |m| sink.lock().unwrap().push(m.to_vec()))
        .unwrap();
    let replies = Arc::new(AtomicU64::new(0));
    let r = Arc::clone(&replies);
    a.submit_recvs(64, 2, move |m| {
        assert_eq!(m, b"pong");
        r.fetch_add(1, Ordering::SeqCst);
    })
    .unwrap();
    let sent = DoneCounter::new();
    for i in 0..20u32 {
        let msg = format!("message {i} {}", "x".repeat(i as usize * 7));
        a.submit_send(&b.main_address(), msg.as_bytes(), sent.clone())
            .or_fail("posting it");
    }
    sent.wait_for(20, WAIT).or_fail("the 20 sends' completions");
    let back = DoneCounter::new();
    for _ in 0..5 {
        b.submit_send(&a.main_address(), b"pong", back.clone())
            .or_fail("posting it");
    }
    back.wait_for(5, WAIT).or_fail("the 5 replies' completions");
    let deadline = Instant::now() + WAIT;
    while (got.lock().unwrap().len() < 20 || replies.load(Ordering::SeqCst) < 5)
        && Instant::now() < deadline
    {
        std::thread::sleep(Duration::from_millis(1));
    }
    let mut got = got.lock().unwrap().clone();
    got.sort();
    let mut want: Vec<Vec<u8>> = (0..20u32)
        .map(|i| format!("message {i} {}", "x".repeat(i as usize * 7)).into_bytes())
        .collect();
    want.sort();
    assert_eq!(got, want, "every message arrives once, intact");
    assert_eq!(replies.load(Ordering::SeqCst), 5);
    // Too large for the sender's limit: refused locally.
    let huge = vec![0u8; config.worker.max_message + 1];
    assert!(matches!(
        a.submit_send(&b.main_address(), &huge, flag()),
        Err(Error::InvalidArgument(_))
    ));
}

/// A notification attached to a transfer reaches the peer only after every byte of that
/// transfer is in the peer's memory: many writes in flight at once, notifications taken in
/// whatever order they come, each one's data checked the moment it is seen.
pub fn notifications_follow_their_data(h: &dyn Harness) {
    const CHUNK: usize = 128 << 10;
    const ROUNDS: usize = 16;
    let config = quick_config(h, h.max_nics().min(2));
    let (a, b) = (open(&config), open(&config));
    b.listen_notifications(ROUNDS).unwrap();
    let src = buffer(&a, CHUNK * ROUNDS, pattern(77));
    let dst = buffer(&b, CHUNK * ROUNDS, |_| 0);
    let sent = DoneCounter::new();
    for round in 0..ROUNDS {
        let id = format!("req-{round}");
        let done = a
            .notify_when_done(&b.main_address(), id.as_bytes(), sent.clone())
            .unwrap();
        let at = (round * CHUNK) as u64;
        a.submit_single_write(CHUNK as u64, None, (src.mr(), at), (dst.desc(), at), done)
            .or_fail("posting it");
    }
    let want = src.to_vec();
    let mut seen = Vec::new();
    for _ in 0..ROUNDS {
        let note = b
            .wait_notification(WAIT)
            .expect("every notification arrives");
        assert_eq!(
            note.from,
            a.main_address(),
            "a notification names its sender"
        );
        let id = note.id;
        let round: usize = std::str::from_utf8(&id)
            .ok()
            .and_then(|t| t.strip_prefix("req-"))
            .and_then(|n| n.parse().ok())
            .unwrap_or_else(|| panic!("unexpected notification {id:?}"));
        let range = round * CHUNK..(round + 1) * CHUNK;
        let got = dst.to_vec();
        assert_copied(
            &format!("chunk {round} when its notification arrived"),
            &got[range.clone()],
            &want[range],
        );
        seen.push(round);
    }
    let r = sent.wait_for(ROUNDS as u64, WAIT);
    assert!(
        r.is_ok(),
        "{r:?}: ok {} failed {} first {:?}",
        sent.ok(),
        sent.failed(),
        sent.first_error()
    );
    seen.sort_unstable();
    assert_eq!(
        seen,
        (0..ROUNDS).collect::<Vec<_>>(),
        "each notification exactly once"
    );
    assert!(b.poll_notifications().is_empty());
    // An id longer than the protocol's limit is refused before anything is sent.
    let long = vec![b'x'; engine_core::NOTIFICATION_ID_MAX + 1];
    assert!(matches!(
        a.notify_when_done(&b.main_address(), &long, flag()),
        Err(Error::InvalidArgument(_))
    ));
}

/// Arrivals counted before the expectation, after it, and interleaved with other immediates
/// are all counted exactly; the pollable count agrees.
pub fn imm_counts(h: &dyn Harness) {
    let config = quick_config(h, 1);
    let (a, b) = (open(&config), open(&config));
    let src = buffer(&a, 64, pattern(1));
    let dst = buffer(&b, 64, |_| 0);
    let writes = DoneCounter::new();
    for i in 0..10 {
        let imm = if i % 2 == 0 { 1 } else { 2 };
        a.submit_single_write(8, Some(imm), (src.mr(), 0), (dst.desc(), 8), writes.clone())
            .or_fail("posting it");
    }
    writes
        .wait_for(10, WAIT)
        .or_fail("the 10 writes' completions");
    let deadline = Instant::now() + WAIT;
    while b.imm_count(1) + b.imm_count(2) < 10 && Instant::now() < deadline {
        std::thread::sleep(Duration::from_millis(1));
    }
    assert_eq!((b.imm_count(1), b.imm_count(2)), (5, 5), "pollable counts");
    // Met at once by arrivals already counted; consumes 3 of 5.
    expect_arrivals(&b, 1, 3)
        .wait(WAIT)
        .or_fail("3 arrivals of immediate 1");
    assert_eq!(b.imm_count(1), 2);
    // Needs 4 more than the 2 left: met only after they arrive.
    let later = expect_arrivals(&b, 1, 6);
    assert!(!later.is_done());
    for _ in 0..4 {
        a.submit_single_write(8, Some(1), (src.mr(), 0), (dst.desc(), 0), writes.clone())
            .or_fail("posting it");
    }
    later.wait(WAIT).or_fail("the 5th arrival of immediate 2");
    assert_eq!((b.imm_count(1), b.imm_count(2)), (0, 5));
}

/// An expectation nobody meets fails with `Timeout`, and the count stays usable.
pub fn expectation_times_out(h: &dyn Harness) {
    let mut config = quick_config(h, 1);
    config.timeouts.expect_ms = 200;
    let b = open(&config);
    let start = Instant::now();
    let f = expect_arrivals(&b, 5, 1);
    assert!(matches!(f.wait(WAIT), Err(Error::Timeout(_))));
    assert!(
        start.elapsed() < Duration::from_secs(5),
        "the deadline was honoured"
    );
}

/// Caller mistakes are typed errors before anything is posted.
pub fn bad_input(h: &dyn Harness) {
    let config = quick_config(h, 1);
    let (a, b) = (open(&config), open(&config));
    let src = buffer(&a, 4096, pattern(1));
    let dst = buffer(&b, 4096, |_| 0);
    let oob = |r: engine_core::Result<()>| matches!(r, Err(Error::OutOfBounds { .. }));
    assert!(oob(a.submit_single_write(
        4097,
        None,
        (src.mr(), 0),
        (dst.desc(), 0),
        flag()
    )));
    assert!(oob(a.submit_single_write(
        10,
        None,
        (src.mr(), 4090),
        (dst.desc(), 0),
        flag()
    )));
    assert!(oob(a.submit_single_write(
        10,
        None,
        (src.mr(), 0),
        (dst.desc(), 4090),
        flag()
    )));
    assert!(oob(a.submit_single_write(
        1,
        None,
        (src.mr(), u64::MAX),
        (dst.desc(), 0),
        flag()
    )));
    let pages = Pages {
        indices: vec![0, u32::MAX],
        stride: 1 << 40,
        offset: 0,
    };
    assert!(oob(a.submit_paged_writes(
        8,
        None,
        (src.mr(), &pages),
        (dst.desc(), &pages),
        flag()
    )));
    let two = Pages {
        indices: vec![0, 1],
        stride: 8,
        offset: 0,
    };
    let one = Pages {
        indices: vec![0],
        stride: 8,
        offset: 0,
    };
    assert!(matches!(
        a.submit_paged_writes(8, None, (src.mr(), &two), (dst.desc(), &one), flag()),
        Err(Error::InvalidArgument(_))
    ));
    let gone = buffer(&a, 64, |_| 0);
    let gone_mr = gone.mr();
    drop(gone);
    assert!(matches!(
        a.submit_single_write(1, None, (gone_mr, 0), (dst.desc(), 0), flag()),
        Err(Error::UnknownHandle(_))
    ));
    assert!(matches!(a.dereg_mr(gone_mr), Err(Error::UnknownHandle(_))));
    // A descriptor from a peer with another NIC count.
    let (ptr, len) = (dst.desc().ptr(), dst.desc().len());
    let doubled = MrDesc::new(
        ptr,
        len,
        vec![dst.desc().rkeys()[0].clone(), dst.desc().rkeys()[0].clone()],
    )
    .unwrap();
    assert!(matches!(
        a.submit_single_write(1, None, (src.mr(), 0), (&doubled, 0), flag()),
        Err(Error::InvalidArgument(_))
    ));
    // Malformed descriptors never decode.
    let bytes = dst.desc().to_bytes();
    assert!(MrDesc::from_bytes(&bytes[..bytes.len() - 1]).is_err());
    assert!(engine_core::NetAddr::from_bytes(&[1, 200]).is_err());
    assert!(matches!(
        a.add_peer_group(vec![]),
        Err(Error::InvalidArgument(_))
    ));
    // SAFETY: a null pointer is refused before anything is registered.
    let null = unsafe { a.reg_mr(std::ptr::null_mut(), 8, Device::Host) };
    assert!(matches!(null, Err(Error::InvalidArgument(_))));
}

/// A wrong rkey is a remote-access error, and nothing is written or counted.
pub fn remote_access_error(h: &dyn Harness) {
    let typed = h.typed_remote_access();
    let config = quick_config(h, 1);
    let (a, b) = (open(&config), open(&config));
    let src = buffer(&a, 4096, pattern(2));
    let dst = buffer(&b, 4096, |_| 0);
    let (addr, rkey) = dst.desc().rkeys()[0].clone();
    let forged = MrDesc::new(
        dst.desc().ptr(),
        dst.desc().len(),
        vec![(addr, rkey ^ 0x5a5a_0000)],
    )
    .unwrap();
    let f = flag();
    a.submit_single_write(4096, Some(4), (src.mr(), 0), (&forged, 0), f.clone())
        .or_fail("posting it");
    let r = f.wait(WAIT);
    if typed {
        assert!(matches!(r, Err(Error::RemoteAccess(_))), "got {r:?}");
    } else {
        assert!(
            r.is_err(),
            "a write with a forged rkey must fail, got {r:?}"
        );
    }
    assert!(
        dst.to_vec().iter().all(|&x| x == 0),
        "nothing may be written"
    );
    assert_eq!(b.imm_count(4), 0, "nothing may be counted");
    // The engine keeps serving after the error (another peer: a provider may drop the
    // connection to the one that refused, as tcp;ofi_rxm does).
    let c = open(&config);
    let dc = buffer(&c, 4096, |_| 0);
    let ok = flag();
    a.submit_single_write(4096, None, (src.mr(), 0), (dc.desc(), 0), ok.clone())
        .or_fail("posting it");
    ok.wait(WAIT)
        .or_fail("a write to a third engine after a remote access error");
    assert_copied("after a remote access error", &dc.to_vec(), &src.to_vec());
}

/// A peer that went away fails transfers within the deadline; the engine serves others.
pub fn dead_peer(h: &dyn Harness) {
    let config = quick_config(h, 1);
    let (a, b, c) = (open(&config), open(&config), open(&config));
    let src = buffer(&a, 4096, pattern(2));
    let dc = buffer(&c, 4096, |_| 0);
    // B's memory is gone with B; only its descriptor remains.
    let mut gone = vec![0u8; 4096];
    // SAFETY: deregistered (by dropping B) before `gone` is freed; no write ever succeeds.
    let (_, desc_b) = unsafe { b.reg_mr(gone.as_mut_ptr(), gone.len(), Device::Host) }.unwrap();
    drop(b);
    let start = Instant::now();
    let f = flag();
    a.submit_single_write(64, Some(1), (src.mr(), 0), (&desc_b, 0), f.clone())
        .or_fail("posting it");
    let r = f.wait(WAIT);
    assert!(
        matches!(r, Err(Error::PeerUnreachable(_) | Error::Timeout(_))),
        "got {r:?}"
    );
    assert!(start.elapsed() < Duration::from_millis(config.timeouts.transfer_ms + 3_000));
    drop(gone);
    let ok = flag();
    a.submit_single_write(4096, None, (src.mr(), 0), (dc.desc(), 0), ok.clone())
        .or_fail("posting it");
    ok.wait(WAIT)
        .or_fail("a write to a live engine after another engine died");
    assert_copied("after a dead peer", &dc.to_vec(), &src.to_vec());
}

/// Thousands of concurrent transfers each finish exactly once.
pub fn exactly_once(h: &dyn Harness) {
    let nics = h.max_nics();
    let mut config = quick_config(h, nics);
    // 3,000 transfers on a loaded 2-core machine can take longer than the suite's 2 s cap;
    // this check is about counting, not speed.
    config.timeouts.transfer_ms = 15_000;
    config.timeouts.expect_ms = 15_000;
    let (a, b) = (open(&config), open(&config));
    let src = buffer(&a, 1 << 16, pattern(8));
    let dst = buffer(&b, 1 << 16, |_| 0);
    let counter = DoneCounter::new();
    let callbacks = Arc::new(AtomicU64::new(0));
    const N: u64 = 3_000;
    let landed = expect_arrivals(&b, 12, N);
    for i in 0..N {
        let off = (i * 64) % (1 << 16);
        let on_done: OnDone = if i % 2 == 0 {
            counter.clone().into()
        } else {
            let cb = Arc::clone(&callbacks);
            OnDone::callback(move |r| {
                r.expect("write");
                cb.fetch_add(1, Ordering::SeqCst);
            })
        };
        a.submit_single_write(64, Some(12), (src.mr(), off), (dst.desc(), off), on_done)
            .or_fail("posting it");
    }
    landed.wait(WAIT).or_fail("the write's immediates");
    counter
        .wait_for(N / 2, WAIT)
        .or_fail("half of the writes' completions");
    let deadline = Instant::now() + WAIT;
    while callbacks.load(Ordering::SeqCst) < N / 2 && Instant::now() < deadline {
        std::thread::sleep(Duration::from_millis(1));
    }
    std::thread::sleep(Duration::from_millis(50));
    assert_eq!(counter.finished(), N / 2, "no completion twice");
    assert_eq!(
        callbacks.load(Ordering::SeqCst),
        N / 2,
        "every callback exactly once"
    );
    assert_eq!(b.imm_count(12), 0);
    assert_copied("exactly once", &dst.to_vec(), &src.to_vec());
    // The engine absorbs a completion it does not wait for; the counters show it. Without
    // timeouts in this check, any such completion is the backend's: one work request
    // reported twice (or one never posted) — on a striped transfer, a duplicate would have
    // finished it before its last piece landed.
    for (side, engine) in [("sender", &a), ("receiver", &b)] {
        let stale = engine.stats().expect("stats").stale_completions;
        assert_eq!(
            stale, 0,
            "the {side} saw {stale} completions for work requests that were not in flight: the backend reported a request twice (or one never posted); rule 1 is exactly once"
        );
    }
}

/// A callback may submit the next transfer (no deadlock), here 200 in a chain.
pub fn callbacks_can_submit(h: &dyn Harness) {
    let config = quick_config(h, 1);
    let (a, b) = (open(&config), open(&config));
    let src = Arc::new(buffer(&a, 4096, pattern(4)));
    let dst = Arc::new(buffer(&b, 4096, |_| 0));
    let finished = DoneFlag::new();
    fn next(
        a: Arc<TransferEngine>,
        src: Arc<HostBuffer>,
        dst: Arc<HostBuffer>,
        left: u32,
        finished: Arc<DoneFlag>,
    ) {
        if left == 0 {
            let _ = a.submit_single_write(1, None, (src.mr(), 0), (dst.desc(), 0), finished);
            return;
        }
        let (a2, s2, d2) = (Arc::clone(&a), Arc::clone(&src), Arc::clone(&dst));
        a.submit_single_write(
            4096,
            Some(6),
            (src.mr(), 0),
            (dst.desc(), 0),
            OnDone::callback(move |r| {
                r.expect("chained write");
                next(a2, s2, d2, left - 1, finished);
            }),
        )
        .unwrap();
    }
    next(
        Arc::clone(&a),
        Arc::clone(&src),
        Arc::clone(&dst),
        200,
        finished.clone(),
    );
    finished.wait(WAIT).or_fail("the 200 writes' completions");
    expect_arrivals(&b, 6, 200)
        .wait(WAIT)
        .or_fail("200 arrivals of immediate 6");
}

/// Dropping an engine fails what it still waits for with `Shutdown`, exactly once.
pub fn shutdown_fails_waiting(h: &dyn Harness) {
    let config = quick_config(h, 1);
    let b = open(&config);
    let waiting = expect_arrivals(&b, 99, 1);
    drop(b);
    assert_eq!(waiting.wait(WAIT), Err(Error::Shutdown));
}

/// A message larger than the receive buffer fails (or is dropped) without costing the
/// receiver its buffer: the next message that fits arrives, and no truncated one is delivered.
pub fn oversized_message_keeps_the_buffer(h: &dyn Harness) {
    let config = quick_config(h, 1);
    let (a, b) = (open(&config), open(&config));
    let got = Arc::new(std::sync::Mutex::new(Vec::new()));
    let g = Arc::clone(&got);
    b.submit_recvs(64, 1, move |m| g.lock().unwrap().push(m.to_vec()))
        .unwrap();
    let big = flag();
    a.submit_send(&b.main_address(), &[7; 4096], big.clone())
        .unwrap();
    let _ = big.wait(WAIT);
    let deadline = Instant::now() + WAIT;
    let mut sent = false;
    while got.lock().unwrap().is_empty() && Instant::now() < deadline {
        if !sent {
            let small = flag();
            a.submit_send(&b.main_address(), b"fits", small.clone())
                .or_fail("posting it");
            // A connection the oversized message broke fails this send; the next reconnects.
            sent = small.wait(WAIT).is_ok();
        }
        std::thread::sleep(Duration::from_millis(5));
    }
    let got = got.lock().unwrap().clone();
    assert_eq!(
        got,
        vec![b"fits".to_vec()],
        "the buffer came back and only the small message was delivered"
    );
}

/// Memory registered readable by peers, with its owner's handle dropped at the end.
struct Readable {
    engine: Arc<TransferEngine>,
    data: Vec<u8>,
    mr: engine_core::MrHandle,
    desc: MrDesc,
}

impl Readable {
    fn new(
        engine: &Arc<TransferEngine>,
        len: usize,
        fill: impl Fn(usize) -> u8,
        access: RemoteAccess,
    ) -> Self {
        let mut data: Vec<u8> = (0..len).map(fill).collect();
        // SAFETY: `data` lives in the returned value and is deregistered in its Drop before
        // it is freed.
        let (mr, desc) =
            unsafe { engine.reg_mr_with(data.as_mut_ptr(), len, Device::Host, access) }
                .unwrap_or_else(|e| panic!("registering {len} readable bytes failed: {e}"));
        Self {
            engine: Arc::clone(engine),
            data,
            mr,
            desc,
        }
    }
}

impl Drop for Readable {
    fn drop(&mut self) {
        let _ = self.engine.dereg_mr(self.mr);
        let _ = &self.data;
    }
}

/// RDMA READ: single reads of every size class (striped over every NIC count), at offsets,
/// and paged reads; the bytes arrive exactly, and the peer counts nothing.
pub fn reads(h: &dyn Harness) {
    for nics in 1..=h.max_nics() {
        let config = quick_config(h, nics);
        let (a, b) = (open(&config), open(&config));
        require_reads(&a);
        const LEN: usize = 3 << 20;
        let remote = Readable::new(&b, LEN, pattern(11), RemoteAccess::READ);
        let local = buffer(&a, LEN, |_| 0);
        for (len, at_local, at_remote) in [
            (1u64, 0u64, 0u64),
            (4000, 17, 4096),
            (65_536, 0, 100),
            (2 << 20, 4096, 8192),
        ] {
            let f = DoneFlag::new();
            a.submit_single_read(
                len,
                (local.mr(), at_local),
                (&remote.desc, at_remote),
                f.clone(),
            )
            .or_fail("posting it");
            f.wait(WAIT)
                .unwrap_or_else(|e| panic!("{nics} NICs: read of {len}: {e}"));
            let got = local.to_vec();
            let (l, r, n) = (at_local as usize, at_remote as usize, len as usize);
            assert_copied(
                &format!("{nics} NICs: read of {len}"),
                &got[l..l + n],
                &remote.data[r..r + n],
            );
        }
        // Paged: remote pages 9, 2, 5 into local pages 0, 1, 2.
        let pages = |indices: Vec<u32>| Pages {
            indices,
            stride: 8192,
            offset: 64,
        };
        let (lp, rp) = (pages(vec![0, 1, 2]), pages(vec![9, 2, 5]));
        let f = DoneFlag::new();
        a.submit_paged_reads(4096, (local.mr(), &lp), (&remote.desc, &rp), f.clone())
            .or_fail("posting it");
        f.wait(WAIT)
            .unwrap_or_else(|e| panic!("{nics} NICs: paged read: {e}"));
        let got = local.to_vec();
        for (l, r) in lp.indices.iter().zip(&rp.indices) {
            let (l, r) = (64 + *l as usize * 8192, 64 + *r as usize * 8192);
            assert_copied("paged read", &got[l..l + 4096], &remote.data[r..r + 4096]);
        }
        assert_eq!(b.imm_count(0), 0, "a read counts nothing at the peer");
        // Out of bounds on either side: refused before anything is posted.
        assert!(matches!(
            a.submit_single_read(
                64,
                (local.mr(), LEN as u64 - 1),
                (&remote.desc, 0),
                DoneFlag::new()
            ),
            Err(Error::OutOfBounds { .. })
        ));
        assert!(matches!(
            a.submit_single_read(
                64,
                (local.mr(), 0),
                (&remote.desc, LEN as u64),
                DoneFlag::new()
            ),
            Err(Error::OutOfBounds { .. })
        ));
    }
}

/// Reading a region its owner registered only for writes is refused at submit with a remote
/// access error, on every backend (its descriptor says so: a courtesy check, since providers
/// such as libfabric's shm and tcp do not enforce it), and nothing is read; a region
/// registered for both can be read and written.
pub fn read_of_an_unreadable_region(h: &dyn Harness) {
    let config = quick_config(h, 1);
    let (a, b) = (open(&config), open(&config));
    require_reads(&a);
    let write_only = buffer(&b, 4096, pattern(3));
    let local = buffer(&a, 4096, |_| 0xaa);
    let refused = a.submit_single_read(
        4096,
        (local.mr(), 0),
        (write_only.desc(), 0),
        DoneFlag::new(),
    );
    assert!(
        matches!(&refused, Err(Error::RemoteAccess(m)) if m.contains("READ")),
        "a read of a write-only region must be refused at submit, naming RemoteAccess::READ: {refused:?}"
    );
    let pages = Pages {
        indices: vec![0],
        stride: 4096,
        offset: 0,
    };
    let refused = a.submit_paged_reads(
        4096,
        (local.mr(), &pages),
        (write_only.desc(), &pages),
        DoneFlag::new(),
    );
    assert!(
        matches!(refused, Err(Error::RemoteAccess(_))),
        "paged: {refused:?}"
    );
    assert!(
        local.to_vec().iter().all(|&x| x == 0xaa),
        "nothing may be read"
    );
    let both = Readable::new(&b, 4096, pattern(4), RemoteAccess::READ_WRITE);
    let f = DoneFlag::new();
    a.submit_single_read(4096, (local.mr(), 0), (&both.desc, 0), f.clone())
        .or_fail("posting it");
    f.wait(WAIT).or_fail("a read of a read-write region");
    assert_copied("read of a read-write region", &local.to_vec(), &both.data);
}

/// A descriptor forged to say a write-only region is readable gets past the initiator's
/// check; the provider then refuses the read (where it enforces access: not libfabric's shm
/// or tcp) and nothing is read.
pub fn read_of_an_unreadable_region_by_a_forged_descriptor(h: &dyn Harness) {
    let config = quick_config(h, 1);
    let (a, b) = (open(&config), open(&config));
    require_reads(&a);
    let write_only = buffer(&b, 4096, pattern(3));
    let forged = write_only
        .desc()
        .clone()
        .with_access(Some(RemoteAccess::READ_WRITE));
    let local = buffer(&a, 4096, |_| 0xaa);
    let f = DoneFlag::new();
    a.submit_single_read(4096, (local.mr(), 0), (&forged, 0), f.clone())
        .or_fail("posting it");
    let r = f.wait(WAIT);
    if h.typed_remote_access() {
        assert!(matches!(r, Err(Error::RemoteAccess(_))), "{r:?}");
    } else {
        assert!(r.is_err(), "a read of a write-only region succeeded");
    }
    assert!(
        local.to_vec().iter().all(|&x| x == 0xaa),
        "nothing may be read"
    );
}

/// A read from a peer that died fails (never hangs, never succeeds); reads from others go on.
pub fn read_from_a_dead_peer(h: &dyn Harness) {
    let config = quick_config(h, 1);
    let (a, b) = (open(&config), open(&config));
    require_reads(&a);
    let remote = Readable::new(&b, 4096, pattern(5), RemoteAccess::READ);
    let desc = remote.desc.clone();
    let local = buffer(&a, 4096, |_| 0);
    let f = DoneFlag::new();
    a.submit_single_read(4096, (local.mr(), 0), (&desc, 0), f.clone())
        .or_fail("posting it");
    f.wait(WAIT).or_fail("a read from a live peer");
    drop(remote);
    drop(b);
    let f = DoneFlag::new();
    a.submit_single_read(4096, (local.mr(), 0), (&desc, 0), f.clone())
        .or_fail("posting it");
    assert!(f.wait(WAIT).is_err(), "a read from a dead peer succeeded");
}

/// A zero-byte write with an immediate (a pure signal) arrives and is counted, unless the
/// backend declares it cannot (then the engine refuses it, typed).
pub fn zero_byte_write_with_imm(h: &dyn Harness) {
    let config = quick_config(h, 1);
    let (a, b) = (open(&config), open(&config));
    let src = buffer(&a, 64, |_| 1);
    let dst = buffer(&b, 64, |_| 0);
    let sent = flag();
    a.submit_single_write(0, Some(901), (src.mr(), 0), (dst.desc(), 0), sent.clone())
        .or_fail("posting it");
    if !a.capabilities()[0].zero_byte_writes {
        assert!(
            matches!(sent.wait(WAIT), Err(Error::InvalidArgument(_))),
            "a backend without zero-byte writes must have them refused"
        );
        return;
    }
    let n = b.expected_arrivals(TransferShape::Single { len: 0 });
    let landed = expect_arrivals(&b, 901, n);
    sent.wait(WAIT)
        .unwrap_or_else(|e| panic!("a zero-byte write failed: {e}"));
    landed
        .wait(WAIT)
        .unwrap_or_else(|e| panic!("a zero-byte write's immediate was not counted: {e}"));
    assert!(
        dst.to_vec().iter().all(|&x| x == 0),
        "a zero-byte write wrote bytes"
    );
}

/// Several engines of one backend in one process, each with its own worker calling into its
/// own Domains concurrently (a plugin's Domains must not share unguarded state): a ring of
/// writes with immediates, every one counted and every byte checked.
pub fn engines_in_parallel(h: &dyn Harness) {
    const ENGINES: usize = 4;
    const WRITES: u32 = 100;
    let config = quick_config(h, 1);
    let engines: Vec<_> = (0..ENGINES).map(|_| open(&config)).collect();
    let srcs: Vec<_> = engines
        .iter()
        .enumerate()
        .map(|(i, e)| buffer(e, 4096, pattern(i as u64 + 40)))
        .collect();
    let dsts: Vec<_> = engines
        .iter()
        .map(|e| buffer(e, 4096 * WRITES as usize, |_| 0))
        .collect();
    let n = engines[0].expected_arrivals(TransferShape::Single { len: 4096 });
    let landed: Vec<_> = engines
        .iter()
        .map(|e| expect_arrivals(e, 77, n * u64::from(WRITES)))
        .collect();
    std::thread::scope(|scope| {
        for i in 0..ENGINES {
            let (engine, src, dst) = (&engines[i], &srcs[i], &dsts[(i + 1) % ENGINES]);
            scope.spawn(move || {
                let sent = DoneCounter::new();
                for w in 0..WRITES {
                    let at = u64::from(w) * 4096;
                    engine
                        .submit_single_write(
                            4096,
                            Some(77),
                            (src.mr(), 0),
                            (dst.desc(), at),
                            sent.clone(),
                        )
                        .or_fail("posting it");
                }
                sent.wait_for(u64::from(WRITES), WAIT)
                    .unwrap_or_else(|e| panic!("engine {i}'s writes failed: {e}"));
            });
        }
    });
    for (i, l) in landed.iter().enumerate() {
        l.wait(WAIT)
            .unwrap_or_else(|e| panic!("engine {i} did not count every arrival: {e}"));
    }
    for i in 0..ENGINES {
        let got = dsts[(i + 1) % ENGINES].to_vec();
        for chunk in got.chunks(4096) {
            assert_copied("a write in the ring of engines", chunk, &srcs[i].to_vec());
        }
    }
}

/// Two raw Domains of the harness's backend on its first NIC, driven here without an engine:
/// what the engine would smooth over (a late repost, a worker that polls anyway) shows.
struct RawPair {
    a: Box<dyn engine_core::domain::Domain>,
    b: Box<dyn engine_core::domain::Domain>,
    a_events: Vec<engine_core::domain::Event>,
    b_events: Vec<engine_core::domain::Event>,
    /// The suite's short deadline (`quick_config`'s transfer timeout).
    deadline: Duration,
}

impl RawPair {
    fn open(h: &dyn Harness) -> Self {
        let config = quick_config(h, 1);
        let backend = engine_core::plugin::find_backend(&config.backend, config.plugin.as_deref())
            .unwrap_or_else(|e| panic!("cannot find the backend: {e}"));
        let options = config.backend_options();
        let nic = &config.groups[0].nics[0];
        let open = || {
            backend
                .open(&engine_core::domain::DomainConfig {
                    nic,
                    options: &options,
                })
                .unwrap_or_else(|e| panic!("cannot open NIC {nic}: {e}"))
        };
        Self {
            a: open(),
            b: open(),
            a_events: Vec::new(),
            b_events: Vec::new(),
            deadline: config.timeouts.transfer(),
        }
    }

    fn poll(&mut self, poll_b: bool) {
        self.a.poll(&mut self.a_events).expect("polling the sender");
        if poll_b {
            self.b
                .poll(&mut self.b_events)
                .expect("polling the receiver");
        }
    }

    /// Polls both until `done` holds, for at most `limit`; returns whether it held.
    fn poll_until(&mut self, limit: Duration, done: impl Fn(&Self) -> bool) -> bool {
        let until = Instant::now() + limit;
        while Instant::now() < until {
            self.poll(true);
            if done(self) {
                return true;
            }
            std::thread::yield_now();
        }
        done(self)
    }

    fn messages(&self) -> Vec<Vec<u8>> {
        self.b_events
            .iter()
            .filter_map(|e| match e {
                engine_core::domain::Event::Message { data } => Some(data.clone()),
                _ => None,
            })
            .collect()
    }

    fn register(
        domain: &mut dyn engine_core::domain::Domain,
        mem: &mut [u8],
    ) -> engine_core::domain::Registration {
        domain
            .register(&engine_core::domain::MemoryRegion {
                ptr: mem.as_mut_ptr() as u64,
                len: mem.len() as u64,
                device: Device::Host,
                remote_write: true,
                remote_read: false,
            })
            .unwrap_or_else(|e| panic!("registering {} bytes failed: {e}", mem.len()))
    }

    /// Posts a write of all of `src` (registered as `src_reg` on a) into `dst` (b's
    /// registration `dst_reg`), retrying while the queue is full.
    fn write(
        &mut self,
        src: &[u8],
        src_reg: engine_core::domain::Registration,
        dst: &[u8],
        dst_reg: engine_core::domain::Registration,
        imm: u32,
    ) {
        let peer = self.b.address();
        let wr = engine_core::domain::RdmaRequest {
            wr_id: 1,
            op: engine_core::domain::RdmaOp::Write { imm: Some(imm) },
            peer: &peer,
            local_addr: src.as_ptr() as u64,
            local_key: src_reg.local_key,
            remote_addr: dst.as_ptr() as u64,
            remote_key: dst_reg.remote_key,
            remote_base: dst.as_ptr() as u64,
            len: src.len() as u64,
        };
        let until = Instant::now() + WAIT;
        while self.a.post_rdma(&wr).expect("posting a write")
            == engine_core::domain::PostStatus::Busy
        {
            assert!(Instant::now() < until, "the sender stayed busy");
            self.poll(true);
        }
    }
}

/// Messages land only in receive buffers the engine posted: with one buffer posted and two
/// messages sent, one arrives; the second waits until a buffer is posted again, then arrives.
/// A backend that ignores `post_recvs` (delivering into buffers of its own) fails here — on a
/// real NIC that is a receiver-not-ready stall or a dropped message the engine never sees.
pub fn messages_use_posted_receives(h: &dyn Harness) {
    let mut pair = RawPair::open(h);
    pair.b
        .post_recvs(64, 1)
        .expect("posting one receive buffer");
    let peer = pair.b.address();
    for (id, text) in [(1u64, &b"first"[..]), (2, b"second")] {
        let until = Instant::now() + WAIT;
        while pair.a.post_send(id, &peer, text).expect("posting a send")
            == engine_core::domain::PostStatus::Busy
        {
            assert!(Instant::now() < until, "the sender stayed busy");
            pair.poll(true);
        }
    }
    assert!(
        pair.poll_until(WAIT, |p| !p.messages().is_empty()),
        "no message arrived in the posted buffer"
    );
    // Long enough for a second message to show up if it had somewhere to go.
    pair.poll_until(Duration::from_millis(300), |p| p.messages().len() > 1);
    assert_eq!(
        pair.messages().len(),
        1,
        "two messages arrived with one receive buffer posted: the backend ignores post_recvs"
    );
    pair.b
        .post_recvs(64, 1)
        .expect("posting a second receive buffer");
    assert!(
        pair.poll_until(WAIT, |p| p.messages().len() == 2),
        "the second message never arrived after a buffer was posted"
    );
    let mut got = pair.messages();
    got.sort();
    assert_eq!(got, vec![b"first".to_vec(), b"second".to_vec()]);
}

/// An immediate is reported only once its write's data is in the receiver's memory: checked
/// the moment the arrival event is seen, on a write large enough to take a while.
pub fn immediate_arrives_after_its_data(h: &dyn Harness) {
    let mut pair = RawPair::open(h);
    let len = 1 << 20;
    let mut src: Vec<u8> = (0..len).map(pattern(91)).collect();
    let mut dst = vec![0u8; len];
    let src_reg = RawPair::register(&mut *pair.a, &mut src);
    let dst_reg = RawPair::register(&mut *pair.b, &mut dst);
    pair.write(&src, src_reg, &dst, dst_reg, 4242);
    let arrived = |p: &RawPair| {
        p.b_events
            .iter()
            .any(|e| matches!(e, engine_core::domain::Event::ImmArrival { imm: 4242, .. }))
    };
    assert!(
        pair.poll_until(WAIT, arrived),
        "the immediate never arrived"
    );
    // `dst` is ours; the NIC is done with these bytes once their immediate arrived.
    assert_copied("data at the moment its immediate arrived", &dst, &src);
    pair.poll_until(WAIT, |p| {
        p.a_events
            .iter()
            .any(|e| matches!(e, engine_core::domain::Event::Done { .. }))
    });
    let _ = pair.a.deregister(src_reg.local_key);
    let _ = pair.b.deregister(dst_reg.local_key);
}

/// A Domain that promises to wake the engine (`set_waker` returns true) calls the waker when
/// an arrival is ready, without being polled first; an engine trusting the promise parks.
pub fn a_promised_waker_is_called(h: &dyn Harness) {
    let mut pair = RawPair::open(h);
    let woken = Arc::new(std::sync::atomic::AtomicBool::new(false));
    let w = Arc::clone(&woken);
    let will_wake = pair.b.set_waker(engine_core::domain::Waker::new(move || {
        w.store(true, Ordering::SeqCst)
    }));
    if !will_wake {
        return; // it will be polled on an interval instead; nothing was promised
    }
    let mut src = vec![5u8; 4096];
    let mut dst = vec![0u8; 4096];
    let src_reg = RawPair::register(&mut *pair.a, &mut src);
    let dst_reg = RawPair::register(&mut *pair.b, &mut dst);
    // Set-up work may have woken it already; only what follows the write counts.
    pair.poll(true);
    pair.b_events.clear();
    woken.store(false, Ordering::SeqCst);
    pair.write(&src, src_reg, &dst, dst_reg, 5151);
    let until = Instant::now() + pair.deadline;
    while !woken.load(Ordering::SeqCst) && Instant::now() < until {
        pair.poll(false); // the sender only: the receiver must wake us by itself
        std::thread::yield_now();
    }
    assert!(
        woken.load(Ordering::SeqCst),
        "set_waker returned true, but the Domain never called the waker for an arrival"
    );
    assert!(
        pair.poll_until(WAIT, |p| p.b_events.iter().any(|e| matches!(
            e,
            engine_core::domain::Event::ImmArrival { imm: 5151, .. }
        ))),
        "woken, but the arrival never came"
    );
    let _ = pair.a.deregister(src_reg.local_key);
    let _ = pair.b.deregister(dst_reg.local_key);
}

/// One conformance check: panics, naming what broke, if the backend fails it.
pub type Check = fn(&dyn Harness);

/// Every check of the suite, by name, in the order `conformance_suite!` and the
/// `xfer conformance` command run them.
pub const CHECKS: &[(&str, Check)] = &[
    ("single_write", single_write),
    ("write_at_offsets_without_imm", write_at_offsets_without_imm),
    ("striping", striping),
    ("paged_writes", paged_writes),
    ("scatter", scatter),
    ("barrier", barrier),
    ("send_recv", send_recv),
    ("imm_counts", imm_counts),
    ("expectation_times_out", expectation_times_out),
    ("bad_input", bad_input),
    ("remote_access_error", remote_access_error),
    ("dead_peer", dead_peer),
    ("exactly_once", exactly_once),
    ("callbacks_can_submit", callbacks_can_submit),
    ("shutdown_fails_waiting", shutdown_fails_waiting),
    ("reads", reads),
    ("read_of_an_unreadable_region", read_of_an_unreadable_region),
    (
        "read_of_an_unreadable_region_by_a_forged_descriptor",
        read_of_an_unreadable_region_by_a_forged_descriptor,
    ),
    ("read_from_a_dead_peer", read_from_a_dead_peer),
    (
        "oversized_message_keeps_the_buffer",
        oversized_message_keeps_the_buffer,
    ),
    (
        "notifications_follow_their_data",
        notifications_follow_their_data,
    ),
    ("zero_byte_write_with_imm", zero_byte_write_with_imm),
    ("engines_in_parallel", engines_in_parallel),
    ("messages_use_posted_receives", messages_use_posted_receives),
    (
        "immediate_arrives_after_its_data",
        immediate_arrives_after_its_data,
    ),
    ("a_promised_waker_is_called", a_promised_waker_is_called),
];

/// How one check ended.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum CheckOutcome {
    /// It passed.
    Passed,
    /// The harness says it cannot pass on this backend, and why.
    Skipped(&'static str),
    /// It failed: the panic's text.
    Failed(String),
}

/// Why a check ended without testing anything: a capability the backend may lack (reads,
/// for a plugin built before ABI version 2). The suite reports it as `SKIP`, never a pass.
struct SkipCheck(&'static str);

/// Ends the running check as skipped, with why (see `SkipCheck`): only for what the ABI
/// makes optional, so that "supported exactly when it passes" holds.
pub fn skip_check(why: &'static str) -> ! {
    std::panic::panic_any(SkipCheck(why))
}

/// The reason every read check gives on a backend without reads.
const NO_READS: &str =
    "the backend has no RDMA READ (a plugin built before ABI version 2, or one that declares none)";

/// Skips the running check unless `engine` reads.
fn require_reads(engine: &TransferEngine) {
    if !engine.supports_reads() {
        skip_check(NO_READS);
    }
}

/// Runs one check, catching its panic (a failed check, or a skip) into the outcome.
pub fn run_check(h: &dyn Harness, name: &str, check: Check) -> CheckOutcome {
    if let Some(why) = h.skip(name) {
        return CheckOutcome::Skipped(why);
    }
    match std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| check(h))) {
        Ok(()) => CheckOutcome::Passed,
        Err(panic) => match panic.downcast_ref::<SkipCheck>() {
            Some(SkipCheck(why)) => CheckOutcome::Skipped(why),
            None => CheckOutcome::Failed(xfer_plugin::panic_message(&*panic)),
        },
    }
}

/// Expands to one `#[test]` per conformance check, each run with the given harness value.
///
/// `conformance_suite!(ignored = "why", harness)` marks every test `#[ignore]`, for backends
/// whose devices exist only somewhere else (the rxe guest runs them with `--ignored`).
#[macro_export]
macro_rules! conformance_suite {
    (ignored = $why:literal, $harness:expr) => {
        $crate::conformance_suite!(@tests [ignore = $why] $harness;
            single_write, write_at_offsets_without_imm, striping, paged_writes, scatter, barrier,
            send_recv, imm_counts, expectation_times_out, bad_input, remote_access_error,
            dead_peer, exactly_once, callbacks_can_submit, shutdown_fails_waiting,
            reads, read_of_an_unreadable_region,
            read_of_an_unreadable_region_by_a_forged_descriptor, read_from_a_dead_peer,
            oversized_message_keeps_the_buffer, notifications_follow_their_data,
            zero_byte_write_with_imm, engines_in_parallel, messages_use_posted_receives,
            immediate_arrives_after_its_data, a_promised_waker_is_called);
    };
    ($harness:expr) => {
        $crate::conformance_suite!(@tests [cfg_attr(any(), ignore)] $harness;
            single_write, write_at_offsets_without_imm, striping, paged_writes, scatter, barrier,
            send_recv, imm_counts, expectation_times_out, bad_input, remote_access_error,
            dead_peer, exactly_once, callbacks_can_submit, shutdown_fails_waiting,
            reads, read_of_an_unreadable_region,
            read_of_an_unreadable_region_by_a_forged_descriptor, read_from_a_dead_peer,
            oversized_message_keeps_the_buffer, notifications_follow_their_data,
            zero_byte_write_with_imm, engines_in_parallel, messages_use_posted_receives,
            immediate_arrives_after_its_data, a_promised_waker_is_called);
    };
    (@tests [$attr:meta] $harness:expr; $($name:ident),* $(,)?) => {
        /// The tests above are the whole suite: the same checks as `CHECKS`, in order.
        #[test]
        fn conformance_tests_cover_every_check() {
            let generated = [$(stringify!($name)),*];
            let listed: Vec<&str> = $crate::CHECKS.iter().map(|c| c.0).collect();
            assert_eq!(generated.to_vec(), listed);
        }
        $(
            #[test]
            #[$attr]
            fn $name() {
                let harness = $harness;
                match $crate::run_check(
                    &harness,
                    stringify!($name),
                    $crate::$name,
                ) {
                    $crate::CheckOutcome::Passed => {}
                    $crate::CheckOutcome::Skipped(why) => {
                        eprintln!("conformance check {} SKIPPED: {why}", stringify!($name));
                    }
                    $crate::CheckOutcome::Failed(message) => panic!("{message}"),
                }
            }
        )*
    };
}
