//! Finding a backend by name and turning a loaded plugin into a [`Domain`].

use std::path::{Path, PathBuf};
use std::sync::Arc;

use super::abi::{
    entry_symbol, EntryFn, PluginHeader, PluginTable, RawBytes, ABI_VERSION, ENTRY_SYMBOL,
    MIN_ABI_VERSION, OPTIONS_FLAT, OPTIONS_TOML, V1_TABLE_SIZE,
};
use super::abi::{
    table_size_of, V2_TABLE_SIZE, V3_TABLE_SIZE, V4_TABLE_SIZE, V5_TABLE_SIZE, V6_TABLE_SIZE,
    V7_TABLE_SIZE,
};
use crate::domain::{BackendRegistration, Domain, DomainConfig, DomainError};
use xfer_plugin::log::{filter_number, LOG_DEBUG, LOG_ERROR, LOG_INFO, LOG_WARN};

/// Colon-separated directories searched for plugins not named by path in the config.
pub const PLUGIN_PATH_ENV: &str = "XFER_PLUGIN_PATH";

/// Why a backend could not be found or loaded.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[non_exhaustive]
pub enum PluginError {
    /// No built-in backend or plugin of that name.
    #[error("no backend named {name:?}: built-in backends are {builtin:?}, and none was found in {searched:?} (set {PLUGIN_PATH_ENV} or `plugin` in the config)")]
    UnknownBackend {
        /// The name asked for.
        name: String,
        /// Backends linked into this binary.
        builtin: Vec<String>,
        /// Directories searched for plugins.
        searched: Vec<PathBuf>,
    },
    /// The library could not be opened by the dynamic loader.
    #[error("cannot load plugin {path}: {message}")]
    Load {
        /// The library.
        path: PathBuf,
        /// The loader's message.
        message: String,
    },
    /// The library exports no entry for the backend asked for.
    #[error("{path} is not an xfer plugin for backend {backend:?}: it exports neither `{ENTRY_SYMBOL}_{backend}` nor `{ENTRY_SYMBOL}` ({message})")]
    MissingEntry {
        /// The library.
        path: PathBuf,
        /// The backend name asked for.
        backend: String,
        /// The loader's message.
        message: String,
    },
    /// The plugin was built against another ABI version, or its table is smaller than its
    /// version's.
    #[error("plugin {path} has ABI version {found} with a table of {table_size} bytes; this engine loads ABI versions {MIN_ABI_VERSION} to {expected}, each with at least its version's table (version 1: {V1_TABLE_SIZE} bytes, 2: {V2_TABLE_SIZE}, 3: {V3_TABLE_SIZE}, 4: {V4_TABLE_SIZE}, 5: {V5_TABLE_SIZE}, 6 and 7: {V6_TABLE_SIZE})")]
    AbiMismatch {
        /// The library.
        path: PathBuf,
        /// Its version.
        found: u32,
        /// The version this engine speaks.
        expected: u32,
        /// Its table size.
        table_size: u32,
        /// This engine's table size.
        expected_size: u32,
    },
    /// The plugin serves a different backend than the config asks for.
    #[error("plugin {path} provides backend {found:?}, but the config asks for {expected:?}")]
    NameMismatch {
        /// The library.
        path: PathBuf,
        /// The name in its table.
        found: String,
        /// The name in the config.
        expected: String,
    },
}

/// A backend ready to open Domains.
#[derive(Clone)]
pub enum Backend {
    /// Linked into this binary.
    Builtin(&'static BackendRegistration),
    /// Loaded from a shared library.
    Plugin(Arc<LoadedPlugin>),
}

impl std::fmt::Debug for Backend {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Self::Builtin(r) => write!(f, "Builtin({})", r.name),
            Self::Plugin(p) => write!(f, "Plugin({})", p.path.display()),
        }
    }
}

impl Backend {
    /// The backend's name.
    pub fn name(&self) -> &str {
        match self {
            Self::Builtin(r) => r.name,
            Self::Plugin(p) => &p.name,
        }
    }

    /// Checks a plugin's options (TOML text) without opening anything, through its
    /// `check_options` entry (ABI 4; older plugins check when a NIC opens). A linked backend's
    /// were checked already, by [`Config::validate`](crate::Config::validate).
    pub fn check_plugin_options(&self, options: &str) -> Result<(), String> {
        match self {
            Self::Builtin(_) => Ok(()),
            Self::Plugin(p) => p.check_options(options),
        }
    }

