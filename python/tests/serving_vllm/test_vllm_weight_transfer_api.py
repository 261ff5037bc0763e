"""xfer as a backend of vLLM 0.33's own weight-transfer API, driven the way vLLM's RL users
drive it: the rollout process builds vLLM's executor from an engine config with
``weight_transfer_config={"backend": "xfer"}`` and tensor parallelism 2 (two CPU workers in
processes of their own, gloo); each worker's ``load_model`` asks vLLM's
``WeightTransferEngineFactory`` for the engine, which knows ``"xfer"`` only through xfer's
``vllm.general_plugins`` entry point (vLLM loads general plugins in each worker process).
The trainer is vLLM's ``WeightTransferTrainerFactory.trainer_init`` over vLLM's own
``ModuleSource`` of a transformers Qwen2, with a client whose four methods are the
``collective_rpc`` calls vLLM's ``RLOfflineMixin`` / ``AsyncLLM`` issue for the RL routes
(``init_weight_transfer_engine``, ``start_weight_update``, ``update_weights``,
``finish_weight_update``); the worker's methods of those names are vLLM's.

The oracle is vLLM's own loader: after a version, each worker's parameters are compared with
what ``model.load_weights`` makes of the full checkpoint on that worker (its TP slice, the
fused ``qkv_proj`` / ``gate_up_proj``). vLLM's ``nccl_m2n`` destination planner runs on the
same workers as the control of the slicing (its data path needs NCCL and a GPU).

Where vLLM stops on this machine: as in test_vllm_weight_extension.py (no compiled ops; the
CPU worker's one call is stood in; the model is never executed)."""

import os

os.environ.setdefault("VLLM_TARGET_DEVICE", "cpu")

import multiprocessing as mp
import threading
import weakref

import pytest

pytest.importorskip("vllm")

import xfer  # noqa: E402
from xfer.weights import VersionFailed  # noqa: E402
from conftest import plugin_available  # noqa: E402
from weight_sync_checkpoint import GRACE, STARTUP, TIMEOUT, Process, full_tensor, qwen2_config, xfer_config  # noqa: E402

TP = 2


def worker_state(wrapper, shapes, seed):
    """One worker after a version: its engine, what it staged, and the parameters that differ
    from what vLLM's own ``load_weights`` makes of version ``seed``'s full checkpoint here
    (run after the snapshot; it leaves the model at that version)."""
    import torch

    worker = wrapper.worker
    model = worker.get_model()
    engine = worker.weight_transfer_engine
    got = {n: p.detach().clone() for n, p in model.named_parameters()}
    model.load_weights((n, full_tensor(n, s, seed)) for n, s in shapes)
    wrong = [n for n, p in model.named_parameters() if not torch.equal(p.data, got[n])]
    receiver = getattr(engine, "receiver", None)
    return {
        "rank": worker.rank,
        "engine": f"{type(engine).__module__}.{type(engine).__qualname__}",
        "staged": None if receiver is None or receiver.buffer is None else int(receiver.buffer.nbytes),
        "boxes": sorted({b.piece[0] for b in engine.slices.boxes}) if getattr(engine, "slices", None) else [],
        "whole": list(engine.slices.whole) if getattr(engine, "slices", None) else [],
        "trace_failure": getattr(engine, "trace_failure", ""),
        "wrong": wrong,
        "params": len(got),
        "outcome": getattr(engine, "last_outcome", None),
    }


def worker_m2n_direct(wrapper, shapes):
    """vLLM's ``nccl_m2n`` destination plan on this worker: the checkpoint tensors it would
    reshard straight into the model (each rank's slice), by name."""
    import torch
    from vllm.distributed.weight_transfer.m2n_layout import resolve_parameter_destinations

    model = wrapper.worker.get_model()
    dests = resolve_parameter_destinations(model, [n for n, _ in shapes], [torch.bfloat16] * len(shapes),
                                           [s for _, s in shapes], num_workers=TP, shard_axis_size=TP, allow_direct=True)
    return sorted(d.name for d in dests if d.direct)


def worker_snapshot(wrapper):
    wrapper.worker.test_snapshot = {n: p.detach().clone() for n, p in wrapper.worker.get_model().named_parameters()}


def worker_changed(wrapper):
    import torch

    changed = [n for n, p in wrapper.worker.get_model().named_parameters()
               if not torch.equal(p.data, wrapper.worker.test_snapshot[n])]
    return changed, wrapper.worker.weight_transfer_engine.last_outcome


