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

    def __init__(self, mode, addr, seed, **server):
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
                                 disaggregation_bootstrap_port=int(port), **server)
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


def test_the_decode_queues_learn_the_prefill_topology_through_the_manager(bootstrap):
    """What DecodePreallocQueue reads of the manager before it makes a receiver
    (decode.py: try_ensure_parallel_info, prefill_info_table, _resolve_prefill_dp_rank)."""
    from unittest.mock import MagicMock

    from sglang.srt.disaggregation.decode import DecodePreallocQueue

    d = Side(DisaggregationMode.DECODE, bootstrap, 8)
    assert not d.mgr.try_ensure_parallel_info(bootstrap), "no prefill there yet"
    assert d.mgr.prefill_info_table.get(bootstrap) is None
    p = Side(DisaggregationMode.PREFILL, bootstrap, 9)
    # As the queue asks, each scheduler pass: "not yet" until the first contact (off the
    # scheduler thread) found the prefill.
    until("the prefill's topology", lambda: d.mgr.try_ensure_parallel_info(bootstrap))
    info = d.mgr.prefill_info_table[bootstrap]
    assert (info.attn_tp_size, info.dp_size, info.page_size) == (1, 1, 16)
    # The queue's own method, on a queue holding this manager (as SGLang's tests drive it).
    queue = MagicMock(spec=DecodePreallocQueue)
    queue.kv_manager = d.mgr
    req = MagicMock(bootstrap_host=bootstrap.split(":")[0],
                    bootstrap_port=int(bootstrap.split(":")[1]), disagg_prefill_dp_rank=None,
                    bootstrap_room=3)
    assert DecodePreallocQueue._resolve_prefill_dp_rank(queue, req) == 0
    assert d.mgr.kv_args is d.mgr.args and not d.mgr.supports_host_destination
    receiver = xs.XferKVReceiver(d.mgr, bootstrap, 11)
    assert receiver.kv_mgr is d.mgr and receiver.bootstrap_infos is None
    receiver.init(0)
    assert len(receiver.bootstrap_infos) == 1 and receiver.poll() == KVPoll.WaitingForInput
    p.close(), d.close()


def test_an_aborted_room_keeps_its_pages_until_every_prefill_rank_stopped_writing(bootstrap):
    """SGLang's deferred release (decode.py: ensure_abort_notified, then
    kv_mgr.is_abort_release_safe(room, len(bootstrap_infos)) before the pages are freed): the
    prefill rank answers only once nothing of its is in flight, and writes nothing after."""
    p = Side(DisaggregationMode.PREFILL, bootstrap, 10)
    d = Side(DisaggregationMode.DECODE, bootstrap, 11)
    receiver = xs.XferKVReceiver(d.mgr, bootstrap, 21)
    receiver.init(0)
    sender = xs.XferKVSender(p.mgr, bootstrap, 21)
    sender.init(2)
    receiver.send_metadata(np.array([6, 7], dtype=np.int32))
    until("the page indices", lambda: sender.poll() == KVPoll.WaitingForInput)
    before = [k.copy() for k in d.kv]
    assert d.mgr.enable_deferred_decode_kv_release
    receiver.abort()
    assert receiver.poll() == KVPoll.Failed and receiver.abort_notified
    required = len(receiver.bootstrap_infos)
    until("the prefill's answer", lambda: d.mgr.is_abort_release_safe(21, required))
    sender.send(np.array([1, 2], dtype=np.int32))  # the prefill's forward ends after all
    assert sender.poll() == KVPoll.Failed
    with pytest.raises(RuntimeError, match="aborted"):
        sender.failure_exception()
    assert 21 not in p.mgr.metadata and 21 not in p.mgr.senders, "a failed sender is cleared"
    for ours, was in zip(d.kv, before):
        assert np.array_equal(ours, was), "written after the abort was answered"
    d.mgr.clear_deferred_abort_state(21)
    assert not d.mgr.is_abort_release_safe(21, required)
    receiver.clear()
    p.close(), d.close()


def test_a_last_chunk_without_pages_still_goes():
    sender = xs.XferKVSender.__new__(xs.XferKVSender)
    assert sender.should_send_kv_chunk(0, True) and not sender.should_send_kv_chunk(0, False)


def test_prefill_ranks_register_at_the_bootstrap_host_sglang_names():
    assert xs._bootstrap_host(ServerArgs(model_path="m", device="cpu")) == "127.0.0.1"
    assert xs._bootstrap_host(ServerArgs(model_path="m", device="cpu", host="10.1.2.3")) == "10.1.2.3"
    across = ServerArgs(model_path="m", device="cpu", dist_init_addr="10.9.8.7:5000", nnodes=2)
    assert xs._bootstrap_host(across) == "10.9.8.7"


