//! A watcher callback that submits transfers: the "layer k is computed, send its pages" path,
//! with a CPU producer standing in for the GPU.

mod common;

use std::sync::Arc;
use std::time::Duration;

use engine_core::conformance::{buffer, pattern};
use engine_core::{
    expected_arrivals, DoneCounter, DoneFlag, TransferEngine, TransferShape, WatchControl,
};

#[test]
fn each_bump_sends_that_layer() {
    const LAYERS: u64 = 24;
    const LAYER_LEN: u64 = 64 << 10;
    let config = common::mock_config(2, "");
    let prefill = Arc::new(TransferEngine::open(&config).unwrap());
    let decode = Arc::new(TransferEngine::open(&config).unwrap());
    let src = Arc::new(buffer(&prefill, (LAYERS * LAYER_LEN) as usize, pattern(6)));
    let dst = buffer(&decode, (LAYERS * LAYER_LEN) as usize, |_| 0);
    let per_layer = expected_arrivals(TransferShape::Single { len: LAYER_LEN }, 2, &config.stripe);
    let landed: Vec<_> = (0..LAYERS)
        .map(|l| {
            let f = DoneFlag::new();
            decode
                .expect_imm_count(l as u32, per_layer, f.clone())
                .unwrap();
            f
        })
        .collect();
    let sent = DoneCounter::new();
    let (engine, source, desc, counter) = (
        Arc::clone(&prefill),
        Arc::clone(&src),
        dst.desc().clone(),
        sent.clone(),
    );
    // The producer bumps the slot to k+1 when layer k is done; a coalesced bump sends every
    // layer between old and new.
    let watcher = prefill
        .alloc_uvm_watcher(move |old, new| {
            for layer in old..new {
                let at = layer * LAYER_LEN;
                engine
                    .submit_single_write(
                        LAYER_LEN,
                        Some(layer as u32),
                        (source.mr(), at),
                        (&desc, at),
                        counter.clone(),
                    )
                    .expect("submit from the watcher callback");
            }
            if new == LAYERS {
                WatchControl::Stop
            } else {
                WatchControl::Continue
            }
        })
        .unwrap();
    for _ in 0..LAYERS {
        watcher.add(1);
        std::thread::sleep(Duration::from_micros(200));
    }
    sent.wait_for(LAYERS, Duration::from_secs(20)).unwrap();
    for (l, f) in landed.iter().enumerate() {
        f.wait(Duration::from_secs(20))
            .unwrap_or_else(|e| panic!("layer {l}: {e}"));
    }
    assert!(dst.bytes() == src.bytes());
    assert_eq!(sent.finished(), LAYERS, "each layer sent exactly once");
}

/// GPU registrations are checked with the CUDA driver before anything is registered; without
/// a driver they are refused with the reason, host memory still registers.
#[test]
fn gpu_memory_without_a_driver_is_a_typed_error() {
    if uvm_watcher::cuda_driver_present() {
        return; // a GPU machine: `cargo xtask gpu-check` exercises the device path
    }
    let config = common::mock_config(1, "");
    let engine = Arc::new(TransferEngine::open(&config).unwrap());
    let mut fake = vec![0u8; 4096];
    // SAFETY: refused before anything registers the memory.
    let err = unsafe { engine.reg_mr(fake.as_mut_ptr(), fake.len(), engine_core::Device::Cuda(0)) }
        .unwrap_err();
    assert!(
        matches!(&err, engine_core::Error::InvalidArgument(m) if m.contains("no CUDA driver")),
        "{err}"
    );
    // SAFETY: `fake` outlives the registration, deregistered right after.
    let (mr, _) =
        unsafe { engine.reg_mr(fake.as_mut_ptr(), fake.len(), engine_core::Device::Host) }.unwrap();
    engine.dereg_mr(mr).unwrap();
}
