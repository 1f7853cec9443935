"""One-request bfloat16 linears on the split-K Triton GEMM where it beats cuBLAS (CUDA).

At 64 rows (one request) a pass is bound by reading every weight once, and cuBLAS's kernels for
the 8b's 4,096-output shapes read theirs at 65-70% of the bandwidth (docs/benchmarks.md).
`install` makes every transformer block's linear a StreamLinear and then `calibrate`s: per weight
shape, the 64-row product over all the layers' own weights (from HBM, as a pass reads them) by
cuBLAS and by the Triton GEMM (kernels/stream_gemm.py, autotuned on its first call), replayed from
CUDA graphs as a pass runs them, and keeps the faster for that shape in every layer. More rows
always run cuBLAS. It is decided before anything is compiled, so the compiled blocks see a constant.
A kernel that fails to build, or whose products are not cuBLAS's to bfloat16 rounding on every
layer, keeps cuBLAS.
"""

from __future__ import annotations

import logging
from collections.abc import Callable

import torch
import torch.nn as nn
import torch.nn.functional as F
from cde.kernels.stream_ops import stream_linear, tile_counters
from cde.kernels.stream_tiles import K_MULTIPLE, MAX_ROWS
from cde.worker.cuda_timing import graph_replay_ms
from cde.worker.model import BLOCK_LINEARS, SteerlingModel

MARGIN = 0.02  # the Triton GEMM must be this much faster: timing noise never flips a shape to it
AGREEMENT = 1e-2  # its products' relative distance from cuBLAS's at most (bfloat16 rounding is ~4e-3)

log = logging.getLogger("cde.stream_linear")


class StreamLinear(nn.Module):
    """A bias-free linear layer whose calls of at most 64 rows run `cde::stream_linear` when
    `stream` is set (by `calibrate`), F.linear otherwise."""

    def __init__(self, weight: nn.Parameter):
        super().__init__()
        self.out_features, self.in_features = weight.shape
        self.weight = weight  # the checkpoint's parameter: same name, same state dict
        self.register_buffer("counters", tile_counters(self.out_features, weight.device), persistent=False)
        self.stream = False

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        rows = x.numel() // self.in_features
        if not self.stream or rows > MAX_ROWS:
            return F.linear(x, self.weight)
        out = stream_linear(x.reshape(rows, self.in_features), self.weight, self.counters)
        return out.reshape(*x.shape[:-1], self.out_features)


Clock = Callable[[str, Callable[[], list[torch.Tensor]]], float]  # (kernel name, calls) -> ms per run


def install(model: SteerlingModel, time_ms: Clock | None = None) -> dict:
    """Every block's linears become StreamLinears, then `calibrate(model, time_ms)`; returns its
    choices."""
    for block in model.transformer.blocks:
        for path in BLOCK_LINEARS:
            owner_name, name = path.split(".")
            owner = getattr(block, owner_name)
            setattr(owner, name, StreamLinear(getattr(owner, name).weight))
    return calibrate(model, time_ms or cuda_ms)


@torch.no_grad()
def calibrate(model: nn.Module, time_ms: Clock) -> dict:
    """Per weight shape (N, K): the ms of a 64-row product over every layer of that shape by cuBLAS
    and by the Triton GEMM; `stream` set where the Triton GEMM is faster by MARGIN. Returns
    {(N, K): {"cublas_ms", "stream_ms" (None: unavailable), "stream"}}."""
    by_shape: dict[tuple[int, int], list[StreamLinear]] = {}
    for module in model.modules():
        if isinstance(module, StreamLinear):
            by_shape.setdefault((module.out_features, module.in_features), []).append(module)
    choices = {}
    for (n, k), layers in by_shape.items():
        w0 = layers[0].weight
        x = torch.randn(MAX_ROWS, k, device=w0.device, dtype=w0.dtype)

        def by_cublas(x: torch.Tensor = x, layers: list[StreamLinear] = layers) -> list[torch.Tensor]:
            return [F.linear(x, m.weight) for m in layers]

        def by_triton(x: torch.Tensor = x, layers: list[StreamLinear] = layers) -> list[torch.Tensor]:
            return [stream_linear(x, m.weight, m.counters) for m in layers]

        cublas = time_ms("cublas", by_cublas)
        stream = None
        if k % K_MULTIPLE == 0 and w0.dtype == torch.bfloat16:
            try:
                stream = time_ms("triton", by_triton)
                if not agrees(by_cublas(), by_triton()):
                    raise ValueError(f"its products differ from cuBLAS's by more than {AGREEMENT:g}")
            except Exception as exc:  # a kernel that does not build or compute right here: cuBLAS stays
                log.warning("stream_linear: the Triton GEMM failed for [%d, %d] (%s); cuBLAS stays", n, k, exc)
                stream = None
        chosen = stream is not None and stream < cublas * (1 - MARGIN)
        for m in layers:
            m.stream = chosen
        choices[(n, k)] = {"cublas_ms": cublas, "stream_ms": stream, "stream": chosen}
    log.info(
        "one-request linears: %s",
        "; ".join(
            f"[{n}, {k}] {'Triton' if c['stream'] else 'cuBLAS'} (cuBLAS {c['cublas_ms']:.3f} ms, Triton "
            f"{'—' if c['stream_ms'] is None else format(c['stream_ms'], '.3f')} ms)"
            for (n, k), c in choices.items()
        ),
    )
    return choices


def agrees(reference: list[torch.Tensor], products: list[torch.Tensor]) -> bool:
    """Every product within AGREEMENT (relative, Frobenius) of its reference."""
    return all(
        ((p.float() - r.float()).norm() <= AGREEMENT * r.float().norm()).item() for r, p in zip(reference, products)
    )


def cuda_ms(kernel: str, fn: Callable[[], list[torch.Tensor]]) -> float:
    """Mean ms of fn() replayed from a CUDA graph, as a pass runs it: timed eagerly, each Triton
    launch from Python (~0.1 ms) outweighed the 64-row GEMM itself (H200, 2026-12-02: "Triton
    4.258 ms" against cuBLAS's 0.763 for 32 layers of one shape, while the same kernels replayed
    from a graph took 4.33 and 4.32 ms for the whole 32-layer stack)."""
    return graph_replay_ms(fn, iters=5)[0]
