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

import socket
import threading
from types import SimpleNamespace
from unittest.mock import MagicMock

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
WAIT_S = 20.0


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


class Listener:
    """A TCP listener at an address a request may name (loopback: dialable by default) that
    accepts and never writes a byte. ``close_at_once``: it closes each connection as it
    accepts it; else it holds them open (a silent bootstrap) until :meth:`close`."""

    def __init__(self, close_at_once=False):
        self.sock = socket.socket()
        self.sock.bind(("127.0.0.1", 0))
        self.sock.listen(64)
        self.addr = "127.0.0.1:%d" % self.sock.getsockname()[1]
        self.peers, self.conns = [], []
        self.accepted = threading.Event()
        self.close_at_once = close_at_once
        threading.Thread(target=self._serve, daemon=True).start()

    def _serve(self):
        while True:
            try:
                conn, peer = self.sock.accept()
            except OSError:
                return
            if self.close_at_once:
                conn.close()
            else:
                self.conns.append(conn)
            self.peers.append(peer)
            self.accepted.set()

    def dials_before_a_sentinel(self):
        """How many connections were accepted before one made now (accepts come in order:
        once the sentinel is, every dial before it was)."""
        with socket.create_connection(self.sock.getsockname()) as sentinel:
            mine = sentinel.getsockname()
            until("the sentinel connection", lambda: mine in self.peers)
        return self.peers.index(mine)

    @staticmethod
    def hung_up(conn):
        """Whether the dialling side closed ``conn`` (what it wrote, its hello, is dropped)."""
        conn.setblocking(False)
        try:
            while conn.recv(4096):
                pass
            return True
        except BlockingIOError:
            return False

    def close(self):
        try:
            self.sock.shutdown(socket.SHUT_RDWR)  # wakes the accept (Linux)
        except OSError:
            pass
        self.sock.close()
        for c in self.conns:
            c.close()


def decode_queue(mgr):
    """SGLang 0.5.23's ``DecodePreallocQueue`` as its ``_ensure_prefill_info`` reads it: the
    manager, each address's last attempt and count, 15 attempts an address. Stand-in: the
    queue object (its spec), with the once-a-second pacing between attempts at 0, so each
    call is SGLang's next attempt; what that hides is only the second between them."""
    from sglang.srt.disaggregation.decode import DecodePreallocQueue

    queue = MagicMock(spec=DecodePreallocQueue)
    queue.kv_manager = mgr
    queue._ensure_last_attempt_time, queue._ensure_retry_count = {}, {}
    queue._ensure_retry_interval, queue._max_ensure_retries = 0.0, 15
    return queue


def pending(mgr, addr, room):
    """A request naming the bootstrap ``addr``, as SGLang's queue holds it while it waits for
    that prefill's topology: its ``DecodeRequest`` and the receiver the queue made at ``add``.
    Stand-in: the ``Req`` (only its id and room are read on this path)."""
    from sglang.srt.disaggregation.decode import DecodeRequest

    return DecodeRequest(req=SimpleNamespace(rid=f"r{room}", bootstrap_room=room),
                         kv_receiver=xs.XferKVReceiver(mgr, addr, room))


def attempt(queue, by_addr):
    """One scheduler pass of SGLang's own ``_ensure_prefill_info`` over the pending requests
    (``{addr: [DecodeRequest]}``), on the calling (scheduler) thread: the addresses ready, the
    requests left for the next pass."""
    from sglang.srt.disaggregation.decode import DecodePreallocQueue

    return DecodePreallocQueue._ensure_prefill_info(queue, by_addr)


def contacts_in_flight(mgr):
    return getattr(mgr, "contacts", {})


def test_a_silent_bootstrap_does_not_hold_the_scheduler_thread(bootstrap):
    """Review M-D (issue 56): SGLang's decode queue asks ``try_ensure_parallel_info`` on its
    scheduler thread, once a second up to 15 times, for each bootstrap address a request
    names (its API client's ``bootstrap_host``/``port``). A listener that accepts and never
    speaks held that thread for the rendezvous client's greeting read (5 s) on every attempt,
    stalling every request of the decode instance. Now the attempt answers "not yet" while the
    dial still waits for the greeting, off that thread, and the next attempts neither wait
    nor dial again while it does; the request keeps waiting (SGLang ends it after its tries)."""
    d = Side(DisaggregationMode.DECODE, bootstrap, 12)
    silent = Listener()
    queue = decode_queue(d.mgr)
    request = pending(d.mgr, silent.addr, 60)
    try:
        ready, left = attempt(queue, {silent.addr: [request]})
        assert not ready and left == [request], "answered while the bootstrap said nothing"
        assert silent.accepted.wait(WAIT_S), "never dialled"
        conn = silent.conns[0]
        # The dial waits for the greeting for 5 s; this follows the accept at once.
        assert not Listener.hung_up(conn), (
            "the attempt returned only after the dial gave up on the greeting: it waited on "
            "the scheduler thread")
        for _ in range(3):  # SGLang's next attempts while that dial waits
            ready, left = attempt(queue, {silent.addr: [request]})
            assert not ready and left == [request]
        assert d.mgr.contacts_made == 1, "dialled again while the first dial waited"
        assert request.kv_receiver.poll() == KVPoll.Bootstrapping
    finally:
        silent.close()
        d.close()


