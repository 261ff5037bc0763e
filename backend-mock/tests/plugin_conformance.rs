//! The whole conformance suite again, with the mock loaded from its cdylib through dlopen and
//! the versioned C ABI, exactly as a third-party plugin would be.

mod common;

use engine_core::Config;
use xfer_conformance::Harness;

struct MockPlugin;

impl Harness for MockPlugin {
    fn config(&self, nics: usize) -> Config {
        let mut config = common::mock_config(nics, "");
        config.plugin = Some(common::built_library("backend_mock"));
        config
    }

    fn max_nics(&self) -> usize {
        4
    }
}

xfer_conformance::conformance_suite!(MockPlugin);

#[test]
fn the_engine_really_runs_the_plugin() {
    let engine = engine_core::TransferEngine::open(&MockPlugin.config(1)).unwrap();
    assert_eq!(engine.backend(), "mock");
    // The plugin's fabric is its own copy: a statically linked kill() cannot see its NICs.
    assert!(!backend_mock::kill(&engine.main_address()));
}

/// The suite catches broken plugins: one that delivers messages into buffers of its own
/// (ignoring `post_recvs`), and one that promises a waker it never calls.
#[test]
fn the_suite_fails_a_plugin_that_breaks_the_receive_or_waker_rules() {
    struct Broken(&'static str);
    impl Harness for Broken {
        fn config(&self, nics: usize) -> Config {
            let mut config = common::mock_config(nics, self.0);
            config.plugin = Some(common::built_library("backend_mock"));
            config
        }
        fn max_nics(&self) -> usize {
            1
        }
    }
    use xfer_conformance::{
        a_promised_waker_is_called, exactly_once, messages_use_posted_receives, run_check,
        CheckOutcome,
    };
    let outcome = run_check(
        &Broken("[backends.mock]\nreceives_multiplier = 4\n"),
        "messages_use_posted_receives",
        messages_use_posted_receives,
    );
    assert!(
        matches!(&outcome, CheckOutcome::Failed(m) if m.contains("ignores post_recvs")),
        "{outcome:?}"
    );
    let outcome = run_check(
        &Broken("[backends.mock]\nsilent_waker = true\n"),
        "a_promised_waker_is_called",
        a_promised_waker_is_called,
    );
    assert!(
        matches!(&outcome, CheckOutcome::Failed(m) if m.contains("never called the waker")),
        "{outcome:?}"
    );
    // Issue 26: a plugin reporting every completion twice passed the whole suite.
    let outcome = run_check(
        &Broken("[backends.mock]\nduplicate_completions = true\n"),
        "exactly_once",
        exactly_once,
    );
    assert!(
        matches!(&outcome, CheckOutcome::Failed(m) if m.contains("reported a request twice")),
        "{outcome:?}"
    );
}