def rollout(conn, model_dir, plugin_dir):
    """The vLLM instance: vLLM's executor with the xfer backend, TP 2, driven by pipe."""
    import sys

    sys.path.insert(0, plugin_dir)
    os.environ["VLLM_HOST_IP"] = "127.0.0.1"
    # vLLM binds each CPU worker's threads to a NUMA node of its own by default; this machine
    # has one node for two workers ("nobind": vLLM's setting for binding by hand).
    os.environ["VLLM_CPU_OMP_THREADS_BIND"] = "nobind"
    from vllm.engine.arg_utils import EngineArgs
    from vllm.v1.executor.abstract import Executor

    vllm_config = EngineArgs(
        model=model_dir, load_format="dummy", skip_tokenizer_init=True, enforce_eager=True, dtype="bfloat16",
        max_model_len=256, tensor_parallel_size=TP, distributed_executor_backend="mp",
        weight_transfer_config={"backend": "xfer"},
    ).create_engine_config()
    executor = Executor.get_class(vllm_config)(vllm_config)
    conn.send(("up", type(executor).__name__))
    while True:
        cmd, arg = conn.recv()
        if cmd == "exit":
            executor.shutdown()
            conn.send(("ok", None))
            return
        method, args, kwargs = arg
        try:
            conn.send(("ok", executor.collective_rpc(method, args=args, kwargs=kwargs)))
        except Exception as e:  # noqa: BLE001 - the driver asserts on it
            conn.send(("failed", f"{type(e).__name__}: {e}"))


class ExecutorClient:
    """vLLM's ``VLLMWeightSyncClient`` over the rollout process: each method the
    ``collective_rpc`` vLLM's ``RLOfflineMixin`` issues for it."""

    def __init__(self, instance):
        self.instance = instance
        self.calls = []

    def _rpc(self, method, **kwargs):
        self.calls.append(method)
        status, result = self.instance.ask("rpc", (method, (), kwargs))
        if status != "ok":
            raise RuntimeError(result)
        return result

    def init_weight_transfer_engine(self, init_info):
        self._rpc("init_weight_transfer_engine", init_info=init_info)

    def start_weight_update(self):
        self._rpc("start_weight_update")

    def update_weights(self, update_info):
        self._rpc("update_weights", update_info=update_info)

    def finish_weight_update(self, weight_version=None):
        self._rpc("finish_weight_update")


def vllm_instance(tmp_path_factory, hf_config, standins=("cpu_standin = vllm_cpu_standin:register",)):
    """vLLM's executor (TP 2, the xfer backend) over a config-only checkpoint of ``hf_config``
    in a process of its own, and a rendezvous service; ``standins``: the general-plugin entry
    points that stand in for the compiled ops the wheel lacks."""
    if not plugin_available("efa"):
        pytest.skip("the efa plugin is not in the package (cargo xtask python builds it)")
    from importlib.metadata import entry_points

    ours = [e for e in entry_points(group="vllm.general_plugins") if e.value.startswith("xfer.")]
    assert ours, "xfer's wheel names no vllm.general_plugins entry point (rebuild: cargo xtask python)"
    model_dir = str(tmp_path_factory.mktemp(f"{hf_config.model_type}-config-only"))
    hf_config.save_pretrained(model_dir)
    plugin_dir = tmp_path_factory.mktemp("plugin")
    dist = plugin_dir / "xfer_test_vllm_cpu_standin-0.dist-info"
    dist.mkdir()
    (dist / "METADATA").write_text("Metadata-Version: 2.1\nName: xfer-test-vllm-cpu-standin\nVersion: 0\n")
    (dist / "entry_points.txt").write_text("[vllm.general_plugins]\n" + "".join(f"{e}\n" for e in standins))
    ctx = mp.get_context("spawn")
    server = xfer.Server("127.0.0.1:0")
    instance = Process(ctx, rollout, model_dir, str(plugin_dir))
    try:
        up = instance.answer(STARTUP)
        assert up[0] == "up", up
        yield instance, server.url
    finally:
        instance.close()
        server.close()


@pytest.fixture(scope="module")
def vllm_tp2(tmp_path_factory):
    yield from vllm_instance(tmp_path_factory, qwen2_config())


