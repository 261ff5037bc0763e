//! `xfer conformance`: the backend conformance suite as a command, so a NIC vendor tests a
//! plugin (Rust or C) without writing any Rust. Each check prints one line; the exit status is
//! 1 if any failed.

use std::path::{Path, PathBuf};
use std::process::ExitCode;
use std::time::Instant;

use engine_core::config::GroupConfig;
use engine_core::Config;
use xfer_conformance::{run_check, CheckOutcome, Harness, CHECKS};

/// What the command was asked to test.
pub(crate) struct Request<'a> {
    pub(crate) config: Option<&'a Path>,
    pub(crate) plugin: Option<&'a Path>,
    pub(crate) backend: Option<&'a str>,
    pub(crate) nics: &'a [String],
    /// Run only the checks whose name contains one of these (all when empty).
    pub(crate) only: &'a [String],
    /// One JSON object on stdout instead of lines.
    pub(crate) json: bool,
}

/// The checks `only` selects, in the suite's order; a filter that matches nothing is an
/// error naming it and the checks there are (a typo must not pass as "0 passed").
fn selected(only: &[String]) -> Result<Vec<(&'static str, xfer_conformance::Check)>, String> {
    for filter in only {
        if !CHECKS
            .iter()
            .any(|(name, _)| name.contains(filter.as_str()))
        {
            let names: Vec<&str> = CHECKS.iter().map(|(n, _)| *n).collect();
            return Err(format!(
                "--check {filter:?} matches no check; the checks are: {}",
                names.join(", ")
            ));
        }
    }
    Ok(CHECKS
        .iter()
        .filter(|(name, _)| only.is_empty() || only.iter().any(|f| name.contains(f.as_str())))
        .copied()
        .collect())
}

/// Loads the plugin once before any check, so a library that cannot be loaded (not a
/// plugin, another ABI version) is reported once, not by every check.
fn preflight(harness: &CommandHarness) -> Result<(), String> {
    let Some(path) = &harness.base.plugin else {
        return Ok(());
    };
    engine_core::plugin::LoadedPlugin::load(path, &harness.base.backend)
        .map(drop)
        .map_err(|e| e.to_string())
}

/// Engines for the suite: the given config (or the default) with the plugin, backend and
/// NIC names from the command line.
struct CommandHarness {
    base: Config,
    nics: Vec<String>,
}

impl Harness for CommandHarness {
    fn config(&self, nics: usize) -> Config {
        let mut config = self.base.clone();
        config.groups = vec![GroupConfig {
            nics: self.nics[..nics].to_vec(),
            worker_cpu: None,
        }];
        config
    }

    fn max_nics(&self) -> usize {
        self.nics.len().min(engine_core::wire::MAX_NICS)
    }
}

/// A backend name from a plugin's file name: `libxfer_<name>.so`, `libbackend_<name>.so` or
/// `lib<name>.so` (the names the engine searches for).
pub(crate) fn backend_from_file(path: &Path) -> Option<String> {
    let stem = path.file_name()?.to_str()?.strip_suffix(".so")?;
    let name = ["libxfer_", "libbackend_", "lib"]
        .iter()
        .find_map(|prefix| stem.strip_prefix(prefix))?;
    (!name.is_empty()).then(|| name.to_owned())
}

/// The config the checks start from. With `--plugin` (or `--backend`) and `--nic`, a
/// `--config` file need not say `backend =` or `[[groups]]`: what the command line gives is
/// filled in (a file used to be refused for each missing field in turn).
fn base_config(req: &Request<'_>) -> Result<Config, String> {
    let Some(path) = req.config else {
        return Config::load(None).map_err(|e| e.to_string());
    };
    let text = std::fs::read_to_string(path).map_err(|e| format!("{}: {e}", path.display()))?;
    let mut table: toml::Table = text
        .parse()
        .map_err(|e: toml::de::Error| format!("{}: {}", path.display(), e.message()))?;
    let named = req
        .backend
        .map(str::to_owned)
        .or_else(|| req.plugin.and_then(backend_from_file));
    if let Some(name) = named {
        table.entry("backend").or_insert(toml::Value::String(name));
    }
    if !req.nics.is_empty() && !table.contains_key("groups") {
        let nics = req.nics.iter().cloned().map(toml::Value::String).collect();
        let group = toml::Table::from_iter([("nics".to_owned(), toml::Value::Array(nics))]);
        table.insert(
            "groups".into(),
            toml::Value::Array(vec![toml::Value::Table(group)]),
        );
    }
    Config::from_toml(&table.to_string(), path).map_err(|e| e.to_string())
}

