"""`python -m cde` as a real subprocess: make-model, then generate from token ids, and a held-out
problem with the built-in demo model (the trained reference model); steering and attribution from
the command line (against the official package), the help text, and `bench engine` on the demo."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from cde.shared.config import preset
from cde.shared.tokenizer import get_tokenizer
from cde.worker.checkpoint import load_checkpoint

from tests.cde_procs import cde_in_process

ROOT = Path(__file__).resolve().parents[2]


def cde(*args, env=None, timeout=120):
    out = subprocess.run(
        [sys.executable, "-m", "cde", *args],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=timeout,
        env={**os.environ, **(env or {})},
    )
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


def test_make_model_replaces_a_checkpoint_only_when_forced(made, tmp_path):
    out = tmp_path / "again"
    assert cde("make-model", "--preset", "tiny", "--seed", "1", str(out)).returncode == 0
    before = (out / "model.safetensors").read_bytes()
    res = cde("make-model", "--preset", "tiny", str(out))
    assert res.returncode == 1 and "--force" in res.stderr and len(res.stderr.strip().splitlines()) == 1
    assert (out / "model.safetensors").read_bytes() == before
    assert cde("make-model", "--preset", "tiny", "--force", str(out)).returncode == 0
    assert (out / "model.safetensors").read_bytes() == (made / "model.safetensors").read_bytes()


def test_generate_prompt_ids_json(made):
    res = cde("generate", "--model", str(made), "--prompt-ids", "1,2,3", "--max-tokens", "8", "--json")
    assert res.returncode == 0, res.stderr
    data = json.loads(res.stdout)
    assert set(data) == {"token_ids", "text"}
    ids = data["token_ids"]
    assert len(ids) == 8 and all(isinstance(t, int) and 0 <= t < 100281 for t in ids)
    assert data["text"] == get_tokenizer(False).decode(ids)


def test_generate_with_the_demo_model_solves_held_out_arithmetic(tmp_path):
    """No --model: the shipped trained model, unpacked under CDE_HOME; a held-out problem asked
    through the chat template is answered right, by the training program's own checker."""
    from cde.train import heldout, tasks

    [p] = [p for p in heldout.problems(1, seed=2) if p.family == "arithmetic"]
    ids = get_tokenizer(True).chat_prompt(heldout.messages(p))
    res = cde(
        "generate",
        "--prompt-ids",
        ",".join(map(str, ids)),
        "--max-tokens",
        str(heldout.MAX_TOKENS),
        "--json",
        env={"CDE_HOME": str(tmp_path / "home"), "OMP_NUM_THREADS": "1"},
    )
    assert res.returncode == 0, res.stderr
    data = json.loads(res.stdout)
    assert tasks.check(p, data["text"]), (p.prompt, data["text"])
    assert 100283 not in data["token_ids"]  # <|eot_id|> ends the sequence, never emitted
    [demo] = (tmp_path / "home" / "demo").glob("*/cde-reference")
    cfg, _ = load_checkpoint(demo)
    assert cfg.instruct and cfg.n_concepts == 77


def test_cde_reference_names_the_demo_model(tmp_path):
    """The name the server reports works as --model: the same tokens as the unpacked directory,
    steering by a catalog name and attribution labelled from the demo's catalog."""
    from cde.worker.demo_model import demo_model_dir

    args = ["--prompt", "Tell me about the ocean.", "--max-tokens", "8", "--json"]
    args += ["--steering", '{"concepts": ["Space"], "strength": 8}', "--attribution", '{"top_k": 3}']
    by_name = cde("generate", "--model", "cde-reference", *args, env={"OMP_NUM_THREADS": "1"})
    assert by_name.returncode == 0 and not by_name.stderr.strip(), by_name.stderr
    by_path = cde("generate", "--model", str(demo_model_dir()), *args, env={"OMP_NUM_THREADS": "1"})
    assert json.loads(by_name.stdout) == json.loads(by_path.stdout)
    [chunk] = json.loads(by_name.stdout)["attribution"]["chunks"]
    assert [c for c in chunk["concepts"] if c["type"] == "known" and not c["label"].startswith("Known: #")]


def test_help_shows_defaults_and_never_the_api_key():
    res = cde("serve", "--help", env={"CDE_API_KEY": "sk-very-secret"})
    assert res.returncode == 0, res.stderr
    text = " ".join(res.stdout.split())  # argparse wraps lines
    assert "--port PORT 0 picks a free port (default: 8000)" in text
    assert "--host HOST address to listen on (0.0.0.0: every IPv4 interface) (default: 127.0.0.1)" in text
    assert "--device {auto,cpu,cuda} auto: cuda when a GPU is visible, else cpu (default: auto)" in text
    assert "--dtype {auto,float32,bfloat16} weights and activations;" in text
    assert (
        "--model MODEL checkpoint directory, `cde-reference` (the built-in demo model), or Hugging Face Hub id" in text
    )
    assert "(default: None)" not in text and "sk-very-secret" not in text
    for command in (["worker"], ["generate"], ["bench", "engine"], ["gateway"]):
        res = cde(*command, "--help")
        assert res.returncode == 0 and "--revision REVISION" in res.stdout, command
        assert "(default: None)" not in res.stdout


