"""xfer.weights: the plan from Python (columns checked by carrying them out on byte arrays) and
the executor on the mock (several engines in one process, each rank a thread): versions in a
row, resharding TP 2 → TP 1 and fused parameters, staging under a budget with a dtype cast,
and a rank that dies mid-version failing that version everywhere while the next succeeds."""

import threading

import numpy as np
import pytest

import xfer
from conftest import MOCK
from xfer import weights as W


def tp2_fused_layout():
    """q, k (8x6 and 4x6, float32) column-sharded over 2 trainer ranks, a norm (6) replicated
    on both; receiver 0 has qk fused (12x6) and the norm, receiver 1 has q's rows 2..6."""
    tensors = (W.TensorSpec("q", (8, 6), "float32"), W.TensorSpec("k", (4, 6), "float32"), W.TensorSpec("norm", (6,), "float32"))
    shards = tuple((r, n, ("dim", 1, 3 * r, 3 * r + 3)) for r in range(2) for n in ("q", "k")) + ((0, "norm", None), (1, "norm", None))
    params = (
        (0, "qk", (12, 6), (("q", None, (0, 0)), ("k", None, (8, 0)))),
        (0, "norm", (6,), (("norm", None, (0,)),)),
        (1, "q_part", (4, 6), (("q", ("dim", 0, 2, 6), (0, 0)),)),
    )
    return W.Layout(tensors, shards, params)


def full_tensors(layout, seed):
    rng = np.random.default_rng(seed)
    return {t.name: rng.standard_normal(t.shape).astype(np.float32) for t in layout.tensors}


def shard_data(layout, full, rank):
    out = {}
    for i, (r, name, sl) in enumerate(layout.shards):
        if r != rank:
            continue
        t = full[name]
        if sl is None:
            out[i] = t
        elif sl[0] == "dim":
            _, dim, start, end = sl
            out[i] = np.ascontiguousarray(np.take(t, range(start, end), axis=dim))
        else:
            out[i] = t.reshape(-1).view(np.uint8)[sl[1] : sl[2]]
    return out


def expected_params(layout, full, rank):
    out = {}
    for _, name, shape, pieces in (p for p in layout.params if p[0] == rank):
        dtype = full[pieces[0][0]].dtype
        a = np.zeros(shape, dtype=dtype)
        for tname, sel, at in pieces:
            src = full[tname]
            if sel is not None:
                _, dim, start, end = sel
                src = np.take(src, range(start, end), axis=dim)
            src = src.reshape((1,) * (len(shape) - src.ndim) + src.shape)
            a[tuple(slice(o, o + n) for o, n in zip(at, src.shape))] = src
        out[name] = a
    return out


def test_plan_columns_carried_out_on_bytes_give_every_parameter():
    layout = tp2_fused_layout()
    full = full_tensors(layout, 1)
    shards = {**shard_data(layout, full, 0), **shard_data(layout, full, 1)}
    w = W.plan(layout)
    assert len(w) > 0 and sum(w.sent) == sum(w.received)
    got = [np.zeros(layout.param_nbytes(i), np.uint8) for i in range(len(layout.params))]
    hits = [np.zeros(layout.param_nbytes(i), np.int64) for i in range(len(layout.params))]
    for s, so, p, do, n in zip(*w.rows()):
        src = W._bytes_of(shards[int(s)])
        got[int(p)][int(do) : int(do + n)] = src[int(so) : int(so + n)]
        hits[int(p)][int(do) : int(do + n)] += 1
    for i, (rank, name, _, _) in enumerate(layout.params):
        assert (hits[i] == 1).all(), f"{name}: bytes written other than once"
        assert np.array_equal(got[i].view(np.float32), expected_params(layout, full, rank)[name].reshape(-1))
    # The replicated norm goes out once, from either holder; q and k's columns split evenly.
    assert max(w.sent) - min(w.sent) <= 24


def test_plan_refusal_names_the_parameter():
    layout = tp2_fused_layout()
    bad = W.Layout(layout.tensors, layout.shards, layout.params + ((1, "kk", (4, 6), (("k", None, (1, 0)),)),))
    with pytest.raises(xfer.InvalidArgumentError, match="kk"):
        W.plan(bad)


