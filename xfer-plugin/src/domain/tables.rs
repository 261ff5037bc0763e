//! What every backend keeps besides its NIC: its local registrations (keys handed out, write
//! sources checked) and its message buffers (send buffers by size class, receive buffers
//! reused by length). Pure bookkeeping, generic over the backend's registration object.

use super::{DomainError, DomainErrorKind, MemoryRegion, Registration};

/// A Domain's local registrations: key → (range, the backend's registration object), so every
/// backend hands out keys and checks write sources the same way.
#[derive(Debug)]
pub struct RegionTable<M> {
    next_key: u64,
    regions: foldhash::HashMap<u64, (u64, u64, M)>,
}

impl<M> Default for RegionTable<M> {
    fn default() -> Self {
        Self {
            next_key: 1,
            regions: foldhash::HashMap::default(),
        }
    }
}

impl<M> RegionTable<M> {
    /// An empty table; keys start at 1.
    pub fn new() -> Self {
        Self::default()
    }

    /// A key no other registration of this table has (for providers that take the key
    /// before registering, and for the Domain's own buffers).
    pub fn next_key(&mut self) -> u64 {
        let key = self.next_key;
        self.next_key += 1;
        key
    }

    /// Records `region`'s registration under `key` and returns what the engine is told:
    /// the key, and `remote_key` if peers may write into the region (else 0).
    pub fn insert(
        &mut self,
        key: u64,
        region: &MemoryRegion,
        registration: M,
        remote_key: u64,
    ) -> Registration {
        self.regions
            .insert(key, (region.ptr, region.len, registration));
        Registration {
            local_key: key,
            remote_key: if region.remote_write || region.remote_read {
                remote_key
            } else {
                0
            },
        }
    }

    /// Removes a registration (dropping it deregisters, for RAII registrations).
    pub fn remove(&mut self, key: u64) -> Result<M, DomainError> {
        self.regions.remove(&key).map(|(_, _, m)| m).ok_or_else(|| {
            DomainError::new(
                DomainErrorKind::InvalidArgument,
                format!("local key {key} is not registered"),
            )
        })
    }

    /// The registration under `key`, if any.
    pub fn registration(&self, key: u64) -> Option<&M> {
        self.regions.get(&key).map(|(_, _, m)| m)
    }

    /// The registration a write's source must lie in: `[addr, addr + len)` inside region `key`.
    pub fn source(&self, key: u64, addr: u64, len: u64) -> Result<&M, DomainError> {
        let (base, size, m) = self.regions.get(&key).ok_or_else(|| {
            DomainError::new(
                DomainErrorKind::InvalidArgument,
                format!("local key {key} is not registered"),
            )
        })?;
        let inside = addr >= *base && addr.checked_add(len).is_some_and(|end| end <= base + size);
        if !inside {
            return Err(DomainError::new(
                DomainErrorKind::InvalidArgument,
                format!("source {addr:#x}+{len} is outside its region {base:#x}+{size}"),
            ));
        }
        Ok(m)
    }
}

/// The size class of a message buffer: powers of two from 256 bytes, so a Domain keeps a few
/// registered buffers per class for its sends instead of registering (and pinning) one per
/// message. Use with [`ReceivePool`], which reuses buffers by exact length.
pub fn message_size_class(len: usize) -> usize {
    len.max(256).next_power_of_two()
}

/// A Domain's receive buffers for messages: each with the backend's registration, reused
/// (by exact length) once its message has been handed over.
#[derive(Debug)]
pub struct ReceivePool<M> {
    buffers: Vec<(Box<[u8]>, M)>,
    free: Vec<usize>,
}

impl<M> Default for ReceivePool<M> {
    fn default() -> Self {
        Self {
            buffers: Vec::new(),
            free: Vec::new(),
        }
    }
}

impl<M> Drop for ReceivePool<M> {
    /// Each buffer's registration goes before its bytes: a NIC never holds a registration of
    /// memory already freed.
    fn drop(&mut self) {
        for (bytes, registration) in self.buffers.drain(..) {
            drop(registration);
            drop(bytes);
        }
    }
}

impl<M> ReceivePool<M> {
    /// An empty pool.
    pub fn new() -> Self {
        Self::default()
    }

