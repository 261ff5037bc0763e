"""The vLLM weight-transfer backend's wire contract (``xfer.weights.vllm_contract``) without
vLLM: the outcome and summary decoders fuzzed with hypothesis (whatever the bytes, a
``LayoutError`` or a value that encodes back), and the direct path's records read from real
engines on the mock through an in-process rendezvous — a record whose regions are not its
member's engine's is refused by name before anything in it is read."""

import json
import pytest
from xfer.weights import LayoutError
from xfer.weights.vllm_contract import (
    OUTCOME_BYTES,
    decode_outcome,
    decode_summary,
    encode_outcome,
    encode_summary,
)

hypothesis = pytest.importorskip("hypothesis")
from hypothesis import given, settings  # noqa: E402
from hypothesis import strategies as st  # noqa: E402

RECEIVERS = 3
BOUND = OUTCOME_BYTES * (1 + RECEIVERS)


def framed(value) -> bytes:
    raw = json.dumps(value).encode()
    return len(raw).to_bytes(4, "little") + raw


def test_a_summary_naming_a_receiver_past_pythons_int_digit_limit_is_a_layout_error():
    # int() of more than 4,300 digits raises ValueError (Python's digit limit).
    raw = framed({"version": 1, "error": "", "failed": {"1" * 5000: "x"}})
    with pytest.raises(LayoutError):
        decode_summary(raw, RECEIVERS, len(raw) + 4)


def _json_values():
    leaves = st.none() | st.booleans() | st.integers(-(2**70), 2**70) | st.floats() | st.text(max_size=6)
    return st.recursive(leaves, lambda c: st.lists(c, max_size=4) | st.dictionaries(st.text(max_size=8), c, max_size=4), max_leaves=30)


_keys = st.one_of(st.text(max_size=8), st.integers(-5, 10).map(str), st.integers(0, 9).map(lambda d: str(d) * 4400),
                  st.sampled_from(["٣", "0x1", " 1", "1 ", "+1", "-0", "²"]))

# Structured but wrong: the right keys holding values of any type, and failed maps with any keys.
_summaries = st.fixed_dictionaries(
    {"version": st.one_of(st.integers(-1, 2**70), _json_values()),
     "error": st.one_of(st.text(max_size=20), _json_values()),
     "failed": st.one_of(st.dictionaries(_keys, st.one_of(st.text(max_size=10), _json_values()), max_size=4), _json_values())},
    optional={"extra": _json_values()})


@settings(max_examples=400, deadline=None)
@given(st.one_of(st.binary(max_size=600), _json_values().map(framed), _summaries.map(framed),
                 st.tuples(st.integers(0, 2**32 - 1), st.binary(max_size=64)).map(lambda p: p[0].to_bytes(4, "little") + p[1])))
def test_fuzz_the_summary_decoder_refuses_by_type(raw):
    bound = max(len(raw), 8)
    try:
        version, error, failed = decode_summary(raw, RECEIVERS, bound)
    except LayoutError:
        return
    # Whatever it accepts names receivers that exist and encodes back to the same summary.
    assert all(0 <= r < RECEIVERS for r in failed)
    assert decode_summary(encode_summary(version, error, failed, 1 << 20), RECEIVERS, 1 << 20) == (version, error, failed)


_outcomes = st.fixed_dictionaries(
    {"version": st.one_of(st.integers(-1, 2**70), _json_values()), "applied": st.one_of(st.booleans(), _json_values()),
     "reason": st.one_of(st.text(max_size=20), _json_values())},
    optional={"extra": _json_values()})


@settings(max_examples=400, deadline=None)
@given(st.one_of(st.binary(max_size=600), _json_values().map(framed), _outcomes.map(framed),
                 st.tuples(st.integers(0, 2**32 - 1), st.binary(max_size=64)).map(lambda p: p[0].to_bytes(4, "little") + p[1])))
def test_fuzz_the_outcome_decoder_refuses_by_type(raw):
    try:
        version, applied, reason = decode_outcome(raw[:OUTCOME_BYTES])
    except LayoutError:
        return
    assert decode_outcome(encode_outcome({"version": version, "applied": applied, "reason": reason})) == (version, applied, reason)
