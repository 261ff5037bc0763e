"""xfer._vllm_push's PushSide against a stand-in of the worker's context: the push protocol's
decisions — which prefill ranks a decode rank asks, when a load ends and with what error, when
a prefill rank writes a layer, answers, cancels — with no engine, rendezvous or vLLM. Work the
component sends to the background runs at once; time is passed in (far from
``time.monotonic``'s, so a method reading the clock itself fails them). The connector's own
tests (``test_vllm_connector.py``) drive the same component through vLLM's classes and a
real engine.
"""

import logging
import random
import struct
import tracemalloc

import pytest

import xfer.kv.vllm_push

from xfer._kvcache import pack_message, unpack_message, view_of
from xfer.kv.control import ControlError, Header, block_ids_of
from xfer._vllm_push import (
    _CANCEL,
    _PUSHED,
    _WANT,
    MAX_PENDING,
    PushContext,
    PushSide,
    WaitTaken,
    _Await,
    block_ids_payload,
)
from xfer._vllm_records import Load, Peer

TIMEOUT = 60.0
FORGET = 120.0
START = 1000.0
"""When a test's decode rank asks for its push (a clock far from ``time.monotonic``'s)."""
LAYERS = ("model.layers.0.attn", "model.layers.1.attn")
TOKEN = "5" * 32
"""The request's token (the proxy's, in both instances' parameters)."""
FORGED = "f" * 32
MIB = 1 << 20


def hnd(heads, total_heads=2, blocks=16, tokens=16, content=8):
    """A layer view with heads outside tokens, as the connector asks vLLM for."""
    return view_of((blocks, heads, tokens, content),
                   (heads * tokens * content, tokens * content, content, 1), 2,
                   "torch.float16", 0, total_heads)


class Transfer:
    def __init__(self, on_done):
        self.on_done = on_done
        self.cancelled = False

    def cancel(self):
        self.cancelled = True
        return "cancelled"

    def wait(self, timeout=None):
        return None


class Worker:
    """What a PushSide is given: a recording engine, this rank's layers, a peer table, and the
    worker's load accounting as a list of events."""

    def __init__(self, engine_id, *, rank=0, tp=1, heads=2, model="m", peers=()):
        self.sent = []
        """(address, kind, header, block ids) of every message sent."""
        self.writes = []
        """(kwargs, Transfer) of every paged write submitted."""
        self.events = []
        """("done", load) for each done message queued, ("finish", req_id, error) per load."""
        self.layers = {name: (f"region-{engine_id}", hnd(heads)) for name in LAYERS}
        self.peers = dict(peers)
        self.push = PushSide(PushContext(
            engine=self, engine_id=engine_id, rank=rank, tp_size=tp, model=model,
            rendezvous_url=f"xfer://{engine_id}", push_timeout_s=TIMEOUT, forget_after_s=FORGET,
            layers=lambda: self.layers, peer=self.peer, shared_layers=self.shared_layers,
            is_draft_layer=lambda name: False, in_background=self.now,
            tell_done_soon=lambda load: self.events.append(("done", load)),
            finish_load=lambda req_id, load, error: self.events.append(("finish", req_id, error)),
            logger=logging.getLogger("test_vllm_push"),
            dialable=(frozenset({"xfer://d", "xfer://p"}), False)))

    # ---- the engine ----

    def submit_send(self, address, data):
        kind, header, payload = unpack_message(bytes(data), len(_WANT))
        self.sent.append((address, kind, header, block_ids_of(payload)))
        return Transfer(None)

    def submit_paged_writes(self, page_len, src, src_pages, dst, dst_pages, **kwargs):
        transfer = Transfer(kwargs.pop("on_done"))
        self.writes.append((dict(kwargs, page_len=page_len, src=src, src_pages=list(src_pages),
                                 dst=dst, dst_pages=list(dst_pages)), transfer))
        return transfer

    # ---- the rest of the worker ----

    def peer(self, engine_id, rank, url=None):
        try:
            return self.peers[(engine_id, rank)]
        except KeyError:
            raise LookupError(f"no record of {engine_id} rank {rank}") from None

    def shared_layers(self, load):
        there = self.peer(load.remote_engine_id, 0, load.remote_rendezvous).layers
        return [name for name in self.layers if name in there]

    @staticmethod
    def now(work, *args):
        work(*args)
        return None

    def sent_of(self, kind):
        return [(address, header, ids) for address, k, header, ids in self.sent if k == kind]


def peer(engine_id, rank, heads=2):
    return Peer(address=f"{engine_id}/{rank}".encode(),
                layers={name: (f"desc-{engine_id}-{rank}", hnd(heads)) for name in LAYERS})


def decoder_of_two_prefill_ranks():
    """A decode rank (TP 1, both heads) whose prefill instance runs at TP 2 (a head each)."""
    d = Worker("d", peers={("p", r): peer("p", r, heads=1) for r in (0, 1)})
    load = Load(local_block_ids=[[4, 5]], remote_engine_id="p", remote_block_ids=[],
                remote_request_id="r", remote_tp_size=2, token=TOKEN)
    d.push.await_push("r-d", load, now=START)
    return d, load


