"""xfer.weights.slices, the pure part of "each rank receives only what its loader takes": a
parameter traced with ids is split into boxes of checkpoint tensors, or refused (received
whole) when the ids show a transform; the rank's part of the layout plans to exactly its
boxes' bytes; a part published by a receiver is decoded by one bounded decoder. The id arrays
here are hand-made (a pure helper's unit test); the same code under vLLM's own loaders is in
serving_vllm/test_vllm_weight_transfer_api.py."""

import numpy as np
import pytest

from xfer.weights import Layout, LayoutError, TensorSpec, plan
from xfer.weights.slices import decode_receiver_layout, id_bases, pieces_of, receiver_params, trace_tensor

Q = TensorSpec("l.q.weight", (4, 3), "bfloat16")
K = TensorSpec("l.k.weight", (2, 3), "bfloat16")
O = TensorSpec("l.o.weight", (3, 4), "bfloat16")
NORM = TensorSpec("l.norm.weight", (3,), "bfloat16")
TENSORS = (Q, K, O, NORM)
BASES = id_bases(TENSORS)


def ids(t):
    return trace_tensor(TENSORS.index(t), TENSORS, BASES)


def tp_rank(rank, tp=2):
    """What a column/row-parallel loader leaves in rank ``rank``'s parameters: fused qk rows
    (q then k, each sliced), o's columns, the norm whole."""
    q, k, o = ids(Q), ids(K), ids(O)
    qk = np.concatenate([q[rank * 2 : rank * 2 + 2], k[rank : rank + 1]])
    return {
        "l.qk.weight": (qk, "bfloat16"),
        "l.o.weight": (o[:, rank * 2 : rank * 2 + 2].copy(), "bfloat16"),
        "l.norm.weight": (ids(NORM), "bfloat16"),
    }


def test_a_fused_tensor_parallel_parameter_is_boxes_of_each_tensors_slice():
    boxes = pieces_of(tp_rank(1)["l.qk.weight"][0], TENSORS, BASES)
    assert boxes == [((0, 0), (2, 3), ("l.q.weight", ("dim", 0, 2, 4), (0, 0))),
                     ((2, 0), (1, 3), ("l.k.weight", ("dim", 0, 1, 2), (0, 0)))]
    assert pieces_of(tp_rank(0)["l.o.weight"][0], TENSORS, BASES) == [((0, 0), (3, 2), ("l.o.weight", ("dim", 1, 0, 2), (0, 0)))]
    assert pieces_of(ids(NORM), TENSORS, BASES) == [((0,), (3,), ("l.norm.weight", None, (0,)))]


def test_rows_the_loader_leaves_untouched_are_not_received():
    padded = np.full((6, 3), -1, dtype=np.int64)  # a vocab-parallel shard padded past the vocab
    padded[:4] = ids(Q)
    assert pieces_of(padded, TENSORS, BASES) == [((0, 0), (4, 3), ("l.q.weight", None, (0, 0)))]


@pytest.mark.parametrize("how", ["transposed", "scaled", "shuffled", "two dims cut", "past every tensor"])
def test_a_parameter_the_loader_transformed_is_refused(how):
    q = ids(Q)
    traced = {
        "transposed": np.ascontiguousarray(ids(O).T),
        "scaled": q * 2,
        "shuffled": q[::-1].copy(),
        "two dims cut": q[:2, :2].copy(),
        "past every tensor": q + 10_000,
    }[how]
    assert pieces_of(traced, TENSORS, BASES) is None


