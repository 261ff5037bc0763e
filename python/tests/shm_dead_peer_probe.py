"""Probe (not a test; run by hand): what a libfabric shm endpoint does once it wrote to a dead
process (docs/moe.md, "Found"). Three processes; rank 1 is SIGKILLed; rank 0 posts one write
to it, then ranks 0 and 2 write to each other in rounds, each write with an immediate. Prints,
per round and rank, whether the other's immediate came within the wait, the rank's own write's
status, and at the end which rounds' bytes landed and what became of the writes that never
completed (the engine fails them after ``timeouts.transfer_ms``).

    python python/tests/shm_dead_peer_probe.py [--bytes 256] [--no-dead-write]

With ``LD_LIBRARY_PATH=target/libfabric-2.1.0/install/lib`` the efa plugin loads libfabric
2.1.0 instead of the system's."""

import argparse
import multiprocessing as mp
import os
import signal
import time

import numpy as np

import xfer

TRANSFER_S = 3
CFG = {
    "backend": "efa",
    "groups": [{"nics": ["auto"]}],
    "backends": {"efa": {"provider": "shm"}},
    "timeouts": {"expect_ms": 60000, "transfer_ms": TRANSFER_S * 1000, "connect_ms": 20000},
    "worker": {"idle_poll_us": 0},
}
ROUNDS, WAIT_S, SLOT = 6, 2.0, 4096


def rank(r, conn, size, dead_write):
    with xfer.TransferEngine(CFG) as e:
        buf = np.zeros(2 * SLOT * (ROUNDS + 1), dtype=np.uint8)
        mr = e.reg_mr(buf, access="write")
        conn.send(bytes(mr.desc))
        descs = [xfer.MrDesc(d) for d in conn.recv()]
        for t in [e.submit_single_write(mr, descs[p], size, imm=100 + r) for p in range(3) if p != r]:
            t.wait(10)
        for x in [e.expect_imm_count(100 + p, 1) for p in range(3) if p != r]:
            x.wait(10)
        conn.send("warm")
        conn.recv()  # rank 1 is killed here, before it answers
        other, log, writes = 2 - r, [], []
        if dead_write and r == 0:
            writes.append(("to the dead rank", e.submit_single_write(mr, descs[1], size, imm=900)))
        for i in range(ROUNDS):
            src = SLOT * (i + 1)
            buf[src:src + size] = 50 + i
            t = e.submit_single_write(mr, descs[other], size, src_offset=src, dst_offset=SLOT * (ROUNDS + 1) + src,
                                      imm=200 + 10 * i + r)
            writes.append((f"round {i}", t))
            start = time.monotonic()
            try:
                e.expect_imm_count(200 + 10 * i + other, 1).wait(WAIT_S)
                got = f"its immediate in {time.monotonic() - start:.3f} s"
            except xfer.TimeoutError:
                got = f"no immediate within {WAIT_S} s"
            log.append(f"round {i}: {got}; my write {t.status}")
        for _name, t in writes:  # each completes, fails, or is failed by transfer_ms
            try:
                t.wait(TRANSFER_S + 5)
            except xfer.Error:
                pass
        landed = [int(buf[SLOT * (ROUNDS + 1) + SLOT * (i + 1)]) == 50 + i for i in range(ROUNDS)]
        log.append(f"the other's bytes landed, by round: {landed}")
        log += [f"my write {name}: {t.status} {t.exception()!r}" for name, t in writes if t.exception() is not None]
        stats = e.stats()
        log.append(f"immediates arrived {stats['imm_arrivals']}, outstanding {stats['outstanding']}")
        conn.send("\n".join(log))
        conn.recv()


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--bytes", type=int, default=256)
    ap.add_argument("--no-dead-write", action="store_true")
    a = ap.parse_args()
    ctx = mp.get_context("spawn")
    pipes = [ctx.Pipe() for _ in range(3)]
    procs = [ctx.Process(target=rank, args=(r, pipes[r][1], a.bytes, not a.no_dead_write)) for r in range(3)]
    for p in procs:
        p.start()
    descs = [pipes[r][0].recv() for r in range(3)]
    for r in range(3):
        pipes[r][0].send(descs)
    for r in range(3):
        assert pipes[r][0].recv() == "warm"
    os.kill(procs[1].pid, signal.SIGKILL)
    procs[1].join()
    for r in (0, 2):
        pipes[r][0].send("go")
    for r in (0, 2):
        print(f"rank {r}:\n{pipes[r][0].recv()}", flush=True)
    for r in (0, 2):
        pipes[r][0].send("bye")
    for p in procs:
        p.join(30)


if __name__ == "__main__":
    main()
