"""Push mode of the vLLM connector (``xfer.vllm``): the decode rank's block ids sent to the
prefill ranks it expects data from, and the prefill rank writing each layer as it is computed.

``PushSide`` is the push half of the connector's worker (``xfer.vllm._Worker`` extends it): one
state with the pull half, so that a pushed load ends through the same accounting as a pulled
one. What it uses of the worker: ``_lock``, ``_engine``, ``_engine_id``, ``_rank``,
``_tp_size``, ``_model``, ``_own_url``, ``_options``, ``_layers``, ``_lookups``,
``_load_started``, ``_peer()``, ``_remote_view()``, ``_shared_layers()``, ``is_draft_layer()``,
``_in_background()``, ``_tell_done_soon()`` and
``_finish_load()``; what it owns:
``_pushes``, ``_step_pushes``, ``_deferred_layers`` and ``_awaiting`` (created by the worker's
constructor, with the rest).
"""

from __future__ import annotations

import array
import dataclasses
import logging
import sys
import time
from typing import TYPE_CHECKING, Any

from ._kvcache import LayoutError, block_runs, matched_blocks, pack_message

if TYPE_CHECKING:
    from .vllm import Load

logger = logging.getLogger("xfer.vllm")

_WANT = b"xfer-vllm-want:"
"""Push: a decode rank's block ids for a request, to each prefill rank it expects data from."""
_PUSHED = b"xfer-vllm-push:"
"""Push: a prefill rank wrote every layer of a request to a decode rank (or could not, or
stopped at the decode rank's cancel: then nothing of it is in flight any more)."""
_CANCEL = b"xfer-vllm-stop:"
"""Push: a decode rank gave up waiting for a request; the prefill rank writes nothing more
there and answers with ``_PUSHED`` once none of its writes is in flight."""


@dataclasses.dataclass
class _Want:
    """Push, prefill side: one decode rank's blocks for a request, and what went to it."""

    engine: str
    rank: int
    tp: int
    blocks: list[int]
    url: str | None = None
    """Where the decode rank's records are (its side channel, or the shared rendezvous)."""
    model: str = ""
    """The model the decoder serves (checked against this instance's)."""
    ready: bool = False
    """Its record was found (looked up off the engine's callback thread); until then nothing
    is written to it."""
    layers: set[str] = dataclasses.field(default_factory=set)
    """Layers whose writes were submitted (for the request's current blocks)."""
    pending: int = 0
    """Writes submitted whose completion has not come."""
    transfers: list[Any] = dataclasses.field(default_factory=list)
    """The writes submitted, for a cancel."""
    error: str | None = None
    replied: bool = False
    cancelled: bool = False
    """The decode rank gave up: nothing more is written; answered once ``pending`` is 0."""
    stop_answered: bool = False


@dataclasses.dataclass
class _Push:
    """Push, prefill side: a request's blocks here and the decode ranks that want them."""

    created: float
    blocks: list[int] = dataclasses.field(default_factory=list)
    wants: dict[tuple[str, int], _Want] = dataclasses.field(default_factory=dict)
    finished: bool = False
    computed: set[str] = dataclasses.field(default_factory=set)
    """Layers computed for these blocks: what a decoder found late is owed at once."""


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


