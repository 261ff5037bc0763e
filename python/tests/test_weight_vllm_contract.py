"""The vLLM weight-transfer backend's wire contract (``xfer.weights.vllm_contract``) without
vLLM: the outcome and summary decoders fuzzed with hypothesis (whatever the bytes, a
``LayoutError`` or a value that encodes back), and the direct path's records read from real
engines on the mock through an in-process rendezvous — a record whose regions are not its
member's engine's is refused by name before anything in it is read."""

import json
import time

import numpy as np
import pytest
import xfer
from conftest import MOCK
from xfer.weights import Layout, LayoutError, TensorSpec
from xfer.weights.vllm_contract import (
    OUTCOME_BYTES,
    TraceFailed,
    _read_receiver,
    _slices_record,
    _summary_record,
    decode_outcome,
    decode_summary,
    encode_outcome,
    encode_summary,
    read_summary,
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


# --- the direct path's records, read from real engines on the mock -------------------------

TENSORS = (TensorSpec("w", (4,), "int8"),)


@pytest.fixture
def fabric():
    """An in-process rendezvous and three engines: the member, the reader, a squatter."""
    server = xfer.Server()
    rdv = xfer.Rendezvous(server.url)
    engines = [xfer.TransferEngine(MOCK) for _ in range(3)]
    held = []
    try:
        yield rdv, engines, held
    finally:
        for h in held:  # publications first, then the regions (with their buffers)
            if not isinstance(h, tuple):
                h.unpublish()
        for h in held:
            if isinstance(h, tuple):
                h[0].dereg()
        for e in engines:
            e.close()


def region_of(engine, raw, held):
    buf = np.frombuffer(bytearray(raw), dtype=np.uint8)
    region = engine.reg_mr(buf, access="read")
    held.append((region, buf))
    return region


def test_a_receivers_trace_failure_published_by_another_engine_is_refused_before_it_is_read(fabric):
    rdv, (member, reader, squatter), held = fabric
    held.append(rdv.publish("g.r0", member.main_address, {}, ttl=30.0))
    bait = region_of(squatter, b"attacker's words", held)
    # The squatter names the member's address and a region of its own.
    held.append(rdv.publish(_slices_record("g", 0), member.main_address, {"trace_failure": bait.desc}, ttl=30.0))
    with pytest.raises(LayoutError, match="another engine") as got:
        _read_receiver(reader, rdv, "g", 0, TENSORS, time.monotonic() + 5.0)
    assert "attacker" not in str(got.value)


def test_a_receivers_slices_published_by_another_engine_under_its_address_are_refused(fabric):
    rdv, (member, reader, squatter), held = fabric
    held.append(rdv.publish("g.r0", member.main_address, {}, ttl=30.0))
    # Slices that decode (no parameters), so that only the owner check can refuse them.
    slices = region_of(squatter, Layout(TENSORS, (), ()).to_json(), held)
    outcome = region_of(squatter, bytes(OUTCOME_BYTES), held)
    held.append(rdv.publish(_slices_record("g", 0), member.main_address, {"slices": slices.desc, "outcome": outcome.desc}, ttl=30.0))
    with pytest.raises(LayoutError, match="another engine"):
        _read_receiver(reader, rdv, "g", 0, TENSORS, time.monotonic() + 5.0)


def test_a_trace_failure_without_a_membership_is_read_only_from_the_engine_that_owns_it(fabric):
    # A worker whose loader cannot be traced publishes no membership: a record under its
    # address naming another engine's region is refused, its own is raised by name.
    rdv, (member, reader, squatter), held = fabric
    bait = region_of(squatter, b"attacker's words", held)
    squat = rdv.publish(_slices_record("g", 0), member.main_address, {"trace_failure": bait.desc}, ttl=30.0)
    with pytest.raises(LayoutError, match="another engine") as got:
        _read_receiver(reader, rdv, "g", 0, TENSORS, time.monotonic() + 5.0)
    assert "attacker" not in str(got.value)
    squat.unpublish()
    failure = region_of(member, b"tensor w", held)
    held.append(rdv.publish(_slices_record("g", 0), member.main_address, {"trace_failure": failure.desc}, ttl=30.0))
    with pytest.raises(TraceFailed, match="tensor w"):
        _read_receiver(reader, rdv, "g", 0, TENSORS, time.monotonic() + 5.0)


def test_a_summary_squatted_under_rank_zeros_address_is_refused_and_rank_zeros_own_is_read(fabric):
    rdv, (rank0, reader, squatter), held = fabric
    # A squatter pre-publishes version 1's summary ("every worker applied it") under rank 0's address.
    forged = region_of(squatter, encode_summary(1, "", {}, BOUND), held)
    squat = rdv.publish(_summary_record("g", 1), rank0.main_address, {"summary": forged.desc}, ttl=30.0)
    with pytest.raises(LayoutError, match="not published by trainer rank 0's engine"):
        read_summary(reader, rdv, "g", 1, bytes(rank0.main_address), RECEIVERS, BOUND, time.monotonic() + 5.0)
    squat.unpublish()
    real = region_of(rank0, encode_summary(1, "", {2: "no room"}, BOUND), held)
    held.append(rdv.publish(_summary_record("g", 1), rank0.main_address, {"summary": real.desc}, ttl=30.0))
    assert read_summary(reader, rdv, "g", 1, bytes(rank0.main_address), RECEIVERS, BOUND, time.monotonic() + 5.0) == {2: "no room"}
