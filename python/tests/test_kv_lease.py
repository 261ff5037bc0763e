"""xfer.kv.lease: what a prefill rank keeps for its readers and answers them, from positive
knowledge (issue 54: "held" is answered only for a request kept for that reader, checked
against its token; issue 56: forged or second readers get nothing). Pure: no engine, no
framework, the clock passed in."""

import random
import tracemalloc

import xfer.kv.lease
from xfer.kv.control import block_id_array, new_token
from xfer.kv.lease import Message, Offers, Reader

READER = Reader("decode-a", "r-d", 2)


def msg(kind, token, rank=0, reader=READER, request="r", blocks=((3, 5),)):
    return Message(kind, request, token, reader, rank, b"addr", tuple(tuple(g) for g in blocks))


def test_a_reader_with_the_token_is_granted_and_told_held_then_the_blocks_are_freed():
    offers, token = Offers(lease_s=10), new_token()
    offers.offer("r", token, [[3, 5, 7]], now=0)
    assert offers.handle(msg("claim", token), 1).ok
    assert offers.handle(msg("done", token, rank=0), 2).ok
    assert offers.poll(2) == (set(), set()), "one reader rank of two is done"
    assert offers.handle(msg("done", token, rank=1, blocks=()), 3).ok
    assert offers.poll(3) == ({"r"}, set())
    assert "r" not in offers


def test_a_reader_past_the_lease_is_told_not_held_at_once_never_held():
    """The bug of issue 54: "held" was "not in the expired set", which was purged a lease
    later — a reader after two leases was told held and decoded another request's KV."""
    offers, token = Offers(lease_s=1), new_token()
    offers.offer("r", token, [[3, 5]], now=0)
    assert offers.poll(1.0) == (set(), {"r"})
    for late in (1.5, 3.5, 1000.0):  # long after any purge of a negative record
        offers.poll(late)
        answer = offers.handle(msg("done", token), late)
        assert answer is not None and not answer.ok, late
        answer = offers.handle(msg("claim", token), late)
        assert answer is not None and not answer.ok


def test_a_second_reader_is_refused_before_it_reads():
    offers, token = Offers(lease_s=10), new_token()
    offers.offer("r", token, [[3, 5]], now=0)
    assert offers.handle(msg("claim", token), 1).ok
    retry = Reader("decode-b", "r-d2", 2)
    answer = offers.handle(msg("claim", token, reader=retry), 1)
    assert not answer.ok and "another reader" in answer.why
    assert not offers.handle(msg("done", token, reader=retry), 1).ok
    assert offers.poll(2) == (set(), set()), "the retry counted nothing"
    # After the first reader finished, the retry is told "not held" too.
    offers.handle(msg("done", token, rank=0), 3), offers.handle(msg("done", token, rank=1), 3)
    assert offers.poll(3) == ({"r"}, set())
    assert not offers.handle(msg("claim", token, reader=retry), 4).ok


def test_forged_messages_without_the_token_change_nothing_and_get_no_answer():
    """Issue 56: a forged done with tp 1 counted as every reader and freed the blocks."""
    offers, token = Offers(lease_s=10), new_token()
    offers.offer("r", token, [[3, 5]], now=0)
    forger = Reader("decode-a", "r-d", 1)
    for kind in ("claim", "done", "renew"):
        assert offers.handle(msg(kind, new_token(), reader=forger), 1) is None
    assert offers.poll(2) == (set(), set()) and "r" in offers
    assert offers.dropped == 3
    # The real reader is still granted and told held.
    assert offers.handle(msg("claim", token), 3).ok


def test_a_claim_of_blocks_not_offered_for_the_request_is_refused():
    """Issue 56: remote_block_ids from an API client named other users' blocks."""
    offers, token = Offers(lease_s=10), new_token()
    offers.offer("r", token, [[3, 5]], now=0)
    answer = offers.handle(msg("claim", token, blocks=[(3, 9)]), 1)
    assert not answer.ok and "not offered" in answer.why
    assert not offers.handle(msg("claim", token, blocks=[(3,), (5,)]), 1).ok, "groups"


def test_messages_before_the_offer_wait_for_it_and_are_answered_then():
    offers, token = Offers(lease_s=10, early_s=5), new_token()
    assert offers.handle(msg("claim", token), 0) is None
    answers = offers.offer("r", token, [[3, 5]], now=1)
    assert [a.ok for a in answers] == [True]
    # Early messages are bounded and forgotten.
    small = Offers(lease_s=10, early_s=5, max_early=4)
    for i in range(10):
        small.handle(msg("done", token, request=f"x{i}"), 0)
    small.poll(10)
    assert small.offer("x9", token, [[1]], now=10) == []
    assert small.dropped == 10


