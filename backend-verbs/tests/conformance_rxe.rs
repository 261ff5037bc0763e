//! The conformance suite on soft-RoCE devices: run inside the rxe guest with
//! `cargo xtask rxe --nics 2 -- <this test binary> --ignored` (cargo xtask test does).

struct Rxe;

impl engine_core::conformance::Harness for Rxe {
    fn config(&self, nics: usize) -> engine_core::Config {
        backend_verbs::link();
        let names: Vec<String> = (0..nics).map(|i| format!("\"rxe{i}\"")).collect();
        let text = format!(
            "backend = \"verbs\"\n[[groups]]\nnics = [{}]\n[worker]\nidle_poll_us = 0\n",
            names.join(", ")
        );
        engine_core::Config::from_toml(&text, std::path::Path::new("<rxe test>")).unwrap()
    }

    fn max_nics(&self) -> usize {
        backend_verbs::devices()
            .iter()
            .filter(|d| d.starts_with("rxe"))
            .count()
            .clamp(1, 4)
    }
}

engine_core::conformance_suite!(
    ignored = "needs soft-RoCE devices: runs in the rxe guest",
    Rxe
);
