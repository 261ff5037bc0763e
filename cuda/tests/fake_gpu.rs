//! GPU memory checks, copies and dma-buf export against the fake CUDA driver
//! (`cargo xtask gpu-fakes`; ignored in a plain `cargo test`, which has no driver).

use std::os::unix::process::ExitStatusExt;

use xfer_cuda::DeviceBuffer;
use xfer_gpu_fakes::{fakes, is_child, run_child};

const NEEDS: &str = "needs the fake CUDA driver: cargo xtask gpu-fakes";

#[test]
#[ignore = "needs the fake CUDA driver: cargo xtask gpu-fakes"]
fn device_memory_is_checked_and_copied_only_through_the_driver() {
    let live = fakes().live_allocations();
    let bytes: Vec<u8> = (0..100_000u32).map(|i| (i % 251) as u8).collect();
    let gpu = DeviceBuffer::new(0, bytes.len()).expect(NEEDS);
    assert_eq!(fakes().live_allocations(), live + 1);
    gpu.upload(0, &bytes).unwrap();
    assert!(gpu.download().unwrap() == bytes);

    let (ptr, len) = (gpu.ptr(), bytes.len() as u64);
    xfer_cuda::check_device_range(ptr, len, 0).unwrap();
    xfer_cuda::check_device_range(ptr + 10, len - 10, 0).unwrap();
    let wrong_device = xfer_cuda::check_device_range(ptr, len, 1).unwrap_err();
    assert!(
        wrong_device.contains("belongs to CUDA device 0, not 1"),
        "{wrong_device}"
    );
    let crosses = xfer_cuda::check_device_range(ptr + 4096, len + 4096, 0).unwrap_err();
    assert!(
        crosses.contains("crosses the end of its allocation"),
        "{crosses}"
    );
    let as_host = xfer_cuda::check_host_range(ptr).unwrap_err();
    assert!(as_host.contains("register it as Device::Cuda"), "{as_host}");
    let host = [0u8; 64];
    let as_device = xfer_cuda::check_device_range(host.as_ptr() as u64, 64, 0).unwrap_err();
    assert!(
        as_device.contains("is not CUDA device memory"),
        "{as_device}"
    );
    xfer_cuda::check_host_range(host.as_ptr() as u64).unwrap();

    // Device to device and device to host through the driver's unified copy.
    let other = DeviceBuffer::new(0, 4096).unwrap();
    let mut back = [0u8; 4096];
    // SAFETY: both ranges are live allocations of at least 4096 bytes.
    unsafe {
        xfer_cuda::copy(other.ptr(), ptr + 4096, 4096).unwrap();
        xfer_cuda::copy(back.as_mut_ptr() as u64, other.ptr(), 4096).unwrap();
    }
    assert!(back[..] == bytes[4096..8192]);
    // A copy running past an allocation is the driver's error, not a stray write.
    // SAFETY: the driver refuses it before touching memory.
    let past = unsafe { xfer_cuda::copy(other.ptr(), ptr, 8192) }.unwrap_err();
    assert!(past.contains("cuMemcpy"), "{past}");
    drop((gpu, other));
    assert_eq!(fakes().live_allocations(), live, "every allocation freed");
}

#[test]
#[ignore = "needs the fake CUDA driver: cargo xtask gpu-fakes"]
fn dma_buf_export_covers_whole_pages_and_failures_name_the_call() {
    let bytes: Vec<u8> = (0..3 * 4096u32).map(|i| (i % 253) as u8).collect();
    let gpu = DeviceBuffer::new(0, bytes.len()).expect(NEEDS);
    gpu.upload(0, &bytes).unwrap();
    let (fd, offset) = xfer_cuda::dmabuf(gpu.ptr() + 100, 5000, 0).unwrap();
    assert_eq!(
        offset, 100,
        "the registration starts inside the first exported page"
    );
    // SAFETY: the driver just handed us this fd; the File owns and closes it.
    let file = unsafe { <std::fs::File as std::os::fd::FromRawFd>::from_raw_fd(fd) };
    let mut seen = vec![0u8; 5000];
    std::os::unix::fs::FileExt::read_exact_at(&file, &mut seen, offset).unwrap();
    assert!(
        seen[..] == bytes[100..5100],
        "the fd holds the device bytes"
    );

    fakes().fail_cuda("cuMemGetHandleForAddressRange", 1);
    let refused = xfer_cuda::dmabuf(gpu.ptr(), 4096, 0).unwrap_err();
    assert!(
        refused.contains("cuMemGetHandleForAddressRange") && refused.contains("NOT_SUPPORTED"),
        "{refused}"
    );
    fakes().fail_cuda("cuMemAlloc_v2", 1);
    let oom = DeviceBuffer::new(0, 4096).unwrap_err();
    assert!(
        oom.contains("cuMemAlloc") && oom.contains("OUT_OF_MEMORY"),
        "{oom}"
    );
    assert!(
        DeviceBuffer::new(0, 4096).is_ok(),
        "one failure was asked for"
    );
}

#[test]
#[ignore = "needs the fake CUDA driver: cargo xtask gpu-fakes"]
fn a_driver_that_fails_to_initialise_is_a_reason() {
    if is_child() {
        let err = xfer_cuda::check_device_range(0x1000, 1, 0).unwrap_err();
        assert!(
            err.contains("cuInit") && err.contains("NOT_INITIALIZED"),
            "{err}"
        );
        let err = DeviceBuffer::new(0, 4096).unwrap_err();
        assert!(err.contains("cuInit"), "{err}");
        return;
    }
    let child = run_child(
        "a_driver_that_fails_to_initialise_is_a_reason",
        &[("XFER_FAKE_CUDA_FAIL", "cuInit")],
    );
    assert!(
        child.status.success(),
        "{}",
        String::from_utf8_lossy(&child.stdout)
    );
}

/// The fake is as unkind as a GPU: the CPU touching device memory dies, so a CPU dereference
/// anywhere in the product fails the test that reaches it.
#[test]
#[ignore = "needs the fake CUDA driver: cargo xtask gpu-fakes"]
fn the_cpu_cannot_touch_device_memory() {
    if is_child() {
        let gpu = DeviceBuffer::new(0, 4096).expect(NEEDS);
        // SAFETY: deliberately not: this child process is meant to die here.
        let byte = unsafe { std::ptr::read_volatile(gpu.ptr() as *const u8) };
        println!("read {byte} from device memory");
        return;
    }
    let child = run_child("the_cpu_cannot_touch_device_memory", &[]);
    assert_eq!(
        child.status.signal(),
        Some(11),
        "the child should die of SIGSEGV: {:?} {}",
        child.status,
        String::from_utf8_lossy(&child.stdout)
    );
}
