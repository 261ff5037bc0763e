//! GPU memory on libfabric's shm provider, against the fake CUDA driver (`cargo xtask
//! gpu-fakes`; ignored in a plain `cargo test`): where the provider grants FI_HMEM the
//! registration goes to it as FI_HMEM_CUDA and bytes land in device memory, or its refusal is
//! a typed error with the provider's reason; where it does not grant FI_HMEM the engine refuses
//! by name, before the provider could take the device pointer for host memory.

mod common;

use std::sync::Arc;
use std::time::Duration;

use engine_core::{Device, DoneCounter, Error, TransferEngine};
use xfer_cuda::DeviceBuffer;

#[test]
#[ignore = "needs the GPU fakes: cargo xtask gpu-fakes"]
fn device_memory_on_shm_is_registered_with_fi_hmem_or_refused_by_name() {
    const LEN: usize = 64 << 10;
    let config = common::config("shm", 1);
    let (a, b) = (
        Arc::new(TransferEngine::open(&config).unwrap()),
        Arc::new(TransferEngine::open(&config).unwrap()),
    );
    let gpu = DeviceBuffer::new(0, LEN).expect("the fake driver");
    let fi_hmem = b.capabilities()[0].cuda_memory;
    // SAFETY: `gpu` outlives the registration (deregistered below, or never registered).
    let registered = unsafe { b.reg_mr(gpu.ptr() as *mut u8, LEN, Device::Cuda(0)) };
    if !fi_hmem {
        match registered {
            Err(Error::Refused { backend, source })
                if backend == "efa" && source.message.contains("cannot register CUDA memory") => {}
            other => panic!("expected the engine's refusal naming the backend, got {other:?}"),
        }
        return;
    }
    // Debian's shm grants FI_HMEM but was built without CUDA: its FI_HMEM_CUDA registration
    // fails (-ENOSYS), and that is a typed error naming the provider's reason.
    let (mr, desc) = match registered {
        Ok(registered) => registered,
        Err(Error::Refused { source, .. })
            if source
                .message
                .contains("shm cannot register GPU memory of CUDA device 0: fi_mr_regattr") =>
        {
            eprintln!("shm refused FI_HMEM_CUDA: {source}");
            return;
        }
        Err(e) => panic!("FI_HMEM granted, yet an untyped failure: {e:?}"),
    };
    let mut host: Vec<u8> = (0..LEN).map(|i| (i % 241) as u8).collect();
    // SAFETY: `host` outlives its registration.
    let (src, _) = unsafe { a.reg_mr(host.as_mut_ptr(), LEN, Device::Host) }.unwrap();
    let done = DoneCounter::new();
    a.submit_single_write(LEN as u64, None, (src, 0), (&desc, 0), done.clone())
        .unwrap();
    done.wait_for(1, Duration::from_secs(20)).unwrap();
    assert!(gpu.download().unwrap() == host);
    b.dereg_mr(mr).unwrap();
    a.dereg_mr(src).unwrap();
}
