//! The handshake transport's datagram slots: which send slots are in use, the UD QP's
//! generation carried in every work-request id, and the resets after a UD error. Pure; `ffi`
//! posts and polls what this decides.
//!
//! One registered buffer holds [`UD_SLOTS`] send slots of [`UD_MSG`] bytes, then as many
//! receive slots of [`GRH`] + [`UD_MSG`] bytes (a UD receive starts with the 40 bytes of the
//! packet's global route header, whether or not the packet had one).
//!
//! A send slot is in use from its post to its completion, holding the address handle the send
//! goes through: it is never overwritten while the NIC may still read it. A UD error
//! completion puts the QP into the error state (soft-RoCE does so under load); it is then
//! reset (keeping its QPN: peers know it) and brought up again, and starts a new generation.
//! Work-request ids carry the generation, so a completion of the previous generation is
//! recognised and ignored: it neither frees a slot nor reposts into the new generation's
//! receives.

use std::ops::Range;

use verbs_sys::{TAG_MASK, TAG_UD_RECV, TAG_UD_SEND};

/// Send slots, and receive slots: the handshake QP's send and receive queue depths.
pub(crate) const UD_SLOTS: usize = 64;
/// The largest handshake datagram.
pub(crate) const UD_MSG: usize = 256;
/// What a UD receive holds ahead of the payload: the global route header's room.
pub(crate) const GRH: usize = 40;
/// One receive slot.
pub(crate) const RECV_SLOT: usize = GRH + UD_MSG;
/// The whole registered buffer: the send slots, then the receive slots.
pub(crate) const BUFFER_LEN: usize = UD_SLOTS * UD_MSG + UD_SLOTS * RECV_SLOT;

/// Where send slot `slot` starts in the buffer.
pub(crate) fn send_offset(slot: usize) -> usize {
    slot * UD_MSG
}

/// Where receive slot `slot` starts in the buffer.
pub(crate) fn recv_offset(slot: usize) -> usize {
    UD_SLOTS * UD_MSG + slot * RECV_SLOT
}

/// Where the payload of a receive of `byte_len` bytes (the GRH's room included) into slot
/// `slot` lies in the buffer: `None` if it carried nothing past the GRH; cut to [`UD_MSG`].
pub(crate) fn payload(slot: usize, byte_len: u32) -> Option<Range<usize>> {
    let len = (byte_len as usize).checked_sub(GRH).filter(|&n| n > 0)?;
    let start = recv_offset(slot) + GRH;
    Some(start..start + len.min(UD_MSG))
}

/// Whether a work-request id is one of the handshake QP's (a send or a receive).
pub(crate) fn is_ud(wr_id: u64) -> bool {
    matches!(wr_id & TAG_MASK, TAG_UD_SEND | TAG_UD_RECV)
}

/// What a completion of the handshake QP calls for.
#[derive(Debug, PartialEq, Eq)]
pub(crate) enum UdCompletion<H> {
    /// Of a previous generation: its slot was reclaimed at the reset; nothing to do.
    Stale,
    /// A send finished (or failed): its slot is free again and this is its handle to release
    /// (`None` if the slot was not in use).
    Sent(Option<H>),
    /// A receive into `slot`: `payload` is where its datagram lies in the buffer (`None`:
    /// failed, or empty), and `repost` whether the slot goes back on the queue now (not
    /// while the QP awaits its reset, which reposts every slot).
    Received {
        slot: usize,
        payload: Option<Range<usize>>,
        repost: bool,
    },
}

/// The handshake QP's slots and generation; `H` is what a send holds until it completes (its
/// address handle).
#[derive(Debug)]
pub(crate) struct UdSlots<H> {
    generation: u32,
    sending: Vec<Option<H>>,
    broken: bool,
    resets: u64,
}

impl<H> Default for UdSlots<H> {
    fn default() -> Self {
        Self {
            generation: 0,
            sending: std::iter::repeat_with(|| None).take(UD_SLOTS).collect(),
            broken: false,
            resets: 0,
        }
    }
}

impl<H> UdSlots<H> {
    /// The lowest free send slot, or `None` while every slot is still being sent (try again
    /// after polling).
    pub(crate) fn free_send_slot(&self) -> Option<usize> {
        self.sending.iter().position(Option::is_none)
    }

    /// The work-request id of a send from `slot` in this generation.
    pub(crate) fn send_wr_id(&self, slot: usize) -> u64 {
        self.wr_id(TAG_UD_SEND, slot)
    }

    /// The work-request id of a receive into `slot` in this generation.
    pub(crate) fn recv_wr_id(&self, slot: usize) -> u64 {
        self.wr_id(TAG_UD_RECV, slot)
    }

    fn wr_id(&self, tag: u64, slot: usize) -> u64 {
        debug_assert!(slot < UD_SLOTS);
        tag | (u64::from(self.generation) << 16) | slot as u64
    }