def pushed(rank, **header):
    return Header({"engine": "p", "req": "r", "rank": rank, "token": TOKEN, **header})


# ---- the wire ----


def test_block_ids_travel_as_little_endian_int32_and_back():
    ids = [0, 1, 256, 70000, 2**31 - 1]
    assert block_ids_payload(ids) == struct.pack("<5i", *ids)
    assert block_ids_of(block_ids_payload(ids)) == ids


def test_a_payload_that_is_not_whole_block_ids_is_refused():
    # The worker drops a message that raises ValueError as malformed, by name.
    with pytest.raises(ValueError):
        block_ids_of(b"\x01\x00\x00\x00\x02")
    with pytest.raises(ControlError):
        block_ids_of(block_ids_payload([1, -2]))


# ---- decode side ----


def test_the_block_ids_go_to_every_prefill_rank_holding_some_of_this_ranks_heads():
    d, _ = decoder_of_two_prefill_ranks()
    wants = d.sent_of(_WANT)
    assert [address for address, _, _ in wants] == [b"p/0", b"p/1"]
    for _, header, ids in wants:
        assert ids == [4, 5]
        assert header == {"req": "r", "engine": "d", "rank": 0, "tp": 1,
                          "rendezvous": "xfer://d", "model": "m", "token": TOKEN}


def test_a_push_ends_once_every_prefill_rank_answered_its_done_message_queued_first():
    d, load = decoder_of_two_prefill_ranks()
    d.push.handle_pushed(pushed(0, ok=True))
    assert d.events == [], "rank 1 has not answered"
    d.push.handle_pushed(pushed(1, ok=True))
    # Queued before the load is reported: a decoder shut down as soon as vLLM sees the load
    # finished would otherwise leave the prefill holding the blocks until its lease.
    assert d.events == [("done", load), ("finish", "r-d", None)]
    d.push.handle_pushed(pushed(1, ok=True))
    assert len(d.events) == 2, "a repeated answer ends nothing twice"


def test_a_prefill_rank_that_could_not_push_fails_the_load_naming_it():
    d, _ = decoder_of_two_prefill_ranks()
    d.push.handle_pushed(pushed(1, ok=False, why="no layer x"))
    d.push.handle_pushed(pushed(0, ok=True))
    [(_, _, error)] = [e for e in d.events if e[0] == "finish"]
    assert isinstance(error, RuntimeError)
    assert "prefill p rank 1" in str(error) and "no layer x" in str(error)


def test_a_late_push_is_cancelled_first_and_ends_after_as_long_again_if_unanswered():
    d, load = decoder_of_two_prefill_ranks()
    due = START + TIMEOUT
    d.push.poll(due - 1, kept=())
    assert not d.sent_of(_CANCEL), "not due yet"
    d.push.poll(due, kept=())
    assert [address for address, _, _ in d.sent_of(_CANCEL)] == [b"p/0", b"p/1"]
    assert d.events == [], "the blocks stay until the prefill ranks say nothing is in flight"
    d.push.handle_pushed(pushed(0, cancelled=True))
    d.push.poll(due + TIMEOUT - 1, kept=())
    assert d.events == []
    d.push.poll(due + TIMEOUT, kept=())
    [done, (_, req_id, error)] = d.events
    assert done == ("done", load) and req_id == "r-d"
    assert isinstance(error, TimeoutError)
    assert "ranks [1] did not answer the cancel" in str(error)


def test_a_cancelled_push_ends_with_its_timeout_once_every_rank_answered():
    d, _ = decoder_of_two_prefill_ranks()
    d.push.poll(START + TIMEOUT, kept=())
    d.push.handle_pushed(pushed(0, cancelled=True))
    d.push.handle_pushed(pushed(1, cancelled=True))
    [(_, _, error)] = [e for e in d.events if e[0] == "finish"]
    assert isinstance(error, TimeoutError)
    assert "did not push request r within 60.0s" in str(error)


def test_a_cancel_this_rank_never_asked_for_fails_the_load():
    """Review 56 H-A: a prefill rank answers "cancelled" to a cancel sent in this decoder's name
    (by anyone holding the request's token); this rank never cancelled, so nothing says its
    blocks were written: the load fails, it is not reported loaded."""
    d, load = decoder_of_two_prefill_ranks()
    d.push.handle_pushed(pushed(0, cancelled=True))
    d.push.handle_pushed(pushed(1, ok=True))
    [(_, _, error)] = [e for e in d.events if e[0] == "finish"]
    assert isinstance(error, RuntimeError)
    assert "prefill p rank 0 cancelled" in str(error)


def test_a_second_wait_for_the_same_prefill_request_fails_alone_and_the_first_goes_on():
    """Review 56 M-A: a second decode request naming the same prefill request replaced the
    first one's wait, which then never ended (holding its blocks)."""
    d, load = decoder_of_two_prefill_ranks()
    again = Load(local_block_ids=[[6]], remote_engine_id="p", remote_block_ids=[],
                 remote_request_id="r", remote_tp_size=2, token=TOKEN)
    with pytest.raises(WaitTaken, match="already waits for prefill p's request r"):
        d.push.await_push("r-d2", again, now=START)
    d.push.handle_pushed(pushed(0, ok=True))
    d.push.handle_pushed(pushed(1, ok=True))
    assert d.events == [("done", load), ("finish", "r-d", None)]


