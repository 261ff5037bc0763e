"""Membership of an EP group (xfer.ep): a clean agrees the epoch among the ranks, a rank whose
process died rejoins as a new incarnation (new engine, regions and NICs) at a clean, and the
writes of the membership before a clean never reach a step after it. On the mock (ranks as
threads, as test_ep.py runs them), through xfer's rendezvous (the embedded service in this
process), and as processes over libfabric tcp with one SIGKILLed and restarted; every step
checked against the oracle."""

import dataclasses
import threading

import numpy as np

import pytest

import xfer
from xfer.ep import EpConfig, EpError, EpGroup
from xfer.ep import oracle
from xfer.ep.group import MAX_EPOCH, agreed_epoch, step_imm
from xfer.ep.rendezvous import EpRendezvous

from test_ep import MOCK, TIMEOUT, DroppedTo, Ranks, check_step, failure_cfg, mock, shm_config, survivors_run, two_steps_in_flight


def die(rs, r, g):
    """Rank ``r`` dies after a step it finished: its combine writes of the step are delivered
    first (``close`` waits for them; an engine closed at once drops those still in flight, and
    its peers then mask it in that step), then its engine closes."""
    g.close()
    rs.engines[r].close()


def test_the_agreed_epoch_and_the_immediates_it_names():
    """Pure helpers: the epoch a clean agrees on is the largest any rank reached, rounded up to
    even (its first step uses buffer set 0); records out of range are refused; the immediate
    is the planner's (tag, epoch mod 4096, phase, source)."""
    assert agreed_epoch([0, 0]) == 0
    assert agreed_epoch([1, 4, 3]) == 4
    assert agreed_epoch([5, 2]) == 6
    assert agreed_epoch([MAX_EPOCH]) == MAX_EPOCH
    for bad in ([], [-1], [1.0], [True], [MAX_EPOCH + 1]):
        with pytest.raises(ValueError):
            agreed_epoch(bad)
    assert step_imm(0xE, 3, 2, 5) == (0xE << 28) | (3 << 16) | (2 << 14) | 5
    assert step_imm(0xE, 3 + 4096, 2, 5) == step_imm(0xE, 3, 2, 5), "12 bits of epoch"


def test_records_a_peer_sends_are_checked_at_connect():
    """A record is untrusted input: out of order, a descriptor that does not decode, a region
    of another size (another EpConfig), a descriptor of another engine than the record's
    address, an epoch out of range — each refused by name, nothing installed."""
    cfg = failure_cfg(2)
    rs = Ranks(cfg, connect=False)
    other = Ranks(dataclasses.replace(cfg, hidden=16, tag=3), connect=False)
    try:
        g = rs.groups[0]
        good = [x.local_info() for x in rs.groups]

        def with_(r, **change):
            infos = [dict(i) for i in good]
            infos[r].update(change)
            return infos

        cases = [
            (good[::-1], "rank order"),
            (good[:1], "2 ranks"),
            (with_(1, dispatch=b"\x01\x02"), "does not decode"),
            (with_(1, combine=other.groups[1].local_info()["combine"]), "this config registers"),
            (with_(1, dispatch=good[0]["dispatch"]), "another engine"),
            (with_(1, address=b""), "address"),
            (with_(1, epoch=-1), "epoch"),
            (with_(1, epoch="7"), "epoch"),
            (with_(0, dispatch=good[1]["dispatch"], address=good[1]["address"], combine=good[1]["combine"]), "own"),
        ]
        for infos, match in cases:
            with pytest.raises(ValueError, match=match):
                g.connect(infos)
            assert g.peers is None and g.epoch == 0
        g.connect(with_(1, epoch=9))
        assert g.epoch == 10
    finally:
        other.close()
        rs.close()


