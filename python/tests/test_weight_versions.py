"""xfer.weights: versions are all-or-nothing across ranks, whoever starts late or loses a
message, however long the version takes under the engine's stock timeouts; and the control
channel acts only on its members' messages (issue 56's probes: a third engine forging
verdicts, READYs and DONE reports, a huge MANIFEST).

Nothing here is timed: a stagger or a blocked sender is released by a condition (a deadline
passed, an expectation expired), and every assertion is about outcomes."""

import hashlib
import os
import struct
import threading
import time

import numpy as np
import pytest

import xfer
from conftest import MOCK
from test_weights import Cluster, check_received, full_tensors, tp2_fused_layout
from xfer import weights as W

# The engine's stock timeouts (expect_ms 10 s, transfer_ms 5 s): the conftest's MOCK raises them.
STOCK = {k: v for k, v in MOCK.items() if k != "timeouts"}


def wait_for(condition, bound=120.0, what="a condition"):
    """Returns once ``condition()`` holds (checked every 20 ms); fails past ``bound`` seconds
    (a hang guard, not a timing assertion)."""
    end = time.monotonic() + bound
    while not condition():
        assert time.monotonic() < end, f"{what} never held"
        time.sleep(0.02)


def all_or_none(results):
    outcomes = {e is None for e in results.values()}
    assert len(outcomes) == 1, f"some ranks applied the version and some did not: {results}"
    return outcomes.pop()


def test_a_receiver_started_early_takes_the_coordinators_deadline():
    # Receiver 0 starts alone; the others start once half its own timeout passed, and the
    # senders' data are gathered only after its own deadline: it must wait as long as the
    # coordinator does (the MANIFEST carries the time left), not give up on its own clock.
    c = Cluster(tp2_fused_layout(), 2, 2, timeout=6.0, grace=1.0)
    try:
        full = full_tensors(c.layout, 100)
        start = []

        def then():
            start.append(time.monotonic())
            wait_for(lambda: time.monotonic() > start[0] + 3.0)

        def gathered_late(name, x):
            wait_for(lambda: time.monotonic() > start[0] + 6.2, what="receiver 0's own deadline")
            return x

        results = c.version(0, full, first=("r", 0), then=then, transform=gathered_late)
        assert all_or_none(results), results
        check_received(c, full)
    finally:
        c.close()


def lose_first_verdict(member):
    """The first VERDICT for this member is lost on the way (a dropped datagram)."""
    handle = member.control.handle
    lost = []

    def lossy(raw, sender=b""):
        if not lost and len(raw) > 3 and raw[3] == 4:  # the header's kind byte: VERDICT
            lost.append(raw)
            return None
        return handle(raw, sender)

    member.control.handle = lossy
    return lost


def test_a_rank_that_misses_the_commit_asks_for_it_and_applies():
    c = Cluster(tp2_fused_layout(), 2, 2, timeout=20.0, grace=0.5)
    try:
        lost = lose_first_verdict(c.receivers[1])
        full = full_tensors(c.layout, 110)
        results = c.version(0, full)
        assert lost, "the probe lost no verdict"
        assert all_or_none(results), results
        check_received(c, full)
        # And the next version, with nothing lost, too.
        full = full_tensors(c.layout, 111)
        assert all_or_none(c.version(1, full))
        check_received(c, full)
    finally:
        c.close()


def test_an_unreachable_coordinator_leaves_a_rank_in_doubt_not_deciding():
    # The coordinator's verdict never reaches receiver 1 and its QUERYs go unanswered: it
    # must not claim success, nor failure of a version the others applied: VersionInDoubt.
    c = Cluster(tp2_fused_layout(), 2, 2, timeout=2.0, grace=0.3)
    try:
        handle = c.receivers[1].control.handle
        c.receivers[1].control.handle = lambda raw, sender=b"": None if raw[3] == 4 else handle(raw, sender)
        results = c.version(0, full_tensors(c.layout, 120))
        assert isinstance(results[("r", 1)], W.VersionInDoubt), results
        assert results[("r", 0)] is None and results[("s", 0)] is None
    finally:
        c.close()