def test_a_deadline_first_cancels_then_ends():
    load = Load([[1]], "p", [], "r", token=TOKEN)
    waiting = _Await("r-d", load, {0, 1}, deadline=10.0)
    assert waiting.handle_deadline(10.0, TIMEOUT) is True
    assert waiting.deadline == 10.0 + TIMEOUT
    assert "ranks [0, 1] missing" in str(waiting.cancelling)
    assert waiting.handle_deadline(waiting.deadline, TIMEOUT) is False


def test_a_prefill_rank_that_cannot_be_reached_for_the_cancel_is_answered_for():
    d, _ = decoder_of_two_prefill_ranks()
    due = START + TIMEOUT
    del d.peers[("p", 1)]  # it went away
    d.push.poll(due, kept=())
    d.push.handle_pushed(pushed(0, cancelled=True))
    [(_, _, error)] = [e for e in d.events if e[0] == "finish"]
    assert "did not push request r" in str(error)


# ---- prefill side ----


def prefill_with_a_decoder(model="m", token=TOKEN, scheduled=True):
    """A prefill rank (TP 1) and the block ids of one decode rank (TP 1, same model);
    ``scheduled``: the prefill's scheduler has the request (and so its token) already."""
    p = Worker("p", peers={("d", 0): peer("d", 0)})
    if scheduled:
        p.push.tokens_known({"r": TOKEN}, START)
    header = {"req": "r", "engine": "d", "rank": 0, "tp": 1, "rendezvous": "xfer://d",
              "model": model, "token": token}
    _, header, payload = unpack_message(
        pack_message(_WANT, header, block_ids_payload([0, 9, 2])), len(_WANT))
    return p, Header(header), payload


def complete(worker, error=None):
    for _, transfer in worker.writes:
        if transfer.on_done is not None:
            on_done, transfer.on_done = transfer.on_done, None
            on_done(error)


def test_each_layer_goes_as_it_is_computed_and_the_decoder_is_told_once_all_landed():
    p, header, payload = prefill_with_a_decoder()
    p.push.handle_want(header, payload, now=START)
    p.push.step_started({"r": [3, 5, 7]}, now=START)
    p.push.layer_computed(LAYERS[0], None)
    [(write, _)] = p.writes
    assert (write["src"], write["src_pages"]) == ("region-p", [3, 5, 7])
    assert (write["dst"], write["dst_pages"]) == ("desc-d-0", [0, 9, 2])
    p.push.request_finished("r", [3, 5, 7], now=START)
    assert len(p.writes) == 2, "the second layer at the end"
    complete(p)
    [(address, reply, _)] = p.sent_of(_PUSHED)
    assert address == b"d/0"
    assert reply == {"req": "r", "engine": "p", "rank": 0, "ok": True, "why": None,
                     "cancelled": False, "token": TOKEN}


def test_ids_that_come_after_the_request_was_computed_are_pushed_at_once():
    p, header, payload = prefill_with_a_decoder()
    p.push.step_started({"r": [3, 5, 7]}, now=START)
    p.push.layer_computed(LAYERS[0], None)
    p.push.request_finished("r", [3, 5, 7], now=START)
    assert p.writes == []
    p.push.handle_want(header, payload, now=START)
    assert len(p.writes) == len(LAYERS)


def test_a_decoder_serving_another_model_is_refused_by_name():
    p, header, payload = prefill_with_a_decoder(model="other")
    p.push.handle_want(header, payload, now=START)
    p.push.request_finished("r", [3, 5, 7], now=START)
    assert p.writes == []
    [(_, reply, _)] = p.sent_of(_PUSHED)
    assert reply["ok"] is False and "'other'" in reply["why"] and "'m'" in reply["why"]


def test_a_cancel_stops_the_writes_in_flight_and_is_answered_once_none_is():
    p, header, payload = prefill_with_a_decoder()
    p.push.handle_want(header, payload, now=START)
    p.push.step_started({"r": [3, 5, 7]}, now=START)
    p.push.layer_computed(LAYERS[0], None)
    p.push.handle_cancel(Header({"req": "r", "engine": "d", "rank": 0, "token": TOKEN}),
                        now=START)
    assert all(transfer.cancelled for _, transfer in p.writes)
    assert p.sent_of(_PUSHED) == [], "a write is still in flight"
    p.push.request_finished("r", [3, 5, 7], now=START)
    assert len(p.writes) == 1, "nothing more is written after the cancel"
    complete(p, error=RuntimeError("cancelled"))
    [(_, reply, _)] = p.sent_of(_PUSHED)
    assert reply["cancelled"] is True and reply["ok"] is False


