"""Weights sent to L2 ahead of the GEMM that reads them (Hopper, CUDA): a one-request pass reads
every weight once, and between two GEMMs run short latency-bound kernels (after c_attn: QKV +
RoPE, attention, a quantization, ~10-15 us per layer; elsewhere a fused activation kernel) during
which HBM idles. A kernel that runs just before such a stretch (the GEMM before it, or the QKV
kernel at its start) issues bulk prefetches of the next GEMM's weight, `cp.async.bulk.prefetch.L2`:
fire-and-forget, so the fetch goes on while the short kernels run, and the GEMM finds those lines
in L2 (50 MB on the H200). A hint: no result depends on it.

`prefetch_rows` is the device side (a @triton.jit helper that kernels call), `row_prefix` the
host side's choice of how much of each row to send.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

# At most this many bytes of a weight ahead of its GEMM, under the H200's 50 MB of L2. Not yet
# measured: `FP8_KERNELS=l2_next scripts/gpu_run.sh fp8kernels` sweeps it on the FP8 chain.
AHEAD_BYTES = 24 << 20


@triton.jit
def prefetch_rows(base, rows, stride, prefix, cta, ctas, LANES: tl.constexpr = 128):
    """CTA `cta` of `ctas`: the first `prefix` bytes (a multiple of 16) of its share of the `rows`
    rows at base (`stride` elements apart), one bulk prefetch to L2 per row, a row per thread of 4
    warps at a time (fewer lanes than threads would repeat each), rows dealt out in turn so that
    every CTA (SM) issues some. Every row's start rather than the weight's first rows: the GEMM's
    CTAs each stream rows of their own from K = 0 at once, and the last to finish sets the time."""
    for first in range(0, rows, ctas * LANES):
        row = first + cta + ctas * tl.arange(0, LANES)
        ok = row < rows
        tl.inline_asm_elementwise(
            "cp.async.bulk.prefetch.L2.global [$1], $2; // dummy $0",
            "=r,l,r",
            [tl.where(ok, base + row.to(tl.int64) * stride, base), tl.full([LANES], prefix, tl.int32)],
            tl.int32,
            is_pure=False,
            pack=1,
        )


def row_prefix(w: torch.Tensor | None, nbytes: int = AHEAD_BYTES) -> int:
    """The bytes of each row of w [N, K] that `prefetch_rows` sends for about nbytes of it in all
    (`prefix_bytes`); 0 (send nothing) for no w or off CUDA (Triton's interpreter runs no inline PTX)."""
    if w is None or not w.is_cuda or w.dim() != 2 or w.stride(1) != 1:
        return 0
    return prefix_bytes(w.shape[0], w.stride(0) * w.element_size(), w.data_ptr(), nbytes)


def prefetch_args(
    w: torch.Tensor | None, unread: torch.Tensor, nbytes: int = AHEAD_BYTES
) -> tuple[torch.Tensor, int, int, int]:
    """A kernel's arguments for `prefetch_rows` of w: (base, rows, stride, prefix); with a prefix of
    0 (send nothing: see `row_prefix`) the base is `unread`, any tensor of the call."""
    prefix = row_prefix(w, nbytes)
    if w is None or not prefix:
        return unread, 0, 0, 0
    return w, w.shape[0], w.stride(0), prefix


def prefix_bytes(rows: int, row_bytes: int, address: int, nbytes: int) -> int:
    """About nbytes / rows, a multiple of 16 between 16 and the row; 0 where nbytes is not positive
    or a row does not start on 16 bytes (a bulk prefetch's address must)."""
    if nbytes <= 0 or (address | row_bytes) % 16:
        return 0
    return min(row_bytes, max(16, nbytes // rows)) // 16 * 16