class Trainer:
    """One trainer rank: transformers' Qwen2 (bf16, CPU) as vLLM's ``ModuleSource``; a
    version's values are written into its parameters in place (as an optimizer step does)."""

    def __init__(self, url, group, hf_config=None, rank=0, **kw):
        import torch
        from transformers import AutoModelForCausalLM
        from vllm.distributed.weight_transfer import ModuleSource, WeightTransferTrainerFactory

        from xfer.weights.vllm_engine import XferTrainerInitInfo, register

        register()  # the trainer process is not vLLM's: it runs the plugin itself
        self.model = AutoModelForCausalLM.from_config(hf_config or qwen2_config(), torch_dtype=torch.bfloat16)
        self.shapes = [(n, tuple(p.shape)) for n, p in self.model.named_parameters()]
        self.source = ModuleSource(self.model)
        self.init = XferTrainerInitInfo(rank=rank, rendezvous=url, group=group, receivers=TP, config=xfer_config("shm"),
                                        timeout=TIMEOUT, grace=GRACE, **kw)
        self.factory = WeightTransferTrainerFactory

    def join(self, client):
        self.client = client
        self.engine = self.factory.trainer_init(self.init, client=client, source=self.source)
        return self.engine

    def step(self, seed):
        import torch

        with torch.no_grad():
            for n, p in self.model.named_parameters():
                p.copy_(full_tensor(n, tuple(p.shape), seed))

    @property
    def full_bytes(self):
        return sum(p.numel() * p.element_size() for p in self.model.parameters())


def states(instance, shapes, seed):
    status, result = instance.ask("rpc", (worker_state, (shapes, seed), {}))
    assert status == "ok", result
    return result


def test_each_tp_rank_receives_only_its_slice_through_vllms_weight_transfer_api(vllm_tp2):
    instance, url = vllm_tp2
    # budget_bytes=None: written from the source's own memory (vLLM's ModuleSource over a
    # plain module yields its parameters), registered once; the default streams (below).
    trainer = Trainer(url, "api-tp2", budget_bytes=None)
    engine = trainer.join(ExecutorClient(instance))
    try:
        # vLLM's dummy weights are not version 99's: the oracle can fail.
        before = states(instance, trainer.shapes, 99)
        assert all(len(s["wrong"]) == s["params"] > 0 for s in before), before
        assert {s["engine"] for s in before} == {"xfer.weights.vllm_worker.XferWeightTransferEngine"}
        assert all(s["trace_failure"] == "" for s in before), before
        # Every checkpoint tensor lands as boxes (fused q/k/v and gate/up included): none whole.
        assert all(s["whole"] == [] and len(s["boxes"]) == len(trainer.shapes) for s in before), before
        # vLLM's nccl_m2n planner, the control: what it reshards directly, xfer does too; the
        # fused parts it must send whole to every rank, xfer slices.
        status, m2n = instance.ask("rpc", (worker_m2n_direct, (trainer.shapes,), {}))
        assert status == "ok", m2n
        for direct, state in zip(m2n, before):
            assert set(direct) <= set(state["boxes"])
            assert any(".q_proj." in n for n in set(state["boxes"]) - set(direct)), "fused parts"
        registered = None
        for seed in (11, 12):
            trainer.step(seed)
            engine.send_weights()
            after = states(instance, trainer.shapes, seed)
            assert [s["wrong"] for s in after] == [[]] * TP, after
            # Each rank staged its slices only: half the sharded bytes plus the replicated norms.
            assert all(s["staged"] < 0.6 * trainer.full_bytes for s in after), (after, trainer.full_bytes)
            # The trainer's tensors are the model's own memory, the same each version: registered once.
            now = {k: id(region) for k, (_, region) in engine.sender._registered.items()}
            assert len(now) == len(trainer.shapes)
            assert registered is None or now == registered
            registered = now
        calls = engine.client.calls
        assert calls[:1] == ["init_weight_transfer_engine"]
        assert calls[1:] == ["start_weight_update", "update_weights", "finish_weight_update"] * 2
    finally:
        engine.shutdown()


