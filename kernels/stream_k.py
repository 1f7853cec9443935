"""Stream-K weight-streaming GEMM for one request (Triton, CUDA): the product of kernels/stream_gemm.py
(out[M, N] = a[M, K] @ b[N, K].T, bfloat16 or FP8 with row scales, M <= 64) with its work spread
evenly over a fixed number of CTAs, one per SM.

Why: at one request a GEMM only streams its weights, and one CTA streams ~27-45 GB/s (H200, the
2026-12-04 20:20 timelines), so a shape must keep every SM busy to approach the card's 4.2 TB/s.
The split-K kernel's grid is tiles x splits: the 8b's c_attn (5,120 outputs) makes 80 CTAs of
64-wide tiles, unsplit, on 132 SMs; split 2 it makes 160, two waves of one CTA per SM (a deep
pipeline's shared memory leaves room for one). Here the (output tile, K tile) steps are numbered
tile by tile and each of CTAS programs takes one contiguous run of cdiv(steps, CTAS): every SM
streams the same number of weight tiles.

A run covers the end of one output tile, whole tiles, and the start of another; a tile whose steps
fall to more than one program is a share per program. Each share writes its float32 partial to its
own slot, and the last to finish (the tile's counter) sums the shares in program order, applies the
scales, writes the tile and resets the counter: the split-K kernel's rule, so the result does not
depend on which finished last and the counters are zero between calls. Which programs share a tile
follows from the step numbering alone, so no program waits for another.

A run is one loop over its steps, not a loop per tile: Triton pipelines it as one, so the weight
tiles of the next output tile are in flight while a tile ends (a loop per tile drained and refilled
the pipeline at every tile's end, a DRAM latency each time). Only a run's first and last tiles can
be shared, so their counters are counted after the loop, behind one barrier: a barrier inside the
loop would keep Triton from pipelining it (seen in the sm_90 code, tests/kernels/compile_sm90.py).
"""

import triton
import triton.language as tl
from cde.kernels.gemm_tiles import prefetch_weight_tiles, store_tile
from triton.language.extra.cuda import gdc_wait


@triton.jit
def stream_k_kernel(
    a_ptr,
    b_ptr,
    a_desc,
    b_desc,
    c_ptr,
    sa_ptr,
    sb_ptr,
    part_ptr,
    count_ptr,
    shares,  # partial slots per tile (tile_shares)
    M,
    N,
    K,
    stride_am,
    stride_bn,
    stride_cm,
    SCALE_A: tl.constexpr,
    SCALE_B: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    PREFETCH: tl.constexpr = 0,
    TMA: tl.constexpr = False,
):
    pid = tl.program_id(0)
    k_tiles = K // BLOCK_K
    per = tl.cdiv(tl.cdiv(N, BLOCK_N) * k_tiles, tl.num_programs(0))  # steps per program
    start = pid * per
    end = tl.minimum(start + per, tl.cdiv(N, BLOCK_N) * k_tiles)  # <= start: no work left for it
    offs_m = tl.arange(0, BLOCK_M)
    m_ok = offs_m[:, None] < M
    if PREFETCH > 0:
        # the run's first weight tiles within its first output tile, then wait for the kernel
        # before this one: its outputs are our activations
        t0 = start // k_tiles
        k0 = start - t0 * k_tiles
        ahead = tl.minimum(end - start, k_tiles - k0)  # the run's steps in that tile
        n0 = t0 * BLOCK_N + tl.arange(0, BLOCK_N)
        prefetch_weight_tiles(b_ptr, n0, N, stride_bn, k0, ahead, BLOCK_K, PREFETCH)
        gdc_wait()
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    # One loop over the run's steps, so the pipeline keeps loading across a tile's end: a whole
    # tile's store, or a shared tile's partial, runs while the next tile's first weight tiles are
    # already on their way. (A barrier in the loop would stop Triton from pipelining it, so the
    # shares are counted after it.)
    for step in range(start, end):
        tile = step // k_tiles
        kt = step - tile * k_tiles
        offs_n = tile * BLOCK_N + tl.arange(0, BLOCK_N)
        if TMA:
            a = a_desc.load([0, kt * BLOCK_K])
            b = b_desc.load([tile * BLOCK_N, kt * BLOCK_K])
        else:
            offs_k = kt * BLOCK_K + tl.arange(0, BLOCK_K)
            a = tl.load(a_ptr + offs_m[:, None] * stride_am + offs_k[None, :], mask=m_ok, other=0.0)
            b = tl.load(b_ptr + offs_n[:, None] * stride_bn + offs_k[None, :], mask=offs_n[:, None] < N, other=0.0)
        acc = tl.dot(a, tl.trans(b), acc)
        if (kt == k_tiles - 1) | (step == end - 1):  # this run's share of the tile is done
            first, last = _sharers(tile, k_tiles, per)
            if first == last:
                store_tile(acc, c_ptr, sa_ptr, sb_ptr, offs_m, offs_n, M, N, stride_cm, SCALE_A, SCALE_B)
            else:
                tl.store(_slot(part_ptr, tile, shares, pid - first, BLOCK_M, BLOCK_N), acc)
            acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    if end > start:
        # Only a run's first and last tiles can be shared with other programs.
        tl.debug_barrier()  # every thread's partials are written before a counter says so
        first_tile, last_tile = start // k_tiles, (end - 1) // k_tiles
        _count_share(first_tile, pid, per, k_tiles, c_ptr, sa_ptr, sb_ptr, part_ptr, count_ptr, shares, M, N,
                     stride_cm, SCALE_A, SCALE_B, BLOCK_M, BLOCK_N)  # fmt: skip
        if last_tile != first_tile:
            _count_share(last_tile, pid, per, k_tiles, c_ptr, sa_ptr, sb_ptr, part_ptr, count_ptr, shares, M, N,
                         stride_cm, SCALE_A, SCALE_B, BLOCK_M, BLOCK_N)  # fmt: skip


