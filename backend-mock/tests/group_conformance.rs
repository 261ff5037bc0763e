//! The whole conformance suite on a vendor-style DomainGroup (`mockrails`: the mock's NICs as
//! rails, each unit whole on one rail), proving the worker drives a group without knowing
//! which one and that receivers count what the group plans. The group is registered here, the
//! way a vendor whose library spreads traffic over its rails plugs in its own: the mock's
//! `open` under a second name, plus a [`GroupRegistration`].

mod common;

use std::sync::Arc;

use engine_core::domain::{BackendRegistration, Domain, DomainError};
use engine_core::group::{DomainGroup, GroupRegistration, SpreadPolicy, WholeUnits};
use engine_core::{Config, TransferShape};
use xfer_conformance::Harness;

const RAILS_NAME: &str = "mockrails";

/// The mock's NICs as rails, each unit (a single write, a page, a scatter destination) whole
/// on one of them ([`WholeUnits`]), so the receiver counts one arrival per unit whatever the
/// NIC count.
struct RailsGroup {
    rails: Vec<Box<dyn Domain>>,
    policy: Arc<WholeUnits>,
}

impl DomainGroup for RailsGroup {
    fn domains(&self) -> &[Box<dyn Domain>] {
        &self.rails
    }

    fn domains_mut(&mut self) -> &mut Vec<Box<dyn Domain>> {
        &mut self.rails
    }

    fn spread(&self) -> Arc<dyn SpreadPolicy> {
        self.policy.clone()
    }
}

fn open_rails_group(
    rails: Vec<Box<dyn Domain>>,
    config: &Config,
) -> Result<Box<dyn DomainGroup>, DomainError> {
    Ok(Box::new(RailsGroup {
        rails,
        policy: Arc::new(WholeUnits {
            max_chunk: config.stripe.max_chunk,
        }),
    }))
}

inventory::submit! {
    BackendRegistration {
        name: RAILS_NAME,
        open: backend_mock::open,
        check_options: |text| backend_mock::MockOptions::parse(text).map(|_| ()).map_err(|e| e.message),
    }
}

inventory::submit! {
    GroupRegistration { backend: RAILS_NAME, open: open_rails_group }
}

struct Rails;

impl Harness for Rails {
    fn config(&self, nics: usize) -> Config {
        let mut config = common::mock_config(nics, "");
        config.backend = RAILS_NAME.into();
        config
    }

    fn max_nics(&self) -> usize {
        4
    }
}

xfer_conformance::conformance_suite!(Rails);

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
