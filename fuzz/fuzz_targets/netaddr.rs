//! `NetAddr` from bytes and from hex: never panics; what decodes re-encodes to the same bytes.
#![no_main]

use engine_core::NetAddr;
use libfuzzer_sys::fuzz_target;

fuzz_target!(|data: &[u8]| {
    if let Ok(addr) = NetAddr::from_bytes(data) {
        assert_eq!(addr.to_bytes(), data);
    }
    if let Ok(text) = std::str::from_utf8(data) {
        if let Ok(addr) = text.parse::<NetAddr>() {
            assert_eq!(addr.to_string().parse::<NetAddr>().unwrap(), addr);
        }
    }
});
