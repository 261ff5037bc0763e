//! Watcher slots: memory a GPU kernel (or a CPU producer) bumps to call back on this side.

use super::*;

impl TransferEngine {
    /// Allocates a watcher slot: a u64 that a producer (a GPU kernel through
    /// `Watcher::device_ptr`, or a CPU thread) bumps; `cb(old, new)` runs on the engine's
    /// pinned watcher thread at each change it sees (changes between two polls coalesce into
    /// one call; see the `uvm_watcher` crate). Return `Control::Stop` to free the slot. The
    /// callback may submit transfers: the typical use starts a layer's RDMA when the GPU
    /// signals the layer is computed.
    ///
    /// A callback that captures an `Arc` of this engine keeps it alive (engine → watcher pool
    /// → callback → engine) until it returns `Stop` or its slot is freed; use
    /// [`alloc_uvm_watcher_for`](Self::alloc_uvm_watcher_for) to be handed the engine instead.
    pub fn alloc_uvm_watcher(
        &self,
        cb: impl FnMut(u64, u64) -> uvm_watcher::Control + Send + 'static,
    ) -> Result<uvm_watcher::Watcher> {
        let pool = match self.watchers.get() {
            Some(p) => p,
            None => {
                let w = &self.shared.config.watcher;
                let pool = uvm_watcher::WatcherPool::new(uvm_watcher::PoolConfig {
                    cpu: w.cpu,
                    max_slots: w.max_slots,
                    memory: w.memory_choice().map_err(Error::InvalidArgument)?,
                    pass_interval_us: w.pass_interval_us,
                    ..uvm_watcher::PoolConfig::default()
                })?;
                // Another thread may have won the race; its pool is used and ours dropped.
                let _ = self.watchers.set(pool);
                self.watchers.get().expect("set above")
            }
        };
        Ok(pool.watch(cb)?)
    }

    /// Like [`alloc_uvm_watcher`](Self::alloc_uvm_watcher), but the callback is handed the
    /// engine (`cb(&engine, old, new)`) instead of capturing it: the slot holds the engine
    /// weakly, so dropping the caller's last `Arc` drops the engine (the slot then stops).
    pub fn alloc_uvm_watcher_for(
        self: &Arc<Self>,
        mut cb: impl FnMut(&Arc<TransferEngine>, u64, u64) -> uvm_watcher::Control + Send + 'static,
    ) -> Result<uvm_watcher::Watcher> {
        let weak = Arc::downgrade(self);
        self.alloc_uvm_watcher(move |old, new| match weak.upgrade() {
            Some(engine) => cb(&engine, old, new),
            None => uvm_watcher::Control::Stop,
        })
    }
}
