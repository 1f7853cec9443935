"""The FP8 path's operations as torch custom ops, one name on every device:

- `cde::fp8_matmul(xq, x_scale, wq, w_scale, counters, out_dtype)`: (xq @ wq.T) * x_scale[:, None] *
  w_scale[None, :] for e4m3 activations [M, K] and weights [N, K] with float32 scales (`counters`:
  the weight's split-K tile counters, kernels/stream_ops.py's `tile_counters`);
- `cde::fp8_weight_matmul(x, wq, w_scale, counters)`: (x @ wq.T) * w_scale[None, :] for activations
  [M, K] in their own dtype (bfloat16) and e4m3 weights: weight-only, the activations unquantized;
- `cde::silu_mul_quantize(x)`: x [M, 2F] holds (up, gate); silu(gate) * up, computed in float32,
  quantized per row to e4m3 -> (q [M, F], scales [M]);
- `cde::add_norm_quantize(x, delta, weight, eps, inject=None, gate=None)`: out = x + rms_norm(delta,
  weight, eps) for x, delta [M, K] (a post-norm block's residual), plus the steering gate * inject
  where given (inject [M, K], gate [G]: one per M // G consecutive rows, an item's), and out
  quantized per row to e4m3 -> (out, q [M, K], scales [M]);
- `cde::heads_quantize(y)`: attention's output y [N, H, T, Dh] (any strides) with its heads joined
  per token, [N * T, H * Dh], quantized per row to e4m3 -> (q, scales [N * T]).

On CUDA they run the Triton kernels of kernels/stream_gemm.py and kernels/fp8_triton.py; elsewhere
the same arithmetic in float32 (the CPU tests' emulation). Custom ops are opaque to torch.compile: the compiled blocks
call them as they are, and the Triton autotuner runs during the engine's warm-up passes, never
inside a graph capture.
"""

from __future__ import annotations

import torch
from cde.kernels.stream_ops import rms_norm, swiglu

E4M3 = torch.float8_e4m3fn
E4M3_MAX = 448.0  # the largest finite float8_e4m3fn
MIN_SCALE = 1e-12  # an all-zero row quantizes to zeros instead of dividing by zero


