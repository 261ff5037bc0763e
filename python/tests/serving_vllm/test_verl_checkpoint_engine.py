"""xfer as verl's checkpoint engine, through verl's own registry, out-of-tree loading
(``import_external_libs``, what ``custom_backend_module`` does) and the call sequence of its
``CheckpointEngineManager`` (prepare on every rank, ``build_topology`` on the driver,
``init_process_group``, ``send_weights`` and ``receive_weights`` concurrently, ``finalize``):
a trainer group and a rollout group, each rank its own process, over libfabric's shm and tcp
providers. The model is Qwen2's architecture at a small config (its real parameter names and
shapes, random bf16 values). Trainer ranks with TP 2 yield DTensors sharded as Megatron shards
them (columns for q/k/v/gate/up and the embeddings, rows for o/down, norms replicated); every
rollout worker checks each received tensor against the trainer's full tensor.

The control: verl's own ``nixl`` engine (NIXL 1.5.1 on UCX, ``device="cpu"``) through the same
harness, its trainers yielding full tensors as verl's other engines expect. On a machine
without a GPU it needs three things of its process (``nixl_on_cpu``): ``cupy`` importable (it
imports it at load; ``cupy-cuda12x`` imports without a GPU), ``torch.zeros(pin_memory=True)``
unpinned (its ``prepare`` pins its buckets, which needs a CUDA driver) and
``torch.cuda.synchronize`` a no-op (it orders its bucket copies with it; CPU copies are
synchronous); and ray's node address pinned to 127.0.0.1 (its ZeroMQ side channel binds
there)."""

import os

os.environ.setdefault("VLLM_TARGET_DEVICE", "cpu")

import multiprocessing as mp
import socket
import zlib

import pytest

pytest.importorskip("verl.checkpoint_engine.base")

import xfer  # noqa: E402
from conftest import plugin_available  # noqa: E402
from weight_sync_checkpoint import xfer_config  # noqa: E402

PROVIDERS = ["shm", "tcp;ofi_rxm"]
TIMEOUT = 12.0  # seconds a version may take; a failed one fails everywhere within ~2x this
WAIT = 120.0  # the test's own bound on any rank's answer
STARTUP = 900.0  # … and on a process importing torch, transformers and verl (minutes on a busy two-core machine)


def model_shapes():
    """Qwen2's parameters at a small config, from transformers' own model class (on the meta device)."""
    import torch
    from transformers import AutoModelForCausalLM, Qwen2Config

    cfg = Qwen2Config(hidden_size=128, intermediate_size=256, num_hidden_layers=2, num_attention_heads=4,
                      num_key_value_heads=2, vocab_size=512, tie_word_embeddings=False)
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(cfg)
    return [(n, tuple(p.shape)) for n, p in model.named_parameters()]


def full_tensor(name, shape, seed):
    import torch

    gen = torch.Generator().manual_seed(zlib.crc32(f"{seed}:{name}".encode()))
    return torch.randn(shape, generator=gen).to(torch.bfloat16)


def tp_dim(name, shape):
    """Megatron's split: column-parallel and vocab-parallel on dim 0, row-parallel on dim 1."""
    if len(shape) == 2 and any(k in name for k in ("o_proj", "down_proj")):
        return 1
    if any(k in name for k in ("q_proj", "k_proj", "v_proj", "gate_proj", "up_proj", "embed_tokens", "lm_head")):
        return 0
    return None  # norms: replicated


def nixl_on_cpu(ucx_tls):
    """What verl's nixl engine needs of a process without a GPU (see the module's docstring)."""
    import ray.util
    import torch

    os.environ["UCX_NET_DEVICES"] = "lo"
    if ucx_tls:
        os.environ["UCX_TLS"] = ucx_tls
    if not torch.cuda.is_available():
        zeros = torch.zeros

        def unpinned_zeros(*args, pin_memory=False, **kwargs):
            return zeros(*args, **kwargs)

        torch.zeros = unpinned_zeros
        torch.cuda.synchronize = lambda *args, **kwargs: None
    ray.util.get_node_ip_address = lambda *args, **kwargs: "127.0.0.1"
    import verl.checkpoint_engine.nixl_checkpoint_engine  # noqa: F401 - registers "nixl"


