"""`cde gateway` + `cde worker` as separate processes over TCP (the multi-machine layout): the
gateway serves 503 until a worker answers, then routes to it."""

import os
import re
import signal
import socket
import subprocess
import sys
import time

import httpx
import pytest

from tests.api_server import REPO

ENV = {**os.environ, "OMP_NUM_THREADS": "1"}


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start(*args) -> subprocess.Popen:
    return subprocess.Popen(
        [sys.executable, "-m", "cde", *args],
        cwd=REPO,
        env=ENV,
        text=True,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
    )


def wait_line(proc, pattern, timeout=120.0) -> re.Match:
    deadline = time.monotonic() + timeout
    seen = []
    for line in proc.stdout:
        seen.append(line)
        if m := re.search(pattern, line):
            return m
        assert time.monotonic() < deadline, "".join(seen)
    raise AssertionError("process ended:\n" + "".join(seen))


def stop(proc) -> int:
    proc.send_signal(signal.SIGTERM)
    try:
        return proc.wait(30)
    except subprocess.TimeoutExpired:
        proc.kill()
        return proc.wait()


@pytest.fixture
def procs():
    started = []
    yield started
    for p in started:
        if p.poll() is None:
            stop(p)


def test_gateway_waits_for_a_tcp_worker(tiny_dir, procs):
    endpoint = f"tcp://127.0.0.1:{free_port()}"
    gateway = start("gateway", "--worker", endpoint, "--port", "0", "--heartbeat-timeout", "3")
    procs.append(gateway)
    url = wait_line(gateway, r"listening on (http://\S+)/v1").group(1)
    assert httpx.get(url + "/health").status_code == 503
    r = httpx.post(url + "/v1/completions", json={"model": "x", "prompt": "hi"})
    assert r.status_code == 503 and r.json()["error"]["code"] == "no_worker"

    worker = start(
        "worker", "--model", str(tiny_dir), "--bind", endpoint, "--device", "cpu", "--served-model-name", "tiny"
    )
    procs.append(worker)
    wait_line(worker, "worker ready")
    deadline = time.monotonic() + 30
    while httpx.get(url + "/health").status_code != 200:
        assert time.monotonic() < deadline
        time.sleep(0.1)
    r = httpx.post(
        url + "/v1/completions",
        timeout=60,
        json={"model": "tiny", "prompt": "hi", "max_tokens": 8, "temperature": 0, "tokens_per_step": 8},
    )
    assert r.status_code == 200 and r.json()["choices"][0]["finish_reason"] == "length"

    assert stop(worker) == 0
    deadline = time.monotonic() + 10  # no process handle: found dead by missing heartbeats
    while httpx.get(url + "/health").status_code != 503:
        assert time.monotonic() < deadline
        time.sleep(0.2)
    assert stop(gateway) == 0
