//! The GPU check of uvm-watcher (run by `cargo xtask gpu-check` on a machine with an NVIDIA
//! GPU): a kernel bumps a watcher slot — device-mapped host memory or GPU memory polled through
//! GDRCopy (`--memory`); the watcher thread sees each value and
//! acknowledges it through a second slot the kernel polls before the next bump. Reports the
//! round trip (ack written by the CPU → next value seen by the CPU) p50/p99 over `--events`,
//! and half of it as the one-way GPU-write → CPU-callback estimate. Exits non-zero without a
//! GPU, or if any value is missed.
//!
//! `--pass-cost` instead measures what polling costs the CPU: the time per polling pass with
//! 1, 64 and 512 watched slots of the chosen memory (any memory, `host` included, so it runs
//! without a GPU too).

use std::ffi::c_void;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use clap::Parser;
use cudarc::driver::sys;
use uvm_watcher::{Control, MemoryChoice, MemoryKind, PoolConfig, WatcherPool};

/// `bump(slot, ack, n)`: for i in 1..=n { *slot = i; wait until *ack >= i }.
const PTX: &str = r#"
.version 7.0
.target sm_70
.address_size 64
.visible .entry bump(.param .u64 slot, .param .u64 ack, .param .u64 n)
{
    .reg .u64 %rd<8>;
    .reg .pred %p<3>;
    ld.param.u64 %rd1, [slot];
    ld.param.u64 %rd2, [ack];
    ld.param.u64 %rd3, [n];
    mov.u64 %rd4, 1;
LOOP:
    st.volatile.global.u64 [%rd1], %rd4;
    membar.sys;
WAIT:
    ld.volatile.global.u64 %rd5, [%rd2];
    setp.lt.u64 %p1, %rd5, %rd4;
    @%p1 bra WAIT;
    add.u64 %rd4, %rd4, 1;
    setp.le.u64 %p2, %rd4, %rd3;
    @%p2 bra LOOP;
    ret;
}
"#;

#[derive(Parser)]
struct Args {
    /// Values the kernel writes.
    #[arg(long, default_value_t = 20_000)]
    events: u64,
    /// CPU for the watcher thread.
    #[arg(long)]
    cpu: Option<usize>,
    /// Print JSON.
    #[arg(long)]
    json: bool,
    /// Slot memory: `device_mapped` or `gpu_gdrcopy` (and `host` with --pass-cost).
    #[arg(long, default_value = "device_mapped")]
    memory: String,
    /// Measure the poller's CPU time per pass with 1, 64 and 512 watched slots instead.
    #[arg(long)]
    pass_cost: bool,
}

/// `--pass-cost`: the poller's time per pass (read and compare; no callbacks fire), with 1,
/// 64 and 512 watched slots, over one second each.
fn pass_cost(args: &Args, memory: MemoryChoice) {
    for n in [1usize, 64, 512] {
        let pool = WatcherPool::new(PoolConfig {
            cpu: args.cpu,
            memory,
            max_slots: 512,
            ..PoolConfig::default()
        })
        .unwrap_or_else(|e| {
            eprintln!("gpu-check: {e}");
            std::process::exit(1)
        });
        let watchers: Vec<_> = (0..n)
            .map(|_| pool.watch(|_, _| Control::Continue).expect("slot"))
            .collect();
        std::thread::sleep(Duration::from_millis(100));
        let (p0, t0) = pool.pass_stats();
        std::thread::sleep(Duration::from_secs(1));
        let (p1, t1) = pool.pass_stats();
        let per_pass_ns = (t1 - t0).as_nanos() as f64 / (p1 - p0).max(1) as f64;
        if args.json {
            println!(
                "{{\"memory\": \"{}\", \"slots\": {n}, \"passes\": {}, \"ns_per_pass\": {per_pass_ns:.0}}}",
                pool.memory().name(),
                p1 - p0
            );
        } else {
            println!(
                "gpu-check pass cost: {} memory, {n} slots: {per_pass_ns:.0} ns per pass ({} passes in 1 s)",
                pool.memory().name(),
                p1 - p0
            );
        }
        drop(watchers);
    }
}

fn check(what: &str, r: sys::CUresult) {
    if r != sys::CUresult::CUDA_SUCCESS {
        eprintln!("gpu-check: {what} failed: {r:?}");
        std::process::exit(1);
    }
}

