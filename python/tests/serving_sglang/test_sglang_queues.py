"""SGLang's own disaggregation queues driving xfer (issue 41): a prefill and a decode scheduler
side, each a spawned process that gets xfer only through SGLang's ``load_plugins()`` and
``--disaggregation-transfer-backend xfer`` (the package's entry point; ``$XFER_CONFIG`` names
libfabric's shm provider), with SGLang's ``PrefillBootstrapQueue`` and the prefill mixin's
chunk sending and inflight queue on one side, ``DecodePreallocQueue`` and
``DecodeTransferQueue`` through the decode mixin's ``process_decode_queue`` on the other, on
SGLang's own pools, ``MetadataBuffers`` and ``Req`` objects (``sglang_scheduler_side.py`` says
what stands in for the model and the ``Scheduler`` object, and why).

Every K and V byte of every layer the decode holds for a request is compared with the
prefill's; the aux data is SGLang's metadata row (the first token, the bootstrap room SGLang
checks before it commits)."""

import multiprocessing as mp
import os
import signal

import numpy as np
import pytest

pytest.importorskip("sglang")

import xfer  # noqa: E402

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.abspath(os.path.join(HERE, "..", "..", ".."))
CONFIG = os.path.join(ROOT, "configs", "efa-shm.toml")
PROMPT = list(range(100, 122))  # 22 tokens: 6 pages of 4, the last partial
WAIT = 120


def prefill_process(conn):
    import sglang_scheduler_side as side
    from sglang.srt.disaggregation import utils
    from sglang.srt.plugins import load_plugins

    load_plugins()
    # The bootstrap server SGLang's tokenizer manager starts on the prefill instance (looked
    # up after the plugins loaded, as SGLang's own modules look it up when they call it).
    server = utils.get_kv_class(utils.TransferBackend("xfer"),
                                utils.KVClassType.BOOTSTRAP_SERVER)("127.0.0.1", 0)
    port = int(server.url.rsplit(":", 1)[1])
    s = side.prefill_side(port)
    conn.send(("ready", port))
    reqs = {}
    while True:
        cmd, *args = conn.recv()
        if cmd == "add":
            rid, room = args
            req = side.make_req(rid, PROMPT, "127.0.0.1", port, room)
            reqs[rid] = req
            s.disagg_prefill_bootstrap_queue.add(req, side.HEADS)
            conn.send("added")
        elif cmd == "bootstrap":
            # The scheduler loop until the request left the bootstrap queue and its decode
            # destination is known (optimistic prefill pops it earlier; the waiting queue's
            # check finalises it).
            (rid,) = args
            req = reqs[rid]

            def step():
                s.waiting_queue.extend(s.disagg_prefill_bootstrap_queue.pop_bootstrapped())
                s.resolve_waiting_queue_bootstrap()

            side.until("the decode's destination", lambda: req in s.waiting_queue
                       and not req.pending_bootstrap, step=step)
            s.waiting_queue.remove(req)
            conn.send("bootstrapped")
        elif cmd == "chunk":
            # One prefill chunk, then what the mixin does after it: a middle chunk is sent by
            # process_prefill_chunk, the last one by process_batch_result_disagg_prefill.
            rid, upto, token, seed = args
            req = reqs[rid]
            side.forward(s, req, upto, token, seed)
            if upto < len(PROMPT):
                s.send_kv_chunk(req)
            else:
                s.checkpoint_disagg_prefill(req)
                s.disagg_prefill_inflight_queue.append(req)
                s.send_kv_chunk(req, last_chunk=True)
            conn.send("sent")
        elif cmd == "finish":
            (rid,) = args
            req = reqs[rid]
            pages = side.request_pages(s, req, len(PROMPT))
            done = []
            side.until("the transfer's end", lambda: req in done,
                       step=lambda: done.extend(s.process_disagg_prefill_inflight_queue()))
            conn.send((type(req.finished_reason).__name__, [p.numpy() for p in pages]))
        elif cmd == "stop":
            s.disagg_prefill_bootstrap_queue.kv_manager.close()
            server.close()
            conn.send("stopped")
            return