def test_arrivals_from_before_a_clean_never_meet_a_step_4096_on():
    """EP 2: rank 1 is silent in step 1, which rank 0 runs (masking it): rank 0's header write
    of step 1 lands at rank 1, where nobody counts it. The clean agrees on epoch 4096 (rank 0's
    record says so, as after 4,096 steps), so step 4097 reuses step 1's 12-bit epoch: that
    arrival, left in rank 1's ImmCounter, would meet rank 1's expectation of rank 0's header
    before rank 0 wrote it (rank 1 then masks rank 0: failed so before). And rank 0's wait for
    rank 1's step-1 header, which rank 0 gave up when it masked rank 1, stayed in rank 0's
    engine until its expect_ms, where it took rank 1's header of step 4097 and left that
    step's own wait to time out (each rank masked the other: failed so before). The clean
    clears the first and the group cancels a wait it gives up; steps 4096 and 4097 are
    exact."""
    cfg = failure_cfg(2)
    rs = Ranks(cfg)
    stray = step_imm(cfg.tag, 1, 0, 0)  # step 1, dispatch A, from rank 0
    try:
        def body(r, g):
            check_step(g, r, cfg, [oracle.inputs(53, 0, s, cfg) for s in range(2)])
            if r == 0:
                survivors_run(cfg, g, r, 1, 1, 1, 53)

        rs.run(body)
        assert rs.engines[1].imm_count(stray) == 1
        infos = [g.begin_clean() for g in rs.groups]
        infos[0]["epoch"] = 4096
        for g in rs.groups:
            g.clean(infos)
        assert [g.epoch for g in rs.groups] == [4096, 4096]
        assert rs.engines[1].imm_count(stray) == 0

        def after(r, g):
            for step in (4096, 4097):
                check_step(g, r, cfg, [oracle.inputs(53, step, s, cfg) for s in range(2)])
                assert list(g.query_active_mask()) == [1, 1]

        rs.run(after)
    finally:
        rs.close()


def wait_for_header(rs, cfg, *, source, at, epoch):
    """Until rank ``source``'s header of step ``epoch`` arrived at rank ``at`` (a mirror of
    its arrivals, not consumed: the step still counts it)."""
    arrived = threading.Event()
    header = step_imm(cfg.tag, epoch, 0, source)
    rs.engines[at].mirror_imm_count(header, lambda total: total >= 1 and arrived.set())
    assert arrived.wait(30), f"rank {source}'s header never came"


def finish_after_an_early_step(rs, cfg, ins, early, seed):
    """Rank 1 already started step 2 (``early``, inputs ``ins``), rank 0 now runs it: both
    exact with nobody masked, then step 3."""

    def after(r, g):
        if r == 1:
            recv, cnt = g.dispatch_recv(early)
            expected = oracle.expected_recv(ins, r, cfg)
            for le in range(cfg.experts_per_rank):
                assert np.array_equal(recv[le, : cnt[le]], expected[le]), f"expert {le}"
            x, idx, w = ins[r]
            y = g.combine(oracle.run_experts_deepep(recv, cnt, r, cfg), early, w)
            assert np.array_equal(y, oracle.expected_combine(x, idx, w, cfg))
        else:
            check_step(g, r, cfg, ins)
        assert list(g.query_active_mask()) == [1, 1]
        check_step(g, r, cfg, [oracle.inputs(seed, 3, s, cfg) for s in range(2)])

    rs.run(after)


def test_a_rank_stepping_before_a_peer_finished_its_clean_is_not_lost():
    """EP 2: rank 1 is silent in step 1, which rank 0 runs (masking it). At the clean rank 1
    finishes first and posts its header of the first step after it (epoch 2) before rank 0
    calls clean(infos) — as a rank may that returns from the exchange first. Rank 0's clean
    used to clear the immediates of the steps around the one that masked rank 1, epoch 2
    among them: it wiped rank 1's header arrival, and rank 0 masked rank 1 in that step. The
    ImmCounter is now cleared before the new regions are published (at begin_clean) and, at
    clean, never for the epochs the first two steps after it use."""
    cfg = failure_cfg(2)
    rs = Ranks(cfg)
    try:
        def body(r, g):
            check_step(g, r, cfg, [oracle.inputs(57, 0, s, cfg) for s in range(2)])
            if r == 0:
                survivors_run(cfg, g, r, 1, 1, 1, 57)

        rs.run(body)
        infos = [g.begin_clean() for g in rs.groups]
        rs.groups[1].clean(infos)
        assert [g.epoch for g in rs.groups] == [2, 2]
        ins = [oracle.inputs(57, 2, s, cfg) for s in range(2)]
        early = rs.groups[1].dispatch_send(*ins[1][:2])
        wait_for_header(rs, cfg, source=1, at=0, epoch=2)
        rs.groups[0].clean(infos)

        finish_after_an_early_step(rs, cfg, ins, early, 57)
    finally:
        rs.close()


