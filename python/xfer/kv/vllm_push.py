"""Why one file: it is one component, ``PushSide``, and one lock — both ends of push (the
prefill rank that writes and the decode rank that waits) share its tables of requests, wants and
early cancels, and every method moves entries between them under that lock; the pure parts it
uses are elsewhere (``control`` decodes, ``pages`` plans, ``vllm_records`` holds the records).

Push mode of the vLLM connector (``xfer.kv.vllm``): the decode rank's block ids sent to the
prefill ranks it expects data from, and the prefill rank writing each layer as it is computed.

``PushSide`` is a component the connector's worker owns (``_Worker.push``). It keeps push's own
state — the requests a prefill rank writes and the decode ranks that want them, the requests a
decode rank waits for, cancels that came before their ids — under its own lock, and reaches
the rest of the worker only through the :class:`PushContext` it is given: the engine, this
rank's identity, its registered layers, the peer table, the background threads, and the
worker's accounting of loads (a pushed load ends through ``finish_load``, as a pulled one does,
after its done message was queued through ``tell_done_soon``). It never calls into the context
while holding its lock: the worker's own methods take the worker's lock.

The worker feeds it vLLM's events (``step_started``, ``layer_computed``, ``step_computed``,
``request_finished``, ``request_aborted``, ``await_push``), the peers' messages
(``handle_want``, ``handle_pushed``, ``handle_cancel``) and, between steps, ``poll``. It reads
no clock: the worker passes its own (``now``, monotonic seconds) to each method that needs it.
"""

from __future__ import annotations

import collections
import concurrent.futures
import dataclasses
import logging
import threading
from collections.abc import Callable, Collection, Mapping, Sequence
from typing import Any

import xfer

from .control import ControlError, Header, block_id_array, block_ids_payload, same_token
from .control import encode as pack_message
from .pages import LayerView, LayoutError, block_runs, matched_blocks
from .params import MAX_ID, MAX_TP, ParamsError, allowed_rendezvous
from .vllm_records import Load, Peer

_WANT = b"xfer-vllm-want:"
"""Push: a decode rank's block ids for a request, to each prefill rank it expects data from."""
_PUSHED = b"xfer-vllm-push:"
"""Push: a prefill rank wrote every layer of a request to a decode rank (or could not, or
stopped at the decode rank's cancel: then nothing of it is in flight any more)."""
_CANCEL = b"xfer-vllm-stop:"
"""Push: a decode rank gave up waiting for a request; the prefill rank writes nothing more
there and answers with ``_PUSHED`` once none of its writes is in flight."""

MAX_MESSAGE = 65536
"""The largest message the worker receives (its receive buffers): about 16k block ids."""
MAX_PENDING = 4096
"""Push requests, decoders' ids and early cancels kept before their token is known (for a
request this prefill has not scheduled yet), each: past it the oldest are dropped unanswered."""
MAX_PENDING_IDS = 1 << 20
"""Block ids the decoders' ids kept before their request's token is known hold in all (4 bytes
each: 4 MiB): past it the oldest requests' are dropped unanswered."""
MAX_WANTS = 2 * MAX_TP
"""Decode ranks whose ids one request keeps (two decode instances' worth: a proxy's retry):
more are dropped unanswered — decoder names cost a stranger nothing."""


class WaitTaken(ControlError):
    """A decode request names a prefill request this rank already waits for (for another
    decode request: a proxy's retry, or a request naming another one's): its load fails alone,
    and the prefill is told nothing for it — a done message with the request's token would
    free the prefill's blocks under the first request's push."""


@dataclasses.dataclass(frozen=True)
class PushContext:
    """What the push component uses of the connector's worker, given once at construction."""

    engine: xfer.TransferEngine
    """Sends the block-id, pushed and cancel messages and submits the layers' writes."""
    engine_id: str
    """This instance's engine id (the key its peers know its requests and records by)."""
    rank: int
    """This worker's tensor-parallel rank."""
    tp_size: int
    """This instance's tensor-parallel size."""
    model: str
    """The model this instance serves; a decoder serving another is refused."""
    rendezvous_url: str
    """Where this worker's record is: sent with its block ids, so the prefill finds it."""
    push_timeout_s: float
    """How long a decode rank waits for its prefill ranks' data (and then, as long again, for
    their answer to its cancel)."""
    forget_after_s: float
    """How long a prefill rank keeps a cancel that came before its ids, and the decoders' ids
    of a request it never computes."""
    layers: Callable[[], Mapping[str, tuple[xfer.MemoryRegion, LayerView]]]
    """This worker's registered layers, each with its buffer's region and its view of it
    (empty while vLLM sleeps)."""
    peer: Callable[[str, int, str | None], Peer]
    """The peer table: a worker's record by (engine id, rank, where its records are), looked
    up in the rendezvous the first time (which may wait: never on the engine's threads);
    cached per rendezvous (a record of that name elsewhere is another party's)."""
    shared_layers: Callable[[Load], list[str]]
    """The layers both this worker and a load's prefill hold (raises on other layers)."""
    is_draft_layer: Callable[[str], bool]
    """Whether a layer is a speculative drafter's (a decoder without it is owed nothing)."""
    in_background: Callable[..., concurrent.futures.Future[Any] | None]
    """Runs ``work(*args)`` on the worker's lookup threads (``None``: the worker is closing)."""
    tell_done_soon: Callable[[Load], None]
    """Queues the message telling a load's prefill ranks this rank is done with it (the
    worker's ``close`` waits for the ones queued)."""
    finish_load: Callable[[str, Load, BaseException | None], None]
    """Reports a load finished (with its error, if any) to vLLM, and counts it."""
    logger: logging.Logger
    dialable: tuple[frozenset[str], bool] = (frozenset(), True)
    """The rendezvous URLs a decoder's message may name, and whether any side channel may
    be (``Options.dialable``)."""
    incompatible: Callable[[Peer], str | None] = lambda peer: None
    """Why this worker's KV cannot go to a peer (its compatibility factors), or None."""
    proven: Callable[[str, int, str | None, bytes], bool] = lambda engine, rank, url, sender: False
    """Whether ``sender`` (the engine the transport proved sent a message; b"": not proven) is
    that of (engine id, rank)'s record in that rendezvous, as already looked up (never waits).
    The default proves no sender."""


