"""One-request bfloat16 linears on the split-K Triton GEMM where it beats cuBLAS (CUDA).

At 64 rows (one request) a pass is bound by reading every weight once, and cuBLAS's kernels for
the 8b's 4,096-output shapes read theirs at 65-70% of the bandwidth (docs/benchmarks.md).
`install` makes every transformer block's linear a StreamLinear and then `calibrate`s: per weight
shape, the 64-row product over all the layers' own weights (from HBM, as a pass reads them) by
cuBLAS and by the Triton GEMM (kernels/stream_gemm.py, its config tuned over that chain first:
worker/gemm_tuning.py), replayed from
CUDA graphs as a pass runs them, and keeps the faster for that shape in every layer. More rows
always run cuBLAS. It is decided before anything is compiled, so the compiled blocks see a constant.
A kernel that fails to build, or whose products are not cuBLAS's to bfloat16 rounding on every
layer, keeps cuBLAS.

The MLPs become StreamMLPs: where `calibrate` finds it faster, a one-request call runs c_fc and its
activation as one Triton GEMM with `silu(gate) * up` in its epilogue (`cde::stream_swiglu`), timed
against c_fc as chosen above plus the compiled pointwise kernel, which is what a compiled block
runs otherwise.
"""

from __future__ import annotations

import logging
from typing import cast

import torch
import torch.nn as nn
import torch.nn.functional as F
from cde.kernels import stream_ops
from cde.kernels.stream_ops import stream_linear, stream_swiglu, swiglu, tile_counters
from cde.kernels.stream_tiles import K_MULTIPLE, MAX_ROWS
from cde.worker.gemm_tuning import AGREEMENT, Clock, agrees, cuda_ms, pin_fastest
from cde.worker.gemm_tuning_cache import TuningCache
from cde.worker.model import BLOCK_LINEARS, SteerlingModel

MARGIN = 0.02  # the Triton GEMM must be this much faster: timing noise never flips a shape to it

log = logging.getLogger("cde.stream_linear")


class StreamLinear(nn.Module):
    """A bias-free linear layer whose calls of at most 64 rows run `cde::stream_linear` when
    `stream` is set (by `calibrate`), F.linear otherwise, and always where autograd records
    (input attribution's gradients through the blocks)."""

    def __init__(self, weight: nn.Parameter):
        super().__init__()
        self.out_features, self.in_features = weight.shape
        self.weight = weight  # the checkpoint's parameter: same name, same state dict
        self.register_buffer("counters", tile_counters(self.out_features, weight.device), persistent=False)
        self.stream = False

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        rows = x.numel() // self.in_features
        if not self.stream or rows > MAX_ROWS or torch.is_grad_enabled():  # the op has no backward
            return F.linear(x, self.weight)
        out = stream_linear(x.reshape(rows, self.in_features), self.weight, self.counters)
        return out.reshape(*x.shape[:-1], self.out_features)


class StreamMLP(nn.Module):
    """The MLP on StreamLinears whose calls of at most 64 rows run c_fc and its activation as one
    `cde::stream_swiglu` when `fused` is set (by `calibrate`), c_fc then `swiglu` otherwise, and
    always where autograd records."""

    def __init__(self, c_fc: StreamLinear, c_proj: StreamLinear):
        super().__init__()
        self.c_fc, self.c_proj = c_fc, c_proj
        width = c_fc.out_features // 2
        self.register_buffer("counters", tile_counters(width, c_fc.weight.device), persistent=False)
        self.fused = False

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        rows = x.numel() // self.c_fc.in_features
        if not self.fused or rows > MAX_ROWS or torch.is_grad_enabled():  # the op has no backward
            return self.c_proj(swiglu(self.c_fc(x)))
        h = stream_swiglu(x.reshape(rows, self.c_fc.in_features), self.c_fc.weight, self.counters)
        return self.c_proj(h.reshape(*x.shape[:-1], h.shape[-1]))


def install(model: SteerlingModel, time_ms: Clock | None = None, cache: TuningCache | None = None) -> dict:
    """Every block's linears become StreamLinears and its MLP a StreamMLP, then `calibrate(model,
    time_ms, cache)`; returns its choices."""
    for block in model.transformer.blocks:
        for path in BLOCK_LINEARS:
            owner_name, name = path.split(".")
            owner = getattr(block, owner_name)
            setattr(owner, name, StreamLinear(getattr(owner, name).weight))
        c_fc, c_proj = (cast(StreamLinear, getattr(block.mlp, name)) for name in ("c_fc", "c_proj"))
        block.mlp = StreamMLP(c_fc, c_proj)
    return calibrate(model, time_ms or cuda_ms, cache)


