"""Paged block-causal attention with FlexAttention (the CUDA path).

The whole KV cache of a layer is one key sequence of num_pages * 64 tokens ([1, KVH, P*64, Dh],
a view of the [KVH, P, 64, Dh] cache) and the queries of a pass are N items of 64 tokens. The
BlockMask is built straight from the page table: query tile i visits exactly the pages
page_table[i, :n_pages[i]], all of them as *full* blocks, so no mask function is ever evaluated
and no partial tile exists (tile = diffusion block = page = 64). GQA is native (enable_gqa):
K/V are never repeated per query head.
"""

from __future__ import annotations

import torch
from torch.nn.attention.flex_attention import BlockMask, flex_attention

from shared.config import PAGE

# FORCE_USE_FLEX_ATTENTION: a single item's 64 queries are few enough for FlexAttention to pick
# its split-KV decoding kernel, which (with its separate reduction) ran 6x slower per layer on an
# H200 than the plain kernel at batch 1 (67 vs 11 us over 5 pages, 343 vs 88 us over 64 pages).
KERNEL_OPTIONS = {"BLOCK_M": PAGE, "BLOCK_N": PAGE, "FORCE_USE_FLEX_ATTENTION": True}


class PagedBlockMask:
    """A BlockMask over N query tiles whose tensors are updated in place from the page table,
    so a captured CUDA graph sees every step's pages without being rebuilt."""

    def __init__(self, n: int, cache_pages: int, device):
        self.n, self.cache_pages = n, cache_pages
        self.full_num = torch.zeros(1, 1, n, dtype=torch.int32, device=device)
        # BlockMask wants index rows as wide as the key sequence has blocks.
        self.full_idx = torch.zeros(1, 1, n, cache_pages, dtype=torch.int32, device=device)
        self.allowed = torch.zeros(n, cache_pages, dtype=torch.bool, device=device)
        allowed = self.allowed

        # The mask function states the same visibility for paths that evaluate it densely (eager,
        # CPU); the CUDA kernel never calls it, since every listed block is a full block.
        def page_visible(b, h, q_idx, kv_idx):
            return allowed[q_idx // PAGE, kv_idx // PAGE]

        self.block_mask = BlockMask.from_kv_blocks(
            torch.zeros(1, 1, n, dtype=torch.int32, device=device),
            torch.zeros(1, 1, n, cache_pages, dtype=torch.int32, device=device),
            full_kv_num_blocks=self.full_num,
            full_kv_indices=self.full_idx,
            BLOCK_SIZE=PAGE,
            mask_mod=page_visible,
            seq_lengths=(n * PAGE, cache_pages * PAGE),
            compute_q_blocks=False,
        )

    def update(self, page_table: torch.Tensor, n_pages: torch.Tensor) -> None:
        """page_table [N, W] page ids (entries past n_pages[i] are ignored), n_pages [N]."""
        width = page_table.shape[1]
        self.full_num.copy_(n_pages.view(1, 1, -1))
        self.full_idx[0, 0, :, :width].copy_(page_table)
        visible = torch.arange(width, device=page_table.device)[None, :] < n_pages[:, None]
        hits = torch.zeros(self.n, self.cache_pages, dtype=torch.int32, device=page_table.device)
        hits.scatter_add_(1, page_table.long(), visible.to(torch.int32))  # padding may repeat a page id
        torch.gt(hits, 0, out=self.allowed)


def flex_paged_attention(q, k_cache, v_cache, block_mask: BlockMask, return_lse: bool = False):
    """q [N, H, 64, Dh]; caches [KVH, P, 64, Dh] -> [N, H, 64, Dh] (and the log-sum-exp
    [N, H, 64] in fp32 when asked; a tile with no pages gives 0 and -inf)."""
    n, h, t, d = q.shape
    kvh, p = k_cache.shape[:2]
    qf = q.transpose(0, 1).reshape(1, h, n * t, d)
    out = flex_attention(
        qf, k_cache.view(1, kvh, p * t, d), v_cache.view(1, kvh, p * t, d),
        block_mask=block_mask, enable_gqa=True, kernel_options=KERNEL_OPTIONS, return_lse=return_lse,
    )
    if not return_lse:
        return out.reshape(h, n, t, d).transpose(0, 1)
    out, lse = out
    return out.reshape(h, n, t, d).transpose(0, 1), lse.reshape(h, n, t).transpose(0, 1)
