"""Weight-streaming GEMM for few rows (Triton, CUDA): out[M, N] = a[M, K] @ b[N, K].T, in bfloat16,
in FP8 with row scales (out = (aq @ bq.T) * sa[:, None] * sb[None, :]), or with bfloat16 activations
and FP8 weights (out = (a @ bq.T) * sb[None, :]: the weight tile is widened to bfloat16 in registers,
exactly, so a one-request pass reads FP8 weights without quantizing its activations); or, in
bfloat16, the MLP's up projection with `silu(gate) * up` in its epilogue (SWIGLU: b is c_fc's
weight [2N, K], up rows first; each CTA streams the up and gate rows of its output columns and
writes only their product, so the [M, 2N] projection never goes to memory and no pointwise kernel
reads it back).

At 64 rows (one request) a pass is bound by reading every weight once. cuBLAS reads the FP8
weights at about half the bandwidth there, and its bfloat16 kernels for the 8b's narrower shapes
(4096 outputs) reach 65-70% of it (docs/benchmarks.md). This kernel streams each weight slab once
with a deep pipeline over narrow output tiles and also splits K (SPLIT_K), so that even 4,096
outputs make enough CTAs for every SM. A split tile's CTAs write float32 partials; the last to
finish (a per-tile counter) sums them in split order, so the result does not depend on which
finished last, applies the scales and writes the tile: no second kernel. It then resets its
counter, so the counters are zero between calls and the op is pure from outside.

PREFETCH > 0 launches the kernel with programmatic dependent launch (Hopper): its CTAs start while
the kernel before it still runs (once that kernel's CTAs signal `gdc_launch_dependents`, as
kernels/fp8_triton.py's do), prefetch their first PREFETCH weight tiles into L2 (weights are never
written, so they may be read early) and wait (`gdc_wait`) for the kernel before to finish before
they read the activations or write anything. A weight-streaming GEMM of ~15 us per call loses ~4 us
to its start (launch, the first tiles' DRAM latency); the short latency-bound kernels before it
leave HBM idle meanwhile.

A config may load the tiles by TMA (Hopper's tensor memory accelerator; `tma_fits`): one bulk
copy per tile into shared memory, which streams a CTA's weights faster than its threads' own loads.
The autotuner (per-thread loads) times one weight's eager calls, which stay in L2 and launch alone;
at warm-up the engine instead times its candidates over the layers' own weights as a pass runs them
and pins the fastest (worker/gemm_tuning.py; `stream_gemm(pin=True)`, kernels/stream_gemm_configs.py).

Imported only where Triton is installed (CUDA machines; the CPU tests run it in Triton's
interpreter: tests/kernels/test_triton_interpreted.py).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from cde.kernels.gemm_tiles import prefetch_weight_tiles, store_tile
from cde.kernels.stream_gemm_configs import autotune_configs, pin_config, pinned_config, prune_configs, tma_fits
from cde.kernels.stream_k import partial_elements, stream_k_kernel, tile_shares
from cde.kernels.stream_tiles import K_MULTIPLE, MAX_ROWS, MAX_SPLIT_K, MIN_BLOCK_N
from triton.language.extra.cuda import gdc_wait
from triton.tools.tensor_descriptor import TensorDescriptor


@triton.jit
def _stream_gemm_kernel(
    a_ptr,
    b_ptr,
    a_desc,
    b_desc,
    c_ptr,
    sa_ptr,
    sb_ptr,
    part_ptr,
    count_ptr,
    timeline_ptr,
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
    SPLIT_K: tl.constexpr,
    SWAP_AB: tl.constexpr,
    SWIGLU: tl.constexpr = False,
    PREFETCH: tl.constexpr = 0,
    TIMELINE: tl.constexpr = False,
    TMA: tl.constexpr = False,
):
    if TIMELINE:
        started = _globaltimer()
    pid_n = tl.program_id(0)
    pid_m = tl.program_id(1)
    pid_k = tl.program_id(2)
    k_tiles = K // BLOCK_K
    per_split = tl.cdiv(k_tiles, SPLIT_K)
    k_first = pid_k * per_split
    k_count = tl.minimum(per_split, k_tiles - k_first)  # <= 0: an uneven split's last shares are empty
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_k = k_first * BLOCK_K + tl.arange(0, BLOCK_K)
    a_ptrs = a_ptr + offs_m[:, None] * stride_am + offs_k[None, :]
    b_ptrs = b_ptr + offs_n[:, None] * stride_bn + offs_k[None, :]  # [BLOCK_N, BLOCK_K], K contiguous
    m_ok = offs_m[:, None] < M
    n_ok = offs_n[:, None] < N
    g_ptrs = b_ptrs + N * stride_bn  # SWIGLU: the gate rows of the same output columns
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    acc_g = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)  # SWIGLU: gate
    acc_t = tl.zeros((BLOCK_N, BLOCK_M), dtype=tl.float32)  # SWAP_AB: out.T = b @ a.T
    if PREFETCH > 0:
        prefetch_weight_tiles(b_ptr, offs_n, N, stride_bn, k_first, k_count, BLOCK_K, PREFETCH)
        gdc_wait()  # the kernel before this one has finished: its outputs (our activations) are visible
    for i in range(0, k_count):
        k_at = (k_first + i) * BLOCK_K
        if TMA:  # bulk copies into shared memory (zeros past M and N), no address arithmetic per thread
            a = a_desc.load([pid_m * BLOCK_M, k_at])
            b = b_desc.load([pid_n * BLOCK_N, k_at]).to(a.dtype)
        else:
            a = tl.load(a_ptrs, mask=m_ok, other=0.0)
            b = tl.load(b_ptrs, mask=n_ok, other=0.0).to(a.dtype)  # FP8 weights beside bf16 rows: widened, exactly
        if SWAP_AB:
            acc_t = tl.dot(b, tl.trans(a), acc_t)
        else:
            acc = tl.dot(a, tl.trans(b), acc)
        if SWIGLU:
            if TMA:
                g = b_desc.load([N + pid_n * BLOCK_N, k_at])
            else:
                g = tl.load(g_ptrs, mask=n_ok, other=0.0)
            acc_g = tl.dot(a, tl.trans(g), acc_g)
            g_ptrs += BLOCK_K
        a_ptrs += BLOCK_K
        b_ptrs += BLOCK_K
    if SWAP_AB:
        acc = tl.trans(acc_t)
    if TIMELINE:
        streamed = _globaltimer()
    tile_ok = m_ok & (offs_n[None, :] < N)
    if SPLIT_K > 1:
        tile_offs = offs_m[:, None] * N + offs_n[None, :]
        tl.store(part_ptr + pid_k * M * N + tile_offs, acc, mask=tile_ok)
        if SWIGLU:  # the gate partials after every share's up partials
            tl.store(part_ptr + (SPLIT_K + pid_k) * M * N + tile_offs, acc_g, mask=tile_ok)
        tl.debug_barrier()  # every thread's partial is written before the counter says so
        tile = pid_m * tl.num_programs(0) + pid_n
        finished = tl.atomic_add(count_ptr + tile, 1, sem="acq_rel")
        if finished == SPLIT_K - 1:  # the last of the tile: sum every share in split order
            acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
            acc_g = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
            for s in range(SPLIT_K):  # a loop, not unrolled: SPLIT_K tiles in flight spilled registers
                acc += tl.load(part_ptr + s * M * N + tile_offs, mask=tile_ok, other=0.0, cache_modifier=".cg")
                if SWIGLU:
                    acc_g += tl.load(
                        part_ptr + (SPLIT_K + s) * M * N + tile_offs, mask=tile_ok, other=0.0, cache_modifier=".cg"
                    )
            if SWIGLU:
                acc = _silu_mul(acc, acc_g, c_ptr.dtype.element_ty)
            store_tile(acc, c_ptr, sa_ptr, sb_ptr, offs_m, offs_n, M, N, stride_cm, SCALE_A, SCALE_B)
            tl.atomic_xchg(count_ptr + tile, 0)
    else:
        if SWIGLU:
            acc = _silu_mul(acc, acc_g, c_ptr.dtype.element_ty)
        store_tile(acc, c_ptr, sa_ptr, sb_ptr, offs_m, offs_n, M, N, stride_cm, SCALE_A, SCALE_B)
    if TIMELINE:  # per CTA: start, loop done, end (ns) and its SM, for scripts/sweep_stream_gemm.py --timeline
        cta = (pid_k * tl.num_programs(1) + pid_m) * tl.num_programs(0) + pid_n
        tl.store(timeline_ptr + cta * 4 + 0, started)
        tl.store(timeline_ptr + cta * 4 + 1, streamed)
        tl.store(timeline_ptr + cta * 4 + 2, _globaltimer())
        tl.store(timeline_ptr + cta * 4 + 3, _smid().to(tl.int64))


@triton.jit
def _globaltimer():
    return tl.inline_asm_elementwise("mov.u64 $0, %globaltimer;", "=l", [], dtype=tl.int64, is_pure=False, pack=1)


@triton.jit
def _smid():
    return tl.inline_asm_elementwise("mov.u32 $0, %smid;", "=r", [], dtype=tl.int32, is_pure=True, pack=1)


@triton.jit
def _silu_mul(up, gate, dtype):
    # The unfused path's numerics: up and gate rounded to the output dtype as c_fc writes them,
    # then silu(gate) * up in float32 as the compiled pointwise kernel computes it.
    up = up.to(dtype).to(tl.float32)
    gate = gate.to(dtype).to(tl.float32)
    return gate * tl.sigmoid(gate) * up


def _bench(kernel_call: object, quantiles: list[float]) -> list[float]:
    # A short timing per candidate: the engine autotunes every weight shape at its warm-up.
    return triton.testing.do_bench(kernel_call, warmup=5, rep=20, quantiles=quantiles)


# Keyed by the weight's shape, not by M: every call fits one row tile, and a new row count (a short
# prompt's dense pass) must not autotune again while requests run.
_KEY = ["N", "K", "SCALE_A", "SCALE_B", "SWIGLU", "PREFETCH"]
_autotuned = triton.autotune(
    configs=autotune_configs(), key=_KEY, prune_configs_by={"early_config_prune": prune_configs}, do_bench=_bench
)(_stream_gemm_kernel)


def counter_count(n: int) -> int:
    """Tile counters a weight with n output rows needs (one row tile, the narrowest output tile)."""
    return triton.cdiv(n, MIN_BLOCK_N)


def stream_gemm(
    a: torch.Tensor,
    b: torch.Tensor,
    counters: torch.Tensor,
    out_dtype: torch.dtype,
    scales: tuple[torch.Tensor | None, torch.Tensor] | None = None,
    config: dict | None = None,
    swiglu: bool = False,
    prefetch: int = 0,
    timeline: torch.Tensor | None = None,
    pin: bool = False,
) -> torch.Tensor:
    """a [M, K] (M <= MAX_ROWS), b [N, K] row-major -> [M, N] in out_dtype: both bfloat16; or both e4m3
    with `scales` = (sa [M], sb [N]) float32; or a bfloat16 and b e4m3 with `scales` = (None, sb).
    `swiglu` (both bfloat16, no scales): b is [2N, K], up rows then gate rows, and the result is
    silu(a @ gate.T) * (a @ up.T) [M, N]. `counters`: counter_count(N) int32 zeros, used by one
    stream at a time (and zero again after every call). `config`: fixed kernel meta-parameters
    (BLOCK_M, BLOCK_N, BLOCK_K, SPLIT_K, SWAP_AB; num_warps, num_stages; TMA: the tiles loaded by
    Hopper's tensor memory accelerator) instead of the autotuner's choice, or (BLOCK_M, BLOCK_N,
    BLOCK_K, CTAS, TMA; num_warps, num_stages) for kernels/stream_k.py's stream-K kernel on CTAS
    programs; `pin`: and from now on
    for every call without one of this weight shape, dtypes and flags (worker/gemm_tuning.py pins
    the config it timed fastest over the layers' chain; stream_gemm_configs.pinned_configs).
    `prefetch` > 0: launched with programmatic dependent launch, that many weight tiles to L2 first.
    `timeline` (CUDA, a diagnostic): int64 [CTAs, 4] that each CTA fills with its start, the end of
    its K loop and its end (%globaltimer, ns) and its SM."""
    a, b = a.contiguous(), b.contiguous()  # K is the unit-stride axis of both (no copy when it is)
    m, k = a.shape
    n = b.shape[0] // 2 if swiglu else b.shape[0]
    if swiglu and (scales is not None or a.dtype != b.dtype or b.shape[0] % 2):
        raise ValueError("stream_gemm's swiglu takes two same-dtype operands, no scales, and an even row count")
    if k % K_MULTIPLE or m > MAX_ROWS or counters.numel() < counter_count(n):
        raise ValueError(
            f"stream_gemm needs K divisible by {K_MULTIPLE}, at most {MAX_ROWS} rows and {counter_count(n)} "
            f"counters, got [{m}, {k}] and {counters.numel()}"
        )
    out = torch.empty(m, n, dtype=out_dtype, device=a.device)
    sa, sb = scales if scales is not None else (None, None)

    def grid(meta: dict) -> tuple[int, int, int]:
        return triton.cdiv(n, meta["BLOCK_N"]), triton.cdiv(m, meta["BLOCK_M"]), meta["SPLIT_K"]

    flags = {"SCALE_A": sa is not None, "SCALE_B": sb is not None, "SWIGLU": swiglu, "PREFETCH": prefetch}
    key = (n, k, a.dtype, b.dtype, *flags.values())
    if pin:
        if config is None:
            raise ValueError("stream_gemm pins the config it is given: pass one")
        pin_config(key, config)
    config = config or pinned_config(key)
    if config is not None and config.get("TMA") and not tma_fits(a, b):
        config = {**config, "TMA": False}  # a view off the 16-byte grid: the same tiles by per-thread loads
    tma = config is not None and config.get("TMA", False)  # the autotuner's calls: per-thread loads
    stream_k = config if config is not None and "CTAS" in config else None  # kernels/stream_k.py's
    if stream_k is not None and (swiglu or timeline is not None or a.dtype != b.dtype):
        raise ValueError("stream_gemm's stream-K configs take same-dtype operands, no swiglu and no timeline")
    # Partials for the largest split (or the stream-K shares): allocated per call from the caching
    # allocator (inside a CUDA graph, from its pool), never initialised: each share writes its own
    # before it is read.
    parts = partial_elements(n, k, stream_k) if stream_k is not None else (2 if swiglu else 1) * MAX_SPLIT_K * m * n
    part = torch.empty(parts, dtype=torch.float32, device=a.device)
    if timeline is not None:
        flags["TIMELINE"] = True
    if prefetch:
        flags["launch_pdl"] = True
    # a scale the flags leave off is never read: `out` stands in for its pointer
    scale_ptrs = (out if sa is None else sa, out if sb is None else sb)
    descs = _descriptors(a, b, config) if config is not None and tma else (None, None)
    operands = (a, b, *descs, out, *scale_ptrs, part, counters)
    dims = (m, n, k, a.stride(0), b.stride(0), out.stride(0))
    if stream_k is not None:
        del flags["SWIGLU"]
        meta = {name: v for name, v in stream_k.items() if name != "CTAS"}
        stream_k_kernel[(stream_k["CTAS"],)](*operands, tile_shares(n, k, stream_k), *dims, **flags, **meta)
        return out
    timeline_ptr = out if timeline is None else timeline  # unread without TIMELINE
    args = (*operands, timeline_ptr, *dims)
    if config is None:
        _autotuned[grid](*args, **flags)
    else:
        _stream_gemm_kernel[grid](*args, **flags, **config)
    return out


def _descriptors(a: torch.Tensor, b: torch.Tensor, config: dict) -> tuple:
    """TMA descriptors of the operands with the config's tile shapes (the autotuner's own calls,
    per-thread loads, take none)."""
    return (
        TensorDescriptor.from_tensor(a, [config["BLOCK_M"], config["BLOCK_K"]]),
        TensorDescriptor.from_tensor(b, [config["BLOCK_N"], config["BLOCK_K"]]),
    )


def tuned_launch_configs() -> dict[tuple, dict]:
    """The autotuner's choices as `stream_gemm(config=...)`, per key (N, K, SCALE_A, SCALE_B, SWIGLU,
    PREFETCH, dtypes)."""
    return {
        key: {**c.kwargs, "num_warps": c.num_warps, "num_stages": c.num_stages} for key, c in _autotuned.cache.items()
    }


def tuned_configs() -> list[tuple[tuple, str]]:
    """What the autotuner chose so far, per (N, K, SCALE_A, SCALE_B, dtypes...) key (the benchmark prints it)."""
    return [(key, str(config)) for key, config in _autotuned.cache.items()]
