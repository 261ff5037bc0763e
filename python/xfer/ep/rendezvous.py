"""Forming an EP group through xfer's rendezvous: the first time, and again at every clean —
a restarted rank (new process, engine, regions) rejoins so.

Each formation has a **generation**. Every rank publishes its record for it (its address,
its two written regions, its epoch) as ``NAME.gG.rR``, takes every rank's record of that
generation (waiting until each appears, by one deadline), then publishes what it took — a
digest of every record and its incarnation — as ``NAME.gG.cR``, and waits for every rank's.
Only when all digests are equal does it ``connect`` (a rank that never connected) or
``clean`` (a member: ``EpGroup.begin_clean`` first) with those records, so every rank forms
the same membership: a record of an incarnation that died during the formation, taken by
some ranks and not others (its name then taken by its successor), fails the formation on
every rank instead (``EpError``; form again, at the next generation). A rank whose formation
fails by its deadline may be the only one: its peers formed and will mask it at their next
step; the next formation takes it back.

The generation: one past the last this rank formed and past every generation another rank's
commit record names — what a restarted rank, which knows nothing, learns so (its peers hold
their records of the last formation until the next one). A caller with its own numbering
(a restart counter) may name it instead.

Records a peer publishes are untrusted: each must be named as its key says, carry exactly
the three regions, an epoch in range, and descriptors that decode, belong to the record's
address and have the sizes this rank's ``EpConfig`` registers (``EpGroup._checked``). The
rendezvous bounds a record's size. Who may publish under the group's names is the
rendezvous's to decide (its cluster secret): a client that can publish ``NAME.gG.rR`` is
taken as rank R (docs/security.md)."""

from __future__ import annotations

import hashlib
import re
import time

from .. import _errors
from .._xfer import MrDesc
from .group import MAX_EPOCH, EpError

# A record carries an address and named descriptors only: the epoch and the digest ride in
# a region's name (its descriptor is the rank's dispatch region again, not read).
_EPOCH_KEY = re.compile(r"epoch\.([0-9]{1,10})")
_AGREE_KEY = re.compile(r"agree\.([0-9a-f]{32})")
_NAME = re.compile(r"[A-Za-z0-9._-]{1,64}")
MAX_GENERATION = 10**9