    /// A free buffer of exactly `len` bytes, or a new one registered with `register` (which
    /// sees the buffer at the address it keeps for the pool's lifetime). Returns its index.
    pub fn take<E>(
        &mut self,
        len: usize,
        register: impl FnOnce(&mut [u8]) -> Result<M, E>,
    ) -> Result<usize, E> {
        if let Some(at) = self
            .free
            .iter()
            .position(|&b| self.buffers[b].0.len() == len)
        {
            return Ok(self.free.swap_remove(at));
        }
        let mut data = vec![0u8; len].into_boxed_slice();
        let registration = register(&mut data)?;
        self.buffers.push((data, registration));
        Ok(self.buffers.len() - 1)
    }

    /// Copies `data` to the start of buffer `index` (a send buffer being filled); false if it
    /// does not fit.
    pub fn fill(&mut self, index: usize, data: &[u8]) -> bool {
        match self.buffers.get_mut(index) {
            Some((buf, _)) if buf.len() >= data.len() => {
                buf[..data.len()].copy_from_slice(data);
                true
            }
            _ => false,
        }
    }

    /// Buffer `index`: its bytes' address and length, and its registration.
    pub fn get(&mut self, index: usize) -> (*mut u8, usize, &M) {
        let (data, m) = &mut self.buffers[index];
        (data.as_mut_ptr(), data.len(), m)
    }

    /// A copy of the first `len` bytes of buffer `index` (at most its length), which is then
    /// free for reuse.
    pub fn take_message(&mut self, index: usize, len: usize) -> Option<Vec<u8>> {
        let (data, _) = self.buffers.get(index)?;
        let message = data[..len.min(data.len())].to_vec();
        self.free.push(index);
        Some(message)
    }

    /// Puts buffer `index` back unused (its receive failed or was never posted).
    pub fn release(&mut self, index: usize) {
        if index < self.buffers.len() {
            self.free.push(index);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::domain::Device;

    #[test]
    fn region_table_checks_sources_and_keys() {
        let mut t = RegionTable::new();
        let key = t.next_key();
        let region = MemoryRegion {
            ptr: 0x1000,
            len: 0x100,
            device: Device::Host,
            remote_write: true,
            remote_read: false,
        };
        assert_eq!(
            t.insert(key, &region, "mr", 77),
            Registration {
                local_key: key,
                remote_key: 77
            }
        );
        let local_only = t.next_key();
        let region = MemoryRegion {
            ptr: 0x9000,
            len: 8,
            device: Device::Host,
            remote_write: false,
            remote_read: false,
        };
        assert_eq!(
            t.insert(local_only, &region, "local", 78).remote_key,
            0,
            "no remote key for a local-only region"
        );
        assert_eq!(t.source(key, 0x1000, 0x100), Ok(&"mr"));
        assert!(t
            .source(key, 0x10ff, 2)
            .unwrap_err()
            .message
            .contains("outside"));
        assert!(t.source(key, u64::MAX, 2).is_err());
        assert!(t
            .source(key + 100, 0x1000, 1)
            .unwrap_err()
            .message
            .contains("not registered"));
        assert_eq!(t.remove(key), Ok("mr"));
        assert!(t.remove(key).is_err());
        assert_ne!(t.next_key(), key, "keys are never reused");
    }

    #[test]
    fn receive_pool_reuses_buffers_of_the_same_length_only() {
        let mut p: ReceivePool<u32> = ReceivePool::new();
        let mut registered = 0;
        let a = p
            .take(8, |b| -> Result<u32, ()> {
                b[0] = 7;
                registered += 1;
                Ok(1)
            })
            .unwrap();
        let (_, len, reg) = p.get(a);
        assert_eq!((len, *reg), (8, 1));
        assert_eq!(
            p.take_message(a, 100),
            Some(vec![7, 0, 0, 0, 0, 0, 0, 0]),
            "capped at the buffer"
        );
        let b = p.take(16, |_| Ok::<_, ()>(2)).unwrap();
        assert_ne!(a, b, "a 16-byte request does not reuse the 8-byte buffer");
        let again = p
            .take(8, |_| -> Result<u32, ()> { panic!("must reuse") })
            .unwrap();
        assert_eq!((again, registered), (a, 1));
        assert_eq!(p.take(4, |_| Err("no memory")), Err("no memory"));
        p.release(b);
        assert_eq!(p.take(16, |_| Err("unused")), Ok(b));
        assert_eq!(p.take_message(99, 1), None);
    }
}
