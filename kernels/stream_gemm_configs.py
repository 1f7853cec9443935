"""The split-K GEMM's launch configs (kernels/stream_gemm.py): the autotuner's grid and its
pruning, the candidates worker/gemm_tuning.py times over a layers' chain, whether TMA may load an
operand pair's tiles, and the configs pinned for the launcher's calls without one. Imported only
where Triton is installed, as the kernel is."""

from __future__ import annotations

import torch
import triton
from cde.kernels.stream_tiles import K_MULTIPLE, MAX_ROWS, MAX_SPLIT_K, MIN_BLOCK_N

# A CTA's shared memory on Hopper (opt-in, H100/H200): the limit where there is no CUDA device, so
# Triton's interpreter on the CPU sees the H200's candidates.
SM90_SHARED_BYTES = 227 * 1024


def autotune_configs() -> list:
    # A split share streams 1/SPLIT_K of K: the deeper pipelines are only tried unsplit (fewer
    # candidates keep the autotuning at the engine's warm-up short). 8 stages: on the H200 the
    # autotuner took the deepest offered (6) for two of the 8b's four FP8 shapes (12-03
    # `fp8kernels`), and a one-request GEMM only streams weights, so more bytes in flight may pay.
    # What does not fit a call's shared memory is pruned per call (`prune_configs`).
    return [
        triton.Config(
            {"BLOCK_M": MAX_ROWS, "BLOCK_N": bn, "BLOCK_K": bk, "SPLIT_K": sk, "SWAP_AB": swap},
            num_warps=4,
            num_stages=stages,
        )
        for bn in (MIN_BLOCK_N, 2 * MIN_BLOCK_N, 4 * MIN_BLOCK_N)
        for bk in (K_MULTIPLE // 2, K_MULTIPLE)
        for sk in (1, 2, 4, MAX_SPLIT_K)
        for stages in ((4, 6, 8) if sk == 1 else (4,))
        for swap in (False, True)
    ]


def prune_configs(configs: list, named_args: dict, **kwargs: object) -> list:
    # Swapped operands only where the weight tile is widened (FP8 weights beside bf16 rows): as
    # the MMA's first operand it may stay in registers; as the second it goes back to shared memory.
    a, b, swiglu = named_args["a_ptr"], named_args["b_ptr"], bool(kwargs.get("SWIGLU"))
    widened = a.dtype != b.dtype
    return [
        c
        for c in configs
        if (widened or not c.kwargs["SWAP_AB"]) and fits({**c.kwargs, "num_stages": c.num_stages}, a, b, swiglu)
    ]


def pipeline_bytes(config: dict, a_bytes: int, b_bytes: int, swiglu: bool = False) -> int:
    """At least the shared memory a config's kernel takes (bytes): per stage in flight, an
    activation tile [BLOCK_M, BLOCK_K] and a weight tile [BLOCK_N, BLOCK_K] (two with SwiGLU: up and
    gate rows). Triton adds a few bytes of barriers per stage and, widening FP8 weights, their
    bfloat16 copy; with swapped operands it may keep one stage fewer in flight. Compiled for sm_90
    (Triton 3.6, the H200 image's, and 3.8), the split-K kernel's same-dtype configs take exactly
    the tiles' bytes plus 8-16 per stage, the stream-K kernel's its epilogue's float32 tile besides
    (8-32 KB: every kept config still fits): tests/kernels/test_stream_gemm_configs.py holds the
    bound to the compiler."""
    stages = config["num_stages"] - (1 if config.get("SWAP_AB") else 0)
    weight_tiles = 2 if swiglu else 1
    return stages * config["BLOCK_K"] * (config["BLOCK_M"] * a_bytes + weight_tiles * config["BLOCK_N"] * b_bytes)


def shared_limit(device: torch.device) -> int:
    """A CTA's shared memory (bytes, opt-in) on `device`, as Triton's launcher checks it; Hopper's
    where there is no CUDA device."""
    if device.type != "cuda":
        return SM90_SHARED_BYTES
    index = device.index if device.index is not None else torch.cuda.current_device()
    return int(triton.runtime.driver.active.utils.get_device_properties(index)["max_shared_mem"])


def fits(config: dict, a: torch.Tensor, b: torch.Tensor, swiglu: bool = False) -> bool:
    """Whether a config's pipeline may fit a CTA's shared memory for these operands. A config that
    does not would compile at the engine's warm-up only to fail at its launch (the bfloat16
    candidates were 20 of 45 such, SwiGLU's 17 of 26, FP8's 1 of 45)."""
    return pipeline_bytes(config, a.element_size(), b.element_size(), swiglu) <= shared_limit(a.device)


_pinned: dict[tuple, dict] = {}  # (N, K, dtypes, flags) -> the launch config of calls without one


def pin_config(key: tuple, config: dict) -> None:
    """`config` from now on for the launcher's calls without one under `key`."""
    _pinned[key] = config


def pinned_config(key: tuple) -> dict | None:
    return _pinned.get(key)


def pinned_configs() -> dict[tuple, dict]:
    """The pinned configs per (N, K, a's dtype, b's dtype, SCALE_A, SCALE_B, SWIGLU, PREFETCH)."""
    return dict(_pinned)


def unpin_all() -> None:
    _pinned.clear()


def candidate_configs(a: torch.Tensor, b: torch.Tensor, swiglu: bool = False) -> list[dict]:
    """The autotuner's configs that fit these operands, as `stream_gemm(config=...)`, with the
    tiles loaded by TMA where `tma_fits`, then the stream-K kernel's (kernels/stream_k.py) for
    same-dtype operands without SwiGLU: what worker/gemm_tuning.py times over a layers' chain."""
    named = {"a_ptr": a, "b_ptr": b}
    tma = tma_fits(a, b)
    split_k = [
        {**c.kwargs, "TMA": tma, "num_warps": c.num_warps, "num_stages": c.num_stages}
        for c in prune_configs(autotune_configs(), named, SWIGLU=swiglu)
    ]
    if swiglu or a.dtype != b.dtype:
        return split_k
    return split_k + [c for c in stream_k_configs(programs(a.device), tma) if fits(c, a, b)]


def stream_k_configs(ctas: int, tma: bool) -> list[dict]:
    """The stream-K kernel's configs on `ctas` programs: its tiles as the split-K kernel's, 4 to 8
    weight tiles in flight (those that fit the operands' shared memory: `fits`). A program has its
    SM to itself, so its pipeline depth is what keeps the SM's share of the bytes in flight."""
    return [
        {"BLOCK_M": MAX_ROWS, "BLOCK_N": bn, "BLOCK_K": bk, "CTAS": ctas, "TMA": tma, "num_warps": 4, "num_stages": st}
        for bn in (MIN_BLOCK_N, 2 * MIN_BLOCK_N, 4 * MIN_BLOCK_N)
        for bk in (K_MULTIPLE // 2, K_MULTIPLE)
        for st in (4, 6, 8)
    ]


def programs(device: torch.device) -> int:
    """The stream-K kernel's programs: one per SM (a deep pipeline's shared memory holds one CTA);
    a few in Triton's interpreter, which runs them one after another."""
    return torch.cuda.get_device_properties(device).multi_processor_count if device.type == "cuda" else 4


def tma_fits(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Whether TMA (Hopper's tensor memory accelerator: bulk copies, no per-thread address
    arithmetic) may load these operands' tiles: 16-byte aligned starts (rows are, K being a
    multiple of K_MULTIPLE) and one dtype (the widened FP8 weights keep per-thread loads). On the
    H200 it took 1-13% off each one-request shape's best config, FP8 and bfloat16, graph-timed
    over the 8b's 32 layers (`SWEEP_ARGS="--grid tma" scripts/gpu_run.sh gemmsweep`). A GPU
    before Hopper has no TMA (Triton's interpreter, on the CPU, emulates it)."""
    hopper = not a.is_cuda or torch.cuda.get_device_capability(a.device)[0] >= 9
    return hopper and a.dtype == b.dtype and a.data_ptr() % 16 == 0 and b.data_ptr() % 16 == 0