def test_sglang_processes_load_the_backend_from_its_entry_point():
    """SGLang's spawned schedulers (and its CLI, before it parses arguments) run
    sglang.srt.plugins.load_plugins(): a fresh interpreter that runs only that finds xfer."""
    import subprocess
    import sys

    script = (
        "from sglang.srt.plugins import load_plugins\n"
        "load_plugins()\n"
        "from sglang.srt.server_args import ServerArgs\n"
        "from sglang.srt.disaggregation.utils import KVClassType, TransferBackend, get_kv_class\n"
        "import argparse\n"
        "parser = argparse.ArgumentParser()\n"
        "ServerArgs.add_cli_args(parser)\n"
        "args = parser.parse_args(['--model-path', 'm', '--disaggregation-transfer-backend', 'xfer'])\n"
        "assert args.disaggregation_transfer_backend == 'xfer'\n"
        "print(get_kv_class(TransferBackend('xfer'), KVClassType.MANAGER).__qualname__)\n"
    )
    out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-3000:]
    assert out.stdout.strip().splitlines()[-1] == "XferKVManager"


def test_without_a_config_the_backend_refuses_to_start(monkeypatch):
    monkeypatch.setattr(xs, "_config", None)
    monkeypatch.delenv("XFER_CONFIG", raising=False)
    with pytest.raises(ValueError, match="XFER_CONFIG"):
        xs._engine_config()


class LateForward:
    """Stands in for the CUDA event SGLang records on its forward stream before an early send
    under overlap scheduling (``prefill.py``: ``req.disagg_kv_sender._early_send_wait_event``):
    the previous step's forward is still writing the cached prefix pages, and finishes them
    when the event is waited on. A CPU has no CUDA events; what it hides: a real event's
    ``synchronize`` blocks this thread until the GPU's stream reaches it."""

    def __init__(self, side, pages, value):
        self.side, self.pages, self.value, self.waited = side, pages, value, False

    def synchronize(self):
        for buffer in self.side.kv:
            for page in self.pages:
                buffer[page * PAGE_BYTES:(page + 1) * PAGE_BYTES] = self.value
        self.waited = True


def test_an_early_send_waits_for_the_forward_still_writing_its_prefix(bootstrap):
    """Issue 54: SGLang sends a cached prefix early, before the previous step's forward has
    finished writing it, and records an event for the sender to wait on; xfer posted at once
    and the decode got the pages' old bytes (SGLang had this bug in its Mooncake and NIXL
    backends)."""
    p = Side(DisaggregationMode.PREFILL, bootstrap, 30)
    d = Side(DisaggregationMode.DECODE, bootstrap, 31)
    receiver = xs.XferKVReceiver(d.mgr, bootstrap, 41)
    receiver.init(0)
    sender = xs.XferKVSender(p.mgr, bootstrap, 41)
    sender.init(3)
    receiver.send_metadata(np.array([10, 11, 12], dtype=np.int32))
    until("the page indices", lambda: sender.poll() == KVPoll.WaitingForInput)
    event = LateForward(p, [3, 4], 0xAB)
    sender._early_send_wait_event = event  # as maybe_send_cached_prefix_chunk sets it
    sender.send(np.array([3, 4], dtype=np.int32))  # the early send of the cached prefix
    assert event.waited and sender._early_send_wait_event is None, "one chunk's event"
    sender.send(np.array([5], dtype=np.int32))
    until("the receiver", lambda: receiver.poll() == KVPoll.Success)
    for buffer in d.kv:
        assert (buffer[10 * PAGE_BYTES:12 * PAGE_BYTES] == 0xAB).all(), "the forward's bytes"
    p.close(), d.close()


class HeldWrites:
    """The prefill's engine, its paged writes still on the NIC until released: a transfer's
    ``cancel`` returns only once no NIC touches the memory (xfer's contract), so it waits for
    the release; the first write's completion reports a failure."""

    def __init__(self, engine):
        import threading

        self.engine, self.first, self.count = engine, True, 0
        self.released = threading.Event()

    def __getattr__(self, name):
        return getattr(self.engine, name)

    def submit_paged_writes(self, *args, on_done, **kwargs):
        failed, self.first = self.first, False
        self.count += 1
        transfer = self.engine.submit_paged_writes(
            *args, on_done=lambda e: on_done(RuntimeError("poisoned") if failed else e), **kwargs)
        held = self

        class Held:
            def cancel(self):
                held.released.wait(WAIT)
                return transfer.cancel()

            def wait(self, timeout=None):
                return transfer.wait(timeout)

        return Held()


