"""`cde bench roofline`: the limits it computes against the figures issue 29 states for the 8b
(16 GB of bfloat16 weights read per pass, ~7.7 GB of them FP8 linears when quantized, ~33 TFLOP
for a 32-request pass), the weight count against the architecture's formula, and the table it
prints for a real `cde bench engine --json` run."""

import json
import subprocess
import sys
from pathlib import Path

import pytest
from cde.shared.config import preset

from cde.commands.bench_roofline import pass_flops, shape, weight_bytes

ROOT = Path(__file__).resolve().parents[2]


def test_the_8b_limits_are_the_ones_issue_29_states():
    s = shape(preset("8b"))
    assert weight_bytes(s, "none") == pytest.approx(16.45e9, rel=0.01)
    assert s.block_linear == pytest.approx(7.7e9, rel=0.01)  # one byte each in FP8
    assert weight_bytes(s, "none") / 4.2e12 * 1e3 == pytest.approx(3.9, abs=0.1)  # docs: floor 3.96 ms
    assert pass_flops(s, 32, 64 + 128) == pytest.approx(33.5e12, rel=0.02)


def test_the_weight_count_is_the_architectures():
    cfg = preset("small")
    d, hd = cfg.n_embd, cfg.head_dim
    qkv = d * (cfg.n_head + 2 * cfg.n_kv_heads) * hd
    per_layer = qkv + cfg.n_head * hd * d + d * 2 * cfg.ffn_size + cfg.ffn_size * d
    r = cfg.factorize_rank
    heads = cfg.vocab_size * d + cfg.known_padded * d + d * r + r * cfg.unknown_padded + r * d
    s = shape(cfg)
    assert (s.block_linear, s.other_linear) == (cfg.n_layers * per_layer, heads)
    assert weight_bytes(s, "fp8") == s.block_linear + 2 * heads


def test_the_table_of_a_real_engine_run(tmp_path):
    bench, model = tmp_path / "bench.json", tmp_path / "tiny"
    subprocess.run([sys.executable, "-m", "cde", "make-model", "--preset", "tiny", str(model)], check=True, cwd=ROOT)
    engine = [sys.executable, "-m", "cde", "bench", "engine", "--model", str(model), "--concurrency", "1"]
    subprocess.run([*engine, "--max-tokens", "64", "--json", str(bench)], check=True, cwd=ROOT, capture_output=True)
    args = ["--bandwidth", "1e-6", "--peak", "1e-6"]  # a slow imaginary device: the limits are in range of the CPU's
    out = subprocess.run(
        [sys.executable, "-m", "cde", "bench", "roofline", str(bench), *args],
        check=True,
        cwd=ROOT,
        capture_output=True,
        text=True,
    ).stdout.splitlines()
    assert out[0].startswith("run | ms/pass | tok/s | weight-read limit ms | tensor-core limit ms | of roofline")
    cells = [c.strip() for c in out[2].split("|")]
    result = json.loads(bench.read_text())["results"][0]
    s = shape(preset("tiny"))
    read_ms = weight_bytes(s, "none") / 1e6 * 1e3
    flop_ms = pass_flops(s, 1, 64 + 32) / 1e6 * 1e3
    assert cells[0] == "bf16, 1 request" and float(cells[1]) == pytest.approx(result["ms_per_forward"], abs=0.01)
    assert float(cells[3]) == pytest.approx(read_ms, abs=0.01) and float(cells[4]) == pytest.approx(flop_ms, abs=0.01)
    assert cells[5] == f"{100 * max(read_ms, flop_ms) / result['ms_per_forward']:.0f}%"
    assert cells[7] == str(result["recompiles_after_warmup"]) and cells[8] == "<= 4.8 ms and >= 205 tok/s"
