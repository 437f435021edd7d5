"""Layouts by name: the view read off the tensors is the library's (docs/views.md),
and one compression gives the same result in every layout."""

import numpy as np
import pytest

import kvpolicy
from checks import check_moved
from paged_case import make_case

LAYOUTS = sorted(kvpolicy.LAYOUTS)


def expected_view(layout, L, NB, b, h, d):
    """docs/views.md's table: K and V strides (block, token, head, dim) in elements, and
    each layer's K and V start in elements from the first tensor's start (layer l's own
    tensor for per-layer layouts)."""
    E = b * h * d
    nhd, hnd = (E, h * d, d, 1), (E, d, b * d, 1)
    return {
        "vllm": ((2 * E, 2 * d, b * 2 * d, 1), lambda l: 0, lambda l: d),
        "vllm_flash": (nhd, lambda l: 0, lambda l: NB * E),
        "vllm_flash_blocks_first": ((2 * E, h * d, d, 1), lambda l: 0, lambda l: E),
        "nhd": (nhd, lambda l: 0, lambda l: 0),
        "hnd": (hnd, lambda l: 0, lambda l: 0),
        "nano_vllm": (nhd, lambda l: l * NB * E, lambda l: (L + l) * NB * E),
        "sglang": ((h * d, h * d, d, 1), lambda l: 0, lambda l: 0),
        "trtllm_blocks_first": ((2 * L * E, d, b * d, 1), lambda l: 2 * l * E, lambda l: (2 * l + 1) * E),
        "trtllm_layers_first": ((2 * E, d, b * d, 1), lambda l: 0, lambda l: E),
    }[layout]


@pytest.mark.parametrize("layout", LAYOUTS)
def test_view_matches_the_documented_constructor(layout):
    b = 1 if layout == "sglang" else 4
    case = make_case(block_size=b, lengths=(9, 6), layers=3)
    cache, args = case.cache(layout)
    L, NB, _, h, d = case.kv.shape[1:6]
    strides, k_at, v_at = expected_view(layout, L, NB, b, h, d)
    view = cache.describe()
    assert view["k_stride"] == strides and view["v_stride"] == strides
    assert (cache.num_layers, cache.num_blocks, cache.block_size, cache.num_kv_heads, cache.head_dim) == (L, NB, b, h, d)
    _, split, per_layer, _ = kvpolicy.LAYOUTS[layout]
    size = case.kv.itemsize
    for l in range(L):
        k_tensor = (args["k"] if split else args["kv"])
        v_tensor = args["v"] if split else args["kv"]
        k_base = (k_tensor[l] if per_layer else k_tensor).ctypes.data
        v_base = (v_tensor[l] if per_layer else v_tensor).ctypes.data
        assert view["k_layers"][l] == k_base + k_at(l) * size
        assert view["v_layers"][l] == v_base + v_at(l) * size


def compress_in(layout, stacked=False, **kw):
    b = 1 if layout == "sglang" else 4
    case = make_case(block_size=b, lengths=(40, 0, 33), window=8, seed=11)
    cache, args = case.cache(layout, stacked=stacked, **kw)
    before = case.canonical(layout, {k: (np.copy(v) if not isinstance(v, list) else [x.copy() for x in v])
                                     for k, v in args.items()})
    r = kvpolicy.compress(kvpolicy.SnapKV(window=8), cache, seqs=[0, 2], budgets=[24, 16], queries=case.queries,
                          return_masks=True)
    after = case.canonical(layout, args)
    check_moved(case, before, after, [0, 2], case.lengths, r)
    return r, after


@pytest.mark.parametrize("layout", LAYOUTS)
def test_every_layout_compresses_alike(layout):
    r, after = compress_in(layout)
    reference_layout = "sglang" if layout == "sglang" else "nano_vllm"  # same block size
    r0, after0 = compress_in(reference_layout)
    np.testing.assert_array_equal(r.keep_masks, r0.keep_masks)
    np.testing.assert_array_equal(r.new_lengths, r0.new_lengths)
    np.testing.assert_array_equal(after, after0)