    /// A send from `slot` was posted, going through `handle`; the slot is in use until its
    /// completion. `slot` must be free (one [`Self::free_send_slot`] gave).
    pub(crate) fn sent(&mut self, slot: usize, handle: H) {
        debug_assert!(self.sending[slot].is_none(), "send slot {slot} is in use");
        self.sending[slot] = Some(handle);
    }

    /// A completion of the handshake QP (`is_ud(wr_id)`): `ok` whether it succeeded, and
    /// `byte_len` the bytes a receive got. A failure of this generation breaks the QP: see
    /// [`Self::needs_reset`].
    pub(crate) fn completed(&mut self, wr_id: u64, ok: bool, byte_len: u32) -> UdCompletion<H> {
        let generation = ((wr_id & !TAG_MASK) >> 16) as u32;
        if generation != self.generation {
            return UdCompletion::Stale;
        }
        if !ok {
            self.broken = true;
        }
        let slot = (wr_id & 0xffff) as usize % UD_SLOTS;
        if wr_id & TAG_MASK == TAG_UD_SEND {
            return UdCompletion::Sent(self.sending[slot].take());
        }
        UdCompletion::Received {
            slot,
            payload: if ok { payload(slot, byte_len) } else { None },
            repost: !self.broken,
        }
    }

    /// Whether a failed completion put the QP in the error state: once the poll's completions
    /// are read, it is reset ([`Self::reset_started`]) and brought up again
    /// ([`Self::reset_done`]).
    pub(crate) fn needs_reset(&self) -> bool {
        self.broken
    }

    /// The QP is in the RESET state (its sends in flight are lost: the handshake resends
    /// requests and answers repeated ones): every send slot is free again, a new generation
    /// starts, and these are the handles the lost sends held, to release.
    pub(crate) fn reset_started(&mut self) -> Vec<H> {
        self.generation = self.generation.wrapping_add(1);
        self.sending.iter_mut().filter_map(Option::take).collect()
    }

    /// The reset QP is up again with every receive slot posted in the new generation. Until
    /// then (a failed bring-up) the QP still needs a reset, tried again at the next poll.
    pub(crate) fn reset_done(&mut self) {
        self.broken = false;
        self.resets += 1;
    }

    /// How many times the QP was reset after an error.
    pub(crate) fn resets(&self) -> u64 {
        self.resets
    }

