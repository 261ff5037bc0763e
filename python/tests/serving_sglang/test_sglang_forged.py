"""Forged control messages against a real prefill / decode pair of xfer's SGLang backend
(issue 56): a third engine sends ``meta``, ``stop`` (abort), ``done``, ``fail`` and abort
answers for a live room. Over the mock backend the transport proves who sent a message, so
this third engine knows everything a wire sniffer or a bootstrap reader could — the decode
rank's key from its record, the room's token — and is still refused: its engine is not the
one the records name. (The same pair over libfabric shm, where no sender is proven and the
token alone vouches, is ``test_sglang_queues.py``'s forged-messages test.)

Each probe waits for the refusal to be counted (``mgr.dropped``) or for its effect, then
checks there was none: the transfer succeeds with the right bytes in the right pages, nothing
else in the decode's buffers changes, the room is not ended early."""

import threading

import numpy as np
import pytest

pytest.importorskip("sglang")

from sglang.srt.disaggregation.base.conn import KVPoll  # noqa: E402
from sglang.srt.disaggregation.utils import DisaggregationMode  # noqa: E402
from test_sglang_backend import MOCK, PAGE_BYTES, Side, bootstrap, registered, until  # noqa: E402,F401

import xfer  # noqa: E402
import xfer.sglang as xs  # noqa: E402
from xfer.kv import sglang_control as sc  # noqa: E402

ROOM = 91
SRC, DST = [3, 9, 4, 20], [30, 2, 17, 5]
FORGED_PAGES = [7, 8, 9, 10]


def open_room(p, d, bootstrap, room=ROOM):
    """A room between prefill ``p`` and decode ``d``: the decode's receiver sent its page
    indices (``DST``), the prefill's sender has them."""
    receiver = xs.XferKVReceiver(d.mgr, bootstrap, room)
    receiver.init(0)
    sender = xs.XferKVSender(p.mgr, bootstrap, room)
    sender.init(len(SRC), aux_index=2)
    receiver.send_metadata(np.array(DST, dtype=np.int32), aux_index=5)
    until("the page indices", lambda: sender.poll() != KVPoll.Bootstrapping)
    assert sender.poll() == KVPoll.WaitingForInput, sender.failure
    return receiver, sender


def finish_room(sender, receiver, what="the receiver"):
    """The prefill sends the room's pages (``SRC``); the decode's receiver succeeds."""
    sender.send(np.array(SRC, dtype=np.int32))
    until(what, lambda: receiver.poll() == KVPoll.Success)


def pair(bootstrap):
    p = Side(DisaggregationMode.PREFILL, bootstrap, 11)
    d = Side(DisaggregationMode.DECODE, bootstrap, 12)
    return (p, d, *open_room(p, d, bootstrap))


class Attacker:
    """A third engine that read the bootstrap: every address, the decode rank's key."""

    def __init__(self, bootstrap, d):
        self.engine = xfer.TransferEngine(MOCK)
        rdv = xfer.Rendezvous(f"xfer://{bootstrap}")
        self.prefill = rdv.lookup("sglang.prefill.0.0", 5.0)
        self.decode_name = f"sglang.decode.{d.mgr.id}.0"
        self.decode = rdv.lookup(self.decode_name, 5.0)
        self.key = sc.key_of(self.decode) or sc.new_key()

    def send(self, to, data):
        self.engine.submit_send(bytes(to["addr"]), data).wait(5.0)

    def close(self):
        self.engine.close()


def token(receiver):
    """The room's token, as a wire sniffer would have it."""
    return getattr(receiver, "token", None) or sc.new_token()


def dropped(mgr):
    return getattr(mgr, "dropped", 0)


