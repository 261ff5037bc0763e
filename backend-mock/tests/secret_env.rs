//! Issue 56: `$XFER_SECRET_FILE` (what docs/serving.md tells operators to set for the
//! rendezvous) also keys the backend's handshake when the config names no secret, and a config
//! naming another file is refused naming both. One test in its own binary: it sets the
//! process's environment.

mod common;

use engine_core::{Error, TransferEngine};

#[test]
fn the_secret_file_variable_is_the_engines_secret_and_a_different_one_is_refused() {
    let dir = std::env::temp_dir().join(format!("xfer-secret-env-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let secret = dir.join("secret");
    std::fs::write(&secret, [7u8; 32]).unwrap();
    std::env::set_var(engine_core::config::SECRET_FILE_ENV, &secret);

    let plain = common::mock_config(1, "");
    let engine = TransferEngine::open(&plain).unwrap();
    assert_eq!(engine.secret_file(), Some(secret.as_path()));
    assert!(plain
        .backend_options()
        .contains(&format!("secret_file = \"{}\"", secret.display())));
    drop(engine);

    let mut same = common::mock_config(1, "");
    same.security.secret_file = Some(dir.join(".").join("secret"));
    TransferEngine::open(&same).expect("the same file under another spelling");

    let mut other = common::mock_config(1, "");
    other.security.secret_file = Some(dir.join("another"));
    match TransferEngine::open(&other) {
        Err(Error::Config(e)) => {
            let text = e.to_string();
            assert!(
                text.contains("another") && text.contains("XFER_SECRET_FILE"),
                "{text}"
            );
        }
        other => panic!("expected the two secrets refused by name, got {other:?}"),
    }
    std::env::remove_var(engine_core::config::SECRET_FILE_ENV);
    let engine = TransferEngine::open(&plain).unwrap();
    assert_eq!(engine.secret_file(), None);
    let _ = std::fs::remove_dir_all(&dir);
}
