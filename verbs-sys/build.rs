//! Compiles the C shim against rdma-core's headers and links libibverbs.

/// Writes posted per doorbell (one `ibv_post_send` of a linked chain).
const CHAIN: usize = 4;

fn main() {
    if !std::path::Path::new("/usr/include/infiniband/verbs.h").exists() {
        panic!("verbs-sys needs rdma-core's headers (/usr/include/infiniband/verbs.h): `apt-get install libibverbs-dev` (cargo xtask test installs it)");
    }
    println!("cargo:rerun-if-changed=csrc/shim.c");
    // The one place the chain length is written: the C shim gets it as XV_CHAIN, the Rust side
    // as `verbs_sys::CHAIN` (through the environment of this crate's compilation).
    println!("cargo:rustc-env=XFER_VERBS_CHAIN={CHAIN}");
    cc::Build::new()
        .file("csrc/shim.c")
        .define("XV_CHAIN", CHAIN.to_string().as_str())
        .warnings(true)
        .flag_if_supported("-Wno-unused-parameter")
        .compile("xfer_verbs_shim");
    println!("cargo:rustc-link-lib=ibverbs");
}
