"""`cde bench engine` for real on the tiny preset (CPU). The latency/throughput table per
concurrency, with steering toggled in the same engine and the op-table profile of the first two
blocks. And with `--flashblock-tau`, the side-by-side FlashBlock table: the split without reuse
agrees with the exact path token for token, reuse is measured (fraction of reused steps, KL
against the exact forward) and deterministic. The model is configured past the 8B's 4096-token
context (`--set block_size=8192`) and the prompts use it."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from tests.cde_procs import cde_in_process

ROOT = Path(__file__).resolve().parents[2]


def test_flashblock_table(tmp_path):
    # One engine for the three rows: max_reuse 0 is the split path that never reuses (the
    # policy reuses while `reused < max_reuse`), 63 reuses whenever tau allows. 20 new tokens, in
    # the prompt's last block (1100 = 17 * 64 + 12): the reuse rule across blocks is
    # tests/kernels/test_flashblock.py's. A pass takes logits of its block's still-masked rows
    # only: 40 new tokens cost ~4x the logits of 20 and check nothing more.
    out = tmp_path / "fb.json"
    cmd = [
        sys.executable,
        "-m",
        "cde",
        "bench",
        "engine",
        "--preset",
        "tiny",
        "--set",
        "block_size=2048",
        "--concurrency",
        "2",
        "--prompt-len",
        "1100",
        "--max-tokens",
        "20",
        "--flashblock-tau",
        "2",
        "--flashblock-max-reuse",
        "0,63",
        "--json",
        str(out),
    ]
    subprocess.run(cmd, cwd=ROOT, check=True, capture_output=True, timeout=600)
    exact, split, reuse = json.loads(out.read_text())["results"]
    assert exact["flashblock"] == "off" and exact["context"] == 1120
    assert split["flashblock"] == "tau=2,max_reuse=0" and reuse["flashblock"] == "tau=2,max_reuse=63"
    assert split["token_agreement"] == 1.0 and split["reused_fraction"] == 0.0 and split["mean_kl"] == 0.0
    assert reuse["reused_fraction"] > 0.5 and reuse["mean_kl"] > 0.0 and reuse["deterministic"]
    assert all(r["attention_ms_per_step"] > 0 and r["decode_tok_per_s"] > 0 for r in (exact, split, reuse))


def test_latency_table_and_profile(tmp_path):
    out, prof = tmp_path / "bench.json", tmp_path / "prof"
    cmd = [
        sys.executable,
        "-m",
        "cde",
        "bench",
        "engine",
        "--preset",
        "tiny",
        # One level: the loop over levels in one engine is the tokens-per-step test's too, and
        # every request-step costs the vocabulary-wide logits of the tiny model.
        "--concurrency",
        "2",
        "--max-tokens",
        "128",
        "--steering",
        "--attribution",
        "--json",
        str(out),
        "--profile",
        str(prof),
    ]
    tmp = tmp_path / "tmp"  # the bench's own temporary files: the random checkpoint must not outlive it
    tmp.mkdir()
    env = {**os.environ, "TMPDIR": str(tmp)}
    res = subprocess.run(cmd, cwd=ROOT, check=True, capture_output=True, text=True, timeout=600, env=env)
    assert "wrote random tiny checkpoint" in res.stdout and not list(tmp.glob("cde-tiny-*"))
    header = next(line for line in res.stdout.splitlines() if line.startswith("conc |"))
    assert "ms/fwd 1st block" in header and "ms/fwd after" in header and "GC ms" in header
    results = json.loads(out.read_text())["results"]
    assert [(r["concurrency"], r["steering_half"]) for r in results] == [(2, False), (2, True)]
    for r in results:
        assert r["generated_tokens"] == r["concurrency"] * 128
        # One token per step: 64 passes per block; the first block's passes include the prefill's.
        assert r["forward_passes_per_block"] == 64.0
        assert r["ms_per_forward_first_block"] > 0 and r["ms_per_forward_after"] > 0
        assert r["time_to_first_block_s"] < r["time_to_last_block_s"] and r["output_tok_per_s"] > 0
        # The passes tile the run: their times add up to (nearly) the wall time, idle gaps included.
        assert 0 < r["gpu_idle_fraction"] < 1
        assert r["ms_per_forward"] * r["forward_passes"] / 1e3 == pytest.approx(r["wall_s"], rel=0.2)
    tables = (prof / "profile-c2.txt").read_text()
    assert "== block 0, steps 8-39" in tables and "== steps 48-79, across block 0's end at 64" in tables


def test_tokens_per_step_table_with_fp8(tmp_path: Path) -> None:
    """`--tokens-per-step 4,16`: one row per value (and concurrency), fewer passes per block
    and more tokens per pass as the value grows; `--quantization fp8` runs emulated on the CPU."""
    out = tmp_path / "tps.json"
    cmd = [
        sys.executable,
        "-m",
        "cde",
        "bench",
        "engine",
        "--preset",
        "tiny",
        "--concurrency",
        "2",
        "--max-tokens",
        "64",
        "--tokens-per-step",
        "4,16",  # fp8 is emulated in bfloat16 on the CPU: ~0.25 s a pass here, so few passes
        "--quantization",
        "fp8",
        "--json",
        str(out),
    ]
    res = subprocess.run(cmd, cwd=ROOT, check=True, capture_output=True, text=True, timeout=600)
    lines = res.stdout.splitlines()
    header = lines.index(next(line for line in lines if line.startswith("conc |")))
    assert "tok/step" in lines[header] and "tok/fwd" in lines[header] and "quant" in lines[header]
    assert len([line for line in lines[header + 1 :] if line.startswith("2 |")]) == 2
    results = json.loads(out.read_text())["results"]
    assert [(r["concurrency"], r["tokens_per_step"], r["quantization"]) for r in results] == [
        (2, 4, "fp8"),
        (2, 16, "fp8"),
    ]
    for r in results:
        assert r["generated_tokens"] == 2 * 64 and r["recompiles_after_warmup"] == 0
        assert r["forward_passes_per_block"] == 64 / r["tokens_per_step"]
    four, sixteen = (r["tokens_per_forward"] for r in results)
    assert sixteen > 2 * four


def test_tokens_per_step_must_be_integers_in_range(capsys) -> None:
    """The command's own check, before any checkpoint or engine: run as `cde bench engine` runs it
    (the CLI's parser and error reporting), in this process."""
    for bad in ("0", "1,x", "65"):
        rc = cde_in_process("bench", "engine", "--preset", "tiny", "--tokens-per-step", bad)
        err = capsys.readouterr().err
        assert rc == 1 and "--tokens-per-step" in err and "Traceback" not in err, err
