//! Counted arrivals on the receiver (the ImmCounter) and expectations that time out.

use super::*;

/// Arrivals counted before the expectation, after it, and interleaved with other immediates
/// are all counted exactly; the pollable count agrees.
pub fn imm_counts(h: &dyn Harness) {
    let config = quick_config(h, 1);
    let (a, b) = (open(&config), open(&config));
    let src = buffer(&a, 64, pattern(1));
    let dst = buffer(&b, 64, |_| 0);
    let writes = DoneCounter::new();
    for i in 0..10 {
        let imm = if i % 2 == 0 { 1 } else { 2 };
        a.submit_single_write(8, Some(imm), (src.mr(), 0), (dst.desc(), 8), writes.clone())
            .or_fail("posting it");
    }
    writes
        .wait_for(10, WAIT)
        .or_fail("the 10 writes' completions");
    let deadline = Instant::now() + WAIT;
    while b.imm_count(1) + b.imm_count(2) < 10 && Instant::now() < deadline {
        std::thread::sleep(Duration::from_millis(1));
    }
    assert_eq!((b.imm_count(1), b.imm_count(2)), (5, 5), "pollable counts");
    // Met at once by arrivals already counted; consumes 3 of 5.
    expect_arrivals(&b, 1, 3)
        .wait(WAIT)
        .or_fail("3 arrivals of immediate 1");
    assert_eq!(b.imm_count(1), 2);
    // Needs 4 more than the 2 left: met only after they arrive.
    let later = expect_arrivals(&b, 1, 6);
    assert!(!later.is_done());
    for _ in 0..4 {
        a.submit_single_write(8, Some(1), (src.mr(), 0), (dst.desc(), 0), writes.clone())
            .or_fail("posting it");
    }
    later.wait(WAIT).or_fail("the 5th arrival of immediate 2");
    assert_eq!((b.imm_count(1), b.imm_count(2)), (0, 5));
}

/// An expectation nobody meets fails with `Timeout`, and the count stays usable.
pub fn expectation_times_out(h: &dyn Harness) {
    let mut config = quick_config(h, 1);
    config.timeouts.expect_ms = 200;
    let b = open(&config);
    let start = Instant::now();
    let f = expect_arrivals(&b, 5, 1);
    assert!(matches!(f.wait(WAIT), Err(Error::Timeout(_))));
    assert!(
        start.elapsed() < Duration::from_secs(5),
        "the deadline was honoured"
    );
}