def test_a_version_longer_than_the_engines_stock_expect_ms_completes():
    # Stock engine timeouts (expect_ms 10 s): the senders' data are gathered only after the
    # receivers' first expectation expired in the engine; the version's own timeout (60 s)
    # is what counts.
    c = Cluster(tp2_fused_layout(), 2, 2, timeout=60.0, config=STOCK)
    try:
        full = full_tensors(c.layout, 130)
        imm = c.receivers[0].data_imm(0)
        receiver_engine = c.engines[2]

        def gathered_slowly(name, x):
            wait_for(lambda: receiver_engine.imm_owed(imm) > 0, what="the engine's expectation to expire")
            return x

        results = c.version(0, full, transform=gathered_slowly)
        assert all_or_none(results), results
        check_received(c, full)
    finally:
        c.close()


def test_receivers_count_the_immediates_as_their_senders_stripe():
    # The senders' [stripe] config is not the receivers' (each side configured on its own): a
    # 128 KiB write is one immediate from a sender that stripes nothing under 1 MiB, where the
    # receiver's own config would say two. The senders tell each receiver what they send.
    unstriped = {**MOCK, "stripe": {"min_stripe_len": 1 << 20}}
    tensors = (W.TensorSpec("a", (32768,), "float32"), W.TensorSpec("b", (64, 1024), "float32"))
    layout = W.Layout.replicated(tensors, 2, 2)
    c = Cluster(layout, 2, 2, timeout=10.0, config=unstriped, receiver_config=MOCK)
    try:
        assert c.engines[0].expected_arrivals(1 << 17) == 1 and c.engines[2].expected_arrivals(1 << 17) == 2
        for v in range(2):
            full = {t.name: np.random.default_rng(v).standard_normal(t.shape).astype(np.float32) for t in tensors}
            results = c.version(v, full, data=lambda s, f=full: {s * 2 + i: f[t.name] for i, t in enumerate(tensors)})
            assert all_or_none(results), results
            for rc in c.receivers:
                for t in tensors:
                    assert np.array_equal(rc.params[t.name].view(np.float32).reshape(t.shape), full[t.name])
    finally:
        c.close()


def test_a_membership_change_on_the_same_engines():
    # 1 -> 2 -> 1 receivers: each membership a new group member on the same engines (one
    # receive pool per engine, shared by the members it has been).
    server = xfer.Server()
    rdv = xfer.Rendezvous(server.url)
    engines = [xfer.TransferEngine(MOCK) for _ in range(3)]
    try:
        for step, n in enumerate((1, 2, 1)):
            tensors = (W.TensorSpec("a", (64,), "float32"), W.TensorSpec("b", (3, 5), "float16"))
            layout = W.Layout.replicated(tensors, 1, n)
            sender = W.WeightSender(engines[0], rdv, "m", 0, 1, n, timeout=10.0, grace=1.0)
            receivers = [W.WeightReceiver(engines[1 + r], rdv, "m", r, 1, n, timeout=10.0, grace=1.0) for r in range(n)]
            rng = np.random.default_rng(step)
            data = {i: rng.standard_normal(t.shape).astype(t.dtype) for i, t in enumerate(tensors)}
            errors = []

            def run(fn):
                try:
                    fn()
                except Exception as e:  # noqa: BLE001
                    errors.append(e)

            threads = [threading.Thread(target=run, args=(lambda: sender.send(step, layout, data),))]
            threads += [threading.Thread(target=run, args=(lambda rc=rc: rc.receive(step),)) for rc in receivers]
            for t in threads:
                t.start()
            for t in threads:
                t.join(60)
            assert not errors, errors
            for rc in receivers:
                assert np.array_equal(rc.params["a"].view(np.float32), data[0])
            for m in [sender, *receivers]:
                m.close()
    finally:
        for e in engines:
            e.close()
        server.close()


# --- issue 56's probes: a third engine, not a member, sends what a member would ---------


def forged(kind, version, sender, payload, new_payload=None, group="w"):
    """The message in both framings the protocol has had (the old one: magic, kind, u32
    version, sender; the current one adds the group's tag and a session nonce, here a guess),
    each with its payload."""
    old = struct.pack("<2sBIi", b"XW", kind, version, sender) + payload
    tag = hashlib.sha256(group.encode()).digest()[:8]
    new = struct.pack("<2sBBQI8s16s", b"XW", 2, kind, version, sender, tag, os.urandom(16))
    return [old, new + (payload if new_payload is None else new_payload)]


