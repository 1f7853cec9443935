"""The Triton kernels on the CPU, in Triton's interpreter (tests/conftest.py sets TRITON_INTERPRET
without a GPU), against float64 or the CPU ops they replace on CUDA: the split-K weight-streaming
GEMM (kernels/stream_gemm.py) at every split shape it can meet, and selection's row confidence
(kernels/row_confidence.py). The
interpreter runs a grid's programs one after another, so the split-K tile counters' "last to
finish" is checked for its arithmetic, not for races; test_gpu.py runs the kernels on the H200.

The interpreter decodes bfloat16 loads wrongly, so the GEMM's bfloat16 path runs here on float16
(the kernel is the same for both: tl.dot of the loaded tiles, float32 accumulation). It also rounds
float32 to e4m3 without carrying into the exponent (7.9 becomes 4.0), so the FP8 activation
quantizer (kernels/fp8_triton.py) is checked on the GPU only."""

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from cde.kernels import fp8_ops, row_confidence, stream_gemm, stream_gemm_configs, stream_k
from cde.kernels.stream_ops import tile_counters

assert os.environ.get("TRITON_INTERPRET") == "1" or torch.cuda.is_available()


def config(block_n: int, block_k: int, split_k: int, swap_ab: bool = False) -> dict:
    return {
        "BLOCK_M": stream_gemm.MAX_ROWS,
        "BLOCK_N": block_n,
        "BLOCK_K": block_k,
        "SPLIT_K": split_k,
        "SWAP_AB": swap_ab,
    }


# (rows, outputs, K, kernel config): full and partial row and column tiles; K tiles split evenly,
# unevenly (3 tiles in 2 shares) and with empty shares (4 tiles in 8).
CASES = [
    (64, 128, 512, config(32, 128, 1)),
    (64, 96, 768, config(64, 256, 2)),
    (5, 128, 512, config(32, 128, 8)),
    (17, 160, 1024, config(128, 256, 4)),
]


def stream_k_config(block_n: int, block_k: int, ctas: int) -> dict:
    return {"BLOCK_M": stream_gemm.MAX_ROWS, "BLOCK_N": block_n, "BLOCK_K": block_k, "CTAS": ctas}


# The stream-K kernel (kernels/stream_k.py) on the same tests: a tile's steps shared by 2 programs,
# by 3 (16 steps in runs of 6), a run that ends one tile and starts the next, programs left without
# work, one program for all, partial row and column tiles.
STREAM_K_CASES = [
    (64, 128, 1024, stream_k_config(32, 128, 5)),
    (64, 64, 2048, stream_k_config(64, 128, 3)),
    (64, 96, 1280, stream_k_config(32, 256, 5)),  # 5 steps a tile in runs of 3: the middle tile falls to 3
    (17, 96, 768, stream_k_config(32, 256, 2)),
    (5, 160, 512, stream_k_config(64, 128, 11)),
    (8, 96, 512, stream_k_config(32, 256, 1)),
]


TMA = pytest.mark.parametrize("tma", [False, True], ids=["pointer_loads", "tma_loads"])


@TMA
@pytest.mark.parametrize("m,n,k,cfg", CASES + STREAM_K_CASES)
def test_stream_gemm_is_the_product_at_every_split(m, n, k, cfg, tma):
    cfg = {**cfg, "TMA": tma}
    g = torch.Generator().manual_seed(m + n + k)
    a = torch.randn(m, k, generator=g).half()
    b = (torch.randn(n, k, generator=g) * 0.05).half()
    counters = torch.zeros(stream_gemm.counter_count(n), dtype=torch.int32)
    out = stream_gemm.stream_gemm(a, b, counters, torch.float32, config=cfg)
    ref = a.double() @ b.double().t()
    assert torch.allclose(out.double(), ref, rtol=1e-5, atol=1e-5), (out.double() - ref).abs().max()
    assert not counters.any()  # the last share of every tile reset its counter
    again = stream_gemm.stream_gemm(a, b, counters, torch.float32, config=cfg)
    assert torch.equal(again, out)  # summed in split order: the same bits every call


