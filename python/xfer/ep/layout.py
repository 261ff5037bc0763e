"""The pure part of ``xfer.ep``: the configuration and dtypes as bytes. numpy only: no engine,
no torch. Rows move between the tensors and the wire buffers in the binding
(``EpStep.pack``/``unpack``/``repack``/``reduce``: crate ``xfer-ep-plan``'s ``moves``).

Rows travel as raw bytes of the storage dtype. bfloat16 has no numpy dtype: it is carried as
``uint16`` bit patterns and widened to fp32 exactly (``bits << 16``)."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from .._xfer import ep_region_bytes

#: fp8 dispatch formats: e4m3 values with a float32 scale per 128 channels, ``amax / 448`` (DeepEP's
#: default) or rounded up to a power of two (DeepEP's ``round_scale``).
FP8 = ("e4m3", "e4m3_pow2")
FP8_BLOCK = 128

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

    A token travels once to each rank it routes to (one row per (token, rank), whatever its
    top-k slots there), so a source sends a receiver at most ``max_tokens`` rows.
    ``private_rows``: rows each source may write into its own slot at each receiver before the
    counts land (default: ``max_tokens``, any routing); ``overflow_rows``: rows each receiver
    shares among its sources past their private slots (default: enough for any routing,
    ``ranks × max_tokens`` less the private slots: none with the default private slots).
    ``timeout``: seconds each wait of a step may take before its source is masked (a step
    takes at most ten of them beyond the caller's compute). ``partial_sums``: room for the
    weights at dispatch (``EpGroup.dispatch_send(x, idx, weights=w)``), with which combine
    returns one fp32 partial sum per (token, rank) instead of one row per (token, expert): 4
    bytes per slot in each row's route record, and combine regions that hold either; off,
    the weights are given at combine only (DeepEP's API)."""

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
    fp8: str | None = None
    partial_sums: bool = True

    def __post_init__(self):
        if self.dtype not in STORAGE:
            raise ValueError(f"dtype {self.dtype!r} is not one of {sorted(STORAGE)}")
        if self.fp8 is not None and (self.fp8 not in FP8 or self.dtype != "bfloat16"):
            raise ValueError(f"fp8 must be one of {FP8} (with dtype bfloat16), not {self.fp8!r}")
        for name in ("ranks", "experts_per_rank", "top_k", "hidden"):
            if getattr(self, name) <= 0:
                raise ValueError(f"{name} must be positive")
        if self.max_tokens < 0 or not 0 <= self.tag < 16:
            raise ValueError("max_tokens must be >= 0 and tag in 0..15")

    @property
    def private(self) -> int:
        if self.private_rows is not None:
            return self.private_rows
        # Room for any routing in the private slots (a source sends a receiver one row per
        # token at most): dispatch is always one one-way trip.
        return self.max_tokens

    @property
    def overflow(self) -> int:
        if self.overflow_rows is not None:
            return self.overflow_rows
        return max(0, self.ranks * self.max_tokens - self.ranks * self.private)

    @property
    def storage(self) -> np.dtype:
        return STORAGE[self.dtype]

    @property
    def combine_row_bytes(self) -> int:
        """Bytes of a row in combine (and of the tokens given to dispatch): the dtype's."""
        return self.hidden * self.storage.itemsize

    @property
    def row_bytes(self) -> int:
        """Bytes of a dispatched row: the dtype's, or with ``fp8`` the e4m3 values and a
        float32 scale per 128 channels."""
        if self.fp8 is not None:
            return self.hidden + 4 * self.scale_blocks
        return self.combine_row_bytes

    @property
    def scale_blocks(self) -> int:
        """fp8 scales per row (one per 128 channels)."""
        return -(-self.hidden // FP8_BLOCK)

    @property
    def num_experts(self) -> int:
        return self.ranks * self.experts_per_rank

    def layout_args(self) -> tuple:
        """What ``xfer._xfer.EpStep`` takes."""
        return (self.ranks, self.experts_per_rank, self.top_k, self.max_tokens, self.row_bytes, self.private, self.overflow,
                self.combine_row_bytes, 4 * self.hidden if self.partial_sums else 0)

    def region_bytes(self) -> dict:
        """Bytes per buffer set of each region (and the header, slot, wire row and route
        record sizes)."""
        return dict(ep_region_bytes(self.layout_args()))


def columns(raw: list[bytes]) -> list[np.ndarray]:
    """The binding's columns (little-endian int64 bytes) as numpy arrays."""
    return [np.frombuffer(c, dtype="<i8") for c in raw]

