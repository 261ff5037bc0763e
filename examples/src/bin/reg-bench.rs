//! Registration cost of a model's tensors, with the registration cache off and on (issue 27).
//!
//! `reg-bench [--config FILE] [--tensors N]`: N tensors (default 1,265, sizes cycling through
//! a small model's: 4 KiB to 1 MiB, 307 MiB in all at the default) laid out in one allocation,
//! as a framework's parameters are. For each setting of `[memory] registration_cache` it times
//! the phases an RL weight sync goes through, and counts the NIC registrations each made
//! (the stats' `registered`):
//!
//! - `first`: every tensor registered once (nothing to share: N registrations either way);
//! - `again`: every tensor registered again while the first handles live (each step of a
//!   weight sync re-registers what it sends);
//! - `views`: the whole allocation registered, then every tensor as a view of it;
//! - `dereg`: every handle deregistered.
//!
//! Prints one line per phase: milliseconds off, on, their ratio, and registrations off/on.
//! Timings on a shared machine are noisy; the registration counts are not.
#![deny(unsafe_code)]

use std::time::Instant;

use engine_core::{Config, Device, MrHandle, TransferEngine};
use examples::{arg, fail};

/// Sizes of a small transformer's tensors (weights, biases, norms), cycled.
const SIZES: [usize; 6] = [1 << 20, 64 << 10, 4096, 256 << 10, 16 << 10, 128 << 10];

fn main() {
    examples::init_logging();
    backend_mock::link();
    #[cfg(feature = "verbs")]
    backend_verbs::link();
    let tensors: usize = arg("--tensors").map_or(1265, |n| n.parse().unwrap_or_else(|e| fail(e)));
    let base = match arg("--config") {
        Some(path) => Config::from_file(std::path::Path::new(&path)),
        None => Config::load(None),
    }
    .unwrap_or_else(|e| fail(e));
    let sizes: Vec<usize> = (0..tensors).map(|i| SIZES[i % SIZES.len()]).collect();
    let total: usize = sizes.iter().sum();
    // Touched before timing: the first registration of untouched pages would pay for
    // faulting them in, and whichever setting ran first would look slow.
    let mut memory = vec![1u8; total];
    let base_ptr = memory.as_mut_ptr();
    let offsets: Vec<usize> = sizes
        .iter()
        .scan(0, |at, &s| {
            let o = *at;
            *at += s;
            Some(o)
        })
        .collect();
    println!(
        "reg-bench: {tensors} tensors, {} MiB, backend {}",
        total >> 20,
        base.backend
    );
    let mut results = Vec::new();
    for cache in [false, true] {
        let mut config = base.clone();
        config.memory.registration_cache = cache;
        let engine = TransferEngine::open(&config).unwrap_or_else(|e| fail(e));
        let registered = |e: &TransferEngine| {
            e.stats()
                .unwrap_or_else(|e| fail(e))
                .registrations
                .registered
        };
        let mut handles: Vec<MrHandle> = Vec::new();
        let mut phases = Vec::new();
        let mut phase =
            |name: &'static str, handles: &mut Vec<MrHandle>, work: &dyn Fn(&mut Vec<MrHandle>)| {
                let before = registered(&engine);
                let start = Instant::now();
                work(handles);
                let ms = start.elapsed().as_secs_f64() * 1e3;
                phases.push((name, ms, registered(&engine) - before));
            };
        let register_all = |handles: &mut Vec<MrHandle>| {
            for (&off, &len) in offsets.iter().zip(&sizes) {
                // SAFETY: `memory` outlives the engine's registrations (all deregistered below).
                #[allow(unsafe_code)]
                let (h, _) = unsafe { engine.reg_mr(base_ptr.add(off), len, Device::Host) }
                    .unwrap_or_else(|e| fail(e));
                handles.push(h);
            }
        };
        let dereg_all = |handles: &mut Vec<MrHandle>| {
            for h in handles.drain(..) {
                engine.dereg_mr(h).unwrap_or_else(|e| fail(e));
            }
        };
        phase("first", &mut handles, &register_all);
        phase("again", &mut handles, &register_all);
        phase("dereg", &mut handles, &dereg_all);
        phase("views", &mut handles, &|handles: &mut Vec<MrHandle>| {
            // SAFETY: as above.
            #[allow(unsafe_code)]
            let (whole, _) =
                unsafe { engine.reg_mr(base_ptr, total, Device::Host) }.unwrap_or_else(|e| fail(e));
            handles.push(whole);
            register_all(handles);
        });
        phase("dereg", &mut handles, &dereg_all);
        results.push(phases);
    }
    println!("phase   off_ms     on_ms   off/on  registrations off/on");
    for (off, on) in results[0].iter().zip(&results[1]) {
        println!(
            "{:<6} {:>8.2} {:>8.2} {:>8.1}  {:>6}/{}",
            off.0,
            off.1,
            on.1,
            off.1 / on.1.max(1e-6),
            off.2,
            on.2
        );
    }
    drop(memory);
}
