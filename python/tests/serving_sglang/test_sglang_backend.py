"""xfer.sglang against SGLang's own classes (issue 28), on a CPU-only machine: a prefill and a
decode XferKVManager (SGLang's KVArgs, DisaggregationMode, ServerArgs), their senders and
receivers driven through SGLang's KVPoll states as its prefill and decode loops drive them,
over the mock backend, numpy arrays as the KV and aux buffers."""

import time

import numpy as np
import pytest

pytest.importorskip("sglang")

from sglang.srt.disaggregation.base.conn import KVArgs, KVPoll  # noqa: E402
from sglang.srt.disaggregation.utils import DisaggregationMode  # noqa: E402
from sglang.srt.server_args import ServerArgs  # noqa: E402

import xfer  # noqa: E402
import xfer.sglang as xs  # noqa: E402

PAGES, PAGE_BYTES, AUX_BYTES, BUFFERS = 32, 256, 64, 4  # 2 layers x (K, V)
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


class Side:
    """One rank of one instance: its buffers and its XferKVManager."""

    def __init__(self, mode, addr, seed):
        rng = np.random.default_rng(seed)
        self.kv = [rng.integers(0, 255, PAGES * PAGE_BYTES, dtype=np.uint8) for _ in range(BUFFERS)]
        self.aux = [rng.integers(0, 255, 8 * AUX_BYTES, dtype=np.uint8)]
        args = KVArgs()
        args.engine_rank = 0
        args.kv_data_ptrs = [a.ctypes.data for a in self.kv]
        args.kv_data_lens = [a.nbytes for a in self.kv]
        args.kv_item_lens = [PAGE_BYTES] * BUFFERS
        args.aux_data_ptrs = [a.ctypes.data for a in self.aux]
        args.aux_data_lens = [a.nbytes for a in self.aux]
        args.aux_item_lens = [AUX_BYTES]
        args.page_size = 16
        host, port = addr.split(":")
        server_args = ServerArgs(model_path="dummy", device="cpu", disaggregation_mode=mode.value,
                                 disaggregation_bootstrap_port=int(port))
        self.mgr = xs.XferKVManager(args, mode, server_args)

    def close(self):
        self.mgr.close()


def until(what, cond):
    deadline = time.monotonic() + WAIT
    while not cond():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.001)


def test_sglang_finds_the_backend_after_register():
    from sglang.srt.arg_groups.choices import DISAGG_TRANSFER_BACKEND_CHOICES
    from sglang.srt.disaggregation.utils import KVClassType, TransferBackend, get_kv_class

    assert "xfer" in DISAGG_TRANSFER_BACKEND_CHOICES
    backend = TransferBackend("xfer")
    assert get_kv_class(backend, KVClassType.MANAGER) is xs.XferKVManager
    assert get_kv_class(backend, KVClassType.SENDER) is xs.XferKVSender
    assert get_kv_class(backend, KVClassType.BOOTSTRAP_SERVER) is xs.XferKVBootstrapServer
    assert get_kv_class(TransferBackend("fake"), KVClassType.MANAGER).__name__ == "FakeKVManager"


def test_chunks_pushed_into_the_decode_pages_with_aux_then_both_succeed(bootstrap):
    p = Side(DisaggregationMode.PREFILL, bootstrap, 1)
    d = Side(DisaggregationMode.DECODE, bootstrap, 2)
    receiver = xs.XferKVReceiver(d.mgr, bootstrap, 77)
    assert receiver.poll() == KVPoll.Bootstrapping
    receiver.init(0)
    assert receiver.poll() == KVPoll.WaitingForInput
    sender = xs.XferKVSender(p.mgr, bootstrap, 77)
    sender.init(6, aux_index=2)
    assert sender.poll() == KVPoll.Bootstrapping
    src, dst = [3, 9, 4, 20, 21, 1], [30, 2, 17, 5, 6, 11]
    receiver.send_metadata(np.array(dst, dtype=np.int32), aux_index=5)
    until("the page indices", lambda: sender.poll() == KVPoll.WaitingForInput)
    sender.send(np.array(src[:4], dtype=np.int32))   # a chunk as it is computed
    assert sender.poll() in (KVPoll.Transferring, KVPoll.Success)
    sender.send(np.array(src[4:], dtype=np.int32))   # the last chunk
    until("the sender", lambda: sender.poll() == KVPoll.Success)
    until("the receiver", lambda: receiver.poll() == KVPoll.Success)
    for ours, theirs in zip(d.kv, p.kv):
        for s, t in zip(src, dst):
            assert np.array_equal(ours[t * PAGE_BYTES:(t + 1) * PAGE_BYTES],
                                  theirs[s * PAGE_BYTES:(s + 1) * PAGE_BYTES])
    assert np.array_equal(d.aux[0][5 * AUX_BYTES:6 * AUX_BYTES], p.aux[0][2 * AUX_BYTES:3 * AUX_BYTES])
    metric = sender.get_transfer_metric()
    assert metric.transfer_total_bytes == 6 * PAGE_BYTES * BUFFERS
    p.close(), d.close()


def test_a_dead_decode_fails_the_sender(bootstrap, monkeypatch):
    monkeypatch.setattr(xs, "transfer_timeout_s", 1.0)
    p = Side(DisaggregationMode.PREFILL, bootstrap, 3)
    d = Side(DisaggregationMode.DECODE, bootstrap, 4)
    receiver = xs.XferKVReceiver(d.mgr, bootstrap, 5)
    receiver.init(0)
    receiver.send_metadata(np.array([1, 2], dtype=np.int32))
    sender = xs.XferKVSender(p.mgr, bootstrap, 5)
    sender.init(2)
    until("the page indices", lambda: sender.poll() == KVPoll.WaitingForInput)
    d.mgr.engine.close()   # the decode process dies
    sender.send(np.array([3, 4], dtype=np.int32))
    until("the sender to fail", lambda: sender.poll() == KVPoll.Failed)
    with pytest.raises(RuntimeError, match="xfer transfer failed"):
        sender.failure_exception()
    p.close()


def test_a_prefill_that_never_sends_fails_the_receiver_within_its_deadline(bootstrap, monkeypatch):
    monkeypatch.setattr(xs, "transfer_timeout_s", 0.5)
    p = Side(DisaggregationMode.PREFILL, bootstrap, 5)
    d = Side(DisaggregationMode.DECODE, bootstrap, 6)
    receiver = xs.XferKVReceiver(d.mgr, bootstrap, 9)
    receiver.init(0)
    receiver.send_metadata(np.array([1], dtype=np.int32))
    until("the receiver to give up", lambda: receiver.poll() == KVPoll.Failed)
    with pytest.raises(RuntimeError, match="no data within"):
        receiver.failure_exception()
    p.close(), d.close()


def test_no_prefill_at_the_bootstrap_and_abort(bootstrap, monkeypatch):
    monkeypatch.setattr(xs, "transfer_timeout_s", 0.5)
    d = Side(DisaggregationMode.DECODE, bootstrap, 7)
    receiver = xs.XferKVReceiver(d.mgr, bootstrap, 1)
    receiver.init(0)
    assert receiver.poll() == KVPoll.Failed
    other = xs.XferKVReceiver(d.mgr, bootstrap, 2)
    other.abort()
    assert other.poll() == KVPoll.Failed
    d.close()


def test_without_a_config_the_backend_refuses_to_start(monkeypatch):
    monkeypatch.setattr(xs, "_config", None)
    monkeypatch.delenv("XFER_CONFIG", raising=False)
    with pytest.raises(ValueError, match="XFER_CONFIG"):
        xs._engine_config()
