//! The embedded rendezvous service's frames, which any host that can reach its port sends
//! before proving anything (and a client's, from whatever answers at the service's address):
//! never panics; a request read re-encodes to a frame that reads back the same; and reading
//! allocates no more than a bound over the bytes given, whatever lengths they announce.
#![no_main]

use std::alloc::{GlobalAlloc, Layout, System};
use std::sync::atomic::{AtomicUsize, Ordering};

use libfuzzer_sys::fuzz_target;
use xfer_rendezvous::embedded::fuzzing;

/// Counts the bytes Rust allocates (libFuzzer's own allocations do not pass through here).
struct Counting;

static LIVE: AtomicUsize = AtomicUsize::new(0);
static PEAK: AtomicUsize = AtomicUsize::new(0);

// SAFETY: forwards to `System` unchanged; only counts.
unsafe impl GlobalAlloc for Counting {
    unsafe fn alloc(&self, layout: Layout) -> *mut u8 {
        let live = LIVE.fetch_add(layout.size(), Ordering::Relaxed) + layout.size();
        PEAK.fetch_max(live, Ordering::Relaxed);
        // SAFETY: the caller's contract is `GlobalAlloc::alloc`'s, passed on.
        unsafe { System.alloc(layout) }
    }
    unsafe fn dealloc(&self, ptr: *mut u8, layout: Layout) {
        LIVE.fetch_sub(layout.size(), Ordering::Relaxed);
        // SAFETY: `ptr` came from `alloc` above with this layout.
        unsafe { System.dealloc(ptr, layout) }
    }
}

#[global_allocator]
static ALLOC: Counting = Counting;

/// What decoding may allocate beyond a multiple of the input: serde preallocates a vector
/// from its announced length only up to 1 MiB, once per nesting level in progress.
const SLACK: usize = 4 << 20;

fn allocated_during(f: impl FnOnce()) -> usize {
    let before = LIVE.load(Ordering::Relaxed);
    PEAK.store(before, Ordering::Relaxed);
    f();
    PEAK.load(Ordering::Relaxed).saturating_sub(before)
}

fuzz_target!(|data: &[u8]| {
    let bound = 4 * data.len() + SLACK;
    let mut frames = Vec::new();
    let used = allocated_during(|| frames = fuzzing::service_frames(data));
    assert!(used <= bound, "the service allocated {used} bytes reading {}", data.len());
    for frame in frames {
        assert_eq!(fuzzing::service_frames(&frame), vec![frame.clone()]);
    }
    let used = allocated_during(|| {
        fuzzing::client_frame(data);
    });
    assert!(used <= bound, "a client allocated {used} bytes reading {}", data.len());
});