@TMA
@pytest.mark.parametrize("m,n,k,cfg", CASES + STREAM_K_CASES[:3])
def test_stream_gemm_fp8_applies_row_and_channel_scales(m, n, k, cfg, tma):
    cfg = {**cfg, "TMA": tma}
    g = torch.Generator().manual_seed(m * n + k)
    xq, xs = fp8_ops.quantize_rows(torch.randn(m, k, generator=g))
    wq, ws = fp8_ops.quantize_rows(torch.randn(n, k, generator=g) * 0.02)
    counters = torch.zeros(stream_gemm.counter_count(n), dtype=torch.int32)
    out = stream_gemm.stream_gemm(xq, wq, counters, torch.float32, scales=(xs[:, 0], ws[:, 0]), config=cfg)
    ref = fp8_ops.fp8_matmul(xq, xs[:, 0], wq, ws[:, 0], tile_counters(n, "cpu"), torch.float32)
    assert torch.allclose(out, ref, rtol=1e-5, atol=1e-6), (out - ref).abs().max()
    assert not counters.any()


@pytest.mark.parametrize("swap_ab", [False, True], ids=["weights_second", "weights_first"])
@pytest.mark.parametrize("m,n,k,cfg", CASES)
def test_stream_gemm_weight_only_widens_fp8_weights_and_applies_channel_scales(m, n, k, cfg, swap_ab):
    cfg = {**cfg, "SWAP_AB": swap_ab}  # the MMA's operand order: both are offered to the autotuner
    g = torch.Generator().manual_seed(m * k + n)
    x = torch.randn(m, k, generator=g).half()
    wq, ws = fp8_ops.quantize_rows(torch.randn(n, k, generator=g) * 0.02)
    counters = torch.zeros(stream_gemm.counter_count(n), dtype=torch.int32)
    out = stream_gemm.stream_gemm(x, wq, counters, torch.float32, scales=(None, ws[:, 0]), config=cfg)
    ref = (x.double() @ wq.double().t()) * ws.double().t()
    assert torch.allclose(out.double(), ref, rtol=1e-5, atol=1e-6), (out.double() - ref).abs().max()
    assert not counters.any()


@TMA
@pytest.mark.parametrize("m,n,k,cfg", CASES)
def test_stream_gemm_swiglu_writes_silu_gate_times_up(m, n, k, cfg, tma):
    """c_fc's weight [2n, K] (up rows, then gate rows) -> silu(gate) * up [m, n], with the unfused
    path's roundings: up and gate rounded to the output dtype, the product in float32."""
    cfg = {**cfg, "TMA": tma}
    g = torch.Generator().manual_seed(m + 2 * n + k)
    a = torch.randn(m, k, generator=g).half()
    w = (torch.randn(2 * n, k, generator=g) * 0.05).half()
    counters = torch.zeros(stream_gemm.counter_count(n), dtype=torch.int32)
    out = stream_gemm.stream_gemm(a, w, counters, torch.float16, config=cfg, swiglu=True)
    up, gate = (a.double() @ w.double().t()).half().float().chunk(2, dim=-1)
    ref = (torch.nn.functional.silu(gate) * up).half()
    assert out.shape == (m, n)
    assert torch.allclose(out.float(), ref.float(), rtol=2e-3, atol=1e-4), (out.float() - ref.float()).abs().max()
    assert not counters.any()
    assert torch.equal(stream_gemm.stream_gemm(a, w, counters, torch.float16, config=cfg, swiglu=True), out)