def test_a_version_that_fails_on_the_trainer_changes_no_tp_rank_and_the_next_one_lands(vllm_tp2):
    instance, url = vllm_tp2
    trainer = Trainer(url, "api-tp2-fail", budget_bytes=1 << 20)
    engine = trainer.join(ExecutorClient(instance))
    try:
        trainer.step(21)
        engine.send_weights()
        assert [s["wrong"] for s in states(instance, trainer.shapes, 21)] == [[]] * TP
        assert instance.ask("rpc", (worker_snapshot, (), {}))[0] == "ok"
        # The trainer's source fails after the first tensors were written (streamed: staged
        # in two buckets of 512 KiB).
        iter_full = trainer.source.iter_full

        def fails_late():
            for i, item in enumerate(iter_full()):
                if i == len(trainer.shapes) - 2:
                    raise RuntimeError("stand-in: the trainer's gather failed")
                yield item

        trainer.source.iter_full = fails_late
        trainer.step(22)
        with pytest.raises(VersionFailed, match="weight version 2 failed: trainer rank 0: stand-in"):
            engine.send_weights()
        # Not applied on either rank; each worker's update_weights returned (vLLM's executor
        # would otherwise keep the second worker's failure queued for the next call).
        status, after = instance.ask("rpc", (worker_changed, (), {}))
        assert status == "ok", after
        for changed, outcome in after:
            assert changed == [] and outcome["version"] == 2 and not outcome["applied"], after
            assert "stand-in: the trainer's gather failed" in outcome["reason"]
        assert engine.client.calls[-3:] == ["start_weight_update", "update_weights", "finish_weight_update"]
        trainer.source.iter_full = iter_full
        trainer.step(23)
        engine.send_weights()
        assert [s["wrong"] for s in states(instance, trainer.shapes, 23)] == [[]] * TP
    finally:
        engine.shutdown()


def test_tensors_received_whole_go_through_vllms_load_weights_inside_its_layerwise_reload(vllm_tp2):
    # direct=False: what a quantised model gets (every tensor whole, loaded by vLLM's own
    # load_weights between initialize_ and finalize_layerwise_reload).
    instance, url = vllm_tp2
    trainer = Trainer(url, "api-tp2-whole", direct=False)
    engine = trainer.join(ExecutorClient(instance))
    try:
        trainer.step(31)
        engine.send_weights()
        after = states(instance, trainer.shapes, 31)
        assert [s["wrong"] for s in after] == [[]] * TP, after
        assert all(s["boxes"] == [] and len(s["whole"]) == len(trainer.shapes) for s in after), after
        assert all(s["staged"] >= trainer.full_bytes for s in after), after
    finally:
        engine.shutdown()


def worker_init_without_config(wrapper, init_info):
    """vLLM's ``Worker.init_weight_transfer_engine`` with ``init_info`` and no ``$XFER_CONFIG``
    in the worker, as the API route would call it; returns what it raised (caught here: a
    failure raised through the executor leaves the other worker's answer queued)."""
    saved = os.environ.pop("XFER_CONFIG", None)
    try:
        wrapper.worker.init_weight_transfer_engine(init_info)
        return None, getattr(wrapper.worker.weight_transfer_engine, "receiver", None) is not None
    except Exception as e:  # noqa: BLE001 - the driver asserts on it
        return f"{type(e).__name__}: {e}", getattr(wrapper.worker.weight_transfer_engine, "receiver", None) is not None
    finally:
        if saved is not None:
            os.environ["XFER_CONFIG"] = saved


def test_without_a_config_neither_the_trainer_nor_a_worker_builds_the_mock(vllm_tp2, monkeypatch):
    # No config and no $XFER_CONFIG: refused by name on both sides (as verl's engine does),
    # never xfer.TransferEngine(None), the in-process mock that moves nothing between hosts.
    instance, url = vllm_tp2
    monkeypatch.delenv("XFER_CONFIG", raising=False)
    trainer = Trainer(url, "api-no-config")
    trainer.init.config = None
    client = ExecutorClient(instance)
    with pytest.raises(ValueError, match="XferTrainerInitInfo: no xfer config.*XFER_CONFIG"):
        trainer.join(client)
    assert client.calls == [], "refused before any worker was asked"
    # A worker asked directly (over vLLM's RL route) without a config refuses too.
    init = {"rendezvous": url, "group": "api-no-config", "receivers": TP,
            "tensors": [[n, list(s), "bfloat16"] for n, s in trainer.shapes]}
    status, answers = instance.ask("rpc", (worker_init_without_config, (init,), {}))
    assert status == "ok", answers
    for error, joined in answers:
        assert error is not None and "XferInitInfo: no xfer config" in error and "XFER_CONFIG" in error, answers
        assert not joined, answers


