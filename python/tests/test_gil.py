"""No pass of the engine takes the GIL (issue 53): transfers complete — posted, polled,
delivered, their `Transfer` marked done and expectations met — while a Python thread holds the
GIL without letting go. Only the worker makes passes, and the bindings' wakers hand Python
callbacks to their own thread.

The GIL is held by a pure-Python loop with the switch interval raised far beyond the test's
length, so no other thread (the engine's included, were it to ask) gets it until the loop
ends; the loop looks at the transfers through `done()`, which never lets the GIL go."""

import sys
import threading
import time

import numpy as np


def test_transfers_complete_while_a_python_thread_holds_the_gil(engine):
    src = np.arange(1 << 16, dtype=np.uint8)
    dst = np.zeros(1 << 16, dtype=np.uint8)
    s, d = engine.reg_mr(src, access="local"), engine.reg_mr(dst)
    called = []
    all_called = threading.Event()

    def on_done(exc):
        called.append(exc)
        if len(called) == 64:
            all_called.set()

    expected = engine.expect_imm_count(3, 64 * engine.expected_arrivals(1024))
    writes = [
        engine.submit_single_write(
            s, d.desc, 1024, src_offset=i * 1024, dst_offset=i * 1024, imm=3,
            on_done=on_done,
        )
        for i in range(64)
    ]
    before = sys.getswitchinterval()
    sys.setswitchinterval(1000.0)
    try:
        # Holding the GIL: a bounded loop (it only keeps a broken engine from hanging).
        give_up = time.monotonic() + 30
        while not (all(w.done() for w in writes) and expected.done()):
            if time.monotonic() > give_up:
                break
        finished_holding_the_gil = all(w.done() for w in writes) and expected.done()
    finally:
        sys.setswitchinterval(before)
    assert finished_holding_the_gil, "the engine waited for the GIL"
    for w in writes:
        w.wait(5)
    assert np.array_equal(src, dst)
    # The Python callbacks run on the bindings' callback thread once the GIL is free.
    assert all_called.wait(30)
    assert called == [None] * 64
