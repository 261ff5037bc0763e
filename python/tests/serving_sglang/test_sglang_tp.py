"""xfer.sglang across attention TP sizes (issue 28): prefill and decode ranks with different
head splits, standard attention and MLA, every byte checked against the whole model's KV;
layouts that cannot exchange refused by name; decode prefix reuse; state buffers refused."""

import time

import numpy as np
import pytest

pytest.importorskip("sglang")

from sglang.srt.disaggregation.base.conn import KVArgs, KVPoll  # noqa: E402
from sglang.srt.disaggregation.utils import DisaggregationMode  # noqa: E402
from sglang.srt.server_args import ServerArgs  # noqa: E402

import xfer.sglang as xs  # noqa: E402

HEADS, HEAD_BYTES, PAGE, PAGES, BUFFERS, AUX_BYTES = 4, 8, 4, 16, 2, 16
PREFILL, DECODE = DisaggregationMode.PREFILL, DisaggregationMode.DECODE
WAIT = 20.0


MOCK = {"backend": "mock", "groups": [{"nics": ["mock0"]}], "timeouts": {"transfer_ms": 2000}}


# Not in a conftest.py: this directory has no package, and a second `conftest` module would
# shadow python/tests/conftest.py for the suites that import from it.
@pytest.fixture(scope="module", autouse=True)
def registered():
    xs.register(config=MOCK)


@pytest.fixture
def bootstrap():
    server = xs.XferKVBootstrapServer("127.0.0.1", 0)
    yield server.url.removeprefix("xfer://")
    server.close()


def until(what, cond):
    deadline = time.monotonic() + WAIT
    while not cond():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.001)


