"""xfer.kv.lookups: how long the vLLM connector's lookup of a peer's record may wait (issue 56,
review M4: a fresh engine id per request made each lookup wait ``lookup_timeout_s`` on the
connector's two lookup threads). Pure: the clock is passed in."""

import random

from xfer.kv.lookups import LookupGate


def test_a_record_never_found_is_only_checked_however_often_it_is_asked_for():
    gate = LookupGate(30.0)
    for i in range(100):
        key = ("rv", f"engine-{i}", 0)
        assert gate.begin(key, now=i) == 0.0
        gate.end(key, 0.0, found=False, now=i)
    assert gate.waiting == 0
    assert gate.begin(("rv", "engine-0", 0), now=1000) == 0.0, "a failure does not make it known"


def test_a_record_found_before_may_be_waited_for_by_one_lookup_at_a_time():
    gate = LookupGate(30.0)
    a, b = ("rv", "p", 0), ("rv", "p", 1)
    for key in (a, b):
        gate.end(key, gate.begin(key, 0), found=True, now=0)
    assert gate.begin(a, 1) == 30.0
    assert gate.begin(b, 1) == 0.0, "the waiting place is taken: a check"
    assert gate.begin(a, 1) == 0.0
    gate.end(b, 0.0, found=False, now=1)
    gate.end(a, 0.0, found=False, now=1)
    gate.end(a, 30.0, found=True, now=2)  # the one that waited found its peer back
    assert gate.waiting == 0
    assert gate.begin(b, 3) == 30.0, "a check that found nothing starts no backoff"


def test_a_failed_wait_is_followed_by_checks_only_for_a_doubling_backoff():
    gate = LookupGate(2.0, max_backoff_s=6.0)
    key = ("rv", "p", 0)
    gate.end(key, gate.begin(key, 0), found=True, now=0)
    now, backoffs = 0.0, []
    wait = gate.begin(key, now)
    for _ in range(4):
        assert wait == 2.0
        now += wait
        gate.end(key, wait, found=False, now=now)
        start = now
        while (wait := gate.begin(key, now)) == 0.0:  # no lookup meanwhile
            now += 0.5
        backoffs.append(now - start)
    assert backoffs == [2.0, 4.0, 6.0, 6.0]


def test_checks_that_keep_failing_keep_the_backoff_and_a_found_record_ends_it():
    gate = LookupGate(2.0)
    key = ("rv", "p", 0)
    gate.end(key, gate.begin(key, 0), found=True, now=0)
    gate.end(key, gate.begin(key, 0), found=False, now=2)  # waited 2 s: back off until 4
    for now in (3.0, 4.5, 6.0):  # each failed check renews it
        assert gate.begin(key, now) == 0.0
        gate.end(key, 0.0, found=False, now=now)
    assert gate.begin(key, 7.9) == 0.0
    gate.end(key, 0.0, found=True, now=7.9)
    assert gate.begin(key, 8.0) == 2.0


def test_what_it_remembers_is_bounded_and_the_waiting_count_balances():
    gate = LookupGate(1.0, max_remembered=8, max_waiting=2)
    rng = random.Random(56)
    keys = [("rv", f"e{i}", 0) for i in range(40)]
    now = 0.0
    for _ in range(5000):
        key = rng.choice(keys)
        wait = gate.begin(key, now)
        assert wait in (0.0, 1.0) and gate.waiting <= 2
        if wait and rng.random() < 0.5:
            # another lookup starts while this one waits
            other = rng.choice(keys)
            other_wait = gate.begin(other, now)
            assert gate.waiting <= 2
            gate.end(other, other_wait, found=rng.random() < 0.5, now=now)
        now += rng.random()
        gate.end(key, wait, found=rng.random() < 0.3, now=now)
        assert len(gate._found) <= 8 and len(gate._backoff) <= 8
    assert gate.waiting == 0
