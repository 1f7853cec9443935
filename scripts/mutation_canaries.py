#!/usr/bin/env python3
"""Mutation canaries: plant each small deliberate bug of scripts/canaries.toml in a scratch copy
of the repository, run the tests that should catch it, and fail if any bug survives.

A test suite that passes says nothing about the bugs it would miss; each canary is one such bug
that once went unnoticed (or that guards an important module), kept here so the tests that now
catch it cannot quietly stop doing so.

The working tree is never touched (others edit it while this runs): the files git knows about
(tracked, plus untracked ones that are not ignored) are copied into a temporary directory per
canary, and pytest runs there with that copy first on the import path. The package is installed
editable from the real checkout, but its import hook comes after the path entries, so the copy's
modules win; `check_isolation` proves it before anything runs.

The verdict comes from what ran, read from pytest's JUnit XML report, never from its exit status
alone (a python without pytest also exits 1): "caught" only when pytest collected the canary's
tests and at least one of them failed an assertion; "SURVIVED" when they ran and passed; anything
else (no pytest, no report, an import or collection error, a fixture error, no test selected, a
timeout, a snippet no longer found exactly once) is BROKEN, and fails the run as a survivor does.

    python scripts/mutation_canaries.py            # all, two at a time
    python scripts/mutation_canaries.py -k sampler # names containing "sampler"
    python scripts/mutation_canaries.py --list
    python scripts/mutation_canaries.py --canaries other.toml  # another list (the runner's own test)
"""

from __future__ import annotations

import argparse
import contextlib
import multiprocessing
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
import tomllib
import xml.etree.ElementTree as ET
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
CANARIES = Path(__file__).with_name("canaries.toml")
PACKAGES = ("cde", "gateway", "kernels", "shared", "worker", "tests")  # folders copied
MODULES = ("cde", "cde.gateway", "cde.kernels", "cde.shared", "cde.worker", "tests")  # must come from the copy
TIMEOUT_S = 150  # per canary by default: a mutation that makes a test hang must still end
REPORT = ".canary-junit.xml"  # pytest's JUnit XML report, written in the scratch copy


@dataclass
class Canary:
    name: str
    file: str
    find: str
    replace: str
    tests: list[str]
    why: str = ""
    timeout_s: float = TIMEOUT_S  # a canary whose tests are slow under load states its own


@dataclass
class Outcome:
    canary: Canary
    verdict: str  # "caught" | "SURVIVED" | "BROKEN"
    seconds: float
    detail: str = ""


def load(path: Path) -> list[Canary]:
    return [Canary(**c) for c in tomllib.loads(path.read_text())["canary"]]


def _visible(path: str) -> bool:
    """Not under a hidden directory (a CI virtualenv, caches) nor a __pycache__."""
    return not any(part.startswith(".") or part == "__pycache__" for part in Path(path).parts)


def repo_files() -> list[str]:
    """The tracked files, and the untracked ones git does not ignore (new work) outside hidden
    directories; outside a git checkout (an exported tree), every visible file."""

    def git(*args: str) -> list[str] | None:
        res = subprocess.run(["git", "ls-files", "-z", *args], cwd=REPO, capture_output=True)
        return res.stdout.decode().split("\0") if res.returncode == 0 else None

    tracked, others = git("--cached"), git("--others", "--exclude-standard")
    if tracked is None or others is None:
        files = [str(p.relative_to(REPO)) for p in REPO.rglob("*") if p.is_file()]
        return [f for f in files if _visible(f)]
    # Deleted files are still listed as tracked until the deletion is committed.
    return [f for f in tracked + [o for o in others if _visible(o)] if f and (REPO / f).is_file()]


def copy_tree(files: list[str], dest: Path) -> None:
    for f in files:
        (dest / f).parent.mkdir(parents=True, exist_ok=True)
        shutil.copy2(REPO / f, dest / f)


def env_for(tree: Path) -> dict[str, str]:
    # One torch thread per run: the canaries run side by side on small CI machines.
    return {
        **os.environ,
        "PYTHONPATH": str(tree),
        "CDE_HOME": str(tree / ".cache" / "cde"),
        "OMP_NUM_THREADS": "1",
        "PYTHONDONTWRITEBYTECODE": "1",
    }


