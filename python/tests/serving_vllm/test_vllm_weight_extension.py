"""xfer's vLLM worker extension (``xfer.vllm_weights.XferWeightsExtension``) the way an RL
framework drives it: vLLM builds its executor from an engine config naming the extension
(``worker_extension_cls``), its ``WorkerWrapperBase`` mixes the extension into vLLM's own
``CPUWorker``, the worker loads a Qwen2 model vLLM constructs itself (a config-only small
checkpoint, ``load_format="dummy"``: fused ``qkv_proj`` and ``gate_up_proj``) with tensor
parallelism 2 (two CPU workers in processes of their own, gloo), and every call goes through
the executor's ``collective_rpc``. A trainer process sends the checkpoint-named (Hugging Face)
tensors; every parameter of each worker's model is then compared with what vLLM's own
``load_weights`` makes of those tensors on that worker (its TP slice, q/k/v and gate/up fused).

Where vLLM stops on this machine: its PyPI wheel has no compiled ops (``vllm._C``), and the
CPU worker's constructor calls one, ``init_cpu_memory_env`` (NUMA memory binding); the rollout
process defines a no-op in its place. Everything else — config, executor, worker wrapper,
distributed init (gloo), model runner, model construction, ``reload_weights`` — is vLLM's
code. Executing the model (KV cache profiling, ``LLM.generate``) needs the kernels and is not
reached; ``LLM.collective_rpc`` is the engine core forwarding to this same executor method."""

import os

os.environ.setdefault("VLLM_TARGET_DEVICE", "cpu")

import multiprocessing as mp

import pytest

pytest.importorskip("vllm")

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
    full_tensor,
    qwen2_config,
    trainer,
    xfer_config,
)

EXTENSION = "xfer.vllm_weights.XferWeightsExtension"
TP = 2
# Run on vLLM's worker (its own process), each a callable through ``collective_rpc``, which
# passes vLLM's ``WorkerWrapperBase`` (it forwards attributes to the worker).


def worker_model_check(worker, shapes, seed):
    """(parameters checked, names not equal to what vLLM's own ``load_weights`` makes of
    version ``seed``'s checkpoint on this worker). The model is left as it was."""
    import torch

    model = worker.get_model()
    now = {n: p.detach().clone() for n, p in model.named_parameters()}
    with torch.no_grad():
        model.load_weights((n, full_tensor(n, s, seed)) for n, s in shapes)
        wrong = [n for n, p in model.named_parameters() if not torch.equal(p.data, now[n])]
        for n, p in model.named_parameters():
            p.data.copy_(now[n])
    return len(now), wrong


def worker_snapshot(worker):
    worker.test_snapshot = {n: p.detach().clone() for n, p in worker.get_model().named_parameters()}
    return len(worker.test_snapshot)


def worker_changed_since_snapshot(worker):
    import torch

    return [n for n, p in worker.get_model().named_parameters() if not torch.equal(p.data, worker.test_snapshot[n])]


def worker_staged(worker, shapes, seed):
    """The names whose bytes in the extension's staging are those of version ``seed``."""
    import torch

    shape = dict(shapes)
    return [n for n, t in worker._xfer_weights.receiver.tensors() if torch.equal(t, full_tensor(n, shape[n], seed))]


def worker_class(wrapper):
    """The class of the worker inside vLLM's ``WorkerWrapperBase`` (what callables get)."""
    from xfer.vllm_weights import XferWeightsExtension

    cls = type(wrapper.worker)
    return f"{cls.__module__}.{cls.__qualname__}", XferWeightsExtension in cls.__bases__, os.getpid()


def rollout(conn, model_dir, plugin_dir):
    """One vLLM instance, as an RL framework's rollout process holds it: vLLM's executor (its
    worker in a process of its own, as vLLM runs on CPU), driven through ``collective_rpc``."""
    import sys

    sys.path.insert(0, plugin_dir)  # the stand-in's entry point; the worker inherits sys.path
    os.environ["VLLM_HOST_IP"] = "127.0.0.1"  # vLLM's own sockets on loopback
    # vLLM binds each CPU worker's threads to a NUMA node of its own by default; this machine
    # has one node for two workers ("nobind": vLLM's setting for binding by hand).
    os.environ["VLLM_CPU_OMP_THREADS_BIND"] = "nobind"
    from vllm.engine.arg_utils import EngineArgs
    from vllm.v1.executor.abstract import Executor

    vllm_config = EngineArgs(
        model=model_dir, load_format="dummy", skip_tokenizer_init=True, enforce_eager=True, dtype="bfloat16",
        max_model_len=256, worker_extension_cls=EXTENSION, tensor_parallel_size=TP, distributed_executor_backend="mp",
    ).create_engine_config()
    executor = Executor.get_class(vllm_config)(vllm_config)  # what vLLM's engine core does
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


