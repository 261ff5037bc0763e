//! The completion queue's policy: how many entries it needs and when it grows (`CqBudget`),
//! and its completions as the Domain reads them (`Wc`, routed by work-request tag). Pure;
//! `ffi` resizes and polls what this decides.

use verbs_sys::{TAG_IMM_RECV, TAG_MASK, TAG_MSG_RECV};

use crate::ud::UD_MSG;

/// The CQ size assumed when the device does not say its `max_cqe`.
const DEFAULT_MAX_CQE: i32 = 1 << 22;

/// `ENOSPC`: the device's largest CQ cannot hold a reservation.
pub(crate) const ENOSPC: i32 = 28;

/// How much of the device's CQ is reserved, and how large it is.
///
/// The CQ is sized from what can be outstanding on it: the receives (both SRQs, the UD QP)
/// at setup, plus what each RC QP reserved while it exists — the work requests its owner lets
/// it have outstanding, not its send queue's depth. A reservation past the CQ's capacity grows
/// it (at least doubling, so growth is rare, up to the device's `max_cqe`); one past
/// `max_cqe` is refused rather than risking an overrun.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) struct CqBudget {
    /// The CQ's entries now (what the device made of the size asked).
    capacity: i32,
    /// What is reserved of it.
    reserved: i64,
    /// The device's largest CQ.
    max_cqe: i32,
    /// Test fault: the CQ keeps its size whatever is reserved, so it can overrun.
    fixed: bool,
}

impl CqBudget {
    /// Before the CQ exists, on a device whose `max_cqe` is `reported` (0 or less: unknown).
    pub(crate) fn new(reported: i32) -> Self {
        Self {
            capacity: 0,
            reserved: 0,
            max_cqe: if reported > 0 {
                reported
            } else {
                DEFAULT_MAX_CQE
            },
            fixed: false,
        }
    }

    /// The size to create the CQ with when `wanted` entries are needed (the device's largest
    /// at most).
    pub(crate) fn initial_size(&self, wanted: i32) -> i32 {
        wanted.min(self.max_cqe)
    }

    /// The CQ was created for `size` entries (reserved from now on) and has `capacity`.
    pub(crate) fn created(&mut self, size: i32, capacity: i32) {
        self.capacity = capacity;
        self.reserved = i64::from(size);
    }

    /// Test fault: the CQ never grows again.
    pub(crate) fn fix(&mut self) {
        self.fixed = true;
    }

    /// Reserves `entries` more, growing the CQ through `resize` (given the size to ask for,
    /// it returns the capacity the device made, or an errno) when they do not fit. `Err`:
    /// [`ENOSPC`] past the device's `max_cqe`, or the resize's errno; nothing is reserved
    /// then.
    pub(crate) fn reserve(
        &mut self,
        entries: i64,
        resize: impl FnOnce(i32) -> Result<i32, i32>,
    ) -> Result<(), i32> {
        let need = self.reserved + entries;
        if self.fixed {
            self.reserved = need;
            return Ok(());
        }
        if need > i64::from(self.max_cqe) {
            return Err(ENOSPC);
        }
        if need > i64::from(self.capacity) {
            let doubled = i64::from(self.capacity) * 2;
            let size = if need > doubled {
                need
            } else {
                doubled.min(i64::from(self.max_cqe))
            };
            // need <= max_cqe, so size fits an i32.
            self.capacity = resize(size as i32)?;
        }
        self.reserved = need;
        Ok(())
    }

    /// `entries` reserved earlier are free again (their QP is gone, or was never made).
    pub(crate) fn release(&mut self, entries: i64) {
        self.reserved -= entries;
    }

    /// The CQ's capacity now, and what is reserved of it (for errors and `xfer doctor`).
    pub(crate) fn state(&self) -> (i32, i64) {
        (self.capacity, self.reserved)
    }
}

