"""kernels/flex_paged_attention.py on the CPU (FlexAttention's eager path evaluates the same
block mask densely): the page-table block mask, and split-KV, against per-item SDPA over exactly
the item's pages. The compiled CUDA kernel is checked against a dense reference in test_gpu.py."""

import warnings

import pytest
import torch
import torch.nn.functional as F
from cde.kernels.flex_paged_attention import (
    KERNEL_OPTIONS,
    MAX_Q_BLOCK,
    PACKED_OPTIONS,
    SINGLE_TILE_OPTIONS,
    PagedBlockMask,
    flex_paged_attention,
    merge_splits,
)

KVH, H, D, CACHE_PAGES = 2, 8, 32, 24
# Mixed lengths and non-contiguous page ids in one batch; the 0s past each length are padding.
TABLE = torch.tensor([[3, 5, 7, 9, 11, 0, 0], [1, 2, 0, 0, 0, 0, 0], [4, 6, 8, 10, 12, 13, 14], [20, 0, 0, 0, 0, 0, 0]])
LENGTHS = torch.tensor([5, 2, 7, 1])


@pytest.fixture(scope="module")
def tensors():
    g = torch.Generator().manual_seed(0)
    k = torch.randn(KVH, CACHE_PAGES, 64, D, generator=g)
    v = torch.randn(KVH, CACHE_PAGES, 64, D, generator=g)
    q = torch.randn(len(LENGTHS), H, 64, D, generator=g)
    return q, k, v


def attend(q, k, v, lengths, splits, group=1, options=None):
    mask = PagedBlockMask(len(lengths), CACHE_PAGES, "cpu", splits, group, options)
    mask.update(TABLE, lengths)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # eager FlexAttention warns that it is not compiled
        return flex_paged_attention(q, k, v, mask, return_lse=True), mask


