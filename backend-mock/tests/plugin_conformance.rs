//! The whole conformance suite again, with the mock loaded from its cdylib through dlopen and
//! the versioned C ABI, exactly as a third-party plugin would be.

mod common;

use engine_core::conformance::Harness;
use engine_core::Config;

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

engine_core::conformance_suite!(MockPlugin);

#[test]
fn the_engine_really_runs_the_plugin() {
    let engine = engine_core::TransferEngine::open(&MockPlugin.config(1)).unwrap();
    assert_eq!(engine.backend(), "mock");
    // The plugin's fabric is its own copy: a statically linked kill() cannot see its NICs.
    assert!(!backend_mock::kill(&engine.main_address()));
}
