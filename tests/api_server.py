"""Start a real `cde serve` subprocess for API tests, and read what it exposes."""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import threading
import time
import warnings
from pathlib import Path

import httpx

from cde.commands.load_client import metric_samples
from cde.commands.serve import kill_showing_stacks

REPO = Path(__file__).resolve().parents[1]
_BANNER = re.compile(r"CDE (?:serving .* at|gateway listening on) (http://\S+)/v1")


SLOW_STOP_S = 5.0  # a test process's stop slower than this is reported, with what it wrote last


def stop_process(proc: subprocess.Popen, output: list[str], drainer: threading.Thread | None) -> int:
    """SIGTERM, and the exit status. A process still running 30 s later first writes its threads'
    stacks into `output`, then is killed (-9). A stop slower than
    SLOW_STOP_S is a warning carrying the end of `output` (read to its end by `drainer`), so that a
    CI log says why a teardown took its time (a worker killed by serve after its stop timeout
    writes its stacks there too, cde/commands/serve.py)."""
    t0 = time.monotonic()
    if proc.poll() is None:
        proc.send_signal(signal.SIGTERM)
    try:
        status = proc.wait(30)
    except subprocess.TimeoutExpired:
        status = kill_showing_stacks(proc)
    if (took := time.monotonic() - t0) > SLOW_STOP_S:
        if drainer is not None:
            drainer.join(5)
        command = " ".join(str(a) for a in proc.args[2:4])  # type: ignore[index]  # past `python -m`
        warnings.warn(
            f"{command} took {took:.1f} s to stop (status {status}); its last lines:\n" + "".join(output[-60:]),
            stacklevel=3,  # the fixture that stopped it
        )
    return status


def metrics_at(url: str) -> dict[str, float]:
    """The /metrics samples of the server at `url` by `name{labels}`, and each name's sum over its
    labels by plain `name`."""
    return metric_samples(httpx.get(url + "/metrics", timeout=10).text)


class ServerProcess:
    def __init__(
        self,
        model_dir,
        *args: str,
        workers: int = 2,
        timeout: float = 180.0,
        command: str = "serve",
        env: dict[str, str] | None = None,
    ):
        """`command="gateway"`: only the gateway, with `--worker` endpoints among `args`; `model_dir`
        None: no --model (serve: the built-in demo model); `env`: added to the environment (an
        API key goes in CDE_API_KEY: the command line refuses it)."""
        model = [] if model_dir is None else ["--model", str(model_dir)]
        cmd = [sys.executable, "-m", "cde", command, *model, "--port", "0", *args]
        if command == "serve":
            cmd += ["--workers", str(workers), "--device", "cpu"]
        # One torch thread per worker: CI machines are small and often busy.
        env = {**os.environ, "OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS", "1"), **(env or {})}
        self.proc = subprocess.Popen(
            cmd, cwd=REPO, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True
        )
        self.output: list[str] = []
        self._drainer: threading.Thread | None = None  # from the banner on (before it, the start reads)
        self.url = self._wait_for_banner(timeout)
        self._drainer = threading.Thread(target=self._drain, daemon=True)
        self._drainer.start()

    def _wait_for_banner(self, timeout: float) -> str:
        deadline = time.monotonic() + timeout
        for line in self.proc.stdout:
            self.output.append(line)
            m = _BANNER.search(line)
            if m:
                return m.group(1)
            if time.monotonic() > deadline:
                break
        self.stop()
        raise RuntimeError("cde serve did not start:\n" + "".join(self.output))

    def _drain(self) -> None:
        for line in self.proc.stdout:
            self.output.append(line)

    @property
    def base_url(self) -> str:
        return self.url + "/v1"

    def health(self) -> tuple[int, dict]:
        r = httpx.get(self.url + "/health", timeout=10)
        return r.status_code, r.json()

    def worker_pids(self) -> list[int]:
        return [w["pid"] for w in self.health()[1]["workers"]]

    def metrics(self) -> dict[str, float]:
        return metrics_at(self.url)

    def stop(self) -> int:
        return stop_process(self.proc, self.output, self._drainer)


def pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    # A zombie still answers kill(0); it has exited all the same.
    try:
        return Path(f"/proc/{pid}/stat").read_text().split()[2] != "Z"
    except FileNotFoundError:
        return False


# A long streamed request for the fault tests (900 steps of the tiny model). One event per block,
# not one per step that grew the prefix: fewer events the gateway may hold when a worker is stopped
# or killed (`stream_outcome` reads past those to the stream's end).
LONG = {
    "model": "tiny",
    "prompt": "x",
    "max_tokens": 900,
    "temperature": 0,
    "stream": True,
    "stream_granularity": "block",
}


async def read_events(response: httpx.Response):
    """Yields each SSE payload of a streamed response (parsed JSON, or the string "[DONE]")."""
    async for line in response.aiter_lines():
        if line.startswith("data: "):
            yield "[DONE]" if line == "data: [DONE]" else json.loads(line[6:])


async def stream_outcome(events) -> tuple[str, str, float]:
    """Reads a stream to its end after a fault: ("error", its message, seconds until the error came)
    or ("finished", the finish reason, 0.0). Blocks the gateway held before the fault come first,
    so the event right after it says nothing of how the stream ends."""
    t0 = time.monotonic()
    async for event in events:
        if "error" in event:
            assert await anext(events) == "[DONE]"
            return "error", event["error"]["message"], time.monotonic() - t0
        if event["choices"][0]["finish_reason"] is not None:
            assert await anext(events) == "[DONE]"
            return "finished", event["choices"][0]["finish_reason"], 0.0
    raise AssertionError("the stream ended with neither an error nor a finish reason")
