"""The FP8 path's activation kernel on CUDA (`worker/fp8.py` calls it through `kernels/fp8_ops.py`;
its GEMM for few rows is kernels/stream_gemm.py):

- `silu_mul_quantize`: the MLP's `silu(gate) * up` quantized per row to e4m3, in one kernel that
  reads the up/gate row once (compiled, it was two kernels that each read it and recomputed the
  product: 145 us per layer at 2048 rows on the H200).

Imported where Triton is installed (CUDA machines; the CPU tests run it in Triton's interpreter).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

# Globals a @triton.jit function reads must be constexpr (the same values as worker/fp8.py's).
E4M3_MAX = tl.constexpr(448.0)
MIN_SCALE = tl.constexpr(1e-12)


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