    /// Opens one NIC.
    pub fn open(&self, config: &DomainConfig<'_>) -> Result<Box<dyn Domain>, DomainError> {
        match self {
            Self::Builtin(r) => (r.open)(config),
            Self::Plugin(p) => p.open(config),
        }
    }

    /// How the engine makes this backend's DomainGroup: the backend's own, or the built-in
    /// striping group.
    pub fn open_group(&self) -> crate::group::OpenGroupFn {
        match self {
            Self::Builtin(r) => crate::group::group_opener(r.name),
            Self::Plugin(_) => crate::group::StripingGroup::open,
        }
    }

    /// Names of the backends linked into this binary.
    pub fn builtin_names() -> Vec<String> {
        xfer_plugin::registry::all()
            .map(|r| r.name.to_owned())
            .collect()
    }
}

/// Resolves a backend: an explicit plugin path first, then a built-in of that name, then
/// `lib<name>.so`, `libxfer_<name>.so` or `libbackend_<name>.so` in `$XFER_PLUGIN_PATH`.
pub fn find_backend(name: &str, plugin_path: Option<&Path>) -> Result<Backend, PluginError> {
    if let Some(path) = plugin_path {
        return load_checked(path, name);
    }
    if let Some(reg) = xfer_plugin::registry::find(name) {
        return Ok(Backend::Builtin(reg));
    }
    let searched: Vec<PathBuf> = std::env::var_os(PLUGIN_PATH_ENV)
        .map(|v| plugin_dirs(&v))
        .unwrap_or_default();
    for dir in &searched {
        for file in [
            format!("lib{name}.so"),
            format!("libxfer_{name}.so"),
            format!("libbackend_{name}.so"),
        ] {
            let candidate = dir.join(file);
            if candidate.is_file() {
                return load_checked(&candidate, name);
            }
        }
    }
    Err(PluginError::UnknownBackend {
        name: name.to_owned(),
        builtin: Backend::builtin_names(),
        searched,
    })
}

/// The directories `$XFER_PLUGIN_PATH` names, in order. An empty element (`a::b`, a leading
/// or trailing `:`) is skipped: in `$PATH` it means the working directory, and loading a
/// library from wherever a process happens to run is running its code (issue 56).
fn plugin_dirs(value: &std::ffi::OsStr) -> Vec<PathBuf> {
    std::env::split_paths(value)
        .filter(|dir| !dir.as_os_str().is_empty())
        .collect()
}

fn load_checked(path: &Path, name: &str) -> Result<Backend, PluginError> {
    let plugin = LoadedPlugin::load(path, name)?;
    if plugin.name != name {
        return Err(PluginError::NameMismatch {
            path: path.to_owned(),
            found: plugin.name.clone(),
            expected: name.to_owned(),
        });
    }
    Ok(Backend::Plugin(Arc::new(plugin)))
}

/// A plugin library whose table passed the version check.
pub struct LoadedPlugin {
    pub(super) path: PathBuf,
    pub(super) name: String,
    /// The plugin's ABI version.
    pub(super) version: u32,
    /// A copy of the plugin's table: the `table_size` bytes it declared, entries past them
    /// absent (`None`).
    pub(super) table: PluginTable,
    /// Keeps the code behind `table` mapped — for the whole process, never `dlclose`d: a
    /// thread that ran plugin code (the worker) runs the plugin's thread-local destructors
    /// when it exits, which can be after the last `Arc` of this plugin dropped; unmapping
    /// the library first made the worker jump into unmapped memory at exit (seen with the
    /// verbs plugin on soft-RoCE: a segfault after every byte had arrived).
    _library: std::mem::ManuallyDrop<libloading::Library>,
}

