//! Backends: the built-in ones registered with `inventory`, and out-of-tree plugins loaded with
//! `libloading` through the C ABI in [`abi`]. This module holds the crate's only `unsafe`
//! besides the ABI shims themselves.

pub use xfer_plugin::abi;
mod flat;
mod loader;
mod plugin_domain;

pub use flat::flat_options;
pub use loader::{find_backend, Backend, LoadedPlugin, PluginError, PLUGIN_PATH_ENV};
