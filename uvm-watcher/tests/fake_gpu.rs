//! The watcher's GPU memory kinds and the GPU counter against the fake CUDA driver and GDRCopy
//! (`cargo xtask gpu-fakes`; ignored in a plain `cargo test`): "kernel" stores through the
//! fake GPU, pins and allocations counted back to zero, faults falling back with the reason.

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use uvm_watcher::{
    probe, Control, CounterMemory, GpuCounter, MemoryChoice, MemoryKind, PoolConfig, WatcherPool,
};
use xfer_gpu_fakes::fakes;

fn wait_until(what: &str, mut done: impl FnMut() -> bool) {
    let deadline = Instant::now() + Duration::from_secs(20);
    while !done() {
        assert!(Instant::now() < deadline, "timed out waiting for {what}");
        std::thread::sleep(Duration::from_millis(1));
    }
}

fn pool(memory: MemoryChoice) -> WatcherPool {
    WatcherPool::new(PoolConfig {
        memory,
        ..PoolConfig::default()
    })
    .unwrap_or_else(|e| panic!("{memory:?}: {e} (run through cargo xtask gpu-fakes)"))
}

/// A kernel bumps its slot five times; the callback sees every step (possibly coalesced), and
/// everything the pool allocated or pinned is released when it goes.
fn kernel_bumps_are_seen(memory: MemoryChoice, kind: MemoryKind) {
    let (allocations, pins) = (fakes().live_allocations(), fakes().live_pins());
    let pool = pool(memory);
    assert_eq!(pool.memory(), kind);
    let (sum, last) = (Arc::new(AtomicU64::new(0)), Arc::new(AtomicU64::new(0)));
    let (s, l) = (Arc::clone(&sum), Arc::clone(&last));
    let watcher = pool
        .watch(move |old, new| {
            s.fetch_add(new - old, Ordering::Relaxed);
            l.store(new, Ordering::Release);
            Control::Continue
        })
        .unwrap();
    assert_eq!(watcher.memory(), kind);
    let device = watcher
        .device_ptr()
        .expect("GPU-visible slots have a device address");
    for k in 1..=5 {
        fakes().gpu_store(device, k);
        fakes().gpu_threadfence_system();
    }
    fakes().synchronize();
    wait_until("the last bump", || last.load(Ordering::Acquire) == 5);
    assert_eq!(
        sum.load(Ordering::Relaxed),
        5,
        "the deltas add up to every bump"
    );
    assert_eq!(watcher.value(), 5, "the CPU reads what the kernel wrote");
    // A CPU producer on the same slot, through the mapping.
    watcher.store(9);
    wait_until("the CPU's store", || last.load(Ordering::Acquire) == 9);
    drop(watcher);
    drop(pool);
    assert_eq!(
        fakes().live_pins(),
        pins,
        "every GDRCopy pin and mapping released"
    );
    assert_eq!(
        fakes().live_allocations(),
        allocations,
        "every allocation freed"
    );
}

#[test]
#[ignore = "needs the GPU fakes: cargo xtask gpu-fakes"]
fn a_kernel_bumping_device_mapped_slots_is_seen() {
    kernel_bumps_are_seen(MemoryChoice::DeviceMapped, MemoryKind::DeviceMapped);
}

#[test]
#[ignore = "needs the GPU fakes: cargo xtask gpu-fakes"]
fn a_kernel_bumping_gpu_memory_slots_is_seen_through_gdrcopy() {
    kernel_bumps_are_seen(MemoryChoice::GpuGdrcopy, MemoryKind::GpuGdrcopy);
}

#[test]
#[ignore = "needs the GPU fakes: cargo xtask gpu-fakes"]
fn auto_takes_the_best_memory_and_says_why_it_passed_others_over() {
    assert_eq!(
        probe(MemoryChoice::Auto, 0).unwrap().0,
        MemoryKind::GpuGdrcopy
    );
    fakes().fail_gdr("gdr_open", -1);
    let (kind, why) = probe(MemoryChoice::Auto, 0).unwrap();
    fakes().fail_gdr("gdr_open", 0);
    assert_eq!(kind, MemoryKind::DeviceMapped);
    assert!(why.iter().any(|w| w.contains("gdrdrv")), "{why:?}");
    fakes().fail_gdr("gdr_pin_buffer", -1);
    let (kind, why) = probe(MemoryChoice::Auto, 0).unwrap();
    fakes().fail_gdr("gdr_pin_buffer", 0);
    assert_eq!(kind, MemoryKind::DeviceMapped);
    assert!(
        why.iter().any(|w| w.contains("pinning GPU memory")),
        "{why:?}"
    );
    let gdr_only = probe(MemoryChoice::GpuGdrcopy, 0);
    assert_eq!(gdr_only.unwrap().0, MemoryKind::GpuGdrcopy);
    fakes().fail_cuda("cuMemHostAlloc", -1);
    fakes().fail_gdr("gdr_open", -1);
    let (kind, why) = probe(MemoryChoice::Auto, 0).unwrap();
    fakes().fail_cuda("cuMemHostAlloc", 0);
    fakes().fail_gdr("gdr_open", 0);
    assert_eq!(
        kind,
        MemoryKind::Host,
        "mapped memory that cannot be allocated is passed over"
    );
    assert!(why.iter().any(|w| w.contains("cuMemHostAlloc")), "{why:?}");
    let refused = WatcherPool::new(PoolConfig {
        memory: MemoryChoice::GpuGdrcopy,
        cuda_device: 7,
        ..PoolConfig::default()
    })
    .unwrap_err();
    assert!(
        refused.to_string().contains("CUDA device 7 does not exist"),
        "{refused}"
    );
}

