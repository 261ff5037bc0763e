//! Compiles the C shim against rdma-core's headers and links libibverbs.

fn main() {
    if !std::path::Path::new("/usr/include/infiniband/verbs.h").exists() {
        panic!("verbs-sys needs rdma-core's headers (/usr/include/infiniband/verbs.h): `apt-get install libibverbs-dev` (cargo xtask test installs it)");
    }
    println!("cargo:rerun-if-changed=csrc/shim.c");
    cc::Build::new()
        .file("csrc/shim.c")
        .warnings(true)
        .flag_if_supported("-Wno-unused-parameter")
        .compile("xfer_verbs_shim");
    println!("cargo:rustc-link-lib=ibverbs");
}
