"""The attention's input stage on CUDA as one op, `cde::qkv_rope_write`, and its Triton kernel
(kernels/qkv_rope.py says when the model calls it): from the c_attn output, clip, RMS-normalize
each q and k head, rotate them (RoPE), write q in FlexAttention's packed layout and k, v into their
cache pages.

Compiled, the same work was three kernels per layer (q; k with its cache write; v's cache write),
the q kernel at about 1.2 TB/s at 2,048 rows (docs/benchmarks.md): here each program reads one
head of 16 rows once and writes it once where it goes.

Imported where Triton is installed (CUDA machines; the CPU tests run it in Triton's interpreter).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

ROWS = 16  # rows of one item per program: 64-row items split evenly, 4 KB of bfloat16 per head


@triton.jit
def _qkv_rope_kernel(
    qkv_ptr,
    qw_ptr,
    kw_ptr,
    cos_ptr,
    sin_ptr,
    q_ptr,
    k_ptr,
    v_ptr,
    pages_ptr,
    n_items,
    cache_pages,
    clip,
    eps,
    N_HEAD: tl.constexpr,
    N_KV: tl.constexpr,
    GROUP: tl.constexpr,
    T: tl.constexpr,
    HALF: tl.constexpr,
    ROWS: tl.constexpr,
    CLIP: tl.constexpr,
    NORM: tl.constexpr,
):
    D: tl.constexpr = 2 * HALF
    row0 = tl.program_id(0).to(tl.int64) * ROWS  # first row of this program, over all items' rows
    head = tl.program_id(1)  # q heads, then k heads, then v heads (c_attn's output order)
    item = row0 // T
    t = row0 % T + tl.arange(0, ROWS)[:, None]  # [ROWS, 1] positions within the item
    cols = tl.arange(0, HALF)[None, :]  # [1, HALF]
    src = qkv_ptr + (item * T + t) * ((N_HEAD + 2 * N_KV) * D) + head * D + cols
    lo = tl.load(src).to(tl.float32)
    hi = tl.load(src + HALF).to(tl.float32)
    if CLIP:
        lo = tl.minimum(tl.maximum(lo, -clip), clip)
        hi = tl.minimum(tl.maximum(hi, -clip), clip)
    dtype = q_ptr.dtype.element_ty
    if head >= N_HEAD + N_KV:  # v: clipped, stored as it is
        dst = v_ptr + ((head - N_HEAD - N_KV) * cache_pages + tl.load(pages_ptr + item)) * (T * D) + t * D + cols
        tl.store(dst, lo.to(dtype))
        tl.store(dst + HALF, hi.to(dtype))
    else:
        is_q = head < N_HEAD
        if NORM:  # RMSNorm in float32, its weight times the normalized row rounded like the model's
            inv = tl.math.rsqrt((tl.sum(lo * lo, axis=1) + tl.sum(hi * hi, axis=1))[:, None] / D + eps)
            if is_q:
                w_lo, w_hi = tl.load(qw_ptr + cols), tl.load(qw_ptr + HALF + cols)
            else:
                w_lo, w_hi = tl.load(kw_ptr + cols), tl.load(kw_ptr + HALF + cols)
            lo = (w_lo.to(tl.float32) * (lo * inv)).to(dtype).to(tl.float32)
            hi = (w_hi.to(tl.float32) * (hi * inv)).to(dtype).to(tl.float32)
        rope = (item * T + t) * D + cols  # the tables hold each row's angles [D] in float32
        cos_lo, cos_hi = tl.load(cos_ptr + rope), tl.load(cos_ptr + rope + HALF)
        sin_lo, sin_hi = tl.load(sin_ptr + rope), tl.load(sin_ptr + rope + HALF)
        out_lo = lo * cos_lo - hi * sin_lo  # t * cos + cat(-t_hi, t_lo) * sin
        out_hi = hi * cos_hi + lo * sin_hi
        if is_q:  # packed: [N_HEAD // GROUP, items, GROUP, T, D]
            packed = (head // GROUP * n_items + item) * GROUP + head % GROUP
            dst = q_ptr + packed * (T * D) + t * D + cols
        else:
            dst = k_ptr + ((head - N_HEAD) * cache_pages + tl.load(pages_ptr + item)) * (T * D) + t * D + cols
        tl.store(dst, out_lo.to(dtype))
        tl.store(dst + HALF, out_hi.to(dtype))


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
    n, t, _ = qkv.shape
    n_kv, cache_pages, _, d = k_cache.shape
    q = torch.empty(n_head // group, n, group, t, d, dtype=qkv.dtype, device=qkv.device)
    norm = q_weight is not None and k_weight is not None
    _qkv_rope_kernel[(n * t // ROWS, n_head + 2 * n_kv)](
        qkv.contiguous(),
        q_weight if norm else qkv,  # unread without the norm
        k_weight if norm else qkv,
        cos.contiguous(),
        sin.contiguous(),
        q,
        k_cache,
        v_cache,
        write_pages,
        n,
        cache_pages,
        0.0 if clip is None else clip,
        eps,
        N_HEAD=n_head,
        N_KV=n_kv,
        GROUP=group,
        T=t,
        HALF=d // 2,
        ROWS=ROWS,
        CLIP=clip is not None,
        NORM=norm,
        num_warps=4,
    )
    return q


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
