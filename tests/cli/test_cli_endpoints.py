"""ZeroMQ endpoints on the command line: `cde worker --bind` is tried before the model loads (a busy
port or a malformed endpoint is one line, not a ZMQError once the model is ready), and `cde gateway
--worker` is checked before the server starts; each run as a real `python -m cde` process."""

import socket
import subprocess

import pytest

from tests.cde_procs import run_cde


def one_line(res: subprocess.CompletedProcess, command: str, *says: str) -> None:
    lines = res.stderr.strip().splitlines()
    assert res.returncode == 1 and len(lines) == 1, res.stderr + res.stdout
    assert lines[0].startswith(f"cde {command}: ") and all(s in lines[0] for s in says), res.stderr
    assert "ready" not in res.stdout, res.stdout  # refused before the model loaded


def test_a_busy_worker_port_is_one_line_before_the_model_loads(tiny_dir):
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        endpoint = f"tcp://127.0.0.1:{busy.getsockname()[1]}"
        res = run_cde("worker", "--model", str(tiny_dir), "--device", "cpu", "--bind", endpoint)
    one_line(res, "worker", f"--bind {endpoint}", "Address already in use")


@pytest.mark.parametrize("endpoint", ["127.0.0.1:5597", "udp://127.0.0.1:5597"])
def test_a_malformed_endpoint_is_one_line_naming_the_flag(tiny_dir, endpoint):
    res = run_cde("worker", "--model", str(tiny_dir), "--device", "cpu", "--bind", endpoint)
    one_line(res, "worker", f"--bind {endpoint}", "tcp://HOST:PORT or ipc://PATH")
    res = run_cde("gateway", "--port", "0", "--worker", "ipc:///tmp/cde-test-fine", "--worker", endpoint)
    one_line(res, "gateway", f"--worker {endpoint}", "tcp://HOST:PORT or ipc://PATH")
