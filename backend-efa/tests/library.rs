//! Which libfabric these tests run against. `cargo xtask test` runs the EFA backend's tests
//! twice — against Debian 12's 1.17 and against a 2.x it builds — and names the one it means
//! in `XFER_EXPECT_LIBFABRIC`, so a build that silently picked the other library fails here.

#[test]
fn the_library_under_test_is_the_one_asked_for() {
    let api = backend_efa::api_version();
    eprintln!("libfabric API in use: {api}");
    if let Ok(want) = std::env::var("XFER_EXPECT_LIBFABRIC") {
        assert!(
            api.starts_with(&want),
            "the EFA backend uses libfabric API {api}, but this run is for {want}"
        );
    }
}