def test_a_rank_stepping_before_a_peer_finished_a_local_clean_is_not_lost():
    """The local clean (``clean()``, DeepEP's ``low_latency_clean_mask_buffer``, which vLLM's
    ranks call with no barrier after it): rank 1's step-1 header to rank 0 is lost and rank 1
    stops after its dispatch, so rank 0 masks it in step 1; both are then at epoch 2. Rank 1
    cleans first and posts its step-2 header before rank 0 cleans. Rank 0's clean used to clear
    the immediates of the two steps after the one that masked rank 1 — step 2's among them — so
    it wiped that arrival and masked rank 1 again; it now spares the next two steps'."""
    cfg = failure_cfg(2)
    dropping = {}

    def wrap(r, e):
        if r == 1:
            dropping[r] = DroppedTo(e, doomed=b"")
            return dropping[r]
        return e

    rs = Ranks(cfg, wrap=wrap)
    try:
        rs.run(lambda r, g: check_step(g, r, cfg, [oracle.inputs(59, 0, s, cfg) for s in range(2)]))
        dropping[1].doomed = rs.groups[0].local_info()["dispatch"]

        def masking(r, g):
            if r == 0:
                survivors_run(cfg, g, r, 1, 1, 1, 59)
            else:
                g.dispatch_send(*oracle.inputs(59, 1, r, cfg)[:2])

        rs.run(masking)
        dropping[1].doomed = b""
        assert [g.epoch for g in rs.groups] == [2, 2]
        ins = [oracle.inputs(59, 2, s, cfg) for s in range(2)]
        rs.groups[1].clean()
        early = rs.groups[1].dispatch_send(*ins[1][:2])
        wait_for_header(rs, cfg, source=1, at=0, epoch=2)
        rs.groups[0].clean()

        finish_after_an_early_step(rs, cfg, ins, early, 59)
    finally:
        rs.close()


def test_a_dead_rank_rejoins_with_a_new_engine_at_a_clean():
    """EP 3: rank 2's engine closes after step 0 (the process died); the survivors mask it and
    go on. A new incarnation of rank 2 (new engine, new group, new regions) rejoins at a clean:
    the survivors take its records, restrict its immediates to its new NICs and everyone agrees
    on the epoch (the newcomer starts at 0). The next steps, one after another and two in
    flight, are exact on every rank, the newcomer included."""
    cfg = failure_cfg(3)
    dead = 2
    rs = Ranks(cfg)
    try:
        def body(r, g):
            check_step(g, r, cfg, [oracle.inputs(51, 0, s, cfg) for s in range(3)])
            if r == dead:
                die(rs, r, g)
                return
            survivors_run(cfg, g, r, dead, 1, 2, 51)

        rs.run(body)
        rs.clean(rejoin=(dead,))
        assert [g.epoch for g in rs.groups] == [4, 4, 4]

        def after(r, g):
            for step in range(4, 7):
                h = check_step(g, r, cfg, [oracle.inputs(51, step, s, cfg) for s in range(3)])
                assert len(h.lost_slots) == 0
            two_steps_in_flight(g, r, cfg, [[oracle.inputs(51, step, s, cfg) for s in range(3)] for step in (7, 8)])
            assert list(g.query_active_mask()) == [1, 1, 1]

        rs.run(after)
    finally:
        rs.close()


