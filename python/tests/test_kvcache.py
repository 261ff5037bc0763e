"""The page arithmetic the serving connectors share (xfer._kvcache), without a serving system."""

import numpy as np
import pytest

from xfer._kvcache import LayoutError, check_compatible, layout_of, matched_blocks


def layout(array, mla=False):
    strides = tuple(s // array.itemsize for s in array.strides)
    return layout_of(array.shape, strides, array.itemsize, str(array.dtype), mla=mla)


def test_key_and_value_planes_are_pages_a_plane_apart():
    cache = np.zeros((2, 10, 4, 2, 8), dtype=np.float16)  # (2, blocks, tokens, heads, dim)
    l = layout(cache)
    assert (l.planes, l.num_blocks, l.block_bytes, l.plane_pages) == (2, 10, 4 * 2 * 8 * 2, 10)
    assert l.pages([3, 7]) == [3, 7, 13, 17]
    # The pages are where the blocks are.
    flat = cache.reshape(-1).view(np.uint8)
    cache[1, 7] = 5
    page = l.pages([7])[1]
    assert (flat[page * l.block_bytes:(page + 1) * l.block_bytes].view(np.float16) == 5).all()


def test_mla_is_one_plane():
    l = layout(np.zeros((6, 16, 576), dtype=np.float16), mla=True)
    assert (l.planes, l.num_blocks, l.plane_pages) == (1, 6, 6)
    assert l.pages([0, 5]) == [0, 5]


def test_what_cannot_be_paged_is_refused_by_name():
    with pytest.raises(LayoutError, match="not \\(2, num_blocks"):
        layout(np.zeros((3, 4, 4), dtype=np.float16))
    strided = np.zeros((2, 8, 4, 16), dtype=np.float16)[:, :, :, :8]
    with pytest.raises(LayoutError, match="not contiguous"):
        layout(strided)
    every_other = np.zeros((2, 8, 4, 8), dtype=np.float16)[:, ::2]
    with pytest.raises(LayoutError, match="not packed"):
        layout(every_other)


def test_mismatches_and_short_peers_are_named():
    a = layout(np.zeros((2, 4, 4, 2, 8), dtype=np.float16)).describe()
    b = layout(np.zeros((2, 4, 4, 2, 16), dtype=np.float16)).describe()
    check_compatible(a, dict(a), "layer 0")
    with pytest.raises(LayoutError, match="layer 0: block_shape differs"):
        check_compatible(a, b, "layer 0")
    assert matched_blocks([9, 8], [1, 2, 3]) == ([9, 8], [2, 3])
    with pytest.raises(LayoutError, match="only 1"):
        matched_blocks([1, 2], [5])