def _prompt() -> list[int]:
    return torch.randint(0, 100000, (64,), generator=torch.Generator().manual_seed(7)).tolist()


@pytest.mark.reference
def test_generate_steering_matches_official(made):
    from tests.oracle import official_generator
    from tests.parity.test_steering_parity import N_NEW, amplify, reference_steered

    ids = _prompt()
    # The API's amplify preset on a 2-layer model: strength 8 normalised, layer min(8, 2), cutoff 32.
    steering = json.dumps({"concepts": [3, 17, "Known: #40"], "preset": "amplify"})
    res = cde(
        "generate",
        "--model",
        str(made),
        "--prompt-ids",
        ",".join(map(str, ids)),
        "--max-tokens",
        str(N_NEW),
        "--steering",
        steering,
        "--json",
    )
    assert res.returncode == 0, res.stderr
    _, ref = amplify([3, 17, 40], 2)
    got = json.loads(res.stdout)
    assert set(got) == {"token_ids", "text"}
    assert got["token_ids"] == reference_steered(official_generator(made), ids, ref)


@pytest.mark.reference
def test_generate_attribution_matches_official_chunks(made):
    import numpy as np

    from tests.parity.test_attribution_parity import TOL, reference, text_prompt

    text, ids = text_prompt()
    out, ref_chunks, _ = reference(made, text, 64, 1)
    res = cde(
        "generate",
        "--model",
        str(made),
        "--prompt-ids",
        ",".join(map(str, ids)),
        "--max-tokens",
        "64",
        "--attribution",
        '{"top_k": 5, "chunking": "endofchunk"}',
        "--json",
    )
    assert res.returncode == 0, res.stderr
    got = json.loads(res.stdout)
    assert got["token_ids"] == out.tokens[len(ids) :].tolist()
    chunks = got["attribution"]["chunks"]
    assert len(chunks) == len(ref_chunks) >= 1
    for chunk, (entries, eps_pct) in zip(chunks, ref_chunks):
        # The API's rendering: the chunk's top_k concepts by |contribution|, the official order.
        assert [(c["label"], c["type"]) for c in chunk["concepts"]] == [(e["label"], e["type"]) for e in entries[:5]]
        np.testing.assert_allclose(
            [c["contribution"] for c in chunk["concepts"]], [e["contribution"] for e in entries[:5]], **TOL
        )
        np.testing.assert_allclose(chunk["epsilon_pct"], eps_pct, **TOL)


@pytest.mark.parametrize(
    "flag,value,messages",
    [
        (
            "--steering",
            '{"concepts": ["no such concept"]}',
            ["cde generate: unknown concept label 'no such concept'", "(param: steering.concepts)"],
        ),
        (
            "--steering",
            '{"concepts": [1], "strength": "high"}',
            ["cde generate: Invalid value for 'steering.strength'", "(param: steering.strength)"],
        ),
        ("--steering", '{"concepts": [1], "inject_layer": -1}', ["(param: steering.inject_layer)"]),
        ("--attribution", '{"top_k": 0}', ["cde generate: Invalid value for 'attribution.top_k'"]),
        ("--attribution", "{top_k: 5}", ["cde generate: --attribution is not JSON"]),
    ],
)
def test_generate_rejects_bad_steering_and_attribution(made, flag, value, messages, capsys):
    """In this process, through the CLI's entry point (the model loads, the request is refused)."""
    rc = cde_in_process("generate", "--model", str(made), "--prompt-ids", "1,2,3", "--max-tokens", "4", flag, value)
    err = capsys.readouterr().err
    assert rc == 1 and "Traceback" not in err, err
    assert all(m in err for m in messages), err


def test_bench_engine_defaults_to_the_demo_model(tmp_path):
    out = tmp_path / "bench.json"
    res = cde(
        "bench",
        "engine",
        "--concurrency",
        "1",
        "--max-tokens",
        "8",
        "--device",
        "cpu",
        "--json",
        str(out),
        env={"CDE_HOME": str(tmp_path / "home"), "OMP_NUM_THREADS": "1"},
        timeout=300,
    )
    assert res.returncode == 0, res.stderr
    [_] = (tmp_path / "home" / "demo").glob("*/cde-reference/config.json")  # the shipped model, unpacked
    [result] = json.loads(out.read_text())["results"]
    assert result["concurrency"] == 1 and result["generated_tokens"] == 8
