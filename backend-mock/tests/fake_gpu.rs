//! GPU memory through the engine on the mock, against the fake CUDA driver
//! (`cargo xtask gpu-fakes`; ignored in a plain `cargo test`): registrations checked by the
//! driver, writes and reads between host and device memory placed by the driver's copies (the
//! CPU touching device memory would kill the test), typed refusals.

mod common;

use std::sync::Arc;
use std::time::Duration;

use engine_core::{Device, DoneCounter, Error, RemoteAccess, TransferEngine};
use xfer_cuda::DeviceBuffer;
use xfer_gpu_fakes::fakes;

const LEN: usize = 256 << 10;

fn engines() -> (Arc<TransferEngine>, Arc<TransferEngine>) {
    let config = common::mock_config(2, "");
    (
        Arc::new(TransferEngine::open(&config).unwrap()),
        Arc::new(TransferEngine::open(&config).unwrap()),
    )
}

fn pattern(seed: u8) -> Vec<u8> {
    (0..LEN).map(|i| (i % 251) as u8 ^ seed).collect()
}

#[test]
#[ignore = "needs the GPU fakes: cargo xtask gpu-fakes"]
fn writes_and_reads_move_bytes_between_host_and_device_memory() {
    let live = fakes().live_allocations();
    let (a, b) = engines();
    let mut host = pattern(1);
    let gpu_a = DeviceBuffer::new(0, LEN).unwrap();
    let gpu_b = DeviceBuffer::new(0, LEN).unwrap();
    gpu_a.upload(0, &pattern(2)).unwrap();
    // SAFETY: every buffer outlives its registration (deregistered at the end).
    let ((host_mr, _), (gpu_a_mr, gpu_a_desc), (gpu_b_mr, gpu_b_desc)) = unsafe {
        (
            a.reg_mr(host.as_mut_ptr(), LEN, Device::Host).unwrap(),
            a.reg_mr_with(
                gpu_a.ptr() as *mut u8,
                LEN,
                Device::Cuda(0),
                RemoteAccess::READ_WRITE,
            )
            .unwrap(),
            b.reg_mr(gpu_b.ptr() as *mut u8, LEN, Device::Cuda(0))
                .unwrap(),
        )
    };
    let done = DoneCounter::new();
    // Host → remote device, striped over both NICs.
    a.submit_single_write(
        LEN as u64,
        None,
        (host_mr, 0),
        (&gpu_b_desc, 0),
        done.clone(),
    )
    .unwrap();
    done.wait_for(1, Duration::from_secs(20)).unwrap();
    assert!(
        gpu_b.download().unwrap() == pattern(1),
        "host bytes landed in device memory"
    );
    // Device → remote device, at offsets.
    a.submit_single_write(
        4096,
        None,
        (gpu_a_mr, 8192),
        (&gpu_b_desc, 4096),
        done.clone(),
    )
    .unwrap();
    done.wait_for(2, Duration::from_secs(20)).unwrap();
    let landed = gpu_b.download().unwrap();
    assert!(landed[4096..8192] == pattern(2)[8192..12288]);
    assert!(
        landed[..4096] == pattern(1)[..4096],
        "nothing outside the range moved"
    );
    // Remote device → local host by RDMA READ.
    b.submit_single_read(LEN as u64, (gpu_b_mr, 0), (&gpu_a_desc, 0), done.clone())
        .unwrap_or_else(|e| panic!("{e}"));
    done.wait_for(3, Duration::from_secs(20)).unwrap();
    assert!(
        gpu_b.download().unwrap() == pattern(2),
        "read device bytes into device memory"
    );
    for (engine, mr) in [(&a, host_mr), (&a, gpu_a_mr), (&b, gpu_b_mr)] {
        engine.dereg_mr(mr).unwrap();
    }
    drop((gpu_a, gpu_b, host));
    assert_eq!(fakes().live_allocations(), live);
}

#[test]
#[ignore = "needs the GPU fakes: cargo xtask gpu-fakes"]
fn device_memory_registered_wrongly_is_a_typed_error() {
    let (a, _) = engines();
    let gpu = DeviceBuffer::new(0, LEN).unwrap();
    let mut host = vec![0u8; 4096];
    let refused = |result: engine_core::Result<_>, what: &str| match result {
        Err(Error::InvalidArgument(m)) if m.contains(what) => {}
        other => panic!("expected InvalidArgument naming {what:?}, got {other:?}"),
    };
    // SAFETY: every call is refused before anything registers the memory.
    unsafe {
        refused(
            a.reg_mr(host.as_mut_ptr(), 4096, Device::Cuda(0))
                .map(|_| ()),
            "not CUDA device memory",
        );
        refused(
            a.reg_mr(gpu.ptr() as *mut u8, LEN, Device::Host)
                .map(|_| ()),
            "register it as Device::Cuda",
        );
        refused(
            a.reg_mr(gpu.ptr() as *mut u8, LEN, Device::Cuda(1))
                .map(|_| ()),
            "belongs to CUDA device 0, not 1",
        );
        refused(
            a.reg_mr(gpu.ptr() as *mut u8, LEN + 4096, Device::Cuda(0))
                .map(|_| ()),
            "crosses the end of its allocation",
        );
    }
}
