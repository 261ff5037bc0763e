//! The host-memory watcher: many slots, a fast producer, every change observed, slots reused.

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use uvm_watcher::{Control, PoolConfig, WatcherPool, SLOTS_PER_BLOCK};

fn wait_until(what: &str, mut done: impl FnMut() -> bool) {
    let deadline = Instant::now() + Duration::from_secs(20);
    while !done() {
        assert!(Instant::now() < deadline, "timed out waiting for {what}");
        std::thread::sleep(Duration::from_millis(1));
    }
}

#[test]
fn every_change_of_many_slots_is_seen_with_nothing_lost() {
    const WATCHERS: usize = 300;
    const BUMPS: u64 = 2_000;
    let pool = WatcherPool::new(PoolConfig::default()).unwrap();
    // Per slot: the sum of (new - old) the callback saw, and the last `new`.
    let seen: Arc<Vec<(AtomicU64, AtomicU64)>> = Arc::new(
        (0..WATCHERS)
            .map(|_| (AtomicU64::new(0), AtomicU64::new(0)))
            .collect(),
    );
    let watchers: Vec<_> = (0..WATCHERS)
        .map(|k| {
            let seen = Arc::clone(&seen);
            pool.watch(move |old, new| {
                assert!(new > old, "a counter only grows");
                seen[k].0.fetch_add(new - old, Ordering::Relaxed);
                seen[k].1.store(new, Ordering::Release);
                Control::Continue
            })
            .unwrap()
        })
        .collect();
    assert_eq!(pool.active(), WATCHERS);
    let producer = {
        let ptrs: Vec<usize> = watchers.iter().map(|w| w.host_ptr() as usize).collect();
        std::thread::spawn(move || {
            for _ in 0..BUMPS {
                for &p in &ptrs {
                    // SAFETY: the slots stay allocated while their watchers live (joined below
                    // before they drop); the slot is an aligned u64 the poller reads atomically.
                    let cell = unsafe { &*(p as *const AtomicU64) };
                    cell.fetch_add(1, Ordering::Release);
                }
            }
        })
    };
    producer.join().unwrap();
    wait_until("every final value", || {
        seen.iter().all(|s| s.1.load(Ordering::Acquire) == BUMPS)
    });
    for (k, s) in seen.iter().enumerate() {
        assert_eq!(
            s.0.load(Ordering::Relaxed),
            BUMPS,
            "slot {k}: the deltas add up to every bump"
        );
    }
    drop(watchers);
    wait_until("slots to be freed", || pool.active() == 0);
}

#[test]
fn a_callback_can_stop_and_slots_are_reused() {
    let pool = WatcherPool::new(PoolConfig {
        max_slots: SLOTS_PER_BLOCK,
        ..PoolConfig::default()
    })
    .unwrap();
    let calls = Arc::new(Mutex::new(Vec::new()));
    let c = Arc::clone(&calls);
    let w = pool
        .watch(move |old, new| {
            c.lock().unwrap().push((old, new));
            if new >= 3 {
                Control::Stop
            } else {
                Control::Continue
            }
        })
        .unwrap();
    let first_slot = w.slot();
    for v in 1..=3 {
        w.store(v);
        wait_until("the change", || {
            calls.lock().unwrap().last().map(|x| x.1) == Some(v)
        });
    }
    wait_until("the stop to free the slot", || pool.active() == 0);
    w.store(10);
    std::thread::sleep(Duration::from_millis(20));
    assert_eq!(calls.lock().unwrap().len(), 3, "no callback after Stop");
    drop(w); // dropping a stopped watcher is harmless
    let again = pool.watch(|_, _| Control::Continue).unwrap();
    assert_eq!(again.slot(), first_slot, "the freed slot is reused");
    assert_eq!(again.value(), 0, "a reused slot starts at zero");
}