def send_all(attacker, addr, messages):
    for m in messages:
        attacker.submit_send(addr, m).wait(5)


def test_probe_a_forged_verdict_does_not_complete_a_failed_version():
    c = Cluster(tp2_fused_layout(), 2, 2, timeout=30.0)
    attacker = xfer.TransferEngine(MOCK)
    try:
        assert all_or_none(c.version(0, full_tensors(c.layout, 200)))
        # Version 1 fails on its merits (trainer rank 1 never sends); the attacker sends
        # every other member a positive verdict for it, ahead of time.
        for e in c.engines:
            send_all(attacker, e.main_address, forged(4, 1, 0, b"\x01"))
        c.timeout(1.5)
        results = c.version(1, full_tensors(c.layout, 201), skip_sender=1)
        assert all(isinstance(e, W.VersionFailed) for e in results.values()), results
    finally:
        attacker.close()
        c.close()


def test_probe_a_forged_ready_does_not_make_a_sender_write_elsewhere():
    c = Cluster(tp2_fused_layout(), 2, 2, timeout=1.5)
    attacker = xfer.TransferEngine(MOCK)
    trap = np.zeros(4096, dtype=np.uint8)
    region = attacker.reg_mr(trap)
    try:
        # Receiver 1 never joins version 0; the attacker claims its place (in both framings).
        desc = bytes(region.desc)
        for s in range(2):
            send_all(attacker, c.engines[s].main_address,
                     forged(2, 0, 3, desc, c.layout.digest() + b"\x00" + desc))
        results = c.version(0, full_tensors(c.layout, 210), skip_receiver=1)
        assert not trap.any(), "a sender wrote into the attacker's memory"
        assert all(isinstance(e, W.VersionFailed) for e in results.values()), results
    finally:
        region.dereg()
        attacker.close()
        c.close()


def test_probe_pre_sent_done_reports_do_not_decide_a_version():
    c = Cluster(tp2_fused_layout(), 2, 2, timeout=30.0)
    attacker = xfer.TransferEngine(MOCK)
    try:
        assert all_or_none(c.version(0, full_tensors(c.layout, 220)))
        ok = b"\x01" + c.layout.digest()
        for member in (1, 2, 3):
            send_all(attacker, c.engines[0].main_address, forged(3, 1, member, ok))
        c.timeout(1.5)
        results = c.version(1, full_tensors(c.layout, 221), skip_sender=1)
        assert all(isinstance(e, W.VersionFailed) for e in results.values()), results
    finally:
        attacker.close()
        c.close()


def test_probe_a_huge_manifest_allocates_nothing():
    # From a non-member: refused before it is read (no nonce). From the coordinator itself
    # (a member gone wrong): the receiver's max_bytes refuses it before allocating.
    c = Cluster(tp2_fused_layout(), 2, 2, timeout=1.5)
    attacker = xfer.TransferEngine(MOCK)
    try:
        huge = W.Layout((W.TensorSpec("x", (1 << 40,), "uint8"),), ((0, "x", None),), ((0, "x", (1 << 40,), (("x", None, (0,)),)),))
        raw = huge.to_json()
        from xfer.weights import protocol as P

        chunk = P.manifest_payload(0, 1, 60_000, huge.digest(), len(raw), raw)
        receiver = c.receivers[0]
        before = receiver.control.refused
        send_all(attacker, c.engines[2].main_address, forged(1, 0, 0, chunk))
        wait_for(lambda: receiver.control.refused >= before + 1, what="the forged MANIFEST to be refused")
        assert receiver.buffer is None
        # The real coordinator, with a layout past this receiver's bound.
        receiver.max_bytes = 100
        results = c.version(0, full_tensors(c.layout, 230))
        assert "max_bytes" in str(results[("r", 0)]), results
        assert receiver.buffer is None
        assert all(isinstance(e, W.VersionFailed) for e in results.values()), results
    finally:
        attacker.close()
        c.close()


def nonce_of(c, name):
    """A member's session nonce as anyone who reads the group's records reads it."""
    regions = dict(c.rdv.lookup(name, 5.0)["regions"])
    return bytes.fromhex(next(n for n in regions if n.startswith("nonce."))[len("nonce."):])


