"""``EpGroup``: one rank of an expert-parallel group over a ``TransferEngine``. It owns four
registered regions (two buffer sets each) and carries out the protocol of
``xfer._xfer.EpStep`` (crate ``xfer-ep-plan``): writes with immediates, one expectation per
(step, phase, source), every wait with a deadline; a source that misses one is masked until
``clean()``.

A rank reuses a step's buffers two steps on, once its writes of that step are delivered. A
peer's own later writes prove delivery (its combine of the step, its header two steps on);
the local completion decides only where no such proof exists, so a provider that withholds
completions (libfabric shm behind a dead peer) does not mask live peers. A clean re-forms
the group: new registrations of the written regions (the membership before cannot write into
a later step), one agreed epoch, a restarted rank's new engine taken in. docs/moe.md,
"Failure".

The data path is numpy on host memory; ``xfer.ep.tensors`` puts torch tensors on it.

One file on purpose: membership (connect, clean, rejoin), the stages and the proofs of
delivery all read and write the same per-rank state — the active mask, the immediates owed to
the ImmCounter, the writes not yet proven, the registered regions and their epoch — and a
clean must reset exactly what the stages left; the protocol itself (the plan, deadlines,
masking) is the Rust ``StepMachine``'s, so what is here is that state and the engine calls."""

from __future__ import annotations

import time
from dataclasses import dataclass, field

import numpy as np

from .. import _errors
from .._xfer import EpStep, MrDesc
from .layout import EpConfig, columns

LAYOUTS = ("deepep", "flat")
_REGIONS = ("send", "dispatch", "combine_send", "combine")
# The bits of an immediate (``xfer-ep-plan``'s ``Imm``) that name the group's tag (top 4) and
# the posting rank (low 14), whatever the step and phase.
_SOURCE_FAMILY = 0xF000_3FFF
# (engine id, engine address, tag) of every group not closed: one group per tag per engine.
_TAGS_IN_USE: set = set()
# Epochs the immediate tells apart (``xfer-ep-plan``'s ``IMM_EPOCHS``: 12 bits).
IMM_EPOCHS = 1 << 12
# The planner's epochs are u32; a record may name one up to here, so that a group agreeing on
# the largest still has 2**20 steps before the counter would overflow.
MAX_EPOCH = (1 << 32) - (1 << 20)
# Bounds on what one rank's record may carry (a descriptor names one key per NIC).
_MAX_ADDRESS_BYTES = 1 << 10
_MAX_DESC_BYTES = 1 << 14


def agreed_epoch(epochs) -> int:
    """The epoch every rank takes at a clean: the largest any rank reached (no rank used it or
    any later one, so no late arrival of an earlier step carries it), rounded up to even, so
    that the first step of a membership uses buffer set 0, as after ``connect``."""
    epochs = list(epochs)
    if not epochs or any(type(e) is not int or not 0 <= e <= MAX_EPOCH for e in epochs):
        raise ValueError(f"epochs must be integers in 0..{MAX_EPOCH}, not {epochs[:8]}")
    top = max(epochs)
    return top + (top & 1)


def step_imm(tag: int, epoch: int, phase: int, source: int) -> int:
    """``xfer-ep-plan``'s immediate: ``tag:4 | epoch:12 | phase:2 | source:14``."""
    return ((tag & 0xF) << 28) | ((epoch % IMM_EPOCHS) << 16) | ((phase & 3) << 14) | (source & 0x3FFF)


def _bytes_of(a: np.ndarray) -> np.ndarray:
    """A C-contiguous array's bytes, as a flat uint8 view (what the binding's copies take)."""
    return a.reshape(-1).view(np.uint8)


class _Landed:
    """The expectation of a rank's write to itself: copied already, so landed."""

    @staticmethod
    def done() -> bool:
        return True

    @staticmethod
    def exception():
        return None


_LANDED = _Landed()


def _failure(t):
    """A finished write's error that counts as its peer's failure. The engine's own timeout
    (``timeouts.transfer_ms``) does not: it says only that no completion came, which a provider
    that holds completions back also says of a write that was delivered (the peer's later
    writes may still prove it)."""
    if not t.done():
        return None
    e = t.exception()
    return None if e is None or isinstance(e, _errors.TimeoutError) else e


class EpError(_errors.Error):
    """A step that cannot go on (the same on every rank): e.g. a routing past capacity."""