def worker_fail_next_load(wrapper, rank, after):
    """Stand-in for a load that fails on one worker after the commit (a tensor its loader
    refuses, memory running out while vLLM materialises a layer): worker ``rank``'s next
    ``load_weights`` takes ``after`` tensors, then raises. Once."""
    if wrapper.worker.rank != rank:
        return False
    model = wrapper.worker.get_model()
    load = model.load_weights

    def fails_part_way(weights):
        del model.load_weights  # once: the next version loads with the model's own
        taken = []
        for i, item in enumerate(weights):
            if i == after:
                load(iter(taken))
                raise RuntimeError(f"stand-in: worker {rank}'s loader failed at its tensor {i}")
            taken.append(item)
        return load(iter(taken))

    model.load_weights = fails_part_way
    return True


def worker_versions_held(wrapper, rank, shapes, seeds):
    """On worker ``rank``: which of versions ``seeds`` each parameter holds (as vLLM's own
    ``load_weights`` places it; None: none of them). The model is left as it was."""
    import torch

    if wrapper.worker.rank != rank:
        return None
    model = wrapper.worker.get_model()
    now = {n: p.detach().clone() for n, p in model.named_parameters()}
    held = {n: None for n in now}
    with torch.no_grad():
        for seed in seeds:
            model.load_weights((n, full_tensor(n, s, seed)) for n, s in shapes)
            for n, p in model.named_parameters():
                if held[n] is None and torch.equal(p.data, now[n]):
                    held[n] = seed
        for n, p in model.named_parameters():
            p.data.copy_(now[n])
    return held


def worker_outcome(wrapper):
    engine = wrapper.worker.weight_transfer_engine
    return engine.last_outcome, wrapper.worker._weight_update_active


