//! The Domain trait and the types a backend exchanges with the engine live in the plugin kit
//! ([`xfer_plugin::domain`]), so a backend depends on that small crate alone; this module
//! re-exports them. Linked-in backends register in [`xfer_plugin::registry`]; one with a
//! DomainGroup of its own adds a [`GroupRegistration`](crate::group::GroupRegistration).

pub use xfer_plugin::domain::*;
pub use xfer_plugin::registry::BackendRegistration;
