//! The verbs backend's address and handshake datagrams, which any host on the subnet can send:
//! never panics; both layouts are fixed-size, so what decodes re-encodes to exactly the bytes
//! given (no trailing bytes accepted).
#![no_main]

use backend_verbs::wire::{Handshake, VerbsAddr};
use libfuzzer_sys::fuzz_target;

fuzz_target!(|data: &[u8]| {
    if let Ok(addr) = VerbsAddr::decode(data) {
        assert_eq!(&addr.encode()[..], data);
    }
    match Handshake::decode(data) {
        Ok(msg) => assert_eq!(&msg.encode()[..], data),
        // Every error names itself without panicking.
        Err(e) => assert!(!e.to_string().is_empty()),
    }
});
