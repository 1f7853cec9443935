"""The split-K GEMM's tile limits (kernels/stream_gemm.py), importable without Triton: its callers
decide from them which calls it may take, and which weights the kernels before it bring to L2."""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import torch

MAX_ROWS = 64  # one row tile: calls of at most one request
MIN_BLOCK_N = 32  # the narrowest output tile: at most cdiv(N, 32) tiles, one counter each
K_MULTIPLE = 256  # the largest K tile: K must be a multiple of it
MAX_SPLIT_K = 8


def weight_to_prefetch(rows: int, weight: torch.Tensor | None) -> torch.Tensor | None:
    """The weight of the GEMM after a kernel of `rows` rows, for the kernel to bring to L2
    (kernels/l2_prefetch.py), or None: at most MAX_ROWS rows, where a pass waits on reading its
    weights; with more, the GEMMs wait on their arithmetic and the kernel's own rows need HBM."""
    return weight if rows <= MAX_ROWS else None
