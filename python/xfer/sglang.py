"""xfer as an SGLang disaggregation transfer backend (SGLang 0.5's ``disaggregation/base``).

SGLang pushes: the decode instance allocates pages for a request and sends their indices to
the prefill instance (``KVReceiver.send_metadata``), which writes each chunk of KV pages into
them as it computes (``KVSender.send``) — one paged write per KV buffer per chunk, pages from
indices — then the auxiliary data, then tells the decode instance by bootstrap room. Both sides
poll ``KVPoll`` states: Bootstrapping → WaitingForInput → Transferring → Success or Failed.

Select it (SGLang has no registry of transfer backends yet)::

    import xfer.sglang
    xfer.sglang.register()          # then --disaggregation-transfer-backend xfer

**Bootstrap**: the prefill instance's bootstrap server is xfer's rendezvous service
(``xfer.Server`` on the bootstrap host and port; it serves loopback only unless
``$XFER_SECRET_FILE`` names the cluster secret). Prefill ranks publish
``sglang.prefill.<rank>``; a decode rank publishes its KV buffers there as
``sglang.decode.<id>.<rank>`` when it first meets that prefill. Engines use ``$XFER_CONFIG``
(or the config given to ``register``); without either, the backend refuses to start.

**Failures** — a peer gone, a refused write, no answer within ``transfer_timeout_s`` — end in
``KVPoll.Failed`` with ``failure_exception()`` naming the cause, on both sides; ``abort()``
ends a transfer at once. Not yet (issue 28): different TP sizes, state (Mamba/SWA) buffers,
decode-side prefix reuse.
"""

from __future__ import annotations

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

from ._kvcache import pack_message, unpack_message

logger = logging.getLogger("xfer.sglang")

NAME = "xfer"
_META, _DONE, _FAIL = b"xsg-meta\n", b"xsg-done\n", b"xsg-fail\n"
"""Prefixes of the messages between the instances (a JSON header follows)."""

_config: Any = None
transfer_timeout_s = 60.0
"""How long a receiver waits for its data, and a sender for its peer's indices."""


def _engine_config() -> Any:
    if _config is not None:
        return _config
    if os.environ.get("XFER_CONFIG"):
        return None  # the engine reads it
    raise ValueError(
        "the xfer transfer backend needs an engine config: xfer.sglang.register(config=...) "
        "or $XFER_CONFIG"
    )


def _message(prefix: bytes, header: dict[str, Any], payload: bytes = b"") -> bytes:
    return pack_message(prefix, header, payload)


def _parse(data: bytes) -> tuple[bytes, dict[str, Any], bytes]:
    return unpack_message(data, len(_META))


class XferKVBootstrapServer(BaseKVBootstrapServer):
    """The prefill instance's bootstrap server: xfer's rendezvous service."""

    def __init__(self, host: str, port: int):
        self.server = xfer.Server(f"{host}:{port}", secret_file=os.environ.get("XFER_SECRET_FILE"))

    @property
    def url(self) -> str:
        return self.server.url

    def close(self) -> None:
        self.server.close()


