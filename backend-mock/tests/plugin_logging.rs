//! A plugin's `tracing` events reach the host's subscriber (ABI 3's `set_log`): a `cdylib` has
//! its own copy of `tracing`, so without the bridge they would be lost. A file of its own: the
//! host's subscriber must be installed before the plugin is first loaded in this process.

mod common;

use std::io::Write;
use std::sync::{Arc, Mutex};

#[derive(Clone, Default)]
struct Captured(Arc<Mutex<Vec<u8>>>);

impl Write for Captured {
    fn write(&mut self, buf: &[u8]) -> std::io::Result<usize> {
        self.0.lock().unwrap().extend_from_slice(buf);
        Ok(buf.len())
    }
    fn flush(&mut self) -> std::io::Result<()> {
        Ok(())
    }
}

#[test]
fn a_plugins_log_lines_arrive_in_the_hosts_subscriber() {
    let captured = Captured::default();
    let writer = captured.clone();
    tracing_subscriber::fmt()
        .with_max_level(tracing::Level::DEBUG)
        .with_ansi(false)
        .with_writer(move || writer.clone())
        .init();
    let mut config = common::mock_config(1, "");
    config.plugin = Some(common::built_library("backend_mock"));
    let engine = engine_core::TransferEngine::open(&config).unwrap();
    drop(engine);
    let text = String::from_utf8(captured.0.lock().unwrap().clone()).unwrap();
    let line = text
        .lines()
        .find(|l| l.contains("mock NIC opened"))
        .unwrap_or_else(|| panic!("the plugin's open was not logged in the host:\n{text}"));
    assert!(
        line.contains("xfer::plugin") && line.contains("plugin_target=backend_mock"),
        "{line}"
    );
}