@dataclass
class Handle:
    """One step in flight: what ``dispatch_recv``, ``combine_send`` and ``combine_recv`` need.

    After ``combine_recv``: ``lost_slots`` lists ``token × top_k + slot`` whose output did not
    come back (routed to a masked rank or a rank that missed a deadline); the rest are exact."""

    step: EpStep
    epoch: int
    num_tokens: int
    layout: str | None = None
    # The weights were given at dispatch: combine returns one partial sum per (token, rank).
    weighted: bool = False
    token: np.ndarray = field(default=None)
    slot: np.ndarray = field(default=None)
    peer: np.ndarray = field(default=None)
    expects: dict = field(default_factory=dict)
    # This step's dispatch writes to other ranks, ``(peer, transfer)``, until proven delivered
    # or completed; ``overflow``: its dispatch B write to each peer (at most one).
    sends: list = field(default_factory=list)
    overflow: dict = field(default_factory=dict)
    # Its combine writes, likewise, until combine_recv hands them to the group.
    combine_sends: list = field(default_factory=list)
    lost_slots: np.ndarray | None = None
    stats: dict = field(default_factory=dict)


class HostMemory:
    """Where a group's regions live: host memory, registered as it is (the default).
    ``xfer.ep.gpu.DeviceMemory`` puts them in device memory, the NIC reading and writing there,
    with a host shadow the host stages go through: ``fetch`` before the host reads a range of a
    region, ``publish`` after it wrote one, ``copy`` for a rank's write to itself."""

    def register(self, engine, name: str, nbytes: int, access: str):
        # Poisoned, not zeroed: a row read before it was written is visibly wrong.
        region = np.full(nbytes, 0xA5, dtype=np.uint8)
        return region, engine.reg_mr(region, access=access)

    def fetch(self, regions: dict, name: str, lo: int, hi: int) -> None:
        pass

    def publish(self, regions: dict, name: str, lo: int, hi: int) -> None:
        pass

    def copy(self, regions: dict, dst: str, dst_off: int, src: str, src_off: int, n: int) -> None:
        regions[dst][dst_off:dst_off + n] = regions[src][src_off:src_off + n]

    def release(self, engine, name: str, mr) -> None:
        engine.dereg_mr(mr)


