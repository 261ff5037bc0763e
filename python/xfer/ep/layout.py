"""The pure part of ``xfer.ep``: the configuration, dtypes as bytes, and moving rows between
the wire buffers and the layouts experts read (DeepEP's low-latency one and a flat one), and
the weighted fp32 reduction of combine. numpy only: no engine, no torch.

Rows travel as raw bytes of the storage dtype. bfloat16 has no numpy dtype: it is carried as
``uint16`` bit patterns and widened to fp32 exactly (``bits << 16``)."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from .._xfer import ep_region_bytes

#: Storage dtypes by name: the numpy dtype of one element as stored (bf16 as its bits).
STORAGE = {"bfloat16": np.dtype(np.uint16), "float16": np.dtype(np.float16), "float32": np.dtype(np.float32)}


def to_f32(rows: np.ndarray, dtype: str) -> np.ndarray:
    """Rows of a storage dtype as fp32 (exact for every dtype here); a new array."""
    if dtype == "bfloat16":
        return (rows.astype(np.uint32) << 16).view(np.float32)
    return rows.astype(np.float32)


def from_f32(values: np.ndarray, dtype: str) -> np.ndarray:
    """fp32 values in a storage dtype, rounded to nearest even (bf16 NaNs stay NaN)."""
    if dtype == "bfloat16":
        u = np.ascontiguousarray(values, dtype=np.float32).view(np.uint32)
        rounded = ((u + (((u >> 16) & 1) + 0x7FFF)) >> 16).astype(np.uint16)
        nan = np.isnan(values)
        if nan.any():
            rounded[nan] = 0x7FC0
        return rounded
    return values.astype(STORAGE[dtype])


@dataclass(frozen=True)
class EpConfig:
    """The fixed shape of an expert-parallel group, the same on every rank.

    ``private_rows``: rows each source may write into its own slot at each receiver before the
    counts land (default: ``max_tokens × top_k`` split evenly over the experts' ranks, at least
    ``max_tokens``); ``overflow_rows``: rows each receiver shares among its sources past their
    private slots (default: enough for any routing, ``ranks × max_tokens × top_k`` less the
    private slots). ``timeout``: seconds each wait of a step may take before its source is
    masked (a step takes at most ten of them beyond the caller's compute)."""

    ranks: int
    experts_per_rank: int
    top_k: int
    max_tokens: int
    hidden: int
    dtype: str = "bfloat16"
    private_rows: int | None = None
    overflow_rows: int | None = None
    timeout: float = 5.0
    tag: int = 0xE

    def __post_init__(self):
        if self.dtype not in STORAGE:
            raise ValueError(f"dtype {self.dtype!r} is not one of {sorted(STORAGE)}")
        for name in ("ranks", "experts_per_rank", "top_k", "hidden"):
            if getattr(self, name) <= 0:
                raise ValueError(f"{name} must be positive")
        if self.max_tokens < 0 or not 0 <= self.tag < 16:
            raise ValueError("max_tokens must be >= 0 and tag in 0..15")

    @property
    def private(self) -> int:
        if self.private_rows is not None:
            return self.private_rows
        even = -(-self.max_tokens * self.top_k // self.ranks)
        return max(even, self.max_tokens)

    @property
    def overflow(self) -> int:
        if self.overflow_rows is not None:
            return self.overflow_rows
        return max(0, self.ranks * self.max_tokens * self.top_k - self.ranks * self.private)

    @property
    def storage(self) -> np.dtype:
        return STORAGE[self.dtype]

    @property
    def row_bytes(self) -> int:
        return self.hidden * self.storage.itemsize

    @property
    def num_experts(self) -> int:
        return self.ranks * self.experts_per_rank

    def layout_args(self) -> tuple:
        """What ``xfer._xfer.EpStep`` takes."""
        return (self.ranks, self.experts_per_rank, self.top_k, self.max_tokens, self.row_bytes, self.private, self.overflow)

    def region_bytes(self) -> dict:
        """Bytes per buffer set of each region (and the header sizes)."""
        return dict(ep_region_bytes(self.layout_args()))


def columns(raw: list[bytes]) -> list[np.ndarray]:
    """The binding's columns (little-endian int64 bytes) as numpy arrays."""
    return [np.frombuffer(c, dtype="<i8") for c in raw]


def rows_at(region: np.ndarray, offset: int, count: int, cfg: EpConfig) -> np.ndarray:
    """A view of ``count`` rows at byte ``offset`` of a uint8 region."""
    return region[offset:offset + count * cfg.row_bytes].view(cfg.storage).reshape(count, cfg.hidden)


@dataclass
class RecvRuns:
    """The received rows as runs: each run is ``count`` rows contiguous in the dispatch region
    (from ``recv_offset``) and in the combine send buffer (from ``combine_offset``), for local
    expert ``expert`` at ``position`` in its rows."""

    recv_offset: np.ndarray
    combine_offset: np.ndarray
    count: np.ndarray
    expert: np.ndarray
    position: np.ndarray
    expert_counts: np.ndarray

    @classmethod
    def of(cls, raw) -> "RecvRuns":
        cols, counts = raw
        return cls(*columns(cols), np.asarray(counts, dtype=np.int64))

    @property
    def expert_starts(self) -> np.ndarray:
        """Where each expert's rows start in the flat layout (``experts + 1`` entries)."""
        return np.concatenate([[0], np.cumsum(self.expert_counts)]).astype(np.int64)


def gather_deepep(region: np.ndarray, runs: RecvRuns, cfg: EpConfig, out: np.ndarray) -> None:
    """DeepEP's low-latency layout: ``out[expert, position]`` (``[experts_per_rank, ranks ×
    max_tokens, hidden]``); rows past ``recv_count`` are left as they are."""
    for off, n, e, pos in zip(runs.recv_offset, runs.count, runs.expert, runs.position):
        out[e, pos:pos + n] = rows_at(region, int(off), int(n), cfg)


def gather_flat(region: np.ndarray, runs: RecvRuns, cfg: EpConfig, out: np.ndarray) -> None:
    """The flat expert-major layout: expert 0's rows, then expert 1's, … (``[rows, hidden]``)."""
    starts = runs.expert_starts
    for off, n, e, pos in zip(runs.recv_offset, runs.count, runs.expert, runs.position):
        at = int(starts[e] + pos)
        out[at:at + n] = rows_at(region, int(off), int(n), cfg)


def scatter_back(expert_out: np.ndarray, runs: RecvRuns, cfg: EpConfig, layout: str, csend: np.ndarray) -> None:
    """The experts' outputs (in ``layout``) into the combine send buffer, in each source's
    order."""
    starts = runs.expert_starts
    for coff, n, e, pos in zip(runs.combine_offset, runs.count, runs.expert, runs.position):
        if layout == "deepep":
            src = expert_out[e, pos:pos + n]
        else:
            at = int(starts[e] + pos)
            src = expert_out[at:at + n]
        rows_at(csend, int(coff), int(n), cfg)[:] = src


def reduce_combined(
    region: np.ndarray,
    blocks,
    valid: np.ndarray,
    token: np.ndarray,
    slot: np.ndarray,
    weights: np.ndarray,
    num_tokens: int,
    cfg: EpConfig,
) -> np.ndarray:
    """``y[t] = Σ_slot weight[t, slot] · output(t, slot)`` in fp32, slots summed in order; a slot
    whose output did not come back (masked rank, lost row) contributes zero."""
    k = cfg.top_k
    per_slot = np.zeros((num_tokens * k, cfg.hidden), dtype=np.float32)
    first = 0
    w = np.asarray(weights, dtype=np.float32).reshape(num_tokens, k) if num_tokens else np.zeros((0, k), np.float32)
    for _peer, offset, count in blocks:
        if count == 0:
            continue
        sl = slice(first, first + count)
        first += count
        ok = valid[sl]
        rows = rows_at(region, int(offset), int(count), cfg)
        if not ok.all():
            rows = rows[ok]
        t, s = token[sl][ok], slot[sl][ok]
        contrib = to_f32(rows, cfg.dtype)
        contrib *= w[t, s][:, None]
        per_slot[t * k + s] = contrib
    return per_slot.reshape(num_tokens, k, cfg.hidden).sum(axis=1, dtype=np.float32)