def test_a_cancel_before_the_ids_is_answered_and_drops_them_until_forgotten():
    cancel = Header({"req": "r", "engine": "d", "rank": 0, "rendezvous": "xfer://d",
                     "token": TOKEN})
    p, header, payload = prefill_with_a_decoder()
    p.push.handle_cancel(cancel, now=START)
    [(address, reply, _)] = p.sent_of(_PUSHED)
    assert address == b"d/0" and reply["cancelled"] is True
    p.push.poll(START + FORGET, kept=())  # kept for forget_after_s
    p.push.handle_want(header, payload, now=START + FORGET)
    assert p.push.wants("r") == [], "its ids came after its cancel"

    p, header, payload = prefill_with_a_decoder()
    p.push.handle_cancel(cancel, now=START)
    p.push.poll(START + FORGET + 1, kept=())  # the cancel is forgotten once stale
    p.push.handle_want(header, payload, now=START + FORGET + 1)
    assert len(p.push.wants("r")) == 1


def test_a_request_aborted_or_never_computed_fails_its_decoders_at_once():
    p, header, payload = prefill_with_a_decoder()
    p.push.handle_want(header, payload, now=START)
    p.push.request_aborted("r", "aborted here")
    [(_, reply, _)] = p.sent_of(_PUSHED)
    assert reply["ok"] is False and reply["why"] == "aborted here"

    p, header, payload = prefill_with_a_decoder()
    p.push.handle_want(header, payload, now=START)
    p.push.poll(START + FORGET, kept=())
    assert p.sent_of(_PUSHED) == [], "its ids are kept for forget_after_s"
    p.push.poll(START + FORGET + 1, kept=())
    [(_, reply, _)] = p.sent_of(_PUSHED)
    assert reply["why"].startswith("the prefill instance never computed the request")


def test_a_computed_push_is_forgotten_once_its_blocks_are_no_longer_kept():
    p, header, payload = prefill_with_a_decoder()
    p.push.handle_want(header, payload, now=START)
    p.push.step_started({"r": [3, 5, 7]}, now=START)
    p.push.request_finished("r", [3, 5, 7], now=START)
    complete(p)
    p.push.poll(START, kept={"r"})
    assert len(p.push.wants("r")) == 1
    p.push.poll(START, kept=())
    assert p.push.wants("r") == []
    assert len(p.sent_of(_PUSHED)) == 1, "its decoder was answered once, when it landed"


def test_a_chunk_of_a_longer_prompt_waits_for_the_whole_request():
    p, header, payload = prefill_with_a_decoder()
    p.push.handle_want(header, payload, now=START)
    p.push.step_started({"r": [3, 5]}, now=START)  # two of the decoder's three blocks
    p.push.layer_computed(LAYERS[0], None)
    assert p.writes == []
    p.push.request_finished("r", [3, 5, 7], now=START)
    assert sorted(w["src_pages"] == [3, 5, 7] for w, _ in p.writes) == [True, True]


def test_an_abort_with_writes_in_flight_cancels_them_and_answers_once_none_is():
    # The decoder frees its blocks when it hears the load failed, and vLLM hands them to another
    # request: a write still landing there would overwrite that request's KV.
    p, header, payload = prefill_with_a_decoder()
    p.push.handle_want(header, payload, now=START)
    p.push.step_started({"r": [3, 5, 7]}, now=START)
    p.push.layer_computed(LAYERS[0], None)
    p.push.request_aborted("r", "aborted here")
    assert all(transfer.cancelled for _, transfer in p.writes)
    assert p.sent_of(_PUSHED) == [], "a write is still in flight"
    p.push.request_finished("r", [3, 5, 7], now=START)
    assert len(p.writes) == 1, "nothing more is written after the abort"
    # The decoder's cancel, if it times out meanwhile, is not answered early either.
    p.push.handle_cancel(Header({"req": "r", "engine": "d", "rank": 0, "token": TOKEN}),
                        now=START)
    assert p.sent_of(_PUSHED) == []
    complete(p, error=RuntimeError("cancelled"))
    [(_, reply, _)] = p.sent_of(_PUSHED)
    assert reply["ok"] is False
    p.push.poll(START, kept=())
    assert p.push.wants("r") == [], "forgotten once nothing of it is in flight"


def test_an_abort_with_writes_in_flight_fails_the_load_with_its_reason():
    p, header, payload = prefill_with_a_decoder()
    p.push.handle_want(header, payload, now=START)
    p.push.step_started({"r": [3, 5, 7]}, now=START)
    p.push.layer_computed(LAYERS[0], None)
    p.push.request_aborted("r", "aborted here")
    complete(p, error=RuntimeError("cancelled"))
    [(_, reply, _)] = p.sent_of(_PUSHED)
    assert reply == {"req": "r", "engine": "p", "rank": 0, "ok": False, "why": "aborted here",
                     "cancelled": False, "token": TOKEN}


