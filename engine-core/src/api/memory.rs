//! Registering memory: checks on the caller's thread, the round trip to the worker, and the
//! table of this engine's regions that transfers are validated against.

use super::*;

/// A region on this side, as the caller's thread validates against it.
#[derive(Debug, Clone)]
pub(super) struct LocalRegion {
    pub(super) ptr: u64,
    pub(super) len: u64,
    /// One registration per NIC, in NIC order.
    pub(super) keys: Vec<Registration>,
    /// Where the registration the keys belong to starts (`ptr` unless shared).
    pub(super) base: u64,
    /// The registration cache's id for the registration, if cached.
    pub(super) cache_id: Option<u64>,
}

type RegistrationCache = crate::regcache::RegistrationCache<Vec<Registration>>;

fn lock_cache(cache: &Mutex<RegistrationCache>) -> std::sync::MutexGuard<'_, RegistrationCache> {
    cache.lock().unwrap_or_else(|p| p.into_inner())
}

impl TransferEngine {
    pub(super) fn register(
        &self,
        ptr: *mut u8,
        len: usize,
        device: Device,
        access: RemoteAccess,
    ) -> Result<(MrHandle, LocalRegion)> {
        if ptr.is_null() || len == 0 {
            return Err(Error::InvalidArgument(format!(
                "cannot register {len} bytes at {ptr:?}: the region must be non-null and non-empty"
            )));
        }
        let region = MemoryRegion {
            ptr: ptr as u64,
            len: len as u64,
            device,
            remote_write: access.write,
            remote_read: access.read,
        };
        // Wrong memory kinds are caught here, before any NIC sees them: a device pointer
        // passed as host memory, host memory (or another GPU's) passed as a device's, a range
        // across two allocations, a device that does not exist.
        match device {
            Device::Host => xfer_cuda::check_host_range(region.ptr),
            Device::Cuda(i) => xfer_cuda::check_device_range(region.ptr, region.len, i),
        }
        .map_err(Error::InvalidArgument)?;
        let kind = (device, access.write, access.read);
        let cache = self.shared.registrations.as_ref();
        let hit = cache.and_then(|c| lock_cache(c).acquire(kind, region.ptr, region.len));
        let local = match hit {
            Some(hit) => {
                self.shared
                    .registration_cache_hits
                    .fetch_add(1, Ordering::Relaxed);
                LocalRegion {
                    ptr: region.ptr,
                    len: region.len,
                    keys: hit.value,
                    base: hit.base,
                    cache_id: Some(hit.id),
                }
            }
            None => {
                let keys = self.control("reg_mr", |reply| Command::Register { region, reply })?;
                let cache_id = cache.map(|c| {
                    lock_cache(c)
                        .insert(kind, region.ptr, region.len, keys.clone())
                        .id
                });
                LocalRegion {
                    ptr: region.ptr,
                    len: region.len,
                    keys,
                    base: region.ptr,
                    cache_id,
                }
            }
        };
        let handle = MrHandle {
            engine: self.id,
            id: self.next_id.fetch_add(1, Ordering::Relaxed),
        };
        self.regions
            .write()
            .unwrap_or_else(|p| p.into_inner())
            .insert(handle.id, Arc::new(local.clone()));
        Ok((handle, local))
    }

    /// Registers `len` bytes at `ptr` on every NIC; returns the local handle and the
    /// descriptor to give peers so they can write here.
    ///
    /// # Safety
    /// The memory must stay allocated until [`dereg_mr`](Self::dereg_mr) returns, and while it
    /// is registered peers may write into it at any time: read it only after the writes you
    /// wait for have been counted (an `expect_imm_count` or the writer's own signal).
    pub unsafe fn reg_mr(
        &self,
        ptr: *mut u8,
        len: usize,
        device: Device,
    ) -> Result<(MrHandle, MrDesc)> {
        self.register_remote(ptr, len, device, RemoteAccess::WRITE)
    }

    /// Registers `len` bytes at `ptr` on every NIC with the remote access given — e.g.
    /// [`RemoteAccess::READ`] for a region peers pull from with
    /// [`submit_single_read`](Self::submit_single_read) (a prefill node's KV cache) — and
    /// returns the handle and the descriptor for peers. A peer's access the region was not
    /// registered for fails at the peer's NIC as a remote access error, nothing transferred.
    ///
    /// # Safety
    /// As for [`reg_mr`](Self::reg_mr): the memory stays allocated until `dereg_mr` returns,
    /// and peers may read or write it (as allowed) at any time meanwhile.
    pub unsafe fn reg_mr_with(
        &self,
        ptr: *mut u8,
        len: usize,
        device: Device,
        access: RemoteAccess,
    ) -> Result<(MrHandle, MrDesc)> {
        self.register_remote(ptr, len, device, access)
    }

    /// What `reg_mr` and `reg_mr_with` do (their contract is the callers').
    pub(super) fn register_remote(
        &self,
        ptr: *mut u8,
        len: usize,
        device: Device,
        access: RemoteAccess,
    ) -> Result<(MrHandle, MrDesc)> {
        if !access.write && !access.read {
            return Err(Error::InvalidArgument(
                "a region peers can neither read nor write has no descriptor: use reg_mr_local"
                    .into(),
            ));
        }
        let (handle, local) = self.register(ptr, len, device, access)?;
        let rkeys = self
            .addresses
            .iter()
            .cloned()
            .zip(local.keys.iter().map(|k| k.remote_key))
            .collect();
        let desc = MrDesc::new(local.ptr, local.len, rkeys)
            .and_then(|d| d.within_registration_at(local.base))
            .map(|d| d.with_access(Some(access)))
            .map_err(|source| Error::Decode {
                what: "MrDesc",
                source,
            })?;
        Ok((handle, desc))
    }

