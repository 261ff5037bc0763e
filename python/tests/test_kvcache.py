"""The page arithmetic the serving connectors share (xfer.kv.pages, also importable as
xfer._kvcache), without a serving system."""

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


# ---- vLLM 0.33's layer views (xfer._kvcache.LayerView, block_runs) ----

ORDERS = [  # physical order of (layer, block, head, token); content is innermost
    "LBHN", "LBNH", "LHBN", "BLHN", "BLNH", "BHLN"]


def rank_view(full, rank, tp, order, layers=2, layer=1):
    """Rank ``rank``'s share of ``full`` ([blocks, heads, tokens, content], all heads) in a
    buffer of ``layers`` layers laid out in ``order``, as vLLM's allocate_kv_cache views it."""
    from xfer._kvcache import view_of

    blocks, total, tokens, content = full.shape
    heads = max(1, total // tp)
    first = rank * total // tp
    logical = {"L": layers, "B": blocks, "H": heads, "N": tokens}
    buf = np.zeros([logical[d] for d in order] + [content], dtype=full.dtype)
    view = buf.transpose([order.index(d) for d in "LBHN"] + [4])[layer]
    view[...] = full[:, first:first + heads]
    offset = view.__array_interface__["data"][0] - buf.__array_interface__["data"][0]
    lv = view_of(view.shape, [s // full.itemsize for s in view.strides], full.itemsize,
                 str(full.dtype), offset, total)
    return buf, lv


def move(runs, local_buf, local_view, remote_bufs, remote_views, local_ids, remote_ids):
    """Moves what ``runs`` say as xfer's paged reads would: page ``b`` at offset + b * stride."""
    dst = local_buf.reshape(-1).view(np.uint8)
    for run in runs:
        src = remote_bufs[run.remote_rank].reshape(-1).view(np.uint8)
        rv = remote_views[run.remote_rank]
        for lb, rb in zip(local_ids, remote_ids):
            at_l = local_view.offset + lb * local_view.strides[0] + run.local
            at_r = rv.offset + rb * rv.strides[0] + run.remote
            dst[at_l:at_l + run.length] = src[at_r:at_r + run.length]


def test_block_runs_move_every_head_of_every_block_once_across_orders_and_tp_sizes():
    from xfer._kvcache import block_runs

    rng = np.random.default_rng(7)
    cases = 0
    for _ in range(300):
        total = int(rng.choice([1, 2, 4, 8]))
        tp_l, tp_r = int(rng.choice([1, 2, 4, 8])), int(rng.choice([1, 2, 4, 8]))
        if any(total % tp and tp % total for tp in (tp_l, tp_r)):
            continue
        tokens, content = int(rng.choice([1, 4, 16])), int(rng.choice([2, 8]))
        dtype = rng.choice([np.float16, np.uint8])
        full = rng.integers(1, 250, size=(6, total, tokens, content)).astype(dtype)
        order_l, order_r = rng.choice(ORDERS), rng.choice(ORDERS)
        remote = [rank_view(full, r, tp_r, order_r) for r in range(tp_r)]
        remote_ids, local_ids = [5, 0, 3], [1, 4, 2]
        for rank in range(tp_l):
            empty = np.zeros_like(full)
            buf, lv = rank_view(empty, rank, tp_l, order_l)
            runs = block_runs(lv, remote[0][1], rank, tp_l, tp_r)
            move(runs, buf, lv, [b for b, _ in remote], [v for _, v in remote], local_ids, remote_ids)
            view = buf.transpose([order_l.index(d) for d in "LBHN"] + [4])[1]
            first, heads = rank * total // tp_l, max(1, total // tp_l)
            for lb, rb in zip(local_ids, remote_ids):
                assert (view[lb] == full[rb, first:first + heads]).all(), (order_l, order_r, tp_l, tp_r)
            untouched = [b for b in range(6) if b not in local_ids]
            assert not view[untouched].any()
            if order_l == order_r and tp_l == tp_r and order_l[1:3] in ("BH", "BN"):
                assert len(runs) == 1  # a whole block is one run
            cases += 1
    assert cases > 200


def test_a_head_slice_is_one_run_under_hnd_and_one_per_token_under_nhd():
    from xfer._kvcache import block_runs

    full = np.zeros((4, 8, 16, 128), dtype=np.float16)
    for order, want in (("LBHN", 1), ("LBNH", 16)):
        remote = rank_view(full, 0, 2, order)[1]
        local = rank_view(full, 1, 4, order)[1]
        runs = block_runs(local, remote, 1, 4, 2)
        assert len(runs) == want
        assert sum(r.length for r in runs) == 2 * 16 * 128 * 2


def test_layer_views_that_cannot_be_moved_are_refused_by_name():
    from xfer._kvcache import block_runs, parse_view, view_of

    with pytest.raises(LayoutError, match="not \\[num_blocks, heads, tokens, content\\]"):
        view_of((2, 4, 16, 8, 8), (1,) * 5, 2, "torch.float16", 0, 8)
    with pytest.raises(LayoutError, match="content dimension"):
        view_of((4, 2, 16, 8), (512, 256, 16, 2), 2, "torch.float16", 0, 2)
    with pytest.raises(LayoutError, match="not a share"):
        view_of((4, 3, 16, 8), (384, 128, 8, 1), 2, "torch.float16", 0, 8)
    a = view_of((4, 2, 16, 8), (256, 128, 8, 1), 2, "torch.float16", 0, 2)
    b = view_of((4, 2, 16, 8), (256, 128, 8, 1), 2, "torch.bfloat16", 0, 2)
    with pytest.raises(LayoutError, match="models differ"):
        block_runs(a, b, 0, 1, 1)
    assert parse_view(a.name()) == a
    with pytest.raises(LayoutError, match="is not offset-shape"):
        parse_view("12-4x2")


def test_sliding_window_groups_keep_only_the_blocks_their_window_reaches():
    from xfer._kvcache import clip_to_windows

    # vLLM's lists for a full-attention group and a sliding-window one whose blocks before the
    # window became its null block (0): the window's tail is kept, nulls never moved.
    full, sliding = [1, 2, 3, 4, 5], [0, 0, 0, 9, 10]
    assert clip_to_windows([full, sliding], [0, 2]) == [full, [9, 10]]
    assert clip_to_windows([full, sliding], [0, 3]) == [full, [9, 10]]
    # A full-attention group's ids are kept as they are (a hand-made block 0 too).
    assert clip_to_windows([[0, 1]], [0]) == [[0, 1]]
    with pytest.raises(LayoutError, match="2 KV cache groups of block ids for 1 groups"):
        clip_to_windows([full, sliding], [0])


def test_the_old_flat_paths_are_the_kv_rooms_modules():
    """Issue 54: the KV modules moved into ``xfer.kv``; every path users and docs name still
    imports, as the same module object (a patch through one name reaches the other)."""
    import importlib

    for old, new in [("xfer._kvcache", "xfer.kv.pages"),
                     ("xfer._sglang_layout", "xfer.kv.sglang_layout"),
                     ("xfer._vllm_records", "xfer.kv.vllm_records")]:
        assert importlib.import_module(old) is importlib.import_module(new), old