def test_stream_k_slots_hold_every_share_of_a_tile():
    """tile_shares against the programs' runs counted one by one: every tile's shares get a slot."""
    for tiles in (1, 3, 80, 160):
        for k_tiles in (1, 2, 5, 16, 64):
            for ctas in (1, 2, 5, 7, 132):
                cfg = stream_k_config(32, 256, ctas)
                per = -(-tiles * k_tiles // ctas)
                owners = [{step // per for step in range(t * k_tiles, (t + 1) * k_tiles)} for t in range(tiles)]
                assert max(map(len, owners)) <= stream_k.tile_shares(32 * tiles, 256 * k_tiles, cfg)


def test_stream_k_refuses_what_it_does_not_compute():
    a, counters = torch.zeros(64, 512).half(), torch.zeros(stream_gemm.counter_count(96), dtype=torch.int32)
    wq = torch.zeros(96, 512, dtype=torch.float8_e4m3fn)
    for args, kwargs in (
        ((a, torch.zeros(192, 512).half()), {"swiglu": True}),
        ((a, wq), {"scales": (None, torch.ones(96))}),  # weight-only: the split-K kernel widens
    ):
        with pytest.raises(ValueError, match="stream-K"):
            stream_gemm.stream_gemm(*args, counters, torch.float32, config=stream_k_config(32, 128, 4), **kwargs)


def _tiles_bytes(c, a_bytes: int, b_bytes: int, weight_tiles: int = 1) -> int:
    """What an unswapped config's pipeline holds in shared memory, counted here from its tiles."""
    return c.num_stages * c.kwargs["BLOCK_K"] * (64 * a_bytes + weight_tiles * c.kwargs["BLOCK_N"] * b_bytes)


def test_swiglu_keeps_the_pipelines_of_two_weight_tiles_that_fit_and_no_swapped_operands():
    configs = stream_gemm_configs.autotune_configs()
    half = torch.zeros(1, dtype=torch.float16)
    plain = stream_gemm_configs.prune_configs(configs, {"a_ptr": half, "b_ptr": half})
    fused = stream_gemm_configs.prune_configs(configs, {"a_ptr": half, "b_ptr": half}, SWIGLU=True)
    assert fused and set(map(str, fused)) < set(map(str, plain))
    unswapped = [c for c in configs if not c.kwargs["SWAP_AB"]]
    # exactly the unswapped configs whose up and gate tiles with the rows' fit Hopper's 227 KB
    assert set(map(str, fused)) == {str(c) for c in unswapped if _tiles_bytes(c, 2, 2, 2) <= 227 * 1024}


def test_only_the_widening_mode_offers_swapped_operands_to_the_autotuner():
    configs = stream_gemm_configs.autotune_configs()
    bf16, fp8 = torch.zeros(1, dtype=torch.float16), torch.zeros(1, dtype=torch.float8_e4m3fn)
    for a, b, swapped in ((bf16, bf16, False), (fp8, fp8, False), (bf16, fp8, True)):
        kept = stream_gemm_configs.prune_configs(configs, {"a_ptr": a, "b_ptr": b})
        assert any(c.kwargs["SWAP_AB"] for c in kept) is swapped
        fitting = [
            c
            for c in configs
            if not c.kwargs["SWAP_AB"] and _tiles_bytes(c, a.element_size(), b.element_size()) <= 227 * 1024
        ]
        assert {str(c) for c in kept if not c.kwargs["SWAP_AB"]} == set(map(str, fitting))


def test_stream_gemm_refuses_what_it_cannot_compute():
    a, b = torch.zeros(64, 512).half(), torch.zeros(96, 512).half()
    enough = torch.zeros(stream_gemm.counter_count(96), dtype=torch.int32)
    for args, what in (
        ((torch.zeros(65, 512).half(), b, enough), "at most 64 rows"),
        ((torch.zeros(64, 320).half(), torch.zeros(96, 320).half(), enough), "K divisible by 256"),
        ((a, b, enough[:-1]), "3 counters"),
    ):
        with pytest.raises(ValueError, match=what):
            stream_gemm.stream_gemm(*args, torch.float32, config=config(32, 128, 2))


# The all-banned row's -inf - -inf and 1 / 0, in the interpreter's numpy: meant, as on the GPU.
@pytest.mark.filterwarnings("ignore:invalid value encountered:RuntimeWarning")
@pytest.mark.filterwarnings("ignore:divide by zero encountered:RuntimeWarning")
@pytest.mark.parametrize("splits", [1, 2, 3])
def test_row_confidence_kernels_are_the_softmax_max_and_the_first_argmax(splits):
    """Each row whole (1), in two chunks (4096 + 904 columns) and in three (2048 each, the last
    904): the combine kernel must take the max, the rescaled sum and the first column across them."""
    g = torch.Generator().manual_seed(4)
    x = torch.randn(8, 5000, generator=g) * 4
    x[:, 4000:] = float("-inf")  # banned columns, across a block boundary of the kernel's loop
    x[3, :3000] = float("-inf")  # a row whose first block (and first of three chunks) is all banned
    x[4, [10, 2058, 3000]] = 50.0  # tied maxima in two lanes' columns: the first column wins
    x[5, [2100, 52]] = 50.0  # tied in one lane (52 and 2100 = 52 + 2048) and another: 52
    x[6] = float("-inf")  # all banned: torch.argmax says column 0
    x[7, [4100, 2050]] = 50.0  # tied across chunks, the later column in the earlier lane: 2050
    conf, top = row_confidence.row_confidence_split(x, splits)
    live = [0, 1, 2, 3, 4, 5, 7]
    assert torch.allclose(conf[live], torch.softmax(x[live], -1).amax(-1), rtol=1e-5)
    assert top.tolist() == x.argmax(-1).tolist()
    assert top[4:].tolist() == [10, 52, 0, 2050]


def test_row_confidence_splits_give_every_sm_two_programs():
    assert row_confidence.splits_for(rows=64, sms=132) == 5
    assert row_confidence.splits_for(rows=1, sms=132) == row_confidence.MAX_SPLITS
    assert row_confidence.splits_for(rows=1024, sms=132) == 1


def test_the_swiglu_experiment_kernel_is_silu_gate_times_up():
    """scripts/swiglu_gemm_experiment.py's fused kernel (issue 29's experiment, timed by
    `scripts/gpu_run.sh swiglu`) against the two-step float32 product: its --interpret check
    (a partial row tile, 4 column and 4 K tiles) exits 0 only within float16 rounding."""
    script = Path(__file__).resolve().parents[2] / "scripts" / "swiglu_gemm_experiment.py"
    res = subprocess.run([sys.executable, str(script), "--interpret"], capture_output=True, text=True, timeout=300)
    assert res.returncode == 0, res.stdout + res.stderr
    assert "max relative error" in res.stdout


def test_add_norm_quantize_kernel_writes_the_residual_and_its_scales():
    """The post-norm residual x + RMSNorm(delta) and its per-row scales against the op's CPU
    definition (float16 here; its e4m3 values are checked on the GPU, see above). Row 2's delta is
    zero: the norm is 0, not NaN."""
    from cde.kernels import fp8_triton

    g = torch.Generator().manual_seed(9)
    x, delta = (torch.randn(4, 3000, generator=g) * 2).half(), (torch.randn(4, 3000, generator=g) * 5).half()
    delta[2] = 0.0
    w = (torch.rand(3000, generator=g) + 0.5).half()
    out, _, scale = fp8_triton.add_norm_quantize(x, delta, w, 1e-5)
    ref, _, ref_scale = fp8_ops.add_norm_quantize(x, delta, w, 1e-5)
    assert out.dtype == torch.float16 and out.shape == (4, 3000)
    assert torch.allclose(out.float(), ref.float(), rtol=2**-10, atol=0)  # one float16 rounding at most
    assert torch.equal(out[2], x[2])
    assert torch.allclose(scale, ref_scale, rtol=2**-10)


def test_add_norm_quantize_kernel_adds_the_steering_of_each_item():
    """At a block's end: plus gate * inject, the gate per item of 2 rows here (64 in the model);
    item 1's gate is 0, so its rows are the residual alone."""
    from cde.kernels import fp8_triton

    g = torch.Generator().manual_seed(11)
    x, delta, inject = ((torch.randn(4, 3000, generator=g) * s).half() for s in (2.0, 5.0, 0.5))
    w = (torch.rand(3000, generator=g) + 0.5).half()
    gate = torch.tensor([1.0, 0.0], dtype=torch.float16)
    out, _, scale = fp8_triton.add_norm_quantize(x, delta, w, 1e-5, inject, gate)
    ref, _, ref_scale = fp8_ops.add_norm_quantize(x, delta, w, 1e-5, inject, gate)
    plain, _, _ = fp8_triton.add_norm_quantize(x, delta, w, 1e-5)
    assert torch.allclose(out.float(), ref.float(), rtol=2**-9, atol=0)  # two float16 roundings at most
    assert torch.equal(out[2:], plain[2:]) and not torch.equal(out[:2], plain[:2])
    assert torch.allclose(scale, ref_scale, rtol=2**-9)


def test_heads_quantize_kernel_reads_each_tokens_heads_where_they_lie():
    """The kernel on attention's output as the attention kernel leaves it ([N, H, T, Dh], heads
    outermost) against the op's CPU definition. Every value is an e4m3 value times 2^-4 and every
    token's largest magnitude is 448 * 2^-4, so its scale is 2^-4 and its quotients need no rounding
    (which the interpreter gets wrong, see above): q must be each token's heads, joined, exactly."""
    from cde.kernels import fp8_triton

    g = torch.Generator().manual_seed(13)
    n, h, t, d = 2, 3, 8, 32
    e4m3 = torch.randn(h, n, t, d, generator=g).mul(60).clamp(-448, 448).to(torch.float8_e4m3fn).float()
    e4m3[:, :, :, 0] = 0.0
    e4m3[0, :, :, 0] = 448.0  # every token's largest magnitude
    y = (e4m3 * 2**-4).half().transpose(0, 1)  # [N, H, T, Dh], not contiguous
    q, scale = fp8_triton.heads_quantize(y)
    ref_q, ref_scale = fp8_ops.heads_quantize(y)
    assert q.shape == (n * t, h * d) and torch.equal(scale, torch.full((n * t,), 2.0**-4))
    assert torch.equal(scale, ref_scale) and torch.equal(q.float(), ref_q.float())
