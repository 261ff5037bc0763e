"""What a version moves: tensors, trainer shards, inference parameters (``Layout``), and the
one decoder of a layout another host sent (``Layout.from_json``: typed, bounded, every
failure a ``LayoutError``). Pure: numpy only, no engine, no framework."""

from __future__ import annotations

import dataclasses
import hashlib
import json
from collections.abc import Sequence
from typing import Any

import numpy as np

__all__ = ["DTYPE_SIZES", "LayoutError", "MAX_LAYOUT_BYTES", "PieceSpec", "SliceSpec", "TensorSpec", "Layout"]

# A trainer shard's slice: None (whole), ("flat", start_byte, end_byte) or ("dim", dim, start, end).
SliceSpec = tuple[Any, ...] | None
# A parameter piece: (tensor name, None or ("dim", dim, start, end), coordinates in the parameter).
PieceSpec = tuple[str, SliceSpec, tuple[int, ...]]

DTYPE_SIZES: dict[str, int] = {
    "bool": 1, "uint8": 1, "int8": 1, "float8_e4m3fn": 1, "float8_e5m2": 1,
    "float16": 2, "bfloat16": 2, "int16": 2,
    "float32": 4, "int32": 4, "uint32": 4,
    "float64": 8, "int64": 8, "uint64": 8,
}

# Bounds of a layout from the wire: a Kimi-K2-shaped layout (~1,000 ranks x ~1,100 tensors)
# is a few hundred MB of JSON; nothing legitimate comes near these.
MAX_LAYOUT_BYTES = 1 << 30
_MAX_DIMS = 8
_MAX_NAME = 1024
_MAX_EXTENT = 1 << 48
_MAX_RANK = 1 << 20


class LayoutError(ValueError):
    """Bytes that are not a valid layout (malformed JSON, wrong types, values out of bounds)."""


@dataclasses.dataclass(frozen=True)
class TensorSpec:
    """A tensor as the receivers get it: name, full shape, dtype name (``"bfloat16"``, …)."""

    name: str
    shape: tuple[int, ...]
    dtype: str

    @property
    def elem_size(self) -> int:
        try:
            return DTYPE_SIZES[self.dtype]
        except KeyError:
            raise ValueError(f"tensor {self.name!r}: unknown dtype {self.dtype!r} (known: {sorted(DTYPE_SIZES)})") from None

    @property
    def nbytes(self) -> int:
        return int(np.prod(self.shape, dtype=np.int64)) * self.elem_size


@dataclasses.dataclass(frozen=True)
class Layout:
    """Both sides' metadata. ``shards``: (trainer rank, tensor, slice), a write's ``src_shard``
    indexes it; ``params``: (inference rank, name, shape, pieces), ``dst_param`` indexes it."""

    tensors: tuple[TensorSpec, ...]
    shards: tuple[tuple[int, str, SliceSpec], ...]
    params: tuple[tuple[int, str, tuple[int, ...], tuple[PieceSpec, ...]], ...]

    @staticmethod
    def replicated(tensors: Sequence[TensorSpec], senders: int, receivers: int) -> Layout:
        """Every trainer rank holds every tensor whole; every receiver gets every tensor whole
        (verl's contract: each trainer rank yields full tensors; each rollout worker loads
        full tensors through its engine's own ``load_weights``). The plan splits the sending
        evenly over the trainer ranks."""
        shards = tuple((s, t.name, None) for s in range(senders) for t in tensors)
        return Layout(tuple(tensors), shards, Layout.whole_params(tensors, receivers))

    @staticmethod
    def whole_params(tensors: Sequence[TensorSpec], receivers: int) -> tuple[Any, ...]:
        """Every receiver gets every tensor whole."""
        return tuple(
            (r, t.name, tuple(t.shape), ((t.name, None, (0,) * len(t.shape)),)) for r in range(receivers) for t in tensors
        )

    def tensor(self, name: str) -> TensorSpec:
        return self._by_name()[name]

    def _by_name(self) -> dict[str, TensorSpec]:
        cache = self.__dict__.get("_names")
        if cache is None:
            cache = {t.name: t for t in self.tensors}
            object.__setattr__(self, "_names", cache)
        return cache

    def param_elem_size(self, index: int) -> int:
        pieces = self.params[index][3]
        return self.tensor(pieces[0][0]).elem_size

    def param_nbytes(self, index: int) -> int:
        return int(np.prod(self.params[index][2], dtype=np.int64)) * self.param_elem_size(index)

    def shard_nbytes(self, index: int) -> int:
        _, name, sl = self.shards[index]
        t = self.tensor(name)
        if sl is None:
            return t.nbytes
        if sl[0] == "flat":
            return int(sl[2]) - int(sl[1])
        _, dim, start, end = sl
        return t.nbytes // t.shape[dim] * (end - start)

    def to_json(self) -> bytes:
        return json.dumps(
            {
                "tensors": [[t.name, list(t.shape), t.dtype] for t in self.tensors],
                "shards": [[r, n, None if s is None else list(s)] for r, n, s in self.shards],
                "params": [
                    [r, n, list(shape), [[t, None if s is None else list(s), list(at)] for t, s, at in pieces]]
                    for r, n, shape, pieces in self.params
                ],
            },
            separators=(",", ":"),
        ).encode()

    @staticmethod
    def from_json(raw: bytes) -> Layout:
        """The layout in ``raw`` (what ``to_json`` wrote, possibly from another host): every
        field checked for type and bound, every tensor a piece or shard names declared.
        Anything else raises ``LayoutError`` — never another exception."""
        if len(raw) > MAX_LAYOUT_BYTES:
            raise LayoutError(f"a layout of {len(raw)} bytes is past the bound of {MAX_LAYOUT_BYTES}")
        try:
            d = json.loads(raw, parse_constant=_no_constant)
        except LayoutError:
            raise
        except (ValueError, RecursionError, UnicodeDecodeError) as e:
            raise LayoutError(f"not a layout: {type(e).__name__}: {str(e)[:200]}") from None
        try:
            return _decode(d)
        except LayoutError:
            raise
        except (TypeError, ValueError, KeyError, IndexError, RecursionError) as e:
            raise LayoutError(f"not a layout: {type(e).__name__}: {str(e)[:200]}") from None

    def digest(self) -> bytes:
        cache = self.__dict__.get("_digest")
        if cache is None:
            cache = hashlib.sha256(self.to_json()).digest()[:16]
            object.__setattr__(self, "_digest", cache)
        return cache