def test_a_bootstrap_whose_dial_failed_is_not_dialled_again_within_its_backoff(
        bootstrap, monkeypatch):
    """Review M-D (issue 56): each of SGLang's attempts dialled a request's bootstrap again
    (before b6b0686, 8 times an attempt in a 2 s retry loop; then once an attempt), 15
    attempts an address. A dial connects once, and its failure is remembered: within its
    backoff SGLang's next attempts answer "not yet" without a dial; after its 15 attempts
    SGLang ends the request (its receiver aborted)."""
    # Every attempt here falls within the backoff (raising=False: failing first, before it was).
    monkeypatch.setattr(xs, "CONTACT_BACKOFF_S", 3600.0, raising=False)
    d = Side(DisaggregationMode.DECODE, bootstrap, 12)
    closing = Listener(close_at_once=True)
    queue = decode_queue(d.mgr)
    request = pending(d.mgr, closing.addr, 61)
    try:
        ready, left = attempt(queue, {closing.addr: [request]})
        assert not ready and left == [request]
        until("the first dial over", lambda: closing.peers and not contacts_in_flight(d.mgr))
        for _ in range(14):  # SGLang's other 14 attempts
            ready, left = attempt(queue, {closing.addr: [request]})
            assert not ready
        assert left == [], "SGLang did not end the request after its 15 attempts"
        assert request.kv_receiver.poll() == KVPoll.Failed
        until("no contact in flight", lambda: not contacts_in_flight(d.mgr))
        dials = closing.dials_before_a_sentinel()
        assert dials == 1, f"dialled {dials} times in 15 attempts within its backoff"
        assert d.mgr.unreachable.failures == 1
    finally:
        closing.close()
        d.close()


def test_past_the_bound_on_first_contacts_a_request_naming_another_bootstrap_fails_by_name(
        bootstrap, monkeypatch):
    """First contacts in flight are bounded (``MAX_CONTACTS``, each on a thread of its own):
    with the bound taken by a silent bootstrap, a request naming another new one fails when
    SGLang next polls it (its queue polls every request it holds), naming the bound, without
    a dial; the first request still waits. Stand-in besides the queue's: SGLang's
    ``poll_and_all_reduce`` over one rank (each receiver's ``poll``, called here)."""
    monkeypatch.setattr(xs, "MAX_CONTACTS", 1, raising=False)
    d = Side(DisaggregationMode.DECODE, bootstrap, 12)
    silent, other = Listener(), Listener()
    queue = decode_queue(d.mgr)
    first, second = pending(d.mgr, silent.addr, 62), pending(d.mgr, other.addr, 63)
    try:
        ready, left = attempt(queue, {silent.addr: [first], other.addr: [second]})
        assert not ready and left == [first, second]
        # What SGLang's _update_handshake_waiters does next: poll each receiver.
        assert second.kv_receiver.poll() == KVPoll.Failed
        with pytest.raises(RuntimeError, match=r"MAX_CONTACTS"):
            second.kv_receiver.failure_exception()
        assert first.kv_receiver.poll() == KVPoll.Bootstrapping
        assert silent.accepted.wait(WAIT_S)
        assert other.dials_before_a_sentinel() == 0, "dialled past the bound"
    finally:
        silent.close(), other.close()
        d.close()


def test_a_failed_dials_backoff_doubles_and_ends():
    """``DialBackoff``, the pure table behind the above: doubling from the first backoff up to
    the cap, ended by a dial that gets through, the oldest failure forgotten past the bound."""
    b = xs.DialBackoff(1.0, 4.0, limit=2)
    assert b.waiting("a", 0.0) is None
    assert b.failed("a", 0.0, "refused") == 1.0
    assert "1 time " in b.waiting("a", 0.5) and "refused" in b.waiting("a", 0.5)
    assert b.waiting("a", 1.0) is None
    assert [b.failed("a", t, "x") for t in (1.0, 3.0, 7.0, 11.0)] == [2.0, 4.0, 4.0, 4.0]
    assert "5 times" in b.waiting("a", 11.0)
    b.succeeded("a")
    assert b.waiting("a", 11.0) is None and b.failed("a", 11.0, "x") == 1.0
    b.failed("b", 11.0, "x"), b.failed("c", 11.0, "x")
    assert b.waiting("a", 11.0) is None, "past the bound the oldest is forgotten"
    assert b.waiting("c", 11.0) is not None and b.failures == 8