def quantize_rows(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-row e4m3 quantization of a [..., K] tensor: (q in float8_e4m3fn, float32 scales [..., 1])
    with x ~= q * scale; computed in float32, saturating at +-448."""
    xf = x.float()
    scale = (xf.abs().amax(-1, keepdim=True) / E4M3_MAX).clamp(min=MIN_SCALE)
    return quantize_with_scale(xf, scale), scale


def quantize_with_scale(x: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """x / scale rounded to e4m3, saturating at +-448 (a plain cast would overflow to NaN)."""
    return (x.float() / scale).clamp(-E4M3_MAX, E4M3_MAX).to(E4M3)


# The counters are scratch that every call leaves as it found it (zero), so the op is pure.
@torch.library.custom_op("cde::fp8_matmul", mutates_args=())
def fp8_matmul(
    xq: torch.Tensor,
    x_scale: torch.Tensor,
    wq: torch.Tensor,
    w_scale: torch.Tensor,
    counters: torch.Tensor,
    out_dtype: torch.dtype,
) -> torch.Tensor:
    return ((xq.float() @ wq.float().t()) * x_scale[:, None] * w_scale[None, :]).to(out_dtype)


@fp8_matmul.register_fake
def _(
    xq: torch.Tensor,
    x_scale: torch.Tensor,
    wq: torch.Tensor,
    w_scale: torch.Tensor,
    counters: torch.Tensor,
    out_dtype: torch.dtype,
) -> torch.Tensor:
    return xq.new_empty(xq.shape[0], wq.shape[0], dtype=out_dtype)


@torch.library.custom_op("cde::fp8_weight_matmul", mutates_args=())
def fp8_weight_matmul(x: torch.Tensor, wq: torch.Tensor, w_scale: torch.Tensor, counters: torch.Tensor) -> torch.Tensor:
    return ((x.float() @ wq.float().t()) * w_scale[None, :]).to(x.dtype)


@fp8_weight_matmul.register_fake
def _(x: torch.Tensor, wq: torch.Tensor, w_scale: torch.Tensor, counters: torch.Tensor) -> torch.Tensor:
    return x.new_empty(x.shape[0], wq.shape[0])


@torch.library.custom_op("cde::silu_mul_quantize", mutates_args=())
def silu_mul_quantize(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    q, scale = quantize_rows(swiglu(x.float()))
    return q, scale[:, 0]


@silu_mul_quantize.register_fake
def _(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    rows, width = x.shape
    return x.new_empty(rows, width // 2, dtype=E4M3), x.new_empty(rows, dtype=torch.float32)


@torch.library.custom_op("cde::add_norm_quantize", mutates_args=())
def add_norm_quantize(
    x: torch.Tensor,
    delta: torch.Tensor,
    weight: torch.Tensor,
    eps: float,
    inject: torch.Tensor | None = None,
    gate: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    out = x + rms_norm(delta, weight, eps)
    if inject is not None and gate is not None:  # the model's roundings: the product, then the sum
        out = out + gate.repeat_interleave(x.shape[0] // gate.numel())[:, None] * inject
    q, scale = quantize_rows(out)
    return out, q, scale[:, 0]


@add_norm_quantize.register_fake
def _(
    x: torch.Tensor,
    delta: torch.Tensor,
    weight: torch.Tensor,
    eps: float,
    inject: torch.Tensor | None = None,
    gate: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    rows, width = x.shape
    return torch.empty_like(x), x.new_empty(rows, width, dtype=E4M3), x.new_empty(rows, dtype=torch.float32)


@torch.library.custom_op("cde::heads_quantize", mutates_args=())
def heads_quantize(y: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    n, h, t, d = y.shape
    q, scale = quantize_rows(y.transpose(1, 2).reshape(n * t, h * d))
    return q, scale[:, 0]


@heads_quantize.register_fake
def _(y: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    n, h, t, d = y.shape
    return y.new_empty(n * t, h * d, dtype=E4M3), y.new_empty(n * t, dtype=torch.float32)


try:
    from cde.kernels import fp8_triton, stream_gemm
except ImportError:  # no Triton (CPU environments): the float32 definitions above everywhere
    fp8_triton = stream_gemm = None  # type: ignore[assignment]


# The FP8 GEMM's weight tiles fetched to L2 while the activation kernel before it runs (programmatic
# dependent launch): on the H200 the 32-layer one-request chain took 3.149 ms plain, 3.016 / 3.000 /
# 3.019 / 3.083 ms with 1 / 2 / 4 / 8 tiles (`FP8_KERNELS=pdl_chain scripts/gpu_run.sh fp8kernels`).
PREFETCH_TILES = 2


def stream_fp8_matmul(
    xq: torch.Tensor,
    x_scale: torch.Tensor,
    wq: torch.Tensor,
    w_scale: torch.Tensor,
    counters: torch.Tensor,
    out_dtype: torch.dtype,
    config: dict | None = None,
    pin: bool = False,
) -> torch.Tensor:
    """`cde::fp8_matmul` on CUDA: the split-K GEMM launched early with its first weight tiles to L2
    (on the CPU, in Triton's interpreter, which runs no PTX: plainly); `config` and `pin` as
    kernels/stream_gemm.stream_gemm's (worker/gemm_tuning.py)."""
    prefetch = PREFETCH_TILES if xq.is_cuda else 0
    return stream_gemm.stream_gemm(
        xq, wq, counters, out_dtype, scales=(x_scale, w_scale), config=config, prefetch=prefetch, pin=pin
    )


if fp8_triton is not None:
    fp8_matmul.register_kernel("cuda")(stream_fp8_matmul)
    fp8_weight_matmul.register_kernel("cuda")(
        lambda x, wq, w_scale, counters: stream_gemm.stream_gemm(x, wq, counters, x.dtype, scales=(None, w_scale))
    )
    silu_mul_quantize.register_kernel("cuda")(fp8_triton.silu_mul_quantize)
    add_norm_quantize.register_kernel("cuda")(fp8_triton.add_norm_quantize)
    heads_quantize.register_kernel("cuda")(fp8_triton.heads_quantize)