@pytest.mark.parametrize("layout", [name for name in LAYOUTS if kvpolicy.LAYOUTS[name][2]])
def test_a_stacked_tensor_is_its_list_of_layers(layout):
    r, after = compress_in(layout, stacked=True)
    r0, after0 = compress_in(layout)
    np.testing.assert_array_equal(r.keep_masks, r0.keep_masks)
    np.testing.assert_array_equal(after, after0)


def test_csr_table_is_the_dense_one():
    case = make_case(lengths=(40, 0, 33), window=8, seed=12)
    lengths = case.lengths
    blocks = [case.block_table[s, : -(-n // 4)] for s, n in enumerate(lengths)]
    indptr = np.concatenate([[0], np.cumsum([len(x) for x in blocks])]).astype(np.int32)
    indices = np.concatenate(blocks).astype(np.int32)
    kv = case.tensors("nano_vllm")["kv"]
    dense = kvpolicy.PagedCache("nano_vllm", kv.copy(), block_table=case.block_table, lengths=lengths)
    csr = kvpolicy.PagedCache("nano_vllm", kv, block_indptr=indptr, block_indices=indices, lengths=lengths)
    assert csr.describe()["csr"] and not dense.describe()["csr"]
    p = kvpolicy.SnapKV(window=8)
    a = kvpolicy.compress(p, dense, seqs=[0, 2], budgets=20, queries=case.queries, return_masks=True)
    b = kvpolicy.compress(p, csr, seqs=[0, 2], budgets=20, queries=case.queries, return_masks=True, max_tokens=40)
    np.testing.assert_array_equal(a.keep_masks, b.keep_masks)


def test_strided_views_are_read_in_place():
    # vLLM may allocate [num_blocks, 2, b, h, d] and hand out its [2, num_blocks, ...]
    # view: vllm_flash reads that view's strides, no copy.
    case = make_case(lengths=(40, 33), window=8, seed=13)
    blocks_first = case.tensors("vllm_flash_blocks_first")["kv"]
    before = case.canonical("vllm_flash_blocks_first", {"kv": [x.copy() for x in blocks_first]})
    as_flash = [x.transpose(1, 0, 2, 3, 4) for x in blocks_first]
    assert not as_flash[0].flags.c_contiguous
    cache = kvpolicy.PagedCache("vllm_flash", as_flash, block_table=case.block_table, lengths=case.lengths)
    view = cache.describe()
    assert view["v_layers"][0] - view["k_layers"][0] == as_flash[0].strides[0]
    r = kvpolicy.compress(kvpolicy.SnapKV(window=8), cache, seqs=[0, 1], budgets=20, queries=case.queries,
                          return_masks=True)
    after = case.canonical("vllm_flash_blocks_first", {"kv": blocks_first})
    check_moved(case, before, after, [0, 1], case.lengths, r)


def test_one_kv_head_with_arbitrary_size_one_strides():
    case = make_case(kv_heads=1, q_heads=2, lengths=(40, 33), window=8, seed=14)
    k = case.kv[0].transpose(0, 1, 2, 3, 4)  # [L, NB, b, 1, d]
    v = case.kv[1]
    # A size-1 head axis whose stride says nothing (as after a broadcast or unsqueeze).
    k_odd = np.lib.stride_tricks.as_strided(k.copy(), strides=k.strides[:3] + (4,) + k.strides[4:])
    cache = kvpolicy.PagedCache("nhd", k=list(k_odd), v=list(v.copy()), block_table=case.block_table,
                                lengths=case.lengths)
    assert cache.describe()["k_stride"][2] >= cache.head_dim
    r = kvpolicy.compress(kvpolicy.SnapKV(window=8), cache, seqs=[0], budgets=20, queries=case.queries)
    assert r.new_lengths.tolist() == [20]


# vLLM from v0.26 (vllm/v1/kv_cache_layout.py, read in v0.33.0): one allocation for a
# group's layers, the axes [L, B, H, N, C] (C = K then V) in one of six memory orders,
# each layer handed out as a strided [B, H, N, C] view of it (create_kv_cache_views).
VLLM_ORDERS = ["LBHNC", "LBNHC", "LHBNC", "BLHNC", "BLNHC", "BHLNC"]


def vllm_layer_views(case, order, pad=0):
    """The case's cache laid out as vLLM lays out `order`, and its per-layer logical views
    as vLLM's allocator makes them; `pad` elements pad each page where vLLM pads them
    (compute_layout_strides: the stride of the second axis of a block-compact order)."""
    kv = case.kv  # [2, L, NB, b, h, d]
    _, L, NB, b, h, d = kv.shape
    logical = np.ascontiguousarray(kv.transpose(1, 2, 4, 3, 0, 5)).reshape(L, NB, h, b, 2 * d)  # [L, B, H, N, C]
    sizes = dict(zip("LBHNC", logical.shape))
    strides, extent = {}, 1
    for axis in reversed(order):  # row-major over the physical order, innermost first
        if axis == order[1] and order[:2] in ("LB", "BL"):
            extent += pad  # a padded page: the step after the page's own [H, N, C]
        strides[axis] = extent
        extent *= sizes[axis]
    raw = np.zeros(extent + pad, dtype=kv.dtype)
    item = raw.itemsize
    view = np.lib.stride_tricks.as_strided(raw, shape=logical.shape,
                                           strides=[strides[a] * item for a in "LBHNC"], writeable=True)
    view[...] = logical
    return raw, [view[l] for l in range(L)]


def element_offsets(raw, x):
    """The index into `raw` of every element of its view `x`."""
    start = (x.ctypes.data - raw.ctypes.data) // raw.itemsize
    steps = [stride // raw.itemsize for stride in x.strides]
    return start + sum(np.meshgrid(*[np.arange(n) * st for n, st in zip(x.shape, steps)], indexing="ij"))


@pytest.mark.parametrize("order", VLLM_ORDERS)
@pytest.mark.parametrize("pad", [0, 8])
def test_vllm_memory_orders_are_read_in_place(order, pad):
    if pad and order[:2] not in ("LB", "BL"):
        pytest.skip("vLLM pads only block-compact pages")
    case = make_case(kv_heads=3, q_heads=6, lengths=(40, 0, 33), window=8, seed=15)
    raw, layers = vllm_layer_views(case, order, pad)
    if order != "LBHNC" or pad:
        assert not layers[0].flags.c_contiguous  # read through the strides, no copy
    cache = kvpolicy.PagedCache("vllm", layers, block_table=case.block_table, lengths=case.lengths)
    view = cache.describe()
    d = case.kv.shape[-1]
    assert view["v_layers"][0] - view["k_layers"][0] == d * raw.itemsize
    assert view["k_layers"][1] - view["k_layers"][0] == layers[1].ctypes.data - layers[0].ctypes.data
    p = kvpolicy.SnapKV(window=8)
    if order == "LHBNC":
        # Heads outside blocks (vLLM's ROCm backends): a block's rows interleave with
        # the next block's, which the executors' overlap check does not accept yet.
        with pytest.raises(kvpolicy.Error, match="k_stride"):
            kvpolicy.compress(p, cache, seqs=[0, 2], budgets=[24, 16], queries=case.queries)
        return
    before = raw.copy()
    r = kvpolicy.compress(p, cache, seqs=[0, 2], budgets=[24, 16], queries=case.queries, return_masks=True)
    # The same compression over a contiguous nano-vllm copy of the same tokens.
    nano_args = case.tensors("nano_vllm")
    ref = kvpolicy.compress(p, kvpolicy.PagedCache("nano_vllm", **nano_args, block_table=case.block_table,
                                                   lengths=case.lengths),
                            seqs=[0, 2], budgets=[24, 16], queries=case.queries, return_masks=True)
    np.testing.assert_array_equal(r.keep_masks, ref.keep_masks)
    np.testing.assert_array_equal(r.new_lengths, ref.new_lengths)
    np.testing.assert_array_equal(r.released_blocks, ref.released_blocks)
    np.testing.assert_array_equal(case.canonical("vllm", {"kv": layers}), case.canonical("nano_vllm", nano_args))
    if pad:  # the padding after each page is never written
        written = np.zeros(raw.shape, dtype=bool)
        for x in layers:
            written[element_offsets(raw, x)] = True
        assert not written.all()
        np.testing.assert_array_equal(raw[~written], before[~written])


def test_vllm_odd_content_axis_is_refused():
    case = make_case(lengths=(8,), window=4)
    layers = [np.zeros((6, 2, 4, 31), dtype=np.float32) for _ in range(2)]
    with pytest.raises(kvpolicy.Error, match=r"kv: has 31 elements on its K\|V axis"):
        kvpolicy.PagedCache("vllm", layers, block_table=case.block_table, lengths=case.lengths)


@pytest.mark.parametrize("hnd", [False, True])
def test_sglang_paged_pool_is_read_in_place(hnd):
    # SGLang v0.5.23's MHATokenToKVPool with page size p: per layer K and V halves of one
    # [2, rows, h, d] tensor (rows = pool size + p, token slots), or [pages, h, p, d]
    # under SGLANG_USE_HND_KVCACHE; req_to_token holds each request's slots, whole pages
    # of p consecutive slots; SGLang's paged backends read the page table
    # req_to_token[:, ::p] // p. PagedCache reads the pool through page views of it.
    p = 4
    case = make_case(block_size=p, lengths=(40, 0, 33), window=8, seed=16)
    kv = case.kv  # [2, L, NB, p, h, d]
    _, L, NB, _, h, d = kv.shape
    if hnd:
        fused = [np.ascontiguousarray(kv[:, l].transpose(0, 1, 3, 2, 4)) for l in range(L)]  # [2, NB, h, p, d]
        k, v = [f[0] for f in fused], [f[1] for f in fused]
    else:
        fused = [np.ascontiguousarray(kv[:, l].reshape(2, NB * p, h, d)) for l in range(L)]  # slots
        k = [f[0].reshape(NB, p, h, d) for f in fused]
        v = [f[1].reshape(NB, p, h, d) for f in fused]
    assert all(np.shares_memory(x, f) for x, f in zip(k, fused))
    max_len = case.block_table.shape[1] * p
    t = np.arange(max_len)
    req_to_token = (case.block_table[:, t // p] * p + t % p).astype(np.int32)
    page_table = np.ascontiguousarray(req_to_token[:, ::p] // p)
    cache = kvpolicy.PagedCache("hnd" if hnd else "nhd", k=k, v=v, block_table=page_table, lengths=case.lengths)
    policy = kvpolicy.SnapKV(window=8)
    r = kvpolicy.compress(policy, cache, seqs=[0, 2], budgets=[24, 16], queries=case.queries, return_masks=True)
    nano_args = case.tensors("nano_vllm")
    ref = kvpolicy.compress(policy, kvpolicy.PagedCache("nano_vllm", **nano_args, block_table=case.block_table,
                                                        lengths=case.lengths),
                            seqs=[0, 2], budgets=[24, 16], queries=case.queries, return_masks=True)
    np.testing.assert_array_equal(r.keep_masks, ref.keep_masks)
    np.testing.assert_array_equal(r.released_blocks, ref.released_blocks)
    back = np.stack([f.reshape(2, NB, h, p, d).transpose(0, 1, 3, 2, 4) if hnd else f.reshape(2, NB, p, h, d)
                     for f in fused], axis=1)  # [2, L, NB, p, h, d]
    np.testing.assert_array_equal(back, case.canonical("nano_vllm", nano_args))
