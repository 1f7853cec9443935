"""`--quantization fp8` on the CPU, where worker/fp8.py emulates the FP8 GEMM with the same e4m3
rounding and scales: the quantizer, both paths of the linear layer and their choice per batch
bucket, the model's logits against bfloat16 (small preset), the flag's validation, and serving
through the CLI (tiny preset)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import httpx
import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F
from cde.kernels import fp8_ops
from cde.kernels.stream_ops import tile_counters
from cde.shared.protocol import GenerateRequest, SteeringSpec
from cde.worker import fp8
from cde.worker.checkpoint import make_model
from cde.worker.engine import Engine, EngineArgs

from tests.api_server import ServerProcess
from tests.cde_procs import cde_in_process

# e4m3: 3 mantissa bits, so a normal value rounds to within 2^-4 of itself; the smallest
# subnormal step is 2^-9 (in units of the row's scale), half of it the worst absolute rounding.
E4M3_REL = 2.0**-4
E4M3_SUBNORMAL_HALF_STEP = 2.0**-10


def test_weight_scales_are_per_output_channel_and_use_the_whole_range() -> None:
    g = torch.Generator().manual_seed(0)
    w = torch.randn(48, 96, generator=g) * torch.logspace(-3, 2, 48)[:, None]  # rows 5 decades apart
    w[7] = 0.0  # an all-zero row quantizes to zeros, not NaN
    q, scale = fp8_ops.quantize_rows(w)
    assert q.dtype == torch.float8_e4m3fn and q.shape == w.shape and scale.shape == (48, 1)
    assert scale.dtype == torch.float32
    nonzero = torch.arange(48) != 7
    assert torch.allclose(scale[nonzero, 0], w[nonzero].abs().amax(-1) / 448.0)
    # each row's largest value lands on e4m3's largest finite value, whatever the row's magnitude
    assert torch.equal(q.float().abs().amax(-1)[nonzero], torch.full((47,), 448.0))
    assert torch.equal(q[7].float(), torch.zeros(96))


def test_quantization_saturates_at_448_instead_of_overflowing() -> None:
    x = torch.tensor([[1.0, -1.0, 1000.0, -1e6, 448.0, 449.0, 0.5]])
    q = fp8_ops.quantize_with_scale(x, torch.ones(1, 1))
    assert not q.float().isnan().any()
    assert q.float().tolist() == [[1.0, -1.0, 448.0, -448.0, 448.0, 448.0, 0.5]]


def test_round_trip_error_is_within_e4m3_rounding() -> None:
    g = torch.Generator().manual_seed(1)
    w = torch.randn(256, 512, generator=g) * 0.02
    q, scale = fp8_ops.quantize_rows(w)
    back = fp8.dequantize(q, scale)
    bound = w.abs() * E4M3_REL + scale * E4M3_SUBNORMAL_HALF_STEP
    assert ((back - w).abs() <= bound * (1 + 1e-6)).all()
    rel = ((back - w).norm() / w.norm()).item()
    assert 5e-3 < rel < 4e-2, rel  # lossy, but only by e4m3's rounding


def _linear(n: int = 96, k: int = 64) -> nn.Linear:
    torch.manual_seed(2)
    lin = nn.Linear(k, n, bias=False)
    nn.init.normal_(lin.weight, std=0.02)
    return lin.to(torch.bfloat16)


def test_fp8_linear_paths_and_their_choice_by_rows() -> None:
    """Weight-only below the threshold (one request: the FP8 weight times the bfloat16 rows, channel
    scales on the float32 sums; more rows: the bf16 GEMM of the dequantized weight), per-token
    activation quantization above it; all close to the bfloat16 layer."""
    lin = _linear(k=256)  # the Triton GEMM's K multiple: one request's weight-only call can take it
    layer = fp8.Fp8Linear.from_linear(lin, weight_only_rows=64)
    assert layer.emulate and layer.weight.dtype == torch.float8_e4m3fn and layer.scale.shape == (96,)
    g = torch.Generator().manual_seed(3)
    one = torch.randn(1, 64, 256, generator=g).to(torch.bfloat16)  # one item: 64 rows
    two = torch.randn(2, 64, 256, generator=g).to(torch.bfloat16)  # two items: 128 rows
    weight_only = lambda x: F.linear(x, layer.dequantized(torch.bfloat16))

    def weight_times_rows(x: torch.Tensor) -> torch.Tensor:
        out = (x.double() @ layer.weight.double().t()) * layer.scale.double()
        return out.to(torch.bfloat16)

    def scaled(x: torch.Tensor) -> torch.Tensor:
        xq, xs = fp8_ops.quantize_rows(x.reshape(-1, 256))
        out = fp8.dequantize(xq, xs) @ fp8.dequantize(layer.weight, layer.scale[:, None]).t()
        return out.to(torch.bfloat16).reshape(*x.shape[:-1], 96)

    assert torch.allclose(layer(one).float(), weight_times_rows(one).float(), rtol=8e-3, atol=1e-6)
    assert not torch.equal(layer(one), weight_only(one))  # the scales applied to the sums, not the weight
    assert torch.allclose(layer(two).float(), scaled(two).float(), rtol=1e-2, atol=1e-3)
    assert not torch.equal(layer(two), weight_only(two))  # the activations were quantized too
    wide = fp8.Fp8Linear.from_linear(lin, weight_only_rows=128)
    assert torch.equal(wide(two), weight_only(two))  # past the Triton GEMM's rows: the dequantized weight
    for x in (one, two):
        ref = lin(x).float()
        rel = ((layer(x).float() - ref).norm() / ref.norm()).item()
        assert rel < 6e-2, rel
    assert fp8.path_table(0, (1, 2, 4, 24, 64)) == {1: "triton", 2: "cublas", 4: "cublas", 24: "cublas", 64: "cublas"}
    assert fp8.path_table(64)[1] == "weight-only" and fp8.path_table(64)[2] == "cublas"
    assert set(fp8.path_table(1 << 30).values()) == {"weight-only"}
    # the Triton GEMM's K tiles are 256 wide: other widths go to cuBLAS at any row count
    assert fp8.path_for_rows(64, 0, in_features=512) == "triton"
    assert fp8.path_for_rows(64, 0, in_features=320) == "cublas"


def test_fp8_matmul_op_is_the_row_and_channel_scaled_product() -> None:
    """cde::fp8_matmul against the definition: dequantize both sides, multiply in float64."""
    g = torch.Generator().manual_seed(4)
    xq, xs = fp8_ops.quantize_rows(torch.randn(5, 256, generator=g))
    wq, ws = fp8_ops.quantize_rows(torch.randn(7, 256, generator=g) * 0.1)
    out = fp8_ops.fp8_matmul(xq, xs[:, 0], wq, ws[:, 0], tile_counters(7, "cpu"), torch.bfloat16)
    assert out.shape == (5, 7) and out.dtype == torch.bfloat16
    ref = (xq.double() * xs.double()) @ (wq.double() * ws.double()).t()
    assert torch.allclose(out.double(), ref, rtol=2**-8, atol=1e-6)


def test_silu_mul_quantize_op_quantizes_the_float32_product_per_row() -> None:
    g = torch.Generator().manual_seed(5)
    x = (torch.randn(6, 2 * 512, generator=g) * 3).to(torch.bfloat16)
    x[2] = 0.0  # an all-zero row: zeros and the minimum scale, no NaN
    q, scale = fp8_ops.silu_mul_quantize(x)
    assert q.dtype == torch.float8_e4m3fn and q.shape == (6, 512) and scale.shape == (6,)
    up, gate = x.double()[:, :512], x.double()[:, 512:]
    h = gate * torch.sigmoid(gate) * up  # independent of the op's float32 arithmetic
    assert torch.allclose(scale.double(), (h.abs().amax(-1) / 448.0).clamp(min=1e-12), rtol=1e-6)
    assert torch.equal(q[2].float(), torch.zeros(512))
    back = q.double() * scale.double()[:, None]
    assert ((back - h).abs() <= h.abs() * 2**-4 + scale.double()[:, None] * 2**-10 + 1e-9).all()
    assert torch.equal(q.float().abs().amax(-1)[[0, 1, 3, 4, 5]], torch.full((5,), 448.0))


def test_add_norm_quantize_op_is_the_post_norm_residual_quantized_per_row() -> None:
    """Against float64 arithmetic: out = x + bfloat16(RMSNorm(delta)), rounded to bfloat16, and
    its rows quantized to e4m3 with amax / 448 scales."""
    g = torch.Generator().manual_seed(8)
    x, delta = (
        torch.randn(5, 512, generator=g).to(torch.bfloat16),
        (torch.randn(5, 512, generator=g) * 3).to(torch.bfloat16),
    )
    w = (torch.rand(512, generator=g) + 0.5).to(torch.bfloat16)
    out, q, scale = fp8_ops.add_norm_quantize(x, delta, w, 1e-5)
    assert out.dtype == torch.bfloat16 and q.dtype == torch.float8_e4m3fn and scale.shape == (5,)
    d = delta.double()
    normed = (w.double() * d / (d.pow(2).mean(-1, keepdim=True) + 1e-5).sqrt()).to(torch.bfloat16)
    ref = (x.double() + normed.double()).to(torch.bfloat16)
    assert (out.double() - ref.double()).abs().le(ref.double().abs() * 2**-7).all()  # one rounding apart at most
    h = out.double()
    assert torch.allclose(scale.double(), h.abs().amax(-1) / 448.0, rtol=1e-6)
    back = q.double() * scale.double()[:, None]
    assert ((back - h).abs() <= h.abs() * E4M3_REL + scale.double()[:, None] * E4M3_SUBNORMAL_HALF_STEP + 1e-9).all()


def test_add_norm_quantize_op_adds_the_steering_with_the_model_roundings() -> None:
    """With the steering (gate per item of 64 rows, inject per row), against float64 arithmetic:
    the post-norm residual rounded to bfloat16, plus bfloat16(gate * inject), rounded again; the
    rows of an item whose gate is 0 are the residual alone."""
    g = torch.Generator().manual_seed(10)
    x, delta, inject = ((torch.randn(128, 256, generator=g) * s).to(torch.bfloat16) for s in (1.0, 3.0, 0.7))
    w = (torch.rand(256, generator=g) + 0.5).to(torch.bfloat16)
    gate = torch.tensor([1.0, 0.0], dtype=torch.bfloat16)  # the first item steers, the second does not
    out, _, scale = fp8_ops.add_norm_quantize(x, delta, w, 1e-5, inject, gate)
    plain, _, _ = fp8_ops.add_norm_quantize(x, delta, w, 1e-5)
    assert torch.equal(out[64:], plain[64:])
    ref = (plain[:64].double() + inject[:64].double()).to(torch.bfloat16)
    assert (out[:64].double() - ref.double()).abs().le(ref.double().abs() * 2**-8).all()  # rounding ties
    assert not torch.equal(out[:64], plain[:64])
    assert torch.allclose(scale.double(), out.double().abs().amax(-1) / 448.0, rtol=1e-6)


def test_fp8_block_fuses_the_residual_into_the_mlp_input_and_keeps_its_output(
    tiny_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The FP8 block's step between attention and the MLP (one fused op) against the plain
    block's (x + ln_1(a), then the MLP quantizing its input) on the same layers: equal, and the
    fused op is what runs."""
    engine = Engine(EngineArgs(str(tiny_dir), quantization="fp8", max_running=2))
    block = engine.runner.model.transformer.blocks[0]
    assert isinstance(block, fp8.Fp8Block) and block.post_norm
    torch.manual_seed(7)
    x, a = (torch.randn(2, 64, engine.cfg.n_embd) * s for s in (1.0, 3.0))
    x, a = x.to(torch.bfloat16), a.to(torch.bfloat16)
    calls, op = [], fp8.add_norm_quantize
    monkeypatch.setattr(fp8, "add_norm_quantize", lambda *args: calls.append(1) or op(*args))
    fused_x, fused_m = block.attn_residual_and_mlp(x, a)
    monkeypatch.undo()
    plain_x, plain_m = fp8.Block.attn_residual_and_mlp(block, x, a)
    assert calls == [1]
    assert torch.equal(fused_x, plain_x) and torch.equal(fused_m, plain_m)


