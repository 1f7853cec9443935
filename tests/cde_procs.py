"""Real `cde worker` / `cde gateway` subprocesses whose output is collected as they run."""

from __future__ import annotations

import os
import re
import socket
import subprocess
import sys
import threading
import time
from unittest import mock

import httpx

from tests.api_server import REPO, metrics_at, stop_process

ENV = {**os.environ, "OMP_NUM_THREADS": "1"}


def cde_in_process(*args: str) -> int:
    """`cde ARGS` through the CLI's entry point, in this process (for commands whose work is their
    parser or an early check): its exit status, the parser's refusals included. What the CLI sets
    for its process is put back: its environment defaults (compile caches) and torch's threads."""
    import torch

    from cde.cli import main

    threads = torch.get_num_threads()
    try:
        with mock.patch.dict(os.environ):
            return main(list(args))
    except SystemExit as exc:  # the parser's refusals
        return exc.code if isinstance(exc.code, int) else 1
    finally:
        torch.set_num_threads(threads)


def run_cde(
    *args: str, env: dict | None = None, timeout: float = 60, module: str = "cde"
) -> subprocess.CompletedProcess:
    """One `python -m cde` command (or `module`'s, tests.faulty_worker), run to its end, its output captured."""
    return subprocess.run(
        [sys.executable, "-m", module, *args],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=timeout,
        env={**ENV, **(env or {})},
        check=False,
    )


def wait_for(predicate, what: str, timeout: float = 30.0):
    """`predicate()`'s first true value, polled until `timeout` seconds have passed."""
    deadline = time.monotonic() + timeout
    while not (value := predicate()):
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.02)
    return value


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class CdeProcess:
    def __init__(self, *args: str, module: str = "cde"):
        self.proc = subprocess.Popen(
            [sys.executable, "-m", module, *args],
            cwd=REPO,
            env=ENV,
            text=True,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
        )
        self.lines: list[str] = []
        self._new_line = threading.Condition()
        self._drainer = threading.Thread(target=self._drain, daemon=True)
        self._drainer.start()

    def _drain(self) -> None:
        for line in self.proc.stdout:
            with self._new_line:
                self.lines.append(line)
                self._new_line.notify_all()
        with self._new_line:
            self._new_line.notify_all()

    @property
    def output(self) -> str:
        return "".join(self.lines)

    def wait_for(self, pattern: str, timeout: float = 120.0) -> re.Match:
        deadline = time.monotonic() + timeout
        with self._new_line:
            while True:
                for line in self.lines:
                    if m := re.search(pattern, line):
                        return m
                left = deadline - time.monotonic()
                assert left > 0 and self.proc.poll() is None, f"no {pattern!r} in:\n{self.output}"
                self._new_line.wait(min(left, 1.0))

    def stop(self) -> int:
        return stop_process(self.proc, self.lines, self._drainer)


class TinyWorker(CdeProcess):
    """`cde worker` (or `module`'s, tests.faulty_worker) serving `model_dir` as "tiny" on the CPU at
    `endpoint`, a free loopback port unless `port` names one; `extra` flags after those."""

    def __init__(self, model_dir, *extra: str, port: int | None = None, module: str = "cde"):
        self.endpoint = f"tcp://127.0.0.1:{port or free_port()}"
        command = ("worker",) if module == "cde" else ()
        flags = ("--model", str(model_dir), "--bind", self.endpoint, "--device", "cpu", "--served-model-name", "tiny")
        super().__init__(*command, *flags, *extra, module=module)


class Gateway(CdeProcess):
    def __init__(self, *args: str):
        super().__init__("gateway", "--port", "0", "--log-level", "info", *args)
        self.url = self.wait_for(r"listening on (http://\S+)/v1").group(1)

    def health(self) -> tuple[int, dict]:
        r = httpx.get(self.url + "/health", timeout=10)
        return r.status_code, r.json()

    def metrics(self) -> dict[str, float]:
        return metrics_at(self.url)

    def wait_health(self, status: int, timeout: float = 30.0) -> dict:
        deadline = time.monotonic() + timeout
        while (got := self.health())[0] != status:
            assert time.monotonic() < deadline, f"/health stayed {got} (wanted {status}):\n{self.output}"
            time.sleep(0.1)
        return got[1]

    def complete(self, timeout: float = 60.0, **extra) -> httpx.Response:
        body = {"model": "tiny", "prompt": "hi", "max_tokens": 8, "temperature": 0, "tokens_per_step": 8, **extra}
        return httpx.post(self.url + "/v1/completions", json=body, timeout=timeout)
