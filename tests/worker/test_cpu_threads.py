"""A CPU worker's torch threads, chosen in a real process: an explicit --threads, then
OMP_NUM_THREADS, then the cores the process may use (here bound by `taskset`) among the host's
workers; `cde worker` logs the choice at start (tests/gateway/test_worker_catalogs.py reads it)."""

import os
import subprocess
import sys

import pytest

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