def member(kind, rank, trainers, conn, shapes, provider, pg_port, backend="xfer"):
    """One process: a trainer rank or a rollout worker, answering the driver's commands."""
    import asyncio

    import torch
    from verl.checkpoint_engine import CheckpointEngineRegistry
    from verl.utils.import_utils import import_external_libs

    if backend == "nixl":
        nixl_on_cpu(provider)
        engine = CheckpointEngineRegistry.new(
            "nixl", bucket_size=64 << 10, device="cpu", is_master=(kind == "trainer" and rank == 0)
        )
    else:
        import_external_libs("xfer.verl")  # what rollout.checkpoint_engine.custom_backend_module does
        engine = CheckpointEngineRegistry.new(
            "xfer", bucket_size=64 << 10, is_master=(kind == "trainer" and rank == 0),
            config=xfer_config(provider), timeout=TIMEOUT, listen="127.0.0.1:0",  # one machine: no secret
        )
    mesh = None
    if kind == "trainer" and trainers > 1 and backend == "xfer":
        import torch.distributed as dist
        from torch.distributed.device_mesh import init_device_mesh

        dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{pg_port}", rank=rank, world_size=trainers)
        mesh = init_device_mesh("cpu", (trainers,))

    def weights(seed):
        from torch.distributed.tensor import DTensor, Replicate, Shard

        for name, shape in shapes:
            t = full_tensor(name, shape, seed)
            if mesh is None:
                yield name, t
                continue
            d = tp_dim(name, shape)
            if d is None:
                yield name, DTensor.from_local(t, mesh, [Replicate()], run_check=False)
            else:
                local = t.chunk(trainers, dim=d)[rank].contiguous()
                yield name, DTensor.from_local(local, mesh, [Shard(d)], run_check=False, shape=t.shape, stride=t.stride())

    async def receive(seed):
        checked, wrong = 0, []
        async for name, t in engine.receive_weights():
            want = full_tensor(name, dict(shapes)[name], seed)
            checked += 1
            if t.dtype != want.dtype or tuple(t.shape) != tuple(want.shape) or not torch.equal(t, want):
                wrong.append(name)
        return checked, wrong

    conn.send("up")
    while True:
        cmd, arg = conn.recv()
        try:
            if cmd == "prepare":
                conn.send(engine.prepare())
            elif cmd == "init":
                engine.init_process_group(**arg)
                conn.send("ok")
            elif cmd == "send":
                asyncio.run(engine.send_weights(weights(arg)))
                conn.send(("ok", None))
            elif cmd == "receive":
                seed, die = arg
                if die:
                    dies_in_the_middle(engine)
                conn.send(("ok", asyncio.run(receive(seed))))
            elif cmd == "finalize":
                engine.finalize()
                conn.send("ok")
            elif cmd == "exit":
                if backend == "nixl":
                    os._exit(0)  # NIXL 1.5.1's bundled libnl faults in its destructor at exit (conftest)
                return
        except Exception as e:  # noqa: BLE001 - the driver asserts on it
            conn.send(("failed", f"{type(e).__name__}: {e}"))


def dies_in_the_middle(engine):
    """This rollout worker's process ends once its data is on its way (it told the trainers it
    is ready and waits for the arrivals), as a worker killed mid-version would."""
    receiver = engine._member
    real = receiver.engine

    class Dying:
        def __getattr__(self, name):
            return getattr(real, name)

        def expect_imm_count(self, *args, **kwargs):
            real.expect_imm_count(*args, **kwargs)

            class Expectation:
                def __getattr__(self, name):  # whatever the receiver asks of it: wait, done, ...
                    os._exit(17)

            return Expectation()

    receiver.engine = Dying()


