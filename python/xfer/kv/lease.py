"""What a prefill rank keeps for the readers of its requests, and what it answers them — from
positive knowledge (pure: no clock, no engine, no framework; ``now`` is passed in).

A prefill keeps a finished request's blocks for one reader under a lease. Each kept request is
an :class:`Offer`: the request's random token (which travelled to the reader in the request's
parameters), the blocks offered per KV cache group, its deadline. A reader

1. *claims* the blocks it will read, before it reads them (:meth:`Offers.claim`): granted only
   with the request's token, for blocks that were offered for that request, to the first
   reader (a decode instance's request: every rank of it) — a second reader (a proxy's retry)
   is refused before it reads anything;
2. says it is *done* (:meth:`Offers.done`) and is told whether the blocks were held: "held"
   only while the offer exists — it exists from the moment the request's blocks were kept
   until the rank reports them freed, so an offer found with its token means the blocks held
   that request's KV for the whole read. A request freed at its lease (or read by every rank
   of its reader) is remembered, bounded, as *gone*: its reader is told "not held" at once.
   Nothing is inferred from the absence of a record.
3. may *renew* the lease while it waits to be scheduled (:meth:`Offers.renew`), up to
   ``max_lease_s`` from the offer.

Messages for a request whose offer has not come yet (the reader can be faster than the step
that keeps it) wait, bounded, and are answered when it comes (:meth:`Offers.offer`). Anyone
who can reach the engine can send them (only the token's form is checked before the offer), so
they are bounded in count, in block ids held (4 bytes each) and in time, oldest dropped first,
and found by request (offering a request never goes through the others'). Messages with
another token are dropped: they are forged, or for another incarnation of this instance.
"""

from __future__ import annotations

import array
import collections
import dataclasses
import hmac
from collections.abc import Sequence


@dataclasses.dataclass(frozen=True)
class Reader:
    """Who reads: a decode instance's request (every rank of it), and its TP size."""

    engine: str
    request: str
    tp: int


@dataclasses.dataclass(frozen=True)
class Message:
    """A reader rank's claim, done or renewal, as decoded and bounded by the caller."""

    kind: str
    """``claim``, ``done`` or ``renew``."""
    request: str
    """The prefill's request id."""
    token: str
    reader: Reader
    rank: int
    """The reader's rank (below ``reader.tp``)."""
    reply_to: bytes = b""
    """Where the answer goes (the reader's engine address)."""
    blocks: tuple[Sequence[int], ...] = ()
    """A claim's blocks per KV cache group (as decoded: ``array('i')``)."""


@dataclasses.dataclass(frozen=True)
class Answer:
    """What a prefill rank answers a claim or a done."""

    message: Message
    ok: bool
    """Claim: granted. Done: the blocks were held throughout."""
    why: str | None = None


@dataclasses.dataclass
class Offer:
    token: str
    deadline: float
    latest: float
    """Renewals extend the deadline up to here."""
    blocks: list[frozenset[int]]
    reader: Reader | None = None
    done: set[int] = dataclasses.field(default_factory=set)

    @property
    def read(self) -> bool:
        return self.reader is not None and len(self.done) >= self.reader.tp


def _same(a: str, b: str) -> bool:
    return hmac.compare_digest(a.encode(), b.encode())


def _compact(blocks: Sequence[int]) -> array.array[int]:
    """Block ids as 4 bytes each (as Python ints they take about 40)."""
    if isinstance(blocks, array.array) and blocks.typecode == "i":
        return blocks
    return array.array("i", blocks)


