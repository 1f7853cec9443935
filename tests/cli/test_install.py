"""CDE installs as one top-level package, `cde`, and lives beside PyPI's `kernels` and `shared`
(issue 18): the repository's folders gateway/, worker/, shared/ and kernels/ install as
cde.gateway, cde.worker, cde.shared and cde.kernels, so the PyPI packages of those names keep
theirs.

A fresh venv gets the two PyPI packages from the wheels in .cache/pypi (`.ci/run` downloads them
with their dependencies; no network here) and a non-editable build of this checkout. For speed it
reaches the CI venv's packages through a .pth line naming that venv's site-packages (pip installs
only what those lack: `kernels` wants a newer huggingface_hub, sigstore, ...). A .pth line only
adds a directory to sys.path, it does not run the .pth files inside it, so the editable install's
import hook there stays out (the test checks that `cde` is the venv's own copy)."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sysconfig
import venv
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
WHEELS = ROOT / ".cache" / "pypi"
PYPI = ("kernels==0.17.2", "shared==0.0.32")
DOWNLOAD = "pip download -d .cache/pypi " + " ".join(PYPI)

PROBE = """
import json, sys
import kernels, shared, cde, cde.kernels, cde.shared, cde.gateway, cde.worker
from importlib.metadata import distribution
dist = distribution("cde")
print(json.dumps({
    "files": {m.__name__: m.__file__ for m in (kernels, shared, cde, cde.kernels, cde.shared, cde.gateway, cde.worker)},
    "top_level": (dist.read_text("top_level.txt") or "").split(),
    "record": [str(f) for f in dist.files or []],
    "dist_at": str(dist.locate_file("")),
    "prefix": sys.prefix,
}))
"""


def _wheels() -> list[Path]:
    found = sorted(WHEELS.glob("*.whl")) if WHEELS.is_dir() else []
    names = {w.name.split("-")[0].lower() for w in found}
    if not {"kernels", "shared"} <= names:
        pytest.fail(f"{WHEELS} lacks the kernels and shared wheels; run `{DOWNLOAD}` first (.ci/run does)")
    return found


def _run(cmd: list, cwd: Path, env: dict[str, str], hint: str) -> str:
    done = subprocess.run(cmd, cwd=cwd, env=env, capture_output=True, text=True)
    if done.returncode:
        pytest.fail(f"{' '.join(map(str, cmd))} failed {hint}\n{done.stdout}\n{done.stderr}")
    return done.stdout


def _source_copy(dest: Path) -> Path:
    """The files a build reads, copied, so that the build's build/ and egg-info stay out of the
    checkout (other runs may be building there at the same time)."""
    skip = shutil.ignore_patterns("__pycache__", "*.egg-info")
    for name in ("pyproject.toml", "README.md"):
        shutil.copy2(ROOT / name, dest / name)
    for folder in ("cde", "gateway", "worker", "shared", "kernels"):
        shutil.copytree(ROOT / folder, dest / folder, ignore=skip)
    return dest


@pytest.mark.slow
def test_installs_beside_pypi_kernels_and_shared(tmp_path: Path) -> None:
    _wheels()
    env_dir = tmp_path / "venv"
    venv.create(env_dir, with_pip=False)
    python = env_dir / "bin" / "python"
    site = Path(
        subprocess.check_output(
            [python, "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"], text=True
        ).strip()
    )
    (site / "ci_venv_deps.pth").write_text(sysconfig.get_paths()["purelib"] + "\n")
    src = tmp_path / "src"
    src.mkdir()
    _source_copy(src)

    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "PIP_FIND_LINKS", "PIP_INDEX_URL")}
    env["PIP_DISABLE_PIP_VERSION_CHECK"] = "1"
    pip = [python, "-m", "pip", "install", "-q", "--no-index"]
    _run([*pip, "--find-links", WHEELS, *PYPI], tmp_path, env, f"(are all the wheels there? `{DOWNLOAD}`)")
    _run([*pip, "--no-deps", "--no-build-isolation", src], tmp_path, env, "")
    got = json.loads(_run([python, "-c", PROBE], tmp_path, env, ""))
    assert Path(got["prefix"]) == env_dir
    files = {name: Path(f) for name, f in got["files"].items()}
    # Every module is the venv's own: PyPI's kernels and shared, and our non-editable copy.
    for name, f in files.items():
        assert f.is_relative_to(site), f"{name} imported from {f}, not from the venv"
    assert files["kernels"] == site / "kernels" / "__init__.py"
    assert files["shared"] == site / "shared" / "__init__.py"
    for sub in ("kernels", "shared", "gateway", "worker"):
        assert files[f"cde.{sub}"] == site / "cde" / sub / "__init__.py"

    # Nothing of ours at top level but `cde` (and its dist-info): top_level.txt and every file the
    # wheel wrote, bar the console script in bin/.
    assert got["top_level"] == ["cde"]
    assert Path(got["dist_at"]) == site
    tops = {Path(f).parts[0] for f in got["record"] if not f.startswith("..")}
    assert {t for t in tops if not t.endswith(".dist-info")} == {"cde"}, sorted(tops)
    assert [t.split("-")[0] for t in tops if t.endswith(".dist-info")] == ["cde"], sorted(tops)
    # And PyPI's packages are intact: their own top-level names, their own files.
    assert (site / "kernels" / "_rust.abi3.so").is_file()
    assert (site / "shared" / "__main__.py").is_file()
    assert not (site / "gateway").exists() and not (site / "worker").exists()