#[test]
#[ignore = "needs the GPU fakes: cargo xtask gpu-fakes"]
fn the_gpu_counter_lives_in_gpu_memory_and_the_kernel_reads_what_the_cpu_set() {
    let pins = fakes().live_pins();
    let counter = GpuCounter::new(0);
    assert_eq!(counter.memory(), CounterMemory::Gdr);
    counter.set(41);
    counter.set(42);
    assert_eq!(counter.value(), 42);
    let mut seen = [0u8; 8];
    let device = counter.device_ptr().expect("a device address");
    // SAFETY: 8 bytes of live device memory into a live host array.
    unsafe { xfer_cuda::copy(seen.as_mut_ptr() as u64, device, 8) }.unwrap();
    assert_eq!(
        u64::from_ne_bytes(seen),
        42,
        "the device memory holds the value"
    );
    drop(counter);
    assert_eq!(fakes().live_pins(), pins, "the counter's pin released");
    fakes().fail_gdr("gdr_open", -1);
    let mapped = GpuCounter::new(0);
    fakes().fail_gdr("gdr_open", 0);
    assert_eq!(mapped.memory(), CounterMemory::DeviceMapped);
    mapped.set(5);
    assert_eq!(mapped.value(), 5);
}

/// The fencing rule of the watcher's docs, shown on the fake GPU, whose unfenced stores land
/// last-first: a kernel publishes a value in device memory and then bumps the slot; the
/// callback reads the value on the bump. With `__threadfence_system()` between the two it
/// always sees the value; without it, the fake lets it see a stale one — as a GPU may.
fn published(fenced: bool) -> (u64, u64) {
    let pool = pool(MemoryChoice::GpuGdrcopy);
    let data = xfer_cuda::DeviceBuffer::new(0, 8).unwrap();
    let data_ptr = data.ptr();
    let seen: Arc<Mutex<Vec<(u64, u64)>>> = Arc::default();
    let s = Arc::clone(&seen);
    let watcher = pool
        .watch(move |_, new| {
            let mut value = [0u8; 8];
            // SAFETY: 8 bytes of the live device buffer into a local array.
            unsafe { xfer_cuda::copy(value.as_mut_ptr() as u64, data_ptr, 8) }.unwrap();
            s.lock().unwrap().push((new, u64::from_ne_bytes(value)));
            Control::Continue
        })
        .unwrap();
    let slot = watcher.device_ptr().unwrap();
    const ROUNDS: u64 = 20;
    for round in 1..=ROUNDS {
        fakes().gpu_store(data_ptr, round * 100);
        if fenced {
            fakes().gpu_threadfence_system();
        }
        fakes().gpu_store(slot, round);
        fakes().gpu_threadfence_system();
        fakes().synchronize();
        wait_until("the bump", || {
            seen.lock()
                .unwrap()
                .last()
                .is_some_and(|&(n, _)| n == round)
        });
    }
    let seen = seen.lock().unwrap();
    let stale = seen.iter().filter(|&&(n, v)| v != n * 100).count() as u64;
    (seen.len() as u64, stale)
}

#[test]
#[ignore = "needs the GPU fakes: cargo xtask gpu-fakes"]
fn a_fenced_kernel_publishes_its_data_before_the_slot() {
    let (calls, stale) = published(true);
    assert!(calls >= 20);
    assert_eq!(
        stale, 0,
        "with the fence every callback read the published value"
    );
}

#[test]
#[ignore = "needs the GPU fakes: cargo xtask gpu-fakes"]
fn without_the_fence_the_fake_gpu_shows_stale_data() {
    let (_, stale) = published(false);
    assert!(stale > 0, "the fake GPU must make a missing fence visible");
}
