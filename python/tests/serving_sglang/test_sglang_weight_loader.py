"""xfer's SGLang custom weight loader (``xfer.sglang_weights.load_version``) the way an RL
framework reaches it: SGLang's ``update_weights_from_tensor`` with ``load_format`` naming the
loader that ``--custom-weight-loader`` declared. The rollout process publishes SGLang's
server args (``custom_weight_loader=[...]``, ``load_format="dummy"``), initialises SGLang's
distributed state (gloo, one rank) and builds a Qwen2 model with SGLang's own loader from a
config-only small checkpoint (fused ``qkv_proj`` and ``gate_up_proj``). Each update is
``xfer.sglang_weights.update`` in the driver over a stand-in for ``sglang.Engine``'s session
calls: the payload serialized per rank (``MultiprocessingSerializer``, as
``Engine.update_weights_from_tensor`` does) and each request handed to SGLang's
``SchedulerWeightUpdaterManager`` in the rank's process, over the model runner's own
``WeightUpdater``, which dispatches to the custom loader. A trainer process sends the
checkpoint-named tensors; every parameter of SGLang's model is compared with what they imply, and
what SGLang answered, recorded (weight versions) and flushed is checked for each version.

Where SGLang stops on this machine: its CPU engine (``SGLANG_USE_CPU_ENGINE=1``) needs the
CPU build of ``sgl_kernel`` (PyPI's is CUDA's: it fails to load without ``libcuda``), so the
model is built on SGLang's default platform on the CPU device; there SGLang's rotary embedding
takes a reference to vLLM's compiled rope kernel as its fallback (``vllm._custom_ops``), and
the rollout process gives it a stand-in that raises if called (nothing here runs the model).
The scheduler process and its ``ModelRunner`` (KV pools, attention backends, CUDA graphs) are
not constructed: they need a GPU or the CPU kernels."""

import multiprocessing as mp
import socket
import sys

import pytest

pytest.importorskip("sglang")

import xfer  # noqa: E402
from conftest import plugin_available  # noqa: E402
from weight_sync_checkpoint import (  # noqa: E402
    FUSED,
    GRACE,
    STARTUP,
    TIMEOUT,
    WAIT,
    Process,
    checkpoint_shapes,
    expected_parameter,
    full_tensor,
    qwen2_config,
    trainer,
    xfer_config,
)

LOADER = "xfer.sglang_weights.load_version"
def vllm_rope_standin():
    """SGLang's rotary embedding imports vLLM's compiled rope kernel as its fallback on a device
    it does not recognise; only a reference is kept at construction."""
    import sys
    import types

    def rotary_embedding(*args, **kwargs):
        raise NotImplementedError("stand-in for vLLM's compiled rope kernel: the test runs no forward pass")

    ops = types.ModuleType("vllm._custom_ops")
    ops.rotary_embedding = rotary_embedding
    pkg = types.ModuleType("vllm")
    pkg._custom_ops = ops
    sys.modules.setdefault("vllm", pkg)
    sys.modules.setdefault("vllm._custom_ops", ops)


def scheduler_weight_updater(updater):
    """SGLang's scheduler-side ``SchedulerWeightUpdaterManager`` (the session check, the TP
    barrier, the cache flush, the weight-version record), over the model runner's own
    ``WeightUpdater``. Stand-ins: the TP worker (a ``TpModelWorker`` needs a ``ModelRunner``:
    KV pools, attention backends, a GPU) carries ``TpModelWorker``'s own two methods the
    manager calls; the scheduler records weight versions (ignoring ``None``, as SGLang's does)
    and counts cache flushes; the flush and the idleness check say yes (no requests run here)."""
    import types

    from sglang.srt.managers.scheduler_components.weight_updater import SchedulerWeightUpdaterManager
    from sglang.srt.managers.tp_worker import TpModelWorker

    class TpWorker:
        deserialize_own_rank = TpModelWorker.deserialize_own_rank
        weight_update_runners = TpModelWorker.weight_update_runners

        def __init__(self):
            self._model_runner = types.SimpleNamespace(weight_updater=updater)

    class Scheduler:
        def __init__(self):
            self.versions = []
            self.flushes = 0

        def record_weight_version_change(self, new_version):
            if new_version is not None:  # as Scheduler.record_weight_version_change ignores None
                self.versions.append(new_version)

        def flush_cache(self, **kwargs):
            self.flushes += 1
            return True

    scheduler = Scheduler()
    return SchedulerWeightUpdaterManager(
        tp_worker=TpWorker(), draft_worker=None, memory_saver_adapter=None,
        flush_cache=scheduler.flush_cache, is_fully_idle=lambda **kwargs: True, scheduler=scheduler)


