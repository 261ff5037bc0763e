//! Backends linked into a binary as Rust crates (not loaded as plugins) announce themselves
//! here with `inventory::submit!`; the engine finds them by name. A plugin library does not
//! need this: the engine reaches it through [`crate::abi`] instead (registrations made inside
//! a `dlopen`ed library are not seen by the host).
//!
//! ```
//! use xfer_plugin::domain::{Domain, DomainConfig, DomainError};
//! # fn open(_: &DomainConfig<'_>) -> Result<Box<dyn Domain>, DomainError> { unimplemented!() }
//! xfer_plugin::inventory::submit! {
//!     xfer_plugin::registry::BackendRegistration {
//!         name: "mynic",
//!         open,
//!         // A typo in `[backends.mynic]` is then an error when the config is loaded.
//!         check_options: |_toml_text| Ok(()),
//!     }
//! }
//! assert!(xfer_plugin::registry::find("mynic").is_some());
//! ```

use crate::domain::OpenFn;

/// A backend linked into the binary.
#[derive(Debug)]
pub struct BackendRegistration {
    /// The name configs select it by.
    pub name: &'static str,
    /// Opens one NIC.
    pub open: OpenFn,
    /// Parses the backend's own config table (`[backends.<name>]` as TOML text, with the
    /// engine-wide settings added); the error names what is wrong. The engine calls it when
    /// a config is loaded, so a typo fails there, naming the key, instead of at NIC open.
    pub check_options: crate::domain::CheckOptionsFn,
}

inventory::collect!(BackendRegistration);

/// The linked-in backend registered under `name`.
pub fn find(name: &str) -> Option<&'static BackendRegistration> {
    inventory::iter::<BackendRegistration>
        .into_iter()
        .find(|r| r.name == name)
}

/// Every linked-in backend.
pub fn all() -> impl Iterator<Item = &'static BackendRegistration> {
    inventory::iter::<BackendRegistration>.into_iter()
}
