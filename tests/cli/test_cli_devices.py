"""`--device`: a value no command can use is refused by its parser, and a cuda device torch cannot
use (a CPU build of torch, or no GPU visible) is one line before any model loads, each run as a
real `python -m cde` process. CUDA_VISIBLE_DEVICES=99 names a GPU no machine has: torch then sees
none, with a CUDA build as with a CPU build."""

import os
import re
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from tests.cde_procs import run_cde

ROOT = Path(__file__).resolve().parents[2]
NO_GPU = {"CUDA_VISIBLE_DEVICES": "99"}


def one_line(res: subprocess.CompletedProcess, command: str, status: int, *says: str) -> None:
    lines = res.stderr.strip().splitlines()
    assert res.returncode == status and len(lines) == 1, res.stderr
    assert lines[0].startswith(f"cde {command}: ") and all(s in lines[0] for s in says), res.stderr


@pytest.mark.parametrize("command", ["worker", "generate", "bench engine", "bench prefix-cache", "eval", "make-model"])
def test_a_device_no_command_knows_is_refused_by_the_parser(command):
    res = run_cde(*command.split(), "--device", "gpu")
    one_line(res, command, 2, "argument --device", "'gpu'")


def test_a_worker_takes_an_indexed_cuda_device():
    from cde.commands.worker import worker_device

    assert [worker_device(d) for d in ("auto", "cpu", "cuda", "cuda:1")] == ["auto", "cpu", "cuda", "cuda:1"]


@pytest.mark.parametrize(
    "command,args",
    [
        ("generate", ["--prompt", "hi"]),
        ("worker", ["--bind", "ipc://@cde-test-devices"]),
        ("serve", []),
        ("make-model", ["--preset", "tiny", "/nonexistent/cde-never-written"]),
    ],
)
def test_cuda_that_torch_cannot_use_is_one_line(command, args):
    res = run_cde(command, "--device", "cuda", *args, env=NO_GPU)
    one_line(res, command, 1, "--device cuda but torch cannot use a GPU here")


def test_serve_auto_asks_torch_not_only_cuda_visible_devices(tmp_path):
    """`--device auto` with CUDA_VISIBLE_DEVICES naming a GPU torch cannot use serves on the CPU;
    torch is asked in a child process, never loaded into the gateway (250 MB resident)."""
    cmd = [sys.executable, "-m", "cde", "serve", "--port", "0", "--workers", "1", "--warm-up", "off"]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "TMPDIR": str(tmp_path), **NO_GPU}
    proc = subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    lines = []
    for line in proc.stdout:
        lines.append(line)
        if re.search(r"CDE serving .* at http://", line) or "exited with code" in line:
            break
    gateway_libraries = Path(f"/proc/{proc.pid}/maps").read_text()
    proc.send_signal(signal.SIGTERM)
    lines += proc.stdout.readlines()
    assert proc.wait(30) == 0, "".join(lines)
    assert any("(1 worker on CPU)" in line for line in lines), "".join(lines)
    assert "libtorch" not in gateway_libraries