def reference(q, k, v, i, n):
    pages = TABLE[i, :n]
    kvh, h = k.shape[0], q.shape[1]
    keys, values = (c[:, pages].reshape(kvh, -1, D) for c in (k, v))
    out = F.scaled_dot_product_attention(q[i][None], keys[None], values[None], enable_gqa=True)[0]
    scores = q[i].reshape(kvh, h // kvh * 64, D) @ keys.transpose(-1, -2) * D**-0.5
    return out, torch.logsumexp(scores, -1).reshape(h, 64)


@pytest.mark.parametrize("group", [1, 2, 4])  # 4: all query heads of a KV head in one sequence
@pytest.mark.parametrize("splits", [1, 2, 3, 8])
def test_each_item_attends_exactly_its_pages_with_any_number_of_splits(tensors, splits, group):
    q, k, v = tensors
    (out, lse), mask = attend(q, k, v, LENGTHS, splits, group)
    for i, n in enumerate(LENGTHS.tolist()):
        ref_out, ref_lse = reference(q, k, v, i, n)
        assert torch.allclose(out[i], ref_out, atol=1e-5), (i, (out[i] - ref_out).abs().max())
        assert torch.allclose(lse[i], ref_lse, atol=1e-4)
    # The splits' shares of an item are disjoint and cover its pages exactly once.
    per = mask.tiles_per_share  # query tiles of one share (2 when 4 heads of 64 rows are packed)
    counts = mask.full_num.view(len(LENGTHS), splits, per)
    assert (counts == counts[..., :1]).all() and counts[..., 0].sum(1).tolist() == LENGTHS.tolist()
    for i, n in enumerate(LENGTHS.tolist()):
        shares = [
            mask.full_idx[0, 0, (i * splits + j) * per, :c].tolist() for j, c in enumerate(counts[i, :, 0].tolist())
        ]
        assert [p for share in shares for p in share] == TABLE[i, :n].tolist()


@pytest.mark.parametrize("group,splits", [(1, 1), (4, 1), (2, 3)])
def test_queries_given_packed_attend_as_the_same_queries_unpacked(tensors, group, splits):
    """kernels/qkv_rope.py hands the attention q already in the packed order [H / G, N, G, 64, D]."""
    q, k, v = tensors
    n, h = q.shape[:2]
    packed = q.view(n, h // group, group, 64, D).transpose(0, 1).contiguous()
    (out, lse), _ = attend(q, k, v, LENGTHS, splits, group)
    (out_packed, lse_packed), _ = attend(packed, k, v, LENGTHS, splits, group)
    assert torch.equal(out_packed, out) and torch.equal(lse_packed, lse)
    with pytest.raises(ValueError, match="does not fit"):
        attend(packed, k, v, LENGTHS, splits, group * 2)  # packed for another grouping


@pytest.mark.parametrize("splits", [1, 2])
def test_a_grouping_whose_rows_do_not_fill_128_row_tiles_keeps_64_row_tiles(splits):
    """3 query heads per KV head: 192 rows per (item, split), which 128-row tiles would straddle."""
    g = torch.Generator().manual_seed(1)
    k, v = (torch.randn(KVH, CACHE_PAGES, 64, D, generator=g) for _ in "kv")
    q = torch.randn(len(LENGTHS), 3 * KVH, 64, D, generator=g)
    (out, lse), mask = attend(q, k, v, LENGTHS, splits, group=3)
    assert (mask.q_block, mask.tiles_per_share, mask.options["BLOCK_M"]) == (64, 3, 64)
    for i, n in enumerate(LENGTHS.tolist()):
        ref_out, ref_lse = reference(q, k, v, i, n)
        assert torch.allclose(out[i], ref_out, atol=1e-5), (i, (out[i] - ref_out).abs().max())
        assert torch.allclose(lse[i], ref_lse, atol=1e-4)


def test_the_engine_layouts_kernel_options_follow_the_tiles():
    """Packed 128-row tiles take 128-row kernel blocks on 8 warps; one unsplit item keeps 16-row
    blocks (more CTAs); a per-head or odd grouping keeps 64-row blocks."""
    assert PagedBlockMask(4, CACHE_PAGES, "cpu", 1, 8).options == PACKED_OPTIONS
    assert PagedBlockMask(1, CACHE_PAGES, "cpu", 8, 8).options == PACKED_OPTIONS
    assert PagedBlockMask(1, CACHE_PAGES, "cpu", 1, 8).options == SINGLE_TILE_OPTIONS
    assert PagedBlockMask(1, CACHE_PAGES, "cpu", 1, 1).options == SINGLE_TILE_OPTIONS
    assert PagedBlockMask(4, CACHE_PAGES, "cpu", 1, 1).options == KERNEL_OPTIONS
    assert PagedBlockMask(4, CACHE_PAGES, "cpu", 1, 3).options == KERNEL_OPTIONS
    assert PACKED_OPTIONS["BLOCK_M"] == MAX_Q_BLOCK


def test_an_item_without_pages_gives_zero_and_minus_infinity(tensors):
    """FlashBlock's reusing items visit no page at all."""
    q, k, v = tensors
    (out, lse), _ = attend(q, k, v, torch.tensor([0, 2, 0, 1]), splits=4)
    assert out[0].abs().max() == 0 and out[2].abs().max() == 0
    assert torch.isneginf(lse[0]).all() and torch.isneginf(lse[2]).all()
    assert torch.allclose(out[1], reference(q, k, v, 1, 2)[0], atol=1e-5)


def test_merge_of_splits_is_attention_over_the_union():
    g = torch.Generator().manual_seed(1)
    q, k, v = torch.randn(1, 16, 8, generator=g), torch.randn(1, 30, 8, generator=g), torch.randn(1, 30, 8, generator=g)
    parts = [(0, 7), (7, 7), (7, 30)]  # one share is empty
    outs, lses = [], []
    for a, b in parts:
        s = q @ k[:, a:b].transpose(-1, -2)
        lse = torch.logsumexp(s, -1)
        outs.append(torch.nan_to_num(torch.softmax(s, -1)) @ v[:, a:b] if b > a else torch.zeros(1, 16, 8))
        lses.append(lse)
    out, lse = merge_splits(torch.stack(outs, 1), torch.stack(lses, 1))
    whole = q @ k.transpose(-1, -2)
    assert torch.allclose(out, torch.softmax(whole, -1) @ v, atol=1e-6)
    assert torch.allclose(lse, torch.logsumexp(whole, -1), atol=1e-6)


def test_the_layout_reaches_the_compiler_as_constants_in_every_bucket_and_model(tensors):
    """One compiled forward serves every bucket (16-row kernel blocks for one unsplit item, 128 for
    packed tiles) and, in one process, every model (another grouping): Dynamo turns an int that
    changes between calls into a symbol unless it specializes it, and a symbolic BLOCK_M or grouping
    broke FlexAttention's lowering on the GPU. Each traced graph must carry its layout as plain ints:
    the kernel options, and the query's packed heads."""
    q, k, v = tensors
    seen: list[tuple[dict, tuple]] = []

    def record(gm: torch.fx.GraphModule, example_inputs):
        for node in gm.graph.nodes:
            if node.op == "call_function" and "flex_attention" in str(node.target):
                options = next(a for a in node.args if isinstance(a, dict) and "BLOCK_M" in a)
                seen.append((options, tuple(node.args[0].meta["example_value"].shape)))
        return gm.forward

    torch._dynamo.reset()
    attend = torch.compile(flex_paged_attention, backend=record)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        for group in (H // KVH, 2):  # two models' groupings: 2 and 4 packed sequences per item
            for n, splits in ((1, 1), (4, 1), (1, 8), (2, 4)):  # single tile, then packed
                mask = PagedBlockMask(n, CACHE_PAGES, "cpu", splits, group)
                mask.update(TABLE[:n], LENGTHS[:n])
                attend(q[:n], k, v, mask)
    torch._dynamo.reset()
    assert {o["BLOCK_M"] for o, _ in seen} == {SINGLE_TILE_OPTIONS["BLOCK_M"], PACKED_OPTIONS["BLOCK_M"]}
    assert all(type(x) is int for o, _ in seen for x in o.values() if not isinstance(x, (bool, str))), seen
    assert {shape[1] for _, shape in seen} == {H // 4, H // 2}, seen  # packed heads, never a symbol
