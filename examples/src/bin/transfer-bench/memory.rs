//! `--queue-memory N`: the resident memory each queued operation costs.

use super::*;

/// Resident memory of this process, in bytes.
pub(crate) fn resident_bytes() -> Option<u64> {
    let status = std::fs::read_to_string("/proc/self/status").ok()?;
    let line = status.lines().find(|l| l.starts_with("VmRSS:"))?;
    let kib: u64 = line.split_whitespace().nth(1)?.parse().ok()?;
    Some(kib * 1024)
}

/// `--queue-memory N`: what N outstanding operations cost, held by a mock NIC that lands
/// nothing for two seconds (so they stay queued in the engine and the fabric).
pub(crate) fn queue_memory(n: usize) -> Result<(), BoxError> {
    let text = format!(
        "backend = \"mock\"\n[[groups]]\nnics = [\"mock0\"]\n[worker]\nmax_outstanding = {}\n[timeouts]\ntransfer_ms = 60000\n[backends.mock]\ndelay_us = 2000000\njitter_us = 0\n",
        n.max(1)
    );
    let config = Config::from_toml(&text, std::path::Path::new("<queue-memory>"))?;
    let a = Arc::new(TransferEngine::open(&config)?);
    let b = Arc::new(TransferEngine::open(&config)?);
    let src = HostBuffer::new(&a, 64)?;
    let dst = HostBuffer::new(&b, 64)?;
    let done = DoneCounter::new();
    let before = resident_bytes().ok_or("no /proc/self/status")?;
    for _ in 0..n {
        a.submit_single_write(64, Some(1), (src.mr(), 0), (dst.desc(), 0), done.clone())?;
    }
    // Let the worker take them all off the submission queue and post them.
    std::thread::sleep(Duration::from_millis(500));
    let after = resident_bytes().ok_or("no /proc/self/status")?;
    println!(
        "{n} queued 64-byte writes: resident memory grew {} KiB, {:.0} bytes per queued operation (engine + mock fabric)",
        after.saturating_sub(before) / 1024,
        after.saturating_sub(before) as f64 / n.max(1) as f64
    );
    wait(&done, n as u64)?;
    Ok(())
}
