"""The wire contract of xfer's vLLM weight-transfer backend: what a worker engine
(``vllm_worker``) publishes and the trainer engine (``vllm_trainer``) reads, with the one
encoder and decoder of each, kept apart from both engines so that each end is written against
the same definitions and the decoders are testable without vLLM (nothing here imports it).

- the slices record (``_slices_record``): a worker's part of the layout (its ``slices``
  region) and its outcome region, or in their place its trace failure; read, bounded and
  decoded by ``read_receiver_slices`` / ``_read_receiver`` (``TraceFailed`` when it holds a
  failure);
- the outcome region (``OUTCOME_BYTES``): a worker's outcome of its last version,
  ``encode_outcome`` / ``decode_outcome``;
- the summary record (``_summary_record``): trainer rank 0's word to the other trainer ranks
  on a committed version, ``encode_summary`` / ``decode_summary``, read by ``read_summary``;
- ``BACKEND``, the name both factories know the backend by, and ``_dtype_name``, the dtype
  names the tensors are listed with.
"""

from __future__ import annotations

import json
import time
from typing import Any

import numpy as np

from .. import _xfer
from .layout import MAX_LAYOUT_BYTES, Layout, LayoutError, TensorSpec
from .slices import decode_receiver_layout

BACKEND = "xfer"


def _dtype_name(dtype: Any) -> str:
    return str(dtype).removeprefix("torch.")


def _slices_record(group: str, rank: int) -> str:
    return f"{group}.m{rank}"


def _member_record(group: str, rank: int) -> str:
    """Receiver ``rank``'s membership record (published by its ``WeightReceiver``)."""
    return f"{group}.r{rank}"


class TraceFailed(RuntimeError):
    """A worker's loader could not be traced (``trace_model``): the message names the
    checkpoint tensor the loader was given when it failed. The worker publishes it instead of
    its slices; the trainer's ``trainer_init`` raises it, naming the worker. Nothing falls
    back to receiving whole tensors behind the user's back: ``direct=False`` asks for that."""


def read_receiver_slices(engine: _xfer.TransferEngine, rendezvous: Any, group: str, rank: int,
                         tensors: tuple[TensorSpec, ...], deadline: float) -> Layout:
    """Receiver ``rank``'s part of the layout, read from the region its slices record names
    (published by the same engine as its member record), bounded and decoded by
    ``decode_receiver_layout``."""
    return _read_receiver(engine, rendezvous, group, rank, tensors, deadline)[0]


def _read_receiver(engine: _xfer.TransferEngine, rendezvous: Any, group: str, rank: int,
                   tensors: tuple[TensorSpec, ...], deadline: float) -> tuple[Layout, Any]:
    """``read_receiver_slices``, and the descriptor of the receiver's outcome region."""
    left = max(0.0, deadline - time.monotonic())
    rec = rendezvous.lookup(_slices_record(group, rank), left)
    regions = dict(rec["regions"])
    # Anyone who may publish on the rendezvous may publish this name under the member's
    # address: nothing a record names is read unless each of its regions is owned by the engine
    # at the member's address (``_owned_by``).
    failure = regions.get("trace_failure")
    if failure is not None:
        # A worker whose loader could not be traced does not join (it publishes no membership
        # record): its failure is tied to the engine that owns its region, and refused where a
        # membership of another engine exists.
        try:
            addr = bytes(rendezvous.lookup(_member_record(group, rank), 0.0)["addr"])
        except TimeoutError:  # xfer's is one: absent now
            addr = bytes(rec["addr"])
        if not _owned_by(rec, addr):
            raise LayoutError(f"receiver {rank}'s trace failure is published by another engine than its membership")
        n = int(failure.nbytes)
        if not 0 < n <= OUTCOME_BYTES:
            raise LayoutError(f"receiver {rank}'s trace failure is {n} bytes (bound {OUTCOME_BYTES})")
        buf = _read_region(engine, failure, n, deadline)
        raise TraceFailed(f"receiver {rank} could not learn its slices from its loader: "
                          f"{buf.tobytes().decode(errors='replace')} (init with direct=False to receive every "
                          "tensor whole through load_weights)")
    member = rendezvous.lookup(_member_record(group, rank), max(0.0, deadline - time.monotonic()))
    if not _owned_by(rec, bytes(member["addr"])):
        raise LayoutError(f"receiver {rank}'s slices are published by another engine than its membership")
    desc = regions.get("slices")
    if desc is None:
        raise LayoutError(f"receiver {rank}'s slices record names no region")
    outcome = regions.get("outcome")
    if outcome is None or int(outcome.nbytes) != OUTCOME_BYTES:
        raise LayoutError(f"receiver {rank}'s slices record names no outcome region of {OUTCOME_BYTES} bytes")
    n = int(desc.nbytes)
    if not 0 < n <= MAX_LAYOUT_BYTES:
        raise LayoutError(f"receiver {rank}'s slices are {n} bytes (bound {MAX_LAYOUT_BYTES})")
    buf = _read_region(engine, desc, n, deadline)
    return decode_receiver_layout(buf.tobytes(), rank, tensors), outcome


def _owned_by(rec: dict[str, Any], addr: bytes) -> bool:
    """Whether record ``rec`` is published under ``addr`` and each region it names is owned by
    the engine at ``addr`` (``MrDesc.owner``: the first NIC its keys are for, its engine's main
    address). The rendezvous takes the address a publisher writes on its word; a descriptor's
    owner is where a read of it goes."""
    return bytes(rec["addr"]) == addr and all(bytes(d.owner) == addr for d in dict(rec["regions"]).values())


