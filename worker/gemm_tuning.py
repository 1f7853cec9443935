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
(`stream_gemm(pin=True)`). worker/stream_linear.py tunes the bfloat16 shapes before its cuBLAS race;
`tune_fp8_linears` the FP8 blocks' (the engine calls it after quantizing). The picks are kept
under CDE_HOME (worker/gemm_tuning_cache.py): a restart pins them without timing again.
"""

from __future__ import annotations

import functools
import logging
from collections.abc import Callable

import torch
import torch.nn as nn
from cde.kernels.fp8_ops import silu_mul_quantize, stream_fp8_matmul
from cde.kernels.stream_tiles import MAX_ROWS
from cde.worker.cuda_timing import graph_replay_ms
from cde.worker.fp8 import Fp8Linear, path_for_rows
from cde.worker.gemm_tuning_cache import Pick, TuningCache, tuning_key

AGREEMENT = 1e-2  # a product's relative distance from cuBLAS's at most (bfloat16 rounding is ~4e-3)

Clock = Callable[[str, Callable[[], list[torch.Tensor]]], float]  # (kernel name, calls) -> ms per run
Calls = Callable[..., list[torch.Tensor]]  # (config, pin=False) -> the chain's products

log = logging.getLogger("cde.gemm_tuning")


def agrees(reference: list[torch.Tensor], products: list[torch.Tensor]) -> bool:
    """Every product within AGREEMENT (relative, Frobenius) of its reference."""
    return all(
        ((p.float() - r.float()).norm() <= AGREEMENT * r.float().norm()).item() for r, p in zip(reference, products)
    )


def tune(name: str, reference: list[torch.Tensor], calls: Calls, candidates: list[dict], time_ms: Clock) -> Pick:
    """The fastest candidate whose products agree with `reference` and its ms, pinned by one more
    `calls(config, pin=True)`; a candidate that fails to build is skipped. Raises ValueError when
    none is left (the caller keeps cuBLAS)."""
    fastest: dict[str, tuple[float, dict]] = {}  # per kernel: the log says what each one reached
    for config in candidates:
        try:
            if not agrees(reference, calls(config)):
                log.warning("gemm_tuning: %s %s: products off cuBLAS's, skipped", name, config)
                continue
            ms = time_ms(name, functools.partial(calls, config))
        except Exception as exc:  # a config Triton cannot build here (shared memory, registers)
            log.debug("gemm_tuning: %s %s: %s", name, config, exc)
            continue
        kernel = "stream-K" if "CTAS" in config else "split-K"
        if kernel not in fastest or ms < fastest[kernel][0]:
            fastest[kernel] = (ms, config)
    if not fastest:
        raise ValueError(f"no config of {len(candidates)} builds and agrees with cuBLAS")
    ms, config = min(fastest.values(), key=lambda pick: pick[0])
    calls(config, pin=True)
    per_kernel = ", ".join(f"{kernel} {pick[0]:.3f} ms" for kernel, pick in sorted(fastest.items()))
    log.info(
        "gemm_tuning: %s %.3f ms with %s (%d candidates; fastest %s)", name, ms, config, len(candidates), per_kernel
    )
    return Pick(config, ms)


def pin_fastest(
    name: str,
    reference: list[torch.Tensor],
    calls: Calls,
    a: torch.Tensor,
    b: torch.Tensor,
    time_ms: Clock,
    cache: TuningCache,
    swiglu: bool = False,
) -> float | None:
    """The pick `cache` keeps for operands a, b where it is still a candidate and still agrees,
    pinned; else `tune` over the candidates (kernels/stream_gemm_configs.py) and keep its pick.
    Its ms; None where none builds and agrees: the autotuner's pick stays, and a warning says so."""
    from cde.kernels.stream_gemm_configs import candidate_configs  # Triton: CUDA machines (and the tests)

    candidates = candidate_configs(a, b, swiglu)
    key = tuning_key(name, a, b, swiglu)
    kept = cache.get(key)
    if kept is not None and kept.config in candidates and _still_agrees(reference, calls, kept.config):
        calls(kept.config, pin=True)
        log.info("gemm_tuning: %s %.3f ms with %s (kept in %s)", name, kept.ms, kept.config, cache.path)
        return kept.ms
    try:
        pick = tune(name, reference, calls, candidates, time_ms)
    except ValueError as exc:
        log.warning("gemm_tuning: %s not tuned (%s); the autotuner's pick stays", name, exc)
        return None
    cache.put(key, pick)
    return pick.ms


def _still_agrees(reference: list[torch.Tensor], calls: Calls, config: dict) -> bool:
    try:
        return agrees(reference, calls(config))
    except Exception:  # no longer builds here
        return False


def cuda_ms(kernel: str, fn: Callable[[], list[torch.Tensor]]) -> float:
    """Mean ms of fn() replayed from a CUDA graph, as a pass runs it: timed eagerly, each Triton
    launch from Python (~0.1 ms) outweighed the 64-row GEMM itself (H200, 2026-12-02: "Triton
    4.258 ms" against cuBLAS's 0.763 for 32 layers of one shape, while the same kernels replayed
    from a graph took 4.33 and 4.32 ms for the whole 32-layer stack)."""
    return graph_replay_ms(fn, iters=5)[0]


@torch.no_grad()
def tune_fp8_linears(
    model: nn.Module, cache: TuningCache, time_ms: Clock = cuda_ms
) -> dict[tuple[int, int], float | None]:
    """CUDA: per weight shape of the FP8 blocks (worker/fp8.py), the one-request GEMM's config
    timed over every layer's weight and pinned; the references are torch._scaled_mm's products.
    Each GEMM of the timed chain follows the short quantizing kernel that feeds it, as in a pass:
    launched early (PDL) behind it, not behind the GEMM before, whose tail it would overlap.
    Returns the pinned chain's ms per (N, K), None where none agreed (the autotuner's pick stays)."""
    by_shape: dict[tuple[int, int], list[Fp8Linear]] = {}
    for module in model.modules():
        if isinstance(module, Fp8Linear) and path_for_rows(MAX_ROWS, 0, module.in_features) == "triton":
            by_shape.setdefault((module.out_features, module.in_features), []).append(module)
    chosen: dict[tuple[int, int], float | None] = {}
    for (n, k), layers in by_shape.items():
        h = torch.randn(MAX_ROWS, 2 * k, device=layers[0].weight.device, dtype=torch.bfloat16)
        xq, x_scale = silu_mul_quantize(h)
        reference = [
            torch._scaled_mm(
                xq, m.weight.t(), scale_a=x_scale[:, None], scale_b=m.scale[None, :], out_dtype=torch.bfloat16
            )
            for m in layers
        ]

        def calls(
            config: dict, pin: bool = False, h: torch.Tensor = h, layers: list[Fp8Linear] = layers
        ) -> list[torch.Tensor]:
            products = []
            for m in layers:
                q, scale = silu_mul_quantize(h)
                products.append(stream_fp8_matmul(q, scale, m.weight, m.scale, m.counters, torch.bfloat16, config, pin))
            return products

        chosen[(n, k)] = pin_fastest(f"fp8 [{n}, {k}]", reference, calls, xq, layers[0].weight, time_ms, cache)
    return chosen
