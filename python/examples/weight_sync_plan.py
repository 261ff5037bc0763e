"""RL weight sync on a plan: two trainer ranks holding tensor-parallel halves of a small model
write each version straight into three inference ranks' parameters — one with the model whole
and q/k/v fused into ``qkv_proj``, two with q/k/v split by heads (TP 2) — every byte once.

Each rank is a thread with its own engine here (the mock, or ``--config`` for a real fabric);
across machines each is its own process and they meet through the same rendezvous service.

    python python/examples/weight_sync_plan.py [--versions 3] [--config FILE]
"""

import argparse
import threading
import time

import numpy as np

import xfer
from xfer import weights as W

HIDDEN, Q, KV = 64, 64, 16


def layout(trainers: int) -> W.Layout:
    tensors = [W.TensorSpec(n, s, "float32") for n, s in (("q", (Q, HIDDEN)), ("k", (KV, HIDDEN)), ("v", (KV, HIDDEN)), ("norm", (HIDDEN,)))]
    # Trainer rank r holds rows r/2 of q, k and v (column-parallel), and the norm whole.
    shards = [(r, n, ("dim", 0, r * rows // 2, (r + 1) * rows // 2)) for r in range(trainers) for n, rows in (("q", Q), ("k", KV), ("v", KV))]
    shards += [(r, "norm", None) for r in range(trainers)]
    fused = ("qkv_proj", (Q + 2 * KV, HIDDEN), (("q", None, (0, 0)), ("k", None, (Q, 0)), ("v", None, (Q + KV, 0))))
    params = [(0, *fused), (0, "norm", (HIDDEN,), (("norm", None, (0,)),))]
    for r, half in ((1, 0), (2, 1)):
        for n, rows in (("q", Q), ("k", KV), ("v", KV)):
            params.append((r, n, (rows // 2, HIDDEN), ((n, ("dim", 0, half * rows // 2, (half + 1) * rows // 2), (0, 0)),)))
        params.append((r, "norm", (HIDDEN,), (("norm", None, (0,)),)))
    return W.Layout(tuple(tensors), tuple(shards), tuple(params))


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--config", help="config file (default: $XFER_CONFIG or the mock)")
    p.add_argument("--versions", type=int, default=3)
    a = p.parse_args()
    trainers, receivers = 2, 3
    lay = layout(trainers)
    plan = W.plan(lay)
    print(f"plan: {len(plan)} strided writes, bytes sent per trainer rank {plan.sent}, received per inference rank {plan.received}")
    server = xfer.Server()
    rdv = xfer.Rendezvous(server.url)
    engines = [xfer.TransferEngine(a.config) for _ in range(trainers + receivers)]
    senders = [W.WeightSender(engines[s], rdv, "example", s, trainers, receivers, timeout=10) for s in range(trainers)]
    recvs = [W.WeightReceiver(engines[trainers + r], rdv, "example", r, trainers, receivers, timeout=10) for r in range(receivers)]
    rng = np.random.default_rng(0)
    for version in range(a.versions):
        full = {t.name: rng.standard_normal(t.shape).astype(np.float32) for t in lay.tensors}  # "a training step"
        local = [
            {i: np.ascontiguousarray(full[n] if sl is None else full[n][sl[2] : sl[3]]) for i, (r, n, sl) in enumerate(lay.shards) if r == s}
            for s in range(trainers)
        ]
        start = time.monotonic()
        errors: list[BaseException] = []

        def run(fn, *args):
            try:
                fn(*args)
            except BaseException as e:  # noqa: BLE001 - raised below, after every rank returned
                errors.append(e)

        threads = [threading.Thread(target=run, args=(senders[s].send, version, lay, local[s])) for s in range(trainers)]
        threads += [threading.Thread(target=run, args=(rc.receive, version)) for rc in recvs]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        if errors:
            raise errors[0]
        took = time.monotonic() - start
        qkv = recvs[0].params["qkv_proj"].view(np.float32).reshape(Q + 2 * KV, HIDDEN)
        assert np.array_equal(qkv, np.concatenate([full["q"], full["k"], full["v"]]))
        for r, half in ((1, 0), (2, 1)):
            for n, rows in (("q", Q), ("k", KV), ("v", KV)):
                got = recvs[r].params[n].view(np.float32).reshape(rows // 2, HIDDEN)
                assert np.array_equal(got, full[n][half * rows // 2 : (half + 1) * rows // 2]), (r, n)
        for rc in recvs:
            assert np.array_equal(rc.params["norm"].view(np.float32), full["norm"])
        print(f"version {version}: every parameter of {receivers} inference ranks verified, {took * 1e3:.1f} ms")
    for m in [*senders, *recvs]:
        m.close()
    for e in engines:
        e.close()
    server.close()


if __name__ == "__main__":
    main()
