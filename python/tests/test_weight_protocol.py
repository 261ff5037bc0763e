"""xfer.weights' pure core: the control protocol's decoder (who may send what, session,
bounds), its inbox (bounded to the current and next version), the coordinator's decision,
and the layout decoder — each fuzzed with hypothesis: whatever the bytes, a typed refusal
(``ProtocolError`` / ``LayoutError``), never another exception."""

import json

import pytest

from xfer.weights import Layout, LayoutError, TensorSpec
from xfer.weights import protocol as P

hypothesis = pytest.importorskip("hypothesis")
from hypothesis import given, settings  # noqa: E402
from hypothesis import strategies as st  # noqa: E402

TAG = P.group_tag("g")
SESSION = b"s" * 16
# Two senders (0 = coordinator, 1) and two receivers (2, 3).
COORD = P.Rules(0, 2, 2, TAG, SESSION)
SENDER1 = P.Rules(1, 2, 2, TAG, SESSION)
RECV = P.Rules(2, 2, 2, TAG, SESSION)


def msg(kind, sender, payload=b"", version=7, session=SESSION, tag=TAG):
    return P.encode(kind, version, sender, tag, session, payload)


def manifest(index=0, count=1, total=3, chunk=b"abc"):
    return P.manifest_payload(index, count, 1000, b"d" * 16, total, chunk)


def test_messages_from_the_member_the_protocol_names_are_accepted():
    assert RECV.decode(msg(P.MANIFEST, 0, manifest())).kind == P.MANIFEST
    assert RECV.decode(msg(P.VERDICT, 0, b"\x01")).kind == P.VERDICT
    assert SENDER1.decode(msg(P.READY, 3, b"d" * 16 + b"\x00" + b"desc")).sender == 3
    assert COORD.decode(msg(P.DONE, 3, b"\x01" + b"d" * 16)).kind == P.DONE
    assert COORD.decode(msg(P.QUERY, 2)).kind == P.QUERY
    assert RECV.decode(msg(P.COUNT, 1, b"\x05" + b"\x00" * 7)).kind == P.COUNT


@pytest.mark.parametrize(
    "rules, raw, why",
    [
        (RECV, msg(P.VERDICT, 1, b"\x01"), "only the coordinator"),  # a verdict from a non-coordinator
        (RECV, msg(P.MANIFEST, 3, manifest()), "only the coordinator"),
        (SENDER1, msg(P.READY, 0, b"d" * 17), "only receivers"),  # READY from a sender
        (RECV, msg(P.READY, 3, b"d" * 17), "only receivers"),  # READY to a receiver
        (SENDER1, msg(P.DONE, 2, b"\x01" + b"d" * 16), "only the coordinator takes"),  # DONE elsewhere
        (RECV, msg(P.QUERY, 3), "only the coordinator takes"),
        (RECV, msg(P.VERDICT, 0, b"\x01", session=b"x" * 16), "session"),  # forged: no nonce
        (RECV, msg(P.VERDICT, 0, b"\x01", tag=P.group_tag("h")), "another group"),
        (RECV, msg(P.VERDICT, 9, b"\x01"), "not another member"),
        (RECV, msg(P.VERDICT, 2, b"\x01"), "not another member"),  # itself
        (RECV, msg(P.COUNT, 3, b"\x00" * 8), "only senders send it"),  # COUNT from a receiver
        (SENDER1, msg(P.COUNT, 0, b"\x00" * 8), "only senders send it"),  # COUNT to a sender
        (RECV, msg(P.COUNT, 1, b"\x00" * 9), "outside"),
        (RECV, msg(9, 0), "unknown kind"),
        (RECV, msg(P.VERDICT, 0, b""), "outside"),
        (COORD, msg(P.DONE, 3, b"\x01" + b"d" * 16 + b"r" * 2000), "outside"),
        (COORD, msg(P.QUERY, 3, b"x"), "outside"),
        # A MANIFEST that claims more layout than its chunks can carry, or chunk 3 of 2.
        (RECV, msg(P.MANIFEST, 0, manifest(total=10**12)), "out of bounds"),
        (RECV, msg(P.MANIFEST, 0, manifest(index=3, count=2)), "out of bounds"),
        (RECV, msg(P.MANIFEST, 0, manifest(count=10**9)), "out of bounds"),
        (RECV, b"XW", "shorter"),
        (RECV, b"\x00" * (P.MSG_BYTES + 1), "longer"),
    ],
)
def test_what_the_protocol_does_not_allow_is_refused_by_name(rules, raw, why):
    with pytest.raises(P.ProtocolError, match=why):
        rules.decode(raw)


def test_the_inbox_keeps_the_current_and_next_version_once_per_sender():
    box = P.Inbox()
    done = lambda v, s: P.Message(P.DONE, v, s, b"\x01" + b"d" * 16)  # noqa: E731
    assert box.handle(done(5, 1)) and box.handle(done(6, 1))
    assert not box.handle(done(7, 1)), "a third version is past the window"
    assert not box.handle(done(5, 1)), "a repeat from the same sender"
    assert box.handle(done(5, 2))
    assert [m.sender for m in box.get(P.DONE, 5)] == [1, 2]
    box.finish(5)
    assert box.get(P.DONE, 5) == [] and not box.handle(done(5, 3)) and not box.handle(done(4, 3))
    assert box.handle(done(7, 1)), "the window moved on"
    assert box.dropped == 4


