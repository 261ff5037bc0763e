"""The SGLang backend's control messages (``xfer.kv.sglang_control``, issue 56): the decoder
refuses anything malformed with ``ControlError`` only, a meta or abort is taken only with the
proof of the decode rank's published key, from its engine where the transport names one, and
naming only pages and aux slots it published; a decode rank takes an answer only for a room it
holds, with that room's token, from a prefill rank the room's indices went to."""

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from xfer.kv import sglang_control as sc
from xfer.kv.control import ControlError

KEY = "ab" * 16
DECODE = "sglang.decode.0123456789ab.0"
ADDR, OTHER = b"decode-engine", b"someone-else"
PREFILL_ADDR = b"prefill-engine"


class Desc:
    def __init__(self, nbytes):
        self.nbytes = nbytes


def record(pages=32, item=256, aux_slots=8, aux_item=64, key=KEY):
    regions = {f"kv{i}": Desc(pages * item) for i in range(2)}
    regions["aux0"] = Desc(aux_slots * aux_item)
    regions[sc.key_region(key)] = Desc(1)
    return {"name": DECODE, "addr": ADDR, "regions": regions}


def meta(**kw):
    fields = dict(room=77, token="cd" * 16, decode=DECODE, to=0, rank=0, tp=1, heads=2,
                  item=256, prefix=0, aux_index=5, aux=True,
                  pages=np.array([30, 2, 17], dtype=np.int64))
    fields.update(kw)
    return sc.Meta(**fields)


def check(m, key=KEY, sender=ADDR, rec=None, data=None):
    got, proof = sc.parse(data if data is not None else m.encode(key))
    sc.check_meta(got, proof, rec or record(), sender, 2, [64])
    return got


def test_a_decode_ranks_own_meta_is_taken_whole():
    got = check(meta())
    assert got.pages.tolist() == [30, 2, 17] and got.aux_index == 5 and got.to == 0
    assert check(meta(), sender=b"").room == 77, "no proven sender: the proof alone"


@pytest.mark.parametrize("why,kw", [
    ("another engine sent it", dict(sender=OTHER)),
    ("proven under another key", dict(key="ef" * 16)),
    ("past the decode's pages", dict(m=meta(pages=np.array([1, 32])))),
    ("past its aux slots", dict(m=meta(aux_index=8))),
    ("a record without a key", dict(rec={**record(), "regions": {
        k: v for k, v in record()["regions"].items() if not k.startswith("xsgkey")}})),
])
def test_a_meta_that_is_not_the_decode_ranks_own_or_names_what_it_never_published(why, kw):
    m = kw.pop("m", meta())
    with pytest.raises(ControlError):
        check(m, **kw)


def test_a_meta_altered_after_its_proof_is_refused():
    good = meta().header(KEY)
    for field, value in (("pages", None), ("to", 1), ("aux_index", 3), ("prefix", 4),
                         ("room", 78), ("token", "ee" * 16)):
        header = dict(good)
        payload = np.array([30, 2, 17], dtype="<i4").tobytes()
        if field == "pages":
            payload = np.array([30, 2, 18], dtype="<i4").tobytes()
        else:
            header[field] = value
        with pytest.raises(ControlError):
            check(None, data=sc.encode(sc.META, header, payload))


def test_an_abort_needs_the_proof_and_the_engine():
    a = sc.Abort(77, "cd" * 16, DECODE, 0)
    got, proof = sc.parse(a.encode(KEY))
    sc.check_abort(got, proof, record(), ADDR)
    with pytest.raises(ControlError):
        sc.check_abort(got, proof, record(), OTHER)
    got, proof = sc.parse(a.encode("ef" * 16))
    with pytest.raises(ControlError):
        sc.check_abort(got, proof, record(), b"")


def answer(kind, room=77, token="cd" * 16, rank=0):
    msg, _ = sc.parse(sc.Answer(kind, room, token, rank, "boom").encode())
    return msg


def test_a_decode_rank_takes_answers_only_for_its_rooms_with_their_token_from_their_prefills():
    rooms = sc.DecodeRooms()
    rooms.enter(77, "cd" * 16, {0: PREFILL_ADDR})
    for bad, sender in ((answer(sc.DONE, room=78), PREFILL_ADDR),          # not its room
                        (answer(sc.DONE, token="ee" * 16), PREFILL_ADDR),  # not its token
                        (answer(sc.DONE, rank=1), PREFILL_ADDR),           # not sent there
                        (answer(sc.FAIL), OTHER),                          # another engine
                        (answer(sc.ABORT_ACK), OTHER)):
        with pytest.raises(ControlError):
            rooms.handle(bad, sender)
    r = rooms.rooms[77]
    assert (r.done, r.failure, r.acks) == (set(), None, None)
    assert 78 not in rooms.rooms, "an unknown room leaves no state"
    rooms.handle(answer(sc.DONE), PREFILL_ADDR)
    rooms.handle(answer(sc.DONE), b"")  # a replay counts once
    assert r.done == {0}
    r.acks = set()
    rooms.handle(answer(sc.ABORT_ACK), PREFILL_ADDR)
    assert r.acks == {0}
    rooms.leave(77)
    with pytest.raises(ControlError):
        rooms.handle(answer(sc.FAIL), PREFILL_ADDR)


@settings(max_examples=400, deadline=None)
@given(st.binary(max_size=300), st.sampled_from(sc.KINDS))
def test_the_decoder_raises_nothing_but_control_error(tail, kind):
    for data in (tail, kind + tail, kind + len(tail).to_bytes(4, "little") + tail):
        try:
            sc.parse(data)
        except ControlError:
            pass


@settings(max_examples=200, deadline=None)
@given(st.dictionaries(st.sampled_from(["room", "token", "decode", "to", "rank", "tp", "heads",
                                        "item", "prefix", "aux_index", "aux", "proof", "why"]),
                       st.one_of(st.none(), st.booleans(), st.integers(-2, 1 << 70),
                                 st.text(max_size=70), st.lists(st.integers(), max_size=3))),
       st.sampled_from(sc.KINDS), st.binary(max_size=16))
def test_headers_of_any_shape_raise_nothing_but_control_error(header, kind, payload):
    try:
        msg, proof = sc.parse(sc.encode(kind, header, payload))
    except ControlError:
        return
    if isinstance(msg, sc.Meta):
        with pytest.raises(ControlError):
            sc.check_meta(msg, proof, record(), ADDR, 2, [64])  # the proof is never right
