"""Which bytes of the checkpoint's tensors an inference rank needs, learned from its own
loader. Pure: numpy only, no engine, no framework.

An inference engine's ``load_weights`` knows how the checkpoint maps onto this rank's
parameters — the tensor-parallel slice, the fused ``qkv_proj`` / ``gate_up_proj``, padding —
but says so only by doing it. So the rank runs it once on *ids* (``trace_tensor``: element
``i`` of tensor ``t`` is the integer ``bases[t] + i``) into parameters whose storage is
integer; each parameter then holds the id of the checkpoint element that lands in each of its
elements, or -1 where nothing does. ``receiver_params`` turns that into the rank's part of
the layout:

- a parameter made of boxes each copied from a box of one tensor (sliced along at most one
  dimension, as ``Layout`` pieces are) is **direct**: one layout parameter per box, of the
  box's bytes only, and applying a version copies each box into place;
- anything else — a cast, a transpose, a quantised repack, a scale, a tensor that lands in
  no parameter (a buffer, say) — is **whole**: the tensor is received whole and goes through
  ``load_weights`` as before. So is every tensor of a module that has one such parameter
  (vLLM's layerwise reload finalises a module as a unit), and every parameter such a tensor
  also feeds (a parameter is applied one way only).

A layout parameter's name says which kind it is: ``p:<parameter>#<box>`` or ``t:<tensor>``.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Collection, Mapping, Sequence
import numpy as np

from .layout import Layout, LayoutError, PieceSpec, TensorSpec

__all__ = ["Box", "ReceiverSlices", "id_bases", "pieces_of", "receiver_params", "decode_receiver_layout"]


def id_bases(tensors: Sequence[TensorSpec]) -> np.ndarray:
    """The first id of each tensor (ids run on across tensors in order)."""
    sizes = np.array([int(np.prod(t.shape, dtype=np.int64)) for t in tensors], dtype=np.int64)
    return np.concatenate([[0], np.cumsum(sizes)])[:-1] if len(sizes) else np.zeros(0, dtype=np.int64)


def trace_tensor(index: int, tensors: Sequence[TensorSpec], bases: np.ndarray) -> np.ndarray:
    """Tensor ``index`` as ids (int64, its shape)."""
    t = tensors[index]
    n = int(np.prod(t.shape, dtype=np.int64))
    return (np.arange(n, dtype=np.int64) + bases[index]).reshape(t.shape)


@dataclasses.dataclass(frozen=True)
class Box:
    """One direct box: ``param[at : at + shape]`` is ``tensor`` (sliced by ``slice``)."""

    param: str
    at: tuple[int, ...]
    shape: tuple[int, ...]
    piece: PieceSpec

    @property
    def name(self) -> str:
        return f"p:{self.param}#{','.join(map(str, self.at))}"


def pieces_of(ids: np.ndarray, tensors: Sequence[TensorSpec], bases: np.ndarray) -> list[tuple[tuple[int, ...], tuple[int, ...], PieceSpec]] | None:
    """A traced parameter as boxes ``(at, shape, piece)``, each a box of one tensor sliced
    along at most one dimension and laid out as in the tensor; None if it is not (the ids
    say another transform ran). An untouched parameter is no boxes."""
    flat = ids.reshape(-1)
    touched = np.flatnonzero(flat >= 0)
    if len(touched) == 0:
        return []
    total = int(bases[-1]) + int(np.prod(tensors[-1].shape, dtype=np.int64)) if len(tensors) else 0
    got = flat[touched]
    if int(got.max()) >= total:
        return None
    owner = np.searchsorted(bases, got, side="right") - 1
    coords = np.unravel_index(touched, ids.shape)
    expected = np.full(ids.shape, -1, dtype=np.int64)
    boxes = []
    for t in np.unique(owner):
        spec = tensors[int(t)]
        if len(spec.shape) != ids.ndim:
            return None
        sel = owner == t
        at = tuple(int(c[sel].min()) for c in coords)
        end = tuple(int(c[sel].max()) + 1 for c in coords)
        shape = tuple(e - a for a, e in zip(at, end))
        if int(np.prod(shape, dtype=np.int64)) != int(sel.sum()):
            return None
        local = np.unravel_index(got[sel] - bases[t], spec.shape)
        lo = tuple(int(c.min()) for c in local)
        hi = tuple(int(c.max()) + 1 for c in local)
        if tuple(h - lo_ for lo_, h in zip(lo, hi)) != shape:
            return None
        cut = [d for d in range(ids.ndim) if lo[d] != 0 or hi[d] != spec.shape[d]]
        if len(cut) > 1:
            return None
        grid = np.meshgrid(*[np.arange(lo[d], hi[d]) for d in range(ids.ndim)], indexing="ij")
        window = tuple(slice(a, e) for a, e in zip(at, end))
        expected[window] = bases[t] + np.ravel_multi_index(grid, spec.shape) if ids.ndim else bases[t]
        sl = None if not cut else ("dim", cut[0], lo[cut[0]], hi[cut[0]])
        boxes.append((at, shape, (spec.name, sl, (0,) * ids.ndim)))
    if not np.array_equal(expected, ids):
        return None
    return boxes


@dataclasses.dataclass(frozen=True)
class ReceiverSlices:
    """A rank's part of the layout: its ``params`` (``Layout.params`` entries), the direct
    ``boxes`` and the tensors it receives ``whole``."""

    params: tuple[tuple[int, str, tuple[int, ...], tuple[PieceSpec, ...]], ...]
    boxes: tuple[Box, ...]
    whole: tuple[str, ...]


def receiver_params(
    rank: int,
    traced: Mapping[str, tuple[np.ndarray, str]],
    tensors: Sequence[TensorSpec],
    *,
    direct: bool = True,
    whole_params: Collection[str] = (),
) -> ReceiverSlices:
    """Rank ``rank``'s part of the layout from its traced parameters (name → (ids, dtype
    name)); ``direct=False`` receives every tensor whole; the parameters in ``whole_params``
    are received whole whatever their trace says (the adapter knows its host processes them
    another way)."""
    bases = id_bases(tensors)
    index = {t.name: i for i, t in enumerate(tensors)}
    boxes_of: dict[str, list[tuple[tuple[int, ...], tuple[int, ...], PieceSpec]]] = {}
    feeds: dict[str, set[int]] = {}
    failed: set[str] = set()
    total = int(bases[-1]) + int(np.prod(tensors[-1].shape, dtype=np.int64)) if len(tensors) else 0
    for pname, (ids, dtype) in traced.items():
        got = ids[ids >= 0]
        if len(got) == 0:
            continue
        if int(got.max()) >= total:
            failed.add(pname)
            feeds[pname] = set()
            continue
        feeds[pname] = {int(t) for t in np.unique(np.searchsorted(bases, got, side="right") - 1)}
        boxes = pieces_of(ids, tensors, bases) if direct and pname not in whole_params else None
        if boxes is None or any(tensors[index[b[2][0]]].dtype != dtype for b in boxes):
            failed.add(pname)
        else:
            boxes_of[pname] = boxes
    # A module with one parameter loaded whole loads whole (layerwise reload finalises a
    # module as a unit); a tensor loaded whole makes every parameter it feeds whole.
    fed = set().union(*feeds.values())
    whole = {i for i in range(len(tensors)) if i not in fed}
    changed = True
    while changed:
        changed = False
        modules = {p.rpartition(".")[0] for p in failed}
        for p in list(boxes_of):
            if p.rpartition(".")[0] in modules or feeds[p] & whole:
                failed.add(p)
                del boxes_of[p]
                changed = True
        for p in failed:
            if not feeds[p] <= whole:
                whole |= feeds[p]
                changed = True
    params: list[tuple[int, str, tuple[int, ...], tuple[PieceSpec, ...]]] = []
    boxes: list[Box] = []
    for pname in sorted(boxes_of):
        for at, shape, piece in boxes_of[pname]:
            box = Box(pname, at, shape, piece)
            boxes.append(box)
            params.append((rank, box.name, shape, (piece,)))
    names = tuple(tensors[i].name for i in sorted(whole))
    for n in names:
        t = tensors[index[n]]
        params.append((rank, f"t:{n}", tuple(t.shape), ((n, None, (0,) * len(t.shape)),)))
    return ReceiverSlices(tuple(params), tuple(boxes), names)


def decode_receiver_layout(raw: bytes, rank: int, tensors: Sequence[TensorSpec]) -> Layout:
    """A receiver's part of the layout as it published it (a ``Layout`` of the announced
    tensors, no shards, only its own parameters): decoded by ``Layout.from_json``, then
    checked to declare exactly the announced tensors and only rank ``rank``'s parameters,
    each named as ``receiver_params`` names them. Anything else raises ``LayoutError``."""
    layout = Layout.from_json(raw)
    if layout.tensors != tuple(tensors):
        raise LayoutError(f"receiver {rank} describes other tensors than the trainer announced")
    if layout.shards:
        raise LayoutError(f"receiver {rank} declared trainer shards")
    names = set()
    for r, name, _, _ in layout.params:
        if r != rank:
            raise LayoutError(f"receiver {rank} declared a parameter of rank {r}")
        if not (name.startswith("p:") or name.startswith("t:")) or name in names:
            raise LayoutError(f"receiver {rank}: parameter name {name[:80]!r} is not one it may declare")
        names.add(name)
    return layout
