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
import time

import numpy as np
import pytest

pytest.importorskip("sglang")

import xfer  # noqa: E402

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.abspath(os.path.join(HERE, "..", "..", ".."))
CONFIG = os.path.join(ROOT, "configs", "efa-shm.toml")
PROMPT = list(range(100, 122))  # 22 tokens: 6 pages of 4, the last partial
WAIT = 120
CACHED = 3


def prefill_process(conn, rank=0, world=1, dist_port=None, extra=()):
    """One prefill scheduler (``rank`` of ``world`` in its TP group: under DP attention, one
    DP group each); the first starts the instance's bootstrap server."""
    import sglang_scheduler_side as side
    from sglang.srt.disaggregation import utils
    from sglang.srt.plugins import load_plugins

    load_plugins()
    server = None
    if rank == 0:
        # The bootstrap server SGLang's tokenizer manager starts on the prefill instance
        # (looked up after the plugins loaded, as SGLang's own modules look it up).
        server = utils.get_kv_class(utils.TransferBackend("xfer"),
                                    utils.KVClassType.BOOTSTRAP_SERVER)("127.0.0.1", 0)
        port = int(server.url.rsplit(":", 1)[1])
        conn.send(("port", port))
    else:
        port = conn.recv()
    s = side.prefill_side(port, rank, world, dist_port, extra)
    conn.send(("ready", port))
    reqs = {}
    while True:
        cmd, *args = conn.recv()
        if cmd == "add":
            rid, room = args
            req = side.make_req(rid, PROMPT, "127.0.0.1", port, room)
            req.cached_tokens = CACHED  # a prefix hit it reports to the decode in its aux row
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
        elif cmd == "dropped":
            conn.send(getattr(s.disagg_prefill_bootstrap_queue.kv_manager, "dropped", 0))
        elif cmd in ("release", "resume"):
            # What SchedulerWeightUpdater.release/resume_memory_occupation do with the KV tag
            # on a prefill instance (the memory saver itself: a no-op on a CPU).
            getattr(s.disagg_prefill_bootstrap_queue, f"{cmd}_memory_occupation")()
            conn.send(cmd)
        elif cmd == "stop":
            s.disagg_prefill_bootstrap_queue.kv_manager.close()
            if server is not None:
                server.close()
            conn.send("stopped")
            return


def decode_process(conn):
    import sglang_scheduler_side as side

    conn.send("up")
    port = conn.recv()
    s = side.decode_side(port)
    conn.send("ready")
    reqs, held = {}, {}
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
            side.until("the preallocation", lambda: req.finished_reason is not None or any(
                d.req is req for d in s.disagg_decode_transfer_queue.queue),
                step=s.process_decode_queue)
            conn.send("allocated" if req.finished_reason is None else str(req.finished_reason))
        elif cmd == "receive":
            (rid,) = args
            req = reqs[rid]
            side.until("the KV", lambda: req in s.waiting_queue or req.finished_reason,
                       step=s.process_decode_queue)
            if req.finished_reason is not None:
                conn.send(("failed", req.finished_reason.message))
                continue
            pages = side.request_pages(s, req, len(PROMPT))
            conn.send(("ok", list(req.output_ids), req.cached_tokens,
                       [p.numpy() for p in pages]))
        elif cmd == "abort":
            # What Scheduler.abort_request does for a request in the transfer queue (its
            # receiver's abort: the prefill ranks are told), then scheduler-loop iterations.
            (rid,) = args
            req = reqs[rid]
            (entry,) = [d for d in s.disagg_decode_transfer_queue.queue if d.req is req]
            locs = s.req_to_token_pool.req_to_token[req.kv.req_pool_idx, :len(PROMPT)].clone()
            entry.kv_receiver.abort()
            side.until("the abort to reach the client", lambda: req in s.output_streamer.streamed,
                       step=s.process_decode_queue)
            for _ in range(200):  # the prefill is stopped: nothing may free the pages
                s.process_decode_queue()
            held[rid] = (locs, None)
            conn.send((s.disagg_decode_transfer_queue.num_pending_deferred_releases(),
                       req.kv.holds_kv, side.pages_free(s, locs)))
        elif cmd == "released":
            # The scheduler loop until the held pages are freed (the release timeout is longer
            # than this wait: only the prefill's answer frees them).
            (rid,) = args
            locs, _ = held[rid]
            side.until("the held pages' release", lambda: not s.disagg_decode_transfer_queue
                       .has_pending_deferred_releases(), step=s.process_decode_queue)
            # What they hold now (the chunk in flight at the abort may have landed before the
            # prefill answered): nothing may change after.
            held[rid] = (locs, side.pages_at(s, locs))
            conn.send(side.pages_free(s, locs))
        elif cmd == "unchanged":
            # The freed pages still hold what they held at the abort: nothing was written after.
            (rid,) = args
            locs, before = held[rid]
            after = side.pages_at(s, locs)
            conn.send(all(np.array_equal(a.numpy(), b.numpy()) for a, b in zip(after, before)))
        elif cmd == "dropped":
            conn.send(getattr(s.disagg_decode_prealloc_queue.kv_manager, "dropped", 0))
        elif cmd in ("release", "resume"):
            # SchedulerWeightUpdater's order on a decode instance: the transfer queue, then
            # the prealloc queue.
            for queue in (s.disagg_decode_transfer_queue, s.disagg_decode_prealloc_queue):
                getattr(queue, f"{cmd}_memory_occupation")()
            conn.send(cmd)
        elif cmd == "state":
            # The request's transfer state as the transfer queue polls it.
            (rid,) = args
            (entry,) = [d for d in s.disagg_decode_transfer_queue.queue if d.req is reqs[rid]]
            conn.send(int(entry.kv_receiver.poll()))
        elif cmd == "snapshot":
            # Every slot of the KV pool but the request's: nothing may write there.
            (rid,) = args
            import torch

            mine = set(s.req_to_token_pool.req_to_token[reqs[rid].kv.req_pool_idx,
                                                        :len(PROMPT)].tolist())
            others = torch.tensor([t for t in range(side.POOL_TOKENS) if t not in mine])
            held[rid] = (others, side.pages_at(s, others))
            conn.send(len(others))
        elif cmd == "stop":
            s.disagg_decode_prealloc_queue.kv_manager.close()
            conn.send("stopped")
            return


