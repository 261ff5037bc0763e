"""Paged KV caches as xfer addresses them: pure arithmetic, shared by the serving connectors.

A serving system keeps one cache tensor per attention layer, split in blocks (pages) of
``block_size`` tokens. Standard attention stores keys and values in two planes,
``(2, num_blocks, ...)``; MLA stores one latent plane, ``(num_blocks, ...)``. A block of one
plane is contiguous, so a request's blocks move as pages of ``block_bytes``: page ``p`` of plane
``k`` is page ``k * blocks_per_plane + p`` when the planes are ``plane_stride`` bytes apart.
Offsets come from block ids — no descriptor list is built per block.
"""

from __future__ import annotations

import dataclasses
import functools
import json
import math
from collections.abc import Sequence
from typing import Any


class LayoutError(ValueError):
    """A cache tensor xfer cannot address as pages, or two that do not match."""


@dataclasses.dataclass(frozen=True)
class Layout:
    """One layer's cache tensor, as pages."""

    planes: int
    """2 (keys and values) or 1 (MLA)."""
    num_blocks: int
    block_bytes: int
    """Bytes of one block in one plane."""
    plane_pages: int
    """Pages from the start of one plane to the next (``num_blocks`` when planes are packed)."""
    dtype: str
    block_shape: tuple[int, ...]
    """Shape of one block of one plane (tokens, heads, head size …)."""

    def pages(self, block_ids: Sequence[int]) -> list[int]:
        """The page indices of ``block_ids`` in every plane, plane by plane."""
        return [k * self.plane_pages + b for k in range(self.planes) for b in block_ids]

    def describe(self) -> dict[str, object]:
        """What a peer checks before moving blocks (see ``check_compatible``)."""
        return {
            "planes": self.planes,
            "block_bytes": self.block_bytes,
            "dtype": self.dtype,
            "block_shape": list(self.block_shape),
        }


def layout_of(
    shape: Sequence[int], strides: Sequence[int], itemsize: int, dtype: str, *, mla: bool
) -> Layout:
    """The page layout of a cache tensor of ``shape`` and element ``strides``.

    ``mla``: one plane ``(num_blocks, ...)``; else two, ``(2, num_blocks, ...)``. Each block must
    be contiguous and the planes a whole number of blocks apart.
    """
    shape, strides = tuple(shape), tuple(strides)
    lead = 1 if mla else 2
    if len(shape) < lead + 1 or (not mla and shape[0] != 2):
        want = "(num_blocks, ...)" if mla else "(2, num_blocks, ...)"
        raise LayoutError(f"a KV cache tensor of shape {shape} is not {want}")
    block_dim = lead - 1
    block_shape = shape[block_dim + 1 :]
    block_elems = math.prod(block_shape)
    # Contiguous within a block: the innermost dimensions are packed.
    expected = 1
    for size, stride in reversed(list(zip(block_shape, strides[block_dim + 1 :]))):
        if size > 1 and stride != expected:
            raise LayoutError(
                f"a block of the KV cache (shape {shape}, strides {strides}) is not contiguous"
            )
        expected *= size
    if strides[block_dim] != block_elems:
        raise LayoutError(
            f"blocks of the KV cache (shape {shape}, strides {strides}) are not packed"
        )
    plane_pages = shape[block_dim]
    if not mla:
        if strides[0] % block_elems != 0:
            raise LayoutError(
                f"the key and value planes (strides {strides}) are not a whole number of blocks apart"
            )
        plane_pages = strides[0] // block_elems
    return Layout(
        planes=1 if mla else 2,
        num_blocks=shape[block_dim],
        block_bytes=block_elems * itemsize,
        plane_pages=plane_pages,
        dtype=dtype,
        block_shape=tuple(block_shape),
    )


