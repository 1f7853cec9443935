"""`cde bench roofline`: the limits it computes against the figures issue 29 states for the 8b
(16 GB of bfloat16 weights read per pass, ~7.7 GB of them FP8 linears when quantized, ~33 TFLOP
for a 32-request pass), the weight count against the architecture's formula, and the table it
prints for a real `cde bench engine --json` run."""

import argparse
import dataclasses
import json
import subprocess
import sys
from pathlib import Path

import pytest
from cde.shared.config import ModelConfig, preset

from cde.commands import bench_roofline
from cde.commands.bench_roofline import pass_flops, shape, weight_bytes
from tests.cde_procs import cde_in_process

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


def test_the_table_of_a_real_engine_run(tiny_dir, tmp_path, capsys):
    bench = tmp_path / "bench.json"
    engine = [sys.executable, "-m", "cde", "bench", "engine", "--model", str(tiny_dir), "--concurrency", "1"]
    compare = ["--compare-async-scheduling"]  # planned after the picks, then ahead: the first row has no bar
    # 16 new tokens: a pass takes logits of its block's still-masked rows (64 cost ~15x those of
    # 16), and the table reads the same fields of the report whatever their number.
    subprocess.run([*engine, "--max-tokens", "16", *compare, "--json", str(bench)], check=True, cwd=ROOT)
    args = ["--bandwidth", "1e-6", "--peak", "1e-6"]  # a slow imaginary device: the limits are in range of the CPU's
    # The command as the CLI runs it (its parser, its run), in this process.
    capsys.readouterr()
    assert cde_in_process("bench", "roofline", str(bench), *args) == 0
    out = capsys.readouterr().out.splitlines()
    assert out[0].startswith("run | ms/pass | tok/s | weight-read limit ms | tensor-core limit ms | of roofline")
    after, ahead = json.loads(bench.read_text())["results"]
    assert (after["async_scheduling"], ahead["async_scheduling"], ahead["outputs_match_sync"]) == (False, True, True)
    cells = [c.strip() for c in out[2].split("|")]
    assert cells[0] == "bf16, 1 request, planned after the picks" and cells[10:12] == ["—", "—"]
    cells, result = [c.strip() for c in out[3].split("|")], ahead
    s = shape(preset("tiny"))
    read_ms = weight_bytes(s, "none") / 1e6 * 1e3
    flop_ms = pass_flops(s, 1, 64 + 16 / 2) / 1e6 * 1e3  # the prompt and half the new tokens
    assert cells[0] == "bf16, 1 request" and float(cells[1]) == pytest.approx(result["ms_per_forward"], abs=0.01)
    assert float(cells[3]) == pytest.approx(read_ms, abs=0.01) and float(cells[4]) == pytest.approx(flop_ms, abs=0.01)
    assert cells[5] == f"{100 * max(read_ms, flop_ms) / result['ms_per_forward']:.0f}%"
    assert cells[7] == str(result["recompiles_after_warmup"])
    gap_ms = result["gpu_idle_fraction"] * result["wall_s"] * 1e3 / result["forward_passes"]
    assert cells[8] == f"{gap_ms:.2f}" and result["gpu_idle_fraction"] > 0  # the host's part of a CPU pass
    # the bars were set on the H200: shown, not judged, for the card the run names
    assert json.loads(bench.read_text())["device"] == "cpu" and cells[10:] == [
        "<= 4.8 ms and >= 205 tok/s (on the H200)",
        "—",
        "cpu",
    ]


def roofline(tmp_path, capsys: pytest.CaptureFixture[str], report: dict, *flags: str) -> list[list[str]]:
    """The table's rows for one report, through the command's own parser and run (in this process:
    the test above runs it through the CLI, `cde bench roofline`)."""
    path = tmp_path / "report.json"
    path.write_text(json.dumps(report))
    parser = argparse.ArgumentParser()
    bench_roofline.add_arguments(parser)
    capsys.readouterr()
    assert bench_roofline.run(parser.parse_args([str(path), *flags])) == 0
    return [[c.strip() for c in line.split("|")] for line in capsys.readouterr().out.splitlines()[2:]]


def engine_report(device: str | None, *ms: float) -> dict:
    """An 8b `cde bench engine --json` report on `device`: one fp8 request at each of `ms` per pass."""
    results = [
        {"concurrency": 1, "quantization": "fp8", "ms_per_forward": t, "output_tok_per_s": 1e3 / t}
        | {"gc_ms": 0.0, "wall_s": 1.0, "recompiles_after_warmup": 0}
        for t in ms
    ]
    report = {"args": {"prompt_len": 64, "max_tokens": 256}, "config": dataclasses.asdict(preset("8b"))}
    return {**report, "results": results} | ({} if device is None else {"device": device})


