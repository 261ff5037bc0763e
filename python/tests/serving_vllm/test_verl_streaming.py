"""xfer as verl's checkpoint engine, in one process (threads, the mock fabric), through verl's
registry (``import_external_libs`` as ``custom_backend_module`` does) and the call sequence of
its ``CheckpointEngineManager.update_weights``: ``prepare`` on every rank, ``build_topology``,
``init_process_group``, ``send_weights`` (a streaming generator of full tensors, as verl's
FSDP engine yields them) concurrently with ``receive_weights``, ``finalize``; rollout
membership changing between steps on the same engine objects (1 -> 2 -> 1 workers, as
``add_replicas`` / ``remove_replicas`` and the per-step rebuild do).

What is counted: how many tensors the generator yielded are alive at once (weak references,
not the engine's own account) — the engine must stream through its two buckets, not gather
the model; and every rollout worker's tensors against the trainer's.

Then verl's vLLM rollout around ``receive_weights``: verl's ``CheckpointEngineWorker.update_weights``,
its vLLM ``ServerAdapter`` (ZeroMQ buckets) and, in a thread standing for the vLLM worker
process, verl's ``vLLMColocateWorkerExtension.update_weights_from_ipc`` loading into a stand-in
model: a failed version and a tensor larger than the bucket must end that exchange on both
ends (stand-ins listed at each)."""

import asyncio
import os
import threading
import weakref
import zlib

import pytest

pytest.importorskip("verl.checkpoint_engine.base")

import torch  # noqa: E402

MOCK = {"backend": "mock", "groups": [{"nics": ["mock0", "mock1"]}], "backends": {"mock": {"seed": 3, "reorder": True}}}
TENSORS = [(f"layers.{i}.w", (256, 1024)) for i in range(24)]  # 24 x 1 MiB (float32)
BUCKET = 2 << 20


def full(name, shape, seed):
    gen = torch.Generator().manual_seed(zlib.crc32(f"{seed}:{name}".encode()))
    return torch.randn(shape, generator=gen)


class Liveness:
    """Counts the generator's tensors still alive at each yield."""

    def __init__(self):
        self.alive = 0
        self.most = 0
        self.lock = threading.Lock()

    def _gone(self):
        with self.lock:
            self.alive -= 1

    def track(self, t):
        with self.lock:
            self.alive += 1
            self.most = max(self.most, self.alive)
        weakref.finalize(t, self._gone)
        return t


async def stream(seed, live):
    """verl's per-tensor generator: each full tensor made (gathered) only when asked for."""
    for name, shape in TENSORS:
        yield name, live.track(full(name, shape, seed))
        await asyncio.sleep(0)


def new_engine(is_master, **kwargs):
    from verl.checkpoint_engine import CheckpointEngineRegistry
    from verl.utils.import_utils import import_external_libs

    import_external_libs("xfer.verl")  # what rollout.checkpoint_engine.custom_backend_module does
    kwargs.setdefault("config", MOCK)
    kwargs.setdefault("listen", "127.0.0.1:0")
    return CheckpointEngineRegistry.new("xfer", bucket_size=BUCKET, is_master=is_master, timeout=60.0, **kwargs)