/// Why a plugin's table is refused.
#[derive(Debug, Clone, PartialEq, Eq)]
enum TableRefusal {
    /// A version this engine does not load, or a table smaller than its version's.
    Version { found: u32, table_size: u32 },
    /// A required entry is null.
    Null(&'static str),
}

/// Checks a plugin's table header and copies the table: exactly the entries of its declared
/// version (the version decides what exists; the declared size must cover them, and bytes
/// past them are never read — a version-1 table declaring more is read as version 1, and a
/// size ending inside a pointer cannot copy half of one).
///
/// # Safety
/// `table_ptr` is non-null and points at a table whose header is readable, and which has at
/// least the `table_size` readable bytes its header declares.
unsafe fn checked_table(table_ptr: *const PluginTable) -> Result<PluginTable, TableRefusal> {
    // SAFETY: the caller guarantees the header is readable; every version starts with it.
    let header = unsafe { *(table_ptr as *const PluginHeader) };
    let refused = TableRefusal::Version {
        found: header.abi_version,
        table_size: header.table_size,
    };
    let size = match table_size_of(header.abi_version) {
        Some(size) if (MIN_ABI_VERSION..=ABI_VERSION).contains(&header.abi_version) => size,
        _ => return Err(refused),
    };
    if header.table_size < size {
        return Err(refused);
    }
    copy_table(table_ptr, size).map_err(TableRefusal::Null)
}

/// Copies the first `size` bytes of a plugin's table (a whole table of its version) into a
/// table of this engine's layout whose later entries stay absent, after checking that every
/// entry a version-1 table must have is non-null (a null function pointer would be undefined
/// behaviour the moment it is read as one). Returns the name of the first null entry
/// otherwise.
fn copy_table(table: *const PluginTable, size: u32) -> Result<PluginTable, &'static str> {
    use std::mem::{offset_of, size_of, MaybeUninit};
    let n = (size as usize).min(size_of::<PluginTable>());
    let mut copy = MaybeUninit::<PluginTable>::zeroed();
    // SAFETY: the plugin declared at least `size` readable bytes of static table (its
    // version's size, checked by the caller); we copy no more than our own table holds.
    unsafe { std::ptr::copy_nonoverlapping(table.cast::<u8>(), copy.as_mut_ptr().cast::<u8>(), n) };
    let required = [
        ("open", offset_of!(PluginTable, open)),
        ("close", offset_of!(PluginTable, close)),
        ("address", offset_of!(PluginTable, address)),
        ("register", offset_of!(PluginTable, register)),
        ("deregister", offset_of!(PluginTable, deregister)),
        ("post_write", offset_of!(PluginTable, post_write)),
        ("post_send", offset_of!(PluginTable, post_send)),
        ("post_recvs", offset_of!(PluginTable, post_recvs)),
        ("poll", offset_of!(PluginTable, poll)),
        ("set_waker", offset_of!(PluginTable, set_waker)),
    ];
    for (entry, offset) in required {
        // SAFETY: every required entry lies inside the copied version-1 prefix; reading it as
        // a plain word says whether it is null without treating it as a function pointer.
        let word = unsafe {
            copy.as_ptr()
                .cast::<u8>()
                .add(offset)
                .cast::<usize>()
                .read_unaligned()
        };
        if word == 0 {
            return Err(entry);
        }
    }
    // SAFETY: every non-optional field was copied from the plugin's table and checked
    // non-null; the optional entries past its size are zero, which is `None`.
    Ok(unsafe { copy.assume_init() })
}

impl LoadedPlugin {
    /// Opens `path`, finds backend `name`'s entry (or the generic one), checks its ABI
    /// header, and keeps the library loaded.
    pub fn load(path: &Path, name: &str) -> Result<Self, PluginError> {
        // SAFETY: loading a library runs its initialisers; the user chose this file as a plugin
        // (by config or search path), which is the trust decision dlopen always requires.
        let library = unsafe { libloading::Library::new(path) }.map_err(|e| PluginError::Load {
            path: path.to_owned(),
            message: loader_text(&e),
        })?;
        // SAFETY: we only read the symbol's address here; its type is checked by the header
        // below before anything beyond the header is used.
        let entry = unsafe { library.get::<EntryFn>(entry_symbol(name).as_bytes()) }
            // SAFETY: as above, for the generic symbol.
            .or_else(|_| unsafe { library.get::<EntryFn>(ENTRY_SYMBOL.as_bytes()) })
            .map_err(|e| PluginError::MissingEntry {
                path: path.to_owned(),
                backend: name.to_owned(),
                message: loader_text(&e),
            })?;
        // SAFETY: the entry symbol is the ABI's `extern "C" fn() -> *const PluginTable`; every
        // ABI version begins the table with a PluginHeader, the only part read before checking.
        let table_ptr = unsafe { entry() };
        if table_ptr.is_null() {
            return Err(PluginError::MissingEntry {
                path: path.to_owned(),
                backend: name.to_owned(),
                message: "the entry returned a null table".into(),
            });
        }
        // SAFETY: non-null; the plugin's entry promises a table with the header it declares
        // (a plugin is trusted code: dlopen ran its initialisers already).
        let table = unsafe { checked_table(table_ptr) }.map_err(|refusal| match refusal {
            TableRefusal::Version { found, table_size } => PluginError::AbiMismatch {
                path: path.to_owned(),
                found,
                expected: ABI_VERSION,
                table_size,
                expected_size: V7_TABLE_SIZE,
            },
            TableRefusal::Null(entry) => PluginError::Load {
                path: path.to_owned(),
                message: format!("its table's entry `{entry}` is null"),
            },
        })?;
        if ![OPTIONS_TOML, OPTIONS_FLAT].contains(&table.options_format) {
            return Err(PluginError::Load {
                path: path.to_owned(),
                message: format!(
                    "its options format {} is unknown ({OPTIONS_TOML} = TOML, {OPTIONS_FLAT} = flat lines)",
                    table.options_format
                ),
            });
        }
        if let Some(set_log) = table.set_log {
            // The most verbose level the host's subscriber wants now.
            let level = filter_number(tracing::level_filters::LevelFilter::current());
            // SAFETY: host_log is callable from any thread for the life of the process; the
            // plugin keeps it (the library is never unloaded, see `_library`).
            unsafe { set_log(host_log, level) };
        }
        // SAFETY: the table's name is static UTF-8 in the library (checked lossily anyway).
        let name = String::from_utf8_lossy(unsafe { table.name.as_slice() }).into_owned();
        Ok(Self {
            path: path.to_owned(),
            name,
            version: table.header.abi_version,
            table,
            _library: std::mem::ManuallyDrop::new(library),
        })
    }

