"""Why one file: it is the module SGLang imports as its transfer backend — the manager,
sender, receiver and bootstrap classes its scheduler instantiates share one set of records
and one engine per process.

xfer as an SGLang disaggregation transfer backend (SGLang 0.5's ``disaggregation/base``).

Why one file: it is the module SGLang's entry point loads, holding the four classes SGLang
instantiates (bootstrap server, manager, sender, receiver); the sender and receiver read and
write their manager's state (peers, rooms, aborts, one lock), so they stay beside it. What
needs no SGLang — the rank mapping between TP sizes and the published KV shape — is
``sglang_layout``; page arithmetic and message framing are ``pages``.

SGLang pushes: the decode instance allocates pages for a request and sends their indices to
the prefill instance (``KVReceiver.send_metadata``), which writes each chunk of KV pages into
them as it computes (``KVSender.send``) — one paged write per KV buffer per chunk, pages from
indices — then the auxiliary data, then tells the decode instance by bootstrap room. Both sides
poll ``KVPoll`` states: Bootstrapping → WaitingForInput → Transferring → Success or Failed.

Select it with ``--disaggregation-transfer-backend xfer``: the package declares an
``sglang.srt.plugins`` entry point, which SGLang runs in every process it starts (its CLI
before parsing the arguments, each spawned scheduler), and which adds the choice and the
classes (SGLang has no registry of transfer backends: ``register`` patches its enum and
``get_kv_class``). The engine config comes from ``$XFER_CONFIG`` (or an earlier
``xfer.sglang.register(config=...)`` in the same process).

**Decode queues**: besides ``base/conn.py``, the manager and receiver have what SGLang's
decode queues read (``prefill_info_table``, ``try_ensure_parallel_info``, ``kv_args``,
``kv_mgr``, ``bootstrap_infos``, ``conclude_state``), and the deferred release of an aborted
room: the decode rank tells its prefill ranks (``ensure_abort_notified``), each cancels what
it has in flight, writes nothing more to the room and answers; SGLang frees the pages once
all answered (``kv_mgr.is_abort_release_safe``). Prefill ranks register at the bootstrap
host SGLang names (``--dist-init-addr``'s host across nodes, else ``--host``).

**Bootstrap**: the prefill instance's bootstrap server is xfer's rendezvous service
(``xfer.Server`` on the bootstrap host and port; it serves loopback only unless
``$XFER_SECRET_FILE`` names the cluster secret). Prefill ranks publish
``sglang.prefill.<dp>.<rank>``, with their KV layout (attention TP size, heads per rank, page
size, buffers, MLA, DP groups) in the name of the one region they publish; a decode rank publishes its KV
buffers there as ``sglang.decode.<id>.<rank>`` when it first meets that prefill — only at
the bootstraps ``$XFER_SGLANG_PREFILL_BOOTSTRAPS`` lists (``host:port,...``; ``*``: any;
unset: loopback ones only): SGLang takes the address from the request, that is from its API
client, and a request naming another fails, naming why. Its first contact with a bootstrap (the
dial, the greeting, the prefill's record) runs off SGLang's scheduler thread, at most
``MAX_CONTACTS`` at once; a failed dial is not tried again within its backoff. Engines use
``$XFER_CONFIG`` (or the config given to ``register``); without either, the backend refuses
to start.

**Tensor parallelism**: prefill and decode may run different attention TP sizes (one divides
the other). A decode rank with fewer heads than a prefill rank receives its slice of one
prefill rank's heads; one with more receives from each of several prefill ranks into its
place — token by token, as ``pages.read_plan`` plans reads, turned around into writes.
MLA's latent is the same on every rank: one prefill rank writes it. Every prefill rank a decode
rank names gets its page indices and answers done (one with nothing to write at once), so every
prefill sender ends. Layouts that cannot exchange (page size, buffers, heads, MLA) are refused
by name at ``init``.

**Data parallelism**: each DP group of the prefill (``--dp-size``: attention DP groups under
``--enable-dp-attention``, else replicas) publishes its own ranks; a decode rank learns the
group count with the layout (SGLang's ``PrefillServerInfo.dp_size``), SGLang picks a request's
group (``follow_bootstrap_room``: its room modulo the count) and the receiver sends to that
group's ranks. A decode rank whose ``KVArgs`` carry no head count (SGLang's decode queue sets
none) takes it from the prefill's total.

**Prefix reuse**: a decode instance holding a prefix sends ``decode_prefix_len``; the prefill
sends from there (``pop_decode_prefix_len``).

**Control messages** are untrusted input (``sglang_control``): a decode rank's indices and
aborts carry its room's token and a proof under the key it published at the bootstrap, and
name only pages it published; answers carry the room's token; each is taken only from the
engine its record names where the transport proves senders. Refused ones are counted
(``dropped``).

**Memory release** (``deregister_buffer_to_engine`` / ``register_buffer_to_engine``, from
SGLang's ``release/resume_memory_occupation``) drops and remakes the registrations; a decode
rank republishes under a new name. **Rebootstrap** of a retracted decode request
(``submit_prefill_recompute``) posts SGLang's payload to the prefill's ``/generate``.
Pipeline parallelism, DP routing other than by bootstrap room, and replicated KV heads
between TP sizes are refused by name.

**Failures** — a peer gone (a decode rank watches the bootstrap records of the prefill ranks
it waits on, off the scheduler thread), a refused write, no answer within
``transfer_timeout_s`` — end in
``KVPoll.Failed`` with ``failure_exception()`` naming the cause, on both sides; ``abort()``
ends a transfer at once. State (Mamba/SWA/NSA) buffers are refused when the manager starts:
not yet (issue 28).
"""

from __future__ import annotations

import concurrent.futures
import dataclasses
import logging
import os
import threading
import time
import uuid
from typing import Any

import numpy as np
from sglang.srt.disaggregation.base.conn import (
    BaseKVBootstrapServer,
    BaseKVManager,
    BaseKVReceiver,
    BaseKVSender,
    KVArgs,
    KVPoll,
    KVTransferMetric,
)
from sglang.srt.disaggregation.utils import DisaggregationMode

import xfer
from xfer.rendezvous_security import RendezvousSecurity

from . import sglang_control as sc
from .control import ControlError, new_token
from .pages import LayoutError, read_plan
from .sglang_layout import PROTOCOL, KvShape, decode_sources, prefill_targets

logger = logging.getLogger("xfer.sglang")

NAME = "xfer"

_config: Any = None


def _env_seconds(name: str, default: float) -> float:
    try:
        value = float(os.environ.get(name, default))
    except ValueError:
        return default
    return value if value > 0 else default


transfer_timeout_s = _env_seconds("SGLANG_DISAGGREGATION_WAITING_TIMEOUT", 300.0)
"""How long a receiver waits for its data, and a sender for its peer's indices: SGLang's own
``SGLANG_DISAGGREGATION_WAITING_TIMEOUT`` (300 s unless set), as its backends wait."""
lookup_timeout_s = 5.0
"""How long a lookup of a peer's record may wait where SGLang's scheduler thread waits on it
(a decode rank publishes its record before it sends its indices: it is there or gone)."""
MAX_ABORTED = 4096
"""Aborted rooms a prefill rank remembers (the oldest are forgotten first)."""
MAX_ROOMS = 4096
"""Rooms a prefill rank holds decode indices for at once (a meta past it is dropped)."""
MAX_CHECKS = 64
"""Messages a prefill rank holds while it looks up the decode rank they name (off the
engine's callback thread); more are dropped."""
record_wait_s = 0.25
"""How long a prefill rank waits for the record of a decode rank a message names: a decode
rank publishes it before it sends anything, so one that is not there is forged or gone."""
watch_interval_s = 1.0
"""How often a decode rank checks that the prefill ranks it waits on are still there (their
bootstrap records are leases of 5 s)."""


