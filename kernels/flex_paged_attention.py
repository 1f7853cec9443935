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

KERNEL_OPTIONS = {"BLOCK_M": PAGE, "BLOCK_N": PAGE}


def paged_block_mask(page_table: torch.Tensor, n_pages: torch.Tensor, cache_pages: int) -> BlockMask:
    """page_table [N, W] (page ids, padding ignored past n_pages), n_pages [N]. BlockMask wants
    the index rows as wide as the key sequence has blocks, so the table is padded to cache_pages."""
    n, width = page_table.shape
    dev = page_table.device
    indices = torch.zeros(1, 1, n, cache_pages, dtype=torch.int32, device=dev)
    indices[0, 0, :, :width] = page_table
    # The mask function states the same visibility for paths that evaluate it densely (eager,
    # CPU); the CUDA kernel never calls it, since every listed block is a full block.
    visible = torch.arange(width, device=dev)[None, :] < n_pages[:, None]
    hits = torch.zeros(n, cache_pages, dtype=torch.int32, device=dev)
    allowed = hits.scatter_add_(1, page_table.long(), visible.to(torch.int32)) > 0  # padding may repeat a page id

    def page_visible(b, h, q_idx, kv_idx):
        return allowed[q_idx // PAGE, kv_idx // PAGE]

    return BlockMask.from_kv_blocks(
        torch.zeros(1, 1, n, dtype=torch.int32, device=dev),
        torch.zeros(1, 1, n, cache_pages, dtype=torch.int32, device=dev),
        full_kv_num_blocks=n_pages.to(torch.int32)[None, None],
        full_kv_indices=indices,
        BLOCK_SIZE=PAGE,
        mask_mod=page_visible,
        seq_lengths=(n * PAGE, cache_pages * PAGE),
        compute_q_blocks=False,
    )


def flex_paged_attention(q, k_cache, v_cache, block_mask: BlockMask):
    """q [N, H, 64, Dh]; caches [KVH, P, 64, Dh] -> [N, H, 64, Dh]."""
    n, h, t, d = q.shape
    kvh, p = k_cache.shape[:2]
    qf = q.transpose(0, 1).reshape(1, h, n * t, d)
    out = flex_attention(
        qf, k_cache.view(1, kvh, p * t, d), v_cache.view(1, kvh, p * t, d),
        block_mask=block_mask, enable_gqa=True, kernel_options=KERNEL_OPTIONS,
    )
    return out.reshape(h, n, t, d).transpose(0, 1)