def real(kind, version, sender, nonce, payload, group="w"):
    tag = hashlib.sha256(group.encode()).digest()[:8]
    return struct.pack("<2sBBQI8s16s", b"XW", 2, kind, version, sender, tag, nonce) + payload


def test_probe_messages_pre_sent_with_the_real_nonces_before_first_contact_are_not_acted_on():
    # The attacker reads every member's nonce from the rendezvous and, before any member has
    # met trainer rank 1, sends the coordinator DONE(ok) and each receiver COUNT(0) in rank
    # 1's name: version 0 must fail (rank 1 sent nothing), not commit.
    c = Cluster(tp2_fused_layout(), 2, 2, timeout=1.5)
    attacker = xfer.TransferEngine(MOCK)
    try:
        ok = b"\x01" + c.layout.digest()
        send_all(attacker, c.engines[0].main_address, [real(3, 0, 1, nonce_of(c, "w.s0"), ok)])
        for r in range(2):
            send_all(attacker, c.engines[2 + r].main_address, [real(6, 0, 1, nonce_of(c, f"w.r{r}"), struct.pack("<Q", 0))])
        results = c.version(0, full_tensors(c.layout, 240), skip_sender=1)
        assert all(isinstance(e, W.VersionFailed) for e in results.values()), results
    finally:
        attacker.close()
        c.close()


def test_probe_a_verdict_pre_sent_with_the_real_nonces_before_first_contact_is_not_acted_on():
    c = Cluster(tp2_fused_layout(), 2, 2, timeout=1.5)
    attacker = xfer.TransferEngine(MOCK)
    try:
        for r in range(2):
            send_all(attacker, c.engines[2 + r].main_address, [real(4, 0, 0, nonce_of(c, f"w.r{r}"), b"\x01")])
        results = c.version(0, full_tensors(c.layout, 250), skip_sender=1)
        assert all(isinstance(e, W.VersionFailed) for e in results.values()), results
    finally:
        attacker.close()
        c.close()


def test_probe_far_versions_do_not_close_the_inbox_to_real_ones():
    # Messages for versions 2^40 and 2^40 + 1 with a member's id and real nonce, as a reader
    # of the rendezvous sends them where the engine proves no sender (the handler called
    # with none, as a stranger's first message on EFA/libfabric without a secret arrives),
    # must not crowd out versions 1 and 2 for good.
    c = Cluster(tp2_fused_layout(), 2, 2, timeout=30.0)
    try:
        assert all_or_none(c.version(0, full_tensors(c.layout, 260)))
        members = c.senders + c.receivers
        for i, m in enumerate(members):
            kind, who = (3, 1) if i == 0 else ((4, 0) if i == 1 else (6, 1))
            payload = {3: b"\x01" + c.layout.digest(), 4: b"\x01", 6: struct.pack("<Q", 0)}[kind]
            for v in (1 << 40, (1 << 40) + 1):
                m.control.handle(real(kind, v, who, m.nonce, payload), b"")
        for v in (1, 2):
            full = full_tensors(c.layout, 260 + v)
            assert all_or_none(c.version(v, full)), v
            check_received(c, full)
    finally:
        c.close()


def test_a_message_in_the_name_of_a_member_not_yet_looked_up_is_held_until_its_record_is():
    # Before this rank has the coordinator's record: a VERDICT in its name from another
    # address is held aside (not acted on, not in the real one's place), then refused once
    # the record is known; the real one, held likewise, is then kept.
    c = Cluster(tp2_fused_layout(), 1, 1, timeout=5.0)
    try:
        control = c.receivers[0].control
        wait_for(lambda: 0 in control.addresses, what="group formation")
        real_addr = control.addresses.pop(0)
        control.handle(real(4, 0, 0, c.receivers[0].nonce, b"\x01"), b"attacker")
        control.handle(real(4, 0, 0, c.receivers[0].nonce, b"\x00no"), real_addr)
        assert control.inbox.get(4, 0) == [] and len(control.held) == 2
        before = control.refused
        control.learn(0, real_addr)
        assert control.refused == before + 1 and not control.held
        assert [m.payload for m in control.inbox.get(4, 0)] == [b"\x00no"]
    finally:
        c.close()
