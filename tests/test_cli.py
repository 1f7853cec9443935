"""`python -m cde` as a real subprocess: make-model, then generate from token ids and from text
with the built-in demo model."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from shared.config import preset
from shared.tokenizer import get_tokenizer
from worker.checkpoint import load_checkpoint

ROOT = Path(__file__).resolve().parents[1]


def cde(*args, env=None, timeout=120):
    out = subprocess.run([sys.executable, "-m", "cde", *args], cwd=ROOT, capture_output=True, text=True,
                         timeout=timeout, env={**os.environ, **(env or {})})
    return out


@pytest.fixture(scope="module")
def made(tmp_path_factory):
    out = tmp_path_factory.mktemp("cli") / "tiny"
    res = cde("make-model", "--preset", "tiny", str(out))
    assert res.returncode == 0, res.stderr
    assert res.stdout.strip() == str(out)
    return out


def test_make_model_writes_loadable_checkpoint(made):
    assert (made / "config.json").is_file() and (made / "model.safetensors").is_file()
    cfg, _ = load_checkpoint(made)
    assert cfg == preset("tiny")


def test_generate_prompt_ids_json(made):
    res = cde("generate", "--model", str(made), "--prompt-ids", "1,2,3", "--max-tokens", "8", "--json")
    assert res.returncode == 0, res.stderr
    data = json.loads(res.stdout)
    assert set(data) == {"token_ids", "text"}
    ids = data["token_ids"]
    assert len(ids) == 8 and all(isinstance(t, int) and 0 <= t < 100281 for t in ids)
    assert data["text"] == get_tokenizer(False).decode(ids)


def test_generate_text_with_demo_model(tmp_path):
    env = {"CDE_HOME": str(tmp_path / "home")}
    res = cde("generate", "--prompt", "The key to understanding neural networks is", "--max-tokens", "64",
              "--json", env=env)
    assert res.returncode == 0, res.stderr
    data = json.loads(res.stdout)
    assert 1 <= len(data["token_ids"]) <= 64 and isinstance(data["text"], str)
    # the demo model was written under CDE_HOME: an instruct checkpoint of the tiny preset
    demo = tmp_path / "home" / "demo-tiny-instruct"
    cfg, _ = load_checkpoint(demo)
    assert cfg == preset("tiny", instruct=True)
    assert 100283 not in data["token_ids"]  # <|eot_id|> ends the sequence, never emitted


def test_cli_errors(tmp_path):
    res = cde("generate", "--model", str(tmp_path / "missing"), "--prompt-ids", "1", "--max-tokens", "2")
    assert res.returncode != 0 and "CheckpointError" in res.stderr and "does not exist" in res.stderr
    res = cde("make-model", "--preset", "nope", str(tmp_path / "x"))
    assert res.returncode == 2 and "invalid choice" in res.stderr
    for command in ("serve", "worker"):
        for bad in ("0", "65"):
            res = cde(command, "--kv-splits", bad)
            assert res.returncode == 1 and "--kv-splits must be in [1, 64]" in res.stderr