PREFILL_BOOTSTRAPS_ENV = "XFER_SGLANG_PREFILL_BOOTSTRAPS"
"""The bootstrap addresses (``host:port``, comma-separated) of the prefill instances a decode
instance may receive from; ``*``: any. Unset: loopback ones only. SGLang takes a request's
bootstrap address from its API client (``bootstrap_host`` / ``bootstrap_port``), and a decode
rank publishes its key and writable KV descriptors at the bootstrap it dials: only the ones
the operator listed (or, by default, its own host's) are dialled."""
MAX_REFUSED = 1024
"""Bootstrap addresses a decode rank remembers refusing (the oldest are forgotten first)."""
MAX_CONTACTS = 8
"""First contacts with bootstraps (the dial, the greeting, the prefill's record) a decode rank
has in flight at once, each on a thread of its own, off SGLang's scheduler thread. A request
naming yet another new bootstrap while they are all in flight fails, naming this bound."""
CONTACT_BACKOFF_S = 1.0
"""How long a bootstrap whose dial failed is not dialled again: this after its first failure
(SGLang's decode queue asks once a second), doubling with each failure after, at most
``MAX_CONTACT_BACKOFF_S``."""
MAX_CONTACT_BACKOFF_S = 60.0
MAX_UNREACHABLE = 1024
"""Bootstraps whose dial failed a decode rank remembers (the oldest failure forgotten first)."""

_LOOPBACK_NAMES = ("localhost", "localhost.localdomain", "ip6-localhost")


def dialable_bootstraps(addr: str, allowed: str | None) -> bool:
    """Whether a decode rank may dial the bootstrap at ``addr`` (``host:port`` as SGLang
    writes it, IPv6 hosts in brackets), ``allowed`` being ``$XFER_SGLANG_PREFILL_BOOTSTRAPS``:
    a comma-separated list of ``host:port`` (compared as written), ``*`` for any; unset or
    empty, loopback addresses only."""
    import ipaddress

    if allowed is not None and allowed.strip():
        listed = {a.strip() for a in allowed.split(",") if a.strip()}
        return "*" in listed or addr in listed
    host, _, port = addr.rpartition(":")
    if not port.isdigit():
        return False
    host = host.strip("[]")
    if host.lower() in _LOOPBACK_NAMES:
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


class BootstrapRefused(RuntimeError):
    """A request named a bootstrap this decode instance was not configured to dial."""


class DialBackoff:
    """The bootstrap addresses whose dial failed, each not dialled again until its backoff
    ends: ``first_s`` after its first failure, doubling with each failure after, at most
    ``max_s``; a dial that gets through forgets the address. At most ``limit`` addresses (the
    oldest failure forgotten first): a request names its own address, the table must not grow
    with them. Pure: ``now`` is passed in, the caller holds its lock."""

    def __init__(self, first_s: float, max_s: float, limit: int) -> None:
        self._first_s, self._max_s, self._limit = first_s, max(max_s, first_s), limit
        self._failed: dict[str, tuple[float, float, int, str]] = {}
        """By address: (not dialled until, backoff, failures in a row, the last one's why),
        oldest failure first."""
        self.failures = 0
        """Dials that failed, in all."""

    def failed(self, addr: str, now: float, why: str) -> float:
        """The dial of ``addr`` failed at ``now``: its backoff (also returned)."""
        previous = self._failed.pop(addr, None)
        backoff = self._first_s if previous is None else min(self._max_s, 2 * previous[1])
        self._failed[addr] = (now + backoff, backoff, 1 if previous is None else previous[2] + 1,
                              why)
        self.failures += 1
        while len(self._failed) > self._limit:
            del self._failed[next(iter(self._failed))]
        return backoff

    def succeeded(self, addr: str) -> None:
        self._failed.pop(addr, None)

    def waiting(self, addr: str, now: float) -> str | None:
        """Why ``addr`` is not dialled at ``now`` (its backoff has not ended), else None."""
        entry = self._failed.get(addr)
        if entry is None or now >= entry[0]:
            return None
        until, _, count, why = entry
        return (f"its dial failed {count} time{'s' if count > 1 else ''} in a row (last: "
                f"{why[:200]}); not dialled again for {until - now:.1f} s")


def _engine_config() -> Any:
    if _config is not None:
        return _config
    if os.environ.get("XFER_CONFIG"):
        return None  # the engine reads it
    raise ValueError(
        "the xfer transfer backend needs an engine config: xfer.sglang.register(config=...) "
        "or $XFER_CONFIG"
    )


def _bootstrap_host(server_args: Any) -> str:
    """Where the prefill's bootstrap server is: the host of ``--dist-init-addr`` across nodes
    (where SGLang's own backends register), else the serving ``--host``."""
    addr = getattr(server_args, "dist_init_addr", None)
    if addr:
        return str(addr).rsplit(":", 1)[0].strip("[]")
    host = getattr(server_args, "host", None)
    return "127.0.0.1" if not host or host in ("0.0.0.0", "::") else str(host)


def _dp(args: KVArgs, server_args: Any, attn_tp: int) -> tuple[int, int]:
    """This rank's data-parallel group and the number of groups: under DP attention the
    groups split one TP group (``engine_rank`` over attention TP), else each DP replica is a
    TP group of its own (``system_dp_rank``). As SGLang's bootstrap counts them, either way
    ``--dp-size`` groups."""
    size = int(getattr(server_args, "dp_size", 1) or 1)
    if size == 1:
        return 0, 1
    if getattr(server_args, "enable_dp_attention", False):
        return int(args.engine_rank) // attn_tp, size
    return int(getattr(args, "system_dp_rank", 0) or 0), size


def _attn_tp(server_args: Any) -> int:
    """The attention TP size: ranks over which KV heads are split (TP over attention-DP)."""
    tp = int(getattr(server_args, "tp_size", 1) or 1)
    dp = int(getattr(server_args, "dp_size", 1) or 1)
    return tp // dp if getattr(server_args, "enable_dp_attention", False) and dp > 1 else tp


def _refuse_unsupported(server_args: Any, mode: DisaggregationMode) -> None:
    """Refuses by name, when the manager starts, the set-ups this backend cannot serve
    (SGLang would otherwise run them and move the wrong pages, or none)."""
    pp = int(getattr(server_args, "pp_size", 1) or 1)
    if pp > 1:
        raise NotImplementedError(
            f"the xfer transfer backend does not support pipeline parallelism (--pp-size {pp}): "
            "each stage holds other layers under the same rank names; use another backend")
    dp = int(getattr(server_args, "dp_size", 1) or 1)
    method = getattr(server_args, "load_balance_method", None) or "auto"
    if mode == DisaggregationMode.PREFILL and dp > 1 and method not in (
            "auto", "follow_bootstrap_room"):
        # "auto" is follow_bootstrap_room on a prefill instance (SGLang's serving_hook).
        raise NotImplementedError(
            f"the xfer transfer backend finds a request's prefill DP group from its bootstrap "
            f"room: --load-balance-method {method} with --dp-size {dp} is not supported (use "
            "follow_bootstrap_room)")
    from sglang.srt.environ import envs

    if mode == DisaggregationMode.DECODE and envs.SGLANG_DISAGGREGATION_FORCE_QUERY_PREFILL_DP_RANK.get():
        raise NotImplementedError(
            "the xfer transfer backend does not answer prefill DP rank queries: "
            "SGLANG_DISAGGREGATION_FORCE_QUERY_PREFILL_DP_RANK is not supported (the prefill "
            "routes by bootstrap room)")


def _prefill_name(dp: int, rank: int) -> str:
    """A prefill rank's bootstrap record: its DP group, its attention-TP rank."""
    return f"sglang.prefill.{dp}.{rank}"


class XferKVBootstrapServer(BaseKVBootstrapServer):
    """The prefill instance's bootstrap server: xfer's rendezvous service."""

    def __init__(self, host: str, port: int):
        # The cluster secret: the engine config's (register's, else $XFER_CONFIG's), else
        # $XFER_SECRET_FILE (xfer.rendezvous_security).
        security = RendezvousSecurity.of(_config, who="XferKVBootstrapServer")
        self.server = xfer.Server(f"{host}:{port}", secret_file=security.secret_file)

    @property
    def url(self) -> str:
        return self.server.url

    def close(self) -> None:
        self.server.close()


