//! Configs for engines on libfabric's shm and tcp providers.
#![allow(dead_code, unreachable_pub)]

use std::path::Path;

use engine_core::Config;

/// An efa-backend config on `provider` with `nics` endpoints (`auto`, `auto#1`, ...).
pub fn config(provider: &str, nics: usize) -> Config {
    config_with(provider, nics, "")
}

/// [`config`] with more TOML after it (its own tables).
pub fn config_with(provider: &str, nics: usize, extra: &str) -> Config {
    backend_efa::link();
    // tcp;ofi_rxm must stay on loopback; harmless for shm.
    std::env::set_var("FI_TCP_IFACE", "lo");
    let names: Vec<String> = (0..nics)
        .map(|i| {
            if i == 0 {
                "\"auto\"".into()
            } else {
                format!("\"auto#{i}\"")
            }
        })
        .collect();
    let text = format!(
        "backend = \"efa\"\n[[groups]]\nnics = [{}]\n[worker]\nidle_poll_us = 0\n[backends.efa]\nprovider = \"{provider}\"\n{extra}",
        names.join(", ")
    );
    Config::from_toml(&text, Path::new("<efa test>")).unwrap()
}