def test_a_hung_incarnations_writes_landing_after_the_clean_never_reach_a_later_step():
    """Rank 2's NIC holds its writes of step 0 past the survivors' deadline: they mask it, and
    a new incarnation of rank 2 rejoins at a clean before the old one's writes land — into the
    slot of rank 2 in buffer set 0, which the first step after the clean uses again. The
    clean's new registrations refuse them (they fail at the hung rank); every step after the
    clean is exact on every rank, also those run after the old writes came."""
    cfg = failure_cfg(3)
    hung = 2
    # Past the header wait (two timeouts), with room for the survivors to end the step and clean
    # on a loaded machine before the writes land.
    delay = 3.5 * cfg.timeout
    rs = Ranks(cfg, engine_configs={hung: mock(delay_us=int(delay * 1e6))})
    old = {}
    try:
        def body(r, g):
            ins = [oracle.inputs(61, 0, s, cfg) for s in range(3)]
            if r == hung:
                x, idx, _w = ins[r]
                old["handle"] = g.dispatch_send(x, idx)  # its writes held by its NIC
                return
            survivors_run(cfg, g, r, hung, 0, 1, 61)

        rs.run(body)
        old_sends = list(old["handle"].sends)
        assert old_sends and not any(t.done() for _peer, t in old_sends), "the old writes landed before the clean"
        rs.clean(rejoin=(hung,))
        assert [g.epoch % 2 for g in rs.groups] == [0, 0, 0], "the first step after the clean uses set 0"
        decided = threading.Barrier(3)
        landed = {}

        def after(r, g):
            step = 1
            while True:
                check_step(g, r, cfg, [oracle.inputs(61, step, s, cfg) for s in range(3)])
                assert list(g.query_active_mask()) == [1, 1, 1]
                step += 1
                landed[r] = all(t.done() for _peer, t in old_sends)
                decided.wait()
                go_on = not all(landed.values()) and step < 3000
                decided.wait()
                if not go_on:
                    break
            for step in (step, step + 1):  # and after they came
                check_step(g, r, cfg, [oracle.inputs(61, step, s, cfg) for s in range(3)])

        rs.run(after)
        for _peer, t in old_sends:
            assert t.exception() is not None, "a write of the old incarnation landed after the clean"
    finally:
        rs.close()


# -- through the rendezvous -------------------------------------------------------------------


def test_a_group_forms_and_a_dead_rank_rejoins_through_the_rendezvous():
    """EP 3 forms at generation 0 through the embedded rendezvous; rank 2's engine closes
    (its records stay published, as a killed process's do until their lease ends). The
    survivors mask it; a new incarnation with a new engine, group and rendezvous client —
    knowing nothing of the group — and the survivors form generation 1, which it learns from
    the survivors' records. The steps after are exact on every rank."""
    server = xfer.Server()
    cfg = failure_cfg(3)
    dead = 2
    rs = Ranks(cfg, connect=False)
    rdvs = [EpRendezvous(xfer.Rendezvous(server.url), "moe-a", ttl=3) for _ in range(3)]
    try:
        def form(expected):
            def body(r, g):
                assert rdvs[r].form(g, timeout=30) == expected

            rs.run(body)
            assert len({g.epoch for g in rs.groups}) == 1

        form(0)

        def steps(r, g):
            check_step(g, r, cfg, [oracle.inputs(71, 0, s, cfg) for s in range(3)])
            if r == dead:
                die(rs, r, g)
                return
            survivors_run(cfg, g, r, dead, 1, 1, 71)

        rs.run(steps)
        rs.replaced.append(rs.engines[dead])
        rs.engines[dead] = xfer.TransferEngine(MOCK)
        rs.groups[dead] = EpGroup(rs.engines[dead], dead, cfg)
        # The dead incarnation's records stay published (held here, as a killed process's
        # are until their lease ends): the newcomer's own rank's commit is not taken for the
        # group's generation.
        rdvs.append(rdvs[dead])
        rdvs[dead] = EpRendezvous(xfer.Rendezvous(server.url), "moe-a", ttl=3)
        assert "moe-a.g0.c2" in [rec["name"] for rec in xfer.Rendezvous(server.url).list()]
        form(1)

        def after(r, g):
            for step in (2, 3):
                check_step(g, r, cfg, [oracle.inputs(71, step, s, cfg) for s in range(3)])
            assert list(g.query_active_mask()) == [1, 1, 1]

        rs.run(after)
    finally:
        for rdv in rdvs:
            rdv.close()
        rs.close()
        server.close()


