"""Block-causal attention over a paged KV cache.

Layout (shared with the FlexAttention kernel): per layer, K and V are each a tensor
[KVH, num_pages, 64, Dh]; a page holds one 64-token diffusion block of one request. A forward
pass is a list of *items* (one 64-token block each). Item i first writes its fresh K/V into
`write_pages[i]`, then attends over `page_table[i, :n_pages[i]]`: its request's pages for blocks
0..b_i, its own page last. Because attention tile = diffusion block = page, every tile is fully
visible or fully hidden: block-causality needs no mask inside a tile.

Writing before reading in every layer is what lets one pass hold a request's prefill blocks, the
commit of a finished block and the first step of the next block: each sees the pages before it.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from cde.kernels.flashblock import FlashBlockBatch, split_attention, split_attention_item
from cde.kernels.flex_paged_attention import PagedBlockMask, flex_paged_attention
from cde.shared.config import ATTN_EXACT, PAGE


@dataclass
class PagedBatch:
    """Attention metadata for one forward pass (tensors on the cache's device)."""

    write_pages: torch.Tensor  # [N] int64
    page_table: torch.Tensor  # [N, max_pages] int64, padded with 0
    n_pages: torch.Tensor  # [N] int64
    n_pages_host: list[int]  # the same, on the host, for the CPU loop
    block_mask: PagedBlockMask | None = None  # set on CUDA: FlexAttention over the pages
    flashblock: FlashBlockBatch | None = None  # set when some item splits its attention


def paged_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cache: tuple, meta: PagedBatch) -> torch.Tensor:
    """q [N, H, 64, Dh], k/v [N, KVH, 64, Dh] of this pass; cache = (K, V) [KVH, P, 64, Dh],
    followed by FlashBlock's (A, L) rows when the pass splits attention."""
    k_cache, v_cache = cache[0], cache[1]
    write_kv(k_cache, k, meta.write_pages)
    write_kv(v_cache, v, meta.write_pages)
    fb = meta.flashblock
    if meta.block_mask is None:
        return sdpa_paged_attention(q, cache, meta, fresh=(k, v))
    if fb is None:
        return flex_paged_attention(q, k_cache, v_cache, meta.block_mask)
    # The block mask already leaves out what split items take elsewhere (see external_pages).
    external, lse = flex_paged_attention(q, k_cache, v_cache, meta.block_mask, return_lse=True)
    return split_attention(q, k, v, external, lse, cache[2:], fb)


def write_kv(cache: torch.Tensor, new: torch.Tensor, write_pages: torch.Tensor) -> None:
    """cache: [KVH, P, 64, Dh]; new: [N, KVH, 64, Dh]."""
    cache.index_copy_(1, write_pages, new.transpose(0, 1).to(cache.dtype))


def gather_pages(cache: torch.Tensor, pages: torch.Tensor) -> torch.Tensor:
    """[KVH, P, 64, Dh] -> [KVH, len(pages) * 64, Dh] for one item."""
    kvh, _, _page, dh = cache.shape
    return cache.index_select(1, pages).reshape(kvh, -1, dh)


def sdpa_paged_attention(
    q: torch.Tensor, cache: tuple, batch: PagedBatch, fresh: tuple[torch.Tensor, torch.Tensor] | None = None
) -> torch.Tensor:
    """CPU / fallback path: one SDPA call per item over exactly its pages, so an item's result
    never depends on what else is in the batch (no padding, no shared reductions). Split items
    (FlashBlock) attend to their cached pages and to their own `fresh` (k, v) separately."""
    k_cache, v_cache = cache[0], cache[1]
    fb = batch.flashblock
    out = torch.empty_like(q)
    for i, n in enumerate(batch.n_pages_host):
        mode = fb.mode_host[i] if fb is not None else ATTN_EXACT
        pages = batch.page_table[i, : n if mode == ATTN_EXACT else n - 1]
        k_seen = gather_pages(k_cache, pages)
        v_seen = gather_pages(v_cache, pages)
        if mode == ATTN_EXACT:
            out[i] = F.scaled_dot_product_attention(q[i : i + 1], k_seen[None], v_seen[None], enable_gqa=True)[0]
        else:
            out[i] = split_attention_item(
                q[i], fresh[0][i], fresh[1][i], k_seen, v_seen, cache[2:], int(fb.slot[i]), mode
            )
    return out


def dense_block_causal_reference(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, block: int = PAGE) -> torch.Tensor:
    """Ground truth for tests: full-sequence block-causal attention. q: [B, H, T, D], k/v: [B, KVH, T, D]."""
    t = q.shape[-2]
    idx = torch.arange(t, device=q.device)
    allowed = (idx[:, None] // block) >= (idx[None, :] // block)
    return F.scaled_dot_product_attention(q, k, v, attn_mask=allowed, enable_gqa=True)
