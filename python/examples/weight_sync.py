"""RL weight sync: a trainer pushes updated weights to several inference engines.

Each inference engine registers its weight buffer and publishes the descriptor; the trainer
scatters its flat weight buffer to all of them in one ``submit_scatter`` (one immediate), then
a barrier on a second immediate tells them the version is complete. Each receiver waits for
both counts and checks the weights.

    python python/examples/weight_sync.py [--receivers 3] [--mib 8]
"""

import argparse
import threading

import numpy as np

import xfer


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--config", help="config file (default: $XFER_CONFIG or the mock)")
    p.add_argument("--receivers", type=int, default=3)
    p.add_argument("--mib", type=int, default=8)
    a = p.parse_args()
    size = a.mib << 20
    weights = np.random.default_rng(0).integers(0, 255, size, dtype=np.uint8)
    receivers = [xfer.TransferEngine(a.config) for _ in range(a.receivers)]
    buffers = [np.zeros(size, dtype=np.uint8) for _ in receivers]
    regions = [r.reg_mr(b) for r, b in zip(receivers, buffers)]
    with xfer.TransferEngine(a.config) as trainer:
        src = trainer.reg_mr(weights, access="local")
        group = trainer.add_peer_group([r.main_address for r in receivers])
        for version in range(3):
            weights[:64] = version  # "a training step"
            waits = [(r.expect_imm_count(1, r.expected_arrivals(scatter_lens=[size])),
                      r.expect_imm_count(2, r.expected_arrivals(barrier=True))) for r in receivers]
            sync = trainer.submit_scatter(src, [(size, 0, reg.desc, 0) for reg in regions], imm=1, group=group)
            sync.wait(60)
            trainer.submit_barrier(2, [reg.desc for reg in regions], group=group).wait(60)
            for (data, done), buf in zip(waits, buffers):
                data.wait(60)
                done.wait(60)
                assert np.array_equal(buf, weights)
            print(f"version {version}: {a.receivers} x {a.mib} MiB in {sync.duration * 1e3:.1f} ms")
    for r in receivers:
        r.close()
    print("every receiver has every version")


if __name__ == "__main__":
    main()