@triton.jit
def _sharers(tile, k_tiles, per):
    # the first and last programs whose runs cover this tile's steps
    return (tile * k_tiles) // per, ((tile + 1) * k_tiles - 1) // per


@triton.jit
def _slot(part_ptr, tile, shares, share, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr):
    # a tile's partial slots lie one after another, `shares` of them per tile
    offs = tl.arange(0, BLOCK_M)[:, None] * BLOCK_N + tl.arange(0, BLOCK_N)[None, :]
    return part_ptr + (tile * shares + share) * BLOCK_M * BLOCK_N + offs


@triton.jit
def _count_share(
    tile, pid, per, k_tiles, c_ptr, sa_ptr, sb_ptr, part_ptr, count_ptr, shares, M, N, stride_cm,
    SCALE_A: tl.constexpr, SCALE_B: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
):  # fmt: skip
    # A shared tile's share is written: count it; the last share sums them all in program order.
    first, last = _sharers(tile, k_tiles, per)
    if first != last:
        finished = tl.atomic_add(count_ptr + tile, 1, sem="acq_rel")
        if finished == last - first:
            acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
            for share in range(0, last - first + 1):
                acc += tl.load(_slot(part_ptr, tile, shares, share, BLOCK_M, BLOCK_N), cache_modifier=".cg")
            offs_n = tile * BLOCK_N + tl.arange(0, BLOCK_N)
            store_tile(acc, c_ptr, sa_ptr, sb_ptr, tl.arange(0, BLOCK_M), offs_n, M, N, stride_cm, SCALE_A, SCALE_B)
            tl.atomic_xchg(count_ptr + tile, 0)


def tile_shares(n: int, k: int, config: dict) -> int:
    """The most programs one output tile's steps can fall to: a tile's partial slots (`shares`)."""
    tiles, k_tiles = triton.cdiv(n, config["BLOCK_N"]), k // config["BLOCK_K"]
    per = triton.cdiv(tiles * k_tiles, config["CTAS"])
    return triton.cdiv(k_tiles - 1, per) + 1  # a tile's first step may be its first program's last


def partial_elements(n: int, k: int, config: dict) -> int:
    """The float32 partials a stream-K call with `config` may write: a slot per share of every tile."""
    return triton.cdiv(n, config["BLOCK_N"]) * tile_shares(n, k, config) * config["BLOCK_M"] * config["BLOCK_N"]
