"""The split-K GEMM's launch config per weight shape, chosen as a pass runs it (CUDA warm-up).

Triton's autotuner times one weight's eager calls: at one request that weight stays in L2 between
the calls (the 8b's FP8 c_attn is 21 MB of the H200's 50) and each call launches alone, not early
behind the kernel before it (programmatic dependent launch, the FP8 path's). So it picked configs
up to 1.5x slower than the best over the layers' chain, and different ones from run to run (H200,
2026-12-04: the FP8 MLP c_proj 1.012 ms against 0.665 for 32 layers,
`SWEEP_ARGS="--grid tma --prefetch 2" scripts/gpu_run.sh gemmsweep`).

`tune` times every candidate (kernels/stream_gemm_configs.candidate_configs) over all the layers' own
weights of one shape, replayed from a CUDA graph (`Clock`), keeps those whose products agree with
a reference (cuBLAS) and pins the fastest for the engine's later calls of that shape
(`stream_gemm(pin=True)`). The callers (worker/stream_linear.py, worker/fp8.py) say what a call is.
"""

from __future__ import annotations

import functools
import logging
from collections.abc import Callable

import torch
from cde.worker.cuda_timing import graph_replay_ms

AGREEMENT = 1e-2  # a product's relative distance from cuBLAS's at most (bfloat16 rounding is ~4e-3)

Clock = Callable[[str, Callable[[], list[torch.Tensor]]], float]  # (kernel name, calls) -> ms per run
Calls = Callable[..., list[torch.Tensor]]  # (config, pin=False) -> the chain's products

log = logging.getLogger("cde.gemm_tuning")


def agrees(reference: list[torch.Tensor], products: list[torch.Tensor]) -> bool:
    """Every product within AGREEMENT (relative, Frobenius) of its reference."""
    return all(
        ((p.float() - r.float()).norm() <= AGREEMENT * r.float().norm()).item() for r, p in zip(reference, products)
    )


def tune(name: str, reference: list[torch.Tensor], calls: Calls, candidates: list[dict], time_ms: Clock) -> float:
    """The ms of the fastest candidate whose products agree with `reference`, pinned by one more
    `calls(config, pin=True)`; a candidate that fails to build is skipped. Raises ValueError when
    none is left (the caller keeps cuBLAS)."""
    best: tuple[float, dict] | None = None
    for config in candidates:
        try:
            if not agrees(reference, calls(config)):
                log.warning("gemm_tuning: %s %s: products off cuBLAS's, skipped", name, config)
                continue
            ms = time_ms(name, functools.partial(calls, config))
        except Exception as exc:  # a config Triton cannot build here (shared memory, registers)
            log.debug("gemm_tuning: %s %s: %s", name, config, exc)
            continue
        if best is None or ms < best[0]:
            best = (ms, config)
    if best is None:
        raise ValueError(f"no config of {len(candidates)} builds and agrees with cuBLAS")
    calls(best[1], pin=True)
    log.info("gemm_tuning: %s %.3f ms with %s (%d candidates)", name, best[0], best[1], len(candidates))
    return best[0]


def cuda_ms(kernel: str, fn: Callable[[], list[torch.Tensor]]) -> float:
    """Mean ms of fn() replayed from a CUDA graph, as a pass runs it: timed eagerly, each Triton
    launch from Python (~0.1 ms) outweighed the 64-row GEMM itself (H200, 2026-12-02: "Triton
    4.258 ms" against cuBLAS's 0.763 for 32 layers of one shape, while the same kernels replayed
    from a graph took 4.33 and 4.32 ms for the whole 32-layer stack)."""
    return graph_replay_ms(fn, iters=5)[0]