def check_compatible(local: dict[str, object], remote: dict[str, object], what: str) -> None:
    """Refuses, naming the first difference, two layers that cannot exchange blocks."""
    for key in ("planes", "dtype", "block_shape", "block_bytes"):
        if local.get(key) != remote.get(key):
            raise LayoutError(
                f"{what}: {key} differs (here {local.get(key)!r}, peer {remote.get(key)!r})"
            )


def matched_blocks(local_ids: Sequence[int], remote_ids: Sequence[int]) -> tuple[list[int], list[int]]:
    """The remote blocks to read into ``local_ids``: the last ``len(local_ids)`` of the
    peer's (blocks the receiver already holds from its own prefix cache come first)."""
    if len(local_ids) > len(remote_ids):
        raise LayoutError(
            f"{len(local_ids)} blocks to fill but the peer holds only {len(remote_ids)}"
        )
    return list(local_ids), list(remote_ids[len(remote_ids) - len(local_ids) :])


NULL_BLOCK = 0
"""vLLM's placeholder block (its pool's first): where a sliding-window group's list holds a
block that left the window. Never read or written."""


def clip_to_windows(groups: Sequence[Sequence[int]], windows: Sequence[int]) -> list[list[int]]:
    """A request's block ids per KV cache group, cut to what is moved: all of a full-attention
    group's (window 0), the last ``window`` of a sliding-window group's (vLLM allocates the
    whole prompt, then replaces blocks that left the window by its null block, at the head)."""
    if len(groups) != len(windows):
        raise LayoutError(f"{len(groups)} KV cache groups of block ids for {len(windows)} groups")
    clipped = []
    for ids, window in zip(groups, windows):
        if window:
            # The window may reach a block further back than the request holds.
            clipped.append([b for b in ids[-window:] if b != NULL_BLOCK])
        else:
            clipped.append(list(ids))
    return clipped


@dataclasses.dataclass(frozen=True)
class Read:
    """One paged read of a layer: from one peer rank, page ``i`` of ``remote_pages`` (at
    ``remote_offset + page * remote_stride``) into page ``i`` of ``local_pages`` (at
    ``local_offset + page * local_stride``), ``page_len`` bytes each."""

    remote_rank: int
    page_len: int
    local_pages: list[int]
    local_offset: int
    local_stride: int
    remote_pages: list[int]
    remote_offset: int
    remote_stride: int