@dataclasses.dataclass
class _Want:
    """Push, prefill side: one decode rank's blocks for a request, and what went to it."""

    engine: str
    rank: int
    tp: int
    blocks: Sequence[int]
    """As decoded: ``array('i')`` (kept, maybe long before the request is scheduled)."""
    url: str | None = None
    """Where the decode rank's records are (its side channel, or the shared rendezvous)."""
    model: str = ""
    """The model the decoder serves (checked against this instance's)."""
    token: str = ""
    """The request's token as the decoder sent it: nothing is looked up, written or answered
    for it until it is the request's own (``_Push.token``)."""
    verified: bool = False
    sender: bytes = b""
    """The engine the transport proved sent the ids (b"": not proven): the decoder's record
    must name it before anything is written there."""
    ready: bool = False
    """Its record was found (looked up off the engine's callback thread); until then nothing
    is written to it."""
    layers: set[str] = dataclasses.field(default_factory=set)
    """Layers whose writes were submitted (for the request's current blocks)."""
    pending: int = 0
    """Writes submitted whose completion has not come."""
    transfers: list[xfer.Transfer] = dataclasses.field(default_factory=list)
    """The writes submitted, for a cancel."""
    error: str | None = None
    replied: bool = False
    cancelled: bool = False
    """The decode rank gave up: nothing more is written; answered once ``pending`` is 0."""
    aborted: str | None = None
    """Why the request will not reach this decode rank (aborted here, or its blocks freed):
    nothing more is written; answered (failed, with this) once ``pending`` is 0 — the decoder
    frees its blocks when told, and a write still in flight would land in another request's."""
    stop_answered: bool = False
    """A cancelled or aborted want was answered (once, whichever came first)."""


@dataclasses.dataclass
class _Push:
    """Push, prefill side: a request's blocks here and the decode ranks that want them."""

    blocks: list[int] = dataclasses.field(default_factory=list)
    wants: dict[tuple[str, int, bytes], _Want] = dataclasses.field(default_factory=dict)
    """By (decode engine, rank, the engine the transport proved sent them): ids in a decoder's
    name from another engine never take the place of its own (they are dropped once its
    record is found, ``_resolve_want``)."""
    finished: bool = False
    computed: set[str] = dataclasses.field(default_factory=set)
    """Layers computed for these blocks: what a decoder found late is owed at once."""
    aborted: str | None = None
    """Why it will not be computed or pushed (``request_aborted``): kept until none of its
    writes is in flight, so a decoder's cancel or late ids are answered right meanwhile."""
    token: str | None = None
    """The request's token (from its parameters, through the scheduler); None until this
    prefill schedules it."""


@dataclasses.dataclass
class _Await:
    """Push, decode side: a request this rank waits for, and from which prefill ranks."""

    req_id: str
    load: Load
    ranks: set[int]
    """The prefill ranks that have not answered."""
    deadline: float
    error: BaseException | None = None
    cancelling: TimeoutError | None = None
    """Set at the deadline: the cancel sent to the ranks that had not answered, and the error
    the load ends with once they say nothing of theirs is in flight (vLLM reuses the blocks
    after a load error, so a write still coming would land in another request's KV)."""

    def handle_deadline(self, now: float, timeout_s: float) -> bool:
        """The deadline passed: the first time, the wait is kept as long again and the
        prefill ranks still owing it are to be told to stop (True); a second time (they never
        answered), it ends (False)."""
        if self.cancelling is not None:
            return False
        self.cancelling = TimeoutError(
            f"prefill {self.load.remote_engine_id} did not push request "
            f"{self.load.remote_request_id} within {timeout_s}s "
            f"(ranks {sorted(self.ranks)} missing)")
        # As long again for the answers (a transfer's own timeout fails a write stuck there).
        self.deadline = now + timeout_s
        return True