/// A message or RC write completed (send, write or read).
pub(crate) const KIND_SEND_DONE: i32 = 0;
/// A receive of the message SRQ.
pub(crate) const KIND_RECV_MSG: i32 = 1;
/// A zero-length receive of the immediate SRQ.
pub(crate) const KIND_RECV_IMM: i32 = 2;
/// A handshake datagram, its bytes in [`Wc::data`].
pub(crate) const KIND_UD_RECV: i32 = 3;

/// A completion as the Domain reads it.
#[derive(Clone, Copy)]
pub(crate) struct Wc {
    pub(crate) wr_id: u64,
    /// `ibv_wc_status` (0: success).
    pub(crate) status: i32,
    /// One of the `KIND_*` constants.
    pub(crate) kind: i32,
    /// Bytes received (a handshake datagram's payload only); `0xdeadbeef` for a failure (the
    /// shim overwrites a failed completion's undefined fields so).
    pub(crate) byte_len: u32,
    /// The immediate of a [`KIND_RECV_IMM`] (host order; `0xdeadbeef` for a failure), 0 for
    /// other kinds.
    pub(crate) imm: u32,
    pub(crate) qp_num: u32,
    pub(crate) vendor_err: u32,
    /// A handshake datagram's bytes (the first `byte_len`).
    pub(crate) data: [u8; UD_MSG],
}

impl Default for Wc {
    fn default() -> Self {
        Self {
            wr_id: 0,
            status: 0,
            kind: 0,
            byte_len: 0,
            imm: 0,
            qp_num: 0,
            vendor_err: 0,
            data: [0; UD_MSG],
        }
    }
}