class Group:
    """The driver's side: the processes, and verl's CheckpointEngineManager call sequence."""

    def __init__(self, trainers, rollouts, provider, backend="xfer"):
        self.ctx = mp.get_context("spawn")
        self.backend = backend
        self.shapes = model_shapes()
        self.provider = provider
        self.trainers = trainers
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            self.pg_port = s.getsockname()[1]
        self.procs = [self.spawn("trainer", r) for r in range(trainers)] + [self.spawn("rollout", r) for r in range(rollouts)]
        for i in range(len(self.procs)):  # all started first: the trainers' gloo group needs them all
            self.started(i)

    def spawn(self, kind, rank):
        here, there = self.ctx.Pipe()
        p = self.ctx.Process(target=member, args=(kind, rank, self.trainers, there, self.shapes, self.provider, self.pg_port, self.backend))
        p.start()
        return [p, here]

    def started(self, i):
        conn = self.procs[i][1]
        if not conn.poll(STARTUP):
            raise AssertionError(f"process {i} did not start in {STARTUP} s")
        assert conn.recv() == "up"

    def ask(self, i, cmd, arg=None):
        self.procs[i][1].send((cmd, arg))

    def answer(self, i):
        p, conn = self.procs[i]
        if not conn.poll(WAIT):
            raise AssertionError(f"process {i} did not answer in {WAIT} s")
        return conn.recv()

    def step(self, seed, *, die=None):
        """One verl weight update; returns the rollout workers' answers (None for one that died)."""
        from verl.checkpoint_engine import CheckpointEngineRegistry
        from verl.utils.import_utils import import_external_libs

        import_external_libs("xfer.verl")  # as CheckpointEngineManager does with custom_backend_module
        if self.backend == "nixl":
            nixl_on_cpu(self.provider)
        n = len(self.procs)
        for i in range(n):
            self.ask(i, "prepare")
        metadata = [self.answer(i) for i in range(n)]
        actor, rollout = CheckpointEngineRegistry.get(self.backend).build_topology(self.trainers, n - self.trainers, metadata)
        for i in range(n):
            kw = actor if i < self.trainers else rollout
            j = i if i < self.trainers else i - self.trainers
            self.ask(i, "init", {k: v[j] for k, v in kw.items() if k != "method"})
        assert all(self.answer(i) == "ok" for i in range(n))
        for i in range(n):
            if i < self.trainers:
                self.ask(i, "send", seed)
            else:
                self.ask(i, "receive", (seed, die == i - self.trainers))
        sent, received = [], []
        for i in range(n):
            if die is not None and i == self.trainers + die:
                self.procs[i][0].join(WAIT)
                assert self.procs[i][0].exitcode == 17, "the rollout worker meant to die did not"
                received.append(None)
                continue
            (sent if i < self.trainers else received).append(self.answer(i))
        if die is None:
            for i in range(n):
                self.ask(i, "finalize")
            assert all(self.answer(i) == "ok" for i in range(n))
        return sent, received

    def respawn_rollout(self, r):
        self.procs[self.trainers + r] = self.spawn("rollout", r)
        self.started(self.trainers + r)

    def close(self):
        for p, conn in self.procs:
            if p.is_alive():
                try:
                    conn.send(("exit", None))
                except OSError:
                    pass
        for p, _ in self.procs:
            p.join(30)
            if p.is_alive():
                p.kill()


def needs(provider):
    if not plugin_available("efa"):
        pytest.skip("the efa plugin is not in the package (cargo xtask python builds it)")


def assert_complete(group, sent, received, seed):
    assert all(s == ("ok", None) for s in sent), sent
    for r, ans in enumerate(received):
        assert ans[0] == "ok", (r, ans)
        checked, wrong = ans[1]
        assert checked == len(group.shapes) and wrong == [], (r, seed, checked, wrong)


@pytest.mark.parametrize("provider", PROVIDERS[:1])
def test_two_tp_trainers_to_two_rollouts(provider):
    needs(provider)
    g = Group(2, 2, provider)
    try:
        for seed in (1, 2, 3):
            sent, received = g.step(seed)
            assert_complete(g, sent, received, seed)
    finally:
        g.close()


# Over tcp: with libfabric's shm provider, a peer that died with operations toward it in flight
# stalls the sender's queue for every peer (seen with xfer.weights directly, no verl: the next
# version's writes to live peers do not complete either); tcp fails those operations alone.
@pytest.mark.parametrize("provider", PROVIDERS[1:])
def test_a_rollout_worker_killed_mid_version_fails_it_everywhere_and_the_next_succeeds(provider):
    needs(provider)
    g = Group(2, 2, provider)
    try:
        sent, received = g.step(1)
        assert_complete(g, sent, received, 1)
        # Rollout worker 1 dies with version 2 in flight: every other rank fails version 2 …
        sent, received = g.step(2, die=1)
        assert all(s[0] == "failed" and "VersionFailed" in s[1] for s in sent), sent
        assert received[0][0] == "failed" and "VersionFailed" in received[0][1], received
        # … and with a new worker in its place, the next version is complete everywhere.
        g.respawn_rollout(1)
        sent, received = g.step(3)
        assert_complete(g, sent, received, 3)
    finally:
        g.close()


@pytest.mark.parametrize("provider", PROVIDERS[1:])
def test_one_trainer_to_four_rollouts(provider):
    needs(provider)
    g = Group(1, 4, provider)
    try:
        for seed in (5, 6, 7):
            sent, received = g.step(seed)
            assert_complete(g, sent, received, seed)
    finally:
        g.close()


# verl's build_topology for nixl gives a single rollout worker itself as its next agent
# (``metadata[-rollout_world_size + 1:]`` is the whole list when that size is 1): the control
# runs with two rollout workers or more.
@pytest.mark.parametrize("trainers,rollouts", [(2, 2), (1, 3)])
def test_control_verls_nixl_engine_through_the_same_harness(trainers, rollouts):
    pytest.importorskip("cupy")
    pytest.importorskip("nixl")
    g = Group(trainers, rollouts, "tcp,self", backend="nixl")
    try:
        for seed in (1, 2):
            sent, received = g.step(seed)
            assert_complete(g, sent, received, seed)
    finally:
        g.close()