def test_ranks_that_took_different_records_form_nothing():
    """A record of an older incarnation of rank 2 is published under generation 0's name when
    ranks 0 and 1 take it; then it goes and the live rank 2 publishes its own and takes it. Each rank's commit names what it took: no rank connects (every one raises EpError,
    its records withdrawn), and the next formation, with only live records, is exact."""
    server = xfer.Server()
    cfg = failure_cfg(3)
    rs = Ranks(cfg, connect=False)
    stale_engine = xfer.TransferEngine(MOCK)
    stale = EpGroup(stale_engine, 2, cfg)
    url = server.url
    rdvs = [EpRendezvous(xfer.Rendezvous(url), "moe-b", ttl=3) for _ in range(3)]
    try:
        info = stale.local_info()
        desc = xfer.MrDesc(info["dispatch"])
        old = xfer.Rendezvous(url).publish(
            "moe-b.g0.r2", info["address"], {"dispatch": desc, "combine": xfer.MrDesc(info["combine"]), "epoch.0": desc}, ttl=3)
        failed = {}

        def attempt(r):
            try:
                rdvs[r].form(rs.groups[r], generation=0, timeout=20)
            except EpError as e:
                failed[r] = e

        first = [threading.Thread(target=attempt, args=(r,)) for r in (0, 1)]
        for t in first:
            t.start()
        # Ranks 0 and 1 committed to what they took (the old incarnation's record among them).
        for r in (0, 1):
            xfer.Rendezvous(url).lookup(f"moe-b.g0.c{r}", timeout=20)
        old.unpublish()
        last = threading.Thread(target=attempt, args=(2,))
        last.start()
        for t in first + [last]:
            t.join(60)
            assert not t.is_alive()
        assert sorted(failed) == [0, 1, 2], failed
        assert all(g.peers is None for g in rs.groups)
        assert not [rec["name"] for rec in xfer.Rendezvous(url).list() if rec["name"].startswith("moe-b.")]

        def body(r, g):
            assert rdvs[r].form(g, timeout=30) == 0
            for step in range(2):
                check_step(g, r, cfg, [oracle.inputs(73, step, s, cfg) for s in range(3)])

        rs.run(body)
    finally:
        for rdv in rdvs:
            rdv.close()
        stale.close()
        stale_engine.close()
        rs.close()
        server.close()


def rejoining_rank(rank, cfg_kwargs, url, conn, role, provider, masked_step):
    """One rank in its own process, forming its group through the rendezvous at ``url``.
    ``first``: forms, runs step 0, reports and waits for "go" (rank 1 is SIGKILLed there);
    a survivor then runs step 1 (masking rank 1) if ``masked_step``, forms again with the
    newcomer and runs steps 2 and 3. ``newcomer``: rank 1 restarted — forms (learning the generation) and runs steps 2
    and 3. Every step checked against the oracle."""
    cfg = EpConfig(**cfg_kwargs)
    try:
        with xfer.TransferEngine(shm_config(provider)) as e:
            g = EpGroup(e, rank, cfg)
            rdv = EpRendezvous(xfer.Rendezvous(url), "moe-kill", ttl=2)
            inputs = lambda step: [oracle.inputs(29, step, s, cfg) for s in range(cfg.ranks)]  # noqa: E731
            if role == "first":
                assert rdv.form(g, timeout=60) == 0
                check_step(g, rank, cfg, inputs(0))
                conn.send("stepped")
                assert conn.recv() == "go"
                if masked_step:
                    survivors_run(cfg, g, rank, 1, 1, 1, 29)
            generation = rdv.form(g, timeout=120)
            assert generation == 1, generation
            for step in (2, 3):
                check_step(g, rank, cfg, inputs(step))
                assert list(g.query_active_mask()) == [1] * cfg.ranks
            conn.send("ok")
            conn.recv()  # every rank done before any engine closes
            rdv.close()
    except BaseException as exc:  # noqa: BLE001 - reported to the parent
        import traceback

        conn.send(f"rank {rank}: {exc!r}\n{traceback.format_exc()}")