class Pair:
    """The processes, started fresh (spawn, as SGLang starts its schedulers): ``prefills``
    prefill schedulers (more than one: DP attention, one DP group each) and a decode."""

    def __init__(self, monkeypatch, prefills=1, extra=()):
        plugin = os.path.join(os.path.dirname(xfer.__file__), "plugins", "libbackend_efa.so")
        if not os.path.exists(plugin):
            pytest.skip("the efa plugin is not in the package (cargo xtask sglang stages it)")
        monkeypatch.setenv("XFER_CONFIG", CONFIG)
        # A held page is released by the prefill's answer, never by this timeout.
        monkeypatch.setenv("SGLANG_DISAGGREGATION_DEFERRED_DECODE_KV_RELEASE_TIMEOUT", "3600")
        monkeypatch.syspath_prepend(HERE)
        ctx = mp.get_context("spawn")
        import sglang_scheduler_side as side

        dist_port = side.free_port()
        self.procs, self.conns = [], []
        for rank in range(prefills):
            here, there = ctx.Pipe()
            self.conns.append(here)
            self.procs.append(ctx.Process(target=prefill_process, name=f"prefill{rank}",
                                          args=(there, rank, prefills, dist_port, extra)))
        here, there = ctx.Pipe()
        self.conns.append(here)
        self.procs.append(ctx.Process(target=decode_process, args=(there,), name="decode"))
        self.ps, self.d = self.conns[:-1], self.conns[-1]
        self.p, self.prefill, self.decode = self.ps[0], self.procs[0], self.procs[-1]
        for proc in self.procs:
            proc.start()
        assert self.answer(self.d) == "up", "the decode process did not start"
        _, self.port = self.answer(self.p)
        for conn in self.ps[1:]:
            conn.send(self.port)
        for conn in self.ps:
            assert self.answer(conn) == ("ready", self.port)
        self.d.send(self.port)
        assert self.answer(self.d) == "ready"

    def answer(self, conn):
        """The process's next answer; a process that died fails the test at once."""
        proc = self.procs[self.conns.index(conn)]
        for _ in range(WAIT * 10):
            if conn.poll(0.1):
                return conn.recv()
            assert proc.is_alive(), f"the {proc.name} process died ({proc.exitcode})"
        raise TimeoutError(f"no answer from {proc.name} within {WAIT} s")

    def ask(self, conn, *msg):
        conn.send(msg)
        return self.answer(conn)

    def close(self):
        for conn, proc in zip(self.conns, self.procs):
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
    transfer(pair, "r1", 7001)