fn main() {
    let args = Args::parse();
    let memory = MemoryChoice::parse(&args.memory).unwrap_or_else(|e| {
        eprintln!("gpu-check: {e}");
        std::process::exit(2)
    });
    if args.pass_cost {
        return pass_cost(&args, memory);
    }
    let pool = WatcherPool::new(PoolConfig {
        cpu: args.cpu,
        memory,
        ..PoolConfig::default()
    })
    .unwrap_or_else(|e| {
        eprintln!("gpu-check: {e}");
        std::process::exit(1)
    });
    let base = Instant::now();
    let ack_written = Arc::new(AtomicU64::new(0));
    let round_trips = Arc::new(Mutex::new(Vec::with_capacity(args.events as usize)));
    let missed = Arc::new(AtomicU64::new(0));
    let ack = Arc::new(pool.watch(|_, _| Control::Continue).expect("ack slot"));
    let (a, r, m, ackw) = (
        Arc::clone(&ack),
        Arc::clone(&round_trips),
        Arc::clone(&missed),
        Arc::clone(&ack_written),
    );
    let slot = pool
        .watch(move |old, new| {
            let now = base.elapsed().as_nanos() as u64;
            if new != old + 1 {
                m.fetch_add(new - old - 1, Ordering::Relaxed);
            }
            if old > 0 {
                r.lock().unwrap().push(now - ackw.load(Ordering::Relaxed));
            }
            ackw.store(base.elapsed().as_nanos() as u64, Ordering::Relaxed);
            a.store(new);
            Control::Continue
        })
        .expect("watched slot");
    assert_ne!(
        slot.memory(),
        MemoryKind::Host,
        "a kernel needs device-visible slots"
    );
    let (slot_dev, ack_dev) = (
        slot.device_ptr().expect("device-visible"),
        ack.device_ptr().expect("device-visible"),
    );
    // SAFETY: the pool opened the driver and retained device 0's primary context (made current
    // by its allocations on this thread); the PTX and names are NUL-terminated; the kernel
    // parameters point at live locals for the launch.
    unsafe {
        let ptx = std::ffi::CString::new(PTX).unwrap();
        let mut module = std::ptr::null_mut();
        check(
            "cuModuleLoadData",
            sys::cuModuleLoadData(&mut module, ptx.as_ptr() as *const c_void),
        );
        let mut func = std::ptr::null_mut();
        check(
            "cuModuleGetFunction",
            sys::cuModuleGetFunction(&mut func, module, c"bump".as_ptr()),
        );
        let (mut p_slot, mut p_ack, mut p_n) = (slot_dev, ack_dev, args.events);
        let mut params = [
            &mut p_slot as *mut u64 as *mut c_void,
            &mut p_ack as *mut u64 as *mut c_void,
            &mut p_n as *mut u64 as *mut c_void,
        ];
        check(
            "cuLaunchKernel",
            sys::cuLaunchKernel(
                func,
                1,
                1,
                1,
                1,
                1,
                1,
                0,
                std::ptr::null_mut(),
                params.as_mut_ptr(),
                std::ptr::null_mut(),
            ),
        );
        check("cuCtxSynchronize", sys::cuCtxSynchronize());
    }
    let deadline = Instant::now() + Duration::from_secs(5);
    while slot.value() < args.events && Instant::now() < deadline {
        std::thread::sleep(Duration::from_millis(1));
    }
    let mut rt = round_trips.lock().unwrap().clone();
    rt.sort_unstable();
    if rt.is_empty() {
        eprintln!("gpu-check: no event was seen");
        std::process::exit(1);
    }
    let pct = |p: f64| rt[((rt.len() as f64 * p) as usize).min(rt.len() - 1)] as f64 / 1e3;
    let (p50, p99) = (pct(0.5), pct(0.99));
    let missed = missed.load(Ordering::Relaxed);
    if args.json {
        println!("{{\"memory\": \"{}\", \"events\": {}, \"missed\": {missed}, \"round_trip_p50_us\": {p50:.3}, \"round_trip_p99_us\": {p99:.3}, \"one_way_p50_us\": {:.3}, \"one_way_p99_us\": {:.3}}}", slot.memory().name(), rt.len(), p50 / 2.0, p99 / 2.0);
    } else {
        println!("gpu-check ({} slots): {} events, {missed} missed; CPU ack -> next GPU value seen: p50 {p50:.2} us, p99 {p99:.2} us (one way ~ p50 {:.2} us, p99 {:.2} us)", slot.memory().name(), rt.len(), p50 / 2.0, p99 / 2.0);
    }
    if missed > 0 {
        std::process::exit(1);
    }
}
