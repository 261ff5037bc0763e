//! Helpers shared by the mock's integration tests.
#![allow(dead_code, unreachable_pub)]

use std::path::{Path, PathBuf};

use engine_core::Config;

/// A mock config with `nics` NICs and `extra` TOML appended (e.g. a `[backends.mock]` table).
pub fn mock_config(nics: usize, extra: &str) -> Config {
    backend_mock::link();
    let names: Vec<String> = (0..nics).map(|i| format!("\"mock{i}\"")).collect();
    let text = format!(
        "backend = \"mock\"\n[[groups]]\nnics = [{}]\n{extra}",
        names.join(", ")
    );
    Config::from_toml(&text, Path::new("<mock test>")).unwrap()
}

/// A cdylib built by cargo next to this test binary (`target/<profile>/` or its `deps/`).
pub fn built_library(stem: &str) -> PathBuf {
    let exe = std::env::current_exe().unwrap();
    let deps = exe.parent().unwrap();
    let file = format!("lib{stem}.so");
    [deps.join(&file), deps.parent().unwrap().join(&file)]
        .into_iter()
        .find(|p| p.is_file())
        .unwrap_or_else(|| panic!("{file} was not built next to {}", exe.display()))
}
