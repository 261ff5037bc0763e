//! The plugin (cdylib) finds the libfabric it was built against: with `LIBFABRIC_DIR` (e.g.
//! AWS's /opt/amazon/efa), ofi-sys reports its library directory and the plugin gets an
//! rpath to it, so loading it never picks up the distribution's older libfabric instead.

fn main() {
    println!("cargo:rerun-if-env-changed=DEP_FABRIC_LIBDIR");
    if let Ok(dir) = std::env::var("DEP_FABRIC_LIBDIR") {
        println!("cargo:rustc-cdylib-link-arg=-Wl,-rpath,{dir}");
    }
}