def test_a_ranks_part_of_the_layout_plans_to_exactly_its_slices_bytes():
    parts = [receiver_params(r, tp_rank(r), TENSORS) for r in (0, 1)]
    assert [p.whole for p in parts] == [(), ()]
    shards = tuple((0, t.name, None) for t in TENSORS)
    layout = Layout(TENSORS, shards, parts[0].params + parts[1].params)
    writes = plan(layout)
    whole = sum(t.nbytes for t in TENSORS)
    # Each rank: half of q, k and o, all of the norm.
    assert writes.received == [(whole - NORM.nbytes) // 2 + NORM.nbytes] * 2
    assert sorted(b.name for b in parts[1].boxes) == ["p:l.norm.weight#0", "p:l.o.weight#0,0", "p:l.qk.weight#0,0", "p:l.qk.weight#2,0"]


def test_a_transformed_parameter_takes_its_module_and_tensors_whole():
    traced = tp_rank(0)
    traced["l.o.weight"] = (np.ascontiguousarray(ids(O)[:, :2].T), "bfloat16")  # shape-swapped: refused
    traced["l.o.bias"] = (ids(NORM), "bfloat16")  # a box on its own, but in o's module
    traced["l.extra"] = (np.full(2, -1, dtype=np.int64), "float32")  # untouched: ignored
    part = receiver_params(0, traced, TENSORS)
    # o's module ("l.o") loads whole, so the norm tensor is whole, so the norm parameter
    # it also feeds is too; qk (another module, other tensors) stays boxes.
    assert part.whole == ("l.o.weight", "l.norm.weight")
    assert {b.param for b in part.boxes} == {"l.qk.weight"}
    assert [p[1] for p in part.params if p[1].startswith("t:")] == ["t:l.o.weight", "t:l.norm.weight"]


def test_a_tensor_that_lands_in_no_parameter_and_a_dtype_mismatch_are_received_whole():
    traced = {"a.qk.weight": tp_rank(0)["l.qk.weight"], "b.norm.weight": (ids(NORM), "float32")}
    part = receiver_params(0, traced, TENSORS)
    # o lands nowhere (a buffer, a skipped name): whole. The norm is cast to float32: whole.
    assert part.whole == ("l.o.weight", "l.norm.weight")
    assert {b.param for b in part.boxes} == {"a.qk.weight"}
    assert receiver_params(0, traced, TENSORS, direct=False).boxes == ()


def test_parameters_the_host_processes_apart_are_received_whole_with_their_module():
    # vLLM processes an attention layer's parameters only when its reload is finished, not
    # when the layer's boxes are in: the adapter names them, and they (with their module and
    # their tensors) go through load_weights like a transformed parameter.
    traced = tp_rank(0)
    traced["l.o.bias"] = (ids(NORM), "bfloat16")
    part = receiver_params(0, traced, TENSORS, whole_params={"l.o.weight"})
    assert part.whole == ("l.o.weight", "l.norm.weight")
    assert {b.param for b in part.boxes} == {"l.qk.weight"}


def test_a_published_part_is_decoded_only_as_the_ranks_own():
    part = receiver_params(1, tp_rank(1), TENSORS)
    raw = Layout(TENSORS, (), part.params).to_json()
    assert decode_receiver_layout(raw, 1, TENSORS).params == part.params
    with pytest.raises(LayoutError, match="rank 1"):
        decode_receiver_layout(raw, 0, TENSORS)
    with pytest.raises(LayoutError, match="other tensors"):
        decode_receiver_layout(raw, 1, TENSORS[:3])
    bad = Layout(TENSORS, (), ((1, "x", (3,), (("l.norm.weight", None, (0,)),)),)).to_json()
    with pytest.raises(LayoutError, match="name"):
        decode_receiver_layout(bad, 1, TENSORS)
    with pytest.raises(LayoutError):
        decode_receiver_layout(b"{" * 100_000, 1, TENSORS)


hypothesis = pytest.importorskip("hypothesis")
from hypothesis import given, settings  # noqa: E402
from hypothesis import strategies as st  # noqa: E402

_VALID = Layout(TENSORS, (), receiver_params(1, tp_rank(1), TENSORS).params).to_json()


@settings(max_examples=300, deadline=None)
@given(st.one_of(st.binary(max_size=512), st.integers(0, len(_VALID)).flatmap(
    lambda cut: st.binary(max_size=8).map(lambda junk: _VALID[:cut] + junk + _VALID[cut + len(junk):]))))
def test_whatever_a_receiver_publishes_is_a_layout_error_or_its_own_part(raw):
    # A receiver's published part is read by every trainer rank: untrusted bytes.
    try:
        layout = decode_receiver_layout(raw, 1, TENSORS)
    except LayoutError:
        return
    assert layout.tensors == TENSORS and all(p[0] == 1 for p in layout.params)