def test_forged_meta_and_abort_with_the_key_and_token_from_another_engine_change_nothing(bootstrap):
    p, d, receiver, sender = pair(bootstrap)
    evil = Attacker(bootstrap, d)
    try:
        before = [k.copy() for k in d.kv]
        taken = dict(p.mgr.metadata[ROOM])
        # The decode rank's own meta, pointed at other pages, proven with its key.
        forged = sc.Meta(room=ROOM, token=token(receiver), decode=evil.decode_name, to=0, rank=0,
                         tp=1, heads=d.mgr.shape.heads, item=PAGE_BYTES, prefix=0,
                         aux_index=1, aux=True, pages=np.array(FORGED_PAGES))
        evil.send(evil.prefill, forged.encode(evil.key))
        evil.send(evil.prefill, sc.Abort(ROOM, token(receiver), evil.decode_name, 0).encode(evil.key))
        until("the forgeries refused or taken",
              lambda: dropped(p.mgr) >= 2 or p.mgr.metadata.get(ROOM) != taken
              or sender.poll() == KVPoll.Failed)
        assert sender.poll() == KVPoll.WaitingForInput, "a forged abort stopped the sender"
        assert p.mgr.metadata[ROOM] == taken, "a forged meta replaced the decode's pages"

        sender.send(np.array(SRC[:2], dtype=np.int32))
        sender.send(np.array(SRC[2:], dtype=np.int32))
        until("the sender", lambda: sender.poll() == KVPoll.Success)
        until("the receiver", lambda: receiver.poll() == KVPoll.Success)
        for ours, theirs, old in zip(d.kv, p.kv, before):
            for s, t in zip(SRC, DST):
                assert np.array_equal(ours[t * PAGE_BYTES:(t + 1) * PAGE_BYTES],
                                      theirs[s * PAGE_BYTES:(s + 1) * PAGE_BYTES])
            rest = np.ones(len(ours), dtype=bool)
            for t in DST:
                rest[t * PAGE_BYTES:(t + 1) * PAGE_BYTES] = False
            assert np.array_equal(ours[rest], old[rest]), "written outside the room's pages"
    finally:
        evil.close(), p.close(), d.close()


def test_forged_done_fail_and_abort_answers_do_not_end_a_room(bootstrap):
    p, d, receiver, sender = pair(bootstrap)
    evil = Attacker(bootstrap, d)
    try:
        # Sniffed token, the prefill rank's number, another engine.
        for kind in (sc.DONE, sc.FAIL, sc.ABORT_ACK):
            evil.send(evil.decode, sc.Answer(kind, ROOM, token(receiver), 0, "forged").encode())
        # No token: what anyone who can address the engine can send.
        for kind in (sc.DONE, sc.FAIL):
            evil.send(evil.decode, sc.Answer(kind, ROOM, "00" * 16, 0, "forged").encode())
        until("the forgeries refused or taken",
              lambda: dropped(d.mgr) >= 5 or receiver.poll() != KVPoll.Transferring)
        assert receiver.poll() == KVPoll.Transferring, receiver.failure
        finish_room(sender, receiver)
    finally:
        evil.close(), p.close(), d.close()


def test_a_forged_abort_answer_does_not_release_held_pages_early(bootstrap):
    """The decode aborts a room while the prefill rank cannot answer yet (its two drain
    threads busy): a forged answer, with the room's token, from another engine, does not make
    ``is_abort_release_safe`` true; the prefill rank's own answer then does."""
    p, d, receiver, sender = pair(bootstrap)
    evil = Attacker(bootstrap, d)
    gate = threading.Event()
    busy = [p.mgr.draining.submit(gate.wait, 30) for _ in range(2)]
    try:
        receiver.abort()
        assert not d.mgr.is_abort_release_safe(ROOM, 1)
        evil.send(evil.decode, sc.Answer(sc.ABORT_ACK, ROOM, token(receiver), 0).encode())
        until("the forged answer refused or taken",
              lambda: dropped(d.mgr) >= 1 or d.mgr.is_abort_release_safe(ROOM, 1))
        assert not d.mgr.is_abort_release_safe(ROOM, 1), "released on a forged answer"
        gate.set()
        until("the prefill rank's answer", lambda: d.mgr.is_abort_release_safe(ROOM, 1))
        assert sender.poll() == KVPoll.Failed
    finally:
        gate.set()
        for f in busy:
            f.result(30)
        evil.close(), p.close(), d.close()


