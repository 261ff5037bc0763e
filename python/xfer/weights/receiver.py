"""An inference rank's side of weight sync (``WeightReceiver``); the protocol it carries out
and the glue it shares with the sender are in ``executor``."""

from __future__ import annotations

import struct
import time
from collections.abc import Iterable
from typing import Any

import numpy as np

from .. import _xfer
from .._errors import TimeoutError as _Timeout
from . import protocol as P
from .executor import (
    _ENDED,
    _aligned,
    _Ended,
    _Member,
    _param_offsets,
    _physical_memory,
    _verdict,
)
from .layout import Layout

__all__ = ["WeightReceiver"]


class WeightReceiver(_Member):
    """An inference rank's side: its parameters live in one registered buffer (``buffer``),
    each a view (``params``: name → uint8 view of its bytes, row-major).

    In place (default), the caller pauses readers of ``params`` during ``receive`` (a failed
    version leaves them partly overwritten; the next successful one rewrites every byte).
    With ``double_buffer=True`` there are two buffers: each version is written into the one
    readers do not see, and ``buffer``/``params`` switch to it only once the coordinator
    committed the version. Readers keep reading the previous version during ``receive``, and
    a failed version leaves ``params`` as they were; views taken before a ``receive`` that
    succeeded must be dropped before the next ``receive`` starts (it writes into them).

    ``max_bytes``: the most this receiver allocates for a layout (default: half the
    machine's memory); a layout that needs more fails the version, allocating nothing."""

    def __init__(
        self,
        engine: _xfer.TransferEngine,
        rendezvous: _xfer.Rendezvous,
        group: str,
        rank: int,
        senders: int,
        receivers: int,
        *,
        timeout: float = 60.0,
        grace: float | None = None,
        imm_base: int = 1 << 30,
        double_buffer: bool = False,
        max_bytes: int | None = None,
    ) -> None:
        super().__init__(engine, rendezvous, group, "r", rank, senders, receivers, timeout=timeout, grace=grace, imm_base=imm_base)
        self.double_buffer = double_buffer
        self.max_bytes = _physical_memory() // 2 if max_bytes is None else max_bytes
        self.layout: Layout | None = None
        self.buffer: np.ndarray | None = None
        self.params: dict[str, np.ndarray] = {}
        self.specs: dict[str, tuple[tuple[int, ...], str]] = {}
        self._region: Any = None
        # Per buffer (one, or two when double-buffered): the array, its region, its views.
        self._buffers: list[tuple[np.ndarray, Any, dict[str, np.ndarray]]] = []
        self._front = 0

    def _prepare(self, layout: Layout) -> None:
        if self.layout is not None and self.layout.digest() == layout.digest():
            return
        offsets = _param_offsets(layout)
        mine = [i for i, p in enumerate(layout.params) if p[0] == self.rank]
        total = max([int(offsets[i]) + _aligned(layout.param_nbytes(i)) for i in mine], default=64)
        copies = 2 if self.double_buffer else 1
        if total * copies > self.max_bytes:
            raise ValueError(f"the layout needs {total * copies} bytes here, past max_bytes={self.max_bytes}")
        specs = {}
        for i in mine:
            _, name, shape, pieces = layout.params[i]
            if name in specs:
                raise ValueError(f"receiver {self.rank} has two parameters named {name!r}")
            specs[name] = (tuple(shape), layout.tensor(pieces[0][0]).dtype)
        for _, region, _ in self._buffers:
            region.dereg()
        self._buffers, self._front, self._region = [], 0, None
        self.layout = None
        self.specs = specs
        for _ in range(copies):
            buf = np.zeros(total, dtype=np.uint8)
            views = {layout.params[i][1]: buf[int(offsets[i]) : int(offsets[i]) + layout.param_nbytes(i)] for i in mine}
            self._buffers.append((buf, self.engine.reg_mr(buf), views))
        self._show(0)
        # The record offers exactly these buffers: a sender writes only into what it names.
        self._regions = {f"buf{k}": region.desc for k, (_, region, _) in enumerate(self._buffers)}
        # A name has one live publisher: the record is replaced, briefly absent (a sender's
        # lookup waits for it).
        self.publication.unpublish()
        self.publication = self._publish()
        self.layout = layout

    def _counts(self, version: int, deadline: float) -> int:
        """The sum of every sender's COUNT for ``version``."""
        def settled(box: P.Inbox) -> bool:
            return len(box.get(P.COUNT, version)) >= self.senders or bool(box.get(P.VERDICT, version))

        self.control.wait_for(settled, deadline)
        got = self.control.collect(P.COUNT, version, bool, 0.0)
        if len(got) < self.senders:
            if self.control.collect(P.VERDICT, version, bool, 0.0):
                raise _Ended(_ENDED)
            missing = sorted(set(range(self.senders)) - {m.sender for m in got})
            raise TimeoutError(f"trainer ranks {missing} never said what they send here")
        return sum(struct.unpack("<Q", m.payload)[0] for m in got)

    def _await_arrivals(self, version: int, expectation: Any, deadline: float) -> str:
        """Waits for every write of ``version`` to land, until the deadline or an abort from
        the coordinator; ``""`` or why not. Past the engine's own ``expect_ms``: when the
        engine times an expectation out first, its debt keeps absorbing the arrivals, and an
        expectation of nothing queued behind it is met exactly when the debt is paid."""
        imm = self.data_imm(version)
        while True:
            self.control.wait_for(lambda box: expectation.done() or bool(box.get(P.VERDICT, version)), deadline)
            if not expectation.done():
                expectation.cancel()
                if self.control.collect(P.VERDICT, version, bool, 0.0):
                    return _ENDED
                return f"not every write of version {version} arrived by the deadline"
            error = expectation.exception()
            if error is None:
                return ""
            if not isinstance(error, _Timeout) or time.monotonic() >= deadline:
                return f"not every write of version {version} arrived ({type(error).__name__}: {error})"
            expectation = self.engine.expect_imm_count(imm, 0, on_done=self.control.poke)

    def _show(self, k: int) -> None:
        """Makes buffer ``k`` the one readers see."""
        self._front = k
        self.buffer, self._region, self.params = self._buffers[k]

    def _layout_of(self, got: list[P.Message]) -> tuple[Layout, float]:
        """The version's layout (sent, or the one this receiver has) and the time left."""
        parts = sorted(P.parse_manifest(m.payload) for m in got)
        _, count, remaining_ms, digest, total, _ = parts[0]
        if any(p[1:5] != (count, remaining_ms, digest, total) for p in parts) or len(parts) != count:
            raise ValueError("the coordinator's MANIFEST chunks disagree")
        if total == 0:
            if self.layout is None or self.layout.digest() != digest:
                raise ValueError("the coordinator sent no layout, and this receiver has none with its digest")
            return self.layout, remaining_ms / 1000
        raw = b"".join(p[5] for p in parts)
        if len(raw) != total:
            raise ValueError(f"the layout's chunks hold {len(raw)} bytes, the MANIFEST says {total}")
        layout = Layout.from_json(raw)
        if layout.digest() != digest:
            raise ValueError("the layout's digest is not the one the MANIFEST names")
        return layout, remaining_ms / 1000

    def receive(self, version: int) -> dict[str, np.ndarray]:
        """Receives ``version`` into ``params`` (returned); returns only when the coordinator
        committed it (every byte landed on every receiver, every rank succeeded); raises
        ``VersionFailed`` otherwise (``VersionInDoubt`` when the decision never came)."""
        deadline = time.monotonic() + self.timeout
        self._records = {}
        self.control.begin(version)
        failure, digest = "", b"\x00" * 16

        def complete(g: list[P.Message]) -> bool:
            return bool(g) and len(g) >= P.parse_manifest(g[0].payload)[1]

        got = self.control.collect(P.MANIFEST, version, complete, deadline)
        target = self._front
        expectation = None
        if not complete(got):
            failure = f"receiver {self.rank}: no layout from trainer rank 0 in time"
        else:
            try:
                layout, left = self._layout_of(got)
                # The coordinator's deadline is the version's: a receiver that started early
                # waits as long as the coordinator does.
                deadline = time.monotonic() + left
                digest = layout.digest()
                self._prepare(layout)
                target = (self._front + 1) % len(self._buffers)
                payload = digest + bytes([target]) + bytes(self._buffers[target][1].desc)
                for s in range(self.senders):
                    why = self.tell(s, P.READY, version, payload, deadline)
                    if why:
                        raise RuntimeError(f"could not tell trainer rank {s} it is ready: {why}")
                # The immediates the version brings, as each sender's engine stripes its writes.
                arrivals = self._counts(version, deadline)
                if arrivals:
                    expectation = self.engine.expect_imm_count(self.data_imm(version), arrivals, on_done=self.control.poke)
            except _Ended:
                failure = f"receiver {self.rank}: {_ENDED}"
            except Exception as e:  # noqa: BLE001
                failure = f"receiver {self.rank}: {e}"
        cause = "" if failure.endswith(_ENDED) else failure
        if expectation is not None:
            if failure:
                expectation.cancel()
            else:
                why = self._await_arrivals(version, expectation, deadline)
                failure = f"receiver {self.rank}: {why}" if why else ""
                # Ended by the coordinator's abort: the cause is in its verdict.
                cause = "" if why == _ENDED else failure
        self.report(version, not failure, digest, failure, deadline)
        try:
            payload = self.decision(version, deadline)
        finally:
            self.control.finish(version)
        # Phase two's apply: only a committed version is shown.
        _verdict(version, payload, cause)
        self._show(target)
        return self.params

    def tensors(self) -> Iterable[tuple[str, Any]]:
        """The received parameters as torch tensors of their dtypes and shapes (views of ``buffer``)."""
        import torch

        for name, raw in self.params.items():
            shape, dtype = self.specs[name]
            yield name, torch.from_numpy(raw).view(getattr(torch, dtype)).view(shape)

    def close(self) -> None:
        for _, region, _ in self._buffers:
            region.dereg()
        self._buffers, self._region = [], None
        super().close()
