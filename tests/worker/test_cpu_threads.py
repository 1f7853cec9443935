"""A CPU worker's torch threads, chosen in a real process: an explicit --threads, then
OMP_NUM_THREADS, then the cores the process may use (here bound by `taskset`) among the host's
workers; `cde worker` logs the choice at start (tests/gateway/test_worker_catalogs.py reads it)."""

import os
import subprocess
import sys

import pytest
from cde.worker.cpu_threads import HUGE_PAGES_ENV

PROBE = "import sys, torch; from cde.worker.cpu_threads import set_cpu_threads; {call}; print(torch.get_num_threads())"


def threads_in(call: str, cpus: str = "0", omp: str | None = None) -> int:
    env = {k: v for k, v in os.environ.items() if k != "OMP_NUM_THREADS"}
    if omp is not None:
        env["OMP_NUM_THREADS"] = omp
    cmd = ["taskset", "-c", cpus, sys.executable, "-c", PROBE.format(call=call)]
    res = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=120, check=False)
    assert res.returncode == 0, res.stderr
    return int(res.stdout.split()[-1])


def test_one_usable_core_means_one_thread():
    assert threads_in("set_cpu_threads(None)") == 1


@pytest.mark.skipif(len(os.sched_getaffinity(0)) < 2, reason="needs two cores to share")
def test_two_workers_share_two_cores_one_each():
    assert threads_in("set_cpu_threads(None, workers_on_host=2)", cpus="0,1") == 1


def test_the_flag_then_the_environment_win():
    assert threads_in("set_cpu_threads(3)", omp="2") == 3
    assert threads_in("set_cpu_threads(None)", omp="2") == 2


HUGE_PAGES_PROBE = """
from cde.worker.cpu_threads import use_huge_pages
use_huge_pages()
import torch

def huge_kb():
    return sum(int(line.split()[1]) for line in open("/proc/self/smaps_rollup") if line.startswith("AnonHugePages"))

before = huge_kb()
logits = torch.empty(256, 100352).fill_(1.0)  # 256 rows of float32 logits: 98 MiB
print(huge_kb() - before)
"""


def huge_pages_offered() -> bool:
    """Whether the kernel gives transparent huge pages to a process that asks (madvise) or to all."""
    with open("/sys/kernel/mm/transparent_hugepage/enabled") as f:
        return "[never]" not in f.read()


@pytest.mark.parametrize("switch", [None, "0"])
def test_large_tensors_come_in_huge_pages_unless_switched_off(switch):
    """`use_huge_pages` (the CLI calls it first) turns torch's switch on unless the operator set it:
    a logits-sized tensor then sits in 2 MB pages where the kernel offers them; with the switch
    set to 0 it gets none."""
    env = {k: v for k, v in os.environ.items() if k != HUGE_PAGES_ENV}
    if switch is not None:
        env[HUGE_PAGES_ENV] = switch
    res = subprocess.run(
        [sys.executable, "-c", HUGE_PAGES_PROBE], env=env, capture_output=True, text=True, timeout=120, check=False
    )
    assert res.returncode == 0, res.stderr
    huge_kb = int(res.stdout.split()[-1])
    if switch == "0" or not huge_pages_offered():
        assert huge_kb == 0
    else:
        assert huge_kb >= 64 * 1024  # most of the 98 MiB


def test_the_cli_asks_for_huge_pages_before_any_command_runs():
    probe = (
        "import os; from cde.cli import main\n"
        "try:\n    main(['make-model', '--help'])\nexcept SystemExit:\n    pass\n"
        f"print(os.environ['{HUGE_PAGES_ENV}'])"
    )
    env = {k: v for k, v in os.environ.items() if k != HUGE_PAGES_ENV}
    res = subprocess.run(
        [sys.executable, "-c", probe], env=env, capture_output=True, text=True, timeout=120, check=False
    )
    assert res.returncode == 0, res.stderr
    assert res.stdout.split()[-1] == "1"
