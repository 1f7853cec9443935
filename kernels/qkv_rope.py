"""`cde::qkv_rope_write`: attention's input stage as one op, for the compiled CUDA blocks.

From c_attn's output [N, T, (H + 2 KV) Dh] it does what `Attention.qkv` and `write_kv` do (clip,
QK RMSNorm, RoPE, k and v into the cache pages of `write_pages`) and returns q already packed for
FlexAttention (kernels/flex_paged_attention.py): [H / G, N, G, T, Dh], the G query heads of a
packed head together, so the attention reads it without a copy. The caches are mutated in place
(torch.compile keeps the op's mutation of its inputs in place: tests/kernels/test_qkv_rope.py).

The kernel is Triton (kernels/qkv_rope_triton.py): the engine calls the op on CUDA only; the CPU
tests run it in Triton's interpreter against the model's own torch path.
"""

from __future__ import annotations

import torch

try:
    from cde.kernels import qkv_rope_triton
except ImportError:  # no Triton: the model keeps its torch path everywhere
    qkv_rope_triton = None  # type: ignore[assignment]


def fused_input_stage(x: torch.Tensor, head_dim: int) -> bool:
    """Whether a pass over x runs the op: CUDA with Triton, and heads the kernel can tile."""
    return qkv_rope_triton is not None and x.is_cuda and tileable_head(head_dim)


def tileable_head(head_dim: int) -> bool:
    """Head halves a power of two wide (a Triton block's width; every published Steerling head is 128)."""
    half = head_dim // 2
    return head_dim % 2 == 0 and half > 0 and half & (half - 1) == 0


@torch.library.custom_op("cde::qkv_rope_write", mutates_args=("k_cache", "v_cache"))
def qkv_rope_write(
    qkv: torch.Tensor,
    q_weight: torch.Tensor | None,
    k_weight: torch.Tensor | None,
    cos: torch.Tensor,
    sin: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    write_pages: torch.Tensor,
    clip: float | None,
    eps: float,
    n_head: int,
    group: int,
) -> torch.Tensor:
    """qkv [N, T, C]; q/k_weight [Dh] (None: no QK norm); cos/sin [N, T, Dh] float32; caches
    [KV, P, T, Dh]; write_pages [N] -> q [H / group, N, group, T, Dh]."""
    if qkv_rope_triton is None:
        raise RuntimeError("cde::qkv_rope_write needs Triton")
    return qkv_rope_triton.qkv_rope_write(
        qkv, q_weight, k_weight, cos, sin, k_cache, v_cache, write_pages, clip, eps, n_head, group
    )


@qkv_rope_write.register_fake
def _(
    qkv: torch.Tensor,
    q_weight: torch.Tensor | None,
    k_weight: torch.Tensor | None,
    cos: torch.Tensor,
    sin: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    write_pages: torch.Tensor,
    clip: float | None,
    eps: float,
    n_head: int,
    group: int,
) -> torch.Tensor:
    n, t, _ = qkv.shape
    return qkv.new_empty(n_head // group, n, group, t, k_cache.shape[-1])
