//! The EFA-facing options (#12) exercised by real code on shm and tcp: each provider either
//! accepts an option or cleanly keeps its default, and transfers work either way. Run against
//! libfabric 1.17 and 2.x by `cargo xtask test`.

mod common;

use std::sync::Arc;
use std::time::Duration;

use engine_core::conformance::{buffer, pattern};
use engine_core::{DoneFlag, TransferEngine, TransferShape};

fn write_and_count(config: &engine_core::Config) {
    let (a, b) = (
        Arc::new(TransferEngine::open(config).unwrap()),
        Arc::new(TransferEngine::open(config).unwrap()),
    );
    let src = buffer(&a, 8192, pattern(3));
    let dst = buffer(&b, 8192, |_| 0);
    let landed = DoneFlag::new();
    b.expect_imm_count(
        5,
        b.expected_arrivals(TransferShape::Single { len: 8192 }),
        landed.clone(),
    )
    .unwrap();
    let sent = DoneFlag::new();
    a.submit_single_write(8192, Some(5), (src.mr(), 0), (dst.desc(), 0), sent.clone())
        .unwrap();
    sent.wait(Duration::from_secs(20)).unwrap();
    landed.wait(Duration::from_secs(20)).unwrap();
    assert!(dst.to_vec() == src.to_vec());
}

#[test]
fn shared_memory_permission_is_accepted_or_left_at_the_default() {
    for provider in ["shm", "tcp;ofi_rxm"] {
        for permitted in [false, true] {
            let mut config = common::config(provider, 1);
            config
                .backends
                .get_mut("efa")
                .and_then(|t| t.as_table_mut())
                .unwrap()
                .insert("shared_memory".into(), toml::Value::Boolean(permitted));
            write_and_count(&config);
        }
    }
}

/// Device memory is declared only where the provider granted FI_HMEM: without it the engine
/// refuses CUDA registrations (naming the backend) instead of letting the provider take a
/// device pointer for host memory. shm and tcp here are built without CUDA.
#[test]
fn device_memory_is_declared_only_with_fi_hmem() {
    for provider in ["shm", "tcp;ofi_rxm"] {
        let engine = TransferEngine::open(&common::config(provider, 1)).unwrap();
        let caps = engine.capabilities()[0];
        eprintln!("{provider}: {caps:?}");
        assert!(caps.host_memory);
        assert!(!caps.dmabuf);
        if provider == "tcp;ofi_rxm" {
            assert!(!caps.cuda_memory, "tcp;ofi_rxm cannot register CUDA memory");
        }
    }
}
