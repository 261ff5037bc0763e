"""How long a lookup of a peer's record in the rendezvous may wait (pure: no clock, no
rendezvous, no threads; ``now`` is passed in, and the caller holds its own lock).

A vLLM request's parameters name the prefill instance its KV is read from, and they come from
the API client (vLLM treats them as attacker-controlled). When every lookup of a name could
wait up to ``lookup_timeout_s`` for its record to appear, on the connector's two lookup
threads, one client sending a fresh engine id with each request kept both threads waiting and
held up every other request's transfers. So:

- A record never found before is only *checked* (one query, no wait): an instance's workers
  publish their records when they start, before any request can name them, so an honest first
  lookup finds the record at once, and a name no record answers fails its own request at once.
- A record found before (its peer restarts, or sleeps and wakes) may be waited for, by at
  most ``max_waiting`` lookups at once (the others only check, so the rest of the lookup
  threads stay free); after a wait that failed it is only checked for a backoff (from
  ``wait_s``, doubling up to ``max_backoff_s``, renewed while checks keep failing), so a dead
  peer holds a thread once per backoff, not once per request.

What it remembers is bounded: the records found and the backoffs, ``max_remembered`` each (the
least recently found, the oldest backoff, forgotten first).
"""

from __future__ import annotations

import collections
from collections.abc import Hashable

MAX_REMEMBERED = 4096
"""Records found (and backoffs) remembered, by default."""


class LookupGate:
    """Decides each lookup's wait: :meth:`begin` before it, :meth:`end` after it."""

    def __init__(self, wait_s: float, *, max_waiting: int = 1,
                 max_remembered: int = MAX_REMEMBERED, max_backoff_s: float = 60.0) -> None:
        self._wait_s = wait_s
        self._max_waiting = max_waiting
        self._max_remembered = max_remembered
        self._max_backoff_s = max(max_backoff_s, wait_s)
        self._found: collections.OrderedDict[Hashable, None] = collections.OrderedDict()
        """Keys whose record was found, least recently found first."""
        self._backoff: collections.OrderedDict[Hashable, tuple[float, float]] = (
            collections.OrderedDict())
        """Keys found before whose wait failed: (only checked until, backoff)."""
        self.waiting = 0
        """Lookups allowed to wait that have not ended."""

    def begin(self, key: Hashable, now: float) -> float:
        """How long the lookup of ``key`` may wait for its record (0: check only). A
        positive answer holds one of the ``max_waiting`` places until :meth:`end`."""
        if key not in self._found:
            return 0.0
        backoff = self._backoff.get(key)
        if (backoff is not None and now < backoff[0]) or self.waiting >= self._max_waiting:
            return 0.0
        self.waiting += 1
        return self._wait_s

    def end(self, key: Hashable, waited: float, found: bool, now: float) -> None:
        """The lookup of ``key`` that :meth:`begin` allowed ``waited`` ended."""
        if waited > 0:
            self.waiting -= 1
        if found:
            self._found[key] = None
            self._found.move_to_end(key)
            while len(self._found) > self._max_remembered:
                self._found.popitem(last=False)
            self._backoff.pop(key, None)
            return
        previous = self._backoff.pop(key, None)
        if waited > 0:
            backoff = min(self._max_backoff_s, 2 * previous[1] if previous else self._wait_s)
        elif previous is not None:
            backoff = previous[1]  # still gone: checks only, for as long again
        else:
            return  # never found, or checked only because the waiting places were taken
        self._backoff[key] = (now + backoff, backoff)
        while len(self._backoff) > self._max_remembered:
            self._backoff.popitem(last=False)

    def found_before(self, key: Hashable) -> bool:
        """Whether ``key``'s record was found (and is still remembered)."""
        return key in self._found
