"""shared/hub.py: `--model` as a directory or a Hub id, resolved by `huggingface_hub` from a Hub
cache built on disk, HF_HUB_OFFLINE=1 (nothing reaches the network). Resolution runs in fresh
processes: `huggingface_hub` reads HF_HOME and HF_HUB_OFFLINE once, at import."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from cde.shared.hub import is_hub_id

from tests.hub_cache import cache_repo

ROOT = Path(__file__).resolve().parents[2]
MAIN, OTHER = "a" * 40, "b" * 40


def resolve(env: dict, model: str, revision: str | None = None) -> dict:
    code = (
        "import json, sys; from cde.shared.hub import HubError, resolve_model\n"
        "try: print(json.dumps({'path': str(resolve_model(sys.argv[1], sys.argv[2] or None))}))\n"
        "except HubError as e: print(json.dumps({'error': str(e)}))"
    )
    out = subprocess.run(
        [sys.executable, "-c", code, model, revision or ""],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=120,
        env={**os.environ, **env},
    )
    assert out.returncode == 0, out.stderr
    return json.loads(out.stdout)


@pytest.fixture(scope="module")
def hf(tmp_path_factory):
    """Two snapshots of one repo: `main` at MAIN, branch `v1` at OTHER; they differ in a file."""
    root = tmp_path_factory.mktemp("hub")
    for _commit, marker in ((MAIN, "main"), (OTHER, "other")):
        files = root / marker
        files.mkdir()
        (files / "config.json").write_text(json.dumps({"marker": marker}))
        (files / "model.safetensors").write_bytes(b"not read here")
    cache_repo(root / "hf", "org/model", root / "main", MAIN)
    cache_repo(root / "hf", "org/model", root / "other", OTHER, ref="v1")
    return {"HF_HOME": str(root / "hf"), "HF_HUB_OFFLINE": "1"}


def marker(resolved: dict) -> str:
    assert "error" not in resolved, resolved["error"]
    return json.loads((Path(resolved["path"]) / "config.json").read_text())["marker"]


def test_hub_id_or_directory(tmp_path, monkeypatch):
    for model in ("guidelabs/steerling-8b", "org/name.v2", "a_b/c-d"):
        assert is_hub_id(model), model
    for model in ("/abs/path", "a/b/c", "./x", "org/../x", "name", "org/", "-x/y"):
        assert not is_hub_id(model), model
    monkeypatch.chdir(tmp_path)
    (tmp_path / "org" / "local").mkdir(parents=True)
    assert not is_hub_id("org/local")  # a directory of that name wins


def test_resolves_revisions_from_the_offline_cache(hf):
    assert marker(resolve(hf, "org/model")) == "main"
    assert marker(resolve(hf, "org/model", "v1")) == "other"
    assert marker(resolve(hf, "org/model", OTHER)) == "other"
    assert Path(resolve(hf, "org/model")["path"]).name == MAIN  # the snapshot directory itself


def test_directories_pass_through(hf, tmp_path):
    assert resolve(hf, str(tmp_path)) == {"path": str(tmp_path)}
    assert resolve(hf, str(tmp_path / "missing")) == {"path": str(tmp_path / "missing")}  # the loader says why
    err = resolve(hf, str(tmp_path), "v1")["error"]
    assert "--revision applies to Hub ids" in err


def test_missing_offline_is_a_clear_error(hf):
    err = resolve(hf, "org/absent")["error"]
    assert "'org/absent' is neither a directory nor in the Hugging Face cache" in err
    assert f"cache ({hf['HF_HOME']}/hub)" in err and "HF_HUB_OFFLINE is set" in err
    elsewhere = {"HF_HOME": "", "HF_HUB_CACHE": f"{hf['HF_HOME']}/other", "HF_HUB_OFFLINE": "1"}
    assert f"cache ({hf['HF_HOME']}/other)" in resolve(elsewhere, "org/model")["error"]  # the cache searched
    err = resolve(hf, "org/model", "v9")["error"]
    assert "'org/model' at revision 'v9'" in err


@pytest.mark.parametrize("command", ["generate", "serve", "worker", "bench"])
def test_commands_refuse_a_missing_id_before_any_model_work(hf, command):
    args = {
        "generate": ["generate", "--prompt-ids", "1"],
        "serve": ["serve", "--port", "0"],
        "worker": ["worker", "--bind", "ipc:///tmp/cde-test-never"],
        "bench": ["bench", "engine"],
    }[command]
    out = subprocess.run(
        [sys.executable, "-m", "cde", *args, "--model", "org/absent"],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=120,
        env={**os.environ, **hf},
    )
    name = "bench engine" if command == "bench" else command
    assert out.returncode == 1, out.stderr
    assert out.stderr.startswith(f"cde {name}: 'org/absent' is neither a directory nor in the Hugging Face cache")
    assert "Traceback" not in out.stderr
