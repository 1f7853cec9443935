"""Paged block-causal attention with FlexAttention (the CUDA path).

The whole KV cache of a layer is one key sequence of num_pages * 64 tokens ([1, KVH, P*64, Dh],
a view of the [KVH, P, 64, Dh] cache) and the queries of a pass are N items of 64 tokens. The
BlockMask is built straight from the page table: a query tile of item i visits exactly the pages
page_table[i, :n_pages[i]], all of them as *full* blocks, so no mask function is ever evaluated
and no partial tile exists (key tile = diffusion block = page = 64).

GQA packing (`group` G > 1): the G query heads that share a KV head are stacked into one query
sequence of G * 64 rows per item, so one tile of 128 rows reads each key page once for two heads
(and does its matrix products on twice the rows) instead of once per head.

Split-KV (`splits` S > 1): a few items over many pages leave most SMs idle, so each item's query
rows are repeated S times, copy s visits the s-th contiguous share of its pages, and the S partial
results merge by log-sum-exp: the same attention, S times the parallelism.
"""

from __future__ import annotations

from typing import Any, NamedTuple

import torch
from cde.shared.config import PAGE
from torch.nn.attention.flex_attention import BlockMask, flex_attention

# FORCE_USE_FLEX_ATTENTION: a single item's 64 queries are few enough for FlexAttention to pick
# its split-KV decoding kernel, which (with its separate reduction) ran 6x slower per layer on an
# H200 than the plain kernel at batch 1 (67 vs 11 us over 5 pages, 343 vs 88 us over 64 pages).
KERNEL_OPTIONS = {"BLOCK_M": PAGE, "BLOCK_N": PAGE, "FORCE_USE_FLEX_ATTENTION": True}
# A pass of one query tile (batch 1, unsplit): 16-row tiles on 2 warps give 4x the CTAs, 9.0 vs
# 11.1 us over 5 pages and 66.5 vs 88.3 us over 64 (they lose from batch 4 on: 149 vs 103 us).
SINGLE_TILE_OPTIONS = {**KERNEL_OPTIONS, "BLOCK_M": 16, "num_warps": 2}
MAX_Q_BLOCK = 2 * PAGE  # rows of one query tile of the block mask when heads are packed
# GQA-packed 128-row tiles on 8 warps: on an H200 (2026-12-02, scripts/flex_kernel_options.py, the
# 8b's 32 heads over 4 KV heads, us per layer) they beat the per-head layout at every batch but one
# unsplit item: 359 vs 787 over 2,048 pages at batch 1 split 8 (SDPA flash over contiguous KV of the
# same size: 513), 2,715 vs 6,105 at batch 8 (cuDNN: 3,745), 380 vs 799 for 32 items over 64 pages;
# one item over 64 pages unsplit: 102 vs 88 (per head on 16-row tiles). One unsplit item keeps the
# 16-row tiles, packed too, so a model's grouping never changes between its passes.
PACKED_OPTIONS = {**KERNEL_OPTIONS, "BLOCK_M": MAX_Q_BLOCK, "num_warps": 8}


class Layout(NamedTuple):
    """What the compiled forward must see as constants: the query heads packed per KV head and the
    FlexAttention kernel options."""

    group: int
    options: dict[str, Any]


# Every layout by name, read from this global table inside the compiled forward: Dynamo specializes
# the ints it reads from a global, whereas ints read off the mask (a frame input) become symbols once
# two calls differ (two buckets' kernel options, or two models' groupings in one process), and a
# symbolic BLOCK_M or grouping broke FlexAttention's lowering (H200, torch 2.11, the tiny model after
# the small one: "unsupported operand type(s) for &: 'floor' and 'Add'").
LAYOUTS: dict[str, Layout] = {}


def layout_key(group: int, options: dict[str, Any]) -> str:
    """The name of this layout in LAYOUTS (registered on first use)."""
    key = repr((group, sorted(options.items())))
    LAYOUTS.setdefault(key, Layout(group, dict(options)))
    return key


