//! The conformance suite on the mock, linked in and registered statically.

use engine_core::Config;
use xfer_conformance::Harness;

struct Mock;

impl Harness for Mock {
    fn config(&self, nics: usize) -> Config {
        backend_mock::link();
        let names: Vec<String> = (0..nics).map(|i| format!("\"mock{i}\"")).collect();
        let text = format!(
            "backend = \"mock\"\n[[groups]]\nnics = [{}]\n",
            names.join(", ")
        );
        Config::from_toml(&text, std::path::Path::new("<mock conformance>")).unwrap()
    }

    fn max_nics(&self) -> usize {
        4
    }
}

xfer_conformance::conformance_suite!(Mock);