class EpRendezvous:
    """One rank's side of forming its group through ``rdv`` (an ``xfer.Rendezvous``) under
    ``name`` (1-64 of ``A-Z a-z 0-9 . _ -``, the same on every rank, one group's: records of
    an earlier run under it, alive until their lease ends, would lead a rank to a later
    generation than its peers); records live for ``ttl`` seconds after their process dies."""

    def __init__(self, rdv, name: str, *, ttl: float = 5.0):
        if not isinstance(name, str) or not _NAME.fullmatch(name):
            raise ValueError(f"name must be 1-64 of A-Z a-z 0-9 . _ -, not {name!r}")
        self.rdv, self.name, self.ttl = rdv, name, ttl
        self._commit_name = re.compile(re.escape(name) + r"\.g([0-9]{1,10})\.c([0-9]{1,5})")
        # The last generation formed here, and the publications of it (held until the next:
        # a peer still forming it reads them).
        self.generation: int | None = None
        self._held: list = []

    def _info_key(self, generation: int, rank: int) -> str:
        return f"{self.name}.g{generation}.r{rank}"

    def _commit_key(self, generation: int, rank: int) -> str:
        return f"{self.name}.g{generation}.c{rank}"

    def next_generation(self, rank: int) -> int:
        """One past the last generation formed here and every generation another rank
        committed to."""
        seen = -1 if self.generation is None else self.generation
        for record in self.rdv.list():
            m = self._commit_name.fullmatch(record["name"])
            if m and int(m.group(2)) != rank:
                seen = max(seen, int(m.group(1)))
        return seen + 1

    def _lookup(self, key: str, deadline: float, what: str) -> dict:
        left = deadline - time.monotonic()
        try:
            if left <= 0:
                raise _errors.TimeoutError("no time left")
            return self.rdv.lookup(key, timeout=left)
        except _errors.TimeoutError:
            raise _errors.TimeoutError(f"{what} ({key}) did not appear in the rendezvous by the deadline") from None

    def _info_of(self, record: dict, rank: int, key: str) -> dict:
        """Rank ``rank``'s record as ``EpGroup.connect`` takes it (checked there further)."""
        regions = record.get("regions") or {}
        if record.get("name") != key or len(regions) != 3 or not {"dispatch", "combine"} <= set(regions):
            raise ValueError(f"{key}: not an EP record (regions {sorted(regions)[:4]})")
        (epoch_key,) = set(regions) - {"dispatch", "combine"}
        m = _EPOCH_KEY.fullmatch(epoch_key)
        if not m or int(m.group(1)) > MAX_EPOCH:
            raise ValueError(f"{key}: no epoch in 0..{MAX_EPOCH}")
        return {
            "rank": rank,
            "address": bytes(record["addr"]),
            "dispatch": bytes(regions["dispatch"]),
            "combine": bytes(regions["combine"]),
            "epoch": int(m.group(1)),
        }

    def form(self, group, *, generation: int | None = None, timeout: float = 60.0) -> int:
        """Forms ``group`` (an ``EpGroup``) with every rank at ``generation`` (by default
        ``next_generation``): on every rank together, once nothing is in flight. Returns the
        generation. Raises ``xfer.TimeoutError`` if a rank's record does not appear by
        ``timeout``, ``EpError`` if the ranks took different records."""
        deadline = time.monotonic() + timeout
        rank, ranks = group.rank, group.cfg.ranks
        if generation is None:
            generation = self.next_generation(rank)
        if type(generation) is not int or not 0 <= generation <= MAX_GENERATION:
            raise ValueError(f"generation must be an integer in 0..{MAX_GENERATION}")
        joining = group.peers is None and not group._fenced
        mine = group.local_info() if joining else group.begin_clean()
        desc = MrDesc(mine["dispatch"])
        regions = {"dispatch": desc, "combine": MrDesc(mine["combine"]), f"epoch.{mine['epoch']}": desc}
        published = [self.rdv.publish(self._info_key(generation, rank), mine["address"], regions, ttl=self.ttl)]
        try:
            records = []
            for r in range(ranks):
                key = self._info_key(generation, r)
                records.append((self._lookup(key, deadline, f"rank {r}'s record of generation {generation}"), key))
            infos = [self._info_of(rec, r, key) for r, (rec, key) in enumerate(records)]
            digest = hashlib.sha256(repr([generation] + [
                (rec["incarnation"], i["address"], i["dispatch"], i["combine"], i["epoch"])
                for (rec, _key), i in zip(records, infos)]).encode()).hexdigest()[:32]
            published.append(self.rdv.publish(
                self._commit_key(generation, rank), mine["address"], {f"agree.{digest}": desc}, ttl=self.ttl))
            for r in range(ranks):
                key = self._commit_key(generation, r)
                commit = self._lookup(key, deadline, f"rank {r}'s commit to generation {generation}")
                theirs = [_AGREE_KEY.fullmatch(k) for k in (commit.get("regions") or {})]
                if len(theirs) != 1 or not theirs[0] or theirs[0].group(1) != digest:
                    raise EpError(
                        f"generation {generation}: rank {r} took other records than rank {rank} (an incarnation "
                        "replaced during the formation?): form again, at the next generation")
            if joining:
                group.connect(infos)
            else:
                group.clean(infos)
        except BaseException:
            for p in published:
                p.unpublish()
            raise
        for p in self._held:
            p.unpublish()
        self._held, self.generation = published, generation
        return generation

    def close(self) -> None:
        """Unpublishes this rank's records."""
        for p in self._held:
            p.unpublish()
        self._held = []