def test_a_waiting_reader_renews_the_lease_up_to_its_bound():
    offers, token = Offers(lease_s=2, max_lease_s=5), new_token()
    offers.offer("r", token, [[3]], now=0)
    for now in (1, 2.5, 4):
        assert offers.handle(msg("renew", token), now) is None
        assert offers.poll(now) == (set(), set())
    assert offers.poll(5.5) == (set(), {"r"}), "renewed no later than max_lease_s"


def test_random_schedules_never_answer_held_after_a_free():
    """Property: whatever the order of claims, dones, renewals, forgeries, second readers and
    time, a done is answered "held" only while the request's offer exists (its blocks have
    not been reported freed)."""
    for seed in range(300):
        rng = random.Random(seed)
        offers, token, freed = Offers(lease_s=rng.choice([0.5, 2, 5]), max_lease_s=6), new_token(), False
        offers.offer("r", token, [[1, 2, 3]], now=0)
        now = 0.0
        for _ in range(30):
            now += rng.random()
            reader = rng.choice([READER, Reader("decode-b", "x", 2), Reader("decode-a", "r-d", 1)])
            kind = rng.choice(["claim", "done", "renew"])
            t = token if rng.random() < 0.8 else new_token()
            answer = offers.handle(msg(kind, t, rank=rng.randrange(2), reader=reader,
                                       blocks=[rng.sample([1, 2, 3, 4], 2)]), now)
            if answer is not None and answer.ok and kind == "done":
                assert not freed, seed
            read, expired = offers.poll(now)
            freed = freed or bool(read or expired)


def test_early_block_ids_are_bounded_in_all_oldest_dropped_first():
    offers, token = Offers(lease_s=10, max_early_ids=5), new_token()
    for i in range(3):  # 2 ids each: the third pushes out the first
        offers.handle(msg("claim", token, request=f"x{i}", blocks=[(1, 2)]), 0)
    assert offers.dropped == 1
    assert offers.offer("x0", token, [[1, 2]], now=1) == []
    assert [a.ok for a in offers.offer("x2", token, [[1, 2]], now=1)] == [True]
    offers.handle(msg("claim", token, request="big", blocks=[range(6)]), 1)
    assert offers.dropped == 2, "more ids than all early messages may hold: dropped alone"
    assert [a.ok for a in offers.offer("x1", token, [[1, 2]], now=1)] == [True]

MIB = 1 << 20


def test_a_strangers_early_claims_are_bounded_in_bytes(random_block_ids):
    """Review 56 M-C: the early reader messages were bounded in count only (4,096), each
    claim's block ids held as Python ints — about 640 KiB a claim, 2.5 GiB from anyone who
    can reach the engine with a token-shaped string. 4,096 claims, each of a random request
    id and token from an engine nobody knows, with 16,380 random ids (what one 64 KiB
    message carries), decoded as the worker decodes them: what is held stays under 64 MiB,
    and the drops are counted. A real reader's early claim after the flood is still
    answered when its request is offered."""
    rng = random.Random(56)
    offers = Offers(lease_s=10, early_s=30)
    tracemalloc.start()
    try:
        before = tracemalloc.get_traced_memory()[0]
        for i in range(4096):
            ids = block_id_array(random_block_ids(rng, 16380))
            stranger = Reader(f"unknown-{rng.getrandbits(64):x}", f"{rng.getrandbits(64):x}", 1)
            offers.handle(Message("claim", f"{rng.getrandbits(64):x}", new_token(), stranger, 0,
                                  b"addr", (ids,)), 0.0)
            if i % 64 == 63:  # a bound held all along, not only at the end
                held = tracemalloc.get_traced_memory()[0] - before
                assert held < 64 * MIB, f"{held / MIB:.0f} MiB held after {i + 1} claims"
    finally:
        tracemalloc.stop()
    assert offers.dropped > 0
    token = new_token()
    assert offers.handle(msg("claim", token), 1.0) is None
    assert [a.ok for a in offers.offer("r", token, [[3, 5]], now=1.0)] == [True]


def test_offering_a_request_does_not_go_through_every_early_message(lines_run):
    """Review 56 M-C: ``offer`` (on vLLM's worker thread, for every request a step keeps)
    compared each of the 4,096 early messages' request ids with it. The lines it runs with
    4,096 early messages held are as many as with one (counted, not timed)."""
    rng = random.Random(4096)

    def early(offers, n):
        for _ in range(n):
            stranger = Reader(f"unknown-{rng.getrandbits(64):x}", "x", 1)
            offers.handle(Message("claim", f"{rng.getrandbits(64):x}", new_token(), stranger, 0,
                                  b"addr", ((rng.randrange(1 << 20),),)), 0.0)
        assert offers.dropped == 0, "every early message is held"

    one, many = Offers(lease_s=10), Offers(lease_s=10)
    early(one, 1), early(many, 4096)
    work = [lines_run(xfer.kv.lease, lambda o=o: o.offer("r", new_token(), [[3]], 1.0))
            for o in (one, many)]
    assert work[1] <= work[0] + 8, f"lines run offering one request: {work}"
