//! The registration cache (issue 27): a `reg_mr` of a range a live registration of the same
//! kind covers shares it; the NIC registration goes with the last handle. The mock refuses a
//! write whose `remote_base` is not its registration's start (as a provider addressing by
//! offset would misplace it), so a shared registration's descriptor is checked end to end.

mod common;

use std::sync::Arc;
use std::time::Duration;

use common::mock_config;
use engine_core::{Device, DoneFlag, MrDesc, MrHandle, RemoteAccess, TransferEngine};
use xfer_conformance::buffer;

const WAIT: Duration = Duration::from_secs(20);

fn open(extra: &str) -> Arc<TransferEngine> {
    Arc::new(TransferEngine::open(&mock_config(1, extra)).unwrap())
}

/// Registers `buf[at..at + len]` for remote writes.
fn reg(engine: &TransferEngine, buf: &mut [u8], at: usize, len: usize) -> (MrHandle, MrDesc) {
    let slice = &mut buf[at..at + len];
    // SAFETY: each test keeps `buf` alive until after every dereg_mr of it.
    unsafe { engine.reg_mr(slice.as_mut_ptr(), len, Device::Host) }.unwrap()
}

fn nic_registrations(engine: &TransferEngine) -> usize {
    backend_mock::registrations(&engine.main_address()).unwrap()
}

/// Writes 64 bytes of `fill` from `a` to `desc` at `offset`.
fn write(a: &Arc<TransferEngine>, desc: &MrDesc, offset: u64, fill: u8) {
    let src = buffer(a, 64, move |_| fill);
    let done = DoneFlag::new();
    a.submit_single_write(64, None, (src.mr(), 0), (desc, offset), done.clone())
        .unwrap();
    done.wait(WAIT).unwrap();
}

#[test]
fn a_covered_range_shares_the_registration_until_the_last_dereg() {
    let (a, b) = (open(""), open(""));
    let base = nic_registrations(&b);
    let mut memory = vec![0u8; 1 << 16];
    let (whole, whole_desc) = reg(&b, &mut memory, 0, 1 << 16);
    let (view, view_desc) = reg(&b, &mut memory, 4096, 8192);
    let (again, _) = reg(&b, &mut memory, 0, 1 << 16);
    assert_eq!(
        nic_registrations(&b),
        base + 1,
        "one NIC registration for all three"
    );
    let stats = b.stats().unwrap().registrations;
    assert_eq!((stats.registered, stats.cache_hits), (1, 2));
    assert_eq!(
        view_desc.registration_base(),
        whole_desc.registration_base()
    );
    // A write at the view's offset 0 lands at the view's start (its remote_base is the shared
    // registration's: the mock refuses anything else).
    write(&a, &view_desc, 0, 0xab);
    assert!(memory[4096..4096 + 64].iter().all(|&x| x == 0xab));
    assert!(memory[..4096].iter().all(|&x| x == 0));
    // Deregistering two handles leaves the registration to the third.
    b.dereg_mr(whole).unwrap();
    b.dereg_mr(again).unwrap();
    assert_eq!(nic_registrations(&b), base + 1);
    write(&a, &view_desc, 64, 0xcd);
    assert!(memory[4096 + 64..4096 + 128].iter().all(|&x| x == 0xcd));
    b.dereg_mr(view).unwrap();
    assert_eq!(nic_registrations(&b), base, "the last dereg deregisters");
    assert_eq!(b.stats().unwrap().registrations.deregistered, 1);
}

#[test]
fn partial_overlaps_and_other_access_register_anew() {
    let b = open("");
    let base = nic_registrations(&b);
    let mut memory = vec![0u8; 1 << 16];
    let (first, _) = reg(&b, &mut memory, 0, 8192);
    let (overlapping, _) = reg(&b, &mut memory, 4096, 8192);
    let slice = &mut memory[0..4096];
    // SAFETY: `memory` outlives the registration.
    let (readable, _) =
        unsafe { b.reg_mr_with(slice.as_mut_ptr(), 4096, Device::Host, RemoteAccess::READ) }
            .unwrap();
    assert_eq!(nic_registrations(&b), base + 3);
    assert_eq!(b.stats().unwrap().registrations.cache_hits, 0);
    for h in [first, overlapping, readable] {
        b.dereg_mr(h).unwrap();
    }
    assert_eq!(nic_registrations(&b), base);
}

#[test]
fn with_the_cache_off_every_reg_mr_registers() {
    let b = open("[memory]\nregistration_cache = false\n");
    let base = nic_registrations(&b);
    let mut memory = vec![0u8; 8192];
    let (h1, _) = reg(&b, &mut memory, 0, 8192);
    let (h2, _) = reg(&b, &mut memory, 0, 4096);
    assert_eq!(nic_registrations(&b), base + 2);
    b.dereg_mr(h1).unwrap();
    assert_eq!(
        nic_registrations(&b),
        base + 1,
        "each dereg revokes at once"
    );
    b.dereg_mr(h2).unwrap();
}

/// Registrations and deregistrations of overlapping ranges from several threads at once,
/// each followed by a write through its descriptor: every write lands where it should, and
/// nothing stays registered at the end.
#[test]
fn concurrent_registrations_of_overlapping_ranges() {
    let (a, b) = (open(""), open(""));
    let base = nic_registrations(&b);
    const LEN: usize = 1 << 16;
    const QUARTER: usize = LEN / 4;
    let mut memory = vec![0u8; LEN];
    let ptr = memory.as_mut_ptr() as usize;
    // One long-lived registration of the whole buffer, so views hit the cache too.
    // SAFETY: `memory` outlives every registration (joined below).
    let (whole, _) = unsafe { b.reg_mr(ptr as *mut u8, LEN, Device::Host) }.unwrap();
    std::thread::scope(|s| {
        for t in 0..4usize {
            let (a, b) = (Arc::clone(&a), Arc::clone(&b));
            s.spawn(move || {
                let mut rng = fastrand::Rng::with_seed(t as u64);
                for round in 0..50 {
                    let at = t * QUARTER + rng.usize(..QUARTER - 4096);
                    let len = rng.usize(64..=4096);
                    // SAFETY: as above.
                    let (h, desc) =
                        unsafe { b.reg_mr((ptr + at) as *mut u8, len, Device::Host) }.unwrap();
                    let fill = (t * 50 + round) as u8;
                    write(&a, &desc, 0, fill);
                    // SAFETY: this thread's quarter is written only by this thread's writes,
                    // which completed.
                    let landed = unsafe { std::slice::from_raw_parts((ptr + at) as *const u8, 64) };
                    assert!(
                        landed.iter().all(|&x| x == fill),
                        "thread {t} round {round}"
                    );
                    b.dereg_mr(h).unwrap();
                }
            });
        }
    });
    b.dereg_mr(whole).unwrap();
    assert_eq!(nic_registrations(&b), base);
    let hits = b.stats().unwrap().registrations.cache_hits;
    assert_eq!(
        hits, 200,
        "every view lay inside the whole buffer's registration"
    );
    drop(memory);
}