def _enter_copy(tree: str, log: str) -> None:
    """In a child of the fork server: output to `log`, and the scratch copy's environment with the
    copy first on the import path (where PYTHONPATH puts it in a fresh interpreter). The server
    imported nothing of the repository's own packages, so the child imports those from the copy."""
    os.setsid()  # its own process group: a timeout kills the servers its tests started too
    fd = os.open(log, os.O_WRONLY | os.O_CREAT | os.O_TRUNC)
    os.dup2(fd, 1)
    os.dup2(fd, 2)
    os.close(fd)
    os.chdir(tree)
    os.environ.update(env_for(Path(tree)))  # for the processes the tests start
    sys.dont_write_bytecode = True
    sys.path.insert(0, tree)


def _module_files(tree: str, log: str) -> None:
    _enter_copy(tree, log)
    import importlib

    print("\n".join(importlib.import_module(m).__file__ or "" for m in MODULES), flush=True)


def check_isolation(ctx: multiprocessing.context.BaseContext, tree: Path) -> None:
    """Every package imports from the copy, both where a canary's pytest runs (a child of the fork
    server) and in a fresh interpreter with the copy's PYTHONPATH (the processes its tests start)."""
    log = tree / ".modules.txt"
    child = ctx.Process(target=_module_files, args=(str(tree), str(log)))
    child.start()
    child.join(60)
    forked = log.read_text().split() if log.exists() and child.exitcode == 0 else []
    code = f"import importlib; print('\\n'.join(importlib.import_module(m).__file__ for m in {MODULES!r}))"
    fresh = subprocess.run(
        [sys.executable, "-c", code], cwd=tree, env=env_for(tree), check=False, capture_output=True, text=True
    ).stdout.split()
    for got in (forked, fresh):
        outside = [f for f in got if not Path(f).resolve().is_relative_to(tree.resolve())]
        if outside or len(got) != len(MODULES):
            raise SystemExit(f"the scratch copy does not shadow the installed package: {outside or got}")


def mutate(tree: Path, c: Canary) -> None:
    path = tree / c.file
    if not path.exists():
        raise LookupError(f"{c.file} does not exist")
    text = path.read_text()
    n = text.count(c.find)
    if n != 1:
        raise LookupError(f"snippet found {n} times in {c.file} (expected once): update the canary\n{c.find}")
    path.write_text(text.replace(c.find, c.replace))


@dataclass
class Run:
    """What one pytest run did: its exit status (None: killed at the timeout), the test cases its
    JUnit report lists (None: it wrote no report, so pytest never ran), and its output's tail."""

    rc: int | None
    cases: list[ET.Element] | None
    tail: str

    def count(self, outcome: str) -> int:
        return sum(c.find(outcome) is not None for c in self.cases or [])

    def verdict(self) -> tuple[str, str]:
        if self.rc is None:
            return "BROKEN", self.tail
        if self.cases is None:
            return "BROKEN", f"pytest wrote no report (exit {self.rc}): it did not run\n{self.tail}"
        failed, errors = self.count("failure"), self.count("error")
        passed = len(self.cases) - failed - errors - self.count("skipped")
        summary = f"pytest exit {self.rc}: {len(self.cases)} collected, {failed} failed, {errors} errors"
        if errors:  # an import, collection or fixture error: the tests never got to judge the code
            return "BROKEN", f"{summary} (errors are not failures)\n{self.tail}"
        if failed and self.rc == 1:
            return "caught", f"{summary}\n{self.tail}"
        if not failed and passed and self.rc == 0:
            return "SURVIVED", f"{summary}\n{self.tail}"
        return "BROKEN", f"{summary}, {passed} passed: no test judged the code\n{self.tail}"


def load_factor() -> float:
    """How many times over the machine's cores are busy (1 when idle or just full): a canary's
    timeout stretches by it, so that a loaded CI machine slows a canary down without killing it."""
    return max(1.0, os.getloadavg()[0] / (os.cpu_count() or 1))


def _run_pytest(tree: str, args: list[str], log: str) -> None:
    """A canary's pytest, in a child of the fork server (`_forkserver`). Its exit status is
    pytest's; in a python without pytest, the import error's (1), with no report."""
    _enter_copy(tree, log)
    import pytest as _pytest

    sys.exit(int(_pytest.main(args)))


def _forkserver() -> multiprocessing.context.BaseContext:
    """Children forked from one process that imported torch and pytest: each canary's run then
    starts without their ~3 s of imports (63 canaries, two at a time, on CI's two cores). The
    server starts with the canaries' environment, so torch reads OMP_NUM_THREADS=1 as it imports."""
    ctx = multiprocessing.get_context("forkserver")
    ctx.set_forkserver_preload(["torch", "pytest"])  # a module that is not installed is skipped
    return ctx