def test_a_meta_naming_no_decode_at_this_bootstrap_is_dropped_without_a_lookup_on_the_callback_thread(
        bootstrap, monkeypatch):
    """Messages naming decode ranks the prefill has not met wait for their lookups off the
    engine's callback thread, at most ``MAX_CHECKS`` of them; the rest are dropped at once."""
    monkeypatch.setattr(xs, "MAX_CHECKS", 8)
    p, d, receiver, sender = pair(bootstrap)
    evil = Attacker(bootstrap, d)
    try:
        start = dropped(p.mgr)
        n = 3 * xs.MAX_CHECKS
        for i in range(n):
            ghost = sc.Meta(room=ROOM + 1 + i, token="ee" * 16,
                            decode=f"sglang.decode.{i:012x}.0", to=0, rank=0, tp=1, heads=2,
                            item=PAGE_BYTES, prefix=0, aux_index=None, aux=False,
                            pages=np.array([1]))
            evil.send(evil.prefill, ghost.encode("ee" * 16))
        # A real request still goes through meanwhile.
        finish_room(sender, receiver)
        until("every ghost dropped", lambda: dropped(p.mgr) - start >= n)
        assert p.mgr.checks == 0
        assert set(p.mgr.metadata) <= {ROOM}, "a ghost's room holds state"
    finally:
        evil.close(), p.close(), d.close()


def test_rooms_no_sender_took_make_way_for_new_ones_past_the_bound(bootstrap, monkeypatch):
    """A prefill rank holds indices for at most ``MAX_ROOMS`` rooms; past it the oldest room
    no sender of its took is forgotten (its request never came to this rank), never a room a
    sender is serving, so orphans cannot shut out new rooms."""
    monkeypatch.setattr(xs, "MAX_ROOMS", 3)
    p, d, receiver, sender = pair(bootstrap)  # ROOM: taken by a live sender
    try:
        orphans = []
        for room in (201, 202, 203):
            rx = xs.XferKVReceiver(d.mgr, bootstrap, room)
            rx.init(0)
            rx.send_metadata(np.array([1], dtype=np.int32))
            orphans.append(rx)
            until(f"room {room}'s indices", lambda room=room: room in p.mgr.metadata)
        assert set(p.mgr.metadata) == {ROOM, 202, 203}
        finish_room(sender, receiver)
    finally:
        p.close(), d.close()


def test_a_decode_publishes_nothing_at_a_bootstrap_a_request_names_that_it_was_not_told_of(
        bootstrap, monkeypatch):
    """Review H1 (issue 56): SGLang takes a request's bootstrap address from its API client.
    An attacker serving its own rendezvous with a valid prefill record, on an address the
    operator did not list (``$XFER_SGLANG_PREFILL_BOOTSTRAPS``), gets neither the decode
    rank's key nor its writable KV descriptors; that request fails, naming why; a request to
    the listed prefill still succeeds."""
    monkeypatch.setenv("XFER_SGLANG_PREFILL_BOOTSTRAPS", bootstrap)
    p = Side(DisaggregationMode.PREFILL, bootstrap, 11)
    d = Side(DisaggregationMode.DECODE, bootstrap, 12)
    evil_server = xfer.Server("127.0.0.1:0")
    evil_addr = evil_server.url.removeprefix("xfer://")
    evil = xfer.TransferEngine(MOCK)
    layout = np.zeros(64, dtype=np.uint8)
    region = evil.reg_mr_raw(layout.ctypes.data, layout.nbytes, access="read")
    real = xfer.Rendezvous(f"xfer://{bootstrap}").lookup("sglang.prefill.0.0", 5.0)
    rdv = xfer.Rendezvous(evil_server.url)
    record = rdv.publish("sglang.prefill.0.0", evil.main_address,
                         {next(iter(real["regions"])): region.desc})
    try:
        assert d.mgr.try_ensure_parallel_info(evil_addr)  # answered: the request fails at init
        rx = xs.XferKVReceiver(d.mgr, evil_addr, 55)
        rx.init(0)
        assert rx.poll() == KVPoll.Failed
        with pytest.raises(RuntimeError, match="XFER_SGLANG_PREFILL_BOOTSTRAPS"):
            rx.failure_exception()
        with pytest.raises(Exception):
            rdv.lookup(f"sglang.decode.{d.mgr.id}.0", 0.5)
        assert evil_addr not in d.mgr.rendezvous, "the decode dialled the attacker's bootstrap"
        # The listed prefill still serves.
        receiver, sender = open_room(p, d, bootstrap)
        finish_room(sender, receiver)
    finally:
        record.unpublish()
        evil.close(), evil_server.close(), p.close(), d.close()