class XferKVManager(BaseKVManager):
    """One per rank: the engine, the registered KV and aux buffers, messages in and out.

    Besides ``base/conn.py`` it has what SGLang 0.5.23's decode queues read of a manager
    (``disaggregation/decode.py``): ``prefill_info_table`` and ``try_ensure_parallel_info``
    (the prefill's topology, learnt once per bootstrap address off the scheduler thread: each
    call answers at once), the deferred release of aborted rooms' pages
    (``is_abort_release_safe``, ``clear_deferred_abort_state``) and the flags it checks."""

    supports_host_destination = False
    """Pages are written into device (or registered) KV buffers only."""
    enable_deferred_decode_kv_release = True
    """An aborted room's pages are freed once its prefill ranks said nothing is in flight."""
    defer_decode_allocation = False

    def __init__(self, args: KVArgs, disaggregation_mode: DisaggregationMode, server_args: Any,
                 is_mla_backend: bool | None = False):
        self.args = self.kv_args = args  # SGLang's queues read ``kv_args``
        self.mode = disaggregation_mode
        self.server_args = server_args
        state = [p for group in (getattr(args, "state_data_ptrs", None) or []) for p in group]
        if state:
            raise NotImplementedError(
                f"the xfer transfer backend does not move state buffers yet ({len(state)} "
                "Mamba/SWA/NSA state tensors registered); use another backend for this model")
        _refuse_unsupported(server_args, disaggregation_mode)
        self.tp = _attn_tp(server_args)
        self.rank = int(args.engine_rank) % self.tp
        self.dp, self.dp_size = _dp(args, server_args, self.tp)
        self.mla = bool(is_mla_backend)
        lens = list(args.kv_item_lens)
        if len(set(lens)) > 1:
            raise LayoutError(f"KV buffers of different page sizes {sorted(set(lens))}: "
                              "the xfer transfer backend needs one")
        heads = 1 if self.mla else int(getattr(args, "kv_head_num", 0) or 0)
        self.heads_known = bool(heads)
        """SGLang's decode queue puts no head count in its ``KVArgs`` (its own backends take
        the decode's from the prefill's total): such a rank learns it from the first prefill
        it meets (``try_ensure_parallel_info``)."""
        self.shape = KvShape(tp=self.tp, heads=heads, page_size=int(args.page_size),
                             item_len=lens[0] if lens else 0, buffers=len(lens), mla=self.mla,
                             dp=self.dp_size,
                             total=0 if self.mla else int(getattr(args, "total_kv_head_num", 0) or 0))
        if not self.heads_known and disaggregation_mode == DisaggregationMode.PREFILL:
            self.shape = dataclasses.replace(self.shape, heads=1)
        if disaggregation_mode == DisaggregationMode.PREFILL:
            self.shape = dataclasses.replace(
                self.shape, http=int(getattr(server_args, "port", 0) or 0) % 65536)
        self.rendezvous_security = RendezvousSecurity.of(_engine_config(), who="XferKVManager")
        """What this rank's bootstrap clients connect with (the cluster secret), refused at
        start if it cannot work."""
        self.engine = xfer.TransferEngine(_engine_config())
        self._register()
        self.id = uuid.uuid4().hex[:12]
        self.lock = threading.Lock()
        self.metadata: dict[int, dict[int, sc.Meta]] = {}
        """Prefill: each room's decode destinations by decode rank, as their receivers sent
        them (each checked against the decode rank's record: ``sglang_control``)."""
        self.rooms = sc.DecodeRooms()
        """Decode: the rooms this rank's receivers sent indices for, their tokens and the
        prefill ranks' answers."""
        self.key = sc.new_key()
        """Decode: the key this rank's metas and aborts are proven under, published in its
        bootstrap records (``sglang_control``)."""
        self.dropped = 0
        """Messages refused (malformed, forged, stale or past a bound): counted, never acted
        on."""
        self.checks = 0
        """Prefill: messages waiting for the lookup of the decode rank they name."""
        self.rendezvous: dict[str, xfer.Rendezvous] = {}
        self.publications: list[Any] = []
        self.decode_publications: list[Any] = []
        """Decode: its records at the prefills' bootstraps (withdrawn when SGLang releases the
        KV memory)."""
        self.released = False
        """SGLang released the KV memory (``release_memory_occupation``): nothing registered."""
        self.recompute: concurrent.futures.ThreadPoolExecutor | None = None
        """Decode: rebootstrap calls (``_ensure_prefill_recompute_executor``)."""
        self.published_at: set[str] = set()
        """Decode: the bootstraps this rank's buffers were published at."""
        self.peers: dict[str, dict[str, Any]] = {}
        """Prefill: decode ranks' records, by name."""
        self.prefill_info_table: dict[str, Any] = {}
        """Decode: each bootstrap address's prefill topology (SGLang's ``PrefillServerInfo``)."""
        self.prefill_shapes: dict[str, KvShape] = {}
        self.refusals: dict[str, str] = {}
        """Decode: the prefills this rank cannot receive from, and why."""
        self.refused: dict[str, str] = {}
        """Decode: bootstraps requests named that this rank may not dial, and why (at most
        ``MAX_REFUSED``)."""
        self.contacts: dict[str, concurrent.futures.Future] = {}
        """Decode: the first contacts with bootstraps in flight, by address (at most
        ``MAX_CONTACTS``), on ``contact_pool``."""
        self.contact_pool: concurrent.futures.ThreadPoolExecutor | None = None
        self.contacts_made = 0
        """Decode: first contacts started (each dials its bootstrap unless a client of it is
        already open)."""
        self.unreachable = DialBackoff(CONTACT_BACKOFF_S, MAX_CONTACT_BACKOFF_S, MAX_UNREACHABLE)
        """Decode: bootstraps whose dial failed, not dialled again within their backoff."""
        self.crowded: dict[str, str] = {}
        """Decode: bootstraps whose first contact could not start (``MAX_CONTACTS`` others in
        flight), and why: the receivers waiting on them fail (at most ``MAX_REFUSED``; an
        entry goes when a contact with its address starts)."""
        self.senders: dict[int, Any] = {}
        """Prefill: the senders by room, for a decode rank's abort."""
        self.aborted: dict[int, float] = {}
        """Prefill: rooms a decode rank whose indices they hold aborted (when): nothing more
        is written there."""
        self.pre_aborted: dict[tuple[int, str, str], float] = {}
        """Prefill: aborts that came before their decode rank's indices (delivery is
        unordered), by room, decode rank and token (when): bound to them, so indices that
        arrive later with that decode rank and token are never written to, and an abort in
        another decode rank's name (or with another token) never touches the room."""
        self.watched: dict[int, Any] = {}
        """Decode: the receivers whose prefill ranks may still write, by room (the watch
        thread fails their rooms if one of those ranks is gone)."""
        self.closing = threading.Event()
        self.watcher: threading.Thread | None = None
        self.own_bootstrap: str | None = None
        """Prefill: the bootstrap this rank registered at, where its decode ranks publish."""
        self.draining = concurrent.futures.ThreadPoolExecutor(
            max_workers=2, thread_name_prefix="xfer-sglang-abort")
        """Prefill: aborts are drained and answered here (a cancel waits until no NIC
        touches the memory): two threads, not one per message."""
        try:
            # Each message with the sender the transport proved (b"" where it cannot tell).
            self.engine.submit_recvs(65536, 64, self._on_message, with_sender=True)
        except TypeError:  # a binding without sender identity: the token and proof alone
            self.engine.submit_recvs(65536, 64, self._on_message)
        if disaggregation_mode == DisaggregationMode.PREFILL:
            self.register_to_bootstrap()

    def try_ensure_parallel_info(self, bootstrap_addr: str) -> bool:
        """Whether the prefill's topology at ``bootstrap_addr`` is known; if not, its first
        contact is started (or left running) and the answer is "not yet": SGLang's decode
        queue calls this on its scheduler thread and asks again a second later, 15 times an
        address, so nothing here waits on the network (review M-D: a listener that accepted
        and stayed silent held the scheduler 5 s an attempt, the rendezvous client's greeting
        read). A bootstrap whose dial failed is not dialled again within its backoff
        (``unreachable``); past ``MAX_CONTACTS`` in flight, the requests naming a new one fail,
        naming the bound (``crowded``, read by their receivers' ``poll``).

        A prefill this rank cannot receive from is answered too (SGLang's queue would raise
        the error in its scheduler loop, and end the decode instance): its receivers fail at
        ``init``, naming the difference (``refusals``)."""
        if bootstrap_addr in self.prefill_info_table:
            return True
        from sglang.srt.disaggregation.common.conn import PrefillServerInfo

        try:
            self._may_dial(bootstrap_addr)
        except BootstrapRefused as e:
            # Answered, so SGLang's queue neither retries nor asks the address for DP ranks
            # over HTTP: the request fails at ``init``, naming why. At most MAX_REFUSED kept
            # (each request names its own address: the table must not grow with them).
            logger.warning("xfer.sglang: %s", e)
            with self.lock:
                while len(self.refused) >= MAX_REFUSED:
                    old = next(iter(self.refused))
                    del self.refused[old]
                    self.prefill_info_table.pop(old, None)
                self.refused[bootstrap_addr] = str(e)
            self.prefill_info_table[bootstrap_addr] = PrefillServerInfo(
                attn_tp_size=1, attn_cp_size=1, dp_size=1, pp_size=1,
                page_size=self.shape.page_size, kv_cache_dtype=None, follow_bootstrap_room=True)
            return True
        self._contact(bootstrap_addr)
        return bootstrap_addr in self.prefill_info_table

    def _contact(self, addr: str) -> concurrent.futures.Future | None:
        """The first contact with the bootstrap at ``addr`` in flight, started here unless
        its dial failed within its backoff or ``MAX_CONTACTS`` others are in flight (then
        ``crowded`` says so, and None)."""
        with self.lock:
            job = self.contacts.get(addr)
            if job is not None:
                return job
            if self.unreachable.waiting(addr, time.monotonic()) is not None:
                return None
            if len(self.contacts) >= MAX_CONTACTS:
                if addr not in self.crowded:
                    while len(self.crowded) >= MAX_REFUSED:
                        del self.crowded[next(iter(self.crowded))]
                    self.crowded[addr] = (
                        f"the bootstrap {addr[:80]!r} a request named was not contacted: "
                        f"{MAX_CONTACTS} first contacts with other bootstraps are in flight "
                        "(xfer.sglang.MAX_CONTACTS)")
                    logger.warning("xfer.sglang: %s", self.crowded[addr])
                return None
            if self.contact_pool is None:
                self.contact_pool = concurrent.futures.ThreadPoolExecutor(
                    max_workers=MAX_CONTACTS, thread_name_prefix="xfer-sglang-contact")
            try:
                # Under the lock: the job removes itself from ``contacts`` under it, so only
                # after it is there.
                job = self.contact_pool.submit(self._first_contact, addr)
            except RuntimeError:  # closing
                return None
            self.crowded.pop(addr, None)
            self.contacts[addr] = job
            self.contacts_made += 1
            return job

    def _first_contact(self, addr: str) -> None:
        """Off the scheduler thread: dials the bootstrap at ``addr`` (one try; a failed dial
        starts or doubles its backoff), looks up the prefill's first rank there and records
        its topology (``prefill_info_table``, where SGLang's queue finds it next time it
        asks). No record yet is not a failed dial: the next attempt looks again."""
        try:
            try:
                rdv = self._bootstrap(addr)
            except Exception as e:  # noqa: BLE001 - refused, closed, silent, not a rendezvous
                with self.lock:
                    backoff = self.unreachable.failed(addr, time.monotonic(), str(e))
                logger.info("xfer.sglang: the bootstrap at %s did not answer (%s); not dialled "
                            "again for %.1f s", addr, e, backoff)
                raise
            with self.lock:
                self.unreachable.succeeded(addr)
            try:
                first = rdv.lookup(_prefill_name(0, 0), 1.0)
            except Exception as e:  # noqa: BLE001 - not up yet: the queue tries again
                logger.info("xfer.sglang: no prefill at %s yet (%s)", addr, e)
                raise
            self._learn(addr, first)
        finally:
            with self.lock:
                self.contacts.pop(addr, None)

    def _learn(self, addr: str, first: dict[str, Any]) -> None:
        """Records the topology of the prefill whose first rank's record is ``first``; the
        table entry SGLang's queue looks for is written last, once the rest is there."""
        from sglang.srt.disaggregation.common.conn import PrefillServerInfo

        names = list(first["regions"])
        with self.lock:
            try:
                if len(names) != 1:
                    raise LayoutError(f"it published {names}: not an xfer SGLang prefill of "
                                      f"protocol {PROTOCOL}")
                prefill = KvShape.parse(names[0])
                self._with_heads_of(prefill).check_pair(prefill)
            except LayoutError as e:
                logger.error("xfer.sglang: the prefill at %s cannot send here: %s", addr, e)
                self.refusals[addr] = str(e)
                self.prefill_info_table[addr] = PrefillServerInfo(
                    attn_tp_size=1, attn_cp_size=1, dp_size=1, pp_size=1,
                    page_size=self.shape.page_size, kv_cache_dtype=None,
                    follow_bootstrap_room=True)
                return
            self.shape = self._with_heads_of(prefill)
            self.heads_known = True
            self.prefill_shapes[addr] = prefill
            self.prefill_info_table[addr] = PrefillServerInfo(
                attn_tp_size=prefill.tp, attn_cp_size=1, dp_size=prefill.dp, pp_size=1,
                page_size=prefill.page_size, kv_cache_dtype=None, follow_bootstrap_room=True,
                prefill_http_port=prefill.http or None)

    def learn_prefill_now(self, addr: str) -> None:
        """For a receiver ``init`` called before ``try_ensure_parallel_info`` answered (SGLang's
        queue never does; direct callers may): waits for the first contact with ``addr``
        (raises, naming why, where there is no prefill to receive from)."""
        if self.try_ensure_parallel_info(addr):
            return
        with self.lock:
            job = self.contacts.get(addr)
        if job is not None:
            try:
                job.result()
            except Exception as e:  # noqa: BLE001 - named below
                raise RuntimeError(f"its bootstrap did not answer ({e})") from None
        if addr not in self.prefill_info_table:
            with self.lock:
                why = self.crowded.get(addr) or self.unreachable.waiting(addr, time.monotonic())
            raise RuntimeError(why or "its bootstrap did not answer")

    def _with_heads_of(self, prefill: KvShape) -> KvShape:
        """This rank's shape, its head count taken from the prefill's total where SGLang gave
        none (as its own backends take the decode's: total heads over attention TP)."""
        if self.heads_known or self.mla:
            return self.shape
        total = prefill.total or prefill.heads * prefill.tp
        if total < self.tp:
            # As SGLang's pools size a rank: at least one head, copies of it past the total.
            return dataclasses.replace(self.shape, heads=1, total=total)
        if total % self.tp:
            raise LayoutError(f"the prefill's {total} KV heads do not split over decode TP "
                              f"{self.tp}")
        return dataclasses.replace(self.shape, heads=total // self.tp, total=total)

    def _ensure_prefill_recompute_executor(self) -> concurrent.futures.ThreadPoolExecutor:
        """Where SGLang's decode queue runs a retracted request's rebootstrap ``/generate``
        (``submit_prefill_recompute``) and its prefill DP-rank queries: one pool per manager
        (``SGLANG_DISAGGREGATION_THREAD_POOL_SIZE`` threads, else 4)."""
        with self.lock:
            if self.recompute is None:
                from sglang.srt.environ import envs

                workers = envs.SGLANG_DISAGGREGATION_THREAD_POOL_SIZE.get() or 4
                self.recompute = concurrent.futures.ThreadPoolExecutor(
                    max_workers=max(1, int(workers)), thread_name_prefix="xfer-sglang-rebootstrap")
            return self.recompute

    def submit_prefill_recompute(self, kv_receiver: Any, payload: dict[str, Any]) -> None:
        """A retracted decode request rebootstraps (SGLang's decode queue calls this after
        the receiver sent its new indices): the prefill instance is asked to compute it again
        (``POST /generate`` with SGLang's payload, the same bootstrap room) at the HTTP port
        it published with its layout, on its bootstrap's host, off the scheduler thread.
        Every decode rank of the request gets here; one asks (attention TP rank 0, as
        SGLang's own backends elect it): the prefill instance sends every rank its share.
        A prefill without a known port, or a failed call, fails the request, naming it."""
        if self.rank != 0:
            return
        info = self.prefill_info_table.get(kv_receiver.addr)
        port = getattr(info, "prefill_http_port", None)
        if not port:
            kv_receiver.fail(f"room {kv_receiver.room}: the prefill at {kv_receiver.addr} "
                             "published no HTTP port to rebootstrap a retracted request at")
            return
        url = f"http://{kv_receiver.addr.rsplit(':', 1)[0]}:{port}/generate"
        self._ensure_prefill_recompute_executor().submit(self._recompute, kv_receiver, url,
                                                         payload)

    def _recompute(self, receiver: Any, url: str, payload: dict[str, Any]) -> None:
        import json
        import urllib.request

        try:
            request = urllib.request.Request(url, data=json.dumps(payload).encode(),
                                             headers={"Content-Type": "application/json"})
            with urllib.request.urlopen(request, timeout=transfer_timeout_s) as answer:
                answer.read()
        except Exception as e:  # noqa: BLE001 - HTTP errors, refused connections: that request
            receiver.fail(f"room {receiver.room}: the rebootstrap /generate at {url} "
                          f"failed: {e}")

    def should_verify_kv_checksum(self, bootstrap_addr: str) -> bool:
        return False

    def is_abort_release_safe(self, bootstrap_room: int, required_acks: int) -> bool:
        """Every prefill rank the room's pages went to answered its abort."""
        with self.lock:
            room = self.rooms.rooms.get(int(bootstrap_room))
            return room is not None and len(room.acks or ()) >= required_acks

    def clear_deferred_abort_state(self, bootstrap_room: int) -> None:
        with self.lock:
            room = self.rooms.rooms.get(int(bootstrap_room))
            if room is not None:
                room.acks = None

    def _bootstrap(self, addr: str) -> xfer.Rendezvous:
        """The rendezvous client of the bootstrap at ``addr``. A decode rank dials only the
        bootstraps ``$XFER_SGLANG_PREFILL_BOOTSTRAPS`` allows (``dialable_bootstraps``): it
        publishes its key and writable KV descriptors at what it dials, and SGLang takes
        the address from the request (raises :class:`BootstrapRefused`)."""
        with self.lock:
            r = self.rendezvous.get(addr)
        if r is None:
            self._may_dial(addr)
            # One connection try: SGLang's decode queue retries each address once a second
            # (up to 15 times), and a failed dial is not tried again within its backoff — a
            # retry loop here held a contact 2 s an attempt for every request naming a dead
            # address (review M-D). Lookups carry their own waits.
            r = self.rendezvous_security.connect(f"xfer://{addr}", connect_timeout=0.0)
            with self.lock:
                self.rendezvous[addr] = r
        return r

    def _may_dial(self, addr: str) -> None:
        """Raises :class:`BootstrapRefused` where this decode rank may not dial ``addr``
        (``$XFER_SGLANG_PREFILL_BOOTSTRAPS``; no network)."""
        if self.mode == DisaggregationMode.PREFILL or addr in self.rendezvous:
            return
        allowed = os.environ.get(PREFILL_BOOTSTRAPS_ENV)
        if not dialable_bootstraps(addr, allowed):
            raise BootstrapRefused(
                f"the bootstrap {addr[:80]!r} a request named is not one this decode "
                f"instance may dial (${PREFILL_BOOTSTRAPS_ENV}: "
                f"{'unset: loopback only' if not (allowed or '').strip() else allowed[:200]})")

    def register_to_bootstrap(self) -> None:
        addr = f"{_bootstrap_host(self.server_args)}:{self.server_args.disaggregation_bootstrap_port}"
        self.own_bootstrap = addr
        # The layout travels as the name of the one region published. Rendezvous records name
        # regions, so it names a small one of its own holding the same text (readable: it is
        # public; the KV buffers stay local, peers never address them).
        text = self.shape.name().encode()
        self._layout_bytes = np.frombuffer(text.ljust(64, b"\0"), dtype=np.uint8).copy()
        self._layout_region = self.engine.reg_mr_raw(
            self._layout_bytes.ctypes.data, self._layout_bytes.nbytes, access="read")
        self.publications.append(
            self._bootstrap(addr).publish(_prefill_name(self.dp, self.rank), self.engine.main_address,
                                          {self.shape.name(): self._layout_region.desc})
        )

    def decode_record(self, addr: str) -> str:
        """Publishes this decode rank's buffers at the prefill's bootstrap (once)."""
        name = f"sglang.decode.{self.id}.{self.rank}"
        with self.lock:
            done = addr in self.published_at
            self.published_at.add(addr)
        if not done:
            regions = {f"kv{i}": r.desc for i, r in enumerate(self.kv)}
            regions.update({f"aux{i}": r.desc for i, r in enumerate(self.aux)})
            # The key travels as the name of a one-byte region of zeros (records name regions):
            # the bootstrap's readers are the ones trusted with it.
            if getattr(self, "_key_region", None) is None:
                self._key_bytes = np.zeros(1, dtype=np.uint8)
                self._key_region = self.engine.reg_mr_raw(self._key_bytes.ctypes.data, 1,
                                                          access="read")
            regions[sc.key_region(self.key)] = self._key_region.desc
            self.decode_publications.append(
                self._bootstrap(addr).publish(name, self.engine.main_address, regions)
            )
        return name

    def _register(self) -> None:
        access = "local" if self.mode == DisaggregationMode.PREFILL else "write"
        args = self.args
        self.kv = [self.engine.reg_mr_raw(p, n, access=access)
                   for p, n in zip(args.kv_data_ptrs, args.kv_data_lens)]
        self.aux = [self.engine.reg_mr_raw(p, n, access=access)
                    for p, n in zip(args.aux_data_ptrs, args.aux_data_lens)]

    def deregister_buffer_to_engine(self) -> None:
        """SGLang releases the KV memory (``release_memory_occupation``, called on an idle
        server, by each decode queue: once is enough): the registrations are dropped, so the
        NIC holds none of the memory SGLang hands back, and a decode rank withdraws the
        records that named them."""
        with self.lock:
            if self.released:
                return
            self.released = True
            regions, self.kv, self.aux = self.kv + self.aux, [], []
            publications, self.decode_publications = self.decode_publications, []
            self.published_at.clear()
        for p in publications:
            p.unpublish()
        for r in regions:
            r.dereg()

    def register_buffer_to_engine(self) -> None:
        """SGLang resumed the KV memory (``resume_memory_occupation``: the same addresses):
        registered again. A decode rank publishes its new registrations under a new name and
        key when it next meets each prefill, so no prefill rank writes through a record it
        cached before the release."""
        with self.lock:
            if not self.released:
                return
            self.released = False
            if self.mode != DisaggregationMode.PREFILL:
                self.id, self.key = uuid.uuid4().hex[:12], sc.new_key()
        self._register()

    def _on_message(self, data: bytes, sender: bytes = b"") -> None:
        """Every message to this rank, decoded once and checked before it is acted on
        (``sglang_control``); a refused one is counted and changes nothing. No lookup here:
        this is the engine's callback thread."""
        if bytes(data[:len(sc.META)]) not in sc.KINDS:
            self._drop("not a message of this backend")
            return
        try:
            msg, proof = sc.parse(data)
            if isinstance(msg, sc.Answer):
                if self.mode == DisaggregationMode.PREFILL:
                    raise ControlError("a prefill rank's answer sent to a prefill rank")
                with self.lock:
                    self.rooms.handle(msg, bytes(sender))
                return
            if self.mode != DisaggregationMode.PREFILL:
                raise ControlError("a decode rank's message sent to a decode rank")
            with self.lock:
                record = self.peers.get(msg.decode)
                later = record is None and self.checks < MAX_CHECKS
                if later:
                    self.checks += 1
            if record is not None:
                self._take(msg, proof, record, bytes(sender))
            elif not later:
                raise ControlError(f"{MAX_CHECKS} messages already wait for their lookups")
            else:
                try:
                    self.draining.submit(self._look_up_then_take, msg, proof, bytes(sender))
                except RuntimeError:  # closing
                    with self.lock:
                        self.checks -= 1
        except ControlError as e:
            self._drop(str(e))

    def _drop(self, why: str) -> None:
        with self.lock:
            self.dropped += 1
        logger.debug("xfer.sglang: a control message was dropped (%s)", why)

    def _look_up_then_take(self, msg: Any, proof: str | None, sender: bytes) -> None:
        """Prefill, off the callback thread: finds the decode rank ``msg`` names at this
        rank's own bootstrap (decode ranks publish there before they send; an address a
        message names is never dialled), then checks and takes ``msg``."""
        try:
            if self.own_bootstrap is None:
                raise ControlError("this rank registered at no bootstrap")
            try:
                record = self._bootstrap(self.own_bootstrap).lookup(msg.decode, record_wait_s)
            except Exception as e:  # noqa: BLE001 - no such decode rank: forged or gone
                raise ControlError(f"no record {msg.decode} at this bootstrap ({e})") from None
            with self.lock:
                record = self.peers.setdefault(msg.decode, record)
            self._take(msg, proof, record, sender)
        except ControlError as e:
            self._drop(str(e))
        finally:
            with self.lock:
                self.checks -= 1

    def _take(self, msg: Any, proof: str | None, record: dict[str, Any], sender: bytes) -> None:
        """Prefill: acts on a decode rank's meta or abort once it is proven that rank's own
        and names only what it published (raises :class:`ControlError` otherwise)."""
        if isinstance(msg, sc.Abort):
            sc.check_abort(msg, proof, record, sender)
            self._aborted(msg)
            return
        sc.check_meta(msg, proof, record, sender, self.shape.buffers,
                      [int(n) for n in self.args.aux_item_lens])
        if msg.to != self.rank:
            raise ControlError(f"a meta for prefill rank {msg.to} sent to rank {self.rank}")
        with self.lock:
            if msg.room in self.aborted:
                return  # its decode rank gave up before these pages came
            if self.pre_aborted.pop((msg.room, msg.decode, msg.token), None) is not None:
                # Its own abort came first: the room is given up, as if it came after.
                self.aborted[msg.room] = time.monotonic()
                sender = self.senders.get(msg.room)
                if sender is not None:
                    try:
                        self.draining.submit(sender.stop, f"room {msg.room}: aborted by decode "
                                             f"rank {msg.rank}")
                    except RuntimeError:
                        pass  # closing
                return
            known = self.metadata.get(msg.room)
            if known is None and len(self.metadata) >= MAX_ROOMS:
                # Rooms no sender of this rank took (their requests never came here, or went
                # before SGLang made one) go first, oldest first.
                orphan = next((r for r in self.metadata if r not in self.senders), None)
                if orphan is None:
                    raise ControlError(f"{MAX_ROOMS} rooms already hold indices")
                del self.metadata[orphan]
            first = (known or {}).get(msg.rank)
            if first is not None:
                # The destinations of a room never change once taken (a replay is a no-op).
                if first.token != msg.token or first.decode != msg.decode:
                    raise ControlError(f"room {msg.room} rank {msg.rank} already has its indices")
                return
            self.metadata.setdefault(msg.room, {})[msg.rank] = msg

    def _aborted(self, abort: Any) -> None:
        """Prefill: a decode rank gave up ``abort.room``: nothing more is written there, what
        is in flight is cancelled, and the decode rank is answered once none of it is."""
        now = time.monotonic()
        room = abort.room
        with self.lock:
            held = self.metadata.get(room)
            if held is None:  # SGLang cleared the room; its sender may still drain writes
                held = getattr(self.senders.get(room), "taken", None) or {}
            first = held.get(abort.rank)
            sender = None
            if first is None:
                # No indices of that decode rank here yet: the abort is bound to it and its
                # token (``pre_aborted``), and touches nothing of the room until they come.
                self.pre_aborted[(room, abort.decode, abort.token)] = now
                for old in [k for k, t in self.pre_aborted.items()
                            if now - t > 2 * transfer_timeout_s]:
                    del self.pre_aborted[old]
                while len(self.pre_aborted) > MAX_ABORTED:
                    del self.pre_aborted[next(iter(self.pre_aborted))]
            elif first.decode != abort.decode or not sc.same_token(first.token, abort.token):
                raise ControlError(f"an abort of room {room} from another decode rank or with "
                                   "another token than its indices")
            else:
                self.aborted[room] = now
                for old in [r for r, t in self.aborted.items()
                            if now - t > 2 * transfer_timeout_s]:
                    del self.aborted[old]
                while len(self.aborted) > MAX_ABORTED:
                    del self.aborted[next(iter(self.aborted))]
                sender = self.senders.get(room)
        # Off the engine's callback thread: a cancel waits until no NIC touches the memory.
        try:
            self.draining.submit(self._drain_and_ack, abort, sender)
        except RuntimeError:
            pass  # closing

    def _drain_and_ack(self, abort: Any, sender: Any) -> None:
        if sender is not None:
            sender.stop(f"room {abort.room}: aborted by decode rank {abort.rank}")
        try:
            with self.lock:
                peer = self.peers[abort.decode]  # proven before the abort was taken
            self.engine.submit_send(peer["addr"], sc.Answer(sc.ABORT_ACK, abort.room, abort.token,
                                                            self.rank).encode())
        except Exception as e:  # noqa: BLE001 - the decode frees at its own deadline
            logger.warning("xfer.sglang: could not answer the abort of room %d: %s", abort.room, e)

    def _all_done(self, receiver: Any) -> bool:
        """Every prefill rank ``receiver``'s indices went to said done (under the lock)."""
        room = self.rooms.rooms.get(receiver.room)
        return room is not None and len(room.done) >= len(receiver.prefills or ())

    def watch(self, receiver: Any) -> None:
        """Decode: watches ``receiver``'s prefill ranks until it is cleared: one that is gone
        (its bootstrap record lapsed or was replaced: the process died or restarted) fails
        the room, naming it, instead of leaving it to ``transfer_timeout_s``. The lookups run
        on this manager's thread, not the scheduler's."""
        with self.lock:
            self.watched[receiver.room] = receiver
            start = self.watcher is None
            if start:
                self.watcher = threading.Thread(target=self._watch, name="xfer-sglang-watch",
                                                daemon=True)
        if start:
            self.watcher.start()

    def unwatch(self, room: int) -> None:
        with self.lock:
            self.watched.pop(room, None)

    def _watch(self) -> None:
        while not self.closing.wait(watch_interval_s):
            with self.lock:
                receivers = [r for r in self.watched.values() if not self._all_done(r)]
            ranks: dict[tuple[str, str, int], list[int]] = {}
            for r in receivers:
                for prefill in r.prefills or []:
                    key = (r.addr, prefill["name"], prefill["incarnation"])
                    ranks.setdefault(key, []).append(r.room)
            for (addr, name, incarnation), rooms in ranks.items():
                try:
                    now = self._bootstrap(addr).lookup(name, watch_interval_s)
                    gone = None if now["incarnation"] == incarnation else "restarted"
                except Exception as e:  # noqa: BLE001 - its record lapsed, or its bootstrap
                    gone = f"gone ({e})"
                if gone is None or self.closing.is_set():
                    continue
                why = f"the prefill rank {name} at {addr} is {gone}"
                logger.error("xfer.sglang: %s: failing rooms %s", why, rooms)
                with self.lock:
                    for room in rooms:
                        state = self.rooms.rooms.get(room)
                        if state is not None and state.failure is None:
                            state.failure = f"room {room}: {why}"
                        self.watched.pop(room, None)

    def close(self) -> None:
        self.closing.set()
        self.draining.shutdown(wait=False, cancel_futures=True)
        with self.lock:
            contacts = self.contact_pool
        if contacts is not None:
            contacts.shutdown(wait=False, cancel_futures=True)
        if self.recompute is not None:
            self.recompute.shutdown(wait=False, cancel_futures=True)
        for p in self.publications + self.decode_publications:
            p.unpublish()
        self.engine.close()


class XferKVSender(BaseKVSender):
    """Prefill: writes a request's pages into each decode rank's, chunk by chunk."""

    def __init__(self, mgr: XferKVManager, bootstrap_addr: str, bootstrap_room: int,
                 req_has_disagg_prefill_dp_rank: bool = False, *args: Any, **kwargs: Any):
        self.mgr, self.addr, self.room = mgr, bootstrap_addr, int(bootstrap_room)
        self.created = time.monotonic()
        self.total = 0
        self.aux_index: int | None = None
        self.sent = 0
        self.pending = 0
        self.bytes = 0
        self.failure: str | None = None
        self.finished = False
        self.transfers: list[xfer.Transfer] = []
        self.started: float | None = None
        self.ended: float | None = None
        self.cleared = False
        """SGLang is done with it; it stays findable (for a decode rank's abort) until none of
        its writes is in flight."""
        self._early_send_wait_event: Any = None
        """Set by SGLang's prefill (``maybe_send_cached_prefix_chunk``, overlap scheduling) on
        the sender before an early send of the cached prefix: the previous step's forward may
        still be writing those pages. The chunk's writes wait for it."""
        with mgr.lock:
            mgr.senders[self.room] = self
            if self.room in mgr.aborted:
                self.failure = f"room {self.room}: aborted by the decode instance"

    def init(self, num_kv_indices: int, aux_index: int | None = None) -> None:
        self.total, self.aux_index = int(num_kv_indices), aux_index

    def _destinations(self) -> list[sc.Meta] | None:
        """Every decode rank's indices once all that name this rank have arrived (each
        proven that rank's own when it came: ``XferKVManager._take``)."""
        with self.mgr.lock:
            got = dict(self.mgr.metadata.get(self.room, {}))
        if not got:
            return None
        decode_tp = next(iter(got.values())).tp
        if any(m.tp != decode_tp for m in got.values()):
            raise LayoutError(f"room {self.room}: decode ranks of different TP sizes "
                              f"{sorted({m.tp for m in got.values()})}")
        want = decode_sources(self.mgr.rank, decode_tp, self.mgr.tp, self.mgr.mla)
        if any(r not in got for r in want):
            return None
        return [got[r] for r in want]

    def should_send_kv_chunk(self, num_pages: int, last_chunk: bool) -> bool:
        """The last chunk goes even without pages: it is what ends the transfer."""
        return num_pages > 0 or last_chunk

    def pop_decode_prefix_len(self) -> int:
        """Tokens the decode instance already holds: sending starts after them."""
        try:
            dests = self._destinations()
        except LayoutError:
            return 0
        return dests[0].prefix if dests else 0

    def send(self, kv_indices: Any, state_indices: Any = None, num_kv_tokens: Any = None) -> None:
        if self.failure is not None:
            return  # aborted or failed: nothing more is written
        if self.mgr.released:
            self._fail(f"room {self.room}: SGLang released the KV memory")
            return
        try:
            dests = self._destinations()
        except LayoutError as e:
            self._fail(str(e))
            return
        if dests is None:
            self._fail(f"room {self.room}: send before the decode instance sent its page indices")
            return
        pages = np.asarray(kv_indices, dtype=np.int64)
        self.started = self.started or time.monotonic()
        # The event belongs to this chunk alone (as SGLang's own senders take it).
        wait_event, self._early_send_wait_event = self._early_send_wait_event, None
        try:
            if wait_event is not None:
                wait_event.synchronize()
            for meta in dests:
                if self.sent + len(pages) > len(meta.pages):
                    raise LayoutError(f"{self.sent + len(pages)} pages sent, decode rank "
                                      f"{meta.rank} allocated {len(meta.pages)}")
                self._write(meta, pages, meta.pages[self.sent : self.sent + len(pages)])
            self.sent += len(pages)
            if self.sent >= self.total:
                for meta in dests:
                    if meta.aux and self.aux_index is not None and meta.aux_index is not None:
                        self._write_aux(meta)
                self.finished = True
                self._maybe_done()
        except Exception as e:  # noqa: BLE001 - any failure ends this transfer
            self._fail(f"room {self.room}: {e}")

    def _write(self, meta: sc.Meta, src: np.ndarray, dst: np.ndarray) -> None:
        """This rank's share of one chunk for one decode rank: the decode rank's read plan,
        turned around (its "remote" pages are ours)."""
        peer = self._peer(meta)
        theirs = KvShape(tp=meta.tp, heads=meta.heads, page_size=self.mgr.shape.page_size,
                         item_len=meta.item, buffers=self.mgr.shape.buffers, mla=self.mgr.mla)
        ours = self.mgr.shape
        mgr = self.mgr
        for i, region in enumerate(mgr.kv):
            desc = peer["regions"][f"kv{i}"]
            plan = read_plan(theirs.layout(desc.nbytes // theirs.item_len),
                             ours.layout(mgr.args.kv_data_lens[i] // ours.item_len),
                             meta.rank, theirs.tp, ours.tp,
                             dst.tolist(), src.tolist(), mla=ours.mla)
            for w in plan:
                if w.remote_rank != mgr.rank:
                    continue
                self._submit(lambda w=w, region=region, desc=desc: mgr.engine.submit_paged_writes(
                    w.page_len, region, w.remote_pages, desc, w.local_pages,
                    src_stride=w.remote_stride, dst_stride=w.local_stride,
                    src_offset=w.remote_offset, dst_offset=w.local_offset,
                    on_done=self._one_done))
                self.bytes += w.page_len * len(w.local_pages)

    def _write_aux(self, meta: sc.Meta) -> None:
        peer = self._peer(meta)
        for i, (region, item) in enumerate(zip(self.mgr.aux, self.mgr.args.aux_item_lens)):
            self._submit(lambda i=i, region=region, item=item: self.mgr.engine.submit_paged_writes(
                item, region, [self.aux_index], peer["regions"][f"aux{i}"],
                [meta.aux_index], on_done=self._one_done))

    def _peer(self, meta: sc.Meta) -> dict[str, Any]:
        """The record of the decode rank ``meta`` came from (found and checked when it came:
        never looked up here, on SGLang's scheduler thread)."""
        with self.mgr.lock:
            return self.mgr.peers[meta.decode]

    def _submit(self, post: Any) -> None:
        with self.mgr.lock:
            if self.failure is not None:
                return  # stopped while this chunk was being submitted
            self.pending += 1
        try:
            transfer = post()
        except Exception:
            with self.mgr.lock:
                self.pending -= 1
            raise
        with self.mgr.lock:
            self.transfers.append(transfer)
            stopped = self.failure is not None
        if stopped:
            transfer.cancel()

    def stop(self, why: str) -> None:
        """A decode rank aborted: fails this transfer and returns once none of its writes is
        in flight (each cancel waits until no NIC touches the memory)."""
        with self.mgr.lock:
            if self.failure is None:
                self.failure = why
            transfers = list(self.transfers)
        for t in transfers:
            t.cancel()

    def _one_done(self, error: BaseException | None) -> None:
        if error is not None:
            self._fail(f"room {self.room}: a write failed: {error}")
        with self.mgr.lock:
            self.pending -= 1
            if self.cleared and self.pending == 0 and self.mgr.senders.get(self.room) is self:
                del self.mgr.senders[self.room]
        self._maybe_done()

    def _maybe_done(self) -> None:
        with self.mgr.lock:
            ready = self.finished and self.pending == 0 and self.failure is None and self.ended is None
            if ready:
                self.ended = time.monotonic()
        if ready:
            for meta in self._destinations() or []:
                self.mgr.engine.submit_send(self._peer(meta)["addr"], sc.Answer(
                    sc.DONE, self.room, meta.token, self.mgr.rank).encode())

    def _fail(self, why: str) -> None:
        with self.mgr.lock:
            first = self.failure is None
            if first:
                self.failure = why
        if first:
            logger.error("xfer.sglang: %s", why)
            with self.mgr.lock:
                known = list(self.mgr.metadata.get(self.room, {}).values())
            for meta in known:
                try:
                    self.mgr.engine.submit_send(self._peer(meta)["addr"], sc.Answer(
                        sc.FAIL, self.room, meta.token, self.mgr.rank, why).encode())
                except Exception:  # noqa: BLE001 - the receiver times out instead
                    pass

    def poll(self) -> int:
        if self.failure is not None:
            return KVPoll.Failed
        if self.ended is not None:
            return KVPoll.Success
        if self._destinations() is None:
            if time.monotonic() - self.created > transfer_timeout_s:
                self._fail(f"room {self.room}: the decode instance never sent its page indices")
                return KVPoll.Failed
            return KVPoll.Bootstrapping
        return KVPoll.Transferring if self.sent else KVPoll.WaitingForInput

    def get_transfer_metric(self) -> KVTransferMetric:
        latency = None if self.started is None or self.ended is None else self.ended - self.started
        return KVTransferMetric(transfer_latency_s=latency, transfer_total_bytes=self.bytes)

    def failure_exception(self) -> None:
        # SGLang's prefill never clears a failed sender: this is its last call.
        self.clear()
        raise RuntimeError(f"xfer transfer failed: {self.failure}")

    def abort(self) -> None:
        for t in self.transfers:
            t.cancel()
        self._fail(f"room {self.room}: aborted")

    def clear(self) -> None:
        """SGLang is done with the room. A sender with writes still in flight stays findable
        until they are not (``_one_done``): a decode rank's abort is answered only after the
        drain — the decode reuses the pages once answered, and a write landing later would
        overwrite another request's KV."""
        with self.mgr.lock:
            # Kept with the sender while it stays findable: a late abort is checked against
            # the indices it ends (``XferKVManager._aborted``).
            self.taken = self.mgr.metadata.pop(self.room, None) or {}
            self.cleared = True
            if self.mgr.senders.get(self.room) is self and self.pending == 0:
                del self.mgr.senders[self.room]


class XferKVReceiver(BaseKVReceiver):
    """Decode: sends its page indices to the prefill ranks holding its heads and waits for
    each one's data."""

    def __init__(self, mgr: XferKVManager, bootstrap_addr: str, bootstrap_room: int | None = None,
                 *args: Any, **kwargs: Any):
        self.mgr, self.addr, self.room = mgr, bootstrap_addr, int(bootstrap_room or 0)
        self.prefills: list[dict[str, Any]] | None = None
        self.failure: str | None = None
        self.deadline: float | None = None
        self.abort_notified = False
        """The prefill ranks were told this room is given up (SGLang then waits for their
        answers, ``kv_mgr.is_abort_release_safe``, before it frees the pages)."""
        self.conclude_state: int | None = None
        self.require_staging = False

    @property
    def kv_mgr(self) -> XferKVManager:
        """The manager, by the name SGLang's decode queues use."""
        return self.mgr

    @property
    def bootstrap_infos(self) -> list[dict[str, Any]] | None:
        """The prefill ranks this room's pages go to (SGLang counts their abort answers)."""
        return self.prefills

    def init(self, prefill_dp_rank: int = 0, *args: Any, **kwargs: Any) -> None:
        try:
            if self.mgr.released:
                raise RuntimeError("SGLang released the KV memory")
            if self.addr not in self.mgr.prefill_info_table:
                self.mgr.learn_prefill_now(self.addr)
            rdv = self.mgr._bootstrap(self.addr)  # open (or refused) since the first contact
            if self.addr in self.mgr.refusals:
                raise LayoutError(self.mgr.refusals[self.addr])
            prefill = self.mgr.prefill_shapes[self.addr]
            dp = int(prefill_dp_rank or 0)
            if not 0 <= dp < prefill.dp:
                raise LayoutError(f"prefill DP rank {dp}: the prefill has {prefill.dp}")
            targets = prefill_targets(self.mgr.rank, self.mgr.tp, prefill.tp, self.mgr.mla)
            prefills = [rdv.lookup(_prefill_name(dp, t), lookup_timeout_s) for t in targets]
            self.record = self.mgr.decode_record(self.addr)
            self.targets = targets
            # The room's token: only the prefill ranks its indices go to learn it, and only
            # their answers carrying it count (sglang_control.DecodeRooms).
            self.token = new_token()
            with self.mgr.lock:
                self.mgr.rooms.enter(self.room, self.token,
                                     {t: bytes(p["addr"]) for t, p in zip(targets, prefills)})
            self.prefills = prefills
        except LayoutError as e:
            self.failure = f"room {self.room}: the prefill at {self.addr} cannot send here: {e}"
        except BootstrapRefused as e:
            self.failure = f"room {self.room}: refused: {e}"
        except Exception as e:  # noqa: BLE001 - reported through poll
            self.failure = f"room {self.room}: no prefill at {self.addr}: {e}"

    def send_metadata(self, kv_indices: Any, aux_index: int | None = None, state_indices: Any = None,
                      decode_prefix_len: int | None = None, *args: Any, **kwargs: Any) -> None:
        if self.failure is not None or self.prefills is None:
            return
        pages = np.asarray(kv_indices, dtype=np.int64)
        shape = self.mgr.shape
        try:
            for i, (to, prefill) in enumerate(zip(self.targets, self.prefills)):
                meta = sc.Meta(room=self.room, token=self.token, decode=self.record, to=to,
                               rank=self.mgr.rank, tp=shape.tp, heads=shape.heads,
                               item=shape.item_len, prefix=int(decode_prefix_len or 0),
                               aux_index=None if aux_index is None else int(aux_index),
                               aux=i == 0, pages=pages)
                self.mgr.engine.submit_send(prefill["addr"], meta.encode(self.mgr.key))
            self.deadline = time.monotonic() + transfer_timeout_s
            self.mgr.watch(self)
        except Exception as e:  # noqa: BLE001
            self.failure = f"room {self.room}: could not reach the prefill instance: {e}"

    def poll(self) -> int:
        state = self._poll()
        if state in (KVPoll.Success, KVPoll.Failed):
            self.conclude_state = state
        return state

    def _poll(self) -> int:
        if self.failure is not None:
            return KVPoll.Failed
        if self.prefills is None:
            # SGLang polls every request in its queue, those still waiting for their
            # prefill's topology too: one whose bootstrap could not be contacted (too many
            # others in flight) fails here, naming why.
            crowded = self.mgr.crowded.get(self.addr)
            if crowded is not None:
                self.failure = f"room {self.room}: {crowded}"
                return KVPoll.Failed
            return KVPoll.Bootstrapping
        if self.deadline is None:
            return KVPoll.WaitingForInput
        with self.mgr.lock:
            room = self.mgr.rooms.rooms.get(self.room)
            dones = 0 if room is None else len(room.done)
            why = None if room is None else room.failure
        if why is not None:
            self.failure = why
            return KVPoll.Failed
        if dones >= len(self.prefills):
            return KVPoll.Success
        if time.monotonic() > self.deadline:
            self.failure = (f"room {self.room}: no data within {transfer_timeout_s} s "
                            f"({dones} of {len(self.prefills)} prefill ranks done)")
            return KVPoll.Failed
        return KVPoll.Transferring

    def failure_exception(self) -> None:
        self.conclude_state = KVPoll.Failed
        raise RuntimeError(f"xfer transfer failed: {self.failure}")

    def abort(self) -> None:
        self.fail(f"room {self.room}: aborted")

    def fail(self, why: str) -> None:
        """Fails this room (the first reason stands) and tells its prefill ranks."""
        self.failure = self.failure or why
        self.conclude_state = KVPoll.Failed
        self.ensure_abort_notified()

    def ensure_abort_notified(self, *, force_arm: bool = False) -> None:
        """Tells each prefill rank this room's pages went to that the room is given up
        (once); their answers arm ``kv_mgr.is_abort_release_safe``. Before the prefill ranks
        are known nothing was sent to them: nothing to tell."""
        if self.abort_notified or self.prefills is None:
            return
        self.abort_notified = True
        with self.mgr.lock:
            room = self.mgr.rooms.rooms.get(self.room)
            if room is not None:
                room.acks = set()
        message = sc.Abort(self.room, self.token, self.record, self.mgr.rank).encode(self.mgr.key)
        for prefill in self.prefills:
            try:
                self.mgr.engine.submit_send(prefill["addr"], message)
            except Exception as e:  # noqa: BLE001 - SGLang frees at its own deadline
                logger.warning("xfer.sglang: could not tell a prefill rank that room %d was "
                               "aborted: %s", self.room, e)

    def is_abort_release_safe(self) -> bool:
        """Host destinations only (not supported): never reached."""
        return not self.abort_notified

    def clear(self) -> None:
        self.mgr.unwatch(self.room)
        with self.mgr.lock:
            room = self.mgr.rooms.rooms.get(self.room)
            if room is not None and room.token == getattr(self, "token", None):
                self.mgr.rooms.leave(self.room)


def register(config: Any = None) -> None:
    """Makes ``--disaggregation-transfer-backend xfer`` select this backend: adds the choice,
    the ``TransferBackend`` member and the classes ``get_kv_class`` returns (SGLang has no
    registry of transfer backends; this is the one call until it has). ``config``: the xfer
    engine config (else ``$XFER_CONFIG``)."""
    global _config
    if config is not None:  # SGLang's plugin loader calls this with none: $XFER_CONFIG then
        _config = config
    import sys

    from sglang.srt.arg_groups import choices
    from sglang.srt.disaggregation import utils
    from sglang.srt.disaggregation.utils import KVClassType, TransferBackend

    if NAME not in choices.DISAGG_TRANSFER_BACKEND_CHOICES:
        choices.add_disagg_transfer_backend_choices([NAME])
    if NAME not in TransferBackend._value2member_map_:
        member = object.__new__(TransferBackend)
        member._name_, member._value_ = "XFER", NAME
        TransferBackend._member_map_["XFER"] = member
        TransferBackend._value2member_map_[NAME] = member
        TransferBackend._member_names_.append("XFER")
    original = utils.get_kv_class
    if getattr(original, "_xfer", False):
        return
    classes = {
        KVClassType.KVARGS: KVArgs,
        KVClassType.MANAGER: XferKVManager,
        KVClassType.SENDER: XferKVSender,
        KVClassType.RECEIVER: XferKVReceiver,
        KVClassType.BOOTSTRAP_SERVER: XferKVBootstrapServer,
    }

    def get_kv_class(transfer_backend: Any, class_type: Any) -> Any:
        if transfer_backend == TransferBackend._value2member_map_[NAME]:
            return classes.get(class_type)
        return original(transfer_backend, class_type)

    get_kv_class._xfer = True  # type: ignore[attr-defined]
    # Every module that imported the function by name.
    for name, module in list(sys.modules.items()):
        if name.startswith("sglang.") and getattr(module, "get_kv_class", None) is original:
            module.get_kv_class = get_kv_class