def pytest(ctx: multiprocessing.context.BaseContext, tree: Path, tests: list[str], timeout_s: float) -> Run:
    timeout_s *= load_factor()
    report, log = tree / REPORT, tree / ".canary-output.txt"
    report.unlink(missing_ok=True)
    args = ["-x", "-q", "-p", "no:cacheprovider", "--show-capture=no"]
    args += ["-p", "no:xdist", "-p", "no:xdist.looponfail"]  # one process: ~0.3 s of each start
    args += [f"--junitxml={report}", *tests]
    child = ctx.Process(target=_run_pytest, args=(str(tree), args, str(log)))
    child.start()
    child.join(timeout_s)
    if child.is_alive():
        with contextlib.suppress(ProcessLookupError):
            os.killpg(child.pid, signal.SIGKILL)  # pytest and every process its tests started
        child.join()
        return Run(None, None, f"tests ran past {timeout_s:.0f} s")
    output = log.read_text(errors="replace") if log.exists() else ""
    tail = "\n".join(output.strip().splitlines()[-15:])
    try:
        cases = ET.parse(report).getroot().findall(".//testcase")
    except (OSError, ET.ParseError):
        cases = None
    return Run(child.exitcode, cases, tail)


def run_one(
    ctx: multiprocessing.context.BaseContext, files: list[str], c: Canary, keep: bool, baseline: bool
) -> Outcome:
    t0 = time.monotonic()
    tree = Path(tempfile.mkdtemp(prefix="cde-canary-"))
    try:
        copy_tree(files, tree)
        if baseline:
            verdict, detail = pytest(ctx, tree, c.tests, c.timeout_s).verdict()
            if verdict != "SURVIVED":  # unmutated, the tests must run and pass
                return Outcome(c, "BROKEN", time.monotonic() - t0, f"without the mutation: {verdict}\n{detail}")
        try:
            mutate(tree, c)
        except LookupError as exc:
            return Outcome(c, "BROKEN", time.monotonic() - t0, str(exc))
        verdict, detail = pytest(ctx, tree, c.tests, c.timeout_s).verdict()
        return Outcome(c, verdict, time.monotonic() - t0, detail)
    finally:
        if keep:
            print(f"kept {tree} ({c.name})", flush=True)
        else:
            shutil.rmtree(tree, ignore_errors=True)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("-k", dest="match", default="", help="only canaries whose name contains this")
    ap.add_argument("-j", "--jobs", type=int, default=2, help="canaries run at once (default 2)")
    ap.add_argument("--list", action="store_true", help="list the canaries and exit")
    ap.add_argument("--canaries", type=Path, default=CANARIES, help="the list to run (default: %(default)s)")
    ap.add_argument("--keep", action="store_true", help="keep the scratch copies (their paths are printed)")
    ap.add_argument(
        "--baseline",
        action="store_true",
        help="first check that each canary's tests pass without its mutation (twice the time)",
    )
    ap.add_argument("-v", "--verbose", action="store_true", help="print the test output of every canary")
    args = ap.parse_args(argv)
    canaries = [c for c in load(args.canaries) if args.match in c.name]
    if args.list:
        for c in canaries:
            print(f"{c.name}: {c.file} -> {' '.join(c.tests)}")
        return 0
    if not canaries:
        print(f"no canary matches {args.match!r}", file=sys.stderr)
        return 2
    files = repo_files()
    os.environ["OMP_NUM_THREADS"] = "1"  # the fork server's, before it imports torch
    ctx = _forkserver()
    with tempfile.TemporaryDirectory(prefix="cde-canary-probe-") as probe:
        copy_tree([f for f in files if f.split("/")[0] in PACKAGES], Path(probe))
        check_isolation(ctx, Path(probe))
    t0 = time.monotonic()
    failed = 0
    with ThreadPoolExecutor(max(1, args.jobs)) as pool:
        for o in pool.map(lambda c: run_one(ctx, files, c, args.keep, args.baseline), canaries):
            failed += o.verdict != "caught"
            print(f"{o.verdict:8} {o.seconds:6.1f}s  {o.canary.name}", flush=True)
            if o.verdict != "caught" or args.verbose:
                print("    " + o.detail.replace("\n", "\n    "), flush=True)
    print(f"{len(canaries) - failed}/{len(canaries)} canaries caught in {time.monotonic() - t0:.0f} s")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