class Offers:
    """A prefill rank's kept requests (see the module docs)."""

    def __init__(self, lease_s: float, max_lease_s: float | None = None, early_s: float = 30.0,
                 max_early: int = 4096, max_early_ids: int = 1 << 20,
                 max_gone: int = 16384) -> None:
        self._lease_s = lease_s
        self._max_lease_s = max(lease_s, max_lease_s or 0.0)
        self._early_s = early_s
        self._max_early = max_early
        self._max_early_ids = max_early_ids
        """Block ids the early messages hold in all (4 MiB at the default)."""
        self._max_gone = max_gone
        self._offers: dict[str, Offer] = {}
        self._early: collections.OrderedDict[int, tuple[float, Message]] = collections.OrderedDict()
        """Messages waiting for their request's offer, by arrival (oldest first), with when."""
        self._early_by_request: dict[str, dict[int, None]] = {}
        """The same messages' arrival numbers, by request (in arrival order)."""
        self._early_ids = 0
        """Block ids the early messages hold."""
        self._early_seq = 0
        self._gone: collections.OrderedDict[str, str] = collections.OrderedDict()
        """Requests freed here, with their tokens (bounded): their readers are told at once."""
        self.dropped = 0
        """Messages dropped: another token, out of bounds, or early ones past the bound."""

    def __contains__(self, request: str) -> bool:
        return request in self._offers

    def __len__(self) -> int:
        return len(self._offers)

    def kept(self) -> set[str]:
        return set(self._offers)

    def offer(self, request: str, token: str, blocks: Sequence[Sequence[int]], now: float,
              lease_s: float | None = None) -> list[Answer]:
        """The request's blocks are kept for a reader from ``now``; answers the messages that
        came for it before."""
        lease = self._lease_s if lease_s is None else lease_s
        self._offers[request] = Offer(token, now + lease, now + max(lease, self._max_lease_s),
                                      [frozenset(g) for g in blocks])
        answers = []
        for key in self._early_by_request.pop(request, {}):
            _, message = self._early.pop(key)
            self._early_ids -= _held_ids(message)
            answer = self.handle(message, now)
            if answer is not None:
                answers.append(answer)
        return answers

    def handle(self, message: Message, now: float) -> Answer | None:
        """A reader's message: its answer, or None (dropped, or waiting for its offer)."""
        if not 0 <= message.rank < message.reader.tp:
            self.dropped += 1
            return None
        offer = self._offers.get(message.request)
        if offer is None:
            gone = self._gone.get(message.request)
            if gone is not None:
                if not _same(gone, message.token):
                    self.dropped += 1
                    return None
                if message.kind == "renew":
                    return None
                return Answer(message, False, "the prefill freed the request's blocks (at their "
                              "lease, or after their reader) before this reader came")
            self._wait(message, now)
            return None
        if not _same(offer.token, message.token):
            self.dropped += 1
            return None
        if offer.reader is not None and (offer.reader.engine, offer.reader.request) != (
                message.reader.engine, message.reader.request):
            return Answer(message, False, f"the request's blocks were claimed by another reader "
                          f"({offer.reader.engine}): a second read is refused")
        if offer.reader is not None and offer.reader.tp != message.reader.tp:
            self.dropped += 1
            return None
        if message.kind == "renew":
            offer.deadline = max(offer.deadline, min(now + self._lease_s, offer.latest))
            return None
        if message.kind == "claim":
            if len(message.blocks) != len(offer.blocks):
                return Answer(message, False, f"claimed {len(message.blocks)} KV cache groups of "
                              f"{len(offer.blocks)}")
            for claimed, offered in zip(message.blocks, offer.blocks):
                if not offered.issuperset(claimed):
                    return Answer(message, False, "claimed blocks that were not offered for "
                                  "this request")
            offer.reader = message.reader
            return Answer(message, True)
        # done: the offer exists with this token, so the blocks held the request's KV since
        # they were offered, and still do.
        offer.reader = message.reader
        offer.done.add(message.rank)
        return Answer(message, True)

    def _wait(self, message: Message, now: float) -> None:
        if message.kind == "renew":
            return
        try:
            message = dataclasses.replace(message, blocks=tuple(map(_compact, message.blocks)))
        except OverflowError:  # an id no block has: a claim of it could not be granted
            self.dropped += 1
            return
        ids = _held_ids(message)
        if ids > self._max_early_ids:
            self.dropped += 1
            return
        while self._early and (len(self._early) >= self._max_early
                               or self._early_ids + ids > self._max_early_ids):
            self._drop_oldest_early()
        self._early_seq += 1
        self._early[self._early_seq] = (now, message)
        self._early_by_request.setdefault(message.request, {})[self._early_seq] = None
        self._early_ids += ids

    def _drop_oldest_early(self) -> None:
        key, (_, message) = self._early.popitem(last=False)
        same_request = self._early_by_request[message.request]
        del same_request[key]
        if not same_request:
            del self._early_by_request[message.request]
        self._early_ids -= _held_ids(message)
        self.dropped += 1

    def poll(self, now: float) -> tuple[set[str], set[str]]:
        """The requests whose blocks may be freed now: (read by every rank of their reader,
        past their lease unread). Both are forgotten here (remembered as gone)."""
        read = {r for r, o in self._offers.items() if o.read}
        expired = {r for r, o in self._offers.items() if not o.read and now >= o.deadline}
        for request in read | expired:
            self._gone[request] = self._offers.pop(request).token
            self._gone.move_to_end(request)
        while len(self._gone) > self._max_gone:
            self._gone.popitem(last=False)
        # Oldest first: the stale ones are at the front.
        while self._early and now - next(iter(self._early.values()))[0] > self._early_s:
            self._drop_oldest_early()
        return read, expired

    def forget(self, request: str) -> None:
        """The request's blocks are freed for another reason (the worker closes)."""
        offer = self._offers.pop(request, None)
        if offer is not None:
            self._gone[request] = offer.token


def _held_ids(message: Message) -> int:
    return sum(len(g) for g in message.blocks)
