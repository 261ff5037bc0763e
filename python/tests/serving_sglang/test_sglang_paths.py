"""SGLang 0.5.23 paths that reach a transfer backend beyond sending pages (issue 54): memory
released and resumed around a weight update (``release/resume_memory_occupation``), a
retracted decode request's rebootstrap (``submit_prefill_recompute``), and the set-ups xfer
refuses by name (pipeline parallelism, DP routing other than by bootstrap room, replicated KV
heads between TP sizes) or SGLang refuses for it (the ``prefill_complete`` allocation policy).

SGLang's own functions are called where they reach the backend — the queues'
``release_memory_occupation`` / ``resume_memory_occupation``, ``Req.build_rebootstrap_payload``,
its CLI parser and argument checks — on stand-in queue objects holding only what those
functions read (named in each test); the managers, senders and receivers are xfer's, over the
mock backend."""

import http.server
import json
import threading
from types import SimpleNamespace

import numpy as np
import pytest

pytest.importorskip("sglang")

from sglang.srt.disaggregation.base.conn import KVPoll  # noqa: E402
from sglang.srt.disaggregation.decode import DecodePreallocQueue  # noqa: E402
from sglang.srt.disaggregation.prefill import PrefillBootstrapQueue  # noqa: E402
from sglang.srt.disaggregation.utils import DisaggregationMode  # noqa: E402
from test_sglang_backend import PAGE_BYTES, Side, bootstrap, registered, until  # noqa: E402,F401
from test_sglang_tp import Rank  # noqa: E402

import xfer  # noqa: E402
import xfer.sglang as xs  # noqa: E402

PREFILL, DECODE = DisaggregationMode.PREFILL, DisaggregationMode.DECODE


def transfer(p, d, addr, room, src, dst):
    """One room through both sides, as SGLang's loops drive them; the receiver's state."""
    rx = xs.XferKVReceiver(d.mgr, addr, room)
    rx.init(0)
    tx = xs.XferKVSender(p.mgr, addr, room)
    tx.init(len(src), aux_index=1)
    rx.send_metadata(np.array(dst, dtype=np.int32), aux_index=2)
    until("the indices", lambda: tx.poll() != KVPoll.Bootstrapping)
    tx.send(np.array(src, dtype=np.int32))
    until("the receiver", lambda: rx.poll() in (KVPoll.Success, KVPoll.Failed))
    until("the sender", lambda: tx.poll() in (KVPoll.Success, KVPoll.Failed))
    state = rx.poll()
    rx.clear(), tx.clear()
    return state


def same_pages(d, p, src, dst):
    return all(np.array_equal(ours[t * PAGE_BYTES:(t + 1) * PAGE_BYTES],
                              theirs[s * PAGE_BYTES:(s + 1) * PAGE_BYTES])
               for ours, theirs in zip(d.kv, p.kv) for s, t in zip(src, dst))


def records(addr):
    return {r["name"] for r in xfer.Rendezvous(f"xfer://{addr}").list()}


def test_released_memory_is_deregistered_and_registered_again_on_resume(bootstrap):
    """SGLang's queues' ``release_memory_occupation`` (an idle server before a weight update
    frees its KV memory) reach the manager: after it, nothing is registered — a write into
    the decode's buffers through the record published before fails, and the record is
    withdrawn — and ``resume_memory_occupation`` registers the same memory again: the next
    room lands byte-equal through a record under a new name.

    Stand-ins: the queues are namespaces with the members those two functions read
    (``queue``, ``retracted_queue``, ``kv_manager``, the DP-rank query cancel); the memory
    stays mapped (on a GPU SGLang's memory saver unmaps it)."""
    p = Side(PREFILL, bootstrap, 21)
    d = Side(DECODE, bootstrap, 22)
    try:
        assert transfer(p, d, bootstrap, 1, [1, 2], [3, 4]) == KVPoll.Success
        old = next(n for n in records(bootstrap) if n.startswith("sglang.decode."))
        stale = xfer.Rendezvous(f"xfer://{bootstrap}").lookup(old, 5.0)

        decode_queue = SimpleNamespace(queue=[], retracted_queue=[], kv_manager=d.mgr,
                                       _cancel_prefill_dp_rank_queries=lambda: None)
        prefill_queue = SimpleNamespace(queue=[], kv_manager=p.mgr)
        DecodePreallocQueue.release_memory_occupation(decode_queue)
        DecodePreallocQueue.release_memory_occupation(decode_queue)  # both decode queues call
        PrefillBootstrapQueue.release_memory_occupation(prefill_queue)

        assert old not in records(bootstrap), "the record of released memory stays published"
        probe = xfer.TransferEngine(xs._config)
        try:
            src = np.ones(PAGE_BYTES, np.uint8)
            with probe.reg_mr_raw(src.ctypes.data, src.nbytes, access="local") as region:
                with pytest.raises(Exception):
                    probe.submit_single_write(region, stale["regions"]["kv0"], PAGE_BYTES).wait(5.0)
        finally:
            probe.close()

        DecodePreallocQueue.resume_memory_occupation(decode_queue)
        PrefillBootstrapQueue.resume_memory_occupation(prefill_queue)
        assert transfer(p, d, bootstrap, 2, [5, 6, 7], [8, 9, 10]) == KVPoll.Success
        assert same_pages(d, p, [5, 6, 7], [8, 9, 10])
        now = {n for n in records(bootstrap) if n.startswith("sglang.decode.")}
        assert now and old not in now
    finally:
        p.close(), d.close()