def test_fp8_blocks_hand_on_their_quantized_output_and_keep_the_tokens(
    tiny_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Each FP8 block's end (x + ln_2(m) plus the steering, quantized for the next block's c_attn
    by the fused op and handed on) against plain blocks on the same FP8 layers, where c_attn
    quantizes its input itself: the same greedy tokens for a steered and an unsteered request in
    one batch, two fused calls per layer and pass, and the steering does change the tokens."""
    op = fp8.add_norm_quantize

    def generate(fused: bool, steer: bool) -> tuple[list[list[int]], int, int]:
        engine = Engine(EngineArgs(str(tiny_dir), quantization="fp8", max_running=2))
        blocks = engine.runner.model.transformer.blocks
        if not fused:
            for block in blocks:
                block.__class__ = fp8.Block
        calls: list[int] = []
        monkeypatch.setattr(fp8, "add_norm_quantize", lambda *args: calls.append(1) or op(*args))
        spec = SteeringSpec([3], strength=12.0, inject_layer=1, schedule="fixed") if steer else None
        reqs = [
            GenerateRequest("s", [5, 6, 7], max_tokens=16, steering=spec),
            GenerateRequest("u", [9, 8], max_tokens=16),
        ]
        out = engine.generate(reqs)
        monkeypatch.undo()
        return [out["s"], out["u"]], len(calls), engine.forward_passes * len(blocks)

    fused, calls, layer_passes = generate(fused=True, steer=True)
    plain, plain_calls, _ = generate(fused=False, steer=True)
    assert fused == plain and calls == 2 * layer_passes and plain_calls == 0
    assert generate(fused=True, steer=False)[0][0] != fused[0]


def test_quantize_model_converts_only_the_transformer_linears(tiny_dir: Path) -> None:
    engine = Engine(EngineArgs(str(tiny_dir), quantization="fp8", max_running=2))
    model = engine.runner.model
    fp8_layers = [n for n, m in model.named_modules() if isinstance(m, fp8.Fp8Linear)]
    assert len(fp8_layers) == 4 * engine.cfg.n_layers
    assert all(n.startswith("transformer.blocks.") for n in fp8_layers)
    # embeddings (tied LM head), concept heads and norms: still bfloat16 parameters
    assert {p.dtype for p in model.parameters()} == {torch.bfloat16}
    assert model.transformer.lm_head.weight is model.transformer.tok_emb.weight
    assert not any(isinstance(m, nn.Linear) for m in model.transformer.blocks.modules())
    assert all(isinstance(b.mlp, fp8.Fp8MLP) for b in model.transformer.blocks)
    assert all(isinstance(b, fp8.Fp8Block) for b in model.transformer.blocks)
    # the published weight names stay: a quantized model's state dict names what the checkpoint does
    assert "transformer.blocks.0.mlp.c_fc.weight" in model.state_dict()


def test_fp8_mlp_equals_its_unfused_definition() -> None:
    """Fp8MLP's fused activation quantization against c_proj applied to silu(gate) * up computed
    in float32 and quantized by the same layer (so only the fusion differs): equal."""
    torch.manual_seed(6)
    fc, proj = nn.Linear(256, 2 * 512, bias=False), nn.Linear(512, 256, bias=False)
    mlp = fp8.Fp8MLP(
        fp8.Fp8Linear.from_linear(fc.to(torch.bfloat16)), fp8.Fp8Linear.from_linear(proj.to(torch.bfloat16))
    )
    x = torch.randn(2, 64, 256).to(torch.bfloat16)
    h = mlp.c_fc(x).float()
    up, gate = h.chunk(2, dim=-1)
    ref = mlp.c_proj(F.silu(gate) * up)  # Fp8Linear quantizes the float32 product per row
    assert torch.equal(mlp(x), ref.to(torch.bfloat16))


def active_block_logits(
    model_dir: str | Path,
    quantization: str,
    weight_only_rows: int = 64,
    dtype: str = "bfloat16",
    device: str = "cpu",
    cuda_graphs: bool = True,
) -> torch.Tensor:
    """The logits of the engine's first step (the prompt's prefill and block 1's first step in
    one pass of two items: 128 rows), float32 on the CPU."""
    engine = Engine(
        EngineArgs(
            str(model_dir),
            device=device,
            dtype=dtype,
            quantization=quantization,
            fp8_weight_only_rows=weight_only_rows,
            max_running=2,
            cuda_graphs=cuda_graphs,
        )
    )
    captured = []
    inner = engine.runner._logits

    def capture(hidden: torch.Tensor) -> torch.Tensor:
        out = inner(hidden)
        captured.append(out.clone())
        return out

    engine.runner._logits = capture
    prompt = torch.randint(0, 100000, (64,), generator=torch.Generator().manual_seed(7)).tolist()
    engine.add_request(GenerateRequest("r", prompt, max_tokens=64))
    engine.step()
    return captured[0][:, : engine.cfg.vocab_size].float().cpu()


def test_fp8_logits_stay_close_to_bfloat16_on_the_small_preset(tmp_path: Path) -> None:
    """Random weights amplify rounding, so the bound is relative: e4m3 keeps 3 mantissa bits to
    bfloat16's 8, so its rounding is 2^5 = 32 times coarser; the fp8 model may deviate from the
    bfloat16 one by at most 32x what bfloat16 deviates from float32. Measured on this preset:
    bf16 vs fp32 9.0e-3; fp8 vs bf16 1.24e-1 (FP8 GEMM path, 14x), 9.5e-2 (weight-only)."""
    model_dir = make_model("small", tmp_path / "small", seed=3, dtype="bfloat16")
    exact = active_block_logits(model_dir, "none", dtype="float32")
    bf16 = active_block_logits(model_dir, "none")
    bf16_error = ((bf16 - exact).norm() / exact.norm()).item()
    for rows, path in ((64, "FP8 GEMM"), (1 << 30, "weight-only")):
        dev = fp8.deviation(bf16, active_block_logits(model_dir, "fp8", rows))
        print(
            f"small fp8 ({path}) vs bf16: relative error {dev['rel_error']:.2e}, mean KL {dev['mean_kl']:.2e}, "
            f"greedy agreement {dev['greedy_agreement']:.3f} (bf16 vs fp32: {bf16_error:.2e})"
        )
        assert 0 < dev["rel_error"] <= 32 * bf16_error
        assert dev["mean_kl"] < 0.15 and dev["greedy_agreement"] >= 0.6


def test_deviation_report() -> None:
    ref = torch.tensor([[3.0, 0.0, 0.0], [0.0, 2.0, 0.0]])
    same = fp8.deviation(ref, ref)
    assert same == {"rel_error": 0.0, "mean_kl": 0.0, "greedy_agreement": 1.0}
    flipped = fp8.deviation(ref, torch.tensor([[3.0, 0.0, 0.0], [2.0, 0.0, 0.0]]))
    assert (
        flipped["greedy_agreement"] == 0.5
        and flipped["mean_kl"] > 0
        and flipped["rel_error"] == pytest.approx((8 / 13) ** 0.5)
    )


def test_flag_validation(tiny_dir: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    with pytest.raises(ValueError, match=r"bfloat16.*not float32.*--dtype bfloat16"):
        fp8.check_quantization("fp8", "cpu", torch.float32)
    with pytest.raises(ValueError, match=r"unknown quantization 'int4'"):
        fp8.check_quantization("int4", "cpu", torch.bfloat16)
    with pytest.raises(ValueError, match=r"runs on CUDA GPUs.*not on mps"):
        fp8.check_quantization("fp8", "mps", torch.bfloat16)
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda dev=None: (8, 0))
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda dev=None: "NVIDIA A100")
    with pytest.raises(ValueError, match=r"compute capability >= 8\.9.*NVIDIA A100 is 8\.0"):
        fp8.check_quantization("fp8", "cuda", torch.bfloat16)
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda dev=None: (9, 0))
    fp8.check_quantization("fp8", "cuda:0", torch.bfloat16)  # an H100/H200
    fp8.check_quantization("none", "cpu", torch.float32)
    # the engine refuses before loading anything; auto picks bfloat16 for fp8 on the CPU too
    with pytest.raises(ValueError, match="--dtype bfloat16"):
        Engine(EngineArgs(str(tiny_dir), dtype="float32", quantization="fp8"))
    assert fp8.engine_dtype("auto", "cpu", "fp8") == "bfloat16" and fp8.engine_dtype("auto", "cpu", "none") == "float32"
    with pytest.raises(ValueError, match="weight_only_rows"):
        fp8.quantize_model(Engine(EngineArgs(str(tiny_dir), max_running=1)).runner.model, -1)


def test_cli_refuses_fp8_with_float32_and_bad_rows(tiny_dir: Path, capsys) -> None:
    """Refused by the parser or the flags' checks, before any model loads: in this process, through
    the CLI's entry point; `cde serve` (which sets its logging first) as a process of its own."""

    from tests.api_server import REPO

    for command, extra, message in (
        ("generate", ["--prompt-ids", "1,2", "--dtype", "float32"], "--quantization fp8 computes in bfloat16"),
        ("serve", ["--dtype", "float32"], "--quantization fp8 computes in bfloat16"),
        ("worker", ["--dtype", "float32"], "--quantization fp8 computes in bfloat16"),
        ("bench engine", ["--dtype", "float32"], "--quantization fp8 computes in bfloat16"),
        ("generate", ["--prompt-ids", "1,2", "--fp8-weight-only-rows", "-1"], "--fp8-weight-only-rows must be >= 0"),
        ("generate", ["--prompt-ids", "1,2", "--device", "mps"], "argument --device: invalid choice: 'mps'"),
    ):
        args = [*command.split(), "--model", str(tiny_dir), *extra, "--quantization", "fp8"]
        if command == "serve":
            res = subprocess.run(
                [sys.executable, "-m", "cde", *args], cwd=REPO, capture_output=True, text=True, timeout=120
            )
            rc, err = res.returncode, res.stderr
        else:
            rc, err = cde_in_process(*args), capsys.readouterr().err
        assert rc != 0 and message in err, (command, extra, err[-2000:])
        assert "Traceback" not in err


