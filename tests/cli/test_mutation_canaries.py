"""The mutation-canary runner (scripts/mutation_canaries.py) judges a canary by what pytest ran,
not by its exit status: it once reported all 20 canaries "caught" in 2 s from a python without
pytest, whose `python -m pytest` also exits 1. Each test here runs the real script as a process on
a canary list of its own, whose bugs are planted in shared/wire.py and judged by
tests/shared/test_wire.py (the cheapest selection with a real catch)."""

import re
import subprocess
import sys
import venv
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
SCRIPT = REPO / "scripts" / "mutation_canaries.py"
# The line a canary of scripts/canaries.toml already anchors on ("wire: a bool passes for an int").
FIND = "type(value) is hint and hint in _SCALARS"


def canary(name: str, replace: str, tests: str = "tests/shared/test_wire.py") -> str:
    fields = {"name": name, "file": "shared/wire.py", "find": FIND, "replace": replace}
    return "[[canary]]\n" + "".join(f'{k} = "{v}"\n' for k, v in fields.items()) + f'tests = ["{tests}"]\n'


def run_runner(python: str | Path, toml: str, tmp_path: Path) -> tuple[int, dict[str, str], str]:
    """The runner's exit status, each canary's verdict by name, and its whole output."""
    path = tmp_path / "canaries.toml"
    path.write_text(toml)
    res = subprocess.run(
        [str(python), str(SCRIPT), "--canaries", str(path)], cwd=REPO, capture_output=True, text=True, timeout=300
    )
    out = res.stdout + res.stderr
    verdicts = {m[2]: m[1] for m in re.finditer(r"^(caught|SURVIVED|BROKEN)\s+[\d.]+s\s+(.+)$", out, re.M)}
    return res.returncode, verdicts, out


def test_a_python_without_pytest_makes_every_canary_broken(tmp_path):
    env_dir = tmp_path / "venv"
    venv.create(env_dir, with_pip=False)  # the standard library only
    python = env_dir / "bin" / "python"
    assert subprocess.run([python, "-c", "import pytest"], capture_output=True).returncode != 0
    rc, verdicts, out = run_runner(
        python, canary("bool passes for int", "hint in _SCALARS and isinstance(value, hint)"), tmp_path
    )
    assert verdicts == {"bool passes for int": "BROKEN"}, out
    assert rc != 0, out


def test_only_a_failing_test_catches_a_bug(tmp_path):
    toml = "\n".join(
        [
            canary("bool passes for int", "hint in _SCALARS and isinstance(value, hint)"),
            canary("the same check written the other way round", "hint in _SCALARS and type(value) is hint"),
            canary("a syntax error: the test module cannot import", "(type(value) is hint"),
            canary(
                "no test selected",
                "hint in _SCALARS and isinstance(value, hint)",
                "tests/shared/test_wire.py::no_such_test",
            ),
        ]
    )
    rc, verdicts, out = run_runner(sys.executable, toml, tmp_path)
    assert verdicts == {
        "bool passes for int": "caught",
        "the same check written the other way round": "SURVIVED",
        "a syntax error: the test module cannot import": "BROKEN",
        "no test selected": "BROKEN",
    }, out
    assert rc != 0, out


def test_every_canary_of_the_list_finds_its_snippet_once_and_its_tests():
    """The list CI runs last: a snippet that an edit moved (found 0 or 2 times) or a test renamed
    away is reported here, in the parallel tests, not ~18 minutes in at the canaries' turn."""
    import importlib.util

    spec = importlib.util.spec_from_file_location("mutation_canaries", SCRIPT)
    runner = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = runner  # its dataclasses look their module up
    spec.loader.exec_module(runner)
    for c in runner.load(runner.CANARIES):
        text = (REPO / c.file).read_text()
        assert text.count(c.find) == 1, (c.name, c.file, text.count(c.find))
        assert c.replace != c.find and c.tests, c.name
        for test in c.tests:
            path, _, name = test.partition("::")
            assert (REPO / path).is_file(), (c.name, test)
            if name:  # a test function by name (a parametrized case's id is checked when it runs)
                assert f"def {name.split('[')[0]}(" in (REPO / path).read_text(), (c.name, test)
