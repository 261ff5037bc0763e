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


def apply(plan_reads, local_ranks, remote_ranks):
    """Performs reads as xfer would: bytes of remote pages at offset + page * stride."""
    from xfer._kvcache import Read  # noqa: F401

    for r in plan_reads:
        dst = local_ranks.reshape(-1).view(np.uint8)
        src = remote_ranks[r.remote_rank].reshape(-1).view(np.uint8)
        for lp, rp in zip(r.local_pages, r.remote_pages):
            lo, ro = r.local_offset + lp * r.local_stride, r.remote_offset + rp * r.remote_stride
            dst[lo:lo + r.page_len] = src[ro:ro + r.page_len]


@pytest.mark.parametrize("decode_tp,prefill_tp", [(1, 1), (2, 1), (4, 2), (4, 4), (1, 2), (2, 4)])
def test_reads_across_tensor_parallel_sizes_put_every_head_in_its_place(decode_tp, prefill_tp):
    from xfer._kvcache import read_plan

    heads, blocks, tokens, dim = 8, 6, 4, 3
    rng = np.random.default_rng(decode_tp * 10 + prefill_tp)
    # The logical cache: (2, blocks, tokens, heads, dim); rank r holds heads [r*h, (r+1)*h).
    full = rng.integers(0, 60000, size=(2, blocks, tokens, heads, dim)).astype(np.uint16)
    hp, hd = heads // prefill_tp, heads // decode_tp
    prefill = [np.ascontiguousarray(full[:, :, :, r * hp:(r + 1) * hp]) for r in range(prefill_tp)]
    remote_ids, local_ids = [4, 1], [0, 5]
    for rank in range(decode_tp):
        mine = np.zeros((2, blocks, tokens, hd, dim), dtype=np.uint16)
        reads = read_plan(layout(mine), layout(prefill[0]), rank, decode_tp, prefill_tp, local_ids, remote_ids)
        assert len(reads) == max(1, prefill_tp // decode_tp)
        apply(reads, mine, prefill)
        want = full[:, remote_ids][:, :, :, rank * hd:(rank + 1) * hd]
        assert np.array_equal(mine[:, local_ids], want), (decode_tp, prefill_tp, rank)
        untouched = [b for b in range(blocks) if b not in local_ids]
        assert not mine[:, untouched].any()


def test_mla_reads_one_peer_rank_whole_and_odd_tp_sizes_are_refused():
    from xfer._kvcache import read_plan

    latent = layout(np.zeros((5, 4, 16), dtype=np.uint16), mla=True)
    (read,) = read_plan(latent, latent, 3, 4, 2, [1], [2])
    assert (read.remote_rank, read.page_len) == (1, latent.block_bytes)
    kv = layout(np.zeros((2, 4, 4, 2, 8), dtype=np.float16))
    with pytest.raises(LayoutError, match="divide"):
        read_plan(kv, kv, 0, 3, 2, [1], [1])


def test_one_plane_buffers_of_standard_attention_are_sliced_by_heads_when_told():
    from xfer._kvcache import read_plan

    # SGLang keeps keys and values in separate one-plane buffers: one plane is not MLA there.
    mine = layout(np.zeros((6, 4, 2, 3), dtype=np.uint16), mla=True)    # 2 heads per rank
    theirs = layout(np.zeros((6, 4, 4, 3), dtype=np.uint16), mla=True)  # 4 heads, TP 1
    with pytest.raises(LayoutError):
        read_plan(mine, theirs, 1, 2, 1, [0], [2])  # as MLA: the latents would have to match
    (sliced,) = read_plan(mine, theirs, 1, 2, 1, [0], [2], mla=False)
    token = 2 * 3 * 2  # this rank's heads of one token, in bytes
    assert (sliced.remote_rank, sliced.page_len) == (0, token)
    assert sliced.remote_offset == token  # rank 1's heads start after rank 0's
    assert sliced.local_pages == [0, 1, 2, 3] and sliced.remote_pages == [8, 9, 10, 11]
