"""FlashBlock (arXiv 2602.05305): the active block's attention split in two and merged.

While a block is denoised, the pages before it never change, so its attention splits into
*external* (its queries over the cached pages) and *internal* (over its own 64 fresh keys). Each
part comes with its log-sum-exp, and the two merge exactly:

    A = (e^(L_out - m) A_out + e^(L_in - m) A_in) / (e^(L_out - m) + e^(L_in - m)),  m = max(L_out, L_in)

The external part (A_out, L_out) is cached per request slot and layer and may be reused by later
steps of the same block instead of being recomputed (the scheduler decides per item: see
worker/flashblock_policy.py). Items in ATTN_EXACT mode never touch the split or the cache.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from cde.shared.config import ATTN_EXACT, ATTN_REUSE


@dataclass
class FlashBlockBatch:
    """Per item of a forward pass (tensors on the cache's device)."""

    mode: torch.Tensor  # [N] int64 ATTN_*
    slot: torch.Tensor  # [N] int64 cache row read by REUSE items
    write_slot: torch.Tensor  # [N] int64 cache row written (the scratch row unless REFRESH)
    mode_host: list[int]  # the modes again, for the CPU loop


@dataclass
class FlashBlockSplit:
    """The same per item, on the host, as the model runner decides it (FlashBlockBatch is its
    device form; CUDA graphs pack it into their input buffer instead)."""

    modes: list[int]  # ATTN_*
    slots: list[int]  # cache row read by REUSE items (the scratch row for exact items)
    writes: list[int]  # cache row written (the scratch row unless REFRESH)

    def to_device(self, device: torch.device | str) -> FlashBlockBatch:
        def tensor(xs: list[int]) -> torch.Tensor:
            return torch.tensor(xs, device=device)

        return FlashBlockBatch(tensor(self.modes), tensor(self.slots), tensor(self.writes), self.modes)


def attention_lse(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Dense attention with its log-sum-exp, fp32 math. q [..., H, T, D]; k/v [..., KVH, S, D]
    (GQA: query heads grouped onto their KV head without repeating K/V). Returns the output
    [..., H, T, D] in q's dtype and the lse [..., H, T] in fp32; S = 0 gives 0 and -inf."""
    *lead, h, t, d = q.shape
    kvh = k.shape[-3]
    qg = q.float().reshape(*lead, kvh, (h // kvh) * t, d)
    scores = qg @ k.float().transpose(-1, -2) * d**-0.5  # [..., KVH, G*T, S]
    lse = torch.logsumexp(scores, dim=-1, keepdim=True)
    probs = torch.exp(scores - lse).nan_to_num(0.0)  # an empty key set: -inf - -inf
    out = probs @ v.float()
    return out.reshape(*lead, h, t, d).to(q.dtype), lse.reshape(*lead, h, t)


def merge(a_out: torch.Tensor, l_out: torch.Tensor, a_in: torch.Tensor, l_in: torch.Tensor) -> torch.Tensor:
    """The log-space merge of two partial attentions over disjoint key sets (fp32 math)."""
    m = torch.maximum(l_out, l_in)
    w_out, w_in = torch.exp(l_out - m)[..., None], torch.exp(l_in - m)[..., None]
    return ((w_out * a_out.float() + w_in * a_in.float()) / (w_out + w_in)).to(a_in.dtype)


def external_pages(n_pages: torch.Tensor, mode: torch.Tensor) -> torch.Tensor:
    """Pages each item's attention kernel must visit: all of them for exact items, all but its
    own (the last) for split items, none when the external part is reused."""
    return torch.where(mode == ATTN_EXACT, n_pages, torch.where(mode == ATTN_REUSE, 0, n_pages - 1))


def split_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    external: torch.Tensor,
    external_lse: torch.Tensor,
    cache: tuple[torch.Tensor, ...],
    fb: FlashBlockBatch,
) -> torch.Tensor:
    """Batched (CUDA graph friendly) FlashBlock step. q [N, H, 64, D]; k/v [N, KVH, 64, D] the
    items' own keys; `external`/`external_lse` the paged kernel's output over `external_pages`
    (the whole attention for exact items). cache = (A [slots, H, 64, D], L [slots, H, 64])."""
    a_cache, l_cache = cache
    reuse = (fb.mode == ATTN_REUSE)[:, None, None]
    l_ext = torch.where(reuse, l_cache[fb.slot], external_lse)
    a_ext = torch.where(reuse[..., None], a_cache[fb.slot], external)
    a_cache.index_copy_(0, fb.write_slot, a_ext)
    l_cache.index_copy_(0, fb.write_slot, l_ext)
    a_in, l_in = attention_lse(q, k, v)
    exact = (fb.mode == ATTN_EXACT)[:, None, None, None]
    return torch.where(exact, external, merge(a_ext, l_ext, a_in, l_in))


def split_attention_item(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    k_ext: torch.Tensor,
    v_ext: torch.Tensor,
    cache: tuple[torch.Tensor, ...],
    slot: int,
    mode: int,
) -> torch.Tensor:
    """One item on the CPU path (no padding, no batch-wide work): q [H, 64, D]; k/v its own
    keys [KVH, 64, D]; k_ext/v_ext its external pages [KVH, S, D] (unused when reusing)."""
    a_cache, l_cache = cache
    if mode == ATTN_REUSE:
        a_ext, l_ext = a_cache[slot], l_cache[slot]
    else:
        a_ext, l_ext = attention_lse(q, k_ext, v_ext)
        a_cache[slot], l_cache[slot] = a_ext, l_ext
    a_in, l_in = attention_lse(q, k, v)
    return merge(a_ext, l_ext, a_in, l_in)
