"""`cde::qkv_rope_write` (defined with its kernel in kernels/qkv_rope_triton.py): attention's input
stage as one op, for the compiled CUDA blocks, and when the model calls it.

From c_attn's output [N, T, (H + 2 KV) Dh] it does what `Attention.qkv` and `write_kv` do (clip,
QK RMSNorm, RoPE, k and v into the cache pages of `write_pages`) and returns q already packed for
FlexAttention (kernels/flex_paged_attention.py): [H / G, N, G, T, Dh], the G query heads of a
packed head together, so the attention reads it without a copy. The caches are mutated in place
(torch.compile keeps the op's mutation of its inputs in place: tests/kernels/test_qkv_rope.py).

The kernel is Triton: the engine calls the op on CUDA only; the CPU tests run it in Triton's
interpreter against the model's own torch path.
"""

from __future__ import annotations

import torch

try:
    from cde.kernels.qkv_rope_triton import qkv_rope_write
except ImportError:  # no Triton: the model keeps its torch path everywhere
    qkv_rope_write = None  # type: ignore[assignment]


def fused_input_stage(x: torch.Tensor, head_dim: int) -> bool:
    """Whether a pass over x runs the op: CUDA with Triton, and heads the kernel can tile."""
    return qkv_rope_write is not None and x.is_cuda and tileable_head(head_dim)


def tileable_head(head_dim: int) -> bool:
    """Head halves a power of two wide (a Triton block's width; every published Steerling head is 128)."""
    half = head_dim // 2
    return head_dim % 2 == 0 and half > 0 and half & (half - 1) == 0
