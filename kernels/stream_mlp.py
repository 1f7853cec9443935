"""The FP8 MLP of one request (at most 64 rows) as one persistent kernel (Triton, CUDA):
c_fc, `silu(gate) * up` quantized per row to e4m3, and c_proj, the steps kernels/stream_gemm.py
and kernels/fp8_triton.py run as three launches, with the same arithmetic (the same bits for the
same K tiles).

Why one launch: at one request each GEMM only streams its weights, and every launch pays ~5 us
beside its bytes on the H200 (its start, the first tiles' latency, the last CTAs' tail:
docs/benchmarks.md, `per_shape`), plus the quantization kernel between the two GEMMs. Here one CTA
per SM runs three phases separated by grid barriers:

1. c_fc's output tiles (up and gate columns of the same outputs, as SWIGLU does), scaled, rounded
   to the activations' dtype as c_fc writes them, `silu(gate) * up` in float32 to scratch, and each
   row's running max |h| (atomic max on the float's bits: |h| >= 0 orders as an integer);
2. every row's scale (amax / 448) and the tiles of phase 1 quantized to e4m3;
3. c_proj's output tiles from the e4m3 rows, with row and channel scales.

While a CTA waits at a barrier its first c_proj weight tiles are already on their way to L2.
The barrier needs every CTA resident at once: the grid is one CTA per SM, and a CTA needs fewer
than one SM's resources. Triton's interpreter runs the programs one after another, so there (CPU
tests) the phases are launched one at a time instead (PHASE), the same code without the barriers.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from cde.kernels.fp8_triton import E4M3_MAX, MIN_SCALE
from cde.kernels.stream_gemm import _prefetch_l2
from cde.kernels.stream_tiles import MAX_ROWS
from triton.language.extra.cuda import gdc_wait

ALL_PHASES = 0


@triton.jit
def _grid_barrier(sync_ptr, ctas):
    # Sense-reversing: sync_ptr[0] counts arrivals, sync_ptr[1] is the generation; the last to
    # arrive resets the count and starts the next generation, the others wait for it. Every
    # thread's writes are done (bar.sync) before one thread releases them at GPU scope.
    tl.debug_barrier()
    generation = tl.atomic_add(sync_ptr + 1, 0, sem="acquire")
    arrived = tl.atomic_add(sync_ptr, 1, sem="acq_rel")
    if arrived == ctas - 1:
        tl.atomic_xchg(sync_ptr, 0, sem="relaxed")
        tl.atomic_add(sync_ptr + 1, 1, sem="release")
    else:
        # plain loads while waiting (read-modify-writes of one address from every SM queue at L2)
        while tl.load(sync_ptr + 1, volatile=True) == generation:
            pass
        tl.atomic_add(sync_ptr + 1, 0, sem="acquire")  # what the last CTA released is visible here
    tl.debug_barrier()


@triton.jit
def _up_gate_tiles(
    xq_ptr,
    xs_ptr,
    w_ptr,
    ws_ptr,
    h_ptr,
    amax_ptr,
    M,
    F,
    K,
    pid,
    ctas,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    OUT_DTYPE: tl.constexpr,
):
    offs_m = tl.arange(0, BLOCK_M)
    m_ok = offs_m < M
    xs = tl.load(xs_ptr + offs_m, mask=m_ok, other=0.0)
    for tile in range(pid, tl.cdiv(F, BLOCK_N), ctas):
        offs_n = tile * BLOCK_N + tl.arange(0, BLOCK_N)
        n_ok = offs_n < F
        offs_k = tl.arange(0, BLOCK_K)
        a_ptrs = xq_ptr + offs_m[:, None] * K + offs_k[None, :]
        u_ptrs = w_ptr + offs_n[:, None] * K + offs_k[None, :]
        g_ptrs = u_ptrs + F * K
        up = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        gate = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        for _ in range(0, K // BLOCK_K):
            a = tl.load(a_ptrs, mask=m_ok[:, None], other=0.0)
            up = tl.dot(a, tl.trans(tl.load(u_ptrs, mask=n_ok[:, None], other=0.0)), up)
            gate = tl.dot(a, tl.trans(tl.load(g_ptrs, mask=n_ok[:, None], other=0.0)), gate)
            a_ptrs += BLOCK_K
            u_ptrs += BLOCK_K
            g_ptrs += BLOCK_K
        # c_fc's epilogue (row scale, then channel scale, rounded to its output dtype), then
        # silu_mul_quantize's product in float32
        su = tl.load(ws_ptr + offs_n, mask=n_ok, other=0.0)
        sg = tl.load(ws_ptr + F + offs_n, mask=n_ok, other=0.0)
        up = (up * xs[:, None] * su[None, :]).to(OUT_DTYPE).to(tl.float32)
        gate = (gate * xs[:, None] * sg[None, :]).to(OUT_DTYPE).to(tl.float32)
        h = gate * tl.sigmoid(gate) * up
        ok = m_ok[:, None] & n_ok[None, :]
        tl.store(h_ptr + offs_m[:, None] * F + offs_n[None, :], h, mask=ok)
        amax = tl.max(tl.where(ok, tl.abs(h), 0.0), axis=1)
        tl.atomic_max(amax_ptr + offs_m, amax.to(tl.int32, bitcast=True), mask=m_ok, sem="relaxed")


@triton.jit
def _quantize_tiles(h_ptr, hq_ptr, scale, M, F, pid, ctas, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr):
    offs_m = tl.arange(0, BLOCK_M)
    for tile in range(pid, tl.cdiv(F, BLOCK_N), ctas):
        offs_n = tile * BLOCK_N + tl.arange(0, BLOCK_N)
        ok = (offs_m[:, None] < M) & (offs_n[None, :] < F)
        offs = offs_m[:, None] * F + offs_n[None, :]
        h = tl.load(h_ptr + offs, mask=ok, other=0.0, cache_modifier=".cg")
        q = tl.clamp(tl.div_rn(h, scale[:, None]), -E4M3_MAX, E4M3_MAX)
        tl.store(hq_ptr + offs, q.to(hq_ptr.dtype.element_ty), mask=ok)


@triton.jit
def _down_tiles(
    hq_ptr,
    scale,
    w_ptr,
    ws_ptr,
    out_ptr,
    M,
    N,
    F,
    pid,
    ctas,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
):
    offs_m = tl.arange(0, BLOCK_M)
    m_ok = offs_m < M
    for tile in range(pid, tl.cdiv(N, BLOCK_N), ctas):
        offs_n = tile * BLOCK_N + tl.arange(0, BLOCK_N)
        n_ok = offs_n < N
        offs_k = tl.arange(0, BLOCK_K)
        a_ptrs = hq_ptr + offs_m[:, None] * F + offs_k[None, :]
        b_ptrs = w_ptr + offs_n[:, None] * F + offs_k[None, :]
        acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        for _ in range(0, F // BLOCK_K):
            a = tl.load(a_ptrs, mask=m_ok[:, None], other=0.0, cache_modifier=".cg")  # written by other CTAs
            acc = tl.dot(a, tl.trans(tl.load(b_ptrs, mask=n_ok[:, None], other=0.0)), acc)
            a_ptrs += BLOCK_K
            b_ptrs += BLOCK_K
        sb = tl.load(ws_ptr + offs_n, mask=n_ok, other=0.0)
        acc = acc * scale[:, None]
        acc = acc * sb[None, :]
        out = out_ptr + offs_m[:, None] * N + offs_n[None, :]
        tl.store(out, acc.to(out_ptr.dtype.element_ty), mask=m_ok[:, None] & n_ok[None, :])


@triton.jit
def _fp8_mlp_kernel(
    xq_ptr,
    xs_ptr,
    wfc_ptr,
    sfc_ptr,
    wpj_ptr,
    spj_ptr,
    h_ptr,
    hq_ptr,
    hs_ptr,
    amax_ptr,
    sync_ptr,
    out_ptr,
    M,
    F,
    N,
    K,
    BLOCK_M: tl.constexpr,
    BN_FC: tl.constexpr,
    BK_FC: tl.constexpr,
    BN_PJ: tl.constexpr,
    BK_PJ: tl.constexpr,
    PREFETCH: tl.constexpr,
    PHASE: tl.constexpr,
):
    pid = tl.program_id(0)
    ctas = tl.num_programs(0)
    offs_m = tl.arange(0, BLOCK_M)
    if PHASE == 0 or PHASE == 1:
        if PREFETCH > 0:  # launched with programmatic dependent launch: c_fc's first tiles meanwhile
            offs_n = pid * BN_FC + tl.arange(0, BN_FC)
            lines = offs_n[:, None] * K + tl.arange(0, BK_FC // 64)[None, :] * 64
            for t in tl.static_range(PREFETCH):
                _prefetch_l2(wfc_ptr + lines + t * BK_FC, offs_n[:, None] < F, wfc_ptr)
                _prefetch_l2(wfc_ptr + F * K + lines + t * BK_FC, offs_n[:, None] < F, wfc_ptr)
            gdc_wait()
        _up_gate_tiles(
            xq_ptr,
            xs_ptr,
            wfc_ptr,
            sfc_ptr,
            h_ptr,
            amax_ptr,
            M,
            F,
            K,
            pid,
            ctas,
            BLOCK_M,
            BN_FC,
            BK_FC,
            out_ptr.dtype.element_ty,
        )
    if PHASE == 0:
        # c_proj's first tiles to L2 while the other CTAs finish c_fc
        offs_n = pid * BN_PJ + tl.arange(0, BN_PJ)
        lines = offs_n[:, None] * F + tl.arange(0, BK_PJ // 64)[None, :] * 64
        for t in tl.static_range(4):
            _prefetch_l2(wpj_ptr + lines + t * BK_PJ, offs_n[:, None] < N, wpj_ptr)
        _grid_barrier(sync_ptr, ctas)
    if PHASE == 0 or PHASE == 2:
        # kernels/fp8_triton.py's _quantize_row: amax / 448, at least MIN_SCALE
        bits = tl.load(amax_ptr + offs_m, mask=offs_m < M, other=0, cache_modifier=".cg")
        scale = tl.maximum(bits.to(tl.float32, bitcast=True) / E4M3_MAX, MIN_SCALE)
        if pid == 0:
            tl.store(hs_ptr + offs_m, scale, mask=offs_m < M)
        _quantize_tiles(h_ptr, hq_ptr, scale, M, F, pid, ctas, BLOCK_M, BN_FC)
    if PHASE == 0:
        _grid_barrier(sync_ptr, ctas)  # every CTA has read the row maxima and written its e4m3 tiles
    if PHASE == 3:  # interpreted: the scales of the launch before
        scale = tl.load(hs_ptr + offs_m, mask=offs_m < M, other=1.0)
    if PHASE == 0 or PHASE == 3:
        if pid == 0:  # the next call's row maxima start from zero
            tl.store(amax_ptr + offs_m, tl.zeros((BLOCK_M,), dtype=tl.int32))
        _down_tiles(hq_ptr, scale, wpj_ptr, spj_ptr, out_ptr, M, N, F, pid, ctas, BLOCK_M, BN_PJ, BK_PJ)


def scratch(device: torch.device | str) -> torch.Tensor:
    """The kernel's state between calls, zero before and after each: row maxima, barrier count and generation."""
    return torch.zeros(MAX_ROWS + 2, dtype=torch.int32, device=device)