def _no_constant(name: str) -> Any:
    raise LayoutError(f"not a layout: {name} is not a number a layout holds")


def _list(x: Any, what: str, *, length: int | None = None) -> list[Any]:
    if not isinstance(x, list) or (length is not None and len(x) != length):
        raise LayoutError(f"{what}: expected a list" + ("" if length is None else f" of {length}"))
    return x


def _int(x: Any, what: str, hi: int = _MAX_EXTENT) -> int:
    if type(x) is not int or not (0 <= x <= hi):
        raise LayoutError(f"{what}: expected an integer in 0..{hi}, got {str(x)[:40]}")
    return x


def _name(x: Any, what: str) -> str:
    if not isinstance(x, str) or len(x) > _MAX_NAME:
        raise LayoutError(f"{what}: expected a name of at most {_MAX_NAME} characters")
    return x


def _shape(x: Any, what: str) -> tuple[int, ...]:
    dims = _list(x, what)
    if len(dims) > _MAX_DIMS:
        raise LayoutError(f"{what}: more than {_MAX_DIMS} dimensions")
    shape = tuple(_int(n, what) for n in dims)
    total = 1
    for n in shape:
        total *= n
    if total > _MAX_EXTENT:
        raise LayoutError(f"{what}: {total} elements is past the bound")
    return shape


def _slice(x: Any, what: str, *, flat: bool) -> SliceSpec:
    if x is None:
        return None
    parts = _list(x, what)
    if flat and len(parts) == 3 and parts[0] == "flat":
        return ("flat", _int(parts[1], what), _int(parts[2], what))
    if len(parts) == 4 and parts[0] == "dim":
        return ("dim", _int(parts[1], what, _MAX_DIMS), _int(parts[2], what), _int(parts[3], what))
    raise LayoutError(f"{what}: a slice is null, [\"dim\", dim, start, end]" + (" or [\"flat\", start, end]" if flat else ""))


def _decode(d: Any) -> Layout:
    if not isinstance(d, dict) or set(d) != {"tensors", "shards", "params"}:
        raise LayoutError("not a layout: expected an object with tensors, shards and params")
    tensors = []
    for i, t in enumerate(_list(d["tensors"], "tensors")):
        name, shape, dtype = _list(t, f"tensor {i}", length=3)
        if dtype not in DTYPE_SIZES:
            raise LayoutError(f"tensor {i}: unknown dtype {str(dtype)[:40]!r}")
        tensors.append(TensorSpec(_name(name, f"tensor {i}"), _shape(shape, f"tensor {i}"), dtype))
    names = {t.name for t in tensors}
    if len(names) != len(tensors):
        raise LayoutError("tensors: a name is declared twice")

    def known(n: Any, what: str) -> str:
        n = _name(n, what)
        if n not in names:
            raise LayoutError(f"{what}: names undeclared tensor {n[:80]!r}")
        return n

    shards = []
    for i, s in enumerate(_list(d["shards"], "shards")):
        r, n, sl = _list(s, f"shard {i}", length=3)
        shards.append((_int(r, f"shard {i}", _MAX_RANK), known(n, f"shard {i}"), _slice(sl, f"shard {i}", flat=True)))
    params = []
    for i, p in enumerate(_list(d["params"], "params")):
        r, n, shape, pieces = _list(p, f"parameter {i}", length=4)
        what = f"parameter {i}"
        decoded = []
        for k, piece in enumerate(_list(pieces, what)):
            t, sl, at = _list(piece, f"{what}, piece {k}", length=3)
            decoded.append((known(t, f"{what}, piece {k}"), _slice(sl, f"{what}, piece {k}", flat=False), _shape(at, f"{what}, piece {k}")))
        if not decoded:
            raise LayoutError(f"{what}: no pieces")
        params.append((_int(r, what, _MAX_RANK), _name(n, what), _shape(shape, what), tuple(decoded)))
    return Layout(tuple(tensors), tuple(shards), tuple(params))