    /// The plugin's ABI version.
    pub fn abi_version(&self) -> u32 {
        self.version
    }
}

/// libloading's error with the dynamic loader's own words: its `Display` says only "dlopen
/// failed"; `dlerror()`'s text ("cannot open shared object file", "undefined symbol") is its
/// source.
fn loader_text(e: &libloading::Error) -> String {
    match std::error::Error::source(e) {
        Some(source) => format!("{e}: {source}"),
        None => e.to_string(),
    }
}

/// A plugin's log line, as an event of the host's `tracing` (target `xfer::plugin`).
unsafe extern "C" fn host_log(level: u32, target: RawBytes, message: RawBytes) {
    // SAFETY: the plugin passes byte strings live for the call (the ABI's contract).
    let (target, message) = unsafe { (target.as_slice(), message.as_slice()) };
    let target = String::from_utf8_lossy(target);
    let message = String::from_utf8_lossy(message);
    match level {
        LOG_ERROR => tracing::error!(target: "xfer::plugin", plugin_target = %target, "{message}"),
        LOG_WARN => tracing::warn!(target: "xfer::plugin", plugin_target = %target, "{message}"),
        LOG_INFO => tracing::info!(target: "xfer::plugin", plugin_target = %target, "{message}"),
        LOG_DEBUG => tracing::debug!(target: "xfer::plugin", plugin_target = %target, "{message}"),
        _ => tracing::trace!(target: "xfer::plugin", plugin_target = %target, "{message}"),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Issue 56: an empty element of `$XFER_PLUGIN_PATH` searched the working directory.
    #[test]
    fn empty_plugin_path_elements_are_not_the_working_directory() {
        let dirs = plugin_dirs(std::ffi::OsStr::new(":/opt/xfer::plugins:"));
        assert_eq!(
            dirs,
            vec![PathBuf::from("/opt/xfer"), PathBuf::from("plugins")]
        );
        assert!(plugin_dirs(std::ffi::OsStr::new("")).is_empty());
    }
    use crate::domain::DomainErrorKind;

    struct MockOpener;
    impl super::super::abi::PluginOpener for MockOpener {
        const NAME: &'static str = "mock";
        const OPEN: crate::domain::OpenFn = backend_mock::open;
    }
    use crate::domain::OpenFn;
    use crate::plugin::abi::PluginOpener;

    struct Nothing;

    impl PluginOpener for Nothing {
        const NAME: &'static str = "nothing";
        const OPEN: OpenFn = |_| Err(DomainError::new(DomainErrorKind::Other, "nothing"));
    }

    fn with_header(abi_version: u32, table_size: u32) -> PluginTable {
        let mut t = PluginTable::new::<Nothing>();
        t.header = PluginHeader {
            abi_version,
            table_size,
        };
        t
    }

    /// Issue 25 §6: the declared version decides which entries exist. A version-1 plugin
    /// declaring a larger table used to have entries read past its table (and `set_log`
    /// called at load); a version-3 plugin with a version-1-sized table silently lost its
    /// capabilities and options format; a size ending inside a pointer copied half of one.
    #[test]
    fn the_declared_version_decides_which_entries_are_read() {
        let v1_big = with_header(1, V4_TABLE_SIZE);
        // SAFETY: a whole table, live for the call.
        let t = unsafe { checked_table(&v1_big) }.unwrap();
        assert!(t.post_read.is_none() && t.capabilities.is_none() && t.set_log.is_none());
        assert_eq!(t.options_format, 0);
        let v3_big = with_header(3, V5_TABLE_SIZE);
        // SAFETY: as above.
        let t = unsafe { checked_table(&v3_big) }.unwrap();
        assert!(t.set_log.is_some() && t.check_options.is_none());
        let v4_big = with_header(4, V5_TABLE_SIZE);
        // SAFETY: as above.
        let t = unsafe { checked_table(&v4_big) }.unwrap();
        assert!(t.post_write_pages.is_none());
        let v5_big = with_header(5, V6_TABLE_SIZE);
        // SAFETY: as above.
        let t = unsafe { checked_table(&v5_big) }.unwrap();
        assert!(t.post_write_pages.is_some() && t.post_writes.is_none());
        let v6 = with_header(6, V6_TABLE_SIZE);
        // SAFETY: as above.
        assert!(unsafe { checked_table(&v6) }.unwrap().post_writes.is_some());
        let v7 = with_header(7, V7_TABLE_SIZE);
        // SAFETY: as above.
        assert!(unsafe { checked_table(&v7) }.unwrap().post_writes.is_some());
        for (version, size) in [
            (3, V1_TABLE_SIZE),
            (2, V2_TABLE_SIZE - 4),
            (3, V3_TABLE_SIZE - 4),
            (4, V4_TABLE_SIZE - 8),
            (5, V5_TABLE_SIZE - 8),
            (6, V6_TABLE_SIZE - 8),
        ] {
            let t = with_header(version, size);
            // SAFETY: as above.
            let r = unsafe { checked_table(&t) };
            assert_eq!(
                r.err(),
                Some(TableRefusal::Version {
                    found: version,
                    table_size: size
                }),
                "version {version}, {size} bytes"
            );
        }
        for version in [0, ABI_VERSION + 1] {
            let t = with_header(version, V5_TABLE_SIZE);
            // SAFETY: as above.
            assert!(unsafe { checked_table(&t) }.is_err());
        }
        let v2 = with_header(2, V2_TABLE_SIZE);
        // SAFETY: as above.
        let t = unsafe { checked_table(&v2) }.unwrap();
        assert!(t.post_read.is_some() && t.capabilities.is_none());
    }

    /// A table with a null required entry is refused with the entry named, before anything
    /// reads it as a function pointer; optional entries may be null.
    #[test]
    fn a_null_required_entry_is_named_and_an_absent_optional_one_is_none() {
        use std::mem::{offset_of, size_of};
        let table = PluginTable::new::<MockOpener>();
        let size = size_of::<PluginTable>();
        let mut bytes = vec![0u8; size];
        // SAFETY: `table` is a live PluginTable of `size` bytes; bytes has room for them.
        unsafe {
            std::ptr::copy_nonoverlapping(
                (&table as *const PluginTable).cast::<u8>(),
                bytes.as_mut_ptr(),
                size,
            )
        };
        let with_zeroed = |offset: usize| {
            let mut b = bytes.clone();
            b[offset..offset + size_of::<usize>()].fill(0);
            b
        };
        let poll_null = with_zeroed(offset_of!(PluginTable, poll));
        assert_eq!(
            copy_table(poll_null.as_ptr().cast(), size as u32).err(),
            Some("poll")
        );
        let log_null = with_zeroed(offset_of!(PluginTable, set_log));
        let copied = copy_table(log_null.as_ptr().cast(), size as u32).expect("optional");
        assert!(copied.set_log.is_none() && copied.capabilities.is_some());
    }

    #[test]
    fn a_version_1_table_is_a_prefix_of_the_current_one() {
        assert!(V1_TABLE_SIZE < std::mem::size_of::<PluginTable>() as u32);
        assert_eq!(
            V1_TABLE_SIZE as usize,
            std::mem::offset_of!(PluginTable, post_read)
        );
    }
}