def rollout(conn, model_dir, dist_port):
    """One SGLang rank: its model, and the model runner's weight updater."""
    vllm_rope_standin()
    import torch
    from sglang.srt.configs.device_config import DeviceConfig
    from sglang.srt.configs.load_config import LoadConfig
    from sglang.srt.configs.model_config import ModelConfig
    from sglang.srt.distributed.parallel_state import init_distributed_environment, initialize_model_parallel
    from sglang.srt.model_executor.model_runner_components.weight_updater import WeightUpdater
    from sglang.srt.model_loader import get_model
    from sglang.srt.runtime_context import SpawnRanks, publish
    from sglang.srt.runtime_context import get_model as model_settings
    from sglang.srt.server_args import ServerArgs
    from sglang.srt.managers.io_struct import (
        BeginWeightUpdateReqInput,
        EndWeightUpdateReqInput,
        UpdateWeightsFromTensorReqInput,
    )

    from xfer import sglang_weights

    server_args = ServerArgs(model_path=model_dir, device="cpu", load_format="dummy", skip_tokenizer_init=True,
                             dtype="bfloat16", custom_weight_loader=[LOADER])
    publish(server_args, role="scheduler", ranks=SpawnRanks(world_rank=0, gpu_id=0))
    init_distributed_environment(backend="gloo", world_size=1, rank=0, local_rank=0,
                                 distributed_init_method=f"tcp://127.0.0.1:{dist_port}")
    initialize_model_parallel()
    model_config = ModelConfig.from_server_args(server_args)
    model = get_model(model_config=model_config, load_config=LoadConfig(load_format="dummy"),
                      device_config=DeviceConfig(device="cpu", gpu_id=0))

    def unused(*args, **kwargs):
        raise AssertionError("not called by update_weights_from_tensor")

    updater = WeightUpdater(
        tp_rank=0, device="cpu", gpu_id=0, model_config=model_config,
        custom_weight_loaders=model_settings().custom_weight_loader,  # what ModelRunner passes
        get_model=lambda: model, update_model_fields=unused, recapture_cuda_graph=unused, get_model_runner=unused,
    )
    manager = scheduler_weight_updater(updater)
    REQUESTS = {"begin_weight_update": BeginWeightUpdateReqInput, "end_weight_update": EndWeightUpdateReqInput,
                "update_weights_from_tensor": UpdateWeightsFromTensorReqInput}
    conn.send(("up", type(model).__module__ + "." + type(model).__qualname__))
    snapshot = {}
    while True:
        cmd, arg = conn.recv()
        try:
            if cmd == "request":
                # One of the requests sglang.Engine's session calls hand the scheduler.
                kind, fields = arg
                out = getattr(manager, kind)(REQUESTS[kind](**fields))
                conn.send(("ok", (out.success, out.message)))
            elif cmd == "recorded":
                scheduler = manager.scheduler
                conn.send(("ok", (list(scheduler.versions), scheduler.flushes, manager._session is not None,
                                  sglang_weights.last_outcome())))
            elif cmd == "update_without_session":
                out = manager.update_weights_from_tensor(
                    UpdateWeightsFromTensorReqInput(serialized_named_tensors=[arg], load_format=LOADER))
                conn.send(("ok", (out.success, out.message, sglang_weights.last_outcome())))
            elif cmd == "check":
                checkpoint = {n: full_tensor(n, s, arg[1]) for n, s in arg[0]}
                wrong, checked = [], 0
                for name, p in model.named_parameters():
                    want = expected_parameter(name, checkpoint)
                    checked += 1
                    if p.dtype != want.dtype or tuple(p.shape) != tuple(want.shape) or not torch.equal(p.data, want):
                        wrong.append(name)
                conn.send(("ok", (checked, wrong)))
            elif cmd == "snapshot":
                snapshot = {n: p.detach().clone() for n, p in model.named_parameters()}
                conn.send(("ok", len(snapshot)))
            elif cmd == "changed_since_snapshot":
                conn.send(("ok", [n for n, p in model.named_parameters() if not torch.equal(p.data, snapshot[n])]))
            elif cmd == "staged":
                shapes, seed = arg
                shape = dict(shapes)
                staged = sglang_weights._receiver.receiver.tensors()
                conn.send(("ok", [n for n, t in staged if torch.equal(t, full_tensor(n, shape[n], seed))]))
            elif cmd == "close":
                sglang_weights.close()
                conn.send(("ok", None))
            elif cmd == "exit":
                sglang_weights.close()
                conn.send(("ok", None))
                return
        except Exception as e:  # noqa: BLE001 - the driver asserts on it
            import traceback

            conn.send(("failed", f"{type(e).__name__}: {e}\n{traceback.format_exc()}"))