def start(pair, rid, room, prefill=None):
    """Both sides take the request; the decode allocates and sends its pages; the prefill
    learns them."""
    prefill = prefill or pair.p
    assert pair.ask(prefill, "add", rid, room) == "added"
    assert pair.ask(pair.d, "add", rid, room) == "added"
    assert pair.ask(pair.d, "allocated", rid) == "allocated"
    assert pair.ask(prefill, "bootstrap", rid) == "bootstrapped"


def transfer(pair, rid, room, prefill=None, seed=1):
    """A request through both sides' queues in two chunks: every byte and the aux row."""
    prefill = prefill or pair.p
    start(pair, rid, room, prefill)
    assert pair.ask(prefill, "chunk", rid, 12, 0, seed) == "sent"
    assert pair.ask(prefill, "chunk", rid, len(PROMPT), 4242 + seed, seed) == "sent"
    reason, sent = pair.ask(prefill, "finish", rid)
    assert reason == "FINISH_LENGTH", reason
    got = pair.ask(pair.d, "receive", rid)
    assert got[0] == "ok", got
    _, output_ids, cached, received = got
    assert output_ids == [4242 + seed], "the first token comes in SGLang's metadata row"
    assert cached == CACHED, "and the prefill's cached-token count"
    assert len(received) == len(sent) == 4
    for i, (ours, theirs) in enumerate(zip(received, sent)):
        assert np.array_equal(ours, theirs), f"buffer {i} differs"


def test_an_abort_on_the_decode_holds_its_pages_until_the_prefill_answered(pair):
    """SGLang's deferred release (DecodeTransferQueue: the failed transfer's pages held until
    kv_mgr.is_abort_release_safe) with xfer's answer: while the prefill process is stopped, no
    scheduler-loop iteration frees the pages; once it runs, it cancels, answers, and the pages
    go back; the prefill's last chunk, sent after, writes nothing and ends its request."""
    start(pair, "r2", 7002)
    assert pair.ask(pair.p, "chunk", "r2", 12, 0, 2) == "sent"  # in flight: a chunk landed
    os.kill(pair.prefill.pid, signal.SIGSTOP)
    try:
        held, holds_kv, free = pair.ask(pair.d, "abort", "r2")
    finally:
        os.kill(pair.prefill.pid, signal.SIGCONT)
    assert (held, holds_kv, free) == (1, True, False), "freed before the prefill answered"
    assert pair.ask(pair.d, "released", "r2") is True
    assert pair.ask(pair.p, "chunk", "r2", len(PROMPT), 4242, 2) == "sent"
    reason, _ = pair.ask(pair.p, "finish", "r2")
    assert reason == "FINISH_ABORT", reason
    assert pair.ask(pair.d, "unchanged", "r2") is True, "written after the abort was answered"
    # The pair still serves the next request.
    transfer(pair, "r1", 7001)


