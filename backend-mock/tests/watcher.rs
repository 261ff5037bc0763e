//! A watcher callback that submits transfers: the "layer k is computed, send its pages" path,
//! with a CPU producer standing in for the GPU.

mod common;

use std::sync::Arc;
use std::time::Duration;

use engine_core::{
    expected_arrivals, DoneCounter, DoneFlag, GpuCounter, TransferEngine, TransferShape,
    WatchControl,
};
use xfer_conformance::{buffer, pattern};

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
    assert!(dst.to_vec() == src.to_vec());
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

/// The ImmCounter mirrored into a GpuCounter (host memory here; GPU memory where there is
/// one): the counter follows every arrival, consumed or not.
#[test]
fn arrivals_are_mirrored_into_a_gpu_counter() {
    let config = common::mock_config(2, "");
    let (a, b) = (
        Arc::new(TransferEngine::open(&config).unwrap()),
        Arc::new(TransferEngine::open(&config).unwrap()),
    );
    let src = buffer(&a, 1 << 20, pattern(2));
    let dst = buffer(&b, 1 << 20, |_| 0);
    let early = DoneCounter::new();
    a.submit_single_write(64, Some(9), (src.mr(), 0), (dst.desc(), 0), early.clone())
        .unwrap();
    early.wait_for(1, Duration::from_secs(20)).unwrap();
    let counter = GpuCounter::new(0);
    if !uvm_watcher::cuda_driver_present() {
        assert_eq!(counter.memory(), uvm_watcher::CounterMemory::Host);
    }
    let mirror = Arc::clone(&counter);
    // Wait for the early arrival to be counted, so the first report is deterministic.
    while b.imm_count(9) < 1 {
        std::thread::yield_now();
    }
    b.mirror_imm_count(9, move |n| mirror.set(n)).unwrap();
    assert_eq!(
        counter.value(),
        1,
        "the registration reports the total so far"
    );
    let n = expected_arrivals(TransferShape::Single { len: 1 << 20 }, 2, &config.stripe);
    let sent = DoneCounter::new();
    for _ in 0..5 {
        a.submit_single_write(
            1 << 20,
            Some(9),
            (src.mr(), 0),
            (dst.desc(), 0),
            sent.clone(),
        )
        .unwrap();
    }
    sent.wait_for(5, Duration::from_secs(20)).unwrap();
    // Consuming arrivals does not move the mirror back.
    let f = DoneFlag::new();
    b.expect_imm_count(9, 1 + 5 * n, f.clone()).unwrap();
    f.wait(Duration::from_secs(20)).unwrap();
    let deadline = std::time::Instant::now() + Duration::from_secs(20);
    while counter.value() < 1 + 5 * n && std::time::Instant::now() < deadline {
        std::thread::yield_now();
    }
    assert_eq!(counter.value(), 1 + 5 * n);
    assert_eq!(b.imm_count(9), 0);
}
