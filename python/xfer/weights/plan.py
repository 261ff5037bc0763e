"""The plan of a layout (computed in Rust by the ``xfer-weight-plan`` crate): which trainer
rank sends which bytes of which of its shards to which offset of which inference parameter —
every parameter byte written exactly once, replicated bytes sent once per destination by the
least loaded of their holders, resharding along any dimension as strided runs."""

from __future__ import annotations

import dataclasses

import numpy as np

from .. import _xfer
from .layout import Layout

__all__ = ["Writes", "plan"]

_COLUMNS = ("src_rank", "src_shard", "src_offset", "dst_rank", "dst_param", "dst_offset", "len", "count", "src_stride", "dst_stride")


@dataclasses.dataclass
class Writes:
    """A plan's writes as numpy columns (uint64): ``count`` rows of ``len`` bytes, row ``i`` from
    ``src_offset + i*src_stride`` of shard ``src_shard`` to ``dst_offset + i*dst_stride`` of
    parameter ``dst_param``; and the bytes each trainer rank sends / inference rank receives."""

    src_rank: np.ndarray
    src_shard: np.ndarray
    src_offset: np.ndarray
    dst_rank: np.ndarray
    dst_param: np.ndarray
    dst_offset: np.ndarray
    len: np.ndarray
    count: np.ndarray
    src_stride: np.ndarray
    dst_stride: np.ndarray
    sent: list[int]
    received: list[int]

    def __len__(self) -> int:
        return int(self.len.shape[0])

    def rows(self, keep: np.ndarray | None = None) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
        """Every row of the (kept) writes as one contiguous write:
        ``(src_shard, src_offset, dst_param, dst_offset, len)``."""
        sel = (lambda c: c) if keep is None else (lambda c: c[keep])  # noqa: E731
        count = sel(self.count).astype(np.int64)
        n = int(count.sum())
        first = np.repeat(np.cumsum(count) - count, count)
        i = (np.arange(n, dtype=np.int64) - first).astype(np.uint64)
        rep = lambda c: np.repeat(sel(c), count)  # noqa: E731
        return (
            rep(self.src_shard),
            rep(self.src_offset) + i * rep(self.src_stride),
            rep(self.dst_param),
            rep(self.dst_offset) + i * rep(self.dst_stride),
            rep(self.len),
        )


def plan(layout: Layout, *, sender: int | None = None, receiver: int | None = None) -> Writes:
    """The plan of ``layout`` (only trainer rank ``sender``'s writes, or only those to inference
    rank ``receiver``, when given). A layout the plan refuses raises
    ``xfer.InvalidArgumentError`` naming the tensor, shard or parameter."""
    params = [
        (r, name, list(shape), layout.param_elem_size(i), [(t, s, list(at)) for t, s, at in pieces])
        for i, (r, name, shape, pieces) in enumerate(layout.params)
    ]
    out = _xfer.plan_weights(
        [(t.name, list(t.shape), t.elem_size) for t in layout.tensors],
        [(r, n, s) for r, n, s in layout.shards],
        params,
        sender=sender,
        receiver=receiver,
    )
    cols = {c: np.frombuffer(out[c], dtype="<u8") for c in _COLUMNS}
    return Writes(**cols, sent=list(out["sent"]), received=list(out["received"]))
