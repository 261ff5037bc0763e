//! Compiles the C shim against the installed libfabric's headers and links it.
//!
//! Where libfabric is: `$LIBFABRIC_DIR` (e.g. AWS's `/opt/amazon/efa`: `include/` and
//! `lib64/` or `lib/`; backend-efa's plugin gets an rpath to it, so it loads that library,
//! not the distribution's), else pkg-config's `libfabric`, else the system paths. The shim asks
//! for the newest API both these headers and the library loaded at run time offer.

use std::path::PathBuf;

fn main() {
    println!("cargo:rerun-if-changed=csrc/shim.c");
    println!("cargo:rerun-if-env-changed=LIBFABRIC_DIR");
    let mut build = cc::Build::new();
    build
        .file("csrc/shim.c")
        .warnings(true)
        .flag_if_supported("-Wno-unused-parameter");
    let includes: Vec<PathBuf> = if let Some(dir) = std::env::var_os("LIBFABRIC_DIR") {
        let dir = PathBuf::from(dir);
        for lib in ["lib64", "lib"] {
            let path = dir.join(lib);
            if path.is_dir() {
                println!("cargo:rustc-link-search=native={}", path.display());
                // For dependents' build scripts (DEP_FABRIC_LIBDIR): a link-arg from here
                // would reach only this crate's own targets, so backend-efa adds the rpath
                // to its plugin itself.
                println!("cargo:libdir={}", path.display());
                break;
            }
        }
        println!("cargo:rustc-link-lib=fabric");
        vec![dir.join("include")]
    } else {
        match pkg_config::Config::new()
            .atleast_version("1.17")
            .probe("libfabric")
        {
            // pkg-config printed the link flags itself.
            Ok(lib) => lib.include_paths,
            Err(e) => {
                println!(
                    "cargo:warning=pkg-config found no libfabric ({e}); using the system paths"
                );
                println!("cargo:rustc-link-lib=fabric");
                vec![PathBuf::from("/usr/include")]
            }
        }
    };
    let header_found = includes.iter().any(|d| d.join("rdma/fabric.h").exists());
    if !header_found && std::env::var_os("OFI_SYS_SKIP_HEADER_CHECK").is_none() {
        panic!(
            "ofi-sys needs libfabric's headers (rdma/fabric.h in {includes:?}): \
             `apt-get install libfabric-dev` (cargo xtask test installs it), or set \
             LIBFABRIC_DIR to an installation such as /opt/amazon/efa"
        );
    }
    for dir in &includes {
        build.include(dir);
    }
    build.compile("xfer_ofi_shim");
}
