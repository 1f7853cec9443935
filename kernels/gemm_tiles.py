"""Triton helpers the weight-streaming GEMMs share (kernels/stream_gemm.py's split-K kernel and
kernels/stream_k.py's stream-K kernel): the weight tiles' L2 prefetch before `gdc_wait`, and the
output tile's store with its row and channel scales."""

import triton
import triton.language as tl


@triton.jit
def prefetch_l2(ptrs, mask, base):
    # PTX prefetch to L2; the masked-off lines are clamped to the weight's first, which exists
    ptrs = tl.where(mask, ptrs, base)
    tl.inline_asm_elementwise("prefetch.global.L2 [$1]; // dummy $0", "=r,l", [ptrs], tl.int32, is_pure=False, pack=1)


@triton.jit
def prefetch_weight_tiles(b_ptr, offs_n, N, stride_bn, k_first, count, BLOCK_K: tl.constexpr, TILES: tl.constexpr):
    # The first TILES of the `count` weight tiles from K tile k_first on, rows offs_n, to L2: one
    # prefetch per 64 elements of a row (a 128-byte line holds 64 bfloat16 or 128 e4m3).
    lines = offs_n[:, None] * stride_bn + k_first * BLOCK_K + tl.arange(0, BLOCK_K // 64)[None, :] * 64
    for t in tl.static_range(TILES):
        prefetch_l2(b_ptr + lines + t * BLOCK_K, (offs_n[:, None] < N) & (t < count), b_ptr)


@triton.jit
def store_tile(
    acc, c_ptr, sa_ptr, sb_ptr, offs_m, offs_n, M, N, stride_cm, SCALE_A: tl.constexpr, SCALE_B: tl.constexpr
):
    if SCALE_A:
        sa = tl.load(sa_ptr + offs_m, mask=offs_m < M, other=0.0)
        acc = acc * sa[:, None]
    if SCALE_B:
        sb = tl.load(sb_ptr + offs_n, mask=offs_n < N, other=0.0)
        acc = acc * sb[None, :]
    c_ptrs = c_ptr + offs_m[:, None] * stride_cm + offs_n[None, :]
    tl.store(c_ptrs, acc.to(c_ptr.dtype.element_ty), mask=(offs_m[:, None] < M) & (offs_n[None, :] < N))
