//! The whole conformance suite on a vendor-style DomainGroup (`mockrails`: the mock's NICs as
//! rails, each unit whole on one rail), proving the worker drives a group without knowing
//! which one and that receivers count what the group plans.

mod common;

use engine_core::conformance::Harness;
use engine_core::{Config, TransferShape};

struct Rails;

impl Harness for Rails {
    fn config(&self, nics: usize) -> Config {
        let mut config = common::mock_config(nics, "");
        config.backend = backend_mock::RAILS_NAME.into();
        config
    }

    fn max_nics(&self) -> usize {
        4
    }
}

engine_core::conformance_suite!(Rails);

#[test]
fn the_backends_own_group_plans_and_counts() {
    let engine = engine_core::TransferEngine::open(&Rails.config(4)).unwrap();
    let shape = TransferShape::Single { len: 3 << 20 };
    assert_eq!(
        engine.expected_arrivals(shape),
        1,
        "one unit, whole on one rail"
    );
    assert!(
        engine_core::expected_arrivals(shape, 4, &engine.config().stripe) > 1,
        "the built-in striping group would have cut it"
    );
}