def step(trainers, rollouts, seed):
    """CheckpointEngineManager.update_weights' sequence; returns the trainers' liveness and
    each rollout worker's received tensors (or exceptions)."""
    from verl.checkpoint_engine import CheckpointEngineRegistry

    everyone = trainers + rollouts
    metadata = [e.prepare() for e in everyone]
    actor_kw, rollout_kw = CheckpointEngineRegistry.get("xfer").build_topology(len(trainers), len(rollouts), metadata)
    for group, kw in ((trainers, actor_kw), (rollouts, rollout_kw)):
        for i, e in enumerate(group):
            e.init_process_group(**{k: v[i] for k, v in kw.items()})
    lives = [Liveness() for _ in trainers]
    results = {}

    def send(i):
        try:
            asyncio.run(trainers[i].send_weights(stream(seed, lives[i])))
            results[("t", i)] = None
        except Exception as e:  # noqa: BLE001
            results[("t", i)] = e

    def receive(i):
        async def collect():
            return {n: t.clone() async for n, t in rollouts[i].receive_weights()}

        try:
            results[("r", i)] = asyncio.run(collect())
        except Exception as e:  # noqa: BLE001
            results[("r", i)] = e

    threads = [threading.Thread(target=send, args=(i,)) for i in range(len(trainers))]
    threads += [threading.Thread(target=receive, args=(i,)) for i in range(len(rollouts))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(300)
        assert not t.is_alive(), "a rank did not return"
    for e in everyone:
        e.finalize()
    return lives, results


def check(results, rollouts, seed):
    for i in range(rollouts):
        got = results[("r", i)]
        assert isinstance(got, dict), (i, got)
        assert list(got) == [n for n, _ in TENSORS]
        for name, shape in TENSORS:
            assert torch.equal(got[name], full(name, shape, seed)), (i, name)


def test_send_weights_streams_through_two_buckets_across_membership_changes():
    trainers = [new_engine(True), new_engine(False)]
    rollouts = [new_engine(False), new_engine(False)]
    try:
        for seed, n in ((1, 1), (2, 2), (3, 2), (4, 1), (5, 1)):
            lives, results = step(trainers, rollouts[:n], seed)
            assert all(results[("t", i)] is None for i in range(2)), results
            check(results, n, seed)
            # Never more than the tensor being gathered and the one being staged: the model
            # (24 tensors) is never held, on the first step (layout learned) nor later.
            assert max(live.most for live in lives) <= 2, [live.most for live in lives]
            # The layout goes to each rollout worker once per membership (a membership change
            # makes new members, which have no layout), not once per step.
            assert trainers[0]._member.manifests_sent == n, (seed, trainers[0]._member.manifests_sent)
    finally:
        for e in trainers + rollouts:
            if e._member is not None:
                e._member.close()
            if e.engine is not None:
                e.engine.close()
        if trainers[0]._server is not None:
            trainers[0]._server.close()


def test_a_step_whose_tensors_changed_fails_everywhere_and_the_next_learns_them():
    trainers = [new_engine(True)]
    rollouts = [new_engine(False)]
    try:
        _, results = step(trainers, rollouts, 1)
        check(results, 1, 1)
        TENSORS.append(("extra.bias", (1024,)))
        try:
            _, results = step(trainers, rollouts, 2)
            assert all(isinstance(e, Exception) for e in results.values()), results
            assert "learned layout" in str(results[("t", 0)]), results
            _, results = step(trainers, rollouts, 3)
            check(results, 1, 3)
        finally:
            TENSORS.pop()
    finally:
        for e in trainers + rollouts:
            if e._member is not None:
                e._member.close()
            e.engine.close()
        trainers[0]._server.close()


def test_defaults_refuse_a_silent_mock_and_an_open_service_without_the_secret(monkeypatch, tmp_path):
    from xfer.verl import default_listen

    monkeypatch.delenv("XFER_CONFIG", raising=False)
    monkeypatch.delenv("XFER_SECRET_FILE", raising=False)
    with pytest.raises(ValueError, match="no xfer config"):
        new_engine(True, config=None)
    # The service's default address is this host's routable one (or $XFER_WEIGHTS_LISTEN).
    monkeypatch.setenv("XFER_WEIGHTS_LISTEN", "192.0.2.7:7000")
    assert default_listen() == "192.0.2.7:7000"
    monkeypatch.delenv("XFER_WEIGHTS_LISTEN")
    listen = default_listen()
    if listen.startswith("127."):
        pytest.skip("this host has no routable address")
    with pytest.raises(ValueError, match="XFER_SECRET_FILE"):
        new_engine(True, listen=None)
    secret = tmp_path / "secret"
    secret.write_bytes(os.urandom(32))
    secret.chmod(0o600)
    monkeypatch.setenv("XFER_SECRET_FILE", str(secret))
    engine = new_engine(True, listen=None)
    try:
        meta = engine.prepare()
        assert meta["url"].startswith(f"xfer://{listen.rsplit(':', 1)[0]}:")
    finally:
        engine.engine.close()
        engine._server.close()


def test_the_service_and_every_member_take_the_secret_and_etcd_settings_of_the_engine_config(
        monkeypatch, tmp_path, rendezvous_dials):
    """Issue 56 M5: the cluster secret and etcd's TLS named only in the engine config (no
    ``$XFER_SECRET_FILE``): the master's service admits only holders of the secret, every
    member's rendezvous client is made with all the settings, and a step lands."""
    import xfer

    for name in ("XFER_SECRET_FILE", "XFER_ETCD_CA_FILE"):
        monkeypatch.delenv(name, raising=False)
    secret = tmp_path / "secret"
    secret.write_bytes(os.urandom(32))
    secret.chmod(0o600)
    settings = {"etcd_ca_file": str(tmp_path / "ca.pem")}
    config = {**MOCK, "security": {"secret_file": str(secret)}, "rendezvous": settings}
    dialled = rendezvous_dials
    trainers, rollouts = [new_engine(True, config=config)], [new_engine(False, config=config)]
    try:
        _, results = step(trainers, rollouts, 1)
        check(results, 1, 1)
        assert len(dialled) == 2, dialled
        for _, options in dialled:
            assert options.get("secret_file") == str(secret) and options.get("etcd_ca_file") == settings["etcd_ca_file"]
        with pytest.raises(xfer.RendezvousError, match="authentication failed"):
            dialled.real(trainers[0]._server.url, connect_timeout=2)
    finally:
        for e in trainers + rollouts:
            if e._member is not None:
                e._member.close()
            e.engine.close()
        trainers[0]._server.close()


def test_a_password_without_tls_is_refused_by_name_when_the_engine_is_made(monkeypatch, tmp_path):
    """Issue 56 M5: etcd's user and password without TLS are refused when verl makes the
    checkpoint engine, naming the settings."""
    import xfer

    password = tmp_path / "password"
    password.write_text("pw\n")
    password.chmod(0o600)
    monkeypatch.delenv("XFER_ETCD_CA_FILE", raising=False)
    monkeypatch.setenv("XFER_ETCD_USER", "xfer")
    monkeypatch.setenv("XFER_ETCD_PASSWORD_FILE", str(password))
    with pytest.raises(xfer.ConfigError,
                       match=r"XferCheckpointEngine: .*etcd_password_file \(\$XFER_ETCD_PASSWORD_FILE\).*cleartext"):
        new_engine(False)


# ---- verl's vLLM rollout: its server adapter and its vLLM-side receiver around receive_weights ----
#
# On a rollout worker verl calls ``CheckpointEngineWorker.update_weights``: it takes
# ``receive_weights()`` and hands it to its vLLM ``ServerAdapter.update_weights``, which starts
# ``update_weights_from_ipc`` on the vLLM worker (``collective_rpc``, not waited for), then
# streams the tensors to it through ZeroMQ buckets (``BucketedWeightSender``); the vLLM worker
# (verl's ``vLLMColocateWorkerExtension``) receives them (``BucketedWeightReceiver``, a blocking
# ``recv_pyobj`` until ``is_last``) and loads each bucket through ``model.load_weights``. All of
# it is verl's code here; the stand-ins are listed where they are made.


class CpuPlatform:
    """verl's accelerator platform on this machine (no GPU): verl would fall back to its CUDA
    platform and fail in ``torch.cuda.synchronize``. Device "cpu", nothing to synchronise, no
    CUDA IPC — verl's adapter then uses its shared-memory buckets (``use_shm``), as it does on
    platforms without IPC. Installed through verl's own platform singleton."""

    device_name = "cpu"

    class device_module:  # what verl's transfer calls on the device module
        synchronize = ipc_collect = empty_cache = staticmethod(lambda *args, **kwargs: None)
        is_available = staticmethod(lambda: False)

    def current_device(self):
        return 0

    def synchronize(self, device_index=None):
        pass

    def empty_cache(self):
        pass

    def is_ipc_supported(self):
        return False


class StandinModel(torch.nn.Module):
    """vLLM's model as verl's receiver uses it: ``load_weights`` by checkpoint name, refusing
    an unknown name or another shape as vLLM's default loader does."""

    def __init__(self, shapes):
        super().__init__()
        self.model = torch.nn.Module()  # vLLM's models keep their layers here (verl's MoE patch looks)
        self.held = {name: torch.zeros(shape) for name, shape in shapes}

    def load_weights(self, weights):
        loaded = set()
        for name, t in weights:
            param = self.held[name]
            assert param.shape == t.shape, (name, param.shape, t.shape)
            param.copy_(t)
            loaded.add(name)
        return loaded


def vllm_worker(shapes):
    """vLLM's worker with verl's extension mixed in (as vLLM's ``worker_extension_cls`` makes
    it). Stand-ins: the worker's attributes verl's extension reads (device, local rank, a model
    runner holding the model and an unquantised config) and the model; verl's ``__new__`` is
    skipped (it patches vLLM process-wide for LoRA and sets a parent-death signal) and its two
    QAT flags set as it sets them for an unquantised model."""
    from types import SimpleNamespace

    from verl.workers.rollout.vllm_rollout.utils import vLLMColocateWorkerExtension

    class Worker(vLLMColocateWorkerExtension):
        def __new__(cls):
            return object.__new__(cls)

    worker = Worker()
    worker._is_qat_model = worker._is_modelopt_qat = False
    worker.device, worker.local_rank = None, 0
    model_config = SimpleNamespace(word_embeddings_untied_by_checkpoint=False, dtype=torch.float32, quantization=None)
    worker.model_runner = SimpleNamespace(model=StandinModel(shapes), vllm_config=SimpleNamespace(
        speculative_config=None, parallel_config=None, quant_config=None, model_config=model_config))
    return worker


class ServerHandle:
    """The vLLM server actor's handle as verl's adapter calls it (``.remote`` returning an
    awaitable): ``collective_rpc`` runs the method on the one worker in a thread of its own (a
    vLLM worker process), ``clear_kv_cache`` and ``set_global_steps`` are recorded."""

    class _Method:
        def __init__(self, fn):
            self.remote = fn

    def __init__(self, worker):
        self.worker, self.calls, self.threads = worker, [], []
        self.collective_rpc = self._Method(self._collective_rpc)
        self.clear_kv_cache = self._Method(lambda: self._record("clear_kv_cache"))
        self.set_global_steps = self._Method(lambda steps: self._record(("set_global_steps", steps)))

    def _collective_rpc(self, method, timeout=None, args=(), kwargs=None):
        import concurrent.futures

        self.calls.append(method)
        answer = concurrent.futures.Future()

        def run():
            try:
                answer.set_result(getattr(self.worker, method)(*args, **(kwargs or {})))
            except BaseException as e:  # noqa: BLE001 - the answer the adapter awaits
                answer.set_exception(e)

        t = threading.Thread(target=run, name=f"vllm-worker-{method}", daemon=True)
        t.start()
        self.threads.append(t)
        return asyncio.wrap_future(answer)

    def _record(self, what):
        self.calls.append(what)
        done = asyncio.get_running_loop().create_future()
        done.set_result(None)
        return done

    def unblock(self, zmq_handle):
        """Ends a vLLM worker left in ``recv_pyobj`` (the hang the test detects) with the
        ``is_last`` its sender never sent, so that the test ends."""
        import zmq

        sock = zmq.Context.instance().socket(zmq.REQ)
        sock.setsockopt(zmq.LINGER, 0)
        sock.bind(zmq_handle)
        try:
            sock.send_pyobj({"bucket_meta": {}, "is_last": True})
            for t in self.threads:
                t.join(30)
        finally:
            sock.close()


def rollout_worker(engine, worker, bucket):
    """verl's rollout worker as ``CheckpointEngineWorker.update_weights`` sees it: the
    checkpoint engine and verl's vLLM ``ServerAdapter``. Stand-ins: the adapter is made without
    its ``__init__`` (which reads Ray's runtime context and ``RANK`` to name its socket and find
    the server actor): its socket is the one the vLLM worker computes, its server handle the
    stand-in above, its bucket verl's ``update_weights_bucket_megabytes`` (the engine's
    ``bucket_size``)."""
    from types import SimpleNamespace

    from verl.utils.device import is_support_ipc
    from verl.workers.rollout.vllm_rollout.vllm_rollout import ServerAdapter

    adapter = object.__new__(ServerAdapter)
    adapter.config = SimpleNamespace(checkpoint_engine=SimpleNamespace(update_weights_bucket_megabytes=bucket >> 20))
    adapter.server_handle = ServerHandle(worker)
    adapter._has_server = True
    adapter.replica_rank = adapter.rollout_rank = 0
    adapter.zmq_handle = worker._get_zmq_handle()
    adapter.use_shm = not is_support_ipc()
    return SimpleNamespace(checkpoint_engine=engine, server_adapter=adapter)


@pytest.fixture
def verl_vllm_side(monkeypatch):
    """verl's platform on this machine (``CpuPlatform``) and a socket name of this test's own."""
    import verl.plugin.platform.platform_manager as platforms

    monkeypatch.setattr(platforms, "_current_platform", CpuPlatform())
    monkeypatch.setenv("VERL_RAY_JOB_ID", f"xfer-test-{os.getpid()}")


async def failing_stream(seed, live, at):
    """A trainer rank whose gather fails at tensor ``at`` (the version fails everywhere)."""
    async for i, (name, t) in _enumerate(stream(seed, live)):
        if i == at:
            raise RuntimeError("stand-in: the trainer rank's gather failed")
        yield name, t


async def _enumerate(items):
    i = 0
    async for item in items:
        yield i, item
        i += 1


def rollout_step(trainers, rollouts, seed, weights=None):
    """CheckpointEngineManager.update_weights' sequence with verl's own rollout worker method
    (``CheckpointEngineWorker.update_weights``) on each rollout; returns the trainers' and
    rollouts' outcomes (None or the exception) and the vLLM worker threads left running."""
    from verl.checkpoint_engine import CheckpointEngineRegistry
    from verl.checkpoint_engine.base import CheckpointEngineWorker

    everyone = trainers + [r.checkpoint_engine for r in rollouts]
    metadata = [e.prepare() for e in everyone]
    actor_kw, rollout_kw = CheckpointEngineRegistry.get("xfer").build_topology(len(trainers), len(rollouts), metadata)
    for group, kw in ((trainers, actor_kw), ([r.checkpoint_engine for r in rollouts], rollout_kw)):
        for i, e in enumerate(group):
            e.init_process_group(**{k: v[i] for k, v in kw.items()})
    results = {}

    def send(i):
        try:
            asyncio.run(trainers[i].send_weights((weights or stream)(seed, Liveness())))
            results[("t", i)] = None
        except Exception as e:  # noqa: BLE001
            results[("t", i)] = e

    def update(i):
        try:
            asyncio.run(CheckpointEngineWorker.update_weights(rollouts[i], global_steps=seed))
            results[("r", i)] = None
        except Exception as e:  # noqa: BLE001
            results[("r", i)] = e

    threads = [threading.Thread(target=send, args=(i,), daemon=True) for i in range(len(trainers))]
    threads += [threading.Thread(target=update, args=(i,), daemon=True) for i in range(len(rollouts))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(120)
        assert not t.is_alive(), "a trainer rank or verl's rollout worker did not return"
    # The hang detector: every exchange verl's adapter started on a vLLM worker has ended.
    blocked = []
    for r in rollouts:
        handle = r.server_adapter.server_handle
        for t in handle.threads:
            t.join(60)
        if any(t.is_alive() for t in handle.threads):
            blocked.append(r.server_adapter.zmq_handle)
            handle.unblock(r.server_adapter.zmq_handle)
    return results, blocked


def held(rollout):
    return rollout.server_adapter.server_handle.worker.model_runner.model.held


def test_a_failed_version_ends_verls_vllm_exchange_on_both_ends_and_the_next_lands(verl_vllm_side):
    # Before: receive_weights raised from the iterator verl's adapter was streaming, after the
    # adapter had started the vLLM worker's receive; the adapter closed its socket without
    # is_last and the vLLM worker stayed in recv_pyobj for good (the replica wedged).
    from xfer.weights import VersionFailed

    trainers = [new_engine(True), new_engine(False)]
    rollouts = [rollout_worker(new_engine(False), vllm_worker(TENSORS), BUCKET)]
    try:
        results, blocked = rollout_step(trainers, rollouts, 1)
        assert results == {("t", 0): None, ("t", 1): None, ("r", 0): None}, results
        assert all(torch.equal(held(rollouts[0])[n], full(n, s, 1)) for n, s in TENSORS)
        calls = rollouts[0].server_adapter.server_handle.calls
        assert calls == ["update_weights_from_ipc", "clear_kv_cache", ("set_global_steps", 1)], calls
        before = {n: t.clone() for n, t in held(rollouts[0]).items()}

        calls.clear()
        results, blocked = rollout_step(trainers, rollouts, 2, weights=lambda seed, live: failing_stream(seed, live, 12))
        assert blocked == [], "verl's vLLM worker was left blocked in recv_pyobj"
        # verl's rollout worker ends with the version's failure by name; nothing was started
        # on the vLLM worker, whose model keeps the previous version; the trainers fail too.
        assert isinstance(results[("r", 0)], VersionFailed), results
        assert "weight version 2 failed" in str(results[("r", 0)]), results
        assert calls == [], calls
        assert all(torch.equal(held(rollouts[0])[n], before[n]) for n, _ in TENSORS)
        assert all(isinstance(results[("t", i)], Exception) for i in range(2)), results

        results, blocked = rollout_step(trainers, rollouts, 3)
        assert results == {("t", 0): None, ("t", 1): None, ("r", 0): None} and blocked == [], results
        assert all(torch.equal(held(rollouts[0])[n], full(n, s, 3)) for n, s in TENSORS)
    finally:
        close(trainers + [r.checkpoint_engine for r in rollouts])


def test_a_tensor_larger_than_verls_bucket_is_refused_before_verls_exchange_starts(verl_vllm_side):
    # verl's adapter sends a tensor larger than its bucket alone through reduce_tensor (device
    # IPC); with shared-memory buckets (this platform) it asserts instead, and the vLLM worker
    # waited in recv_pyobj for good. Here the engine refuses the version by name before the
    # adapter starts; with IPC it hands such a tensor over as a copy on verl's device (a GPU:
    # not run here).
    big = ("embed.weight", (3 << 20 >> 2,))  # 3 MiB of float32 > the 2 MiB bucket
    TENSORS.append(big)
    trainers = [new_engine(True)]
    rollouts = [rollout_worker(new_engine(False), vllm_worker(TENSORS), BUCKET)]
    try:
        results, blocked = rollout_step(trainers, rollouts, 1)
        assert blocked == [], "verl's vLLM worker was left blocked in recv_pyobj"
        assert results[("t", 0)] is None, results  # the version itself went through
        assert isinstance(results[("r", 0)], ValueError), results
        assert "larger than the bucket" in str(results[("r", 0)]) and "'embed.weight'" in str(results[("r", 0)])
        assert rollouts[0].server_adapter.server_handle.calls == []
        assert not any(t.any() for t in held(rollouts[0]).values()), "the model was changed"
    finally:
        TENSORS.pop()
        close(trainers + [r.checkpoint_engine for r in rollouts])


def close(engines):
    for e in engines:
        if e._member is not None:
            e._member.close()
        if e.engine is not None:
            e.engine.close()
        if e._server is not None:
            e._server.close()
