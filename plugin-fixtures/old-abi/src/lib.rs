//! The mock backend, exported under the name `oldmock` with a version-1 table: its header
//! declares ABI version 1 and the version-1 size, as a plugin built before RDMA READ was
//! appended would. The engine must load it, drive it, and refuse reads naming it.

use engine_core::plugin::abi::{PluginOpener, PluginTable};

struct OldMock;

impl PluginOpener for OldMock {
    const NAME: &'static str = "oldmock";
    const OPEN: engine_core::domain::OpenFn = backend_mock::open;
}

static TABLE: PluginTable = PluginTable::new_v1::<OldMock>();

/// The plugin entry point of backend `oldmock`.
#[no_mangle]
pub extern "C" fn xfer_plugin_entry_oldmock() -> *const PluginTable {
    &TABLE
}