class Rank:
    """One attention-TP rank: its share of every KV buffer (prefill: a slice of ``model``'s
    heads; decode: zeros) and its XferKVManager."""

    def __init__(self, mode, addr, tp, rank, *, model=None, mla=False, page=PAGE, heads=None,
                 state=None):
        per_rank = heads if heads is not None else (1 if mla else HEADS // tp)
        self.heads = slice(0, 1) if mla else slice(rank * per_rank, (rank + 1) * per_rank)
        if model is None:
            self.kv = [np.zeros((PAGES, page, per_rank, HEAD_BYTES), np.uint8) for _ in range(BUFFERS)]
            self.aux = [np.zeros(4 * AUX_BYTES, np.uint8)]
        else:
            self.kv = [np.ascontiguousarray(m[:, :, self.heads, :]) for m in model]
            self.aux = [np.arange(4 * AUX_BYTES, dtype=np.uint8)]  # the same on every rank
        args = KVArgs()
        args.engine_rank = rank
        args.kv_data_ptrs = [a.ctypes.data for a in self.kv]
        args.kv_data_lens = [a.nbytes for a in self.kv]
        args.kv_item_lens = [page * per_rank * HEAD_BYTES] * BUFFERS
        args.aux_data_ptrs = [a.ctypes.data for a in self.aux]
        args.aux_data_lens = [a.nbytes for a in self.aux]
        args.aux_item_lens = [AUX_BYTES]
        args.page_size = page
        args.kv_head_num = per_rank
        args.total_kv_head_num = HEADS
        if state is not None:
            args.state_data_ptrs = state
        host, port = addr.split(":")
        server_args = ServerArgs(model_path="dummy", device="cpu", disaggregation_mode=mode.value,
                                 disaggregation_bootstrap_port=int(port))
        server_args.tp_size = tp
        self.mgr = xs.XferKVManager(args, mode, server_args, is_mla_backend=mla)

    def close(self):
        self.mgr.close()


def model_kv(seed, mla):
    rng = np.random.default_rng(seed)
    return [rng.integers(1, 255, (PAGES, PAGE, 1 if mla else HEADS, HEAD_BYTES), dtype=np.uint8)
            for _ in range(BUFFERS)]


def test_targets_and_sources_pair_every_rank_both_ways():
    for p_tp, d_tp in [(1, 1), (1, 2), (2, 1), (4, 2), (2, 4), (1, 4), (4, 1), (8, 2)]:
        for mla in (False, True):
            covered = set()
            for r in range(d_tp):
                targets = xs.prefill_targets(r, d_tp, p_tp, mla)
                assert targets and all(0 <= t < p_tp for t in targets)
                covered.update(targets)
                for t in targets:
                    assert r in xs.decode_sources(t, d_tp, p_tp, mla)
            assert covered == set(range(p_tp)), (p_tp, d_tp, mla)


@pytest.mark.parametrize("prefill_tp,decode_tp,mla", [
    (1, 1, False), (1, 2, False), (2, 1, False), (4, 2, False), (2, 4, False), (4, 4, False),
    (2, 1, True), (1, 2, True),
])
def test_every_decode_rank_receives_exactly_its_heads(bootstrap, prefill_tp, decode_tp, mla):
    model = model_kv(prefill_tp * 10 + decode_tp, mla)
    prefills = [Rank(PREFILL, bootstrap, prefill_tp, r, model=model, mla=mla) for r in range(prefill_tp)]
    decodes = [Rank(DECODE, bootstrap, decode_tp, r, mla=mla) for r in range(decode_tp)]
    room = 1000 + prefill_tp * 10 + decode_tp
    src, dst = [3, 9, 4, 12], [7, 0, 15, 2]
    receivers = [xs.XferKVReceiver(d.mgr, bootstrap, room) for d in decodes]
    for rx in receivers:
        rx.init(0)
        assert rx.poll() == KVPoll.WaitingForInput, rx.failure
        rx.send_metadata(np.array(dst, dtype=np.int32), aux_index=1)
    senders = [xs.XferKVSender(p.mgr, bootstrap, room) for p in prefills]
    for tx in senders:
        tx.init(len(src), aux_index=2)
        until("every decode rank's indices", lambda tx=tx: tx.poll() == KVPoll.WaitingForInput)
        tx.send(np.array(src[:2], dtype=np.int32))
        tx.send(np.array(src[2:], dtype=np.int32))
    for tx in senders:
        until("the senders", lambda tx=tx: tx.poll() == KVPoll.Success)
    for rx in receivers:
        until("the receivers", lambda rx=rx: rx.poll() == KVPoll.Success)
    for d in decodes:
        for got, whole in zip(d.kv, model):
            for s, t in zip(src, dst):
                assert np.array_equal(got[t], whole[s][:, d.heads, :]), (d.heads, s, t)
            untouched = [p for p in range(PAGES) if p not in dst]
            assert not got[untouched].any(), "a page outside the request was written"
        assert np.array_equal(d.aux[0][AUX_BYTES:2 * AUX_BYTES],
                              prefills[0].aux[0][2 * AUX_BYTES:3 * AUX_BYTES])
    for r in prefills + decodes:
        r.close()


def test_layouts_that_cannot_exchange_are_refused_by_name(bootstrap):
    p = Rank(PREFILL, bootstrap, 1, 0, model=model_kv(1, False))
    for decode, why in [
        (dict(page=2 * PAGE), "page size differs"),
        (dict(heads=HEADS // 2), "KV heads differ"),       # TP 1 with half the heads
        (dict(mla=True), "MLA differs"),
    ]:
        d = Rank(DECODE, bootstrap, 1, 0, **decode)
        rx = xs.XferKVReceiver(d.mgr, bootstrap, 5)
        rx.init(0)
        assert rx.poll() == KVPoll.Failed
        with pytest.raises(RuntimeError, match=why):
            rx.failure_exception()
        d.close()
    p.close()


def test_tp_sizes_that_do_not_divide_are_refused(bootstrap):
    p = Rank(PREFILL, bootstrap, 2, 0, model=model_kv(3, False))
    d = Rank(DECODE, bootstrap, 3, 0, heads=1)
    rx = xs.XferKVReceiver(d.mgr, bootstrap, 6)
    rx.init(0)
    assert rx.poll() == KVPoll.Failed
    with pytest.raises(RuntimeError, match="one must divide the other"):
        rx.failure_exception()
    p.close(), d.close()


def test_a_decode_prefix_is_not_sent_again(bootstrap):
    p = Rank(PREFILL, bootstrap, 1, 0, model=model_kv(2, False))
    d = Rank(DECODE, bootstrap, 1, 0)
    rx = xs.XferKVReceiver(d.mgr, bootstrap, 8)
    rx.init(0)
    rx.send_metadata(np.array([5], dtype=np.int32), decode_prefix_len=2 * PAGE)
    tx = xs.XferKVSender(p.mgr, bootstrap, 8)
    until("the indices", lambda: tx.poll() == KVPoll.WaitingForInput)
    assert tx.pop_decode_prefix_len() == 2 * PAGE
    p.close(), d.close()


def test_state_buffers_are_refused_when_the_manager_starts(bootstrap):
    with pytest.raises(NotImplementedError, match="state buffers"):
        Rank(DECODE, bootstrap, 1, 0, state=[[0x1000], []])