@pytest.fixture(scope="module")
def sglang_rank(tmp_path_factory):
    if not plugin_available("efa"):
        pytest.skip("the efa plugin is not in the package (cargo xtask python builds it)")
    model_dir = str(tmp_path_factory.mktemp("qwen2-config-only"))
    qwen2_config().save_pretrained(model_dir)
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    ctx = mp.get_context("spawn")
    server = xfer.Server("127.0.0.1:0")
    rank = Process(ctx, rollout, model_dir, port)
    try:
        up = rank.answer(STARTUP)
        assert up == ("up", "sglang.srt.models.qwen2.Qwen2ForCausalLM"), up
        yield rank, ctx, server.url, checkpoint_shapes()
    finally:
        rank.close()
        server.close()


class Engine:
    """``sglang.Engine``'s three session calls in the framework's process, each request handed to
    the SGLang rank's scheduler manager: the named tensors serialized one payload per TP rank (as
    ``Engine._serialize_tensors_per_rank``), ``(success, message)`` returned as the tokenizer
    manager returns it. ``weight_version``: what SGLang's HTTP route ``/update_weights_from_tensor``
    adds to the same request (the scheduler records it on success)."""

    def __init__(self, rank):
        self.rank = rank

    def ask(self, kind, **fields):
        status, result = self.rank.ask("request", (kind, fields))
        assert status == "ok", result
        return result

    def begin_weight_update(self):
        return self.ask("begin_weight_update")

    def update_weights_from_tensor(self, named_tensors, load_format=None, flush_cache=True, weight_version=None):
        from sglang.srt.utils import MultiprocessingSerializer

        return self.ask("update_weights_from_tensor",
                        serialized_named_tensors=[MultiprocessingSerializer.serialize(named_tensors)],
                        load_format=load_format, flush_cache=flush_cache, weight_version=weight_version)

    def end_weight_update(self):
        return self.ask("end_weight_update")


class Run:
    """The driver: a trainer process, and the SGLang rank in the same group."""

    def __init__(self, sglang_rank, group, provider):
        self.rank, self.ctx, self.url, self.shapes = sglang_rank
        self.group, self.provider = group, provider
        self.membership = dict(rendezvous=self.url, group=group, receivers=1, senders=1,
                               config=xfer_config(provider), timeout=TIMEOUT, grace=GRACE)
        self.trainer = self.start_trainer()

    def start_trainer(self):
        t = Process(self.ctx, trainer, self.url, self.group, self.shapes, self.provider)
        assert t.answer(STARTUP) == "up"
        return t

    def check(self, seed):
        status, result = self.rank.ask("check", (self.shapes, seed))
        assert status == "ok", result
        return result

    def version(self, v, seed, *, die=False, misshapen=False, session=True):
        """One version: ``xfer.sglang_weights.update`` over the Engine stand-in and the trainer's
        send, concurrently; SGLang's answer, the loader's outcome and what the scheduler recorded
        (new weight versions, cache flushes). ``session=False``: the bare
        ``update_weights_from_tensor`` request, serialized here as ``Engine`` serializes it."""
        from sglang.srt.utils import MultiprocessingSerializer

        from xfer import sglang_weights

        if not session:
            payload = MultiprocessingSerializer.serialize(sglang_weights.request(v, **self.membership))
            self.rank.conn.send(("update_without_session", payload))
            status, result = self.rank.answer()
            assert status == "ok", result
            return None, result
        # xfer.sglang_weights.update in the framework's process, the trainer sending meanwhile.
        self.trainer.conn.send(("send", (v, seed, die, misshapen)))
        versions, flushes, _, _ = self.recorded()
        ok, message = sglang_weights.update(Engine(self.rank), v, weight_version=f"v{v}", **self.membership)
        if die:
            self.trainer.proc.join(WAIT)
            assert self.trainer.proc.exitcode == 17, "the trainer meant to die did not"
            sent = None
        else:
            sent = self.trainer.answer()
        now_versions, now_flushes, session_open, outcome = self.recorded()
        assert not session_open, "the weight-update session was left open"
        recorded = (now_versions[len(versions):], now_flushes - flushes)
        return sent, (ok, message, outcome, recorded)

    def recorded(self):
        """What SGLang's scheduler recorded: weight versions, cache flushes, an open session,
        and the loader's last outcome on the rank."""
        status, result = self.rank.ask("recorded")
        assert status == "ok", result
        return result

    def close(self):
        self.rank.ask("close")
        self.trainer.close()