    /// Every handle still held (the QP is being destroyed).
    pub(crate) fn take_all(&mut self) -> Vec<H> {
        self.sending.iter_mut().filter_map(Option::take).collect()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    #[test]
    fn the_buffer_holds_every_slot_apart() {
        let mut ranges: Vec<Range<usize>> = (0..UD_SLOTS)
            .map(|s| send_offset(s)..send_offset(s) + UD_MSG)
            .chain((0..UD_SLOTS).map(|s| recv_offset(s)..recv_offset(s) + RECV_SLOT))
            .collect();
        ranges.sort_by_key(|r| r.start);
        assert_eq!(ranges[0].start, 0);
        for pair in ranges.windows(2) {
            assert_eq!(pair[0].end, pair[1].start, "slots overlap or leave a gap");
        }
        assert_eq!(ranges.last().unwrap().end, BUFFER_LEN);
    }

    #[test]
    fn a_payload_skips_the_grh_and_is_cut_to_a_slot() {
        assert_eq!(payload(0, 0), None);
        assert_eq!(payload(0, GRH as u32), None, "nothing past the GRH");
        let start = recv_offset(3) + GRH;
        assert_eq!(payload(3, GRH as u32 + 5), Some(start..start + 5));
        assert_eq!(payload(3, u32::MAX), Some(start..start + UD_MSG));
        let last = payload(UD_SLOTS - 1, (RECV_SLOT + 100) as u32).unwrap();
        assert_eq!(last.end, BUFFER_LEN);
    }

    #[test]
    fn ids_carry_tag_generation_and_slot() {
        let mut slots = UdSlots::<u8>::default();
        assert_eq!(slots.send_wr_id(5), TAG_UD_SEND | 5);
        assert_eq!(slots.recv_wr_id(7), TAG_UD_RECV | 7);
        slots.reset_started();
        assert_eq!(slots.send_wr_id(5), TAG_UD_SEND | (1 << 16) | 5);
        assert!(is_ud(slots.send_wr_id(5)) && is_ud(slots.recv_wr_id(0)));
        assert!(!is_ud(verbs_sys::TAG_SEND | 5));
        assert!(!is_ud(verbs_sys::TAG_IMM_RECV | 5));
        assert!(!is_ud(verbs_sys::TAG_MSG_RECV));
    }

    #[test]
    fn a_slot_is_busy_until_its_send_completes() {
        let mut slots = UdSlots::default();
        let first = slots.free_send_slot().unwrap();
        assert_eq!(first, 0);
        slots.sent(first, "ah0");
        assert_eq!(slots.free_send_slot(), Some(1));
        let id = slots.send_wr_id(first);
        assert_eq!(
            slots.completed(id, true, 0),
            UdCompletion::Sent(Some("ah0"))
        );
        assert_eq!(slots.free_send_slot(), Some(0));
        assert!(!slots.needs_reset());
        // A second completion of the same slot frees nothing more.
        assert_eq!(slots.completed(id, true, 0), UdCompletion::Sent(None));
    }

    #[test]
    fn every_slot_busy_refuses_a_send() {
        let mut slots = UdSlots::default();
        for i in 0..UD_SLOTS {
            let slot = slots.free_send_slot().unwrap();
            assert_eq!(slot, i);
            slots.sent(slot, i);
        }
        assert_eq!(slots.free_send_slot(), None);
        let id = slots.send_wr_id(17);
        assert_eq!(slots.completed(id, true, 0), UdCompletion::Sent(Some(17)));
        assert_eq!(slots.free_send_slot(), Some(17));
    }

    #[test]
    fn a_receive_is_delivered_and_reposted() {
        let mut slots = UdSlots::<()>::default();
        let id = slots.recv_wr_id(9);
        let start = recv_offset(9) + GRH;
        assert_eq!(
            slots.completed(id, true, GRH as u32 + 12),
            UdCompletion::Received {
                slot: 9,
                payload: Some(start..start + 12),
                repost: true
            }
        );
    }

    #[test]
    fn a_failure_breaks_the_qp_until_its_reset_is_done() {
        let mut slots = UdSlots::default();
        slots.sent(0, 'a');
        slots.sent(1, 'b');
        let (send0, send1) = (slots.send_wr_id(0), slots.send_wr_id(1));
        let (recv2, recv3) = (slots.recv_wr_id(2), slots.recv_wr_id(3));
        // A failed receive: nothing delivered, not reposted, the QP needs its reset.
        assert_eq!(
            slots.completed(recv2, false, 999),
            UdCompletion::Received {
                slot: 2,
                payload: None,
                repost: false
            }
        );
        assert!(slots.needs_reset());
        // Later completions of the same poll: a send still frees its slot; a good receive is
        // delivered but not reposted into the broken QP.
        assert_eq!(
            slots.completed(send0, false, 0),
            UdCompletion::Sent(Some('a'))
        );
        assert!(matches!(
            slots.completed(recv3, true, GRH as u32 + 1),
            UdCompletion::Received {
                slot: 3,
                payload: Some(_),
                repost: false
            }
        ));
        // The reset: what is still in use is released, and a new generation begins.
        assert_eq!(slots.reset_started(), vec!['b']);
        assert_eq!(slots.free_send_slot(), Some(0));
        assert!(slots.needs_reset(), "broken until the QP is up again");
        slots.reset_done();
        assert!(!slots.needs_reset());
        assert_eq!(slots.resets(), 1);
        // The old generation's completions are ignored, whatever they say.
        assert_eq!(slots.completed(send1, true, 0), UdCompletion::Stale);
        assert_eq!(slots.completed(recv2, false, 0), UdCompletion::Stale);
        assert!(!slots.needs_reset());
    }

    #[test]
    fn a_failed_bring_up_is_retried_in_yet_another_generation() {
        let mut slots = UdSlots::<()>::default();
        let old = slots.recv_wr_id(0);
        slots.completed(old, false, 0);
        slots.reset_started();
        // Bring-up failed: still broken; the next poll resets again.
        assert!(slots.needs_reset());
        let half = slots.recv_wr_id(0);
        slots.reset_started();
        slots.reset_done();
        assert_eq!(slots.completed(half, true, 60), UdCompletion::Stale);
        assert_eq!(slots.resets(), 1);
    }

    #[test]
    fn the_generation_wraps() {
        let mut slots = UdSlots::<()> {
            generation: u32::MAX,
            ..UdSlots::default()
        };
        let last = slots.send_wr_id(63);
        assert_eq!(last & TAG_MASK, TAG_UD_SEND);
        slots.reset_started();
        assert_eq!(slots.generation, 0);
        assert_eq!(slots.completed(last, true, 0), UdCompletion::Stale);
    }

    #[test]
    fn take_all_releases_every_handle() {
        let mut slots = UdSlots::default();
        slots.sent(4, 4);
        slots.sent(60, 60);
        let mut all = slots.take_all();
        all.sort();
        assert_eq!(all, vec![4, 60]);
        assert_eq!(slots.free_send_slot(), Some(0));
    }

    /// What the NIC may do next in the model below.
    #[derive(Debug, Clone)]
    enum Step {
        /// Post a send (when a slot is free).
        Send,
        /// Complete the `n`th outstanding send (if any), successfully or not.
        CompleteSend(usize, bool),
        /// Complete receive slot `n` of the current generation, or of an old one.
        CompleteRecv(usize, bool, bool),
        /// Complete a send of an old generation.
        StaleSend(usize),
        /// End of a poll: reset if broken (bring-up succeeding or not).
        EndOfPoll(bool),
    }

    fn step() -> impl Strategy<Value = Step> {
        prop_oneof![
            3 => Just(Step::Send),
            3 => (0..UD_SLOTS, proptest::bool::weighted(0.9)).prop_map(|(n, ok)| Step::CompleteSend(n, ok)),
            2 => (0..UD_SLOTS, proptest::bool::weighted(0.9), any::<bool>())
                .prop_map(|(n, ok, stale)| Step::CompleteRecv(n, ok, stale)),
            1 => (0..UD_SLOTS).prop_map(Step::StaleSend),
            1 => any::<bool>().prop_map(Step::EndOfPoll),
        ]
    }

    proptest! {
        /// Against a model NIC: a slot is never handed out while its send is outstanding,
        /// every handle is released exactly once, and a stale completion changes nothing.
        #[test]
        fn slots_are_never_handed_out_twice(steps in proptest::collection::vec(step(), 1..400)) {
            let mut slots = UdSlots::<u64>::default();
            // Outstanding sends in this generation: (wr_id, handle).
            let mut outstanding: Vec<(u64, u64)> = Vec::new();
            let mut old_ids: Vec<u64> = Vec::new();
            let mut next_handle = 0u64;
            let mut released: Vec<u64> = Vec::new();
            for step in steps {
                match step {
                    Step::Send => {
                        if let Some(slot) = slots.free_send_slot() {
                            let id = slots.send_wr_id(slot);
                            prop_assert!(outstanding.iter().all(|&(w, _)| w != id), "slot {} handed out twice", slot);
                            slots.sent(slot, next_handle);
                            outstanding.push((id, next_handle));
                            next_handle += 1;
                        } else {
                            prop_assert_eq!(outstanding.len(), UD_SLOTS);
                        }
                    }
                    Step::CompleteSend(n, ok) if !outstanding.is_empty() => {
                        let (id, handle) = outstanding.remove(n % outstanding.len());
                        prop_assert_eq!(slots.completed(id, ok, 0), UdCompletion::Sent(Some(handle)));
                        released.push(handle);
                    }
                    Step::CompleteSend(..) => {}
                    Step::CompleteRecv(slot, ok, stale) => {
                        let id = if stale {
                            match old_ids.get(slot % old_ids.len().max(1)) {
                                Some(&old) => (old & !TAG_MASK & !0xffff) | TAG_UD_RECV | slot as u64,
                                None => continue,
                            }
                        } else {
                            slots.recv_wr_id(slot)
                        };
                        let broken = slots.needs_reset();
                        let got = slots.completed(id, ok, 100);
                        if stale {
                            prop_assert_eq!(got, UdCompletion::Stale);
                            prop_assert_eq!(slots.needs_reset(), broken);
                        } else {
                            let repost = !broken && ok;
                            let is_received = matches!(got, UdCompletion::Received { slot: s, repost: r, .. } if s == slot && r == repost);
                            prop_assert!(is_received);
                        }
                    }
                    Step::StaleSend(slot) => {
                        let Some(&old) = old_ids.get(slot % old_ids.len().max(1)) else { continue };
                        let busy = slots.sending.iter().filter(|s| s.is_some()).count();
                        let broken = slots.needs_reset();
                        prop_assert_eq!(slots.completed(old, true, 0), UdCompletion::Stale);
                        prop_assert_eq!(slots.sending.iter().filter(|s| s.is_some()).count(), busy);
                        prop_assert_eq!(slots.needs_reset(), broken);
                    }
                    Step::EndOfPoll(up) => {
                        if slots.needs_reset() {
                            old_ids.extend(outstanding.iter().map(|&(w, _)| w));
                            old_ids.push(slots.send_wr_id(0));
                            let mut lost = slots.reset_started();
                            lost.sort_unstable();
                            let mut expected: Vec<u64> = outstanding.drain(..).map(|(_, h)| h).collect();
                            expected.sort_unstable();
                            prop_assert_eq!(&lost, &expected);
                            released.extend(lost);
                            if up {
                                slots.reset_done();
                            }
                        }
                    }
                }
            }
            released.extend(slots.take_all());
            released.sort_unstable();
            prop_assert_eq!(released.len(), next_handle as usize, "a handle leaked");
            released.dedup();
            prop_assert_eq!(released.len(), next_handle as usize, "a handle released twice");
        }
    }
}
