//! Backends: the built-in ones registered with `inventory`, and out-of-tree plugins loaded with
//! `libloading` through the C ABI in [`abi`]. This module holds the crate's only `unsafe`
//! besides the ABI shims themselves.

pub use xfer_plugin::abi;
mod loader;

pub use loader::{find_backend, flat_options, Backend, LoadedPlugin, PluginError, PLUGIN_PATH_ENV};