def assert_loaded(run, got, v, seed):
    sent, (ok, message, outcome, recorded) = got
    assert sent == ("ok", None), sent
    assert ok, message
    assert recorded == ([f"v{v}"], 1), recorded  # SGLang recorded the version and flushed its cache once
    assert outcome == {"version": v, "loaded": True, "tensors": len(run.shapes)}, outcome
    checked, wrong = run.check(seed)
    assert wrong == [], (seed, wrong)
    return checked


@pytest.mark.parametrize("provider", ["shm"])
def test_two_versions_land_in_the_parameters_of_sglangs_model(sglang_rank, provider):
    run = Run(sglang_rank, "two-versions", provider)
    try:
        # SGLang's dummy weights are none of the versions': the check can fail.
        checked, wrong = run.check(31)
        assert checked > 0 and len(wrong) == checked, (checked, wrong)
        fused = [n for n in wrong if any(f".{f}." in n for f in FUSED)]
        assert len(fused) == 2 * 3, fused  # qkv_proj's weight and bias, gate_up_proj's weight; 2 layers
        for v, seed in ((1, 31), (2, 32)):
            assert assert_loaded(run, run.version(v, seed), v, seed) == checked
    finally:
        run.close()


@pytest.mark.parametrize("provider", ["shm"])
def test_update_weights_from_tensor_outside_a_session_is_refused_by_sglangs_scheduler(sglang_rank, provider):
    # What xfer.sglang_weights documented before SGLang 0.5.23's session: the scheduler refuses
    # it before any loader runs (the trainer's version then fails by its timeout) — hence
    # xfer.sglang_weights.update, which opens and closes the session.
    run = Run(sglang_rank, "no-session", provider)
    try:
        _, (ok, message, outcome) = run.version(1, 61, session=False)
        assert not ok and "begin_weight_update" in message, message
        assert outcome is None or outcome["version"] != 1, outcome
    finally:
        run.close()


# Over tcp: with libfabric's shm provider a peer that died with operations toward it in flight
# stalls its peers' queues (see docs/weight-sync.md, verl).
@pytest.mark.parametrize("provider", ["tcp;ofi_rxm"])
def test_a_trainer_killed_mid_version_leaves_the_model_untouched_and_the_next_version_lands(sglang_rank, provider):
    run = Run(sglang_rank, "killed-trainer", provider)
    try:
        assert_loaded(run, run.version(1, 41), 1, 41)
        assert run.rank.ask("snapshot")[0] == "ok"
        # The trainer dies staging its last tensor: earlier rounds' writes have landed in the
        # rank's staging. SGLang answers the update a failure with xfer's reason, records no
        # version and keeps its cache (the loader does not raise: that would end SGLang's
        # scheduler process).
        _, (ok, message, outcome, recorded) = run.version(2, 42, die=True)
        assert not ok and "weight version 2" in message and "previous weights" in message, message
        assert recorded == ([], 0), recorded
        assert outcome["version"] == 2 and not outcome["loaded"], outcome
        assert "weight version 2 failed" in outcome["reason"], outcome
        status, staged = run.rank.ask("staged", (run.shapes, 42))
        assert status == "ok" and 0 < len(staged) < len(run.shapes), staged
        # … and none of it reached the model.
        assert run.rank.ask("changed_since_snapshot") == ("ok", [])
        assert run.check(41)[1] == []
        # A new trainer in its place: the next version is complete and loaded.
        run.trainer = run.start_trainer()
        assert_loaded(run, run.version(3, 43), 3, 43)
    finally:
        run.close()


@pytest.mark.parametrize("provider", ["shm"])
def test_a_version_the_models_load_weights_refuses_is_recorded_and_the_rank_keeps_serving(sglang_rank, provider):
    run = Run(sglang_rank, "misshapen", provider)
    try:
        assert_loaded(run, run.version(1, 51), 1, 51)
        assert run.rank.ask("snapshot")[0] == "ok"
        name, shape = run.shapes[-1]
        assert len(shape) == 2 and shape[0] != shape[1], (name, shape)
        # The version arrives whole; the model's own load_weights refuses its last tensor after
        # loading the others. SGLang answers a failure that says the model is a mix, records no
        # version and keeps its cache; the outcome says the same.
        sent, (ok, message, outcome, recorded) = run.version(2, 52, misshapen=True)
        assert sent == ("ok", None), sent
        assert not ok and "load_weights" in message and "mix" in message, message
        assert recorded == ([], 0), recorded
        assert outcome["version"] == 2 and not outcome["loaded"] and outcome["model_changed"], outcome
        assert "load_weights" in outcome["reason"], outcome
        status, changed = run.rank.ask("changed_since_snapshot")
        assert status == "ok" and changed, "the tensors before the refused one were loaded"
        # The next complete version lands whole.
        assert_loaded(run, run.version(3, 53), 3, 53)
    finally:
        run.close()