@pytest.fixture(scope="module")
def vllm_instance(tmp_path_factory):
    if not plugin_available("efa"):
        pytest.skip("the efa plugin is not in the package (cargo xtask python builds it)")
    model_dir = str(tmp_path_factory.mktemp("qwen2-config-only"))
    qwen2_config().save_pretrained(model_dir)
    # The stand-in for vLLM's missing compiled op, as a vLLM general plugin (entry point).
    plugin_dir = tmp_path_factory.mktemp("plugin")
    dist = plugin_dir / "xfer_test_vllm_cpu_standin-0.dist-info"
    dist.mkdir()
    (dist / "METADATA").write_text("Metadata-Version: 2.1\nName: xfer-test-vllm-cpu-standin\nVersion: 0\n")
    (dist / "entry_points.txt").write_text("[vllm.general_plugins]\ncpu_standin = vllm_cpu_standin:register\n")
    ctx = mp.get_context("spawn")
    server = xfer.Server("127.0.0.1:0")
    instance = Process(ctx, rollout, model_dir, str(plugin_dir))
    try:
        up = instance.answer(STARTUP)
        assert up[0] == "up", up
        yield instance, ctx, server.url, checkpoint_shapes()
    finally:
        instance.close()
        server.close()


class Run:
    """The driver: a trainer process, and the vLLM instance joined to the same group."""

    def __init__(self, vllm_instance, group, provider):
        self.instance, self.ctx, self.url, self.shapes = vllm_instance
        self.group, self.provider = group, provider
        self.trainer = self.start_trainer()
        ranks = self.rpc("xfer_weights_init", kwargs=dict(
            rendezvous=self.url, group=group, receivers=TP, senders=1, config=xfer_config(provider),
            timeout=TIMEOUT, grace=GRACE))
        assert ranks == ("ok", list(range(TP))), ranks

    def start_trainer(self):
        t = Process(self.ctx, trainer, self.url, self.group, self.shapes, self.provider, TP)
        assert t.answer(STARTUP) == "up"
        return t

    def rpc(self, method, args=(), kwargs=None):
        return self.instance.ask("rpc", (method, args, kwargs or {}))

    def check(self, seed):
        """(parameters checked per worker, names on any worker not at version ``seed``)."""
        status, result = self.rpc(worker_model_check, (self.shapes, seed))
        assert status == "ok", result
        checked = {c for c, _ in result}
        assert len(checked) == 1, result
        return checked.pop(), sorted({n for _, wrong in result for n in wrong})

    def version(self, v, seed, *, die=False, misshapen=False):
        """One version: the instance's ``collective_rpc`` and the trainer's send, concurrently."""
        self.instance.conn.send(("rpc", ("xfer_weights_receive", (v,), {})))
        self.trainer.conn.send(("send", (v, seed, die, misshapen)))
        if die:
            self.trainer.proc.join(WAIT)
            assert self.trainer.proc.exitcode == 17, "the trainer meant to die did not"
            sent = None
        else:
            sent = self.trainer.answer()
        return sent, self.instance.answer()

    def close(self):
        self.rpc("xfer_weights_close")
        self.trainer.close()


def assert_loaded(run, got, seed):
    from xfer.vllm_weights import applied_everywhere

    sent, received = got
    assert sent == ("ok", None), sent
    assert received[0] == "ok", received
    assert [o["rank"] for o in received[1]] == list(range(TP)), received
    assert applied_everywhere(received[1])["tensors"] == len(run.shapes), received
    checked, wrong = run.check(seed)
    assert wrong == [], (seed, wrong)
    return checked


def test_vllm_composes_the_extension_into_its_own_worker(vllm_instance):
    instance, _, _, _ = vllm_instance
    status, workers = instance.ask("rpc", (worker_class, (), {}))
    assert status == "ok" and len(workers) == TP, workers
    for name, mixed_in, pid in workers:
        assert name == "vllm.v1.worker.cpu_worker.CPUWorker" and mixed_in
        assert pid != instance.proc.pid  # vLLM's worker processes, not the rollout process itself


@pytest.mark.parametrize("provider", ["shm"])
def test_two_versions_land_in_the_parameters_of_vllms_model(vllm_instance, provider):
    run = Run(vllm_instance, "two-versions", provider)
    try:
        # vLLM's dummy weights are none of the versions': the check can fail.
        checked, wrong = run.check(11)
        assert checked > 0 and len(wrong) == checked, (checked, wrong)
        fused = [n for n in wrong if any(f".{f}." in n for f in FUSED)]
        assert len(fused) == 2 * 3, fused  # qkv_proj's weight and bias, gate_up_proj's weight; 2 layers
        for v, seed in ((1, 11), (2, 12)):
            assert assert_loaded(run, run.version(v, seed), seed) == checked
    finally:
        run.close()


