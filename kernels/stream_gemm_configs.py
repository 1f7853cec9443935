"""The split-K GEMM's launch configs (kernels/stream_gemm.py): the autotuner's grid and its
pruning, the candidates worker/gemm_tuning.py times over a layers' chain, whether TMA may load an
operand pair's tiles, and the configs pinned for the launcher's calls without one. Imported only
where Triton is installed, as the kernel is."""

from __future__ import annotations

import torch
import triton
from cde.kernels.stream_tiles import K_MULTIPLE, MAX_ROWS, MAX_SPLIT_K, MIN_BLOCK_N

SMEM_TILES = 4 * MIN_BLOCK_N * K_MULTIPLE * 4  # weight-tile elements a config may keep in flight


def autotune_configs() -> list:
    # A split share streams 1/SPLIT_K of K: the deeper pipelines are only tried unsplit (fewer
    # candidates keep the autotuning at the engine's warm-up short). 8 stages: on the H200 the
    # autotuner took the deepest offered (6) for two of the 8b's four FP8 shapes (12-03
    # `fp8kernels`), and a one-request GEMM only streams weights, so more bytes in flight may pay.
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
        if bn * bk * stages <= SMEM_TILES  # shared memory
    ]


def prune_configs(configs: list, named_args: dict, **kwargs: object) -> list:
    # Swapped operands only where the weight tile is widened (FP8 weights beside bf16 rows): as
    # the MMA's first operand it may stay in registers; as the second it goes back to shared memory.
    # SWIGLU (same-dtype operands) streams two weight tiles per step: half the pipeline fits.
    widened = named_args["a_ptr"].dtype != named_args["b_ptr"].dtype
    tiles = 2 if kwargs.get("SWIGLU") else 1
    return [
        c
        for c in configs
        if (widened or not c.kwargs["SWAP_AB"])
        and tiles * c.kwargs["BLOCK_N"] * c.kwargs["BLOCK_K"] * c.num_stages <= SMEM_TILES
    ]


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
    return split_k + stream_k_configs(programs(a.device), tma)


def stream_k_configs(ctas: int, tma: bool) -> list[dict]:
    """The stream-K kernel's configs on `ctas` programs: its tiles as the split-K kernel's, with as
    many weight tiles in flight as the shared memory holds."""
    return [
        {"BLOCK_M": MAX_ROWS, "BLOCK_N": bn, "BLOCK_K": bk, "CTAS": ctas, "TMA": tma, "num_warps": 4, "num_stages": st}
        for bn in (MIN_BLOCK_N, 2 * MIN_BLOCK_N, 4 * MIN_BLOCK_N)
        for bk in (K_MULTIPLE // 2, K_MULTIPLE)
        for st in (4, 6)
        if bn * bk * st <= SMEM_TILES
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
