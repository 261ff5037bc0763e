//! transfer-bench refuses what cannot work with an error, never an abort.

use std::process::Command;

#[test]
fn an_absurd_block_size_is_a_clean_error() {
    for args in [
        &["--block-size", "1000000000000", "--batch-size", "16"][..],
        &["--block-size", "18446744073709551615", "--batch-size", "2"][..],
        &["--block-size", "0"][..],
    ] {
        let out = Command::new(env!("CARGO_BIN_EXE_transfer-bench"))
            .args(args)
            .args(["--duration", "0.01", "--no-imm-rate"])
            .output()
            .unwrap();
        let stderr = String::from_utf8_lossy(&out.stderr);
        assert_eq!(out.status.code(), Some(1), "{args:?}: {stderr}");
        assert!(stderr.contains("--block-size"), "{args:?}: {stderr}");
    }
}