# Over tcp: with libfabric's shm provider a peer that died with operations toward it in flight
# stalls its peers' queues (see docs/weight-sync.md, verl).
@pytest.mark.parametrize("provider", ["tcp;ofi_rxm"])
def test_a_trainer_killed_mid_version_leaves_the_model_untouched_and_the_next_version_lands(vllm_instance, provider):
    run = Run(vllm_instance, "killed-trainer", provider)
    try:
        assert_loaded(run, run.version(1, 21), 21)
        assert run.rpc(worker_snapshot)[0] == "ok"
        # The trainer dies staging its last tensor: earlier rounds' writes have landed in the
        # worker's staging (the trainer waited for them before reusing their bucket).
        _, received = run.version(2, 22, die=True)
        # Every worker answers the version's outcome (none raises through vLLM's executor),
        # and the answers say it by name.
        from xfer.vllm_weights import applied_everywhere
        from xfer.weights import VersionFailed

        assert received[0] == "ok", received
        assert [(o["version"], o["applied"], o["committed"]) for o in received[1]] == [(2, False, False)] * TP, received
        with pytest.raises(VersionFailed, match="weight version 2 failed"):
            applied_everywhere(received[1])
        status, staged = run.rpc(worker_staged, (run.shapes, 22))
        assert status == "ok" and all(0 < len(s) < len(run.shapes) for s in staged), staged
        # … and none of it reached the model.
        assert run.rpc(worker_changed_since_snapshot) == ("ok", [[]] * TP)
        assert run.check(21)[1] == []
        # A new trainer in its place: the next version is complete and loaded.
        run.trainer = run.start_trainer()
        assert_loaded(run, run.version(3, 23), 23)
    finally:
        run.close()


@pytest.mark.parametrize("provider", ["shm"])
def test_a_committed_version_the_workers_cannot_load_is_answered_not_raised_and_the_next_lands(vllm_instance, provider):
    # The trainer's last tensor goes transposed: every rank receives it and the coordinator
    # commits, then vLLM's loader refuses it on both workers. Raised, vLLM's executor would
    # answer with worker 0's failure and leave worker 1's queued, to be read as the answer to
    # the next call; the outcome is answered instead, and the instance takes the next version.
    from xfer.vllm_weights import applied_everywhere
    from xfer.weights.vllm_engine import VersionNotApplied

    run = Run(vllm_instance, "misshapen", provider)
    try:
        assert_loaded(run, run.version(1, 31), 31)
        sent, received = run.version(2, 32, misshapen=True)
        assert sent == ("ok", None), sent
        assert received[0] == "ok", received
        assert [(o["version"], o["rank"], o["applied"], o["committed"]) for o in received[1]] == \
            [(2, r, False, True) for r in range(TP)], received
        assert all("loading the committed version failed" in o["reason"] for o in received[1]), received
        with pytest.raises(VersionNotApplied, match=r"weight version 2 was committed but not applied on 2 worker"):
            applied_everywhere(received[1])
        # The next call answers for itself (nothing queued): every worker's model holds the new
        # version in the layers processed before the refused tensor, and its previous value
        # there (vLLM's reload ended where it stood: nothing left on the meta device) …
        status, workers = run.rpc(worker_class)
        assert status == "ok" and len(workers) == TP, workers
        assert run.check(32)[1] == ["lm_head.weight"]
        # … and the next version lands whole.
        assert_loaded(run, run.version(3, 33), 33)
    finally:
        run.close()


def test_a_receive_that_raises_anything_is_answered_as_the_version_failing():
    # Not only VersionFailed: whatever the receive raises on one worker (a peer's message it
    # cannot decode, a closed receiver) would go through vLLM's executor and leave the other
    # workers' answers queued. Stand-in: the worker's receiver, raising as such a message would
    # make it; no vLLM instance (the outcome is the extension's own).
    from types import SimpleNamespace

    from xfer.vllm_weights import XferWeightsExtension, applied_everywhere
    from xfer.weights import LayoutError, VersionFailed

    class Receiving:
        receiver = SimpleNamespace(rank=3)

        def receive(self, version):
            raise LayoutError("stand-in: a manifest that does not decode")

    worker = SimpleNamespace(rank=0, _xfer_weights=Receiving())
    outcome = XferWeightsExtension.xfer_weights_receive(worker, 5)
    assert (outcome["version"], outcome["rank"], outcome["applied"], outcome["committed"]) == (5, 3, False, False)
    assert outcome["reason"] == "LayoutError: stand-in: a manifest that does not decode", outcome
    with pytest.raises(VersionFailed, match="weight version 5 failed: LayoutError: stand-in"):
        applied_everywhere([outcome])