def fp8_mlp(
    xq: torch.Tensor,
    x_scale: torch.Tensor,
    w_fc: torch.Tensor,
    s_fc: torch.Tensor,
    w_proj: torch.Tensor,
    s_proj: torch.Tensor,
    state: torch.Tensor,
    out_dtype: torch.dtype,
    config: dict | None = None,
    ctas: int | None = None,
    prefetch: int = 0,
    phased: bool = False,
) -> torch.Tensor:
    """e4m3 rows xq [M, K] (M <= 64) with float32 scales [M]; c_fc's e4m3 weight [2F, K] (up rows,
    then gate rows) and scales [2F]; c_proj's [N, F] and [N] -> [M, N] in out_dtype: c_proj of
    silu(gate) * up quantized per row, as fp8_matmul, silu_mul_quantize and fp8_matmul compute it.
    `state`: `scratch(device)`, used by one stream at a time. `ctas`: the grid (default: one CTA per
    output tile, at most what the GPU holds at once); `phased`: the three phases as three launches
    (no barriers; what Triton's interpreter always runs)."""
    m, k = xq.shape
    f = w_fc.shape[0] // 2
    n = w_proj.shape[0]
    cfg = {"BN_FC": 128, "BK_FC": 128, "BN_PJ": 32, "BK_PJ": 256, "num_warps": 4, "num_stages": 4}
    cfg.update(config or {})
    if m > MAX_ROWS or k % cfg["BK_FC"] or f % cfg["BK_PJ"] or w_proj.shape[1] != f:
        raise ValueError(f"fp8_mlp takes at most {MAX_ROWS} rows and K, F multiples of its K tiles")
    h = torch.empty(m, f, dtype=torch.float32, device=xq.device)
    hq = torch.empty(m, f, dtype=xq.dtype, device=xq.device)
    hs = torch.empty(m, dtype=torch.float32, device=xq.device)
    out = torch.empty(m, n, dtype=out_dtype, device=xq.device)
    interpreted = not xq.is_cuda
    args = (xq, x_scale, w_fc, s_fc, w_proj, s_proj, h, hq, hs, state[:MAX_ROWS], state[MAX_ROWS:], out, m, f, n, k)
    flags = {"BLOCK_M": MAX_ROWS, "PREFETCH": prefetch, **cfg}
    if prefetch:
        flags["launch_pdl"] = True
    tiles = max(triton.cdiv(f, cfg["BN_FC"]), triton.cdiv(n, cfg["BN_PJ"]))
    if interpreted or phased:
        for phase in (1, 2, 3):
            _fp8_mlp_kernel[(ctas or tiles,)](*args, **flags, PHASE=phase)
        return out
    resident = _resident_ctas(args, flags, xq.device)
    ctas = min(ctas or tiles, resident)
    _fp8_mlp_kernel[(ctas,)](*args, **flags, PHASE=ALL_PHASES)
    return out


def _resident_ctas(args: tuple, flags: dict, device: torch.device) -> int:
    """How many CTAs of the barrier kernel the GPU holds at once (all of them must be, or the first
    barrier waits forever): SMs x CTAs per SM by shared memory, registers and warps."""
    kernel = _fp8_mlp_kernel.warmup(*args, **flags, PHASE=ALL_PHASES, grid=(1,))
    kernel._init_handles()  # loads the module: its register count is known from here
    props = triton.runtime.driver.active.utils.get_device_properties(device.index or 0)
    threads = 32 * kernel.metadata.num_warps
    per_sm = min(
        props["max_shared_mem"] // max(kernel.metadata.shared, 1),
        props["max_num_regs"] // max(kernel.n_regs * threads, 1),
        2048 // threads,
    )
    if per_sm < 1:
        raise ValueError("fp8_mlp's config does not fit one SM")
    return per_sm * props["multiprocessor_count"]