def test_a_version_one_worker_cannot_apply_after_the_commit_is_reported_and_the_next_one_lands(vllm_tp2):
    # The commit is the last point every rank agrees on; one worker's apply can still fail
    # after it. That worker's failure must not travel through vLLM's executor (which answers
    # with the first failure and leaves the other worker's answer queued) nor leave the other
    # worker in its session (every later start_weight_update would be refused): the trainer
    # is told by name, the session is closed everywhere, and the next version lands.
    instance, url = vllm_tp2
    trainer = Trainer(url, "api-tp2-apply-fails", direct=False)
    engine = trainer.join(ExecutorClient(instance))
    try:
        trainer.step(41)
        engine.send_weights()
        assert [s["wrong"] for s in states(instance, trainer.shapes, 41)] == [[]] * TP
        status, armed = instance.ask("rpc", (worker_fail_next_load, (1, len(trainer.shapes) // 2), {}))
        assert status == "ok" and armed == [False, True], armed
        trainer.step(42)
        with pytest.raises(Exception) as failed:
            engine.send_weights()
        assert type(failed.value).__name__ == "VersionNotApplied", repr(failed.value)
        assert failed.match(r"weight version 2 was committed but not applied on 1 worker"
                            r".*receiver 1: .*stand-in: worker 1's loader failed")
        assert failed.value.version == 2 and set(failed.value.failed) == {1}
        assert engine.client.calls[-3:] == ["start_weight_update", "update_weights", "finish_weight_update"]
        status, outcomes = instance.ask("rpc", (worker_outcome, (), {}))
        assert status == "ok", outcomes
        (ok, ok_active), (bad, bad_active) = outcomes
        assert ok["version"] == 2 and ok["applied"] and not ok_active, outcomes
        assert bad["version"] == 2 and not bad["applied"] and bad["committed"] and not bad_active, outcomes
        # Rank 0 holds version 2; rank 1 a mix of versions 1 and 2, layer by layer: the layers
        # processed before the failure hold version 2, the rest version 1 — never a layer
        # half-loaded or left uninitialised.
        status, held = instance.ask("rpc", (worker_versions_held, (0, trainer.shapes, (42,)), {}))
        assert status == "ok" and set(held[0].values()) == {42}, held
        status, held = instance.ask("rpc", (worker_versions_held, (1, trainer.shapes, (41, 42)), {}))
        assert status == "ok" and set(held[1].values()) == {41, 42}, held
        # The next version starts a session on every worker and applies whole on both.
        trainer.step(43)
        engine.send_weights()
        assert [s["wrong"] for s in states(instance, trainer.shapes, 43)] == [[]] * TP
    finally:
        engine.shutdown()


class Liveness:
    """How many of the tensors a source yielded are alive at once (weak references: a tensor
    counts until its last reference goes)."""

    def __init__(self):
        self.lock = threading.Lock()
        self.alive = self.most = self.yielded = 0

    def track(self, t):
        with self.lock:
            self.alive += 1
            self.yielded += 1
            self.most = max(self.most, self.alive)
        weakref.finalize(t, self._gone)
        return t

    def _gone(self):
        with self.lock:
            self.alive -= 1


def gathering_source(model, rank=0, owners=None, liveness=None):
    """vLLM's ``WeightSource`` as a sharded trainer implements it: ``metadata`` read from the
    module without gathering (every trainer rank the same, ``owners(name)`` its
    ``ParamMeta.owners``), and ``iter_full`` yielding each parameter this rank owns, in
    metadata order, as a fresh full tensor (what an FSDP ``full_tensor()`` all-gather
    returns), held nowhere by the source."""
    from functools import cached_property

    from vllm.distributed.weight_transfer.base import ParamMeta, WeightSource

    class GatheringSource(WeightSource):
        def __init__(self):
            self.yielded = []

        @cached_property
        def metadata(self):
            return [ParamMeta(n, p.dtype, tuple(p.shape), owners=None if owners is None else owners(n))
                    for n, p in model.named_parameters()]

        def iter_full(self):
            params = dict(model.named_parameters())
            for name in self.owned_names(rank):
                self.yielded.append(name)
                full = params[name].detach().clone()
                yield name, (liveness.track(full) if liveness is not None else full)
                del full

    return GatheringSource()


class NoClient:
    """A trainer rank other than 0 holds vLLM's client but never calls it."""

    def __getattr__(self, name):
        raise AssertionError(f"trainer rank > 0 called the client's {name}")


def on_every_rank(*calls):
    """Runs each trainer rank's call at once (each in a thread, as each rank is a process of
    its own); returns each one's result or the exception it raised."""
    out = [None] * len(calls)

    def run(i, call):
        try:
            out[i] = ("ok", call())
        except BaseException as e:  # noqa: BLE001 - returned to the test
            out[i] = ("raised", e)

    threads = [threading.Thread(target=run, args=(i, c), daemon=True) for i, c in enumerate(calls)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=TIMEOUT * 4 + 60)
    assert not any(t.is_alive() for t in threads), "a trainer rank did not return"
    return out


def test_by_default_the_trainer_streams_a_gathering_source_holding_at_most_two_tensors(vllm_tp2):
    # A source that gathers each tensor fresh (FSDP's full_tensor()): by default each is staged
    # into one of two buckets and let go while the next is gathered, never the whole model.
    instance, url = vllm_tp2
    trainer = Trainer(url, "api-tp2-stream")
    liveness = Liveness()
    trainer.source = gathering_source(trainer.model, liveness=liveness)
    engine = trainer.join(ExecutorClient(instance))
    try:
        for seed in (61, 62):
            trainer.step(seed)
            engine.send_weights()
            assert [s["wrong"] for s in states(instance, trainer.shapes, seed)] == [[]] * TP
        assert liveness.yielded == 2 * len(trainer.shapes) > 4
        assert liveness.most <= 2, f"{liveness.most} of {len(trainer.shapes)} yielded tensors alive at once"
    finally:
        engine.shutdown()


def test_trainer_ranks_with_split_owners_each_send_only_theirs_and_the_version_lands(vllm_tp2):
    # ParamMeta.owners splits the model (pipeline stages, a partitioned source): each trainer
    # rank yields only the tensors it owns, and the version still lands whole on both workers.
    instance, url = vllm_tp2
    ranks = [Trainer(url, "api-tp2-owners", rank=r, senders=2) for r in range(2)]
    names = [n for n, _ in ranks[0].shapes]
    half = set(names[: len(names) // 2])

    def owners(name):
        return (0,) if name in half else (1,)

    for r, t in enumerate(ranks):
        t.source = gathering_source(t.model, rank=r, owners=owners)
    joined = on_every_rank(lambda: ranks[0].join(ExecutorClient(instance)), lambda: ranks[1].join(NoClient()))
    assert [j[0] for j in joined] == ["ok", "ok"], joined
    engines = [j[1] for j in joined]
    try:
        from xfer.weights.plan import plan

        for r, engine in enumerate(engines):
            mine = {engine.layout.shards[int(s)][1] for s in plan(engine.layout, sender=r).src_shard}
            assert mine and all(owners(n) == (r,) for n in mine), (r, mine)
        for seed in (71, 72):
            for t in ranks:
                t.step(seed)
                t.source.yielded.clear()
            sent = on_every_rank(engines[0].send_weights, engines[1].send_weights)
            assert sent == [("ok", None)] * 2, sent
            assert ranks[0].source.yielded == [n for n in names if n in half]
            assert ranks[1].source.yielded == [n for n in names if n not in half]
            assert [s["wrong"] for s in states(instance, ranks[0].shapes, seed)] == [[]] * TP
    finally:
        for engine in engines:
            engine.shutdown()


def test_every_trainer_rank_learns_a_version_one_worker_could_not_apply(vllm_tp2):
    # Only rank 0 drives the workers' session and reads their outcomes; a version committed
    # but not applied on one worker must not look applied to the other trainer ranks.
    instance, url = vllm_tp2
    ranks = [Trainer(url, "api-tp2-not-applied-everywhere", rank=r, senders=2, direct=False) for r in range(2)]
    joined = on_every_rank(lambda: ranks[0].join(ExecutorClient(instance)), lambda: ranks[1].join(NoClient()))
    assert [j[0] for j in joined] == ["ok", "ok"], joined
    engines = [j[1] for j in joined]
    try:
        for t in ranks:
            t.step(81)
        assert on_every_rank(engines[0].send_weights, engines[1].send_weights) == [("ok", None)] * 2
        status, armed = instance.ask("rpc", (worker_fail_next_load, (1, len(ranks[0].shapes) // 2), {}))
        assert status == "ok" and armed == [False, True], armed
        for t in ranks:
            t.step(82)
        sent = on_every_rank(engines[0].send_weights, engines[1].send_weights)
        for r, (how, e) in enumerate(sent):
            assert how == "raised" and type(e).__name__ == "VersionNotApplied", (r, sent)
            assert e.version == 2 and set(e.failed) == {1} and "stand-in: worker 1's loader failed" in e.failed[1], (r, e)
        for t in ranks:
            t.step(83)
        assert on_every_rank(engines[0].send_weights, engines[1].send_weights) == [("ok", None)] * 2
        assert [s["wrong"] for s in states(instance, ranks[0].shapes, 83)] == [[]] * TP
    finally:
        for engine in engines:
            engine.shutdown()


def worker_fail_next_trace(wrapper, tensor):
    """Stand-in for a loader the trace cannot run (an op on ids it refuses): this worker's next
    ``load_weights`` raises when it is given checkpoint tensor ``tensor``. Once."""
    model = wrapper.worker.get_model()
    load = model.load_weights

    def fails_at(weights):
        del model.load_weights
        for name, _ in weights:
            if name == tensor:
                raise RuntimeError(f"stand-in: this loader refuses {name}")
        raise AssertionError("the trace never loaded " + tensor)

    model.load_weights = fails_at
    return load is not None


def worker_joined(wrapper):
    engine = wrapper.worker.weight_transfer_engine
    return engine.trace_failure, engine.receiver is not None, engine.slices is not None


def test_a_loader_the_trace_cannot_run_is_refused_by_name_never_received_whole_silently(vllm_tp2):
    # Falling back to whole tensors stages the whole model on every worker; it is the user's
    # choice (direct=False), not something done behind a log line.
    instance, url = vllm_tp2
    tensor = "model.layers.1.mlp.down_proj.weight"
    status, armed = instance.ask("rpc", (worker_fail_next_trace, (tensor,), {}))
    assert status == "ok" and armed == [True, True], armed
    trainer = Trainer(url, "api-tp2-trace-fails")
    client = ExecutorClient(instance)
    with pytest.raises(Exception) as failed:
        trainer.join(client)
    assert type(failed.value).__name__ == "TraceFailed", repr(failed.value)
    assert failed.match(r"receiver 0 could not learn its slices.*'model\.layers\.1\.mlp\.down_proj\.weight'"
                        r".*stand-in: this loader refuses.*direct=False")
    status, joined = instance.ask("rpc", (worker_joined, (), {}))
    assert status == "ok", joined
    for trace_failure, receiving, sliced in joined:
        assert tensor in trace_failure and "stand-in" in trace_failure, joined
        assert not receiving and not sliced, joined
    # Asked for, whole tensors are received (and the next init traces again).
    trainer = Trainer(url, "api-tp2-trace-fails-whole", direct=False)
    engine = trainer.join(ExecutorClient(instance))
    try:
        trainer.step(91)
        engine.send_weights()
        assert [s["wrong"] for s in states(instance, trainer.shapes, 91)] == [[]] * TP
    finally:
        engine.shutdown()


def worker_device(wrapper, device):
    """Stand-in for a device with no memory to spare: the worker engine's device becomes
    ``device`` (``meta``: whatever is made there holds no data); returns the previous one."""
    import torch

    engine = wrapper.worker.weight_transfer_engine
    before = str(engine.device)
    engine.device = torch.device(device)
    return before


def test_the_trace_allocates_nothing_on_the_workers_device(vllm_tp2):
    # The trace runs after vLLM gave the device's spare memory to the KV cache: its int64
    # stand-ins (four times a bf16 model) and ids must be host memory. On a device where
    # nothing made holds data (meta), a trace that used it could not learn a slice.
    instance, url = vllm_tp2
    status, before = instance.ask("rpc", (worker_device, ("meta",), {}))
    assert status == "ok", before
    try:
        trainer = Trainer(url, "api-tp2-trace-on-host")
        engine = trainer.join(ExecutorClient(instance))
        try:
            status, joined = instance.ask("rpc", (worker_joined, (), {}))
            assert status == "ok" and joined == [("", True, True)] * TP, joined
            trainer.step(95)
            engine.send_weights()
            after = states(instance, trainer.shapes, 95)
            assert all(s["whole"] == [] and len(s["boxes"]) == len(trainer.shapes) for s in after), after
            assert [s["wrong"] for s in after] == [[]] * TP, after
        finally:
            engine.shutdown()
    finally:
        assert instance.ask("rpc", (worker_device, (before[0],), {}))[0] == "ok"


def test_a_workers_outcome_is_decoded_strictly():
    # What the trainer reads from a worker's outcome region is a peer's bytes: bounded, typed.
    from xfer.weights.layout import LayoutError
    from xfer.weights.vllm_engine import OUTCOME_BYTES, decode_outcome, encode_outcome

    def region(raw):
        return (raw + bytes(OUTCOME_BYTES))[:OUTCOME_BYTES]

    raw = encode_outcome({"version": 3, "applied": False, "reason": "x" * 10_000, "committed": True})
    assert len(raw) <= OUTCOME_BYTES
    version, applied, reason = decode_outcome(region(raw))
    assert (version, applied) == (3, False) and 0 < len(reason) < 10_000
    for bad in (b"", (5000).to_bytes(4, "little") + b"{}", (0).to_bytes(4, "little"),
                (3).to_bytes(4, "little") + b"abc", (2).to_bytes(4, "little") + b"[]",
                encode_outcome({"version": 1, "applied": True})[:4] + b'{"version": true, "applied": 1, "reason": ""}'):
        with pytest.raises(LayoutError):
            decode_outcome(region(bad) if bad else bad)


def test_rank_zeros_summary_is_decoded_strictly():
    # What a trainer rank reads from rank 0's summary region is a peer's bytes: bounded, typed,
    # receivers in range; reasons cut to fit rather than the summary refused.
    from xfer.weights.layout import LayoutError
    from xfer.weights.vllm_engine import decode_summary, encode_summary

    bound = 4096 * 3
    raw = encode_summary(7, "", {1: "x" * 100_000, 0: "y"}, bound)
    assert len(raw) <= bound
    version, error, failed = decode_summary(raw, 2, bound)
    assert (version, error, set(failed)) == (7, "", {0, 1}) and failed[0] == "y" and len(failed[1]) < 100_000

    def framed(text):
        return len(text).to_bytes(4, "little") + text

    for bad in (b"", framed(b"{}"), (bound).to_bytes(4, "little") + bytes(bound), framed(b"not json"),
                framed(b'{"version": 1, "error": "", "failed": {"2": "x"}}'),
                framed(b'{"version": 1, "error": "", "failed": {"-1": "x"}}'),
                framed('{"version": 1, "error": "", "failed": {"\u00b2": "x"}}'.encode()),
                framed(b'{"version": true, "error": "", "failed": {}}'),
                framed(b'{"version": 1, "error": 0, "failed": {}}'),
                framed(b'{"version": 1, "error": "", "failed": {"0": 1}}'),
                framed(b'{"version": 1, "error": "", "failed": {}, "more": 1}')):
        with pytest.raises(LayoutError):
            decode_summary(bad, 2, bound)