class XferKVManager(BaseKVManager):
    """One per rank: the engine, the registered KV and aux buffers, messages in and out."""

    def __init__(self, args: KVArgs, disaggregation_mode: DisaggregationMode, server_args: Any,
                 is_mla_backend: bool | None = False):
        self.args = args
        self.mode = disaggregation_mode
        self.server_args = server_args
        self.rank = int(args.engine_rank)
        self.engine = xfer.TransferEngine(_engine_config())
        access = "local" if disaggregation_mode == DisaggregationMode.PREFILL else "write"
        self.kv = [self.engine.reg_mr_raw(p, n, access=access)
                   for p, n in zip(args.kv_data_ptrs, args.kv_data_lens)]
        self.aux = [self.engine.reg_mr_raw(p, n, access=access)
                    for p, n in zip(args.aux_data_ptrs, args.aux_data_lens)]
        self.id = uuid.uuid4().hex[:12]
        self.lock = threading.Lock()
        self.metadata: dict[int, tuple[dict[str, Any], np.ndarray]] = {}
        """Prefill: each room's decode destination, as its receiver sent it."""
        self.outcomes: dict[int, str | None] = {}
        """Decode: each room's end (None: done; else why it failed)."""
        self.rendezvous: dict[str, xfer.Rendezvous] = {}
        self.publications: list[Any] = []
        self.published_at: set[str] = set()
        """Decode: the bootstraps this rank's buffers were published at."""
        self.peers: dict[str, dict[str, Any]] = {}
        """Prefill: decode ranks' records, by name."""
        self.engine.submit_recvs(65536, 64, self._on_message)
        if disaggregation_mode == DisaggregationMode.PREFILL:
            self.register_to_bootstrap()

    def _bootstrap(self, addr: str) -> xfer.Rendezvous:
        with self.lock:
            r = self.rendezvous.get(addr)
        if r is None:
            r = xfer.Rendezvous(f"xfer://{addr}", connect_timeout=transfer_timeout_s,
                                secret_file=os.environ.get("XFER_SECRET_FILE"))
            with self.lock:
                self.rendezvous[addr] = r
        return r

    def register_to_bootstrap(self) -> None:
        host = getattr(self.server_args, "disaggregation_bootstrap_host", None) or "127.0.0.1"
        addr = f"{host}:{self.server_args.disaggregation_bootstrap_port}"
        self.publications.append(
            self._bootstrap(addr).publish(f"sglang.prefill.{self.rank}", self.engine.main_address)
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
            self.publications.append(
                self._bootstrap(addr).publish(name, self.engine.main_address, regions)
            )
        return name

    def _on_message(self, data: bytes) -> None:
        try:
            prefix, header, payload = _parse(data)
        except ValueError:
            logger.warning("xfer.sglang: a malformed message was ignored")
            return
        room = int(header["room"])
        with self.lock:
            if prefix == _META:
                self.metadata[room] = (header, np.frombuffer(payload, dtype="<i4").copy())
            elif prefix == _DONE:
                self.outcomes[room] = None
            elif prefix == _FAIL:
                self.outcomes[room] = str(header.get("why", "the prefill failed"))

    def close(self) -> None:
        for p in self.publications:
            p.unpublish()
        self.engine.close()


class XferKVSender(BaseKVSender):
    """Prefill: writes a request's pages into the decode instance's, chunk by chunk."""

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

    def init(self, num_kv_indices: int, aux_index: int | None = None) -> None:
        self.total, self.aux_index = int(num_kv_indices), aux_index

    def _destination(self) -> tuple[dict[str, Any], np.ndarray] | None:
        with self.mgr.lock:
            return self.mgr.metadata.get(self.room)

    def send(self, kv_indices: Any, state_indices: Any = None, num_kv_tokens: Any = None) -> None:
        dest = self._destination()
        if dest is None:
            self._fail(f"room {self.room}: send before the decode instance sent its page indices")
            return
        header, dst_pages = dest
        pages = np.asarray(kv_indices, dtype=np.int64)
        if self.sent + len(pages) > len(dst_pages):
            self._fail(f"room {self.room}: {self.sent + len(pages)} pages sent, the decode "
                       f"instance allocated {len(dst_pages)}")
            return
        self.started = self.started or time.monotonic()
        try:
            peer = self._peer(header)
            dst = dst_pages[self.sent : self.sent + len(pages)]
            for i, (region, item) in enumerate(zip(self.mgr.kv, self.mgr.args.kv_item_lens)):
                self._submit(lambda: self.mgr.engine.submit_paged_writes(
                    item, region, pages, peer["regions"][f"kv{i}"], dst, on_done=self._one_done))
                self.bytes += item * len(pages)
            self.sent += len(pages)
            if self.sent >= self.total:
                if self.aux_index is not None and header.get("aux_index") is not None:
                    for i, (region, item) in enumerate(zip(self.mgr.aux, self.mgr.args.aux_item_lens)):
                        self._submit(lambda: self.mgr.engine.submit_paged_writes(
                            item, region, [self.aux_index], peer["regions"][f"aux{i}"],
                            [int(header["aux_index"])], on_done=self._one_done))
                self.finished = True
                self._maybe_done()
        except Exception as e:  # noqa: BLE001 - any failure ends this transfer
            self._fail(f"room {self.room}: {e}")

    def _peer(self, header: dict[str, Any]) -> dict[str, Any]:
        name = header["decode"]
        with self.mgr.lock:
            known = self.mgr.peers.get(name)
        if known is None:
            known = self.mgr._bootstrap(self.addr).lookup(name, transfer_timeout_s)
            with self.mgr.lock:
                self.mgr.peers[name] = known
        return known

    def _submit(self, post: Any) -> None:
        with self.mgr.lock:
            self.pending += 1
        try:
            self.transfers.append(post())
        except Exception:
            with self.mgr.lock:
                self.pending -= 1
            raise

    def _one_done(self, error: BaseException | None) -> None:
        if error is not None:
            self._fail(f"room {self.room}: a write failed: {error}")
        with self.mgr.lock:
            self.pending -= 1
        self._maybe_done()

    def _maybe_done(self) -> None:
        with self.mgr.lock:
            ready = self.finished and self.pending == 0 and self.failure is None and self.ended is None
            if ready:
                self.ended = time.monotonic()
        if ready:
            header, _ = self._destination()
            peer = self._peer(header)
            self.mgr.engine.submit_send(peer["addr"], _message(_DONE, {"room": self.room}))

    def _fail(self, why: str) -> None:
        with self.mgr.lock:
            first = self.failure is None
            if first:
                self.failure = why
        if first:
            logger.error("xfer.sglang: %s", why)
            dest = self._destination()
            if dest is not None:
                try:
                    peer = self._peer(dest[0])
                    self.mgr.engine.submit_send(peer["addr"], _message(_FAIL, {"room": self.room, "why": why}))
                except Exception:  # noqa: BLE001 - the receiver times out instead
                    pass

    def poll(self) -> int:
        if self.failure is not None:
            return KVPoll.Failed
        if self.ended is not None:
            return KVPoll.Success
        if self._destination() is None:
            if time.monotonic() - self.created > transfer_timeout_s:
                self._fail(f"room {self.room}: the decode instance never sent its page indices")
                return KVPoll.Failed
            return KVPoll.Bootstrapping
        return KVPoll.Transferring if self.sent else KVPoll.WaitingForInput

    def get_transfer_metric(self) -> KVTransferMetric:
        latency = None if self.started is None or self.ended is None else self.ended - self.started
        return KVTransferMetric(transfer_latency_s=latency, transfer_total_bytes=self.bytes)

    def failure_exception(self) -> None:
        raise RuntimeError(f"xfer transfer failed: {self.failure}")

    def abort(self) -> None:
        for t in self.transfers:
            t.cancel()
        self._fail(f"room {self.room}: aborted")

    def clear(self) -> None:
        with self.mgr.lock:
            self.mgr.metadata.pop(self.room, None)


class XferKVReceiver(BaseKVReceiver):
    """Decode: sends its page indices to the prefill instance and waits for the data."""

    def __init__(self, mgr: XferKVManager, bootstrap_addr: str, bootstrap_room: int | None = None,
                 *args: Any, **kwargs: Any):
        self.mgr, self.addr, self.room = mgr, bootstrap_addr, int(bootstrap_room or 0)
        self.prefill: dict[str, Any] | None = None
        self.failure: str | None = None
        self.deadline: float | None = None

    def init(self, prefill_dp_rank: int = 0, *args: Any, **kwargs: Any) -> None:
        try:
            rdv = self.mgr._bootstrap(self.addr)
            self.prefill = rdv.lookup(f"sglang.prefill.{self.mgr.rank}", transfer_timeout_s)
            self.record = self.mgr.decode_record(self.addr)
        except Exception as e:  # noqa: BLE001 - reported through poll
            self.failure = f"room {self.room}: no prefill at {self.addr}: {e}"

    def send_metadata(self, kv_indices: Any, aux_index: int | None = None, state_indices: Any = None,
                      decode_prefix_len: int | None = None, *args: Any, **kwargs: Any) -> None:
        if self.failure is not None or self.prefill is None:
            return
        pages = np.asarray(kv_indices, dtype="<i4").tobytes()
        header = {"room": self.room, "decode": self.record, "aux_index": aux_index}
        try:
            self.mgr.engine.submit_send(self.prefill["addr"], _message(_META, header, pages))
            self.deadline = time.monotonic() + transfer_timeout_s
        except Exception as e:  # noqa: BLE001
            self.failure = f"room {self.room}: could not reach the prefill instance: {e}"

    def poll(self) -> int:
        if self.failure is not None:
            return KVPoll.Failed
        if self.prefill is None:
            return KVPoll.Bootstrapping
        if self.deadline is None:
            return KVPoll.WaitingForInput
        with self.mgr.lock:
            done = self.room in self.mgr.outcomes
            why = self.mgr.outcomes.get(self.room)
        if done:
            if why is None:
                return KVPoll.Success
            self.failure = why
            return KVPoll.Failed
        if time.monotonic() > self.deadline:
            self.failure = f"room {self.room}: no data within {transfer_timeout_s} s"
            return KVPoll.Failed
        return KVPoll.Transferring

    def failure_exception(self) -> None:
        raise RuntimeError(f"xfer transfer failed: {self.failure}")

    def abort(self) -> None:
        self.failure = self.failure or f"room {self.room}: aborted"

    def clear(self) -> None:
        with self.mgr.lock:
            self.mgr.outcomes.pop(self.room, None)


def register(config: Any = None) -> None:
    """Makes ``--disaggregation-transfer-backend xfer`` select this backend: adds the choice,
    the ``TransferBackend`` member and the classes ``get_kv_class`` returns (SGLang has no
    registry of transfer backends; this is the one call until it has). ``config``: the xfer
    engine config (else ``$XFER_CONFIG``)."""
    global _config
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