class StandInPrefillHttp:
    """The prefill instance's HTTP server as far as a rebootstrap reaches it: it records each
    ``/generate`` body and answers 200 (``status`` to answer otherwise)."""

    def __init__(self, status=200):
        self.bodies, self.status = [], status
        outer = self

        class Handler(http.server.BaseHTTPRequestHandler):
            def do_POST(self):
                body = self.rfile.read(int(self.headers["Content-Length"]))
                outer.bodies.append((self.path, json.loads(body)))
                self.send_response(outer.status)
                self.end_headers()

            def log_message(self, *args):
                pass

        self.server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.port = self.server.server_address[1]
        threading.Thread(target=self.server.serve_forever, daemon=True).start()

    def close(self):
        self.server.shutdown()


def rebootstrap_req(addr, room):
    """A retracted decode request as SGLang's scheduler leaves it (``retract_all`` then the
    DECODE branch: the boundary token popped, ``pd_rebootstrap_in_progress``)."""
    from array import array

    from sglang.srt.managers.schedule_batch import Req
    from sglang.srt.sampling.sampling_params import SamplingParams

    params = SamplingParams(max_new_tokens=8)
    params.normalize(None)
    host, port = addr.split(":")
    req = Req("r-retracted", "", array("q", [11, 12, 13]), params, bootstrap_host=host,
              bootstrap_port=int(port), bootstrap_room=room)
    req.output_ids = [21, 22]
    req.pd_rebootstrap_forced_output_id = req.output_ids.pop()
    req.pd_rebootstrap_in_progress = True
    return req


@pytest.mark.parametrize("status", [200, 500])
def test_a_retracted_request_rebootstraps_through_the_prefills_generate(bootstrap, status):
    """``DecodePreallocQueue`` calls ``kv_manager.submit_prefill_recompute(receiver,
    req.build_rebootstrap_payload())`` after the receiver sent its new indices (the default
    ``early`` allocation policy): the prefill's ``/generate`` gets SGLang's payload (same room)
    at the HTTP port it published; the recomputed KV then lands in the new pages. A failed call
    fails the room, naming it, and tells the prefill ranks.

    Stand-ins: the prefill's HTTP server (it records the call; the test then runs the room's
    sender as the prefill's scheduler would for that request)."""
    server = StandInPrefillHttp(status)
    p = Side(PREFILL, bootstrap, 23, port=server.port)  # the prefill's --port
    d = Side(DECODE, bootstrap, 24)
    try:
        # "Not yet" until the first contact, off the scheduler thread, found the prefill.
        until("the prefill's topology", lambda: d.mgr.try_ensure_parallel_info(bootstrap))
        assert d.mgr.prefill_info_table[bootstrap].prefill_http_port == server.port
        req = rebootstrap_req(bootstrap, 61)
        rx = xs.XferKVReceiver(d.mgr, bootstrap, 61)
        rx.init(0)
        rx.send_metadata(np.array([12, 13], dtype=np.int32), aux_index=3)
        # What DecodePreallocQueue._submit_prefill_recompute does next.
        d.mgr.submit_prefill_recompute(rx, req.build_rebootstrap_payload())
        until("the prefill's /generate", lambda: server.bodies)
        path, body = server.bodies[0]
        assert path == "/generate" and body["bootstrap_room"] == 61
        assert body["input_ids"] == [11, 12, 13, 21] and body["sampling_params"]["max_new_tokens"] == 1
        if status != 200:
            until("the failure", lambda: rx.poll() == KVPoll.Failed)
            with pytest.raises(RuntimeError, match="rebootstrap /generate"):
                rx.failure_exception()
            assert rx.abort_notified, "the prefill ranks were not told"
            return
        tx = xs.XferKVSender(p.mgr, bootstrap, 61)
        tx.init(2, aux_index=0)
        until("the indices", lambda: tx.poll() == KVPoll.WaitingForInput)
        tx.send(np.array([4, 6], dtype=np.int32))
        until("the receiver", lambda: rx.poll() == KVPoll.Success)
        assert same_pages(d, p, [4, 6], [12, 13])
    finally:
        server.close(), p.close(), d.close()


