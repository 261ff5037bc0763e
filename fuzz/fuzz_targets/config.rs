//! Config files: any text is parsed or refused with an error, never a panic.
#![no_main]

use libfuzzer_sys::fuzz_target;

fuzz_target!(|data: &[u8]| {
    if let Ok(text) = std::str::from_utf8(data) {
        if let Ok(config) = engine_core::Config::from_toml(text, std::path::Path::new("<fuzz>")) {
            let _ = config.backend_options();
        }
    }
});
