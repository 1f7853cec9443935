"""The FP8 path's activation kernels on CUDA (`worker/fp8.py` calls it through `kernels/fp8_ops.py`;
its GEMM for few rows is kernels/stream_gemm.py):

- `silu_mul_quantize`: the MLP's `silu(gate) * up` quantized per row to e4m3, in one kernel that
  reads the up/gate row once (compiled, it was two kernels that each read it and recomputed the
  product: 145 us per layer at 2048 rows on the H200).
- `add_norm_quantize`: a post-norm block's residual, x + RMSNorm(delta) (after attention; at the
  block's end plus the steering, gate * inject), and its rows quantized per row to e4m3 for the
  next linear (the MLP's c_fc; the next block's c_attn), in one kernel that reads the rows once
  (compiled, it was two kernels with looped reductions: the norm, then the add and the
  quantization re-reading the rows; at the block's end the quantization was the next block's).

Both signal `gdc_launch_dependents` as they start (on CUDA; Triton's interpreter has no inline
PTX), so that a GEMM launched after them with programmatic dependent launch (kernels/stream_gemm.py's
PREFETCH) starts fetching its weights meanwhile; it still waits for them to finish before it reads
what they write.

Imported where Triton is installed (CUDA machines; the CPU tests run it in Triton's interpreter).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from triton.language.extra.cuda import gdc_launch_dependents

# Globals a @triton.jit function reads must be constexpr (the same values as worker/fp8.py's).
E4M3_MAX = tl.constexpr(448.0)
MIN_SCALE = tl.constexpr(1e-12)


@triton.jit
def _silu_mul_quantize_kernel(x_ptr, q_ptr, s_ptr, F, stride_x, stride_q, BLOCK: tl.constexpr, TRIGGER: tl.constexpr):
    # One row per program, held in registers (BLOCK >= F): the up/gate row is read once.
    if TRIGGER:
        gdc_launch_dependents()
    row = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK)
    ok = cols < F
    up = tl.load(x_ptr + row * stride_x + cols, mask=ok, other=0.0).to(tl.float32)
    gate = tl.load(x_ptr + row * stride_x + F + cols, mask=ok, other=0.0).to(tl.float32)
    _quantize_row(gate * tl.sigmoid(gate) * up, q_ptr + row * stride_q + cols, s_ptr + row, ok)


@triton.jit
def _quantize_row(h, q_ptrs, s_ptr, ok):
    # A float32 row in registers -> e4m3 with scale amax / 448 (worker/fp8.py's quantize_rows).
    scale = tl.maximum(tl.max(tl.abs(h), axis=0) / E4M3_MAX, MIN_SCALE)
    tl.store(s_ptr, scale)
    q = tl.clamp(tl.div_rn(h, scale), -E4M3_MAX, E4M3_MAX)
    tl.store(q_ptrs, q.to(q_ptrs.dtype.element_ty), mask=ok)


def _quantized_rows(rows: int, width: int, device: torch.device) -> tuple[torch.Tensor, torch.Tensor, int, int]:
    """What a one-row-per-program quantizer writes, e4m3 rows [rows, width] and their float32
    scales [rows], and its launch: BLOCK (width's next power of two, the row held in registers) and
    warps (16 values of a row per thread at most, 4 to 32 warps)."""
    q = torch.empty(rows, width, dtype=torch.float8_e4m3fn, device=device)
    scale = torch.empty(rows, dtype=torch.float32, device=device)
    block = triton.next_power_of_2(width)
    return q, scale, block, max(4, min(32, block // 512))


def silu_mul_quantize(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """x [M, 2F] (up, gate halves) -> (silu(gate) * up quantized per row to e4m3 [M, F],
    float32 scales [M])."""
    m, two_f = x.shape
    f = two_f // 2
    q, scale, block, warps = _quantized_rows(m, f, x.device)
    _silu_mul_quantize_kernel[(m,)](
        x, q, scale, f, x.stride(0), q.stride(0), BLOCK=block, TRIGGER=x.is_cuda, num_warps=warps
    )
    return q, scale


@triton.jit
def _add_norm_quantize_kernel(
    x_ptr,
    d_ptr,
    w_ptr,
    inj_ptr,
    g_ptr,
    out_ptr,
    q_ptr,
    s_ptr,
    K,
    eps,
    rows_per_gate,
    STEER: tl.constexpr,
    BLOCK: tl.constexpr,
    TRIGGER: tl.constexpr,
):
    # One row per program, held in registers (BLOCK >= K); the roundings are the model's: the norm
    # to the activations' dtype, then the sum (then the steering product, then its sum).
    if TRIGGER:
        gdc_launch_dependents()
    row = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK)
    ok = cols < K
    dtype = out_ptr.dtype.element_ty
    d = tl.load(d_ptr + row * K + cols, mask=ok, other=0.0).to(tl.float32)
    w = tl.load(w_ptr + cols, mask=ok, other=0.0).to(tl.float32)
    x = tl.load(x_ptr + row * K + cols, mask=ok, other=0.0).to(tl.float32)
    r = tl.math.rsqrt(tl.sum(d * d, axis=0) / K + eps)
    normed = (w * (d * r)).to(dtype).to(tl.float32)
    out = (x + normed).to(dtype)
    if STEER:
        g = tl.load(g_ptr + row // rows_per_gate).to(tl.float32)
        if g != 0.0:  # an unsteered row (most of them) adds zero: its inject row is not read
            inj = tl.load(inj_ptr + row * K + cols, mask=ok, other=0.0).to(tl.float32)
            out = (out.to(tl.float32) + (g * inj).to(dtype).to(tl.float32)).to(dtype)
    tl.store(out_ptr + row * K + cols, out, mask=ok)
    _quantize_row(out.to(tl.float32), q_ptr + row * K + cols, s_ptr + row, ok)


def add_norm_quantize(
    x: torch.Tensor,
    delta: torch.Tensor,
    weight: torch.Tensor,
    eps: float,
    inject: torch.Tensor | None = None,
    gate: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """x, delta [M, K], the norm's weight [K], optionally the steering inject [M, K] and gate [G]
    (one per M // G rows) -> (x + RMSNorm(delta) (+ gate * inject) [M, K] in x's dtype, its rows
    quantized to e4m3 [M, K], float32 scales [M])."""
    x, delta = x.contiguous(), delta.contiguous()  # the kernel indexes rows of width K
    m, k = x.shape
    out = torch.empty_like(x)
    q, scale, block, warps = _quantized_rows(m, k, x.device)
    if inject is not None and gate is not None:
        steer, inj, g, rows_per_gate = True, inject.contiguous(), gate, m // gate.numel()
    else:  # unread when STEER is off
        steer, inj, g, rows_per_gate = False, x, x, 1
    _add_norm_quantize_kernel[(m,)](
        x,
        delta,
        weight,
        inj,
        g,
        out,
        q,
        scale,
        k,
        eps,
        rows_per_gate,
        STEER=steer,
        BLOCK=block,
        TRIGGER=x.is_cuda,
        num_warps=warps,
    )
    return out, q, scale


@triton.jit
def _heads_quantize_kernel(
    y_ptr,
    q_ptr,
    s_ptr,
    T,
    stride_n,
    stride_h,
    stride_t,
    stride_d,
    D: tl.constexpr,
    C: tl.constexpr,
    BLOCK: tl.constexpr,
    TRIGGER: tl.constexpr,
):
    # One token's row per program: its C = H * D values gathered from the heads by y's strides.
    if TRIGGER:
        gdc_launch_dependents()
    row = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK)
    ok = cols < C
    src = y_ptr + (row // T) * stride_n + (row % T) * stride_t + (cols // D) * stride_h + (cols % D) * stride_d
    _quantize_row(tl.load(src, mask=ok, other=0.0).to(tl.float32), q_ptr + row * C + cols, s_ptr + row, ok)


def heads_quantize(y: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Attention's output y [N, H, T, Dh], any strides -> its heads joined per token [N * T, H * Dh]
    quantized per row to e4m3, float32 scales [N * T]; y is read where it lies (no copy)."""
    n, h, t, d = y.shape
    c = h * d
    q, scale, block, warps = _quantized_rows(n * t, c, y.device)
    _heads_quantize_kernel[(n * t,)](
        y, q, scale, t, *y.stride(), D=d, C=c, BLOCK=block, TRIGGER=y.is_cuda, num_warps=warps
    )
    return q, scale