class PagedBlockMask:
    """A BlockMask over N items' query rows (split S ways, G heads packed per KV head) whose
    tensors are updated in place from the page table, so a captured CUDA graph sees every step's
    pages without being rebuilt. `options`: FlexAttention kernel options for this layout."""

    @property
    def group(self) -> int:
        return LAYOUTS[self.layout].group

    @property
    def options(self) -> dict[str, Any]:
        return LAYOUTS[self.layout].options

    def __init__(
        self,
        n: int,
        cache_pages: int,
        device: torch.device | str,
        splits: int = 1,
        group: int = 1,
        options: dict[str, Any] | None = None,
    ) -> None:
        self.n, self.cache_pages, self.splits = n, cache_pages, splits
        self.rows = group * PAGE  # query rows of one (item, split) in one packed head
        # A query tile never straddles two (item, split) sequences: 128 rows where they divide its rows.
        self.q_block = MAX_Q_BLOCK if self.rows % MAX_Q_BLOCK == 0 else PAGE
        self.tiles_per_share = self.rows // self.q_block
        if options is None:  # the engine's layouts (above)
            packed = self.q_block == MAX_Q_BLOCK
            options = SINGLE_TILE_OPTIONS if n * splits == 1 else PACKED_OPTIONS if packed else KERNEL_OPTIONS
        self.layout = layout_key(group, options)
        tiles = n * splits * self.tiles_per_share
        self.full_num = torch.zeros(1, 1, tiles, dtype=torch.int32, device=device)
        # BlockMask wants index rows as wide as the key sequence has blocks.
        self.full_idx = torch.zeros(1, 1, tiles, cache_pages, dtype=torch.int32, device=device)
        self.allowed = torch.zeros(n * splits, cache_pages, dtype=torch.bool, device=device)
        allowed, rows = self.allowed, self.rows

        # The mask function states the same visibility for paths that evaluate it densely (eager,
        # CPU); the CUDA kernel never calls it, since every listed block is a full block.
        def page_visible(b: torch.Tensor, h: torch.Tensor, q_idx: torch.Tensor, kv_idx: torch.Tensor) -> torch.Tensor:
            return allowed[q_idx // rows, kv_idx // PAGE]

        self.block_mask = BlockMask.from_kv_blocks(
            torch.zeros(1, 1, tiles, dtype=torch.int32, device=device),
            torch.zeros(1, 1, tiles, cache_pages, dtype=torch.int32, device=device),
            full_kv_num_blocks=self.full_num,
            full_kv_indices=self.full_idx,
            BLOCK_SIZE=(self.q_block, PAGE),
            mask_mod=page_visible,
            seq_lengths=(n * splits * self.rows, cache_pages * PAGE),
            compute_q_blocks=False,
        )

    def update(self, page_table: torch.Tensor, n_pages: torch.Tensor) -> None:
        """page_table [N, W] page ids (entries past n_pages[i] are ignored), n_pages [N]."""
        n, width = page_table.shape
        dev, s = page_table.device, self.splits
        # Share (i, j) takes pages [j * share_i, (j + 1) * share_i) of item i (none past its end).
        share = (n_pages + s - 1) // s
        start = share[:, None] * torch.arange(s, device=dev)
        count = torch.minimum((n_pages[:, None] - start).clamp(min=0), share[:, None])  # [N, S]
        cols = (start[:, :, None] + torch.arange(width, device=dev)).clamp(max=width - 1)
        pages = page_table.gather(1, cols.view(n, s * width)).view(n * s, width)
        per = self.tiles_per_share  # the query tiles of one share all visit its pages
        self.full_num.copy_(count.view(1, 1, -1).repeat_interleave(per, dim=2))
        self.full_idx[0, 0, :, :width].copy_(pages.repeat_interleave(per, dim=0))
        visible = torch.arange(width, device=dev)[None, :] < count.view(-1, 1)
        hits = torch.zeros(n * s, self.cache_pages, dtype=torch.int32, device=dev)
        hits.scatter_add_(1, pages.long(), visible.to(torch.int32))  # padding may repeat a page id
        torch.gt(hits, 0, out=self.allowed)


def flex_paged_attention(
    q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, mask: PagedBlockMask, return_lse: bool = False
) -> Any:
    """q [N, H, 64, Dh], or already packed [H / G, N, G, 64, Dh] (kernels/qkv_rope.py writes it so);
    caches [KVH, P, 64, Dh] -> [N, H, 64, Dh] (and the log-sum-exp [N, H, 64] in fp32 when asked;
    an item with no pages gives 0 and -inf)."""
    layout = LAYOUTS[mask.layout]
    s, g = mask.splits, layout.group
    kvh, p = k_cache.shape[:2]
    shape = tuple(q.shape)
    if q.dim() == 4 and q.shape[1] % g == 0:
        q = q.unflatten(1, (-1, g)).transpose(0, 1)  # packed: [H / G, N, G, 64, Dh]
    if q.dim() != 5 or q.shape[2] != g or q.shape[1] != mask.n or q.shape[0] % kvh:
        raise ValueError(f"a block mask of {mask.n} items x {g} packed heads does not fit q {shape}")
    heads, n, _, t, d = q.shape
    h = heads * g
    # Query sequences (KV heads when fully packed), each its items' shares of G heads x 64 rows.
    qf = q[:, :, None].expand(heads, n, s, g, t, d).reshape(1, heads, n * s * g * t, d)
    need_lse = return_lse or s > 1
    res = flex_attention(
        qf,
        k_cache.view(1, kvh, p * t, d),
        v_cache.view(1, kvh, p * t, d),
        block_mask=mask.block_mask,
        enable_gqa=heads != kvh,
        return_lse=need_lse,
        kernel_options=layout.options,
    )
    out, lse = res if need_lse else (res, None)
    out = out.view(heads, n, s, g, t, d).permute(1, 2, 0, 3, 4, 5).reshape(n, s, h, t, d)
    if lse is None:
        return out[:, 0]
    lse = lse.view(heads, n, s, g, t).permute(1, 2, 0, 3, 4).reshape(n, s, h, t)
    out, lse = merge_splits(out, lse) if s > 1 else (out[:, 0], lse[:, 0])
    return (out, lse) if return_lse else out


def merge_splits(out: torch.Tensor, lse: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Partial attentions over disjoint key shares [N, S, H, T, D] with their log-sum-exps
    [N, S, H, T] -> the attention over all of them, and its log-sum-exp (fp32 math). Shares
    without keys weigh nothing; an item with no keys at all gives 0 and -inf."""
    top = lse.amax(dim=1, keepdim=True)
    top = torch.where(torch.isinf(top), torch.zeros_like(top), top)
    w = torch.exp(lse - top)
    total = w.sum(dim=1)
    merged = (w[..., None] * out.float()).sum(dim=1) / total.clamp(min=torch.finfo(torch.float32).tiny)[..., None]
    return merged.to(out.dtype), top[:, 0] + torch.log(total)