impl Wc {
    /// A completion of an RC QP or an SRQ, routed by its work-request id's tag (a failed
    /// completion defines no opcode); `imm` and `byte_len` as the shim read them (poisoned
    /// for a failure).
    pub(crate) fn routed(
        wr_id: u64,
        status: i32,
        byte_len: u32,
        imm: u32,
        qp_num: u32,
        vendor_err: u32,
    ) -> Self {
        let kind = match wr_id & TAG_MASK {
            TAG_IMM_RECV => KIND_RECV_IMM,
            TAG_MSG_RECV => KIND_RECV_MSG,
            _ => KIND_SEND_DONE,
        };
        Self {
            wr_id,
            status,
            kind,
            byte_len,
            imm: if kind == KIND_RECV_IMM { imm } else { 0 },
            qp_num,
            vendor_err,
            ..Self::default()
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    /// What a failed completion's undefined fields read as.
    const POISON: u32 = 0xdead_beef;

    fn created(max_cqe: i32, size: i32) -> CqBudget {
        let mut b = CqBudget::new(max_cqe);
        let size = b.initial_size(size);
        b.created(size, size);
        b
    }

    fn no_resize(size: i32) -> Result<i32, i32> {
        panic!("resized to {size} though the reservation fits")
    }

    #[test]
    fn an_unknown_max_cqe_is_assumed() {
        assert_eq!(CqBudget::new(0).initial_size(i32::MAX), DEFAULT_MAX_CQE);
        assert_eq!(CqBudget::new(-1).initial_size(100), 100);
        assert_eq!(CqBudget::new(1000).initial_size(5000), 1000);
    }

    #[test]
    fn the_created_size_is_reserved() {
        let mut b = CqBudget::new(1000);
        b.created(100, 127);
        assert_eq!(b.state(), (127, 100));
    }

    #[test]
    fn what_fits_takes_no_resize() {
        let mut b = created(1000, 100);
        b.release(30);
        assert_eq!(b.reserve(30, no_resize), Ok(()));
        assert_eq!(b.state(), (100, 100));
    }

    #[test]
    fn growth_at_least_doubles() {
        let mut b = created(1000, 100);
        let mut asked = None;
        b.reserve(1, |size| {
            asked = Some(size);
            Ok(size + 3) // a device rounds up
        })
        .unwrap();
        assert_eq!(asked, Some(200));
        assert_eq!(b.state(), (203, 101));
        // More than doubling: exactly what is needed.
        let mut b = created(1000, 100);
        b.reserve(250, |size| {
            asked = Some(size);
            Ok(size)
        })
        .unwrap();
        assert_eq!(asked, Some(350));
    }

    #[test]
    fn doubling_stops_at_max_cqe() {
        let mut b = created(150, 100);
        let mut asked = None;
        b.reserve(10, |size| {
            asked = Some(size);
            Ok(size)
        })
        .unwrap();
        assert_eq!(asked, Some(150));
        assert_eq!(b.state(), (150, 110));
    }

    #[test]
    fn past_max_cqe_is_refused_and_reserves_nothing() {
        let mut b = created(150, 100);
        assert_eq!(b.reserve(51, no_resize), Err(ENOSPC));
        assert_eq!(b.state(), (100, 100));
        assert_eq!(b.reserve(50, Ok), Ok(()), "exactly max_cqe still fits");
    }

    #[test]
    fn a_failed_resize_reserves_nothing() {
        let mut b = created(1000, 100);
        assert_eq!(b.reserve(5, |_| Err(12)), Err(12));
        assert_eq!(b.state(), (100, 100));
    }

    #[test]
    fn a_fixed_cq_never_grows_nor_refuses() {
        let mut b = created(150, 100);
        b.fix();
        assert_eq!(b.reserve(1000, no_resize), Ok(()));
        assert_eq!(b.state(), (100, 1100));
        b.release(1000);
        assert_eq!(b.state(), (100, 100));
    }

    #[test]
    fn completions_are_routed_by_tag() {
        let imm = Wc::routed(TAG_IMM_RECV | 3, 0, 0, 42, 7, 0);
        assert_eq!((imm.kind, imm.imm, imm.qp_num), (KIND_RECV_IMM, 42, 7));
        let msg = Wc::routed(TAG_MSG_RECV | 3, 0, 100, 42, 7, 0);
        assert_eq!((msg.kind, msg.imm, msg.byte_len), (KIND_RECV_MSG, 0, 100));
        let send = Wc::routed(verbs_sys::TAG_SEND | 9, 12, POISON, POISON, 7, 0x81);
        assert_eq!(
            (send.kind, send.imm, send.status, send.vendor_err),
            (KIND_SEND_DONE, 0, 12, 0x81)
        );
        let failed_imm = Wc::routed(TAG_IMM_RECV, 5, POISON, POISON, 7, 0);
        assert_eq!(failed_imm.imm, POISON);
    }

    proptest! {
        /// Whatever is reserved and released, in any order, with resizes that round up or
        /// fail: the reservation never passes max_cqe nor the CQ's capacity, a resize never
        /// asks past max_cqe nor shrinks the CQ, and what is released comes back exactly.
        #[test]
        fn reservations_never_exceed_max_cqe(
            max_cqe in 64..5000i32,
            initial in 1..6000i32,
            ops in proptest::collection::vec((0..800i64, any::<bool>(), 0..4i32, proptest::bool::weighted(0.9)), 1..60),
        ) {
            let mut b = CqBudget::new(max_cqe);
            let size = b.initial_size(initial);
            prop_assert!(size <= max_cqe);
            b.created(size, size);
            let mut held: Vec<i64> = Vec::new();
            for (entries, release, round_up, resize_ok) in ops {
                if release && !held.is_empty() {
                    let e = held.remove(entries as usize % held.len());
                    b.release(e);
                    continue;
                }
                let (capacity, before) = b.state();
                let result = b.reserve(entries, |asked| {
                    assert!(asked <= max_cqe, "asked {asked} past max_cqe {max_cqe}");
                    assert!(asked > capacity, "a resize to {asked} that does not grow {capacity}");
                    if resize_ok { Ok(asked + round_up) } else { Err(12) }
                });
                match result {
                    Ok(()) => held.push(entries),
                    Err(e) => {
                        prop_assert!(e == ENOSPC || e == 12);
                        prop_assert_eq!(b.state().1, before);
                    }
                }
                let (capacity, reserved) = b.state();
                prop_assert!(reserved <= i64::from(max_cqe));
                prop_assert!(reserved <= i64::from(capacity));
                prop_assert_eq!(reserved, i64::from(size) + held.iter().sum::<i64>());
            }
        }
    }
}