def read_plan(
    local: Layout,
    remote: Layout,
    local_rank: int,
    local_tp: int,
    remote_tp: int,
    local_ids: Sequence[int],
    remote_ids: Sequence[int],
    *,
    mla: bool | None = None,
) -> list[Read]:
    """The reads that fill ``local_ids`` of one layer from the peer's ``remote_ids``, across
    tensor-parallel sizes.

    Same TP size: rank ``r`` reads rank ``r``, whole blocks. Otherwise each rank holds
    ``heads / tp`` KV heads of every token, and a block ``(tokens, heads, head_size)`` is read
    token by token (pages of one token's head slice): a decode rank with fewer heads reads its
    slice of one prefill rank; one with more heads reads each of several prefill ranks into its
    place. MLA's latent cache is the same on every rank: rank ``r`` reads one peer rank whole.
    ``mla``: whether the cache is MLA's (default: one plane, as vLLM lays it out; SGLang keeps
    keys and values of standard attention in separate one-plane buffers, so it says).
    """
    if mla is None:
        mla = local.planes == 1
    if local.planes != remote.planes or local.dtype != remote.dtype:
        raise LayoutError(
            f"planes/dtype differ (here {local.planes} {local.dtype}, peer {remote.planes} {remote.dtype})"
        )
    if max(local_tp, remote_tp) % min(local_tp, remote_tp) != 0:
        raise LayoutError(
            f"tensor-parallel sizes {local_tp} (here) and {remote_tp} (peer): one must divide the other"
        )
    if local_tp == remote_tp or mla:
        if local.describe() != remote.describe():
            check_compatible(local.describe(), remote.describe(), "layer")
        rank = local_rank if local_tp == remote_tp else local_rank % remote_tp
        return [Read(rank, local.block_bytes, local.pages(local_ids), 0, local.block_bytes,
                     remote.pages(remote_ids), 0, remote.block_bytes)]
    if len(local.block_shape) != 3 or len(remote.block_shape) != 3:
        raise LayoutError(
            f"blocks of shape {local.block_shape} (here) and {remote.block_shape} (peer) are not "
            "(tokens, heads, head_size): other tensor-parallel sizes need it"
        )
    (tokens, heads_l, dim), (tokens_r, heads_r, dim_r) = local.block_shape, remote.block_shape
    if (tokens, dim) != (tokens_r, dim_r) or heads_l * local_tp != heads_r * remote_tp:
        raise LayoutError(
            f"blocks differ beyond the head split: here {local.block_shape} x TP {local_tp}, "
            f"peer {remote.block_shape} x TP {remote_tp}"
        )
    item = local.block_bytes // (tokens * heads_l * dim)
    token_l, token_r = heads_l * dim * item, heads_r * dim * item

    def token_pages(layout: Layout, ids: Sequence[int]) -> list[int]:
        return [p * tokens + t for p in layout.pages(ids) for t in range(tokens)]

    local_pages, remote_pages = token_pages(local, local_ids), token_pages(remote, remote_ids)
    if local_tp > remote_tp:
        # Fewer heads here: this rank's slice of one peer rank's heads.
        k = local_tp // remote_tp
        return [Read(local_rank // k, token_l, local_pages, 0, token_l, remote_pages,
                     (local_rank % k) * token_l, token_r)]
    # More heads here: every peer rank holding some of them, each into its place.
    k = remote_tp // local_tp
    return [Read(local_rank * k + j, token_r, local_pages, j * token_r, token_l, remote_pages, 0,
                 token_r) for j in range(k)]


def pack_message(prefix: bytes, header: dict[str, Any], payload: bytes = b"") -> bytes:
    """A connector message: a fixed-length ``prefix`` naming its kind, a JSON header, and raw
    bytes (block ids as little-endian int32, not JSON: a request has thousands)."""
    text = json.dumps(header).encode()
    return prefix + len(text).to_bytes(4, "little") + text + payload


def unpack_message(data: bytes, prefix_len: int) -> tuple[bytes, dict[str, Any], bytes]:
    """The parts of a :func:`pack_message` message whose prefixes are ``prefix_len`` bytes."""
    prefix, rest = data[:prefix_len], data[prefix_len:]
    n = int.from_bytes(rest[:4], "little")
    return prefix, json.loads(rest[4 : 4 + n]), rest[4 + n :]


# ---- vLLM 0.33's layer views: [num_blocks, heads, tokens, content], any stride order ----