def test_serve_fp8_end_to_end_on_the_cpu(tiny_dir: Path) -> None:
    server = ServerProcess(tiny_dir, "--quantization", "fp8", workers=1)
    try:
        model = httpx.get(server.base_url + "/models", timeout=10).json()["data"][0]["id"]
        r = httpx.post(
            server.base_url + "/completions",
            json={"model": model, "prompt": "Hello", "max_tokens": 70, "temperature": 0},
            timeout=120,
        )
        assert r.status_code == 200, r.text
        assert r.json()["usage"]["completion_tokens"] == 70
        assert "fp8: 8 linear layers quantized" in "".join(server.output)
    finally:
        assert server.stop() == 0


def test_the_norm_quant_experiment_compiles_both_choices_to_the_eager_output() -> None:
    """scripts/norm_quant_experiment.py (issue 29's experiment, timed by `scripts/gpu_run.sh
    normquant`): its --cpu check compiles the pre-norm + quantization + FP8 linear with Inductor's
    default choices and with persistent row reductions, and exits 0 only if both match eager."""
    script = Path(__file__).resolve().parents[2] / "scripts" / "norm_quant_experiment.py"
    res = subprocess.run([sys.executable, str(script), "--cpu"], capture_output=True, text=True, timeout=300)
    assert res.returncode == 0, res.stdout + res.stderr
    assert "| 5 | default |" in res.stdout and "| 5 | persistent rows |" in res.stdout


