"""xfer as verl's checkpoint engine, in one process (threads, the mock fabric), through verl's
registry (``import_external_libs`` as ``custom_backend_module`` does) and the call sequence of
its ``CheckpointEngineManager.update_weights``: ``prepare`` on every rank, ``build_topology``,
``init_process_group``, ``send_weights`` (a streaming generator of full tensors, as verl's
FSDP engine yields them) concurrently with ``receive_weights``, ``finalize``; rollout
membership changing between steps on the same engine objects (1 -> 2 -> 1 workers, as
``add_replicas`` / ``remove_replicas`` and the per-step rebuild do).

What is counted: how many tensors the generator yielded are alive at once (weak references,
not the engine's own account) — the engine must stream through its two buckets, not gather
the model; and every rollout worker's tensors against the trainer's."""

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