def _read_region(engine: _xfer.TransferEngine, desc: Any, n: int, deadline: float) -> np.ndarray:
    """The first ``n`` bytes of the peer region ``desc`` (the caller bounded ``n``), read by
    ``deadline``."""
    buf = np.zeros(n, dtype=np.uint8)
    region = engine.reg_mr(buf)
    try:
        engine.submit_single_read(region, desc, n).wait(max(0.0, deadline - time.monotonic()))
    finally:
        region.dereg()
    return buf


# A worker's outcome of its last version, in a region the trainer reads after each version:
# a 4-byte little-endian length, then that many bytes of JSON.
OUTCOME_BYTES = 4096
_REASON_CHARS = 1500


def encode_outcome(outcome: dict[str, Any]) -> bytes:
    """A worker's outcome as its outcome region holds it (the reason cut to fit)."""
    fields = {"version": int(outcome["version"]), "applied": bool(outcome["applied"]),
              "reason": str(outcome.get("reason", ""))[:_REASON_CHARS]}
    raw = json.dumps(fields).encode()
    return len(raw).to_bytes(4, "little") + raw


def _framed_json(raw: bytes, bound: int, what: str):
    """The JSON value of a region written as a 4-byte little-endian length and that many bytes
    (at most ``bound`` in all); what is not one raises ``LayoutError`` naming ``what``."""
    if len(raw) < 4:
        raise LayoutError(f"{what} shorter than its length")
    n = int.from_bytes(raw[:4], "little")
    if not 0 < n <= min(len(raw) - 4, bound - 4):
        raise LayoutError(f"{what} of {n} bytes (bound {bound - 4})")
    try:
        return json.loads(bytes(raw[4:4 + n]))
    except (ValueError, RecursionError) as e:  # deeply nested arrays end in RecursionError
        raise LayoutError(f"{what} that is not JSON: {e}") from None


def decode_outcome(raw: bytes) -> tuple[int, bool, str]:
    """``(version, applied, reason)`` from a worker's outcome region; what is not one (a
    length past the region, not JSON, fields of other types) raises ``LayoutError``."""
    fields = _framed_json(raw, OUTCOME_BYTES, "an outcome")
    if not (isinstance(fields, dict) and set(fields) == {"version", "applied", "reason"}
            and type(fields["version"]) is int and type(fields["applied"]) is bool
            and isinstance(fields["reason"], str)):
        raise LayoutError("an outcome without exactly version (int), applied (bool) and reason (str)")
    return fields["version"], fields["applied"], fields["reason"][:_REASON_CHARS]


def _summary_record(group: str, version: int) -> str:
    return f"{group}.s0.v{version}"


def encode_summary(version: int, error: str, failed: dict[int, str], bound: int) -> bytes:
    """What trainer rank 0 tells the other trainer ranks of a committed version once the
    workers' session is finished: the error driving it raised on rank 0 (``""``: none) and
    each worker that did not apply it, with its reason — the reasons cut until it fits
    ``bound`` bytes."""
    cap = _REASON_CHARS
    while True:
        raw = json.dumps({"version": int(version), "error": error[:cap],
                          "failed": {str(r): why[:cap] for r, why in sorted(failed.items())}}).encode()
        if len(raw) + 4 <= bound or cap == 0:
            return len(raw).to_bytes(4, "little") + raw
        cap //= 2


def decode_summary(raw: bytes, receivers: int, bound: int) -> tuple[int, str, dict[int, str]]:
    """``(version, error, failed)`` from rank 0's summary; what is not one raises
    ``LayoutError``. A receiver key is at most 10 digits before ``int`` reads it: past
    Python's digit limit ``int`` raises ``ValueError``."""
    fields = _framed_json(raw, bound, "a summary")
    if not (isinstance(fields, dict) and set(fields) == {"version", "error", "failed"}
            and type(fields["version"]) is int and isinstance(fields["error"], str)
            and isinstance(fields["failed"], dict)
            and all(k.isascii() and k.isdigit() and len(k) <= 10 and int(k) < receivers and isinstance(v, str) for k, v in fields["failed"].items())):
        raise LayoutError("a summary without exactly version (int), error (str) and failed ({receiver: str})")
    return fields["version"], fields["error"][:_REASON_CHARS], {int(k): v[:_REASON_CHARS] for k, v in fields["failed"].items()}


def read_summary(engine: _xfer.TransferEngine, rendezvous: Any, group: str, version: int, coordinator: bytes | None,
                 receivers: int, bound: int, deadline: float) -> dict[int, str]:
    """A trainer rank other than 0: rank 0's summary of committed ``version``, waited for (by
    ``deadline``), checked to come from rank 0's engine (``coordinator``: its member record's
    address; ``None``: never seen), bounded and decoded. Raises what stopped rank 0 driving
    the workers; returns the workers that did not apply it."""
    try:
        rec = rendezvous.lookup(_summary_record(group, version), max(0.0, deadline - time.monotonic()))
    except Exception as e:  # noqa: BLE001 - the same failure, named
        raise RuntimeError(f"weight version {version} was committed, but trainer rank 0 did not say whether the "
                           f"workers applied it in time: {type(e).__name__}: {e}") from e
    if coordinator is None or not _owned_by(rec, coordinator):
        raise LayoutError(f"the summary of weight version {version} is not published by trainer rank 0's engine")
    desc = dict(rec["regions"]).get("summary")
    n = int(desc.nbytes) if desc is not None else 0
    if not 0 < n <= bound:
        raise LayoutError(f"the summary of weight version {version} is {n} bytes (bound {bound})")
    buf = _read_region(engine, desc, n, deadline)
    got, error, failed = decode_summary(buf.tobytes(), receivers, bound)
    if got != version:
        raise LayoutError(f"the summary of weight version {version} is of version {got}")
    if error:
        raise RuntimeError(f"weight version {version} was committed, but trainer rank 0 could not finish the "
                           f"workers' session: {error}")
    return failed
