//! The callback thread: runs user callbacks in the order the worker finished them.

use std::thread::JoinHandle;

use crossbeam_channel::{Receiver, Sender};

use super::completion::{run_contained, Job};

/// Starts the callback thread; it ends after running every job queued before a `None`.
pub(crate) fn spawn_callback_thread(
    name: String,
) -> std::io::Result<(Sender<Job>, JoinHandle<()>)> {
    let (tx, rx): (Sender<Job>, Receiver<Job>) = crossbeam_channel::unbounded();
    let handle = std::thread::Builder::new().name(name).spawn(move || {
        while let Ok(Some(job)) = rx.recv() {
            // A panicking callback is the caller's bug; it must not take the engine's other
            // callbacks down with it.
            run_contained(job);
        }
    })?;
    Ok((tx, handle))
}