    /// Registers memory only as a source of writes (peers get no key to it).
    ///
    /// # Safety
    /// The memory must stay allocated until [`dereg_mr`](Self::dereg_mr) returns.
    pub unsafe fn reg_mr_local(
        &self,
        ptr: *mut u8,
        len: usize,
        device: Device,
    ) -> Result<MrHandle> {
        Ok(self.register(ptr, len, device, RemoteAccess::NONE)?.0)
    }

    /// Deregisters a region on every NIC.
    ///
    /// **Whatever it returns, no NIC touches the memory after it returns**: it waits for the
    /// worker however long that takes (no timeout), and if the worker failed or the engine
    /// shut down, the Domains were closed before this returns. An error only says that some
    /// NIC reported a failure while deregistering (logged) or that the handle is unknown.
    /// Writes of this engine still in flight from the region may fail.
    ///
    /// With `[memory] registration_cache` (the default), handles whose ranges one NIC
    /// registration covers share it ([`crate::regcache`]): the keys are revoked, and the
    /// guarantee above applies, when the last of them is deregistered.
    pub fn dereg_mr(&self, handle: MrHandle) -> Result<()> {
        // Before the handle is forgotten: on the worker's own thread the caller must keep
        // its memory (see `dereg_mr_keeping`).
        self.shared.check_not_on_worker("dereg_mr")?;
        self.forget_region(handle, None)
    }

    /// [`dereg_mr`](Self::dereg_mr) for an owner of the memory that may be dropped on the
    /// worker's own thread (a `HostBuffer` inside a flag's waker): there the deregistration
    /// is queued for the worker's next pass and `keep` — what owns the memory — is dropped
    /// only after it; anywhere else this is `dereg_mr`, and `keep` is dropped on return.
    /// Either way a deregistration that failed keeps (leaks) `keep`: the registration may
    /// still be live.
    pub(crate) fn dereg_mr_keeping(
        &self,
        handle: MrHandle,
        keep: Box<dyn std::any::Any + Send>,
    ) -> Result<()> {
        if self.shared.on_worker_thread() {
            return self.forget_region(handle, Some(keep));
        }
        let result = self.dereg_mr(handle);
        match &result {
            Ok(()) | Err(Error::UnknownHandle(_) | Error::ForeignHandle { .. }) => drop(keep),
            // A deregistration that failed (a Domain refused it, or one was abandoned while
            // closing) may have left the registration live: the memory is kept (leaked).
            Err(_) => std::mem::forget(keep),
        }
        result
    }

    /// Forgets `handle` and deregisters it: waiting for the worker, or — with `keep`, on the
    /// worker's thread — queued behind the pass it is in, `keep` freed after it.
    fn forget_region(
        &self,
        handle: MrHandle,
        keep: Option<Box<dyn std::any::Any + Send>>,
    ) -> Result<()> {
        self.check_owner("memory region", handle.engine, handle.id)?;
        let region = self
            .regions
            .write()
            .unwrap_or_else(|p| p.into_inner())
            .remove(&handle.id)
            .ok_or(Error::UnknownHandle(handle.id))?;
        if let (Some(id), Some(cache)) = (region.cache_id, &self.shared.registrations) {
            let last = lock_cache(cache).release(id).is_some();
            if !last {
                // Other handles still use the registration: it stays until the last goes.
                return Ok(());
            }
        }
        let keys = region.keys.iter().map(|k| k.local_key).collect();
        if let Some(keep) = keep {
            if self.shared.domains_abandoned() {
                // Pushed now, it could outlive the worker's last drain and be freed with the
                // queue; an abandoned Domain may still hold the registration.
                std::mem::forget(keep);
                return Err(crate::runtime::Shared::abandoned_error());
            }
            // Queued whatever state the engine is in: served next pass, or refused after the
            // Domains closed (the shutdown and failure paths close them before draining), or
            // dropped with the engine's last handle, after the worker ended.
            let (reply, _) = crossbeam_channel::bounded(1);
            self.shared.push_for_worker(Command::Deregister {
                keys,
                reply,
                keep: Some(keep),
            });
            return Ok(());
        }
        match self.control_until_done("dereg_mr", |reply| Command::Deregister {
            keys,
            reply,
            keep: None,
        }) {
            // The engine is closing or failed: the worker closes its Domains (it always does
            // once it takes the shutdown or fails); closed Domains hold no registrations, so
            // the guarantee holds from then on — and not before (issue 53: a write in flight
            // landed after an early `Ok`).
            Err(Error::Shutdown | Error::WorkerFailed(_)) => {
                self.shared.wait_domains_closed();
                if self.shared.domains_abandoned() {
                    return Err(crate::runtime::Shared::abandoned_error());
                }
                Ok(())
            }
            other => other,
        }
    }

    pub(super) fn check_owner(&self, what: &'static str, owner: u32, id: u64) -> Result<()> {
        if owner == self.id {
            Ok(())
        } else {
            Err(Error::ForeignHandle {
                what,
                id,
                owner,
                this: self.id,
            })
        }
    }

    pub(super) fn local_region(&self, handle: MrHandle) -> Result<Arc<LocalRegion>> {
        self.check_owner("memory region", handle.engine, handle.id)?;
        // A match, not `ok_or`: that builds (and drops) the error on every submit.
        match self
            .regions
            .read()
            .unwrap_or_else(|p| p.into_inner())
            .get(&handle.id)
        {
            Some(region) => Ok(Arc::clone(region)),
            None => Err(Error::UnknownHandle(handle.id)),
        }
    }
}