@torch.no_grad()
def calibrate(model: nn.Module, time_ms: Clock, cache: TuningCache | None = None) -> dict:
    """Per weight shape (N, K): the ms of a 64-row product over every layer of that shape by cuBLAS
    and by the Triton GEMM, its config tuned first (or taken from `cache`; None: nothing kept); `stream`
    set where the Triton GEMM is faster by MARGIN. Then the MLPs:
    c_fc as chosen plus the compiled activation against `cde::stream_swiglu`; `fused` set where it
    is faster by MARGIN. Returns {"linears": {(N, K): {"cublas_ms", "stream_ms", "stream"}},
    "swiglu": {"unfused_ms", "fused_ms", "fused"} or None (no StreamMLP)}, a None ms: unavailable."""
    by_shape: dict[tuple[int, int], list[StreamLinear]] = {}
    for module in model.modules():
        if isinstance(module, StreamLinear):
            by_shape.setdefault((module.out_features, module.in_features), []).append(module)
    cache = cache or TuningCache(None)
    linears = {}
    for (n, k), layers in by_shape.items():
        w0 = layers[0].weight
        x = torch.randn(MAX_ROWS, k, device=w0.device, dtype=w0.dtype)

        def by_cublas(x: torch.Tensor = x, layers: list[StreamLinear] = layers) -> list[torch.Tensor]:
            return [F.linear(x, m.weight) for m in layers]

        def by_triton(x: torch.Tensor = x, layers: list[StreamLinear] = layers) -> list[torch.Tensor]:
            return [stream_linear(x, m.weight, m.counters) for m in layers]

        if streamable(w0) and w0.is_cuda:
            _tune(f"[{n}, {k}]", by_cublas(), x, [(m.weight, m.counters) for m in layers], time_ms, cache)
        cublas, stream, chosen = race(time_ms, ("cublas", by_cublas), ("triton", by_triton), streamable(w0))
        for m in layers:
            m.stream = chosen
        linears[(n, k)] = {"cublas_ms": cublas, "stream_ms": stream, "stream": chosen}
    log.info(
        "one-request linears: %s",
        "; ".join(
            f"[{n}, {k}] {'Triton' if c['stream'] else 'cuBLAS'} (cuBLAS {c['cublas_ms']:.3f} ms, Triton "
            f"{_ms(c['stream_ms'])} ms)"
            for (n, k), c in linears.items()
        ),
    )
    return {"linears": linears, "swiglu": _calibrate_mlps(model, time_ms, cache)}


def _calibrate_mlps(model: nn.Module, time_ms: Clock, cache: TuningCache) -> dict | None:
    mlps = [m for m in model.modules() if isinstance(m, StreamMLP)]
    if not mlps:
        return None
    w0 = mlps[0].c_fc.weight
    x = torch.randn(MAX_ROWS, w0.shape[1], device=w0.device, dtype=w0.dtype)
    activation = torch.compile(swiglu, dynamic=False)  # one kernel, as in the compiled blocks

    def unfused() -> list[torch.Tensor]:
        return [activation(m.c_fc(x)) for m in mlps]

    def fused() -> list[torch.Tensor]:
        return [stream_swiglu(x, m.c_fc.weight, m.counters) for m in mlps]

    if streamable(w0) and w0.is_cuda:
        _tune("swiglu", unfused(), x, [(m.c_fc.weight, m.counters) for m in mlps], time_ms, cache, swiglu=True)
    unfused_ms, fused_ms, chosen = race(time_ms, ("unfused", unfused), ("fused", fused), streamable(w0))
    for m in mlps:
        m.fused = chosen
    log.info(
        "one-request MLP activation: %s (c_fc + compiled silu * up %.3f ms, in the GEMM's epilogue %s ms)",
        "fused" if chosen else "unfused",
        unfused_ms,
        _ms(fused_ms),
    )
    return {"unfused_ms": unfused_ms, "fused_ms": fused_ms, "fused": chosen}


def _tune(
    name: str,
    reference: list[torch.Tensor],
    x: torch.Tensor,
    layers: list[tuple],
    time_ms: Clock,
    cache: TuningCache,
    swiglu: bool = False,
) -> None:
    """Pins the Triton GEMM's fastest config over these (weight, counters) layers (CUDA), which
    the ops then run; where none agrees with the reference, the autotuner's pick stays."""
    gemm = stream_ops.stream_gemm

    def calls(config: dict, pin: bool = False) -> list[torch.Tensor]:
        return [gemm.stream_gemm(x, w, c, x.dtype, config=config, swiglu=swiglu, pin=pin) for w, c in layers]

    pin_fastest(name, reference, calls, x, layers[0][0], time_ms, cache, swiglu)


def streamable(w: torch.Tensor) -> bool:
    """Whether the Triton GEMM takes this weight (bfloat16, K a multiple of its K tile)."""
    return w.shape[1] % K_MULTIPLE == 0 and w.dtype == torch.bfloat16


def race(time_ms: Clock, baseline: tuple, candidate: tuple, eligible: bool) -> tuple[float, float | None, bool]:
    """(name, calls) of each: the baseline's ms, the candidate's (None where it is not eligible, fails
    to build or its products are not the baseline's within AGREEMENT: the baseline stays), and
    whether the candidate is faster by MARGIN."""
    base_ms = time_ms(*baseline)
    if not eligible:
        return base_ms, None, False
    try:
        ms = time_ms(*candidate)
        if not agrees(baseline[1](), candidate[1]()):
            raise ValueError(f"its products differ from the {baseline[0]} path's by more than {AGREEMENT:g}")
    except Exception as exc:  # a kernel that does not build or compute right here
        log.warning("stream_linear: %s failed (%s); %s stays", candidate[0], exc, baseline[0])
        return base_ms, None, False
    return base_ms, ms, ms < base_ms * (1 - MARGIN)


def _ms(ms: float | None) -> str:
    return "—" if ms is None else format(ms, ".3f")