def test_forged_control_messages_from_a_third_engine_change_nothing(pair):
    """Issue 56's probe on SGLang's own queues over libfabric shm, which proves no sender:
    a third engine that knows every address and the room (both are in the bootstrap and the
    request) but not the decode rank's key or the room's token sends a ``meta`` pointing at
    other pages, an abort, ``done``, ``fail`` and an abort answer. All are refused (counted);
    the request then lands byte-equal, nothing outside its pages changes."""
    from xfer.kv import sglang_control as sc

    start(pair, "r4", 7004)
    assert pair.ask(pair.d, "snapshot", "r4") > 0
    evil = xfer.TransferEngine(CONFIG)
    try:
        rdv = xfer.Rendezvous(f"xfer://127.0.0.1:{pair.port}")
        records = {r["name"]: r for r in rdv.list()}
        prefill = records["sglang.prefill.0.0"]
        (decode_name,) = [n for n in records if n.startswith("sglang.decode.")]
        decode = records[decode_name]
        import sglang_scheduler_side as side

        guess = sc.new_token()
        forged = sc.Meta(room=7004, token=guess, decode=decode_name, to=0, rank=0, tp=1,
                         heads=side.HEADS, item=side.PAGE * side.HEADS * side.HEAD_DIM * 2,
                         prefix=0, aux_index=0, aux=True, pages=np.arange(8, 14))
        evil.submit_send(bytes(prefill["addr"]), forged.encode(sc.new_key())).wait(10)
        evil.submit_send(bytes(prefill["addr"]),
                         sc.Abort(7004, guess, decode_name, 0).encode(sc.new_key())).wait(10)
        for kind in (sc.DONE, sc.FAIL, sc.ABORT_ACK):
            evil.submit_send(bytes(decode["addr"]),
                             sc.Answer(kind, 7004, guess, 0, "forged").encode()).wait(10)
        deadline = time.monotonic() + WAIT
        while pair.ask(pair.p, "dropped") < 2 or pair.ask(pair.d, "dropped") < 3:
            assert pair.ask(pair.d, "state", "r4") == 3, "the room ended on a forged message"
            assert time.monotonic() < deadline, "forged messages neither refused nor taken"
            time.sleep(0.01)
    finally:
        evil.close()
    assert pair.ask(pair.d, "state", "r4") == 3  # KVPoll.Transferring: still waiting for its KV
    assert pair.ask(pair.p, "chunk", "r4", 12, 0, 4) == "sent"
    assert pair.ask(pair.p, "chunk", "r4", len(PROMPT), 4246, 4) == "sent"
    reason, sent = pair.ask(pair.p, "finish", "r4")
    assert reason == "FINISH_LENGTH", reason
    got = pair.ask(pair.d, "receive", "r4")
    assert got[0] == "ok", got
    for i, (ours, theirs) in enumerate(zip(got[3], sent)):
        assert np.array_equal(ours, theirs), f"buffer {i} differs"
    assert pair.ask(pair.d, "unchanged", "r4") is True, "written outside the request's pages"


def test_kv_memory_released_and_resumed_between_requests(pair):
    """A weight update's ``release_memory_occupation`` / ``resume_memory_occupation`` through
    SGLang's own queues on both instances (idle, as SGLang asserts): the decode rank's record
    of the released memory is withdrawn from the bootstrap, and after the resume the next
    request lands byte-equal through registrations made again."""
    transfer(pair, "r1", 7001)
    rdv = xfer.Rendezvous(f"xfer://127.0.0.1:{pair.port}")
    before = {r["name"] for r in rdv.list() if r["name"].startswith("sglang.decode.")}
    assert before
    assert pair.ask(pair.d, "release") == "release"
    assert pair.ask(pair.p, "release") == "release"
    assert not {r["name"] for r in rdv.list()} & before, "released memory stays published"
    assert pair.ask(pair.d, "resume") == "resume"
    assert pair.ask(pair.p, "resume") == "resume"
    transfer(pair, "r5", 7005, seed=5)


def test_a_prefill_that_dies_fails_the_decode_request(pair):
    """The prefill process is killed after its first chunk: the decode's transfer queue gets
    Failed for the request, naming the prefill rank that is gone (its bootstrap record, a
    lease, lapsed: here its bootstrap server went with it), and streams it as aborted."""
    start(pair, "r3", 7003)
    assert pair.ask(pair.p, "chunk", "r3", 12, 0, 3) == "sent"
    pair.prefill.kill()
    pair.prefill.join(30)
    got = pair.ask(pair.d, "receive", "r3")
    assert got[0] == "failed", got
    assert "sglang.prefill.0" in got[1] and "is gone" in got[1], got[1]


def test_dp_attention_two_prefill_groups_each_send_the_rooms_sglang_routes_to_them(monkeypatch):
    """A prefill instance with DP attention (``--tp-size 2 --dp-size 2
    --enable-dp-attention``): two scheduler processes in one gloo TP group, attention TP 1
    each, DP groups 0 and 1, one bootstrap server. The decode's DecodePreallocQueue learns
    the DP size through ``try_ensure_parallel_info`` and picks each request's prefill DP rank
    from its room (``follow_bootstrap_room``, SGLang's default, as its router dispatches);
    each room's pages come from that group, byte-equal."""
    pair = Pair(monkeypatch, prefills=2,
                extra=("--tp-size", "2", "--dp-size", "2", "--enable-dp-attention"))
    try:
        transfer(pair, "even", 8000, prefill=pair.ps[0], seed=5)
        transfer(pair, "odd", 8001, prefill=pair.ps[1], seed=6)
    finally:
        pair.close()