class EpGroup:
    """One rank's side of dispatch and combine.

    ``engine``: an open ``xfer.TransferEngine`` whose ``timeouts.expect_ms`` exceeds ten
    ``cfg.timeout`` (the group's own deadlines decide; the engine's must not come first).
    ``memory``: where the regions live (``HostMemory()``, or ``xfer.ep.gpu.DeviceMemory``).
    Exchange ``local_info()`` among the ranks by any channel, then ``connect(infos)``; after
    a failure, ``begin_clean()`` / ``clean(infos)`` on every rank re-forms the group (a
    restarted rank ``connect``s with the same records); ``xfer.ep.rendezvous`` does either
    through xfer's rendezvous."""

    def __init__(self, engine, rank: int, cfg: EpConfig, *, eplb=None, memory=None):
        if not 0 <= rank < cfg.ranks:
            raise ValueError(f"rank {rank} is not in 0..{cfg.ranks}")
        self.engine, self.rank, self.cfg = engine, rank, cfg
        # Two groups with one tag on one engine would count each other's arrivals (the same
        # immediates) and share one sender restriction per rank (review 56b L-9).
        self._tag_key = (id(engine), bytes(engine.main_address), cfg.tag)
        if self._tag_key in _TAGS_IN_USE:
            raise ValueError(f"this engine already has an EpGroup with tag {cfg.tag}: give each group on one engine its own EpConfig.tag")
        _TAGS_IN_USE.add(self._tag_key)
        self.eplb = [list(map(int, row)) for row in eplb] if eplb is not None else None
        sizes = cfg.region_bytes()
        self._set_bytes = {name: int(sizes[name]) for name in _REGIONS}
        self._header_bytes = int(sizes["header"])
        self._combine_header_bytes = int(sizes["combine_header"])
        self._memory = memory if memory is not None else HostMemory()
        self.regions, self._mrs = {}, {}
        for name in _REGIONS:
            access = "local" if name in ("send", "combine_send") else "write"
            self.regions[name], self._mrs[name] = self._memory.register(engine, name, 2 * self._set_bytes[name], access)
        self.active = [True] * cfg.ranks
        self._owed: list[int] = []
        # Epochs whose immediates may have arrived with nobody to count them (a step that
        # masked a rank, ran without one, or the two after it: see ``_stray_imms``).
        self._suspect: set[int] = set()
        # Between ``begin_clean`` and ``clean``: the written regions are new, the peers not yet.
        self._fenced = False
        # Combine writes of earlier steps not yet known delivered: ``(epoch, peer, transfer)``
        # (at most the last two steps': a peer's header two steps on proves them).
        self._unproven: list = []
        self.epoch = 0
        self.peers = None
        self._out = {}

    # -- membership -------------------------------------------------------------------------
    def local_info(self) -> dict:
        """What peers need: this engine's address, the two written regions and the epoch this
        rank would start its next step with (the ranks agree on one at ``connect`` and
        ``clean``)."""
        return {
            "rank": self.rank,
            "address": bytes(self.engine.main_address),
            "dispatch": bytes(self._mrs["dispatch"].desc),
            "combine": bytes(self._mrs["combine"].desc),
            "epoch": self.epoch,
        }

    def _checked(self, infos) -> list:
        """Every rank's record, as a peer sent it (untrusted): one per rank in rank order, each
        descriptor decodes, names the record's address as its owner and has the size this
        config registers, the epoch is an integer in range. Returns ``[(peer, epoch)]``."""
        cfg = self.cfg
        infos = list(infos)
        if len(infos) != cfg.ranks:
            raise ValueError(f"connect wants every rank's local_info, in rank order: {len(infos)} records for {cfg.ranks} ranks")
        checked = []
        for r, info in enumerate(infos):
            if not isinstance(info, dict) or info.get("rank") != r or type(info.get("rank")) is not int:
                raise ValueError(f"record {r}: not rank {r}'s local_info (connect wants them in rank order)")
            address = info.get("address")
            if not isinstance(address, bytes) or not 0 < len(address) <= _MAX_ADDRESS_BYTES:
                raise ValueError(f"rank {r}: address must be 1..{_MAX_ADDRESS_BYTES} bytes")
            peer = {}
            for name in ("dispatch", "combine"):
                raw = info.get(name)
                if not isinstance(raw, bytes) or not 0 < len(raw) <= _MAX_DESC_BYTES:
                    raise ValueError(f"rank {r}: the {name} descriptor must be 1..{_MAX_DESC_BYTES} bytes")
                try:
                    desc = MrDesc(raw)
                except (ValueError, _errors.Error) as e:
                    raise ValueError(f"rank {r}: the {name} descriptor does not decode: {e}") from None
                if desc.nbytes != 2 * self._set_bytes[name]:
                    raise ValueError(
                        f"rank {r}: its {name} region is {desc.nbytes} bytes, this config registers "
                        f"{2 * self._set_bytes[name]} (the ranks' EpConfig differ)")
                if bytes(desc.owner) != address or not desc.nics:
                    raise ValueError(f"rank {r}: its {name} descriptor belongs to another engine than its address")
                peer[name] = desc
            epoch = info.get("epoch", 0)
            if type(epoch) is not int or not 0 <= epoch <= MAX_EPOCH:
                raise ValueError(f"rank {r}: epoch must be an integer in 0..{MAX_EPOCH}")
            checked.append((peer, epoch))
        if bytes(checked[self.rank][0]["dispatch"]) != bytes(self._mrs["dispatch"].desc) or \
                bytes(checked[self.rank][0]["combine"]) != bytes(self._mrs["combine"].desc):
            raise ValueError(f"record {self.rank} is not this rank's own local_info (regions of another group)")
        return checked

    def _install(self, checked) -> None:
        """Takes the ranks' regions and restricts each rank's immediates to its NICs."""
        self.peers = [peer for peer, _epoch in checked]
        # Each rank's immediates (this group's tag, that rank as source, any step and phase)
        # count only from that rank's NICs: a zero-byte write carrying one from anyone else
        # made this rank read the rank's slot before it was written, and mask it (review 56
        # M6). Where the transport names no sender the arrival still counts
        # (docs/security.md). At a rejoin this also refuses the earlier incarnation's.
        for source, peer in enumerate(self.peers):
            nics = {bytes(n): n for d in peer.values() for n in d.nics}
            self.engine.restrict_imm_senders(_SOURCE_FAMILY, self._family(source), list(nics.values()))
        self.epoch = agreed_epoch(epoch for _peer, epoch in checked)

    def connect(self, infos) -> None:
        """Every rank's ``local_info()``, in rank order, exchanged by any channel (records a
        peer sent are checked: ``_checked``). Every rank starts at the same epoch: the largest
        any record carries (a rank rejoining a running group takes the others')."""
        if self.peers is not None or self._fenced:
            raise RuntimeError("this group is connected: clean(infos) re-forms it")
        self._install(self._checked(infos))

    def _family(self, source: int) -> int:
        """The bits every immediate rank ``source`` posts in this group has under
        ``_SOURCE_FAMILY`` (``xfer-ep-plan``'s immediate: tag, epoch, phase, source)."""
        return step_imm(self.cfg.tag, 0, 0, source)

    def query_active_mask(self) -> np.ndarray:
        """1 for each rank this one still talks to, 0 for a masked one (DeepEP's mask API)."""
        return np.array([1 if a else 0 for a in self.active], dtype=np.int32)

    def _stray_imms(self, spare=()) -> list:
        """What masked steps left in the ImmCounter: the immediates their waits gave up
        (``abandoned_imms``), and every immediate of the steps that masked a rank or ran
        without one and of the two after each (a masked rank may be two steps ahead, and an
        overflow write a rank did not wait for is counted by nobody). Left there, one would
        meet the expectation of the step that reuses its 12-bit epoch, 4,096 steps on. Not
        those of the epochs in ``spare``."""
        spare = {e % IMM_EPOCHS for e in spare}
        imms = {imm for imm in self._owed if (imm >> 16) & (IMM_EPOCHS - 1) not in spare}
        for epoch in self._suspect - spare:
            for source in range(self.cfg.ranks):
                if source != self.rank:
                    imms.update(step_imm(self.cfg.tag, epoch, phase, source) for phase in range(3))
        return sorted(imms)

    def _reset_stray_imms(self, spare=()) -> None:
        for imm in self._stray_imms(spare):
            self.engine.reset_imm(imm)

    def _forget_masked_steps(self, spare=()) -> None:
        self._reset_stray_imms(spare)
        self._owed.clear()
        self._suspect.clear()
        self.active = [True] * self.cfg.ranks

    def begin_clean(self) -> dict:
        """The first half of a clean, on every rank once nothing is in flight (after a barrier
        of the caller's): replaces this rank's two written regions with new registrations, so
        that no write of the membership before — a masked rank's late writes, a dead
        incarnation's — can land in a step after the clean (the old descriptors are refused
        from now on), and clears what the masked steps left in the ImmCounter. Returns this
        rank's record; exchange them as for ``connect``, then ``clean(infos)`` on every rank (a
        restarted rank ``connect``s with the same records). No step runs between the two."""
        if self.peers is None and not self._fenced:
            raise RuntimeError("connect() first: a group that never connected joins with connect(infos)")
        for name in ("dispatch", "combine"):
            # The old one first (a device memory frees its range by name), then the new one,
            # poisoned as at the start.
            self._memory.release(self.engine, name, self._mrs[name])
            self.regions[name], self._mrs[name] = self._memory.register(self.engine, name, 2 * self._set_bytes[name], "write")
        # Cleared here, before any peer holds the new regions (so before any write of a step
        # after the clean): nothing of before can land from now on. The steps this rank did
        # not run are cleared too (its peers masked it in the first of them, writing to it at
        # most two steps on): they count for nobody here.
        self._suspect.update(e % IMM_EPOCHS for e in range(self.epoch, self.epoch + 3))
        self._reset_stray_imms()
        self.peers = None
        self._fenced = True
        return self.local_info()

    def clean(self, infos=None) -> None:
        """Every rank active again, on every rank together once nothing is in flight.

        ``clean(infos)``, after ``begin_clean()`` on every rank, with every rank's record from
        it (a restarted rank's ``local_info()`` in its place): takes every rank's new regions
        (a rejoined rank's engine, regions and NICs, to which its immediates are now
        restricted) and sets one epoch on every rank (the largest any record carries:
        ``agreed_epoch``). Writes of the membership before cannot land in a later step (their
        regions are gone) nor be counted for one (their immediates are cleared, or refused from
        a rejoined rank's old NICs). A peer may start its next step before this rank called
        ``clean``: its writes land in the new regions and are counted.

        ``clean()`` alone is the local half, for hosts whose clean is a local call (DeepEP's
        ``low_latency_clean_mask_buffer``): the masks and the ImmCounter are cleared (but for
        the next two steps' immediates), the regions, peers and epochs stay — the ranks must
        have run the same steps (no fence against a masked rank's late writes;
        docs/moe.md)."""
        if infos is None:
            if self._fenced:
                raise RuntimeError("begin_clean() was called: finish with clean(infos)")
            # Not the next two steps' immediates: a peer whose clean came first may have sent
            # them (no rank ran those steps before, so nothing of before carries them).
            self._forget_masked_steps(spare=(self.epoch, self.epoch + 1))
            return
        if not self._fenced:
            raise RuntimeError("begin_clean() first, on every rank, and exchange what it returns")
        checked = self._checked(infos)
        # Writes of the last steps still unconfirmed went to the regions just replaced: what
        # they carry is never read again.
        self._unproven.clear()
        # Once more, for arrivals of before the engine had not yet counted at begin_clean —
        # but never the immediates of the first two steps after the clean: a peer that
        # finished its clean first may have sent them already.
        agreed = agreed_epoch(epoch for _peer, epoch in checked)
        skipped = min(max(agreed - self.epoch, 0), IMM_EPOCHS)
        self._suspect.update((self.epoch + i) % IMM_EPOCHS for i in range(skipped))
        self._forget_masked_steps(spare=(agreed, agreed + 1))
        self._install(checked)
        self._fenced = False

    def buffer_hint(self) -> dict:
        """Bytes this rank registers (both buffer sets of each region)."""
        return {name: 2 * n for name, n in self._set_bytes.items()}

    # -- the protocol -----------------------------------------------------------------------
    def _set_range(self, name: str, epoch: int) -> tuple[int, int]:
        """The bytes of ``name`` in the buffer set step ``epoch`` uses (sets alternate)."""
        n = self._set_bytes[name]
        return (epoch % 2) * n, (epoch % 2 + 1) * n

    def _now(self) -> int:
        return time.monotonic_ns()

    def _carry(self, h: Handle) -> None:
        for a in h.step.poll_actions():
            if a[0] == "post":
                _, peer, phase, imm, src_off, dst_off, length = a
                src_name = "combine_send" if phase == "combine" else "send"
                dst_name = "combine" if phase == "combine" else "dispatch"
                h.stats["writes"] = h.stats.get("writes", 0) + 1
                h.stats["bytes"] = h.stats.get("bytes", 0) + length
                kind = "combine" if phase == "combine" else "dispatch"
                h.stats[f"{kind}_bytes"] = h.stats.get(f"{kind}_bytes", 0) + length
                if peer == self.rank:
                    # To itself: a copy, not a write through the engine (the NIC's loopback
                    # would move the same bytes twice as far); it lands before its expectation
                    # is looked at, as both come from the same poll.
                    self._memory.copy(self.regions, dst_name, dst_off, src_name, src_off, length)
                    continue
                t = self.engine.submit_single_write(
                    self._mrs[src_name], self.peers[peer][dst_name], length, src_offset=src_off, dst_offset=dst_off, imm=imm)
                if phase == "combine":
                    h.combine_sends.append((peer, t))
                else:
                    h.sends.append((peer, t))
                    if phase == "dispatch_b":
                        h.overflow[peer] = t
                h.stats["remote_writes"] = h.stats.get("remote_writes", 0) + 1
                h.stats["remote_bytes"] = h.stats.get("remote_bytes", 0) + length
                h.stats[f"remote_{kind}_bytes"] = h.stats.get(f"remote_{kind}_bytes", 0) + length
            else:
                _, imm, source, phase = a
                h.expects[(source, phase)] = (imm, _LANDED if source == self.rank else self.engine.expect_imm_count(imm, 1))

    def _header_for(self, h: Handle, source: int, phase: str) -> bytes:
        if phase == "dispatch_a":
            at = h.step.header_offset(source)
            self._memory.fetch(self.regions, "dispatch", at, at + self._header_bytes)
            return self.regions["dispatch"][at:at + self._header_bytes].tobytes()
        if phase == "combine":
            at = h.step.combine_header_offset(source)
            self._memory.fetch(self.regions, "combine", at, at + self._combine_header_bytes)
            return self.regions["combine"][at:at + self._combine_header_bytes].tobytes()
        return b""

    def _settle_sends(self, h: Handle) -> None:
        """Forgets the writes that completed. One whose completion failed masks its peer in step
        ``h``; one the engine timed out stays, as one still pending does, for its proof."""
        failed = set()

        def pending(writes):
            kept = []
            for w in writes:
                peer, t = w[-2], w[-1]
                if t.done():
                    if _failure(t) is not None:
                        failed.add(peer)
                        continue
                    if t.exception() is None:
                        continue
                kept.append(w)
            return kept

        h.sends = pending(h.sends)
        h.combine_sends = pending(h.combine_sends)
        self._unproven = pending(self._unproven)
        for peer in sorted(failed):
            h.step.handle_send_failed(self._now(), peer)

    def _drive(self, h: Handle, until: tuple) -> None:
        """Carries out the step until its stage is in ``until`` (or failed); every wait ends by
        its deadline."""
        while True:
            self._carry(h)
            self._settle_sends(h)
            stage = h.step.stage
            if stage in until or stage.startswith("failed"):
                return
            active = h.step.active()
            for key in [k for k in h.expects if not active[k[0]]]:
                _imm, t = h.expects.pop(key)
                if t is not _LANDED:
                    # The engine forgets the wait too: left there until its own expect_ms, it
                    # took the arrival of the step 4,096 on (the same immediate) after a
                    # clean. Its own arrival, should it come, is owed (cleared by clean()).
                    t.cancel()
            # Everything that landed is taken before any deadline is looked at.
            landed = [(k, v) for k, v in h.expects.items() if v[1].done()]
            for (source, phase), (imm, t) in landed:
                del h.expects[(source, phase)]
                if t.exception() is None:
                    h.step.handle_arrival(self._now(), imm, self._header_for(h, source, phase))
            if landed:
                continue
            deadline = h.step.poll_timeout()
            if deadline is None:
                raise EpError(f"step {h.epoch} is stuck in stage {stage} with nothing to wait for")
            now = self._now()
            if now >= deadline:
                h.step.handle_timeout(now)
                continue
            if not h.expects:
                # The engine gave up on them first (its expect_ms): wait out the step's deadline.
                time.sleep((deadline - now) / 1e9)
                continue
            _key, (_imm, t) = next(iter(h.expects.items()))
            try:
                t.wait((deadline - now) / 1e9)
            except (TimeoutError, _errors.Error):
                pass

    def _prove_sent(self, h: Handle) -> None:
        """Once the step is done: its dispatch writes are delivered before the send buffer is
        reused two steps on, and its combine writes are handed to the group (``combine_send``
        of the step two on proves them).

        A peer still active sent its combine write of this step, which it does only once it
        holds this rank's dispatch A write (or masked this rank, and then it sends nothing):
        that write is delivered. So is the dispatch B write when the peer took it — every row
        sent to it came back, as it counts only the overflow it waited for. A B write it did
        not take has no such proof: it must complete by one timeout, or the peer is masked.
        Writes to a masked peer are not waited for (what they carry is never read)."""
        self._settle_sends(h)
        active = h.step.active()
        _blocks, valid = h.step.combine_blocks()
        valid = np.asarray(valid, dtype=bool)
        unproven = []
        for peer, t in h.sends:
            if active[peer] and h.overflow.get(peer) is t and not valid[h.peer == peer].all():
                unproven.append((peer, t))
        deadline = time.monotonic() + self.cfg.timeout
        for peer, t in unproven:
            try:
                t.wait(max(0.0, deadline - time.monotonic()))
            except _errors.Error:
                h.step.handle_send_failed(self._now(), peer)
        h.sends.clear()
        h.overflow.clear()
        active = h.step.active()
        self._unproven.extend((h.epoch, peer, t) for peer, t in h.combine_sends if active[peer])
        h.combine_sends.clear()

    def _finish(self, h: Handle) -> None:
        for r in h.step.newly_masked():
            self.active[r] = False
        self._owed.extend(h.step.abandoned_imms())
        if not all(h.step.active()):
            self._suspect.update(e % IMM_EPOCHS for e in (h.epoch, h.epoch + 1, h.epoch + 2))

    def dispatch_send(self, x: np.ndarray, topk_idx: np.ndarray, *, weights: np.ndarray | None = None) -> Handle:
        """Starts a step: packs ``x`` (``[tokens, hidden]`` of the storage dtype; quantized to
        fp8 rows with ``cfg.fp8``) once for each rank ``topk_idx`` (``[tokens, top_k]``, ``-1``
        for none) routes it to, and posts the first write to every active peer. Returns the
        step's handle. ``weights`` (``[tokens, top_k]`` float32, needs ``cfg.partial_sums``):
        they travel with the rows, each rank weighs and sums a token's outputs there, and
        combine returns one fp32 partial sum per (token, rank) (``combine_recv`` needs no
        weights then)."""
        cfg = self.cfg
        if self.peers is None:
            raise RuntimeError("connect() first")
        topk_idx = np.ascontiguousarray(topk_idx, dtype="<i8")
        num_tokens = topk_idx.shape[0] if topk_idx.ndim == 2 else 0
        if topk_idx.ndim != 2 or topk_idx.shape[1] != cfg.top_k or num_tokens > cfg.max_tokens:
            raise ValueError(f"topk_idx must be [tokens <= {cfg.max_tokens}, {cfg.top_k}], not {topk_idx.shape}")
        if x.shape != (num_tokens, cfg.hidden) or x.dtype != cfg.storage:
            raise ValueError(f"x must be [{num_tokens}, {cfg.hidden}] of {cfg.storage}, not {x.shape} {x.dtype}")
        if weights is not None:
            if not cfg.partial_sums:
                raise ValueError("weights at dispatch need EpConfig(partial_sums=True)")
            weights = np.ascontiguousarray(weights, dtype="<f4")
            if weights.shape != topk_idx.shape:
                raise ValueError(f"weights must be {topk_idx.shape}, not {weights.shape}")
        t0 = time.perf_counter_ns()
        step = EpStep(
            cfg.layout_args(), self.rank, self.epoch, topk_idx.tobytes(), list(self.active), self._now(),
            int(cfg.timeout * 1e9), tag=cfg.tag, eplb=self.eplb,
            weights=None if weights is None else weights.tobytes(),
        )
        planned = time.perf_counter_ns()
        h = Handle(step=step, epoch=self.epoch, num_tokens=num_tokens, weighted=weights is not None)
        self.epoch += 1
        token, slot, peer, _expert = columns(step.send_rows())
        h.token, h.slot, h.peer = token, slot, peer
        step.pack(_bytes_of(x), self.regions["send"], fp8=cfg.fp8)
        self._memory.publish(self.regions, "send", *self._set_range("send", h.epoch))
        h.stats["plan_ns"] = planned - t0
        h.stats["pack_ns"] = time.perf_counter_ns() - planned
        self._carry(h)
        return h

    def dispatch_recv(self, h: Handle, *, layout: str = "deepep", out: np.ndarray | None = None):
        """Waits for the step's rows (every wait by its deadline) and returns them in
        ``layout``: ``"deepep"``: ``(recv_x [experts_per_rank, ranks × max_tokens, hidden],
        recv_count [experts_per_rank])``; ``"flat"``: ``(recv_x [rows, hidden], expert_starts
        [experts_per_rank + 1])``; with ``cfg.fp8`` ``recv_x`` is ``(values, scales)``: the e4m3
        values as ``uint8`` (``[..., hidden]``) and a float32 scale per 128 channels, each
        contiguous, as DeepEP's low-latency dispatch returns them. Both: for each local expert, the sources in rank order, each
        source's tokens in its order. The returned array is the group's own, valid until the
        step two later (``out`` to give one)."""
        if layout not in LAYOUTS:
            raise ValueError(f"layout must be one of {LAYOUTS}")
        cfg = self.cfg
        h.layout = layout
        t0 = time.perf_counter_ns()
        self._drive(h, ("dispatched",))
        h.stats["dispatch_wait_ns"] = time.perf_counter_ns() - t0
        if h.step.stage.startswith("failed"):
            self._finish(h)
            raise EpError(f"step {h.epoch}: {h.step.stage}")
        # The host reads the rows and their route records: fetch this step's set first.
        self._memory.fetch(self.regions, "dispatch", *self._set_range("dispatch", h.epoch))
        region = self.regions["dispatch"]
        # Each row came once per (token, rank), with its route record: the slots it carries
        # and their local experts here (a source whose records do not decode is masked).
        counts = np.asarray(h.step.read_routes(region), dtype=np.int64)
        rows = cfg.ranks * cfg.max_tokens if layout == "deepep" else int(counts.sum())
        if int(counts.max(initial=0)) > cfg.ranks * cfg.max_tokens:
            raise EpError("an expert got more than ranks × max_tokens rows (duplicate experts in a token?)")
        lead = (cfg.experts_per_rank, rows) if layout == "deepep" else (rows,)
        if out is None:
            out = self.recv_buffer(h.epoch) if layout == "deepep" else None
            if out is None:
                out = self._recv_arrays(lead)
        values, scales = out if cfg.fp8 is not None else (out, None)
        want = self._recv_arrays(lead, shapes_only=True)
        got = [(a.shape, a.dtype) for a in (values, scales) if a is not None]
        if got != want:
            raise ValueError(f"out must be {want}, not {got}")
        t0 = time.perf_counter_ns()
        if scales is None:
            h.step.unpack(region, _bytes_of(values), layout)
        else:
            h.step.unpack(region, _bytes_of(values), layout, scales=_bytes_of(scales), hidden=cfg.hidden)
        h.stats["unpack_ns"] = time.perf_counter_ns() - t0
        meta = counts if layout == "deepep" else np.concatenate([[0], np.cumsum(counts)]).astype(np.int64)
        return out, meta

    def _recv_arrays(self, lead: tuple, *, shapes_only: bool = False):
        """The arrays dispatched rows are unpacked to: one of the storage dtype, or with fp8
        ``(values uint8 [..., hidden], scales float32 [..., blocks])``."""
        cfg = self.cfg
        if cfg.fp8 is None:
            specs = [(lead + (cfg.hidden,), cfg.storage)]
        else:
            specs = [(lead + (cfg.hidden,), np.dtype(np.uint8)), (lead + (cfg.scale_blocks,), np.dtype(np.float32))]
        if shapes_only:
            return specs
        arrays = [np.zeros(shape, dtype=dt) for shape, dt in specs]
        return arrays[0] if cfg.fp8 is None else tuple(arrays)

    def recv_buffer(self, epoch: int):
        """The group's own ``deepep`` output of step ``epoch`` (one per buffer set)."""
        cfg = self.cfg
        key = (epoch % 2, "deepep")
        if key not in self._out:
            self._out[key] = self._recv_arrays((cfg.experts_per_rank, cfg.ranks * cfg.max_tokens))
        return self._out[key]

    def combine_send(self, h: Handle, expert_out: np.ndarray) -> None:
        """Sends each received row's expert output (``expert_out`` in the layout the rows were
        received in) back to its source."""
        if h.layout is None:
            raise RuntimeError("combine_send before dispatch_recv")
        # The buffer set is reused: the combine writes of two steps back are delivered. Every
        # peer still active in this step sent its header of it, which it does only after the
        # combine of every step two or more back (at most two steps are in flight), and only
        # to a rank it had not masked: it received this rank's combine writes of those steps.
        # A masked peer's are not waited for (what they carry is never read).
        if h.step.stage == "dispatched":
            self._unproven = [w for w in self._unproven if w[0] > h.epoch - 2]
        t0 = time.perf_counter_ns()
        h.step.repack(_bytes_of(np.ascontiguousarray(expert_out, dtype=self.cfg.storage)), self.regions["combine_send"], h.layout,
                      dtype=self.cfg.dtype)
        self._memory.publish(self.regions, "combine_send", *self._set_range("combine_send", h.epoch))
        h.stats["repack_ns"] = time.perf_counter_ns() - t0
        h.step.start_combine(self._now())
        self._carry(h)

    def combine_recv(self, h: Handle, topk_weights: np.ndarray | None = None) -> np.ndarray:
        """Waits for the outputs and returns ``[tokens, hidden]`` fp32: each token's outputs
        weighted by ``topk_weights`` and summed in fp32, slots in order — or, with the weights
        given at dispatch (``topk_weights`` then unused), each rank's partial sum added in rank
        order. Slots whose output did not come back count zero; they are in ``h.lost_slots``."""
        cfg = self.cfg
        if topk_weights is None and not h.weighted:
            raise ValueError("topk_weights are needed: none were given at dispatch")
        t0 = time.perf_counter_ns()
        self._drive(h, ("done",))
        h.stats["combine_wait_ns"] = time.perf_counter_ns() - t0
        self._prove_sent(h)
        self._finish(h)
        _blocks, valid = h.step.combine_blocks()
        valid = np.asarray(valid, dtype=bool)
        weights = None if h.weighted else np.ascontiguousarray(topk_weights, dtype=np.float32).reshape(-1)
        y = np.empty((h.num_tokens, cfg.hidden), dtype=np.float32)
        t0 = time.perf_counter_ns()
        self._memory.fetch(self.regions, "combine", *self._set_range("combine", h.epoch))
        h.step.reduce(self.regions["combine"], weights, y.reshape(-1), cfg.dtype)
        h.stats["reduce_ns"] = time.perf_counter_ns() - t0
        lost = set((h.token[~valid] * cfg.top_k + h.slot[~valid]).tolist()) | set(h.step.masked_slots())
        h.lost_slots = np.array(sorted(lost), dtype=np.int64)
        return y

    # -- whole phases -----------------------------------------------------------------------
    def dispatch(self, x, topk_idx, *, layout: str = "deepep", weights=None):
        """``dispatch_send`` then ``dispatch_recv``: ``(recv_x, counts_or_starts, handle)``."""
        h = self.dispatch_send(x, topk_idx, weights=weights)
        recv_x, counts = self.dispatch_recv(h, layout=layout)
        return recv_x, counts, h

    def combine(self, expert_out, h: Handle, topk_weights=None) -> np.ndarray:
        """``combine_send`` then ``combine_recv``."""
        self.combine_send(h, expert_out)
        return self.combine_recv(h, topk_weights)

    def close(self) -> None:
        """Deregisters the regions, once the last steps' combine writes completed (by one
        timeout: no later step of a peer will prove them)."""
        deadline = time.monotonic() + self.cfg.timeout
        for _epoch, _peer, t in self._unproven:
            try:
                t.wait(max(0.0, deadline - time.monotonic()))
            except _errors.Error:
                pass
        self._unproven.clear()
        if self.peers is not None or self._fenced:
            for source in range(self.cfg.ranks):
                self.engine.restrict_imm_senders(_SOURCE_FAMILY, self._family(source), None)
        for name, mr in self._mrs.items():
            self._memory.release(self.engine, name, mr)
        self._mrs = {}
        _TAGS_IN_USE.discard(self._tag_key)
