"""Fuzzing the KV connectors' Python decoders of untrusted input (issue 56) with hypothesis:
control messages (``xfer.kv.control``), a request's ``kv_transfer_params``
(``xfer.kv.params``), published layer views (``xfer.kv.pages.parse_view``) and SGLang's
published KV shape (``xfer.kv.sglang_layout.KvShape.parse``). Each raises only its own typed
error — never a ``KeyError``, ``RecursionError``, ``OverflowError``, ``UnicodeDecodeError`` —
and what it accepts is within its bounds."""

import json

import pytest

hypothesis = pytest.importorskip("hypothesis")
from hypothesis import given, settings  # noqa: E402
from hypothesis import strategies as st  # noqa: E402

from xfer.kv import control, params, sglang_layout  # noqa: E402
from xfer.kv.pages import LayoutError, parse_view  # noqa: E402

PREFIXES = (b"xfer-vllm-done:", b"xfer-vllm-read:", b"xfer-vllm-held:")
FUZZ = settings(max_examples=400, deadline=None)

json_values = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats(allow_nan=True) | st.text(max_size=40),
    lambda inner: st.lists(inner, max_size=5) | st.dictionaries(st.text(max_size=12), inner,
                                                                 max_size=6),
    max_leaves=30)


def framed(prefix, body, length=None):
    return prefix + (len(body) if length is None else length).to_bytes(4, "little") + body


@FUZZ
@given(st.binary(max_size=300))
def test_control_decode_of_any_bytes_is_a_message_or_a_control_error(data):
    try:
        kind, header, payload = control.decode(data, PREFIXES)
    except control.ControlError:
        return
    assert kind in PREFIXES and isinstance(header.fields, dict)


@FUZZ
@given(st.sampled_from(PREFIXES), st.binary(max_size=200) | st.text(max_size=200).map(str.encode),
       st.one_of(st.none(), st.integers(0, 2**32 - 1)))
def test_control_decode_of_framed_garbage(prefix, body, length):
    try:
        control.decode(framed(prefix, body, length), PREFIXES)
    except control.ControlError:
        pass


@pytest.mark.parametrize("body", [b"[" * 4000, b'{"a":' * 900 + b"1" + b"}" * 900,
                                  b'{"rank": Infinity}', b'{"rank": NaN}', b"\xff\xfe{}",
                                  b'{"rank": 1e999}'])
def test_the_classic_json_bombs_are_control_errors(body):
    with pytest.raises(control.ControlError):
        kind, header, _ = control.decode(framed(PREFIXES[0], body), PREFIXES)
        header.integer("rank", 0, 63)


@FUZZ
@given(st.dictionaries(st.sampled_from(["req", "token", "rank", "tp", "addr", "ok", "why"]),
                       json_values, max_size=7))
def test_header_accessors_return_bounded_typed_values_or_refuse(fields):
    header = control.Header(json.loads(json.dumps(fields, allow_nan=True)))
    for read in (lambda: header.text("req", 16), lambda: header.integer("rank", 0, 63),
                 lambda: header.flag("ok"), lambda: header.token(), lambda: header.hex_bytes("addr"),
                 lambda: header.optional_text("why", 32)):
        try:
            value = read()
        except control.ControlError:
            continue
        if isinstance(value, int) and not isinstance(value, bool):
            assert 0 <= value <= 63
        if isinstance(value, str):
            assert len(value) <= 32


@FUZZ
@given(st.binary(max_size=64))
def test_block_ids_of_any_payload(payload):
    try:
        ids = control.block_ids_of(payload, max_count=8)
    except control.ControlError:
        return
    assert len(ids) <= 8 and all(0 <= b < 2**31 for b in ids)


@FUZZ
@given(st.dictionaries(st.sampled_from(
    ["do_remote_prefill", "xfer_push", "remote_engine_id", "remote_request_id", "remote_tp_size",
     "remote_block_ids", "remote_rendezvous", "xfer_token", "remote_model", "xfer_protocol",
     "xfer_lease_s"]),
    json_values, max_size=10))
def test_kv_transfer_params_parse_or_refuse_within_bounds(raw):
    try:
        remote = params.parse_remote_prefill(raw, prompt_tokens=100, block_size=16, local_tp=2,
                                             groups=1, allowed={"xfer://a:1"})
    except params.ParamsError:
        return
    assert 1 <= remote.tp_size <= params.MAX_TP and max(remote.tp_size, 2) % min(remote.tp_size, 2) == 0
    assert control.is_token(remote.token)
    assert remote.rendezvous in (None, "xfer://a:1")
    assert all(len(g) <= 7 and all(0 <= b < 2**31 for b in g) for g in remote.block_ids)


@FUZZ
@given(st.text(max_size=80) | st.from_regex(r"-?\d{1,4}-\d{1,3}x\d{1,3}x\d{1,3}x\d{1,3}-"
                                            r"\d{1,5}\.\d{1,5}\.\d{1,5}\.\d{1,5}-\d-[a-z0-9.]{1,12}"
                                            r"-\d{1,3}-\d{1,3}", fullmatch=True))
def test_published_layer_views_parse_or_refuse(text):
    try:
        view = parse_view(text)
    except LayoutError:
        return
    assert view.kernel_blocks >= 1 and min(view.shape) >= 1 and view.offset >= 0


@FUZZ
@given(st.text(max_size=80))
def test_sglang_published_shapes_parse_or_refuse(text):
    try:
        sglang_layout.KvShape.parse(text)
    except LayoutError:
        pass