def test_an_abort_is_answered_only_after_the_writes_of_a_failed_sender_drained(bootstrap):
    """Issue 54: after one write failed, SGLang's ``failure_exception`` dropped the sender and
    a decode rank's abort was answered at once, with the other writes still in flight; the
    decode reuses the pages once answered."""
    p = Side(DisaggregationMode.PREFILL, bootstrap, 32)
    d = Side(DisaggregationMode.DECODE, bootstrap, 33)
    held = p.mgr.engine = HeldWrites(p.mgr.engine)
    receiver = xs.XferKVReceiver(d.mgr, bootstrap, 42)
    receiver.init(0)
    sender = xs.XferKVSender(p.mgr, bootstrap, 42)
    sender.init(2)
    receiver.send_metadata(np.array([6, 7], dtype=np.int32))
    until("the page indices", lambda: sender.poll() == KVPoll.WaitingForInput)
    with p.mgr.lock:
        sender.pending += 1  # one write's completion still to come (the NIC is on it)
    sender.send(np.array([1, 2], dtype=np.int32))
    assert held.count == BUFFERS
    until("the failed write", lambda: sender.poll() == KVPoll.Failed)
    with pytest.raises(RuntimeError):
        sender.failure_exception()  # SGLang's last call on a failed sender
    receiver.abort()
    required = len(receiver.bootstrap_infos)
    time.sleep(0.5)  # the abort reached the prefill, whose drain waits for the NIC
    assert not d.mgr.is_abort_release_safe(42, required), "answered with writes in flight"
    held.released.set()
    until("the answer once drained", lambda: d.mgr.is_abort_release_safe(42, required))
    sender._one_done(None)  # the last completion
    assert 42 not in p.mgr.senders, "forgotten once drained"
    p.close(), d.close()


# ---- the operator's rendezvous settings (issue 56 M5) ----


def private(path, text):
    path.write_text(text)
    path.chmod(0o600)
    return path


def test_the_bootstrap_and_its_clients_take_the_secret_the_engine_config_names(tmp_path, monkeypatch, rendezvous_dials):
    """Issue 56 M5: the cluster secret named only in the engine config given to ``register``
    (no ``$XFER_SECRET_FILE``): the prefill's bootstrap server admits only holders of it,
    every bootstrap client of both managers is made with it (and the config's etcd
    settings), and a request's pages move."""
    for name in ("XFER_SECRET_FILE", "XFER_CONFIG", "XFER_ETCD_CA_FILE"):
        monkeypatch.delenv(name, raising=False)
    secret = private(tmp_path / "secret", "s" * 32)
    settings = {"etcd_ca_file": str(tmp_path / "ca.pem")}
    monkeypatch.setattr(xs, "_config", {**MOCK, "security": {"secret_file": str(secret)}, "rendezvous": settings})
    dialled = rendezvous_dials
    server = xs.XferKVBootstrapServer("127.0.0.1", 0)
    addr = server.url.removeprefix("xfer://")
    try:
        p = Side(DisaggregationMode.PREFILL, addr, 11)
        d = Side(DisaggregationMode.DECODE, addr, 12)
        receiver = xs.XferKVReceiver(d.mgr, addr, 78)
        receiver.init(0)
        sender = xs.XferKVSender(p.mgr, addr, 78)
        sender.init(2, aux_index=0)
        receiver.send_metadata(np.array([4, 6], dtype=np.int32), aux_index=1)
        until("the page indices", lambda: sender.poll() == KVPoll.WaitingForInput)
        sender.send(np.array([1, 2], dtype=np.int32))
        until("the sender", lambda: sender.poll() == KVPoll.Success)
        until("the receiver", lambda: receiver.poll() == KVPoll.Success)
        for ours, theirs in zip(d.kv, p.kv):
            assert np.array_equal(ours[4 * PAGE_BYTES:5 * PAGE_BYTES], theirs[PAGE_BYTES:2 * PAGE_BYTES])
        assert dialled and {url for url, _ in dialled} == {server.url}
        for _, options in dialled:
            assert options.get("secret_file") == str(secret) and options.get("etcd_ca_file") == settings["etcd_ca_file"]
        with pytest.raises(xfer.RendezvousError, match="authentication failed"):
            dialled.real(server.url, connect_timeout=2)
        p.close(), d.close()
    finally:
        server.close()


def test_a_password_without_tls_is_refused_by_name_when_the_manager_starts(bootstrap, tmp_path, monkeypatch):
    """Issue 56 M5: etcd's user and password without TLS are refused when SGLang makes the
    manager, naming the settings."""
    monkeypatch.delenv("XFER_ETCD_CA_FILE", raising=False)
    monkeypatch.setenv("XFER_ETCD_USER", "xfer")
    monkeypatch.setenv("XFER_ETCD_PASSWORD_FILE", str(private(tmp_path / "password", "pw\n")))
    with pytest.raises(xfer.ConfigError,
                       match=r"XferKVManager: .*etcd_password_file \(\$XFER_ETCD_PASSWORD_FILE\).*cleartext"):
        Side(DisaggregationMode.DECODE, bootstrap, 13)
