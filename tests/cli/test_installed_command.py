"""The `cde` command a user runs is the console script the package installs (pyproject's
[project.scripts]), not `python -m cde`: run as a process, its `make-model` writes a checkpoint
that the official package loads strictly, with the preset's shapes."""

import subprocess
import sys
from pathlib import Path

from cde.shared.config import preset

from tests.oracle import official_model

CDE = Path(sys.executable).parent / "cde"  # installed beside the interpreter by `pip install -e .`


def test_the_installed_cde_command_writes_a_checkpoint_the_official_package_loads(tmp_path):
    assert CDE.is_file(), f"no console script at {CDE}: pip install -e ."
    out = tmp_path / "tiny"
    res = subprocess.run([str(CDE), "make-model", "--preset", "tiny", str(out)], capture_output=True, text=True)
    assert res.returncode == 0, res.stdout + res.stderr
    model, raw = official_model(out)
    cfg = preset("tiny")
    assert (raw["n_layers"], raw["n_embd"], raw["vocab_size"]) == (cfg.n_layers, cfg.n_embd, cfg.vocab_size)
    assert model.transformer.tok_emb.weight.shape == (cfg.vocab_size, cfg.n_embd)