def decode_process(conn):
    import sglang_scheduler_side as side

    conn.send("up")
    port = conn.recv()
    s = side.decode_side(port)
    conn.send("ready")
    reqs = {}
    while True:
        cmd, *args = conn.recv()
        if cmd == "add":
            rid, room = args
            req = side.make_req(rid, PROMPT, "127.0.0.1", port, room)
            reqs[rid] = req
            s.disagg_decode_prealloc_queue.add(req)
            conn.send("added")
        elif cmd == "allocated":
            # The scheduler loop until the request's pages are allocated and sent.
            (rid,) = args
            req = reqs[rid]
            side.until("the preallocation", lambda: any(
                d.req is req for d in s.disagg_decode_transfer_queue.queue),
                step=s.process_decode_queue)
            conn.send("allocated")
        elif cmd == "receive":
            (rid,) = args
            req = reqs[rid]
            side.until("the KV", lambda: req in s.waiting_queue or req.finished_reason,
                       step=s.process_decode_queue)
            if req.finished_reason is not None:
                conn.send(("failed", str(req.finished_reason)))
                continue
            pages = side.request_pages(s, req, len(PROMPT))
            conn.send(("ok", list(req.output_ids), [p.numpy() for p in pages]))
        elif cmd == "stop":
            s.disagg_decode_prealloc_queue.kv_manager.close()
            conn.send("stopped")
            return


class Pair:
    """The two processes, started fresh (spawn, as SGLang starts its schedulers)."""

    def __init__(self, monkeypatch):
        plugin = os.path.join(os.path.dirname(xfer.__file__), "plugins", "libbackend_efa.so")
        if not os.path.exists(plugin):
            pytest.skip("the efa plugin is not in the package (cargo xtask sglang stages it)")
        monkeypatch.setenv("XFER_CONFIG", CONFIG)
        monkeypatch.syspath_prepend(HERE)
        ctx = mp.get_context("spawn")
        self.p, p_there = ctx.Pipe()
        self.d, d_there = ctx.Pipe()
        self.prefill = ctx.Process(target=prefill_process, args=(p_there,), name="prefill")
        self.decode = ctx.Process(target=decode_process, args=(d_there,), name="decode")
        self.prefill.start()
        self.decode.start()
        assert self.answer(self.d) == "up", "the decode process did not start"
        ready, self.port = self.answer(self.p)
        self.d.send(self.port)
        assert self.answer(self.d) == "ready"

    def answer(self, conn):
        """The process's next answer; a process that died fails the test at once."""
        proc = self.prefill if conn is self.p else self.decode
        for _ in range(WAIT * 10):
            if conn.poll(0.1):
                return conn.recv()
            assert proc.is_alive(), f"the {proc.name} process died ({proc.exitcode})"
        raise TimeoutError(f"no answer from {proc.name} within {WAIT} s")

    def ask(self, conn, *msg):
        conn.send(msg)
        return self.answer(conn)

    def close(self):
        for conn, proc in ((self.p, self.prefill), (self.d, self.decode)):
            if proc.is_alive():
                try:
                    conn.send(("stop",))
                    conn.poll(30) and conn.recv()
                except (BrokenPipeError, EOFError, OSError):
                    pass
                proc.join(30)
            if proc.is_alive():
                proc.kill()


@pytest.fixture
def pair(monkeypatch):
    p = Pair(monkeypatch)
    yield p
    p.close()


def test_a_request_through_sglangs_queues_lands_byte_equal_with_its_first_token(pair):
    room = 7001
    assert pair.ask(pair.p, "add", "r1", room) == "added"
    assert pair.ask(pair.d, "add", "r1", room) == "added"
    assert pair.ask(pair.d, "allocated", "r1") == "allocated"
    assert pair.ask(pair.p, "bootstrap", "r1") == "bootstrapped"
    # Two chunks: 12 tokens (3 whole pages go), then the rest with the first token.
    assert pair.ask(pair.p, "chunk", "r1", 12, 0, 1) == "sent"
    assert pair.ask(pair.p, "chunk", "r1", len(PROMPT), 4242, 1) == "sent"
    reason, sent = pair.ask(pair.p, "finish", "r1")
    assert reason == "FINISH_LENGTH", reason
    got = pair.ask(pair.d, "receive", "r1")
    assert got[0] == "ok", got
    _, output_ids, received = got
    assert output_ids == [4242], "the first token comes in SGLang's metadata row"
    assert len(received) == len(sent) == 4
    for i, (ours, theirs) in enumerate(zip(received, sent)):
        assert np.array_equal(ours, theirs), f"buffer {i} differs"