# ---- a rank's receiver rank, from SGLang's own parallel state ----


def parallel(**ranks):
    """SGLang's parallel state as its launcher would have stamped it, for this block."""
    from sglang.srt.runtime_context import get_parallel

    placement = dict(tp_size=1, tp_rank=0, pp_size=1, pp_rank=0, dp_size=1, ep_join_rank_offset=0)
    return get_parallel().override(**dict(placement, **ranks))


def test_a_ranks_receiver_rank_is_its_sglang_world_rank_past_rank_base():
    from xfer import sglang_weights

    with parallel(tp_size=2, tp_rank=1, pp_size=2, pp_rank=1):
        assert sglang_weights.receiver_rank(10) == 10 + 1 * 2 + 1


def test_an_elastic_ep_joiners_receiver_ranks_follow_the_ranks_it_joined():
    # SGLang numbers a scale joiner's WORLD ranks from ep_join_rank_offset: without it, the
    # joiner's ranks would be the first group's, and two receivers would claim each rank.
    from xfer import sglang_weights

    with parallel(tp_size=2, tp_rank=1, ep_join_rank_offset=4):
        assert sglang_weights.receiver_rank(10) == 10 + 4 + 1


def test_each_data_parallel_replica_gets_its_own_receiver_ranks():
    # One update_weights_from_tensor reaches every replica with the same request.
    from xfer import sglang_weights

    with parallel(tp_size=2, tp_rank=1, pp_size=2, pp_rank=0, dp_size=3, dp_rank=2):
        assert sglang_weights.receiver_rank(10) == 10 + 2 * 4 + 1
    with parallel(tp_size=2, dp_size=3, dp_rank=None):
        with pytest.raises(sglang_weights.ReceiverRankError, match="data-parallel"):
            sglang_weights.receiver_rank(0)


def test_a_rank_sglang_has_not_placed_is_refused_by_name_and_nothing_is_loaded(monkeypatch):
    from xfer import sglang_weights

    # Nothing stamped in this process: SGLang cannot say where this rank is.
    with pytest.raises(sglang_weights.ReceiverRankError, match="parallel state.*not published"):
        sglang_weights.receiver_rank(0)
    # An SGLang without its parallel state (runtime_context): refused, not rank_base for all.
    monkeypatch.setitem(sys.modules, "sglang.srt.runtime_context", None)
    with pytest.raises(sglang_weights.ReceiverRankError, match="runtime_context"):
        sglang_weights.receiver_rank(0)

    class Untouchable:
        def load_weights(self, weights):
            raise AssertionError("nothing is loaded")

    sglang_weights.load_version(Untouchable(), sglang_weights.request(
        7, rendezvous="xfer://127.0.0.1:1", group="g", receivers=1))
    outcome = sglang_weights.last_outcome()
    assert outcome["version"] == 7 and not outcome["loaded"], outcome
    assert "receiver rank" in outcome["reason"] and "runtime_context" in outcome["reason"], outcome


def test_a_request_without_a_config_is_refused_by_name_not_served_by_the_mock(monkeypatch):
    # xfer.TransferEngine(None) is the in-process mock: a loader that took it would "receive"
    # nothing from another host and say so only by timing out. Refused, as verl's engine is.
    from xfer import sglang_weights

    monkeypatch.delenv("XFER_CONFIG", raising=False)

    class Untouchable:
        def load_weights(self, weights):
            raise AssertionError("nothing is loaded")

    with parallel(tp_size=1, tp_rank=0):
        sglang_weights.load_version(Untouchable(), sglang_weights.request(
            8, rendezvous="xfer://127.0.0.1:1", group="g", receivers=1, timeout=2.0))
    outcome = sglang_weights.last_outcome()
    assert outcome["version"] == 8 and not outcome["loaded"] and not outcome["model_changed"], outcome
    assert "no xfer config" in outcome["reason"] and "XFER_CONFIG" in outcome["reason"], outcome
    assert sglang_weights.LOADER in outcome["reason"], outcome