class PushSide:
    """The push half of the connector's worker (see the module docs)."""

    def __init__(self, context: PushContext) -> None:
        self._ctx = context
        self._lock = threading.Lock()
        self._pushes: dict[str, _Push] = {}
        """Prefill: requests with decoders' block ids or blocks computed, by request id."""
        self._uncomputed: collections.OrderedDict[str, float] = collections.OrderedDict()
        """Prefill: the requests in ``_pushes`` neither computed nor aborted, with when they
        came, oldest first: ``poll`` aborts the stale ones from the front (never through anyone
        else's)."""
        self._computed: dict[str, None] = {}
        """Prefill: the requests in ``_pushes`` computed here and not aborted (this instance's
        own: ``poll`` finds the ones whose blocks were freed among these)."""
        self._aborted: dict[str, None] = {}
        """Prefill: the requests in ``_pushes`` aborted, forgotten once nothing of theirs is in
        flight."""
        self._unverified: collections.OrderedDict[str, None] = collections.OrderedDict()
        """Prefill: the requests in ``_pushes`` holding decoders' ids before their token is
        known, oldest first (what is dropped first past the bounds)."""
        self._unverified_wants = 0
        """Prefill: the decoders' ids those requests hold ..."""
        self._unverified_ids = 0
        """... and their block ids."""
        self._step_pushes: list[str] = []
        """Prefill: the requests computing in this step."""
        self._deferred_layers: list[str] = []
        """Prefill: GPU layers of this step, pushed once the stream is synchronised."""
        self._awaiting: dict[tuple[str, str], _Await] = {}
        """Decode: (prefill engine, its request id) → what this rank waits for."""
        self._cancels: collections.OrderedDict[tuple[str, str, int],
                                               tuple[float, str, str | None]] = (
            collections.OrderedDict())
        """Prefill: decode ranks' cancels that came before their ids (by request, decode
        engine and rank), with when, their token and where the decoder's records are: their
        ids (with that token) are dropped when they come. Oldest first (one renewed moves to
        the end): ``poll`` forgets the stale ones from the front."""
        self._cancelled_ranks: dict[str, dict[tuple[str, int], None]] = {}
        """Prefill: the same cancels' (decode engine, rank), by request: a request scheduled
        finds its own without going through anyone else's."""
        self.dropped_wants = 0
        """Decoders' ids dropped for a bound (``MAX_WANTS``, ``MAX_PENDING``)."""

    # ---- decode side ----

    def await_push(self, req_id: str, load: Load, now: float) -> None:
        """Sends this rank's block ids to every prefill rank it expects data from (off vLLM's
        model-runner thread: the peers may have to be looked up)."""
        ctx = self._ctx
        ranks = set()
        layers = ctx.layers()
        for name in ctx.shared_layers(load):
            view = layers[name][1]
            remote = ctx.peer(load.remote_engine_id, 0, load.remote_rendezvous).layers[name][1]
            for run in block_runs(view, remote, ctx.rank, ctx.tp_size, load.remote_tp_size):
                ranks.add(run.remote_rank)
        header = {"req": load.remote_request_id, "engine": ctx.engine_id, "rank": ctx.rank,
                  "tp": ctx.tp_size, "rendezvous": ctx.rendezvous_url, "model": ctx.model,
                  "token": load.token}
        # One KV cache group: the scheduler side refused push for the others.
        [blocks] = load.local_block_ids
        message = pack_message(_WANT, header, block_ids_payload(blocks))
        if len(message) > MAX_MESSAGE:
            raise LayoutError(f"{len(blocks)} blocks do not fit one message (64 KiB)")
        key = (load.remote_engine_id, load.remote_request_id)
        with self._lock:
            # One wait per prefill request: a second one (a retry, or a request naming another
            # one's prefill request) would take the first one's answers and leave it waiting
            # forever with its blocks held; it fails alone.
            if key in self._awaiting:
                raise WaitTaken(f"this rank already waits for prefill {key[0]}'s request "
                                   f"{key[1]} (for request {self._awaiting[key].req_id})")
            self._awaiting[key] = _Await(req_id, load, ranks, now + ctx.push_timeout_s)
        try:
            for rank in sorted(ranks):
                ctx.engine.submit_send(
                    ctx.peer(load.remote_engine_id, rank, load.remote_rendezvous).address,
                    message)
        except Exception:
            with self._lock:
                self._awaiting.pop(key, None)
            raise

    def handle_pushed(self, header: Header, sender: bytes = b"") -> None:
        """A prefill rank finished (or failed) writing a request to this rank: acted on only
        with the request's token, from a rank it waits for, sent (where the transport names
        the sender) by the engine of that rank's record in the rendezvous the load names."""
        key = (header.text("engine", MAX_ID), header.text("req", MAX_ID))
        rank = header.integer("rank", 0, MAX_TP - 1)
        token = header.token()
        proven_for = None
        if sender:  # checked outside this lock: the peer table has its own
            with self._lock:
                proven_for = self._awaiting.get(key)
            if proven_for is None or not self._ctx.proven(
                    key[0], rank, proven_for.load.remote_rendezvous, sender):
                return  # not from the prefill rank this load was planned with (or not ours)
        with self._lock:
            waiting = self._awaiting.get(key)
            if (waiting is None or (sender and waiting is not proven_for)
                    or rank not in waiting.ranks or not same_token(waiting.load.token, token)):
                return  # timed out already, or not ours (forged: a "pushed ok" proves nothing)
            waiting.ranks.discard(rank)
            if header.flag("cancelled") and waiting.error is None:
                # A cancel this rank never sent (one in its name, by anyone holding the token)
                # leaves nothing saying the blocks were written: a failure, never a load.
                waiting.error = waiting.cancelling or RuntimeError(
                    f"prefill {key[0]} rank {rank} cancelled the push of request {key[1]}, "
                    "which this rank never asked for: its blocks were not written")
            elif not header.flag("ok") and waiting.error is None:
                waiting.error = RuntimeError(
                    f"prefill {key[0]} rank {rank} could not push: "
                    f"{header.optional_text('why', 512)}")
            if waiting.ranks:
                return
            del self._awaiting[key]
        # The done message is queued (and remembered for `close`) before the load is reported:
        # a decode instance shut down as soon as vLLM sees the load finished would otherwise
        # drop it, and the prefill would hold the blocks until its lease.
        self._ctx.tell_done_soon(waiting.load)
        self._ctx.finish_load(waiting.req_id, waiting.load, waiting.error)

    def _cancel_push(self, key: tuple[str, str], waiting: _Await, ranks: list[int]) -> None:
        """Tells each prefill rank that owes ``waiting`` to stop; one that cannot be reached
        has no connection left to write with."""
        ctx = self._ctx
        load = waiting.load
        message = pack_message(_CANCEL, {"req": load.remote_request_id, "engine": ctx.engine_id,
                                         "rank": ctx.rank, "rendezvous": ctx.rendezvous_url,
                                         "token": load.token})
        for rank in ranks:
            try:
                ctx.engine.submit_send(
                    ctx.peer(load.remote_engine_id, rank, load.remote_rendezvous).address,
                    message)
            except Exception as e:  # noqa: BLE001 - answered for it: it cannot write either
                ctx.logger.warning("XferConnector: prefill %s rank %d of request %s unreachable "
                                   "for its cancel (%s)", load.remote_engine_id, rank, key[1], e)
                self.handle_pushed(Header({"engine": key[0], "req": key[1], "rank": rank,
                                           "cancelled": True, "token": load.token}))

    def _finish_unanswered(self, waiting: _Await) -> None:
        """The ranks never answered the cancel either: the load ends (vLLM must not wait
        forever); named, since one of their writes could still be in flight."""
        error = TimeoutError(f"{waiting.cancelling}; ranks {sorted(waiting.ranks)} did not "
                             "answer the cancel either (their writes may still land)")
        self._ctx.tell_done_soon(waiting.load)
        self._ctx.finish_load(waiting.req_id, waiting.load, error)

    # ---- prefill side ----

    def _url(self, header: Header) -> str | None:
        """Where a decoder's records are, as its message says: only a rendezvous this
        instance was configured to dial (``Options.peer_side_channels``)."""
        try:
            return allowed_rendezvous(header.optional_text("rendezvous", 300),
                                      *self._ctx.dialable)
        except ParamsError as e:
            raise ControlError(str(e)) from None

    def handle_cancel(self, header: Header, now: float, sender: bytes = b"") -> None:
        """A decode rank stopped waiting for a request: nothing more goes to it, what is in
        flight is cancelled, and it is answered once nothing is (``_push_done``). Its ids
        may come after this message (delivery is unordered): then they are dropped. Acted on
        only with the request's token (never looked up here: answers go out in the
        background)."""
        key = (header.text("req", MAX_ID), header.text("engine", MAX_ID),
               header.integer("rank", 0, MAX_TP - 1))
        token, url = header.token(), self._url(header)
        with self._lock:
            push = self._pushes.get(key[0])
            if push is not None and push.token is not None and not same_token(push.token, token):
                return  # forged, or another incarnation's
            named = ([w for k, w in push.wants.items() if k[:2] == key[1:]]
                     if push is not None else [])
            want = next((w for w in named if not sender or not w.sender or w.sender == sender),
                        None)
            if named and (want is None or not same_token(want.token, token)):
                return
            if want is None:
                self._remember_cancel(key, (now, token, url))
                answered = None
            else:
                answered = want.replied or want.stop_answered
                if not answered:
                    want.cancelled = want.replied = True
                transfers = list(want.transfers)
            verified = push is not None and push.token is not None
        if want is None:
            if verified:  # a request this prefill knows: answered that nothing is in flight
                self._reply(key[0], _Want(key[1], key[2], 0, [], url=url, token=token,
                                          verified=True), None, cancelled=True)
            return
        if answered:
            # It finished, or was aborted, (and said so) before the cancel came: say so again.
            self._reply(key[0], want, want.aborted or want.error, cancelled=want.cancelled)
            return
        for transfer in transfers:
            self._ctx.in_background(transfer.cancel)
        self._push_done(key[0], want, None, submitted=False)

    def _remember_cancel(self, key: tuple[str, str, int], value: tuple[float, str, str | None]
                         ) -> None:
        if key not in self._cancels:
            while len(self._cancels) >= MAX_PENDING:
                self._forget_cancel(next(iter(self._cancels)))
            self._cancelled_ranks.setdefault(key[0], {})[key[1:]] = None
        self._cancels[key] = value
        self._cancels.move_to_end(key)

    def _forget_cancel(self, key: tuple[str, str, int]) -> None:
        del self._cancels[key]
        ranks = self._cancelled_ranks[key[0]]
        del ranks[key[1:]]
        if not ranks:
            del self._cancelled_ranks[key[0]]

    def tokens_known(self, tokens: Mapping[str, str], now: float) -> None:
        """The tokens of push requests this prefill scheduled (their parameters'): decoders'
        ids that came with another token are dropped, those with it are acted on now, and
        early cancels with it are answered."""
        resolve, answer = [], []
        with self._lock:
            for req_id, token in tokens.items():
                push = self._push_of(req_id, now)
                if push.token is not None:
                    continue
                push.token = token
                self._leave_unverified(req_id, push)
                for key, want in list(push.wants.items()):
                    if not same_token(token, want.token):
                        del push.wants[key]
                    elif not want.verified:
                        want.verified = True
                        resolve.append((req_id, want))
                for decoder in self._cancelled_ranks.get(req_id, ()):
                    key = (req_id, *decoder)
                    _, cancel_token, url = self._cancels[key]
                    if same_token(token, cancel_token):
                        answer.append((req_id, _Want(key[1], key[2], 0, [], url=url,
                                                     token=cancel_token, verified=True)))
                        self._cancels[key] = (now, cancel_token, url)  # still drops its ids
                        self._cancels.move_to_end(key)
        for req_id, want in resolve:
            self._ctx.in_background(self._resolve_want, req_id, want)
        for req_id, want in answer:
            self._reply(req_id, want, None, cancelled=True)

    def step_started(self, computing: dict[str, list[int]], now: float) -> None:
        """``start_load_kv``: the push requests this step computes, with their blocks."""
        with self._lock:
            for req_id, blocks in computing.items():
                push = self._push_of(req_id, now)
                if push.blocks != blocks:
                    push.computed.clear()  # this step computes the layers for more blocks
                push.blocks = blocks
            self._step_pushes = list(computing)

    def layer_computed(self, layer: str, kv_layer: Any) -> None:
        """``save_kv_layer``: this step's push requests get the layer now (CPU tensors) or
        once the step's stream is synchronised (GPU tensors, whose kernels may still run)."""
        if not self._step_pushes:
            return
        if getattr(getattr(kv_layer, "device", None), "type", "cpu") != "cpu":
            self._deferred_layers.append(layer)
            return
        self._push_layers(self._step_pushes, [layer])

    def step_computed(self) -> None:
        """``wait_for_save``: pushes the GPU layers held back this step."""
        if self._deferred_layers:
            import torch

            torch.cuda.current_stream().synchronize()
            layers, self._deferred_layers = self._deferred_layers, []
            self._push_layers(self._step_pushes, layers)

    def _push_layers(self, req_ids: list[str], layers: list[str]) -> None:
        for req_id in req_ids:
            with self._lock:
                push = self._pushes.get(req_id)
                if push is None:
                    continue
                push.computed.update(layers)
                wants = list(push.wants.values())
            for want in wants:
                for layer in layers:
                    self._push_layer(req_id, push, want, layer)

    def _push_layer(self, req_id: str, push: _Push, want: _Want, layer: str) -> None:
        """Writes one layer of ``req_id``'s blocks to one decode rank (this rank's share)."""
        ctx = self._ctx
        with self._lock:
            if (layer in want.layers or want.replied or want.error is not None or not want.ready
                    or want.aborted is not None or not want.verified
                    or not same_token(push.token, want.token)):
                return  # written only to a decoder that sent this request's token
            if not push.finished and len(push.blocks) < len(want.blocks):
                return  # a chunk of a longer prompt: this layer goes when all is computed
            want.layers.add(layer)
            blocks = list(push.blocks)
            # The layer counts as in flight from here: a cancel or abort that comes while it
            # is planned and submitted is answered only once its writes are (released below).
            want.pending += 1
        try:
            region, view = ctx.layers()[layer]
            peer = ctx.peer(want.engine, want.rank, want.url)
            drafter_only = layer not in peer.layers and ctx.is_draft_layer(layer)
            if layer not in peer.layers and not drafter_only:
                raise LayoutError(f"decoder {want.engine} rank {want.rank} has no layer {layer}")
            writes = []
            if not drafter_only:  # a decoder without a drafter is owed nothing of its layers
                desc, theirs_view = peer.layers[layer]
                theirs, ours = matched_blocks(want.blocks, blocks)
                # The decoder's runs, turned around: its "remote" bytes are this rank's.
                writes = [run for run in block_runs(theirs_view, view, want.rank, want.tp,
                                                    ctx.tp_size)
                          if run.remote_rank == ctx.rank]
        except Exception as e:  # noqa: BLE001 - this decoder's load fails, named
            self._push_done(req_id, want, e)
            return
        with self._lock:
            if want.cancelled or want.aborted is not None:
                writes = []  # stopped while planned: nothing goes
            want.pending += len(writes)
        for run in writes:
            try:
                transfer = ctx.engine.submit_paged_writes(
                    run.length, region, view.rows(ours), desc, theirs_view.rows(theirs),
                    src_stride=view.strides[0], dst_stride=theirs_view.strides[0],
                    src_offset=view.offset + run.remote, dst_offset=theirs_view.offset + run.local,
                    on_done=lambda error, want=want: self._push_done(req_id, want, error),
                )
            except Exception as e:  # noqa: BLE001 - refused at submit: counted like a failure
                self._push_done(req_id, want, e)
                continue
            with self._lock:
                want.transfers.append(transfer)
                cancelled = want.cancelled or want.aborted is not None
            if cancelled:  # the cancel or abort came while this layer was being submitted
                ctx.in_background(transfer.cancel)
        self._push_done(req_id, want, None)  # the layer's planning is over

    def _push_done(self, req_id: str, want: _Want, error: BaseException | None,
                   submitted: bool = True) -> None:
        with self._lock:
            if submitted:
                want.pending -= 1
            stopping = want.cancelled or want.aborted is not None
            if error is not None and want.error is None and not stopping:
                want.error = str(error)
            # A cancelled or aborted want is answered once, when its last write is no longer in
            # flight (the decoder's cancel is answered as such: it fails the load itself).
            stopped = stopping and want.pending == 0 and not want.stop_answered
            if stopped:
                want.stop_answered = True
        if stopped:
            self._reply(req_id, want, None if want.cancelled else want.aborted,
                        cancelled=want.cancelled)
            return
        self._maybe_reply(req_id, want)

    def _maybe_reply(self, req_id: str, want: _Want) -> None:
        """Tells a decode rank its push is complete: the request computed, every layer
        written (or failed), nothing in flight."""
        layers = set(self._ctx.layers())
        with self._lock:
            push = self._pushes.get(req_id)
            done = push is not None and push.finished and want.ready and want.pending == 0 and (
                want.error is not None or layers <= want.layers)
            if not done or want.replied or want.aborted is not None:
                return
            want.replied = True
        self._reply(req_id, want, want.error)

    def _reply(self, req_id: str, want: _Want, error: str | None, cancelled: bool = False) -> None:
        """Tells a decode rank how its push ended, in the background (its record may have to
        be looked up: never on the engine's callback thread or vLLM's model-runner thread).
        Only to a decoder that sent the request's token."""
        if want.verified:
            self._ctx.in_background(self._send_reply, req_id, want, error, cancelled)

    def _send_reply(self, req_id: str, want: _Want, error: str | None, cancelled: bool) -> None:
        ctx = self._ctx
        header = {"req": req_id, "engine": ctx.engine_id, "rank": ctx.rank,
                  "ok": error is None and not cancelled, "why": error, "cancelled": cancelled,
                  "token": want.token}
        try:
            ctx.engine.submit_send(ctx.peer(want.engine, want.rank, want.url).address,
                                   pack_message(_PUSHED, header))
        except Exception as e:  # noqa: BLE001 - the decoder times out instead
            ctx.logger.warning("XferConnector: could not tell %s rank %d about request %s: %s",
                               want.engine, want.rank, req_id, e)

    def handle_want(self, header: Header, payload: bytes, now: float, sender: bytes = b"") -> None:
        """A decode rank's block ids for one of this instance's requests: acted on (its
        record looked up, layers written to it) only once its token is the request's own;
        until this prefill schedules the request, kept (bounded) unanswered."""
        want = _Want(header.text("engine", MAX_ID), header.integer("rank", 0, MAX_TP - 1),
                     header.integer("tp", 1, MAX_TP), block_id_array(payload, MAX_MESSAGE // 4),
                     url=self._url(header), model=header.text("model", 1024, default=""),
                     token=header.token(), sender=sender)
        req_id = header.text("req", MAX_ID)
        with self._lock:
            cancel = self._cancels.get((req_id, want.engine, want.rank))
            if cancel is not None and same_token(cancel[1], want.token):
                self._forget_cancel((req_id, want.engine, want.rank))
                return  # its decode rank gave up before these ids arrived
            push = self._pushes.get(req_id)
            if push is None:
                if len(self._unverified) >= MAX_PENDING:
                    self._drop_unverified(next(iter(self._unverified)))
                push = self._push_of(req_id, now)
            if push.token is not None and not same_token(push.token, want.token):
                return  # forged, or for another incarnation of this instance
            want.verified = push.token is not None
            aborted = push.aborted
            if aborted is None:
                # A resend from the decoder replaces its ids; ids in its name from another
                # engine are kept beside them until its record says whose they are.
                key = (want.engine, want.rank, want.sender)
                replaced = push.wants.get(key)
                if replaced is None and len(push.wants) >= MAX_WANTS:
                    self.dropped_wants += 1
                    return
                push.wants[key] = want
                if not want.verified:
                    self._unverified[req_id] = None
                    self._unverified_wants += replaced is None
                    self._unverified_ids += len(want.blocks) - (
                        len(replaced.blocks) if replaced is not None else 0)
                    self._bound_unverified_wants()
        if not want.verified:
            return  # acted on when the request's token is known (tokens_known)
        if aborted is not None:  # its writes to other decoders are still being stopped
            self._reply(req_id, want, aborted)
            return
        # Closing (None): no more pushes.
        self._ctx.in_background(self._resolve_want, req_id, want)

    def _bound_unverified_wants(self) -> None:
        """Keeps at most ``MAX_PENDING`` decoders' ids, ``MAX_PENDING_IDS`` block ids in all,
        for requests not scheduled here yet, dropping the oldest such requests first (with
        ``self._lock`` held). Each want is dropped at most once: O(1) amortised a want."""
        while self._unverified and (self._unverified_wants > MAX_PENDING
                                    or self._unverified_ids > MAX_PENDING_IDS):
            self._drop_unverified(next(iter(self._unverified)))

    def _drop_unverified(self, req_id: str) -> None:
        """Forgets a request kept only for decoders' ids before its token (a bound's victim;
        nothing was written or answered for them), counting its wants as dropped."""
        self.dropped_wants += len(self._forget_push(req_id).wants)

    def _push_of(self, req_id: str, now: float) -> _Push:
        """``req_id``'s push request, made (as uncomputed, from ``now``) if there is none
        (with ``self._lock`` held)."""
        push = self._pushes.get(req_id)
        if push is None:
            push = self._pushes[req_id] = _Push()
            self._uncomputed[req_id] = now
        return push

    def _forget_push(self, req_id: str) -> _Push:
        """Forgets a push request, wherever it is counted (with ``self._lock`` held)."""
        push = self._pushes.pop(req_id)
        self._leave_unverified(req_id, push)
        self._uncomputed.pop(req_id, None)
        self._computed.pop(req_id, None)
        self._aborted.pop(req_id, None)
        return push

    def _leave_unverified(self, req_id: str, push: _Push) -> None:
        """``req_id`` no longer holds ids before its token (known now, or forgotten): its
        wants leave the bounds' count (with ``self._lock`` held)."""
        if self._unverified.pop(req_id, False) is None:
            self._unverified_wants -= len(push.wants)
            self._unverified_ids -= sum(len(w.blocks) for w in push.wants.values())

    def _resolve_want(self, req_id: str, want: _Want) -> None:
        """Finds the decode rank's record; then, if the request was computed before, pushes
        every layer now (otherwise its layers go as they are computed, or at the end)."""
        ctx = self._ctx
        try:
            found = ctx.peer(want.engine, want.rank, want.url)
            if want.sender and found.address != want.sender:
                # Ids in a decoder's name from another engine (with the request's token):
                # nothing is written for them, and the decoder's own ids still count.
                ctx.logger.warning("XferConnector: ids for request %s in the name of %s rank %d "
                                   "came from another engine; dropped", req_id, want.engine,
                                   want.rank)
                with self._lock:
                    push = self._pushes.get(req_id)
                    key = (want.engine, want.rank, want.sender)
                    if push is not None and push.wants.get(key) is want:
                        del push.wants[key]
                return
        except Exception as e:  # noqa: BLE001 - that decoder cannot be reached: it times out
            ctx.logger.warning("XferConnector: decoder %s rank %d of request %s not found: %s",
                               want.engine, want.rank, req_id, e)
            with self._lock:
                want.error, want.replied = str(e), True
            return
        if want.model and ctx.model and want.model != ctx.model:
            with self._lock:
                want.ready, want.replied = True, True
            self._reply(req_id, want, f"the decoder serves model {want.model!r}, this prefill "
                        f"instance {ctx.model!r}")
            return
        why = ctx.incompatible(found)
        if why is not None:
            with self._lock:
                want.ready, want.replied = True, True
            self._reply(req_id, want, f"the decoder cannot take this instance's KV: {why}")
            return
        with self._lock:
            want.ready = True
            push = self._pushes.get(req_id)
            finished = push is not None and push.finished
            computed = sorted(push.computed) if push is not None else []
        if finished:
            self._push_layers([req_id], list(ctx.layers()))
            self._maybe_reply(req_id, want)
        elif computed:
            # Layers computed while the record was being looked up go now, not at the end.
            self._push_layers([req_id], computed)

    def request_finished(self, req_id: str, blocks: list[int], now: float) -> None:
        """The request is computed: layers its decoders have not had yet go now (all of them
        if its blocks changed since they were pushed)."""
        moved = []
        with self._lock:
            push = self._push_of(req_id, now)
            if push.blocks != blocks:
                push.blocks = blocks
                for want in push.wants.values():
                    if want.layers and not want.replied and want.aborted is None:
                        moved.append((want, list(want.transfers)))
                        want.aborted = ("the prefill's blocks changed after layers were written "
                                        "to this decoder: rewriting them could land in either "
                                        "order (SRD, striping), so the load fails")
            push.finished = True
            self._uncomputed.pop(req_id, None)
            if push.aborted is None:
                self._computed[req_id] = None
            wants = list(push.wants.values())
        for want, transfers in moved:
            for transfer in transfers:
                self._ctx.in_background(transfer.cancel)
            self._push_done(req_id, want, None, submitted=False)
        self._push_layers([req_id], list(self._ctx.layers()))
        for want in wants:
            self._maybe_reply(req_id, want)

    def request_aborted(self, req_id: str, why: str) -> None:
        """The request will not be computed or pushed here: nothing more is written, the
        writes in flight are cancelled, and each decoder not yet answered is told ``why`` once
        none of its writes is (``_push_done``). The request is forgotten at the first ``poll``
        with nothing of it in flight."""
        with self._lock:
            push = self._pushes.get(req_id)
            if push is None or push.aborted is not None:
                return
            push.aborted = why
            self._uncomputed.pop(req_id, None)
            self._computed.pop(req_id, None)
            self._aborted[req_id] = None
            stopping = []
            for want in push.wants.values():
                if want.replied:
                    continue  # answered already, or answered once its cancel's writes stop
                want.aborted = why
                stopping.append((want, list(want.transfers)))
        for want, transfers in stopping:
            for transfer in transfers:
                self._ctx.in_background(transfer.cancel)
            self._push_done(req_id, want, None, submitted=False)

    # ---- both ----

    def poll(self, now: float, kept: Collection[str]) -> None:
        """Between steps (``get_finished``). Decode: a push past its deadline is cancelled at
        its prefill ranks, and ends if they have not answered by the next. Prefill: early
        cancels are forgotten once stale; push requests computed and no longer in ``kept``
        (the requests whose blocks still wait for their decoders: these were freed), or never
        computed here since their decoders' ids came, are aborted (``request_aborted``: the
        decoders not yet answered are told which, once nothing is in flight to them); aborted
        ones are forgotten once nothing is."""
        ctx = self._ctx
        with self._lock:
            cancel, late = [], []
            for key, waiting in [(k, w) for k, w in self._awaiting.items() if now >= w.deadline]:
                if waiting.handle_deadline(now, ctx.push_timeout_s):
                    cancel.append((key, waiting, sorted(waiting.ranks)))
                else:
                    late.append(self._awaiting.pop(key))
            # Oldest first: the stale ones are at the front, and a step goes through no other
            # (the worker's clock is monotonic; one read on another thread just before a later
            # one taken the lock first is forgotten at most that much late).
            while self._cancels:
                key, (when, _, _) = next(iter(self._cancels.items()))
                if now - when <= ctx.forget_after_s:
                    break
                self._forget_cancel(key)
            freed = [r for r in self._computed if r not in kept]
            never = []
            while self._uncomputed:
                req_id, created = next(iter(self._uncomputed.items()))
                if now - created <= ctx.forget_after_s:
                    break
                del self._uncomputed[req_id]
                never.append(req_id)
        for key, waiting, ranks in cancel:
            ctx.in_background(self._cancel_push, key, waiting, ranks)
        for waiting in late:
            self._finish_unanswered(waiting)
        for req_id in freed:
            self.request_aborted(req_id, "the prefill instance freed the request's blocks "
                                 "before they were written to this decoder")
        for req_id in never:
            self.request_aborted(req_id, "the prefill instance never computed the request "
                                 f"(within {ctx.forget_after_s}s of the decoders' block ids)")
        with self._lock:  # the aborted ones, once none of their writes is in flight
            for req_id in [r for r in self._aborted
                           if all(w.pending == 0 for w in self._pushes[r].wants.values())]:
                self._forget_push(req_id)

    def wants(self, req_id: str) -> list[_Want]:
        """The decode ranks whose block ids for ``req_id`` came (for tests and diagnostics)."""
        with self._lock:
            push = self._pushes.get(req_id)
            return list(push.wants.values()) if push is not None else []