class Cluster:
    """m senders and n receivers on the mock, meeting through an in-process rendezvous."""

    def __init__(self, layout, senders, receivers, *, timeout=5.0, budget=None, group="w", double_buffer=False, config=MOCK, grace=2.0,
                 receiver_config=None):
        self.server = xfer.Server()
        self.rdv = xfer.Rendezvous(self.server.url)
        self.engines = [xfer.TransferEngine(config) for _ in range(senders)]
        self.engines += [xfer.TransferEngine(receiver_config or config) for _ in range(receivers)]
        self.layout = layout
        self.senders = [
            W.WeightSender(self.engines[s], self.rdv, group, s, senders, receivers, timeout=timeout, grace=grace, budget_bytes=budget)
            for s in range(senders)
        ]
        self.receivers = [
            W.WeightReceiver(
                self.engines[senders + r], self.rdv, group, r, senders, receivers, timeout=timeout, grace=grace, double_buffer=double_buffer
            )
            for r in range(receivers)
        ]

    def version(self, v, full, *, skip_sender=None, skip_receiver=None, transform=None, data=None, first=None, then=None):
        """Runs version v on every rank (threads); returns each rank's exception or None.
        ``first`` (a key such as ``("r", 0)``) starts alone; ``then()`` returns when the
        others may start (a staggered start)."""
        results = {}

        def run(key, fn):
            try:
                fn()
                results[key] = None
            except Exception as e:  # noqa: BLE001
                results[key] = e

        threads = {}
        for s, sender in enumerate(self.senders):
            if s == skip_sender:
                continue
            shards = data(s) if data else shard_data(self.layout, full, s)
            threads[("s", s)] = threading.Thread(target=run, args=(("s", s), lambda sd=sender, sh=shards: sd.send(v, self.layout, sh, transform=transform)))
        for r, receiver in enumerate(self.receivers):
            if r == skip_receiver:
                continue
            threads[("r", r)] = threading.Thread(target=run, args=(("r", r), lambda rc=receiver: rc.receive(v)))
        if first is not None:
            threads[first].start()
            then()
        for key, t in threads.items():
            if key != first:
                t.start()
        for t in threads.values():
            t.join(120)
            assert not t.is_alive(), "a rank did not return within its deadline"
        return results

    def timeout(self, seconds):
        """Every rank's deadline per version from now on (short for a version meant to fail,
        long for the others: nothing is timed, a busy machine only makes them slower)."""
        for m in self.senders + self.receivers:
            m.timeout = seconds

    def close(self):
        for m in self.senders + self.receivers:
            m.close()
        for e in self.engines:
            e.close()
        self.server.close()


def check_received(cluster, full, params=None):
    for r, rc in enumerate(cluster.receivers):
        want = expected_params(cluster.layout, full, r)
        got = rc.params if params is None else params[r]
        assert set(got) == set(want)
        for name, a in want.items():
            assert np.array_equal(got[name].view(a.dtype).reshape(a.shape), a), f"receiver {r}: {name}"


def test_versions_in_a_row_reshard_and_fuse():
    c = Cluster(tp2_fused_layout(), 2, 2)
    try:
        for v in range(3):
            full = full_tensors(c.layout, 10 + v)
            results = c.version(v, full)
            assert all(e is None for e in results.values()), results
            check_received(c, full)
    finally:
        c.close()


def test_budget_buckets_and_a_cast_on_the_sender():
    # The wire is float16; trainer shards are float32 and cast per tensor into the buckets.
    base = tp2_fused_layout()
    layout = W.Layout(tuple(W.TensorSpec(t.name, t.shape, "float16") for t in base.tensors), base.shards, base.params)
    c = Cluster(layout, 2, 2, budget=2 * 64 * 2)  # every shard in a bucket of its own
    try:
        for v in range(2):
            full = full_tensors(layout, 20 + v)
            results = c.version(v, full, transform=lambda name, x: x.astype(np.float16))
            assert all(e is None for e in results.values()), results
            check_received(c, {k: a.astype(np.float16) for k, a in full.items()})
    finally:
        c.close()


def test_a_dead_sender_fails_the_version_everywhere_and_the_next_succeeds():
    c = Cluster(tp2_fused_layout(), 2, 2, timeout=1.5)
    try:
        full = full_tensors(c.layout, 30)
        assert all(e is None for e in c.version(0, full).values())
        # Sender 1 never sends version 1 (as if its process died before writing).
        results = c.version(1, full_tensors(c.layout, 31), skip_sender=1)
        assert set(results) == {("s", 0), ("r", 0), ("r", 1)}
        for key, e in results.items():
            assert isinstance(e, W.VersionFailed) and e.version == 1, (key, e)
        why = str(results[("s", 0)])
        assert "trainer rank 1 did not report" in why or "arrived" in why or "trainer ranks [1] never said" in why, why
        full = full_tensors(c.layout, 32)
        results = c.version(2, full)
        assert all(e is None for e in results.values()), results
        check_received(c, full)
    finally:
        c.close()


def test_a_receiver_dying_after_its_data_landed_fails_the_others_too():
    c = Cluster(tp2_fused_layout(), 2, 2, timeout=1.5)
    try:
        full = full_tensors(c.layout, 50)
        silent = c.receivers[1]
        # Receiver 1 gets its data, then goes silent (never reports): receiver 0 has every byte
        # of its own but must not call the version complete.
        silent.report = lambda *args, **kwargs: None
        results = c.version(0, full)
        assert isinstance(results[("r", 0)], W.VersionFailed), results
        assert "receiver 1 did not report" in str(results[("r", 0)])
        assert all(isinstance(results[("s", s)], W.VersionFailed) for s in range(2))
        del silent.report
        full = full_tensors(c.layout, 51)
        results = c.version(1, full)
        assert all(e is None for e in results.values()), results
        check_received(c, full)
    finally:
        c.close()


