"""`scripts/http_vs_engine.py` (gpu_run.sh's `http` stage) end to end on the CPU with the tiny
preset: the engine bench, `cde serve` with its warm-up, the first request and `cde bench serve`
for every cell, then the table and the JSON."""

import json
import subprocess
import sys

import pytest

from tests.api_server import REPO

pytestmark = pytest.mark.slow


def test_the_http_stage_prints_the_table_and_writes_json(tiny_dir, tmp_path):
    cmd = [sys.executable, "scripts/http_vs_engine.py", "--model", str(tiny_dir), "--device", "cpu"]
    cmd += ["--concurrency", "1,2", "--prompt-len", "64", "--max-tokens", "16", "--tokens-per-step", "8"]
    cmd += ["--requests-at-1", "2", "--out", str(tmp_path)]
    done = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, timeout=900)
    assert done.returncode == 0, done.stdout + done.stderr + (tmp_path / "serve.log").read_text()
    rows = [line for line in done.stdout.splitlines() if line.startswith("| ") and "---" not in line]
    assert len(rows) == 5  # the header and the 4 cells
    summary = json.loads((tmp_path / "http_vs_engine.json").read_text())
    cells = {(c["concurrency"], c["attribution"]): c for c in summary["cells"]}
    assert set(cells) == {(1, False), (1, True), (2, False), (2, True)} and summary["device"] == "cpu"
    for c in cells.values():
        assert c["engine_tok_s"] > 0 and c["http_tok_s"] > 0 and c["http_ttfb_s"] > 0 and c["engine_ttfb_s"] > 0
        # The worker's passes in the cell, from /metrics: 16 tokens at 8 a step are at least 2 per
        # request (2 requests in turn at concurrency 1); on the CPU the host's gaps between them are
        # never 0.
        assert c["http_passes"] >= 2 * (2 if c["concurrency"] == 1 else 1) and c["http_gap_ms"] > 0
        assert c["engine_passes"] >= 2 and c["http_ms_per_pass"] > 0
    assert summary["first_request"]["ttfb_s"] > 0
    assert "warm-up requests done" in (tmp_path / "serve.log").read_text()
