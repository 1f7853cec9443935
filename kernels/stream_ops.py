"""`cde::stream_linear(x, w, counters)`: x [M, K] @ w [N, K].T for few rows, as a torch custom op
with one name on every device. On CUDA it runs the split-K Triton GEMM (kernels/stream_gemm.py,
at most 64 rows, K a multiple of 256); elsewhere F.linear. The op is opaque to torch.compile, so
the compiled blocks call it as it is (worker/stream_linear.py decides where it runs).

`cde::stream_swiglu(x, w, counters)`: the MLP's up projection and activation, `swiglu(x @ w.T)`
for c_fc's weight w [2F, K], in one op: on CUDA the same GEMM with the activation in its epilogue
(the [M, 2F] projection is never written), elsewhere the two steps.

`rms_norm` and `swiglu` are the one definition of the model's norm and activation, which the
fused kernels (here and in kernels/fp8_ops.py) compute in their epilogues.

`tile_counters`: the split-K tile counters a weight carries for the CUDA kernel (and for the FP8
op of kernels/fp8_ops.py), zero before and after every call.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

try:
    from cde.kernels import stream_gemm
except ImportError:  # no Triton: F.linear everywhere, and no counters
    stream_gemm = None  # type: ignore[assignment]


def tile_counters(n: int, device: torch.device | str) -> torch.Tensor:
    """The counters of a weight with n output rows: what the CUDA kernel needs, none elsewhere."""
    cuda = torch.device(device).type == "cuda" and stream_gemm is not None
    return torch.zeros(stream_gemm.counter_count(n) if cuda else 0, dtype=torch.int32, device=device)


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """The model's RMSNorm: float32 statistics, cast back (the reference's numerics)."""
    xf = x.float()
    xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    return (weight * xf).to(x.dtype)


def swiglu(h: torch.Tensor) -> torch.Tensor:
    """The MLP's activation on c_fc's output [..., 2F] (up, then gate): silu(gate) * up [..., F]."""
    up, gate = h.chunk(2, dim=-1)
    return F.silu(gate) * up


# The counters are scratch that every call leaves as it found it (zero), so the ops are pure.
@torch.library.custom_op("cde::stream_linear", mutates_args=())
def stream_linear(x: torch.Tensor, w: torch.Tensor, counters: torch.Tensor) -> torch.Tensor:
    return F.linear(x, w)


@stream_linear.register_fake
def _(x: torch.Tensor, w: torch.Tensor, counters: torch.Tensor) -> torch.Tensor:
    return x.new_empty(x.shape[0], w.shape[0])


@torch.library.custom_op("cde::stream_swiglu", mutates_args=())
def stream_swiglu(x: torch.Tensor, w: torch.Tensor, counters: torch.Tensor) -> torch.Tensor:
    return swiglu(F.linear(x, w))


@stream_swiglu.register_fake
def _(x: torch.Tensor, w: torch.Tensor, counters: torch.Tensor) -> torch.Tensor:
    return x.new_empty(x.shape[0], w.shape[0] // 2)


def _cuda_stream_linear(x: torch.Tensor, w: torch.Tensor, counters: torch.Tensor) -> torch.Tensor:
    return stream_gemm.stream_gemm(x, w, counters, x.dtype)


def _cuda_stream_swiglu(x: torch.Tensor, w: torch.Tensor, counters: torch.Tensor) -> torch.Tensor:
    return stream_gemm.stream_gemm(x, w, counters, x.dtype, swiglu=True)


if stream_gemm is not None:
    stream_linear.register_kernel("cuda")(_cuda_stream_linear)
    stream_swiglu.register_kernel("cuda")(_cuda_stream_swiglu)