def test_the_inbox_window_is_anchored_at_the_ranks_own_version_not_at_what_arrives():
    # Two far versions sent first (by anyone holding the nonce) must not close the window
    # to the real ones: once the rank begins or finishes a version, only it and the next
    # are kept, and what lies outside is dropped.
    done = lambda v, s: P.Message(P.DONE, v, s, b"\x01" + b"d" * 16)  # noqa: E731
    box = P.Inbox()
    assert box.handle(done(1 << 40, 1)) and box.handle(done((1 << 40) + 1, 1))
    box.begin(3)
    assert box.get(P.DONE, 1 << 40) == [] and box.handle(done(3, 1)) and box.handle(done(4, 1))
    assert not box.handle(done(1 << 40, 2)) and not box.handle(done(5, 1)) and not box.handle(done(2, 1))
    box.finish(3)
    assert box.get(P.DONE, 4) and box.handle(done(5, 1)) and not box.handle(done(6, 1))
    # A rank that finished a version without having begun one here (a fresh inbox) too.
    box = P.Inbox()
    box.finish(0)
    assert not box.handle(done(1 << 40, 1)) and box.handle(done(1, 1)) and box.handle(done(2, 1))


def test_the_coordinator_commits_only_on_every_members_success_with_its_layout():
    ok = b"\x01" + b"d" * 16
    everyone = {m: ok for m in range(4)}
    assert P.decide(everyone, 2, 2, b"d" * 16) == ""
    assert "receiver 1 did not report" in P.decide({m: ok for m in range(3)}, 2, 2, b"d" * 16)
    assert P.decide({**everyone, 1: b"\x00" + b"d" * 16 + b"disk full"}, 2, 2, b"d" * 16) == "disk full"
    assert "different layout" in P.decide({**everyone, 2: b"\x01" + b"e" * 16}, 2, 2, b"d" * 16)


@settings(max_examples=400, deadline=None)
@given(st.binary(max_size=600), st.sampled_from([COORD, SENDER1, RECV]))
def test_fuzz_the_message_decoder_refuses_by_type(raw, rules):
    try:
        rules.decode(raw)
    except P.ProtocolError:
        pass


@settings(max_examples=300, deadline=None)
@given(st.integers(0, 5), st.integers(0, 3), st.binary(max_size=200), st.integers(0, 2**64 - 1))
def test_fuzz_well_framed_messages_with_any_payload(kind, sender, payload, version):
    raw = msg(kind, sender, payload, version=version)
    for rules in (COORD, SENDER1, RECV):
        try:
            m = rules.decode(raw)
        except P.ProtocolError:
            continue
        if m.kind == P.MANIFEST:
            P.parse_manifest(m.payload)


def layout_sample():
    t = (TensorSpec("q", (8, 6), "float32"), TensorSpec("n", (6,), "bfloat16"))
    return Layout(t, ((0, "q", ("dim", 1, 0, 3)), (1, "q", ("dim", 1, 3, 6)), (0, "n", None)),
                  ((0, "qn", (8, 6), (("q", None, (0, 0)),)), (1, "n", (6,), (("n", None, (0,)),))))


def test_a_layout_round_trips_through_its_decoder():
    layout = layout_sample()
    assert Layout.from_json(layout.to_json()) == layout


@pytest.mark.parametrize(
    "raw",
    [
        b"[" * 100_000 + b"]" * 100_000,  # nested: RecursionError in json
        b'{"tensors": [["q", [Infinity], "float32"]], "shards": [], "params": []}',
        b'{"tensors": [["q", [1e400], "float32"]], "shards": [], "params": []}',
        b'{"tensors": [["q", [true], "float32"]], "shards": [], "params": []}',
        b'{"tensors": [["q", [-1], "float32"]], "shards": [], "params": []}',
        b'{"tensors": [["q", [4294967296, 4294967296], "float32"]], "shards": [], "params": []}',
        b'{"tensors": [["q", [2], "complex1024"]], "shards": [], "params": []}',
        b'{"tensors": [], "shards": [[0, "nope", null]], "params": []}',
        b'{"tensors": [["q", [2], "int8"], ["q", [2], "int8"]], "shards": [], "params": []}',
        b'{"tensors": [], "shards": [], "params": [], "extra": 1}',
        b'\xff\xfe',
        b"null",
    ],
)
def test_the_layout_decoder_refuses_what_is_not_a_layout(raw):
    with pytest.raises(LayoutError):
        Layout.from_json(raw)


def _json_values():
    leaves = st.none() | st.booleans() | st.integers(-(2**70), 2**70) | st.floats() | st.text(max_size=6)
    return st.recursive(leaves, lambda c: st.lists(c, max_size=4) | st.dictionaries(st.text(max_size=8), c, max_size=4), max_leaves=30)


@settings(max_examples=400, deadline=None)
@given(st.one_of(
    st.binary(max_size=300),
    _json_values().map(lambda v: json.dumps(v).encode()),
    # Mutations of a real layout: one value replaced anywhere in its tree.
    st.tuples(st.integers(0, 10_000), _json_values()).map(lambda p: _mutated(p[0], p[1])),
))
def test_fuzz_the_layout_decoder_refuses_by_type(raw):
    try:
        layout = Layout.from_json(raw)
    except LayoutError:
        return
    # Whatever it accepts is a layout that encodes back to an equal one.
    assert Layout.from_json(layout.to_json()) == layout


def _mutated(seed, value):
    tree = json.loads(layout_sample().to_json())
    spots = []

    def walk(node):
        for k in (range(len(node)) if isinstance(node, list) else list(node)):
            spots.append((node, k))
            if isinstance(node[k], (list, dict)):
                walk(node[k])

    walk(tree)
    node, k = spots[seed % len(spots)]
    node[k] = value
    return json.dumps(tree).encode()