class PushSide:
    """The push half of the connector's worker (see the module docs)."""

    # ---- push: decode side ----

    def _await_push(self, req_id: str, load: Load) -> None:
        """Sends this rank's block ids to every prefill rank it expects data from."""
        ranks = set()
        for name in self._shared_layers(load):
            view = self._layers[name][1]
            for run in block_runs(view, self._remote_view(load, 0, name), self._rank,
                                  self._tp_size, load.remote_tp_size):
                ranks.add(run.remote_rank)
        header = {"req": load.remote_request_id, "engine": self._engine_id, "rank": self._rank,
                  "tp": self._tp_size, "rendezvous": self._own_url, "model": self._model}
        # One KV cache group: the scheduler side refused push for the others.
        [blocks] = load.local_block_ids
        ids = array.array("i", blocks)
        if sys.byteorder != "little":
            ids.byteswap()
        message = pack_message(_WANT, header, ids.tobytes())
        if len(message) > 65536:
            raise LayoutError(f"{len(blocks)} blocks do not fit one message (64 KiB)")
        with self._lock:
            self._awaiting[(load.remote_engine_id, load.remote_request_id)] = _Await(
                req_id, load, ranks, time.monotonic() + self._options.push_timeout_s)
        try:
            for rank in sorted(ranks):
                self._engine.submit_send(self._peer(load.remote_engine_id, rank, load.remote_rendezvous).address, message)
        except Exception:
            with self._lock:
                self._awaiting.pop((load.remote_engine_id, load.remote_request_id), None)
            raise

    def _pushed(self, header: dict[str, Any]) -> None:
        """A prefill rank finished (or failed) writing a request to this rank."""
        key = (str(header["engine"]), str(header["req"]))
        with self._lock:
            waiting = self._awaiting.get(key)
            if waiting is None:
                return  # timed out already, or not ours
            waiting.ranks.discard(int(header["rank"]))
            if header.get("cancelled") and waiting.error is None:
                waiting.error = waiting.cancelling
            elif not header.get("ok") and waiting.error is None:
                waiting.error = RuntimeError(
                    f"prefill {key[0]} rank {header['rank']} could not push: {header.get('why')}")
            if waiting.ranks:
                return
            del self._awaiting[key]
        # The done message is queued (and remembered for `close`) before the load is reported:
        # a decode instance shut down as soon as vLLM sees the load finished would otherwise
        # drop it, and the prefill would hold the blocks until its lease.
        self._tell_done_soon(waiting.load)
        self._finish_load(waiting.req_id, waiting.load, waiting.error)

    def _push_late(self, key: tuple[str, str], waiting: _Await, now: float) -> bool:
        """A push past its deadline (called under the lock): the first time, it is kept and
        the prefill ranks still owing it are told to stop (True: sent from the background);
        a second time (they never answered), it ends (False)."""
        if waiting.cancelling is not None:
            return False
        waiting.cancelling = TimeoutError(
            f"prefill {key[0]} did not push request {key[1]} within "
            f"{self._options.push_timeout_s}s (ranks {sorted(waiting.ranks)} missing)")
        # As long again for the answers (a transfer's own timeout fails a write stuck there).
        waiting.deadline = now + self._options.push_timeout_s
        return True

    def _cancel_push(self, key: tuple[str, str], waiting: _Await, ranks: list[int]) -> None:
        """Tells each prefill rank that owes ``waiting`` to stop; one that cannot be reached
        has no connection left to write with."""
        load = waiting.load
        message = pack_message(_CANCEL, {"req": load.remote_request_id, "engine": self._engine_id,
                                         "rank": self._rank, "rendezvous": self._own_url})
        for rank in ranks:
            try:
                self._engine.submit_send(
                    self._peer(load.remote_engine_id, rank, load.remote_rendezvous).address,
                    message)
            except Exception as e:  # noqa: BLE001 - answered for it: it cannot write either
                logger.warning("XferConnector: prefill %s rank %d of request %s unreachable "
                               "for its cancel (%s)", load.remote_engine_id, rank, key[1], e)
                self._pushed({"engine": key[0], "req": key[1], "rank": rank,
                              "cancelled": True})

    def _finish_unanswered(self, key: tuple[str, str], waiting: _Await) -> None:
        """The ranks never answered the cancel either: the load ends (vLLM must not wait
        forever); named, since one of their writes could still be in flight."""
        error = TimeoutError(f"{waiting.cancelling}; ranks {sorted(waiting.ranks)} did not "
                             "answer the cancel either (their writes may still land)")
        self._tell_done_soon(waiting.load)
        self._finish_load(waiting.req_id, waiting.load, error)

    # ---- push: prefill side ----

    def _cancelled(self, header: dict[str, Any]) -> None:
        """A decode rank stopped waiting for a request: nothing more goes to it, what is in
        flight is cancelled, and it is answered once nothing is (``_push_done``). Its ids
        may come after this message (delivery is unordered): then they are dropped."""
        key = (str(header["req"]), str(header["engine"]), int(header["rank"]))
        with self._lock:
            push = self._pushes.get(key[0])
            want = push.wants.get(key[1:]) if push is not None else None
            if want is None:
                self._cancels[key] = time.monotonic()
                answered = None
            else:
                answered = want.replied
                want.cancelled = want.replied = True
                transfers = list(want.transfers)
        if want is None:
            self._reply(key[0], _Want(key[1], key[2], 0, [], url=header.get("rendezvous")),
                        None, cancelled=True)
            return
        if answered:
            # It finished (and said so) before the cancel came: say so again.
            self._reply(key[0], want, want.error)
            return
        for transfer in transfers:
            self._in_background(transfer.cancel)
        self._push_done(key[0], want, None, submitted=False)


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
                if push is not None:
                    push.computed.update(layers)
                wants = list(push.wants.values()) if push is not None else []
            for want in wants:
                for layer in layers:
                    self._push_layer(req_id, push, want, layer)

    def _push_layer(self, req_id: str, push: _Push, want: _Want, layer: str) -> None:
        """Writes one layer of ``req_id``'s blocks to one decode rank (this rank's share)."""
        with self._lock:
            if layer in want.layers or want.replied or want.error is not None or not want.ready:
                return
            if not push.finished and len(push.blocks) < len(want.blocks):
                return  # a chunk of a longer prompt: this layer goes when all is computed
            want.layers.add(layer)
            blocks = list(push.blocks)
        try:
            region, view = self._layers[layer]
            peer = self._peer(want.engine, want.rank, want.url)
            drafter_only = layer not in peer.layers and self.is_draft_layer(layer)
            if layer not in peer.layers and not drafter_only:
                raise LayoutError(f"decoder {want.engine} rank {want.rank} has no layer {layer}")
            writes = []
            if not drafter_only:  # a decoder without a drafter is owed nothing of its layers
                desc, theirs_view = peer.layers[layer]
                theirs, ours = matched_blocks(want.blocks, blocks)
                # The decoder's runs, turned around: its "remote" bytes are this rank's.
                writes = [run for run in block_runs(theirs_view, view, want.rank, want.tp,
                                                    self._tp_size)
                          if run.remote_rank == self._rank]
        except Exception as e:  # noqa: BLE001 - this decoder's load fails, named
            self._push_done(req_id, want, e, submitted=False)
            return
        if drafter_only:
            self._maybe_reply(req_id, want)
            return
        with self._lock:
            want.pending += len(writes)
        for run in writes:
            try:
                transfer = self._engine.submit_paged_writes(
                    run.length, region, ours, desc, theirs,
                    src_stride=view.strides[0], dst_stride=theirs_view.strides[0],
                    src_offset=view.offset + run.remote, dst_offset=theirs_view.offset + run.local,
                    on_done=lambda error, want=want: self._push_done(req_id, want, error),
                )
            except Exception as e:  # noqa: BLE001 - refused at submit: counted like a failure
                self._push_done(req_id, want, e)
                continue
            with self._lock:
                want.transfers.append(transfer)
                cancelled = want.cancelled
            if cancelled:  # the cancel came while this layer was being submitted
                self._in_background(transfer.cancel)

    def _push_done(self, req_id: str, want: _Want, error: BaseException | None,
                   submitted: bool = True) -> None:
        with self._lock:
            if submitted:
                want.pending -= 1
            if error is not None and want.error is None and not want.cancelled:
                want.error = str(error)
            # A cancelled want is answered once, when its last write is no longer in flight.
            stopped = want.cancelled and want.pending == 0 and not want.stop_answered
            if stopped:
                want.stop_answered = True
        if stopped:
            self._reply(req_id, want, None, cancelled=True)
            return
        self._maybe_reply(req_id, want)

    def _maybe_reply(self, req_id: str, want: _Want) -> None:
        """Tells a decode rank its push is complete: the request computed, every layer
        written (or failed), nothing in flight."""
        with self._lock:
            push = self._pushes.get(req_id)
            done = push is not None and push.finished and want.ready and want.pending == 0 and (
                want.error is not None or set(self._layers) <= want.layers)
            if not done or want.replied:
                return
            want.replied = True
        self._reply(req_id, want, want.error)

    def _reply(self, req_id: str, want: _Want, error: str | None, cancelled: bool = False) -> None:
        header = {"req": req_id, "engine": self._engine_id, "rank": self._rank,
                  "ok": error is None and not cancelled, "why": error, "cancelled": cancelled}
        try:
            self._engine.submit_send(self._peer(want.engine, want.rank, want.url).address,
                                     pack_message(_PUSHED, header))
        except Exception as e:  # noqa: BLE001 - the decoder times out instead
            logger.warning("XferConnector: could not tell %s rank %d about request %s: %s",
                           want.engine, want.rank, req_id, e)

    def _want(self, header: dict[str, Any], payload: bytes) -> None:
        """A decode rank's block ids for one of this instance's requests."""
        ids = array.array("i")
        ids.frombytes(payload)
        if sys.byteorder != "little":
            ids.byteswap()
        want = _Want(str(header["engine"]), int(header["rank"]), int(header["tp"]), list(ids),
                     url=header.get("rendezvous"), model=str(header.get("model") or ""))
        req_id = str(header["req"])
        with self._lock:
            if self._cancels.pop((req_id, want.engine, want.rank), None) is not None:
                return  # its decode rank gave up before these ids arrived
            push = self._pushes.setdefault(req_id, _Push(created=time.monotonic()))
            push.wants[(want.engine, want.rank)] = want
        try:
            self._lookups.submit(self._resolve_want, req_id, want)
        except RuntimeError:
            pass  # closing: no more pushes

    def _resolve_want(self, req_id: str, want: _Want) -> None:
        """Finds the decode rank's record; then, if the request was computed before, pushes
        every layer now (otherwise its layers go as they are computed, or at the end)."""
        try:
            self._peer(want.engine, want.rank, want.url)
        except Exception as e:  # noqa: BLE001 - that decoder cannot be reached: it times out
            logger.warning("XferConnector: decoder %s rank %d of request %s not found: %s",
                           want.engine, want.rank, req_id, e)
            with self._lock:
                want.error, want.replied = str(e), True
            return
        if want.model and self._model and want.model != self._model:
            with self._lock:
                want.ready, want.replied = True, True
            self._reply(req_id, want, f"the decoder serves model {want.model!r}, this prefill "
                        f"instance {self._model!r}")
            return
        with self._lock:
            want.ready = True
            push = self._pushes.get(req_id)
            finished = push is not None and push.finished
            computed = sorted(push.computed) if push is not None else []
        if finished:
            self._push_layers([req_id], list(self._layers))
            self._maybe_reply(req_id, want)
        elif computed:
            # Layers computed while the record was being looked up go now, not at the end.
            self._push_layers([req_id], computed)

    def _push_finished(self, req_id: str, blocks: list[int]) -> None:
        """The request is computed: layers its decoders have not had yet go now (all of them
        if its blocks changed since they were pushed)."""
        with self._lock:
            push = self._pushes.setdefault(req_id, _Push(created=time.monotonic()))
            if push.blocks != blocks:
                push.blocks = blocks
                for want in push.wants.values():
                    want.layers.clear()
            push.finished = True
            wants = list(push.wants.values())
        self._push_layers([req_id], list(self._layers))
        for want in wants:
            self._maybe_reply(req_id, want)

    def _push_aborted(self, req_id: str, why: str) -> None:
        with self._lock:
            push = self._pushes.pop(req_id, None)
            wants = [w for w in push.wants.values() if not w.replied] if push else []
            for want in wants:
                want.replied = True
        for want in wants:
            self._reply(req_id, want, why)