def test_limits_are_the_cards_and_bars_are_judged_on_the_h200_only(tmp_path, capsys):
    """A run's limits come from the card it names (its measured copy bandwidth and bfloat16 rate,
    FP8's twice that); issue 29's bars, set on the H200, are judged there and shown unjudged for
    another card; a card without known figures has no limits; a report without a card is the H200's
    unless --card names another."""
    s = shape(preset("8b"))
    h100 = "NVIDIA H100 80GB HBM3"
    rows = {
        d: roofline(tmp_path, capsys, engine_report(d, 3.1, 3.3)) for d in ("NVIDIA H200", h100, "NVIDIA A100", None)
    }
    for device, bandwidth, peak in (("NVIDIA H200", 4.2, 790), (h100, 3.0, 798), (None, 4.2, 790)):
        row = rows[device][0]
        assert float(row[3]) == pytest.approx(weight_bytes(s, "fp8") / bandwidth / 1e9, abs=0.01)
        assert float(row[4]) == pytest.approx(pass_flops(s, 1, 64 + 128) / (2 * peak) / 1e9, abs=0.01)
    for device in ("NVIDIA H200", None):  # met at 3.1 ms, not at 3.3
        assert [r[10:] for r in rows[device]] == [
            ["<= 3.2 ms and >= 300 tok/s", verdict, "H200"] for verdict in ["yes", "no"]
        ]
    assert [r[10:] for r in rows[h100]] == [["<= 3.2 ms and >= 300 tok/s (on the H200)", "—", "H100 80GB HBM3"]] * 2
    a100 = rows["NVIDIA A100"][0]
    assert a100[3:6] == ["—", "—", "—"] and a100[11:] == ["—", "A100"]
    # --card names the card of a report that names none; a report's own name wins over it
    assert roofline(tmp_path, capsys, engine_report(None, 3.1), "--card", h100) == rows[h100][:1]
    assert roofline(tmp_path, capsys, engine_report("NVIDIA H200", 3.1), "--card", h100) == rows["NVIDIA H200"][:1]


def test_long_context_rows_carry_the_pass_and_flash_bars(tmp_path, capsys):
    """The long stage's JSON (`cde bench engine --flashblock-tau`): decode ms per pass from decode
    tok/s, attention beside SDPA flash, and issue 29's bar only on the exact 128k batch-1 row; no
    tensor-core limit for FlashBlock (it skips the attention FLOPs the limit counts)."""
    cfg = {**dataclasses.asdict(preset("8b")), "n_layers": 4, "context_len": 131072}
    row = {"context": 131072, "flashblock": "off", "attention_ms_per_step": 2.8, "sdpa_flash_ms_per_step": 2.0}
    results = [
        {**row, "concurrency": 1, "decode_tok_per_s": 1e3 / 3.4},  # 3.4 ms, attention 1.4x flash: met
        {**row, "concurrency": 1, "decode_tok_per_s": 1e3 / 3.6},  # 3.6 ms: not met
        {**row, "concurrency": 1, "decode_tok_per_s": 1e3 / 3.4, "sdpa_flash_ms_per_step": 1.8},  # 1.56x: not met
        {**row, "concurrency": 8, "decode_tok_per_s": 8e3 / 20.0},  # batch 8: no bar
        {**row, "concurrency": 1, "decode_tok_per_s": 1e3 / 2.0, "flashblock": "tau=2,max_reuse=16"},
    ]
    rows = roofline(tmp_path, capsys, {"args": {"max_tokens": 128}, "config": cfg, "results": results})
    assert [r[0] for r in rows[:2]] == ["4 layers, 128k, 1 request, FlashBlock off"] * 2
    assert [r[1] for r in rows] == ["3.40", "3.60", "3.40", "20.00", "2.00"]
    assert rows[0][9] == "attention 1.40x SDPA flash" and rows[2][9] == "attention 1.56x SDPA flash"
    assert [r[11] for r in rows] == ["yes", "no", "no", "—", "—"] and {r[12] for r in rows} == {"H200"}
    assert rows[4][4] == rows[4][5] == "—"  # reused attention: no tensor-core limit, no share of it
    s = shape(ModelConfig.from_dict(cfg))
    assert float(rows[0][4]) == pytest.approx(pass_flops(s, 1, 131072 - 64) / 790e12 * 1e3, abs=0.01)


def test_http_rows_are_judged_against_the_engine_of_the_same_run(tmp_path, capsys):
    cells = [
        {"concurrency": 1, "attribution": False, "engine_tok_s": 100.0, "http_tok_s": 97.5},
        {"concurrency": 32, "attribution": True, "engine_tok_s": 500.0, "http_tok_s": 480.0},
    ]
    rows = roofline(tmp_path, capsys, {"args": {}, "device": "NVIDIA H100 80GB HBM3", "cells": cells})
    assert [r[0] for r in rows] == ["HTTP, 1 request, attribution off", "HTTP, 32 requests, attribution on"]
    assert [r[9] for r in rows] == ["-2.5% vs the engine (100.0 tok/s)", "-4.0% vs the engine (500.0 tok/s)"]
    assert [r[11] for r in rows] == ["yes", "no"]  # a ratio within one run: judged on any card
    assert [r[12] for r in rows] == ["H100 80GB HBM3"] * 2
