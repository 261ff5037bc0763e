//! The mock backend exported twice with old tables, as plugins built against older ABIs:
//! `oldmock` with a version-1 table (before RDMA READ was appended) — the engine must load it,
//! drive it, and refuse reads naming it — `v2mock` with a version-2 table (before
//! capabilities and logging) — the engine must not read past it and assume the defaults —
//! `v3mock` with a version-3 table (before the options check), `v4mock` with a version-4
//! table (before batches of pages: the engine posts each page alone), and `v5mock` with a
//! version-5 table (before lists of writes: the engine posts a burst's writes one by one),
//! beside `checkedmock` with the current table and the mock's options check.

use engine_core::plugin::abi::{PluginOpener, PluginTable};

struct OldMock;

impl PluginOpener for OldMock {
    const NAME: &'static str = "oldmock";
    const OPEN: engine_core::domain::OpenFn = backend_mock::open;
}

static TABLE: PluginTable = PluginTable::of_version::<OldMock>(1);

/// The plugin entry point of backend `oldmock`.
#[no_mangle]
pub extern "C" fn xfer_plugin_entry_oldmock() -> *const PluginTable {
    &TABLE
}

struct V2Mock;

impl PluginOpener for V2Mock {
    const NAME: &'static str = "v2mock";
    const OPEN: engine_core::domain::OpenFn = backend_mock::open;
}

static V2_TABLE: PluginTable = PluginTable::of_version::<V2Mock>(2);

/// The plugin entry point of backend `v2mock`.
#[no_mangle]
pub extern "C" fn xfer_plugin_entry_v2mock() -> *const PluginTable {
    &V2_TABLE
}

struct V3Mock;

impl PluginOpener for V3Mock {
    const NAME: &'static str = "v3mock";
    const OPEN: engine_core::domain::OpenFn = backend_mock::open;
}

static V3_TABLE: PluginTable = PluginTable::of_version::<V3Mock>(3);

/// The plugin entry point of backend `v3mock`.
#[no_mangle]
pub extern "C" fn xfer_plugin_entry_v3mock() -> *const PluginTable {
    &V3_TABLE
}

struct V4Mock;

impl PluginOpener for V4Mock {
    const NAME: &'static str = "v4mock";
    const OPEN: engine_core::domain::OpenFn = backend_mock::open;
}

static V4_TABLE: PluginTable = PluginTable::of_version::<V4Mock>(4);

/// The plugin entry point of backend `v4mock`.
#[no_mangle]
pub extern "C" fn xfer_plugin_entry_v4mock() -> *const PluginTable {
    &V4_TABLE
}

struct CheckedMock;

impl PluginOpener for CheckedMock {
    const NAME: &'static str = "checkedmock";
    const OPEN: engine_core::domain::OpenFn = backend_mock::open;
    const CHECK: Option<engine_core::domain::CheckOptionsFn> = Some(|text| {
        backend_mock::MockOptions::parse(text)
            .map(|_| ())
            .map_err(|e| e.message)
    });
}

static CHECKED_TABLE: PluginTable = PluginTable::new::<CheckedMock>();

/// The plugin entry point of backend `checkedmock`.
#[no_mangle]
pub extern "C" fn xfer_plugin_entry_checkedmock() -> *const PluginTable {
    &CHECKED_TABLE
}

struct V5Mock;

impl PluginOpener for V5Mock {
    const NAME: &'static str = "v5mock";
    const OPEN: engine_core::domain::OpenFn = backend_mock::open;
}

static V5_TABLE: PluginTable = PluginTable::of_version::<V5Mock>(5);

/// The plugin entry point of backend `v5mock`.
#[no_mangle]
pub extern "C" fn xfer_plugin_entry_v5mock() -> *const PluginTable {
    &V5_TABLE
}
