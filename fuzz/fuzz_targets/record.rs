//! Rendezvous records (`xfer_rendezvous::record::decode`), which anyone who can write the
//! store (etcd, or the embedded service) can plant: never panics, and what decodes encodes to
//! a value that decodes to the same record (postcard accepts more than one encoding of a
//! length, so bytes are not compared).
//!
//! Input: the first byte is the length of the key (`/xfer/peers/` and that many bytes, so
//! the fuzzer can match a record's name to its key), the rest the value.
#![no_main]

use libfuzzer_sys::fuzz_target;
use xfer_rendezvous::record;

fuzz_target!(|data: &[u8]| {
    let Some((&n, rest)) = data.split_first() else {
        return;
    };
    let (name, value) = rest.split_at(usize::from(n).min(rest.len()));
    let key = format!("/xfer/peers/{}", String::from_utf8_lossy(name));
    match record::decode(&key, value) {
        Ok(r) => assert_eq!(record::decode(&key, &record::encode(&r)).unwrap(), r),
        Err(e) => assert!(!e.to_string().is_empty()),
    }
});
