"""A weight brought to L2 by the short kernel before its GEMM (one request, CUDA).

At one request a pass alternates weight-streaming GEMMs with short, latency-bound kernels (QKV +
RoPE, attention, the norms and quantizations: ~27 us a layer in FP8 on the H200), during which HBM
sits idle. A kernel handed the next GEMM's weight asks, as it starts, for the weight's first bytes
(at most half the L2) to be copied into L2: one `cp.async.bulk.prefetch.L2` per thread, which the
TMA unit carries out while the kernel goes on and after it ends. The GEMM then finds them in L2
and streams the rest from HBM. The GEMM's own PDL prefetch (kernels/gemm_tiles.py) starts only
as the kernel just before it runs, and fetches two tiles per CTA.

Imported where Triton is installed; the kernels call `prefetch_chunks` only on CUDA (Triton's
interpreter runs no PTX).
"""

from __future__ import annotations

import functools

import torch
import triton
import triton.language as tl

CHUNK = tl.constexpr(16384)  # bytes per bulk prefetch (a multiple of 16, as the instruction asks)

# Thread t of the program prefetches chunk `t` of its share (first + t * stride bytes) if t < count.
_BULK_PREFETCH = tl.constexpr("""{
.reg .u32 t; .reg .u64 a; .reg .pred p;
mov.u32 t, %tid.x;
setp.lt.u32 p, t, $3;
mad.wide.u32 a, t, $4, $1;
@p cp.async.bulk.prefetch.L2.global [a], $2;
mov.u32 $0, 0;
}""")


@triton.jit
def prefetch_chunks(w_ptr, n_chunks, program, programs):
    # This program's share of the first n_chunks chunks of the bytes at w_ptr (uint8): chunks
    # program, program + programs, ... (the host keeps the share within the program's threads).
    count = tl.maximum(n_chunks - program + programs - 1, 0) // programs
    first = w_ptr + program.to(tl.int64) * CHUNK
    stride = programs * CHUNK
    tl.inline_asm_elementwise(
        _BULK_PREFETCH, "=r,l,r,r,r", [first, tl.full([], CHUNK, tl.int32), count, stride], tl.int32, False, 1
    )


@functools.cache
def _l2_bytes(device: int) -> int:
    return torch.cuda.get_device_properties(device).L2_cache_size


def prefetch_args(weight: torch.Tensor | None, programs: int, threads: int) -> tuple[torch.Tensor | None, int]:
    """A kernel's prefetch arguments for `weight` (None: no prefetch): (its bytes as uint8, the
    count of CHUNK-byte chunks to fetch), at most half the device's L2 and one chunk per thread of
    the launch's `programs` programs of `threads` threads."""
    if weight is None or not weight.is_cuda:
        return None, 0
    limit = min(weight.numel() * weight.element_size(), _l2_bytes(weight.device.index or 0) // 2)
    return weight.view(-1).view(torch.uint8), min(limit // CHUNK.value, programs * threads)