def test_ids_that_come_after_an_abort_with_writes_in_flight_are_answered_with_it():
    p, header, payload = prefill_with_a_decoder()
    p.push.handle_want(header, payload, now=START)
    p.push.step_started({"r": [3, 5, 7]}, now=START)
    p.push.layer_computed(LAYERS[0], None)
    p.push.request_aborted("r", "aborted here")
    other = Header(dict(header.fields, rank=1))
    p.peers[("d", 1)] = peer("d", 1)
    p.push.handle_want(other, payload, now=START)
    [(address, reply, _)] = p.sent_of(_PUSHED)
    assert address == b"d/1" and reply["why"] == "aborted here"
    assert len(p.writes) == 1


def test_a_computed_push_freed_before_it_landed_tells_its_decoder_so_once_nothing_is_in_flight():
    p, header, payload = prefill_with_a_decoder()
    p.push.handle_want(header, payload, now=START)
    p.push.step_started({"r": [3, 5, 7]}, now=START)
    p.push.request_finished("r", [3, 5, 7], now=START)
    p.push.poll(START, kept=())  # its lease freed the blocks with the writes still in flight
    assert all(transfer.cancelled for _, transfer in p.writes)
    assert p.sent_of(_PUSHED) == []
    complete(p, error=RuntimeError("cancelled"))
    [(_, reply, _)] = p.sent_of(_PUSHED)
    assert reply["ok"] is False and "freed" in reply["why"], reply["why"]
    assert "never computed" not in reply["why"]


def test_a_cancel_that_crosses_an_abort_answer_is_answered_again():
    p, header, payload = prefill_with_a_decoder()
    p.push.handle_want(header, payload, now=START)
    p.push.request_aborted("r", "aborted here")
    p.push.handle_cancel(Header({"req": "r", "engine": "d", "rank": 0, "token": TOKEN}),
                        now=START)
    assert [reply["why"] for _, reply, _ in p.sent_of(_PUSHED)] == ["aborted here"] * 2


# ---- forged messages (issue 56): acted on only with the request's token ----


def test_a_forged_pushed_ok_does_not_complete_a_load():
    """A "pushed ok" from anyone completed a load whose blocks were never written."""
    d, _ = decoder_of_two_prefill_ranks()
    for rank in (0, 1):
        d.push.handle_pushed(Header({"engine": "p", "req": "r", "rank": rank, "ok": True,
                                     "token": FORGED}))
    d.push.handle_pushed(pushed(7, ok=True))  # a rank it does not wait for
    assert d.events == []
    d.push.handle_pushed(pushed(0, ok=True)), d.push.handle_pushed(pushed(1, ok=True))
    assert [e[0] for e in d.events] == ["done", "finish"] and d.events[1][2] is None


def test_forged_ids_write_nothing_look_nothing_up_and_get_no_answer():
    """A forged want made a prefill write a request's KV into chosen blocks of any decoder
    (or, with its rendezvous, into the forger's memory)."""
    p, header, payload = prefill_with_a_decoder(token=FORGED)
    p.push.handle_want(header, payload, now=START)
    p.push.step_started({"r": [3, 5, 7]}, now=START)
    p.push.request_finished("r", [3, 5, 7], now=START)
    assert p.writes == [] and p.sent == [] and p.push.wants("r") == []
    # Its real decoder still gets every layer.
    _, real, payload = prefill_with_a_decoder()
    p.push.handle_want(real, payload, now=START)
    assert len(p.writes) == len(LAYERS)


@pytest.mark.parametrize("forged_first", [False, True])
def test_ids_in_a_decoders_name_from_another_engine_leave_the_decoders_own(forged_first):
    """Review 56b L-3: ids with the request's token in a decoder's name from another engine
    replaced the decoder's own before their sender was checked, and were then dropped — the
    decoder's ids went with them and its load failed at its deadline. In either order, every
    layer goes to the decoder's blocks and nothing to the forged ones."""
    p, header, payload = prefill_with_a_decoder()
    forged = block_ids_payload([1, 1, 1])
    wants = [(header, payload, b"d/0"), (header, forged, b"elsewhere/0")]
    for fields, ids, sender in reversed(wants) if forged_first else wants:
        p.push.handle_want(fields, ids, now=START, sender=sender)
    p.push.step_started({"r": [3, 5, 7]}, now=START)
    p.push.request_finished("r", [3, 5, 7], now=START)
    assert [(w["dst"], w["dst_pages"]) for w, _ in p.writes] == [
        ("desc-d-0", [0, 9, 2])] * len(LAYERS)
    complete(p)
    [(address, reply, _)] = p.sent_of(_PUSHED)
    assert address == b"d/0" and reply["ok"] is True


def test_ids_before_the_prefill_knows_the_request_wait_for_its_token():
    p, header, payload = prefill_with_a_decoder(scheduled=False)
    _, forged, _ = prefill_with_a_decoder(token=FORGED)
    p.push.handle_want(forged, payload, now=START)
    p.push.handle_want(header, payload, now=START)
    p.push.step_started({"r": [3, 5, 7]}, now=START)
    p.push.layer_computed(LAYERS[0], None)
    assert p.writes == [], "no token known yet: nothing written"
    p.push.tokens_known({"r": TOKEN}, START)
    p.push.request_finished("r", [3, 5, 7], now=START)
    assert [w["dst"] for w, _ in p.writes] == ["desc-d-0"] * len(LAYERS)
    assert [want.token for want in p.push.wants("r")] == [TOKEN]


