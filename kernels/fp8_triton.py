"""Triton kernels of the FP8 path on CUDA (`worker/fp8.py` calls them through `kernels/fp8_ops.py`).

- `fp8_gemm`: out = (xq @ wq.T) * x_scale * w_scale for few rows. cuBLAS's FP8 GEMM reads the
  weights at about half the memory bandwidth at 64-256 rows (one request is 64 rows), where the
  pass is bound by that read; this one streams each weight slab once with a deep pipeline over
  narrow output tiles, so that enough tiles keep every SM busy.
- `silu_mul_quantize`: the MLP's `silu(gate) * up` quantized per row to e4m3, in one kernel that
  reads the up/gate row once (compiled, it was two kernels that each read it and recomputed the
  product: 145 us per layer at 2048 rows on the H200).

Imported only on CUDA (Triton is not installed in CPU environments).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

# Globals a @triton.jit function reads must be constexpr (the same values as worker/fp8.py's).
E4M3_MAX = tl.constexpr(448.0)
MIN_SCALE = tl.constexpr(1e-12)


def _gemm_configs() -> list:
    return [
        triton.Config({"BLOCK_M": 64, "BLOCK_N": bn, "BLOCK_K": bk}, num_warps=4, num_stages=stages)
        for bn in (32, 64, 128)
        for bk in (128, 256)
        for stages in (4, 6)
        if bn * bk * stages <= 128 * 256 * 4
    ]


@triton.autotune(configs=_gemm_configs(), key=["M", "N", "K"])
@triton.jit
def _fp8_gemm_kernel(
    a_ptr,
    b_ptr,
    c_ptr,
    sa_ptr,
    sb_ptr,
    M,
    N,
    K,
    stride_am,
    stride_bn,
    stride_cm,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
):
    pid_n = tl.program_id(0)
    pid_m = tl.program_id(1)
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_k = tl.arange(0, BLOCK_K)
    a_ptrs = a_ptr + offs_m[:, None] * stride_am + offs_k[None, :]
    b_ptrs = b_ptr + offs_n[:, None] * stride_bn + offs_k[None, :]  # [BLOCK_N, BLOCK_K], K contiguous
    m_ok = offs_m[:, None] < M
    n_ok = offs_n[:, None] < N
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for _ in range(0, tl.cdiv(K, BLOCK_K)):  # K is a multiple of BLOCK_K (checked by the caller)
        a = tl.load(a_ptrs, mask=m_ok, other=0.0)
        b = tl.load(b_ptrs, mask=n_ok, other=0.0)
        acc = tl.dot(a, tl.trans(b), acc)
        a_ptrs += BLOCK_K
        b_ptrs += BLOCK_K
    sa = tl.load(sa_ptr + offs_m, mask=offs_m < M, other=0.0)
    sb = tl.load(sb_ptr + offs_n, mask=offs_n < N, other=0.0)
    c = acc * sa[:, None] * sb[None, :]
    c_ptrs = c_ptr + offs_m[:, None] * stride_cm + offs_n[None, :]
    tl.store(c_ptrs, c.to(c_ptr.dtype.element_ty), mask=m_ok & (offs_n[None, :] < N))


def fp8_gemm(
    xq: torch.Tensor, x_scale: torch.Tensor, wq: torch.Tensor, w_scale: torch.Tensor, out_dtype: torch.dtype
) -> torch.Tensor:
    """xq [M, K] e4m3, x_scale [M] float32, wq [N, K] e4m3 (row-major), w_scale [N] float32 ->
    [M, N] in out_dtype."""
    m, k = xq.shape
    n = wq.shape[0]
    if k % 256:
        raise ValueError(f"fp8_gemm needs K divisible by 256, got {k}")
    out = torch.empty(m, n, dtype=out_dtype, device=xq.device)

    def grid(meta: dict) -> tuple[int, int]:
        return triton.cdiv(n, meta["BLOCK_N"]), triton.cdiv(m, meta["BLOCK_M"])

    _fp8_gemm_kernel[grid](xq, wq, out, x_scale, w_scale, m, n, k, xq.stride(0), wq.stride(0), out.stride(0))
    return out


@triton.jit
def _silu_mul_quantize_kernel(x_ptr, q_ptr, s_ptr, F, stride_x, stride_q, BLOCK: tl.constexpr):
    # One row per program, held in registers (BLOCK >= F): the up/gate row is read once.
    row = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK)
    ok = cols < F
    up = tl.load(x_ptr + row * stride_x + cols, mask=ok, other=0.0).to(tl.float32)
    gate = tl.load(x_ptr + row * stride_x + F + cols, mask=ok, other=0.0).to(tl.float32)
    h = gate * tl.sigmoid(gate) * up
    scale = tl.maximum(tl.max(tl.abs(h), axis=0) / E4M3_MAX, MIN_SCALE)
    tl.store(s_ptr + row, scale)
    q = tl.clamp(tl.div_rn(h, scale), -E4M3_MAX, E4M3_MAX)
    tl.store(q_ptr + row * stride_q + cols, q.to(q_ptr.dtype.element_ty), mask=ok)


def silu_mul_quantize(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """x [M, 2F] (up, gate halves) -> (silu(gate) * up quantized per row to e4m3 [M, F],
    float32 scales [M])."""
    m, two_f = x.shape
    f = two_f // 2
    q = torch.empty(m, f, dtype=torch.float8_e4m3fn, device=x.device)
    scale = torch.empty(m, dtype=torch.float32, device=x.device)
    block = triton.next_power_of_2(f)
    warps = max(4, min(32, block // 512))  # 16 values of each half per thread at most
    _silu_mul_quantize_kernel[(m,)](x, q, scale, f, x.stride(0), q.stride(0), BLOCK=block, num_warps=warps)
    return q, scale