def test_bootstraps_a_decode_may_dial():
    """Unset: loopback only (a request cannot send a decode's key off its host); a list: only
    those; ``*``: any (the operator's choice, stated)."""
    allowed = xs.dialable_bootstraps
    assert allowed("127.0.0.1:8998", None) and allowed("[::1]:1", None)
    assert allowed("localhost:5", None)
    assert not allowed("10.0.0.5:8998", None) and not allowed("evil.example:8998", None)
    assert allowed("10.0.0.5:8998", "10.0.0.5:8998, 10.0.0.6:8998")
    assert not allowed("127.0.0.1:8998", "10.0.0.5:8998")
    assert not allowed("10.0.0.7:8998", "10.0.0.5:8998,10.0.0.6:8998")
    assert allowed("203.0.113.9:1", "*")


def test_an_abort_from_another_decode_with_its_own_key_neither_stops_a_room_nor_pre_aborts_one(
        bootstrap):
    """Review M3 (issue 56): decode X, with a record and key of its own at the bootstrap,
    sends proven aborts for a room whose indices came from decode Y: naming a decode rank the
    room holds no indices for, and naming Y's rank with the room's (sniffed) token. Neither
    stops Y's room. X's abort of a room id before its decode sent anything does not keep the
    real decode's room from being served."""
    p, d, receiver, sender = pair(bootstrap)
    x = Side(DisaggregationMode.DECODE, bootstrap, 13)
    try:
        own = xs.XferKVReceiver(x.mgr, bootstrap, 300)  # publishes X's record and key
        own.init(0)
        addr = bytes(own.prefills[0]["addr"])
        start = dropped(p.mgr)
        unbound = sc.new_token()
        for rank, tok in ((1, unbound), (0, token(receiver))):
            abort = sc.Abort(ROOM, tok, own.record, rank).encode(x.mgr.key)
            x.mgr.engine.submit_send(addr, abort).wait(5.0)
        # The first is held bound to X's own (absent) indices, the second refused.
        until("the aborts refused or taken",
              lambda: (dropped(p.mgr) - start >= 1
                       and (ROOM, own.record, unbound) in getattr(p.mgr, "pre_aborted", {}))
              or sender.poll() == KVPoll.Failed)
        assert sender.poll() == KVPoll.WaitingForInput, "another decode's abort stopped the room"
        # A room id X never sent indices for, aborted ahead of its real decode.
        x.mgr.engine.submit_send(addr, sc.Abort(ROOM + 1, sc.new_token(), own.record, 0)
                                 .encode(x.mgr.key)).wait(5.0)
        finish_room(sender, receiver)

        later, s2 = open_room(p, d, bootstrap, ROOM + 1)
        finish_room(s2, later, "the pre-aborted room's receiver")
    finally:
        x.close(), p.close(), d.close()


def test_a_bootstrap_a_request_names_is_tried_once_per_scheduler_attempt(bootstrap):
    """Review M-D (issue 56): SGLang's decode queue calls ``try_ensure_parallel_info`` on its
    scheduler thread, once a second up to 15 times an address a request names. A listener that
    answers nothing a rendezvous client can use (here: it closes each connection at once) was
    dialled again and again for 2 s on every attempt, stalling the scheduler for everyone;
    an attempt now connects once (SGLang's own retry is the retry)."""
    import socket

    d = Side(DisaggregationMode.DECODE, bootstrap, 12)
    listener = socket.socket()
    listener.bind(("127.0.0.1", 0))
    listener.listen(16)
    addr = "127.0.0.1:%d" % listener.getsockname()[1]
    accepted = []

    def serve():
        while True:
            try:
                conn, peer = listener.accept()
            except OSError:
                return
            accepted.append(peer)
            conn.close()

    server = threading.Thread(target=serve, daemon=True)
    server.start()
    try:
        assert not d.mgr.try_ensure_parallel_info(addr), "nothing serves there"
        # Connections are accepted in order: once this one is, every dial before it was.
        with socket.create_connection(listener.getsockname()) as sentinel:
            mine = sentinel.getsockname()
            until("the sentinel connection", lambda: mine in accepted)
        dials = accepted.index(mine)
        assert dials == 1, f"one attempt dialled {dials} times"
    finally:
        listener.close()
        d.close()