def test_a_forged_cancel_stops_nothing_and_a_rendezvous_not_configured_is_refused():
    p, header, payload = prefill_with_a_decoder()
    p.push.handle_want(header, payload, now=START)
    p.push.step_started({"r": [3, 5, 7]}, now=START)
    p.push.layer_computed(LAYERS[0], None)
    p.push.handle_cancel(Header({"req": "r", "engine": "d", "rank": 0, "token": FORGED}),
                         now=START)
    assert not any(t.cancelled for _, t in p.writes)
    with pytest.raises(ControlError, match="remote_rendezvous"):
        p.push.handle_want(Header(dict(header.fields, rendezvous="etcd://attacker:2379/x")),
                           payload, now=START)


def test_unverified_ids_are_bounded():
    from xfer.kv.vllm_push import MAX_PENDING

    p, header, payload = prefill_with_a_decoder(scheduled=False)
    for i in range(MAX_PENDING + 50):
        p.push.handle_want(Header(dict(header.fields, req=f"x{i}")), payload, now=START)
    assert len(p.push._pushes) <= MAX_PENDING


def test_ids_under_ever_new_decoder_names_are_bounded_and_counted():
    """Issue 56, review M2: ids were kept per decoder name with no bound — a stranger sending
    ids for a request this prefill has not scheduled yet, under a new decoder name each time,
    grew its wants (up to 64 KiB of block ids each) for as long as it liked. A request keeps
    the ids of at most two decode instances' worth of ranks; the ids of requests not yet
    scheduled are bounded in all (the oldest request's dropped first); what is dropped is
    counted. The real decoder of a request scheduled since is still served."""
    from xfer.kv.params import MAX_TP
    from xfer.kv.vllm_push import MAX_PENDING

    p, header, payload = prefill_with_a_decoder(scheduled=False)
    flood = MAX_PENDING + 50
    for i in range(flood):
        p.push.handle_want(Header(dict(header.fields, engine=f"x{i}")), payload, now=START)
    assert len(p.push.wants("r")) <= 2 * MAX_TP
    for i in range(flood):  # spread over requests: each under its bound, not all of them
        p.push.handle_want(Header(dict(header.fields, req=f"q{i // 100}", engine=f"x{i}")),
                           payload, now=START)
    assert sum(len(push.wants) for push in p.push._pushes.values()) <= MAX_PENDING
    assert p.push.dropped_wants >= 2 * flood - MAX_PENDING
    _, real, payload = prefill_with_a_decoder()
    p.push.tokens_known({"s": TOKEN}, START)
    p.push.handle_want(Header(dict(real.fields, req="s")), payload, now=START)
    p.push.step_started({"s": [3, 5, 7]}, now=START)
    p.push.request_finished("s", [3, 5, 7], now=START)
    assert [w["dst"] for w, _ in p.writes] == ["desc-d-0"] * len(LAYERS)


def stranger_wants(rng, n, ids):
    """``n`` decoders' block ids, each for a random request id with a random token from an
    engine nobody knows, ``ids`` random ids each: (header, payload) as the worker decodes them."""
    for _ in range(n):
        header = {"req": f"{rng.getrandbits(64):x}", "engine": f"unknown-{rng.getrandbits(64):x}",
                  "rank": 0, "tp": 1, "rendezvous": "xfer://d", "model": "m",
                  "token": f"{rng.getrandbits(128):032x}"}
        _, header, payload = unpack_message(pack_message(_WANT, header, ids(rng)), len(_WANT))
        yield Header(header), payload


def test_a_strangers_ids_for_requests_not_scheduled_are_bounded_in_bytes(random_block_ids):
    """Review 56 M-C: the decoders' ids kept for requests this prefill has not scheduled were
    bounded in count only (4,096), each want's ids as Python ints — about 640 KiB a want, 2.4
    GiB from anyone who can reach the engine, for ``free_timeout_s``. 4,096 wants of 16,380
    random ids each: what is held stays under 64 MiB, and the drops are counted. A real
    decoder's ids after the flood are still served."""
    rng = random.Random(56)
    p, _, _ = prefill_with_a_decoder(scheduled=False)
    tracemalloc.start()
    try:
        before = tracemalloc.get_traced_memory()[0]
        wants = stranger_wants(rng, 4096, lambda rng: random_block_ids(rng, 16380))
        for i, (header, payload) in enumerate(wants):
            p.push.handle_want(header, payload, now=START)
            if i % 64 == 63:  # a bound held all along, not only at the end
                held = tracemalloc.get_traced_memory()[0] - before
                assert held < 64 * MIB, f"{held / MIB:.0f} MiB held after {i + 1} wants"
    finally:
        tracemalloc.stop()
    assert p.push.dropped_wants > 0
    _, real, payload = prefill_with_a_decoder()
    p.push.handle_want(real, payload, now=START)
    p.push.tokens_known({"r": TOKEN}, START)
    p.push.request_finished("r", [3, 5, 7], now=START)
    assert [w["dst"] for w, _ in p.writes] == ["desc-d-0"] * len(LAYERS)