@dataclasses.dataclass(frozen=True)
class LayerView:
    """One layer's cache as vLLM 0.33 hands it to a connector: a 4-D view
    ``[num_blocks, heads, tokens, content]`` (keys and values packed in ``content``; MLA's latent
    is one "head") into a buffer other layers may share, in any of vLLM's stride orders (NHD:
    tokens outside heads; HND: heads outside tokens; layers between blocks or heads outside
    blocks). Block ``b``'s element ``(h, n, c)`` is at byte
    ``offset + b * strides[0] + h * strides[1] + n * strides[2] + c * strides[3]`` of the
    registered buffer."""

    offset: int
    """Bytes from the registered buffer's start to block 0."""
    shape: tuple[int, int, int, int]
    strides: tuple[int, int, int, int]
    """In bytes."""
    itemsize: int
    dtype: str
    total_heads: int
    """KV heads of the whole model: a rank's heads are its share (or, with more ranks than
    heads, one replicated head)."""
    kernel_blocks: int = 1
    """Rows of the view per block of vLLM's KV cache manager: an attention backend whose
    kernels take smaller blocks than ``--block-size`` (FlashInfer: 16/32/64 under 128) gets a
    view of kernel blocks, ``[num_blocks * kernel_blocks, heads, block_size / kernel_blocks,
    content]``, and manager block ``b`` is rows ``b * kernel_blocks`` to ``(b + 1) *
    kernel_blocks - 1`` (vLLM's block table maps them so)."""

    def rows(self, block_ids: Sequence[int]) -> list[int]:
        """The view's rows (kernel blocks) holding the manager's ``block_ids``, in order."""
        return kernel_rows(block_ids, self.kernel_blocks)

    @property
    def num_blocks(self) -> int:
        return self.shape[0]

    @property
    def heads(self) -> int:
        return self.shape[1]

    def head_start(self, rank: int, tp: int) -> int:
        """The first of the model's heads rank ``rank`` of ``tp`` holds."""
        return rank * self.total_heads // tp

    def name(self) -> str:
        """The view in the characters rendezvous names allow (see :func:`parse_view`)."""
        dtype = self.dtype.replace("torch.", "")
        return "-".join([
            str(self.offset), "x".join(map(str, self.shape)), ".".join(map(str, self.strides)),
            str(self.itemsize), dtype, str(self.total_heads), str(self.kernel_blocks)])


def parse_view(text: str) -> LayerView:
    """The inverse of :meth:`LayerView.name`."""
    try:
        offset, shape, strides, itemsize, dtype, total, kernel = text.split("-")
        dims = tuple(int(d) for d in shape.split("x"))
        steps = tuple(int(s) for s in strides.split("."))
        if len(dims) != 4 or len(steps) != 4:
            raise ValueError("not 4-D")
        if int(kernel) < 1 or int(total) < 1 or min(dims) < 1 or int(offset) < 0:
            raise ValueError("a count below 1 or a negative offset")
        return LayerView(int(offset), dims, steps, int(itemsize),  # type: ignore[arg-type]
                         "torch." + dtype, int(total), int(kernel))
    except ValueError as e:
        raise LayoutError(f"a layer view {text!r} is not "
                          f"offset-shape-strides-itemsize-dtype-heads-kernelblocks ({e})") from None


def kernel_rows(block_ids: Sequence[int], kernel_blocks: int) -> list[int]:
    """The rows of a kernel-block view holding manager blocks ``block_ids`` (see
    :attr:`LayerView.kernel_blocks`)."""
    if kernel_blocks == 1:
        return list(block_ids)
    return [b * kernel_blocks + j for b in block_ids for j in range(kernel_blocks)]


