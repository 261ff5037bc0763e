//! Starting the worker: its thread, pinned, and the group's Domains opened on it.

use std::collections::VecDeque;
use std::sync::Arc;
use std::thread::JoinHandle;
use std::time::Duration;

use super::{run, Worker};
use crate::domain::{Capabilities, DomainConfig, Waker};
use crate::error::{Error, Result};
use crate::group::SpreadPolicy;
use crate::plugin::Backend;
use crate::runtime::clock::{Anchor, Stamp};
use crate::runtime::dispatch::Dispatch;
use crate::runtime::Shared;
use crate::wire::NetAddr;

/// What the engine keeps of its worker.
pub(crate) struct WorkerHandle {
    pub(crate) thread: JoinHandle<()>,
    pub(crate) addresses: Vec<NetAddr>,
    /// Whether every Domain supports RDMA READ.
    pub(crate) reads: bool,
    /// Each Domain's capabilities, in NIC order.
    pub(crate) caps: Vec<Capabilities>,
    /// The group's spread policy, for planning and counting on the callers' threads.
    pub(crate) spread: Arc<dyn SpreadPolicy>,
}

/// Starts the worker: pins it, then opens the group's Domains on it (so their memory is
/// allocated near the pinned CPU), and returns once they are open.
pub(crate) fn spawn_worker(
    shared: Arc<Shared>,
    backend: Backend,
    group: usize,
) -> Result<WorkerHandle> {
    type Ready = (Vec<NetAddr>, bool, Vec<Capabilities>, Arc<dyn SpreadPolicy>);
    let (ready_tx, ready_rx) = crossbeam_channel::bounded::<Result<Ready>>(1);
    let thread_shared = Arc::clone(&shared);
    let thread = std::thread::Builder::new()
        .name(format!("xfer-worker-{group}"))
        .spawn(move || {
            let shared = thread_shared;
            match open_domains(&shared, &backend, group) {
                Ok(worker) => {
                    let domains = worker.group.domains();
                    let addresses = domains.iter().map(|d| d.address()).collect();
                    let caps = worker.core.caps().to_vec();
                    let reads = caps.iter().all(|c| c.reads);
                    let spread = worker.group.spread();
                    let _ = ready_tx.send(Ok((addresses, reads, caps, spread)));
                    run(worker);
                }
                Err(e) => {
                    let _ = ready_tx.send(Err(e));
                }
            }
        })
        .map_err(|e| Error::backend_io(&shared.backend, "cannot spawn the worker thread", &e))?;
    shared.parking.set_worker(thread.thread().clone());
    let timeout =
        shared.config.timeouts.control() + Duration::from_millis(shared.config.timeouts.connect_ms);
    let (addresses, reads, caps, spread) = match ready_rx.recv_timeout(timeout) {
        Ok(Ok(a)) => a,
        Ok(Err(e)) => {
            let _ = thread.join();
            return Err(e);
        }
        Err(crossbeam_channel::RecvTimeoutError::Disconnected) => {
            // The thread ended without an answer: opening a Domain panicked (a backend bug).
            // Say so, rather than report a timeout that never elapsed.
            let why = match thread.join() {
                Err(panic) => crate::runtime::panic_message(&*panic),
                Ok(()) => "the worker ended while opening its NICs".to_owned(),
            };
            shared.close();
            return Err(Error::WorkerFailed(format!("opening the NICs: {why}")));
        }
        Err(crossbeam_channel::RecvTimeoutError::Timeout) => {
            // Still opening: tell it to stop as soon as it starts, so no orphan lives on.
            shared.push_shutdown();
            shared.close();
            return Err(Error::Timeout(timeout));
        }
    };
    Ok(WorkerHandle {
        thread,
        addresses,
        reads,
        caps,
        spread,
    })
}

fn open_domains(shared: &Arc<Shared>, backend: &Backend, group: usize) -> Result<Worker> {
    let config = &shared.config;
    let group_config = &config.groups[group];
    if let Some(cpu) = group_config.worker_cpu {
        if !core_affinity::set_for_current(core_affinity::CoreId { id: cpu }) {
            return Err(Error::InvalidArgument(format!(
                "cannot pin the worker of group {group} to CPU {cpu} (see groups[{group}].worker_cpu in {})",
                config.source.display()
            )));
        }
    }
    let options = config.backend_options();
    let mut domains = Vec::with_capacity(group_config.nics.len());
    // Queried once per Domain (a plugin's is a call through the ABI), checked here, kept.
    let mut caps: Vec<Capabilities> = Vec::with_capacity(group_config.nics.len());
    let mut domains_wake = true;
    for nic in &group_config.nics {
        let mut domain = backend
            .open(&DomainConfig {
                nic,
                options: &options,
            })
            .map_err(|mut e| {
                e.message = format!("cannot open NIC {nic:?}: {}", e.message);
                Error::Backend {
                    backend: shared.backend.clone(),
                    source: e,
                }
            })?;
        let (waking, asking) = (Arc::clone(&shared.parking), Arc::clone(&shared.parking));
        domains_wake &= domain.set_waker(Waker::with_parking(
            move || waking.wake(),
            move || asking.is_parked(),
        ));
        let declared = domain.capabilities();
        let address_len = domain.address().raw().len();
        if declared.max_address_len > crate::wire::MAX_ADDR_LEN
            || address_len > declared.max_address_len
        {
            return Err(Error::backend_other(
                &shared.backend,
                format!(
                    "NIC {nic:?}: the backend declares addresses of up to {} bytes and handed out one of {address_len}; the engine carries at most {}",
                    declared.max_address_len,
                    crate::wire::MAX_ADDR_LEN
                ),
            ));
        }
        domains.push(domain);
        caps.push(declared);
    }
    let needs_polling = caps.iter().any(|c| c.needs_receiver_polling);
    let nics = domains.len();
    let group = (backend.open_group())(domains, config).map_err(|mut e| {
        e.message = format!("cannot make the DomainGroup: {}", e.message);
        Error::Backend {
            backend: shared.backend.clone(),
            source: e,
        }
    })?;
    if group.domains().len() != nics {
        return Err(Error::backend_other(
            &shared.backend,
            format!(
                "the backend's DomainGroup has {} NICs; the config names {nics}",
                group.domains().len()
            ),
        ));
    }
    let anchor = Anchor::now();
    let core = Dispatch::new(
        shared.backend.clone(),
        caps,
        config.timeouts.transfer(),
        anchor,
    );
    Ok(Worker {
        shared: Arc::clone(shared),
        group,
        domains_wake,
        needs_polling,
        core,
        commands: VecDeque::new(),
        events: Vec::new(),
        imm_outcomes: Vec::new(),
        arrived: Vec::new(),
        callbacks: Vec::new(),
        stamp: Stamp::now(),
        anchor,
        poll_errors: 0,
    })
}