fn harness(req: &Request<'_>) -> Result<CommandHarness, String> {
    let mut base = base_config(req)?;
    if let Some(plugin) = req.plugin {
        base.plugin = Some(PathBuf::from(plugin));
        base.backend = match req.backend {
            Some(name) => name.to_owned(),
            None => backend_from_file(plugin).ok_or_else(|| {
                format!(
                    "cannot tell the backend's name from {}: pass --backend",
                    plugin.display()
                )
            })?,
        };
    } else if let Some(name) = req.backend {
        base.backend = name.to_owned();
    }
    let nics = if req.nics.is_empty() {
        base.groups
            .first()
            .map(|g| g.nics.clone())
            .unwrap_or_default()
    } else {
        req.nics.to_vec()
    };
    if nics.is_empty() {
        return Err("no NIC names: pass --nic (repeat it for more NICs) or a config".into());
    }
    if nics.len() > engine_core::wire::MAX_NICS {
        let (given, max) = (nics.len(), engine_core::wire::MAX_NICS);
        return Err(format!(
            "{given} NICs given; a DomainGroup has at most {max} (the suite stripes over 1 to {max})"
        ));
    }
    Ok(CommandHarness { base, nics })
}

pub(crate) fn run(req: &Request<'_>) -> ExitCode {
    let (harness, checks) = match harness(req).and_then(|h| Ok((h, selected(req.only)?))) {
        Ok(h) => h,
        Err(e) => {
            eprintln!("xfer conformance: {e}");
            return ExitCode::from(2);
        }
    };
    if let Err(e) = preflight(&harness) {
        if req.json {
            println!(
                "{}",
                serde_json::json!({"backend": harness.base.backend, "error": e, "passed": 0, "failed": 0, "skipped": 0})
            );
        } else {
            println!("xfer conformance: the plugin cannot be loaded, so no check can run: {e}");
        }
        return ExitCode::from(1);
    }
    // The basics first, briefly: if they fail, every check would fail for the same reason
    // after its own timeout; say the cause once and stop.
    if let Err(cause) = xfer_conformance::probe(&harness) {
        if req.json {
            println!(
                "{}",
                serde_json::json!({"backend": harness.base.backend, "error": cause, "passed": 0, "failed": 1, "skipped": 0})
            );
        } else {
            println!("FAIL probe: {cause}");
            println!("xfer conformance: stopped before the checks: each relies on what failed");
        }
        return ExitCode::from(1);
    }
    let mut report = Vec::new();
    if !req.json {
        println!(
            "conformance of backend {:?}{} on NICs {:?}",
            harness.base.backend,
            harness
                .base
                .plugin
                .as_ref()
                .map(|p| format!(" ({})", p.display()))
                .unwrap_or_default(),
            harness.nics
        );
    }
    // Each failed check panics; its message is printed once below, not by the panic hook.
    let hook = std::panic::take_hook();
    std::panic::set_hook(Box::new(|_| {}));
    let (mut passed, mut failed, mut skipped) = (0, 0, 0);
    let suite_started = Instant::now();
    for (name, check) in checks {
        let started = Instant::now();
        let outcome = run_check(&harness, name, check);
        let seconds = started.elapsed().as_secs_f64();
        let (status, message) = match &outcome {
            CheckOutcome::Passed => {
                passed += 1;
                ("pass", None::<String>)
            }
            CheckOutcome::Skipped(why) => {
                skipped += 1;
                ("skip", Some(why.to_string()))
            }
            CheckOutcome::Failed(message) => {
                failed += 1;
                ("fail", Some(message.to_string()))
            }
        };
        if req.json {
            report.push(serde_json::json!({"name": name, "outcome": status, "seconds": seconds, "message": message}));
        } else if let Some(message) = message {
            println!("{} {name}: {message}", status.to_uppercase());
        } else {
            println!("PASS {name} ({seconds:.1} s)");
        }
    }
    std::panic::set_hook(hook);
    let seconds = suite_started.elapsed().as_secs_f64();
    if req.json {
        println!(
            "{}",
            serde_json::json!({
                "backend": harness.base.backend,
                "nics": harness.nics,
                "checks": report,
                "passed": passed,
                "failed": failed,
                "skipped": skipped,
                "seconds": seconds,
            })
        );
    } else {
        // pytest's summary shape, which `cargo xtask test` adds to its totals.
        println!(
            "{passed} passed, {failed} failed, {skipped} skipped in {seconds:.1}s (conformance of {})",
            harness.base.backend
        );
    }
    if failed > 0 || passed == 0 {
        ExitCode::from(1)
    } else {
        ExitCode::SUCCESS
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn backend_names_come_from_the_searched_file_names() {
        let name = |p: &str| backend_from_file(Path::new(p));
        assert_eq!(name("/x/libxfer_mynic.so").as_deref(), Some("mynic"));
        assert_eq!(name("libbackend_mock.so").as_deref(), Some("mock"));
        assert_eq!(name("./libloopback.so").as_deref(), Some("loopback"));
        assert_eq!(name("mynic.so"), None);
        assert_eq!(name("lib.so"), None);
    }
}
