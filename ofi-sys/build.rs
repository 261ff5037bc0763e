//! Compiles the C shim against the system's libfabric headers and links libfabric.

fn main() {
    let header = std::path::Path::new("/usr/include/rdma/fabric.h");
    if !header.exists() && std::env::var_os("OFI_SYS_SKIP_HEADER_CHECK").is_none() {
        panic!(
            "ofi-sys needs libfabric's headers (/usr/include/rdma/fabric.h): \
             `apt-get install libfabric-dev` (cargo xtask test installs it)"
        );
    }
    println!("cargo:rerun-if-changed=csrc/shim.c");
    cc::Build::new()
        .file("csrc/shim.c")
        .warnings(true)
        .flag_if_supported("-Wno-unused-parameter")
        .compile("xfer_ofi_shim");
    println!("cargo:rustc-link-lib=fabric");
}
