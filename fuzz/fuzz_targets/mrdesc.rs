//! `MrDesc` from bytes and from hex: never panics; what decodes re-encodes to the same bytes.
#![no_main]

use engine_core::MrDesc;
use libfuzzer_sys::fuzz_target;

fuzz_target!(|data: &[u8]| {
    if let Ok(desc) = MrDesc::from_bytes(data) {
        assert_eq!(desc.to_bytes(), data);
    }
    if let Ok(text) = std::str::from_utf8(data) {
        if let Ok(desc) = text.parse::<MrDesc>() {
            assert_eq!(desc.to_string().parse::<MrDesc>().unwrap(), desc);
        }
    }
});
