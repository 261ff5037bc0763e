"""The SGLang backend across two processes (issue 28): a prefill process (bootstrap server,
XferKVManager, sender) and a decode process (manager, receiver), over libfabric's shm and tcp
providers on loopback, with SGLang's own KVArgs, ServerArgs and KVPoll; every page and the aux
data compared."""

import multiprocessing as mp
import os
import time

import numpy as np
import pytest

pytest.importorskip("sglang")

import xfer  # noqa: E402

PROVIDERS = ["shm", "tcp;ofi_rxm"]
PAGES, PAGE_BYTES, AUX_BYTES, BUFFERS = 64, 1024, 128, 6
SRC, DST = [5, 60, 7, 33, 2, 48, 9, 10], [1, 2, 40, 41, 63, 0, 17, 30]


def config(provider):
    return {
        "backend": "efa",
        "groups": [{"nics": ["auto"]}],
        "backends": {"efa": {"provider": provider}},
        "timeouts": {"transfer_ms": 20000, "connect_ms": 20000},
        "worker": {"idle_poll_us": 0},
    }


def buffers(seed):
    rng = np.random.default_rng(seed)
    kv = [rng.integers(0, 255, PAGES * PAGE_BYTES, dtype=np.uint8) for _ in range(BUFFERS)]
    aux = [rng.integers(0, 255, 4 * AUX_BYTES, dtype=np.uint8)]
    return kv, aux


def manager(mode, port, provider, kv, aux):
    import xfer.sglang as xs
    from sglang.srt.disaggregation.base.conn import KVArgs
    from sglang.srt.server_args import ServerArgs

    xs.register(config=config(provider))
    args = KVArgs()
    args.engine_rank = 0
    args.kv_data_ptrs = [a.ctypes.data for a in kv]
    args.kv_data_lens = [a.nbytes for a in kv]
    args.kv_item_lens = [PAGE_BYTES] * BUFFERS
    args.aux_data_ptrs = [a.ctypes.data for a in aux]
    args.aux_data_lens = [a.nbytes for a in aux]
    args.aux_item_lens = [AUX_BYTES]
    args.page_size = 16
    server_args = ServerArgs(model_path="dummy", device="cpu", disaggregation_mode=mode.value,
                             disaggregation_bootstrap_port=port)
    return xs.XferKVManager(args, mode, server_args)


def until(what, cond, seconds=60):
    deadline = time.monotonic() + seconds
    while not cond():
        if time.monotonic() > deadline:
            raise TimeoutError(what)
        time.sleep(0.002)


def prefill_process(provider, conn):
    os.environ["FI_TCP_IFACE"] = "lo"
    import xfer.sglang as xs
    from sglang.srt.disaggregation.base.conn import KVPoll
    from sglang.srt.disaggregation.utils import DisaggregationMode

    server = xs.XferKVBootstrapServer("127.0.0.1", 0)
    addr = server.url.removeprefix("xfer://")
    kv, aux = buffers(1)
    mgr = manager(DisaggregationMode.PREFILL, int(addr.split(":")[1]), provider, kv, aux)
    conn.send(addr)
    sender = xs.XferKVSender(mgr, addr, 42)
    sender.init(len(SRC), aux_index=3)
    until("the decode's page indices", lambda: sender.poll() == KVPoll.WaitingForInput)
    sender.send(np.array(SRC[:5], dtype=np.int32))
    sender.send(np.array(SRC[5:], dtype=np.int32))
    until("the transfer", lambda: sender.poll() in (KVPoll.Success, KVPoll.Failed))
    conn.send(sender.poll() == KVPoll.Success)
    conn.recv()  # the decode checked its bytes
    mgr.close()
    server.close()


def decode_process(provider, addr, conn):
    os.environ["FI_TCP_IFACE"] = "lo"
    import xfer.sglang as xs
    from sglang.srt.disaggregation.base.conn import KVPoll
    from sglang.srt.disaggregation.utils import DisaggregationMode

    kv = [np.zeros(PAGES * PAGE_BYTES, dtype=np.uint8) for _ in range(BUFFERS)]
    aux = [np.zeros(4 * AUX_BYTES, dtype=np.uint8)]
    mgr = manager(DisaggregationMode.DECODE, int(addr.split(":")[1]), provider, kv, aux)
    receiver = xs.XferKVReceiver(mgr, addr, 42)
    receiver.init(0)
    receiver.send_metadata(np.array(DST, dtype=np.int32), aux_index=1)
    until("the data", lambda: receiver.poll() in (KVPoll.Success, KVPoll.Failed))
    if receiver.poll() != KVPoll.Success:
        conn.send(f"receiver: {receiver.failure}")
        return
    want_kv, want_aux = buffers(1)
    for ours, theirs in zip(kv, want_kv):
        for s, d in zip(SRC, DST):
            if not np.array_equal(ours[d * PAGE_BYTES:(d + 1) * PAGE_BYTES],
                                  theirs[s * PAGE_BYTES:(s + 1) * PAGE_BYTES]):
                conn.send(f"page {s} -> {d} differs")
                return
    if not np.array_equal(aux[0][AUX_BYTES:2 * AUX_BYTES], want_aux[0][3 * AUX_BYTES:4 * AUX_BYTES]):
        conn.send("aux differs")
        return
    conn.send("ok")
    mgr.close()


@pytest.mark.parametrize("provider", PROVIDERS)
def test_prefill_and_decode_processes(provider):
    plugin = os.path.join(os.path.dirname(xfer.__file__), "plugins", "libbackend_efa.so")
    if not os.path.exists(plugin):
        pytest.skip("the efa plugin is not in the package (cargo xtask sglang stages it)")
    ctx = mp.get_context("spawn")
    p_here, p_there = ctx.Pipe()
    d_here, d_there = ctx.Pipe()
    prefill = ctx.Process(target=prefill_process, args=(provider, p_there))
    prefill.start()
    decode = None
    try:
        assert p_here.poll(120), "the prefill process did not start"
        addr = p_here.recv()
        decode = ctx.Process(target=decode_process, args=(provider, addr, d_there))
        decode.start()
        assert d_here.poll(120), "the decode process did not answer"
        assert d_here.recv() == "ok"
        assert p_here.poll(60) and p_here.recv() is True, "the sender did not succeed"
        p_here.send("done")
        decode.join(60)
        prefill.join(60)
        assert (decode.exitcode, prefill.exitcode) == (0, 0)
    finally:
        for p in (prefill, decode):
            if p is not None and p.is_alive():
                p.kill()