def test_a_sender_missing_a_shard_fails_fast_with_its_reason():
    c = Cluster(tp2_fused_layout(), 2, 1 + 1)
    try:
        full = full_tensors(c.layout, 40)

        def data(s):
            d = shard_data(c.layout, full, s)
            if s == 1:
                d.pop(min(d))
            return d

        results = c.version(0, full, data=data)
        assert all(isinstance(e, W.VersionFailed) for e in results.values()), results
        assert "was not given" in str(results[("r", 0)])
    finally:
        c.close()


def test_shards_updated_in_place_are_sent_from_their_own_memory_with_each_versions_values():
    # The same arrays every version (a model's own parameters), new values written into them:
    # each is registered once, and each version carries the values it holds when sent.
    c = Cluster(tp2_fused_layout(), 2, 2)
    try:
        data = {s: shard_data(c.layout, full_tensors(c.layout, 60), s) for s in range(2)}
        regions = []
        for v in range(3):
            full = full_tensors(c.layout, 60 + v)
            for s in range(2):
                for i, a in shard_data(c.layout, full, s).items():
                    data[s][i][...] = a
            results = c.version(v, full, data=lambda s: data[s])
            assert all(e is None for e in results.values()), results
            check_received(c, full)
            regions.append({k: id(r) for k, (_, r) in c.senders[0]._registered.items()})
        assert regions[0] == regions[1] == regions[2] and len(regions[0]) == len(data[0])
        # Other arrays in their place: registered anew, the old ones let go.
        full = full_tensors(c.layout, 70)
        assert all(e is None for e in c.version(3, full).values())
        check_received(c, full)
        assert not set(c.senders[0]._registered) & set(regions[0])
    finally:
        c.close()


def test_a_double_buffered_receiver_shows_a_version_only_once_it_is_complete():
    c = Cluster(tp2_fused_layout(), 2, 2, timeout=30.0, double_buffer=True)
    try:
        first = full_tensors(c.layout, 80)
        assert all(e is None for e in c.version(0, first).values())
        check_received(c, first)
        seen = [rc.params for rc in c.receivers]  # what readers hold while version 1 arrives
        second = full_tensors(c.layout, 81)
        assert all(e is None for e in c.version(1, second).values())
        check_received(c, second)
        check_received(c, first, seen)  # version 1 went into the other buffer
        # Version 2 fails (trainer rank 1 never sends; rank 0's bytes land): readers still see
        # version 1, whole.
        c.timeout(1.5)
        results = c.version(2, full_tensors(c.layout, 82), skip_sender=1)
        assert all(isinstance(e, W.VersionFailed) for e in results.values()), results
        check_received(c, second)
        c.timeout(30.0)
        third = full_tensors(c.layout, 83)
        assert all(e is None for e in c.version(3, third).values())
        check_received(c, third)
    finally:
        c.close()


def test_an_in_place_receiver_is_partly_overwritten_by_a_failed_version():
    # What double buffering is for: in place, the failed version's landed bytes are visible.
    c = Cluster(tp2_fused_layout(), 2, 2, timeout=30.0)
    try:
        first = full_tensors(c.layout, 90)
        assert all(e is None for e in c.version(0, first).values())
        c.timeout(1.5)
        results = c.version(1, full_tensors(c.layout, 91), skip_sender=1)
        assert all(isinstance(e, W.VersionFailed) for e in results.values()), results
        with pytest.raises(AssertionError):
            check_received(c, first)
    finally:
        c.close()


def test_a_stream_of_shards_is_pulled_one_at_a_time_through_two_buckets():
    # Shards given as a generator of (index, data): each made only when its turn comes,
    # staged, written and let go; the generator is read to its end.
    import weakref

    tensors = tuple(W.TensorSpec(f"t{i}", (64, 16), "float32") for i in range(12))
    layout = W.Layout.replicated(tensors, 1, 2)
    c = Cluster(layout, 1, 2, budget=2 * 64 * 16 * 4)
    alive, most, done = [0], [0], []

    def gone():
        alive[0] -= 1

    def stream(full):
        for i, t in enumerate(tensors):
            a = full[t.name].copy()
            alive[0] += 1
            most[0] = max(most[0], alive[0])
            weakref.finalize(a, gone)
            yield i, a
            del a
        done.append(True)

    try:
        for v in range(2):
            full = full_tensors(layout, 300 + v)
            results = c.version(v, full, data=lambda s: stream(full))
            assert all(e is None for e in results.values()), results
            check_received(c, full)
        assert most[0] <= 2, most[0]
        assert done == [True, True]
    finally:
        c.close()
