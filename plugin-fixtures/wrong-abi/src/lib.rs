//! A plugin built against an ABI that does not exist (version 999), so tests can check that
//! the engine refuses it by reading only the header. Deliberately independent of engine-core.

/// The header every xfer plugin table starts with.
#[repr(C)]
pub struct Header {
    abi_version: u32,
    table_size: u32,
}

static TABLE: Header = Header {
    abi_version: 999,
    table_size: 8,
};

/// The xfer plugin entry point, returning a table of the wrong version.
#[no_mangle]
pub extern "C" fn xfer_plugin_entry() -> *const Header {
    &TABLE
}
