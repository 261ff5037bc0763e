//! Messages between engines (`engine_core::wire::decode_message`), which any peer with a
//! connection can send: never panics, and what decodes re-encodes to the same bytes (a user
//! payload is carried as is; a notification's sender and id have one encoding).
#![no_main]

use engine_core::wire::{
    decode_message, encode_notification, encode_user_message, Message, NOTIFICATION_ID_MAX,
};
use libfuzzer_sys::fuzz_target;

fuzz_target!(|data: &[u8]| {
    match decode_message(data) {
        Ok(Message::User(payload)) => assert_eq!(encode_user_message(payload), data),
        Ok(Message::Notification { from, id }) => {
            assert!(id.len() <= NOTIFICATION_ID_MAX);
            assert_eq!(encode_notification(&from, id), data);
        }
        Err(e) => assert!(!e.to_string().is_empty()),
    }
});
