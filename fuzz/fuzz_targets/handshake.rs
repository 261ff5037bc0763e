//! The verbs backend's address and handshake datagrams, which any host on the subnet can send:
//! never panics; what decodes re-encodes to the same bytes.
#![no_main]

use backend_verbs::wire::{Handshake, VerbsAddr};
use libfuzzer_sys::fuzz_target;

fuzz_target!(|data: &[u8]| {
    if let Ok(addr) = VerbsAddr::decode(data) {
        assert_eq!(&addr.encode()[..], &data[..addr.encode().len()]);
    }
    if let Ok(msg) = Handshake::decode(data) {
        let again = Handshake::decode(&msg.encode()).expect("an encoded handshake decodes");
        assert_eq!(again.encode(), msg.encode());
    }
});
