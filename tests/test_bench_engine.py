"""`cde bench engine --flashblock-tau`: the side-by-side FlashBlock table, for real on the tiny
preset (CPU): the split without reuse agrees with the exact path token for token, reuse is
measured (fraction of reused steps, KL against the exact forward) and deterministic. The model
is configured past the 8B's 4096-token context (`--set block_size=8192`) and the prompts use it."""

import json
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def test_flashblock_table(tmp_path):
    out = tmp_path / "fb.json"
    cmd = [sys.executable, "-m", "cde", "bench", "engine", "--preset", "tiny", "--set", "block_size=8192",
           "--concurrency", "2", "--prompt-len", "4200", "--max-tokens", "70", "--flashblock-tau", "0", "--flashblock-max-reuse", "0",
           "--json", str(out)]
    subprocess.run(cmd, cwd=ROOT, check=True, capture_output=True, timeout=600)
    cmd[cmd.index("--flashblock-tau") + 1] = "2"
    cmd[cmd.index("--flashblock-max-reuse") + 1] = "63"
    out2 = tmp_path / "fb2.json"
    cmd[-1] = str(out2)
    subprocess.run(cmd, cwd=ROOT, check=True, capture_output=True, timeout=600)
    exact, split = json.loads(out.read_text())["results"]
    _, reuse = json.loads(out2.read_text())["results"]
    assert exact["flashblock"] == "off" and exact["context"] == 4270
    assert split["token_agreement"] == 1.0 and split["reused_fraction"] == 0.0 and split["mean_kl"] == 0.0
    assert reuse["reused_fraction"] > 0.5 and reuse["mean_kl"] > 0.0 and reuse["deterministic"]
    assert all(r["attention_ms_per_step"] > 0 and r["decode_tok_per_s"] > 0 for r in (exact, split, reuse))
