"""shared/home.py: the compile caches under CDE_HOME, Inductor's named by CDE's custom ops."""

from __future__ import annotations

import os
import shutil
from pathlib import Path

import pytest
from cde.shared.home import KERNELS_DIR, kernels_digest, use_compile_caches


def test_the_caches_go_under_cde_home_and_inductors_is_named_by_the_kernels(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("CDE_HOME", str(tmp_path))
    monkeypatch.delenv("TORCHINDUCTOR_CACHE_DIR", raising=False)
    monkeypatch.delenv("TRITON_CACHE_DIR", raising=False)
    use_compile_caches()
    assert "fp8_ops.py" in {p.name for p in KERNELS_DIR.glob("*.py")}  # the directory the ops live in
    digest = kernels_digest(KERNELS_DIR)
    assert os.environ["TORCHINDUCTOR_CACHE_DIR"] == str(tmp_path / "compile-cache" / f"inductor-{digest}")
    assert os.environ["TRITON_CACHE_DIR"] == str(tmp_path / "compile-cache" / "triton")


def test_an_operators_directories_win(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", str(tmp_path / "i"))
    monkeypatch.setenv("TRITON_CACHE_DIR", str(tmp_path / "t"))
    use_compile_caches()
    assert (os.environ["TORCHINDUCTOR_CACHE_DIR"], os.environ["TRITON_CACHE_DIR"]) == (
        str(tmp_path / "i"),
        str(tmp_path / "t"),
    )


def test_a_changed_or_added_op_source_changes_the_digest_and_nothing_else_does(tmp_path: Path) -> None:
    """An upgrade that changes a custom op must not find the old compiled graphs that call it."""
    kernels = tmp_path / "kernels"
    shutil.copytree(KERNELS_DIR, kernels, ignore=shutil.ignore_patterns("__pycache__"))
    before = kernels_digest(kernels)
    assert kernels_digest(kernels) == before  # a restart of the same install reuses its cache
    (kernels / "notes.txt").write_text("not a source")
    assert kernels_digest(kernels) == before
    ops = kernels / "fp8_ops.py"
    ops.write_text(ops.read_text() + "\n# one more argument\n")
    changed = kernels_digest(kernels)
    assert changed != before
    (kernels / "new_op.py").write_text("")
    assert kernels_digest(kernels) != changed
