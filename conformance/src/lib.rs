//! # xfer-conformance: the backend conformance suite
//!
//! The checks live in one module per topic (`writes`, `messages`, `counting`, `failures`,
//! `reads`, `domain`), re-exported here; this file holds what they share: the [`Harness`], the
//! small helpers, [`CHECKS`] (every check by name) and the `conformance_suite!` macro that turns
//! that list into tests.
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
#![deny(unsafe_code)]

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

    /// Whether the backend names a message's sender (ABI 7's `EVENT_MESSAGE_FROM`): then
    /// `messages_name_their_sender` fails, rather than skips, where no message names one.
    fn names_senders(&self) -> bool {
        false
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
        E::Refused { .. } => "the request was refused as something the backend cannot do, by its declared capabilities or by the plugin: is it one the plugin should carry out?",
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

mod counting;
mod domain;
mod failures;
mod messages;
mod reads;
mod writes;

pub use counting::{expectation_times_out, imm_counts};
pub use domain::{
    a_promised_waker_is_called, immediate_arrives_after_its_data, messages_use_posted_receives,
};
pub use failures::{
    bad_input, callbacks_can_submit, dead_peer, engines_in_parallel, exactly_once,
    remote_access_error, shutdown_fails_waiting,
};
pub use messages::{
    messages_name_their_sender, notifications_follow_their_data,
    oversized_message_keeps_the_buffer, send_recv,
};
pub use reads::{
    read_from_a_dead_peer, read_of_an_unreadable_region,
    read_of_an_unreadable_region_by_a_forged_descriptor, reads,
};
pub use writes::{
    barrier, paged_writes, scatter, single_write, striping, write_at_offsets_without_imm,
    zero_byte_write_with_imm,
};

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
    ("messages_name_their_sender", messages_name_their_sender),
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
            immediate_arrives_after_its_data, a_promised_waker_is_called,
            messages_name_their_sender);
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
            immediate_arrives_after_its_data, a_promised_waker_is_called,
            messages_name_their_sender);
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