# ---- the receiver's own resources ----


def rendezvous_connections(server):
    """This process's open connections to ``server`` (the rendezvous clients it holds)."""
    import psutil

    port = int(server.url.rsplit(":", 1)[1])
    return [c for c in psutil.Process().net_connections("tcp")
            if c.raddr and c.raddr.port == port and c.status == psutil.CONN_ESTABLISHED]


@pytest.fixture
def rendezvous_server():
    if not plugin_available("efa"):
        pytest.skip("the efa plugin is not in the package (cargo xtask python builds it)")
    server = xfer.Server("127.0.0.1:0")
    yield server
    server.close()


def test_a_closed_receiver_holds_no_rendezvous_connection(rendezvous_server):
    from xfer.engine_weights import StagedReceiver

    receiver = StagedReceiver(rendezvous=rendezvous_server.url, group="closing", rank=0, receivers=1,
                              config=xfer_config("shm"))
    assert len(rendezvous_connections(rendezvous_server)) == 1
    receiver.close()
    # Closed, though still referenced (a worker's attribute, a module global): re-joining a
    # group many times must not pile up connections.
    assert rendezvous_connections(rendezvous_server) == []
    receiver.close()  # idempotent


def test_a_receiver_whose_leaving_fails_still_closes_its_engine(rendezvous_server):
    from xfer.engine_weights import StagedReceiver

    receiver = StagedReceiver(rendezvous=rendezvous_server.url, group="failing", rank=0, receivers=1,
                              config=xfer_config("shm"))
    engine = receiver.engine

    def fails():
        raise OSError("stand-in: leaving the group failed")

    receiver.receiver.close = fails
    with pytest.raises(OSError, match="leaving the group failed"):
        receiver.close()
    assert engine.closed
    assert rendezvous_connections(rendezvous_server) == []


def test_a_worker_without_a_rank_is_refused_by_name(rendezvous_server):
    # vLLM's workers have one (the running tests get it back from xfer_weights_init); an object
    # without one would otherwise join as rank 0 — a second receiver 0 fails the whole version.
    from xfer.vllm_weights import WorkerRankError, XferWeightsExtension

    class RanklessWorker:
        pass

    worker = RanklessWorker()
    with pytest.raises(WorkerRankError, match="has no rank"):
        XferWeightsExtension.xfer_weights_init(worker, rendezvous=rendezvous_server.url, group="rankless",
                                               receivers=2, config=xfer_config("shm"))
    assert getattr(worker, "_xfer_weights", None) is None, "nothing joined"
    assert rendezvous_connections(rendezvous_server) == []


def test_data_parallel_replicas_workers_get_distinct_receiver_ranks(rendezvous_server):
    # vLLM numbers each DP engine's workers from 0 (Worker.rank), with the DP index in its
    # ParallelConfig: DP 2 x TP 2 is four receivers, not two claimed twice each.
    from vllm.config import ParallelConfig

    from xfer.vllm_weights import XferWeightsExtension

    class Worker:  # what the extension reads of vLLM's worker: its rank and parallel config
        def __init__(self, rank, dp):
            self.rank = rank
            self.parallel_config = ParallelConfig(tensor_parallel_size=2, data_parallel_size=2, data_parallel_rank=dp)

    workers = [Worker(r, dp) for dp in range(2) for r in range(2)]
    try:
        ranks = [XferWeightsExtension.xfer_weights_init(w, rendezvous=rendezvous_server.url, group="dp",
                                                        receivers=14, rank_base=10, config=xfer_config("shm"))
                 for w in workers]
        assert ranks == [10, 11, 12, 13]
    finally:
        for w in workers:
            XferWeightsExtension.xfer_weights_close(w)


def test_without_a_config_the_extension_refuses_to_join(rendezvous_server, monkeypatch):
    # No config and no $XFER_CONFIG: refused by name (verl's engine does the same), never the
    # in-process mock, which would join the group and then receive nothing from another host.
    from vllm.config import ParallelConfig

    from xfer.vllm_weights import XferWeightsExtension

    class Worker:  # what the extension reads of vLLM's worker: its rank and parallel config
        rank = 0
        parallel_config = ParallelConfig(tensor_parallel_size=1)

    monkeypatch.delenv("XFER_CONFIG", raising=False)
    worker = Worker()
    with pytest.raises(ValueError, match="xfer_weights_init: no xfer config.*XFER_CONFIG"):
        XferWeightsExtension.xfer_weights_init(worker, rendezvous=rendezvous_server.url, group="no-config",
                                               receivers=1)
    assert getattr(worker, "_xfer_weights", None) is None, "nothing joined"
    assert rendezvous_connections(rendezvous_server) == []
