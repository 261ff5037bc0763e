//! `xfer info` and `xfer doctor` on a machine whose CUDA driver and GDRCopy are the fakes
//! (`cargo xtask gpu-fakes` puts them on LD_LIBRARY_PATH; ignored in a plain `cargo test`):
//! the watcher memory and the devices they report, and why when a fake refuses.

use std::process::Command;

/// `xfer info --json`'s watcher memory, with `env` set: (kind, reasons).
fn watcher_memory(env: &[(&str, &str)]) -> (String, Vec<String>) {
    let out = Command::new(env!("CARGO_BIN_EXE_xfer"))
        .args(["info", "--json"])
        .envs(env.iter().copied())
        .output()
        .unwrap();
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let v: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap();
    let ok = &v["watcher_memory"]["Ok"];
    let reasons = ok[1]
        .as_array()
        .unwrap()
        .iter()
        .map(|r| r.as_str().unwrap().to_owned());
    (ok[0].as_str().unwrap().to_owned(), reasons.collect())
}

#[test]
#[ignore = "needs the GPU fakes: cargo xtask gpu-fakes"]
fn info_reports_the_watcher_memory_the_fake_gpu_gives() {
    assert_eq!(watcher_memory(&[]).0, "gpu_gdrcopy");
    let (kind, why) = watcher_memory(&[("XFER_FAKE_GDR_FAIL", "gdr_open")]);
    assert_eq!(kind, "device_mapped");
    assert!(why.iter().any(|w| w.contains("gdrdrv")), "{why:?}");
    let (kind, why) = watcher_memory(&[("XFER_FAKE_CUDA_FAIL", "cuInit")]);
    assert_eq!(kind, "host");
    assert!(why.iter().all(|w| w.contains("cuInit")), "{why:?}");
}

#[test]
#[ignore = "needs the GPU fakes: cargo xtask gpu-fakes"]
fn doctor_names_the_drivers_devices_or_why_there_are_none() {
    let doctor = |env: &[(&str, &str)]| {
        let out = Command::new(env!("CARGO_BIN_EXE_xfer"))
            .arg("doctor")
            .envs(env.iter().copied())
            .output()
            .unwrap();
        String::from_utf8_lossy(&out.stdout).into_owned()
    };
    let out = doctor(&[]);
    assert!(
        out.contains("[PASS] CUDA driver")
            && out.contains("2 device(s): xfer fake GPU 0, xfer fake GPU 1"),
        "{out}"
    );
    let out = doctor(&[("XFER_FAKE_CUDA_FAIL", "cuInit")]);
    assert!(
        out.contains("CUDA driver") && out.contains("cuInit failed"),
        "{out}"
    );
}