#[test]
fn the_pool_refuses_more_slots_than_configured_and_callbacks_may_create_watchers() {
    let pool = Arc::new(
        WatcherPool::new(PoolConfig {
            max_slots: SLOTS_PER_BLOCK,
            ..PoolConfig::default()
        })
        .unwrap(),
    );
    let all: Vec<_> = (0..SLOTS_PER_BLOCK)
        .map(|_| pool.watch(|_, _| Control::Continue).unwrap())
        .collect();
    assert!(matches!(
        pool.watch(|_, _| Control::Continue),
        Err(uvm_watcher::WatcherError::Full(512))
    ));
    drop(all);
    wait_until("free slots", || pool.active() == 0);
    // A callback that watches another slot (no deadlock: the poller owns the callbacks).
    let created = Arc::new(Mutex::new(None));
    let (p, c) = (Arc::clone(&pool), Arc::clone(&created));
    let w = pool
        .watch(move |_, _| {
            *c.lock().unwrap() = Some(p.watch(|_, _| Control::Continue).unwrap());
            Control::Stop
        })
        .unwrap();
    w.store(1);
    wait_until("the nested watcher", || created.lock().unwrap().is_some());
    assert_eq!(pool.active(), 1);
}

#[test]
fn without_a_cuda_driver_auto_falls_back_to_host_memory_and_mapped_is_refused() {
    if uvm_watcher::cuda_driver_present() {
        return; // a GPU machine: the device-mapped path is checked by `cargo xtask gpu-check`
    }
    let pool = WatcherPool::new(PoolConfig::default()).unwrap();
    let w = pool.watch(|_, _| Control::Continue).unwrap();
    assert_eq!(w.memory(), uvm_watcher::MemoryKind::Host);
    assert_eq!(w.device_ptr(), None);
    let err = WatcherPool::new(PoolConfig {
        memory: uvm_watcher::MemoryChoice::DeviceMapped,
        ..PoolConfig::default()
    })
    .unwrap_err();
    assert!(err.to_string().contains("no CUDA driver"), "{err}");
}

/// A specific kind that cannot be had is an error naming why — never a silent fallback; auto
/// says which kinds it passed over and why.
#[test]
fn a_gdrcopy_pool_without_gdrcopy_is_refused_with_the_reason() {
    if std::path::Path::new("/dev/gdrdrv").exists() {
        return; // a GDRCopy machine: `cargo xtask gpu-check` measures the real path
    }
    let err = WatcherPool::new(PoolConfig {
        memory: uvm_watcher::MemoryChoice::GpuGdrcopy,
        ..PoolConfig::default()
    })
    .unwrap_err()
    .to_string();
    assert!(
        err.contains("CUDA driver") || err.contains("GDRCopy") || err.contains("gdrdrv"),
        "{err}"
    );
    let (kind, passed_over) =
        uvm_watcher::probe(uvm_watcher::MemoryChoice::Auto, 0).expect("auto always succeeds");
    if !uvm_watcher::cuda_driver_present() {
        assert_eq!(kind, uvm_watcher::MemoryKind::Host);
        assert_eq!(passed_over.len(), 2, "{passed_over:?}");
        assert!(passed_over[0].starts_with("not gpu_gdrcopy"));
        assert!(passed_over[1].starts_with("not device_mapped"));
    }
    for (text, choice) in [
        ("auto", uvm_watcher::MemoryChoice::Auto),
        ("host", uvm_watcher::MemoryChoice::Host),
        ("device_mapped", uvm_watcher::MemoryChoice::DeviceMapped),
        ("gpu_gdrcopy", uvm_watcher::MemoryChoice::GpuGdrcopy),
    ] {
        assert_eq!(uvm_watcher::MemoryChoice::parse(text), Ok(choice));
    }
    assert!(uvm_watcher::MemoryChoice::parse("gpu").is_err());
}

/// With a pass interval the poller sleeps between passes and still sees every change; pass
/// statistics say what polling costs.
#[test]
fn a_paced_poller_sees_changes_and_reports_its_cost() {
    let pool = WatcherPool::new(PoolConfig {
        memory: uvm_watcher::MemoryChoice::Host,
        pass_interval_us: 200,
        ..PoolConfig::default()
    })
    .unwrap();
    let seen = Arc::new(AtomicU64::new(0));
    let s = Arc::clone(&seen);
    let watchers: Vec<_> = (0..64)
        .map(|_| pool.watch(|_, _| Control::Continue).unwrap())
        .collect();
    let last = pool
        .watch(move |_, new| {
            s.store(new, Ordering::SeqCst);
            Control::Continue
        })
        .unwrap();
    for v in 1..=5 {
        last.store(v);
        wait_until("the paced poller", || seen.load(Ordering::SeqCst) == v);
    }
    let (passes, busy) = pool.pass_stats();
    assert!(passes > 0);
    assert!(busy.as_nanos() > 0);
    assert_eq!(pool.memory(), uvm_watcher::MemoryKind::Host);
    drop(watchers);
}