def test_a_want_costs_the_same_work_however_many_requests_wait_for_their_token(lines_run):
    """Review 56 M-C: each decoder's ids went through every request kept before its token
    (twice: to count them, and to bound their wants), on the engine's callback thread, which
    also serves other requests' transfers. 256 more wants run no more than twice the lines
    with 4,096 requests waiting as with none (the oldest request dropped per want, once:
    amortised O(1); counted, not timed)."""
    rng = random.Random(4096)

    def one_id(rng):
        return block_ids_payload([rng.randrange(1 << 20)])

    def lines_for_256_wants(waiting):
        p, _, _ = prefill_with_a_decoder(scheduled=False)
        for header, payload in stranger_wants(rng, waiting, one_id):
            p.push.handle_want(header, payload, now=START)
        more = list(stranger_wants(rng, 256, one_id))
        return lines_run(xfer.kv.vllm_push, lambda: [
            p.push.handle_want(header, payload, now=START) for header, payload in more])

    few, many = lines_for_256_wants(0), lines_for_256_wants(MAX_PENDING)
    assert many <= 2 * few, f"lines run for 256 wants: {few} with none waiting, {many} with many"


def test_a_request_scheduled_costs_the_same_work_however_many_early_cancels_wait(lines_run):
    """Review 56 M-C (the same shape): each push request a step schedules went through every
    cancel kept before its ids (up to 4,096, anyone's with a token-shaped string) on vLLM's
    worker thread. Its token becoming known runs as many lines with 4,096 strangers' cancels
    held as with none (counted, not timed); an early cancel of its own is still answered."""
    rng = random.Random(7)

    def lines_to_schedule(cancels):
        p, _, _ = prefill_with_a_decoder(scheduled=False)
        for header, _ in stranger_wants(rng, cancels, lambda rng: b""):
            p.push.handle_cancel(header, now=START)
        p.push.handle_cancel(Header({"req": "r", "engine": "d", "rank": 0, "token": TOKEN,
                                     "rendezvous": "xfer://d"}), now=START)
        work = lines_run(xfer.kv.vllm_push, lambda: p.push.tokens_known({"r": TOKEN}, START))
        [(address, reply, _)] = p.sent_of(_PUSHED)
        assert address == b"d/0" and reply["cancelled"] is True
        return work

    few, many = lines_to_schedule(0), lines_to_schedule(MAX_PENDING - 1)
    assert many <= few + 8, f"lines run scheduling one request: {few} vs {many}"


def test_a_step_costs_the_same_work_however_many_strangers_entries_are_held(lines_run):
    """Review 56b L-7: ``poll`` went through every early cancel and every push request held
    (up to 4,096 each, anyone's with a token-shaped string) on vLLM's worker thread at each
    step. A step runs as many lines with 4,095 strangers' cancels and ids held as with none
    (counted, not timed), and once they are stale they are all forgotten."""
    rng = random.Random(757)

    def one_id(rng):
        return block_ids_payload([rng.randrange(1 << 20)])

    def prefill_holding(strangers):
        p, header, payload = prefill_with_a_decoder()
        p.push.handle_want(header, payload, now=START)
        p.push.step_started({"r": [3, 5, 7]}, now=START)
        for cancel, _ in stranger_wants(rng, strangers, lambda rng: b""):
            p.push.handle_cancel(cancel, now=START)
        for want, ids in stranger_wants(rng, strangers, one_id):
            p.push.handle_want(want, ids, now=START)
        return p

    few, many = prefill_holding(0), prefill_holding(MAX_PENDING - 1)
    work = [lines_run(xfer.kv.vllm_push, lambda: p.push.poll(START + 1, {"r"}))
            for p in (few, many)]
    assert work[1] <= work[0] + 8, f"lines run by a step: {work[0]} vs {work[1]}"
    many.push.poll(START + FORGET + 1, {"r"})
    assert list(many.push._pushes) == [] and not many.push._cancels
    assert many.push._unverified_wants == 0 and many.push._unverified_ids == 0