def test_the_silu_quant_experiment_gives_the_engine_kernels_bits() -> None:
    """scripts/silu_quant_experiment.py (issue 29's experiment, timed by `scripts/gpu_run.sh
    siluquant`): its --cpu check runs every looped and persistent variant in Triton's interpreter
    (a persistent program over two of the three rows among them) and exits 0 only if each gives the
    engine kernel's e4m3 values and scales bit for bit."""
    script = Path(__file__).resolve().parents[2] / "scripts" / "silu_quant_experiment.py"
    res = subprocess.run([sys.executable, str(script), "--cpu"], capture_output=True, text=True, timeout=300)
    assert res.returncode == 0, res.stdout + res.stderr
    assert res.stdout.count("| True |") == 19


def test_the_fp8_head_experiment_compares_every_variant_with_bfloat16() -> None:
    """scripts/fp8_head_experiment.py (issue 29's experiment, CPU): with the demo model it prints a
    row per variant against bfloat16's greedy tokens and the e4m3 head's own deviation."""
    script = Path(__file__).resolve().parents[2] / "scripts" / "fp8_head_experiment.py"
    args = [sys.executable, str(script), "--prompts", "2", "--tokens", "8"]
    res = subprocess.run(args, capture_output=True, text=True, timeout=300)
    assert res.returncode == 0, res.stdout + res.stderr
    rows = [line for line in res.stdout.splitlines() if line.startswith("| ") and "/2 |" in line]
    assert len(rows) == 3, res.stdout
    assert "e4m3 head alone on" in res.stdout and "greedy_agreement" in res.stdout