@pytest.mark.parametrize("provider,masked_step", [("tcp;ofi_rxm", True), ("shm", False)])
def test_a_sigkilled_process_restarts_and_rejoins_through_the_rendezvous(provider, masked_step):
    """EP 3 as processes over libfabric, formed through the embedded rendezvous. Rank 1 is
    SIGKILLed after step 0 (its records stay until their lease ends); over tcp the survivors'
    step 1 masks it, exact for every token that avoided it; rank 1 is restarted as a new
    process (new engine, regions, NICs) and it and the survivors form generation 1 through the
    rendezvous; steps 2 and 3 are exact on every rank, the restarted one included. Over shm
    the survivors go to the formation without a step in between: an shm endpoint that wrote
    to a dead process stops delivering (docs/moe.md, "Found")."""
    from conftest import plugin_available

    if not plugin_available("efa"):
        pytest.skip("the efa plugin is not in the package (cargo xtask python builds it)")
    import multiprocessing as mp
    import os
    import signal

    ranks, dead = 3, 1
    ctx = mp.get_context("spawn")
    cfg = dict(ranks=ranks, experts_per_rank=2, top_k=2, max_tokens=6, hidden=64, private_rows=2, timeout=2 * TIMEOUT)
    server = xfer.Server()
    pipes = [ctx.Pipe() for _ in range(ranks)]
    procs = [ctx.Process(target=rejoining_rank, args=(r, cfg, server.url, pipes[r][1], "first", provider, masked_step)) for r in range(ranks)]
    for p in procs:
        p.start()
    try:
        for r in range(ranks):
            assert pipes[r][0].poll(120), f"rank {r} did not step"
            reply = pipes[r][0].recv()
            assert reply == "stepped", reply
        os.kill(procs[dead].pid, signal.SIGKILL)
        procs[dead].join(30)
        for r in range(ranks):
            if r != dead:
                pipes[r][0].send("go")
        pipes[dead] = ctx.Pipe()
        procs.append(ctx.Process(target=rejoining_rank, args=(dead, cfg, server.url, pipes[dead][1], "newcomer", provider, masked_step)))
        procs[-1].start()
        for r in range(ranks):
            assert pipes[r][0].poll(240), f"rank {r} did not finish"
            reply = pipes[r][0].recv()
            assert reply == "ok", reply
        for r in range(ranks):
            pipes[r][0].send("close")
    finally:
        for p in procs:
            p.join(30)
            if p.is_alive():
                p.kill()
        server.close()


class ShadowedMemory:
    """A host stand-in for ``xfer.ep.gpu.DeviceMemory``'s seam: the registered region is one
    array (the "device"), the group's stages see a host shadow reached only through ``fetch`` /
    ``publish`` / ``copy``, and ``release`` frees a region by name. A stage or a clean that went
    around the seam reads poison or stale bytes."""

    def __init__(self):
        self.device = {}

    def register(self, engine, name, nbytes, access):
        self.device[name] = np.full(nbytes, 0xA5, dtype=np.uint8)
        return np.full(nbytes, 0xA5, dtype=np.uint8), engine.reg_mr(self.device[name], access=access)

    def fetch(self, regions, name, lo, hi):
        regions[name][lo:hi] = self.device[name][lo:hi]

    def publish(self, regions, name, lo, hi):
        self.device[name][lo:hi] = regions[name][lo:hi]

    def copy(self, regions, dst, dst_off, src, src_off, n):
        self.device[dst][dst_off:dst_off + n] = self.device[src][src_off:src_off + n]

    def release(self, engine, name, mr):
        engine.dereg_mr(mr)
        del self.device[name]


def test_a_rank_rejoins_survivors_whose_regions_live_behind_a_memory_seam():
    """The survivors' regions in "device" memory (``ShadowedMemory``, as ``DeviceMemory``
    keeps them): the clean registers their new regions through the seam, so the newcomer's
    writes land where the stages fetch from; the steps after the rejoin are exact."""
    cfg = dataclasses.replace(failure_cfg(3), tag=3)
    dead = 2
    rs = Ranks(cfg, connect=False)
    try:
        for r in range(3):
            rs.groups[r].close()
            rs.groups[r] = EpGroup(rs.engines[r], r, cfg, memory=ShadowedMemory())
        rs.connect()

        def body(r, g):
            check_step(g, r, cfg, [oracle.inputs(67, 0, s, cfg) for s in range(3)])
            if r == dead:
                die(rs, r, g)
                return
            survivors_run(cfg, g, r, dead, 1, 1, 67)

        rs.run(body)
        rs.clean(rejoin=(dead,))
        assert set(rs.groups[0]._memory.device) == {"send", "dispatch", "combine_send", "combine"}

        def after(r, g):
            for step in (2, 3):
                check_step(g, r, cfg, [oracle.inputs(67, step, s, cfg) for s in range(3)])
            assert list(g.query_active_mask()) == [1, 1, 1]

        rs.run(after)
    finally:
        rs.close()