def test_random_schedules_keep_the_ids_held_before_their_token_within_the_bounds(monkeypatch):
    """Property: whatever the order of decoders' ids (with the token or a forged one), early
    cancels, tokens becoming known, aborts and time, the ids held for requests whose token is
    not known yet stay within both bounds, and the counts the bounds are kept with (updated
    per want, not recounted) are what is held; the early cancels stay within theirs, each
    found by its request."""
    monkeypatch.setattr(xfer.kv.vllm_push, "MAX_PENDING", 6)
    monkeypatch.setattr(xfer.kv.vllm_push, "MAX_PENDING_IDS", 20)
    monkeypatch.setattr(xfer.kv.vllm_push, "MAX_WANTS", 2)
    monkeypatch.setattr(logging.getLogger("test_vllm_push"), "disabled", True)  # lookups fail
    for seed in range(200):
        rng = random.Random(seed)
        p, _, _ = prefill_with_a_decoder(scheduled=False)
        now = START
        for _ in range(60):
            op, req = rng.random(), f"q{rng.randrange(8)}"
            if op < 0.6:
                header = {"req": req, "engine": f"e{rng.randrange(3)}", "rank": 0, "tp": 1,
                          "rendezvous": "xfer://d", "model": "m",
                          "token": TOKEN if rng.random() < 0.7 else FORGED}
                ids = [rng.randrange(50) for _ in range(rng.randrange(1, 8))]
                p.push.handle_want(Header(header), block_ids_payload(ids), now)
            elif op < 0.7:
                p.push.handle_cancel(Header({"req": req, "engine": f"e{rng.randrange(3)}",
                                             "rank": 0, "token": TOKEN}), now)
            elif op < 0.75:
                p.push.tokens_known({req: TOKEN}, now)
            elif op < 0.85:
                now += rng.choice([1, FORGET + 1])
                p.push.poll(now, kept={f"q{i}" for i in range(8) if rng.random() < 0.5})
            elif op < 0.92:
                p.push.request_finished(req, [1, 2], now)
            else:
                p.push.request_aborted(req, "aborted")
            waiting = [push for push in p.push._pushes.values() if push.token is None]
            wants = sum(len(push.wants) for push in waiting)
            ids = sum(len(w.blocks) for push in waiting for w in push.wants.values())
            assert wants <= 6 and ids <= 20, seed
            assert (p.push._unverified_wants, p.push._unverified_ids) == (wants, ids), seed
            assert len(p.push._cancels) <= 6, seed
            assert set(p.push._cancels) == {(r, *decoder) for r, ranks in
                                            p.push._cancelled_ranks.items() for decoder in ranks}
            # poll's indices (review 56b L-7): what it goes through is what it should, oldest
            # first, and nothing stale is left after it.
            pushes = p.push._pushes.items()
            assert list(p.push._uncomputed) == [
                r for r, push in pushes if not push.finished and push.aborted is None], seed
            assert set(p.push._computed) == {
                r for r, push in pushes if push.finished and push.aborted is None}, seed
            assert set(p.push._aborted) == {r for r, push in pushes if push.aborted}, seed
            cancelled = [when for when, _, _ in p.push._cancels.values()]
            came = list(p.push._uncomputed.values())
            assert cancelled == sorted(cancelled) and came == sorted(came), seed
            if 0.75 <= op < 0.85:
                assert all(now - when <= FORGET for when in cancelled + came), seed


def test_a_cancel_while_a_layer_is_planned_is_answered_only_after_its_writes():
    """Issue 54: ``_push_layer`` checked the want under the lock, then planned and posted
    after dropping it; a cancel in between was answered "nothing in flight" and the writes
    went out after — into blocks the decoder then gave to another request."""
    p, header, payload = prefill_with_a_decoder()
    p.push.handle_want(header, payload, now=START)
    p.push.step_started({"r": [3, 5, 7]}, now=START)
    class CancelWhilePlanned(dict):
        """The layers, read as the layer is planned: the decoder's cancel comes then."""

        def __getitem__(self, name):
            p.layers = dict(self)
            p.push.handle_cancel(Header({"req": "r", "engine": "d", "rank": 0,
                                         "token": TOKEN}), now=START)
            return dict.__getitem__(self, name)

    p.layers = CancelWhilePlanned(p.layers)
    p.push.layer_computed(LAYERS[0], None)
    [(_, reply, _)] = p.sent_of(_PUSHED)  # answered once the planned layer wrote nothing
    assert reply["cancelled"] is True
    assert p.writes == [], "nothing written after the cancel"


def test_blocks_that_change_after_a_layer_was_written_fail_the_load_instead_of_a_rewrite():
    """Issue 54: a block written twice (the first planning's blocks, then the finished
    request's) can end with either write's bytes — SRD and striping do not order writes. The
    decoder is told its load failed, named, once the first write is no longer in flight, and
    nothing is rewritten."""
    p, header, payload = prefill_with_a_decoder()
    p.push.handle_want(header, payload, now=START)
    p.push.step_started({"r": [3, 5, 7]}, now=START)
    p.push.layer_computed(LAYERS[0], None)
    assert len(p.writes) == 1
    p.push.request_finished("r", [4, 5, 7], now=START)
    assert len(p.writes) == 1, "nothing rewritten"
    assert all(transfer.cancelled for _, transfer in p.writes)
    assert p.sent_of(_PUSHED) == [], "its write is still in flight"
    complete(p, error=RuntimeError("cancelled"))
    [(_, reply, _)] = p.sent_of(_PUSHED)
    assert reply["ok"] is False and "either order" in reply["why"]


def test_blocks_that_change_before_anything_was_written_are_pushed_as_finished():
    p, header, payload = prefill_with_a_decoder()
    p.push.handle_want(header, payload, now=START)
    p.push.request_finished("r", [4, 5, 7], now=START)
    assert sorted(w["src_pages"] == [4, 5, 7] for w, _ in p.writes) == [True, True]
    complete(p)
    [(_, reply, _)] = p.sent_of(_PUSHED)
    assert reply["ok"] is True