def view_of(shape: Sequence[int], strides: Sequence[int], itemsize: int, dtype: str,
            offset: int, total_heads: int, block_size: int | None = None) -> LayerView:
    """A layer's :class:`LayerView` from its tensor's ``shape`` and element ``strides``
    (``offset`` in bytes from the registered buffer), refusing what cannot be moved by pages
    of whole elements: not 4-D, a content dimension that is not contiguous, heads that are not
    a share of ``total_heads``. ``block_size``: tokens per block of vLLM's KV cache manager
    (default: the view's own); a view of smaller kernel blocks must divide it."""
    shape, strides = tuple(shape), tuple(strides)
    if len(shape) != 4 or len(strides) != 4:
        raise LayoutError(
            f"a KV cache view of shape {shape} is not [num_blocks, heads, tokens, content] "
            "(vLLM 0.33's layer view)")
    if shape[3] > 1 and strides[3] != 1:
        raise LayoutError(
            f"the content dimension of a KV cache view (shape {shape}, strides {strides}) is not "
            "contiguous")
    heads = shape[1]
    if total_heads < 1 or not (total_heads % heads == 0 or heads == 1):
        raise LayoutError(
            f"a KV cache view with {heads} heads is not a share of the model's {total_heads}")
    kernel_blocks = 1
    if block_size is not None and block_size != shape[2]:
        if block_size % shape[2] or shape[0] % (block_size // shape[2]):
            raise LayoutError(
                f"a KV cache view of {shape[2]}-token blocks does not split the manager's "
                f"{block_size}-token blocks (shape {shape})")
        kernel_blocks = block_size // shape[2]
    return LayerView(offset, shape, tuple(s * itemsize for s in strides),  # type: ignore[arg-type]
                     itemsize, dtype, total_heads, kernel_blocks)


@dataclasses.dataclass(frozen=True)
class Run:
    """Bytes of one block that move as one piece: ``length`` bytes at ``local`` and at
    ``remote`` from their blocks' starts, with the peer rank holding them."""

    remote_rank: int
    local: int
    remote: int
    length: int


@functools.lru_cache(maxsize=4096)
def block_runs(local: LayerView, remote: LayerView, local_rank: int, local_tp: int,
               remote_tp: int) -> tuple[Run, ...]:
    """What of each block moves between this rank's view and the peer ranks' (one layer),
    merged into the fewest runs: a block whose heads both sides hold whole and lay out the
    same is one run; a head slice is one run where heads lie outside tokens (HND) and one run
    per token where tokens lie outside heads (NHD). Never a run per element.

    Each of this rank's heads comes from one peer rank holding it (replicated heads: the
    replica ``local_rank`` picks, so ranks spread over replicas); both sides must agree on the
    model (dtype, tokens per block, content, total heads). Pure; cached per pair of views.
    """
    what = (f"here {local.shape} {local.dtype} of {local.total_heads} heads at TP {local_tp}, "
            f"peer {remote.shape} {remote.dtype} of {remote.total_heads} heads at TP {remote_tp}")
    if (local.dtype, local.itemsize, local.total_heads) != (remote.dtype, remote.itemsize,
                                                             remote.total_heads):
        raise LayoutError(f"the layers' models differ: {what}")
    if local.shape[2:] != remote.shape[2:]:
        raise LayoutError(f"blocks differ in tokens or content: {what}")
    if local.kernel_blocks != remote.kernel_blocks:
        # Heterogeneous block sizes (NIXL's block_size_ratio) are not supported.
        raise LayoutError(
            f"the block sizes differ: {local.kernel_blocks} (here) and {remote.kernel_blocks} "
            f"(peer) kernel blocks of {local.shape[2]} tokens per block: {what}")
    for view, tp in ((local, local_tp), (remote, remote_tp)):
        if view.heads * tp != view.total_heads and not (view.heads == 1 and tp > view.total_heads):
            raise LayoutError(f"{view.heads} heads per rank at TP {tp} are not a share of the "
                              f"model's {view.total_heads}: {what}")
    tokens, content = local.shape[2], local.shape[3] * local.itemsize
    first = local.head_start(local_rank, local_tp)
    last = first + local.heads
    runs: list[Run] = []
    head = first
    while head < last:
        holders = [r for r in range(remote_tp)
                   if remote.head_start(r, remote_tp) <= head
                   < remote.head_start(r, remote_tp) + remote.heads]
        rank = holders[local_rank % len(holders)]
        start = remote.head_start(rank, remote_tp)
        end = min(last, start + remote.heads)
        units = sorted(
            (h_local * local.strides[1] + n * local.strides[2],
             h_remote * remote.strides[1] + n * remote.strides[2])
            for h_local, h_remote in zip(range(head - first, end - first),
                                         range(head - start, end - start))
            for n in range(tokens))
        merged: list[list[int]] = []
        for at_local, at_remote in units:
            if merged and merged[-1][0] + merged[-1][2] == at_local and (
                    merged[-1][1] + merged[-1][2] == at_remote):
                merged[-1][2] += content
            else:
                merged.append([at_local, at_remote, content])
        runs.extend(Run(rank, a, b, n) for a, b, n in merged)
        head = end
    return tuple(runs)