def parsed(mode, port, *extra):
    import sglang_scheduler_side as side

    return side.server_args(mode, port, extra)


@pytest.fixture
def scheduler_side(monkeypatch):
    import os

    monkeypatch.syspath_prepend(os.path.dirname(os.path.abspath(__file__)))


@pytest.mark.parametrize("mode", [PREFILL, DECODE])
def test_pipeline_parallelism_is_refused_by_name(bootstrap, scheduler_side, mode):
    args = parsed(mode.value, int(bootstrap.split(":")[1]), "--pp-size", "2")
    holder = SimpleNamespace()
    with pytest.raises(NotImplementedError, match=r"pipeline parallelism \(--pp-size 2\)"):
        xs.XferKVManager(_kv_args(holder), mode, args)


def _kv_args(holder):
    from sglang.srt.disaggregation.base.conn import KVArgs

    holder.kv = [np.zeros(4 * PAGE_BYTES, np.uint8)]
    args = KVArgs()
    args.engine_rank = 0
    args.kv_data_ptrs = [holder.kv[0].ctypes.data]
    args.kv_data_lens = [holder.kv[0].nbytes]
    args.kv_item_lens = [PAGE_BYTES]
    args.aux_data_ptrs, args.aux_data_lens, args.aux_item_lens = [], [], []
    args.page_size = 16
    args.kv_head_num = 1
    return args


def test_dp_routing_other_than_by_bootstrap_room_is_refused_by_name(bootstrap, scheduler_side,
                                                                       monkeypatch):
    port = int(bootstrap.split(":")[1])
    holder = SimpleNamespace()
    args = parsed("prefill", port, "--tp-size", "2", "--dp-size", "2", "--enable-dp-attention",
                  "--load-balance-method", "round_robin")
    with pytest.raises(NotImplementedError, match="--load-balance-method round_robin"):
        xs.XferKVManager(_kv_args(holder), PREFILL, args)
    monkeypatch.setenv("SGLANG_DISAGGREGATION_FORCE_QUERY_PREFILL_DP_RANK", "1")
    with pytest.raises(NotImplementedError, match="FORCE_QUERY_PREFILL_DP_RANK"):
        xs.XferKVManager(_kv_args(holder), DECODE, parsed("decode", port))


def test_sglang_refuses_the_prefill_complete_policy_for_xfer(bootstrap, scheduler_side):
    """SGLang's own argument check (the one its resolution pipeline runs at launch, called
    here without the rest of the pipeline, which loads the model's config):
    ``prefill_complete`` (``mark_prefill_complete``) runs on Mooncake only, so
    ``--disaggregation-transfer-backend xfer`` never reaches it."""
    from sglang.srt.arg_groups.pd_disaggregation_hook import _validate_prefill_complete

    args = parsed("decode", int(bootstrap.split(":")[1]),
                  "--disaggregation-decode-allocation-policy", "prefill_complete")
    with pytest.raises(ValueError, match="Mooncake"):
        _validate_prefill_complete(args)


@pytest.mark.parametrize("decode_heads_known", [True, False])
def test_replicated_kv_heads_between_tp_sizes_are_refused_by_name(bootstrap, decode_heads_known):
    """A model with 4 KV heads on prefill TP 8 (``total_kv_head_num`` 4: each head on two
    ranks) and decode TP 4: the decode rank names the replication instead of sending its
    pages to ranks whose heads it would misplace."""
    prefills = [Rank(PREFILL, bootstrap, 8, r, heads=1, model=None) for r in range(8)]
    d = Rank(DECODE, bootstrap, 4, 0, heads=1)
    if not decode_heads_known:  # SGLang's decode queue sets no head count
        d.mgr.heads_known = False
    try:
        rx = xs.XferKVReceiver(d.mgr, bootstrap, 7)
        rx.init(0)
        assert rx.poll() == KVPoll.Failed
        with pytest.raises(RuntimeError, match="replicated KV heads"):
            rx.failure_exception()
    finally:
        for r in prefills + [d]:
            r.close()
