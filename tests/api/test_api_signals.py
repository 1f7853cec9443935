"""Signals to a real `cde serve` outside the plain drain (tests/api/test_api_faults.py has that one):
during the start-up, a second one while draining, and its death by SIGKILL. Each ends its workers
and (but for SIGKILL) its socket directory, and an interrupt is one line, exit status 130."""

import contextlib
import json
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import NoReturn

import httpx
import pytest

from cde.commands.serve import kill_showing_stacks
from tests.api_server import LONG, REPO, ServerProcess, pid_alive
from tests.cde_procs import free_port, wait_for

INTERRUPTED = "cde serve: interrupted"


def children(pid: int) -> list[int]:
    out = []
    for task in Path(f"/proc/{pid}/task").glob("*"):
        out += [int(c) for c in (task / "children").read_text().split()]
    return out


def runs_the_worker(pid: int) -> bool:
    """Whether `pid` has exec'd `cde worker`. Between its fork and its exec a child is a copy of
    `cde serve`, whose Popen waits for that exec: a child stopped there stops serve too."""
    with contextlib.suppress(FileNotFoundError, ProcessLookupError):
        return b"\0worker\0" in Path(f"/proc/{pid}/cmdline").read_bytes()
    return False


# `cde serve` whose first worker's start is followed by a SIGTERM that lands in a `__del__`, where a
# KeyboardInterrupt raised by the signal's handler is printed and dropped: a signal that met the
# import machinery's weakref callback so was lost, and serve went on to serve.
DROPPED_SIGTERM = """
import os, signal, subprocess, sys
from cde.cli import main

class LandsHere:
    def __del__(self):
        os.kill(os.getpid(), signal.SIGTERM)
        for _ in range(1000):  # the handler runs at the loop's next check, inside this method
            pass

popen_init = subprocess.Popen.__init__
def init(self, args, *rest, **kwargs):
    popen_init(self, args, *rest, **kwargs)
    if "worker" in args:
        LandsHere()
subprocess.Popen.__init__ = init
sys.exit(main())
"""


class Starting:
    """`cde serve` with one worker, its socket directory under `tmp`, its output collected.
    `program`: run as `python -c program serve ...` instead of `python -m cde serve ...`."""

    def __init__(self, model_dir: Path, tmp: Path, *flags: str, program: str | None = None):
        how = ["-c", program] if program else ["-m", "cde"]
        cmd = [sys.executable, *how, "serve", "--model", str(model_dir), "--port", "0", "--device", "cpu"]
        cmd += flags
        env = {**os.environ, "OMP_NUM_THREADS": "1", "TMPDIR": str(tmp)}
        self.proc = subprocess.Popen(
            cmd, cwd=REPO, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True
        )
        self.tmp, self.lines = tmp, []
        self._reader = threading.Thread(target=lambda: self.lines.extend(self.proc.stdout), daemon=True)
        self._reader.start()

    def worker(self) -> int:
        def workers() -> list[int]:
            return [pid for pid in children(self.proc.pid) if runs_the_worker(pid)]

        return wait_for(workers, "the worker process")[0]

    def wait_for_line(self, text: str, timeout: float = 30) -> None:
        try:
            wait_for(lambda: any(text in line for line in self.lines), repr(text), timeout)
        except AssertionError:
            self._fail(f"cde serve printed no {text!r} in {timeout:g} s")

    def exit_code(self, timeout: float = 30) -> int:
        """Once it has exited; one still running is failed with every thread's stack."""
        try:
            return self.proc.wait(timeout)
        except subprocess.TimeoutExpired:
            self._fail(f"cde serve still ran {timeout:g} s after the signal")

    def _fail(self, what: str) -> NoReturn:
        kill_showing_stacks(self.proc)
        raise AssertionError(f"{what}:\n{self.output()}")

    def output(self) -> str:
        self._reader.join(30)  # until every writer (the workers too) has closed the pipe
        return "".join(self.lines)

    def last_line(self) -> str:
        """serve's own last line: a worker that notices its parent gone may write after it."""
        return [line for line in self.output().strip().splitlines() if not line.startswith("cde worker:")][-1]

    def assert_cleaned_up(self, worker: int) -> None:
        wait_for(lambda: not pid_alive(worker), "the worker to exit", 10)
        assert not list(self.tmp.glob("cde-*")), "the socket directory was left"


def test_sigterm_while_the_workers_start(tiny_dir, tmp_path):
    serve = Starting(tiny_dir, tmp_path)
    worker = serve.worker()
    serve.proc.send_signal(signal.SIGTERM)
    assert serve.exit_code() == 130, serve.output()
    assert serve.last_line() == INTERRUPTED
    serve.assert_cleaned_up(worker)


def test_a_sigterm_raised_where_python_drops_it_still_stops_the_start_up(tiny_dir, tmp_path):
    serve = Starting(tiny_dir, tmp_path, program=DROPPED_SIGTERM)
    worker = serve.worker()
    assert serve.exit_code() == 130, serve.output()
    out = serve.output()
    assert serve.last_line() == INTERRUPTED, out
    assert "CDE serving" not in out and "Exception ignored" not in out and "Traceback" not in out, out
    serve.assert_cleaned_up(worker)


# `cde serve` whose worker's child lingers between its fork and its exec, as a busy machine may
# leave it: a test that stopped it there (not yet the worker) stopped serve's Popen with it.
SLOW_EXEC = """
import subprocess, sys, time
from cde.cli import main

popen_init = subprocess.Popen.__init__
def init(self, args, *rest, **kwargs):
    if "worker" in args:
        kwargs["preexec_fn"] = lambda: time.sleep(2)
    popen_init(self, args, *rest, **kwargs)
subprocess.Popen.__init__ = init
sys.exit(main())
"""


@pytest.mark.parametrize("program", [None, SLOW_EXEC], ids=["serve", "slow-exec"])
def test_sigint_while_waiting_for_the_workers(tiny_dir, tmp_path, program):
    serve = Starting(tiny_dir, tmp_path, program=program)
    worker = serve.worker()
    os.kill(worker, signal.SIGSTOP)  # it never gets ready: the gateway waits for it
    try:
        serve.wait_for_line("Waiting for application startup")
        serve.proc.send_signal(signal.SIGINT)
        assert serve.exit_code() == 130, serve.output()
    finally:
        with contextlib.suppress(ProcessLookupError):  # not left stopped if the test fails
            os.kill(worker, signal.SIGCONT)
    out = serve.output()
    assert serve.last_line() == INTERRUPTED
    assert "CancelledError" not in out and "Traceback" not in out, out
    serve.assert_cleaned_up(worker)


def test_a_worker_dies_with_its_serve_while_it_loads(tiny_dir, tmp_path):
    serve = Starting(tiny_dir, tmp_path)
    worker = serve.worker()
    serve.proc.kill()  # no cleanup of ours runs: the kernel's parent-death signal ends the worker
    serve.proc.wait()
    wait_for(lambda: not pid_alive(worker), "the worker to exit", 10)
    assert "CDE worker ready" not in serve.output()  # stopped in its load, not after it


def test_a_second_signal_ends_the_drain_at_once(tiny_dir):
    srv = ServerProcess(tiny_dir, "--served-model-name", "tiny", workers=1)  # --shutdown-timeout 30 s
    try:
        with httpx.stream("POST", srv.base_url + "/completions", json=LONG, timeout=60) as r:
            events = (line[6:] for line in r.iter_lines() if line.startswith("data: "))
            next(events)
            srv.proc.send_signal(signal.SIGTERM)
            wait_for(lambda: srv.health()[0] == 503, "draining")
            t0 = time.monotonic()
            srv.proc.send_signal(signal.SIGINT)
            rest = list(events)
        assert srv.proc.wait(10) == 130 and time.monotonic() - t0 < 10
    finally:
        srv.stop()
    assert rest[-1] == "[DONE]" and "shut down" in json.loads(rest[-2])["error"]["message"], rest[-2:]
    out = wait_for(lambda: INTERRUPTED in "".join(srv.output) and "".join(srv.output), "the interrupted line", 10)
    assert "Traceback" not in out and "shutdown timeout" not in out, out


def test_serve_stops_when_every_worker_has_exited(tiny_dir, tmp_path):
    """It could only answer 503 from then on; stopped, its process manager restarts it."""
    serve = Starting(tiny_dir, tmp_path)
    worker = serve.worker()
    wait_for(lambda: any("CDE serving" in line for line in serve.lines), "the banner", 60)
    os.kill(worker, signal.SIGKILL)
    assert serve.proc.wait(30) == 1, serve.output()
    last = serve.last_line()
    assert last == "cde serve: stopped, as every worker exited (worker-0 exited with code -9)", last
    serve.assert_cleaned_up(worker)


def test_workers_gone_during_a_drain_end_it_as_asked(tiny_dir, tmp_path):
    """The stop was asked for: exit 0, neither an interrupt nor 'every worker exited'."""
    serve = Starting(tiny_dir, tmp_path, "--heartbeat-timeout", "60")
    worker = serve.worker()
    banner = wait_for(lambda: next((ln for ln in serve.lines if "CDE serving" in ln), None), "the banner", 60)
    url = banner.split(" at ")[1].split()[0].rstrip(",")  # http://127.0.0.1:PORT/v1
    os.kill(worker, signal.SIGSTOP)  # its request stays in flight
    body = {"prompt": "hi", "max_tokens": 8}
    pending = threading.Thread(target=lambda: httpx.post(url + "/completions", json=body, timeout=60), daemon=True)
    pending.start()
    time.sleep(0.5)
    serve.proc.send_signal(signal.SIGTERM)
    wait_for(lambda: httpx.get(url.removesuffix("/v1") + "/health").status_code == 503, "the drain")
    os.kill(worker, signal.SIGKILL)
    assert serve.proc.wait(30) == 0, serve.output()
    assert INTERRUPTED not in serve.output() and "every worker exited" not in serve.output()


# `cde worker` that never acts on SIGTERM, as one hung in a device call would not.
DEAF_WORKER = """
import sys
from cde.worker.zmq_server import WorkerServer
WorkerServer.request_stop = lambda self, *_: None
from cde.cli import main
sys.exit(main())
"""


def test_a_worker_still_running_after_its_stop_timeout_writes_its_stacks_then_is_killed(tiny_dir, caplog):
    """serve's stop of its workers is bounded (`_stop`, after the drain), and a worker that outlives
    the bound says where it hangs before the kill: its threads' stacks on the stderr it shares."""
    from cde.commands.serve import STACKS_S, _stop

    endpoint = f"tcp://127.0.0.1:{free_port()}"
    cmd = [sys.executable, "-c", DEAF_WORKER, "worker", "--model", str(tiny_dir), "--bind", endpoint, "--device", "cpu"]
    worker = subprocess.Popen(
        cmd,
        cwd=REPO,
        env={**os.environ, "OMP_NUM_THREADS": "1"},
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )
    lines: list[str] = []
    reader = threading.Thread(target=lambda: lines.extend(worker.stdout), daemon=True)  # type: ignore[arg-type]
    reader.start()
    wait_for(lambda: any("worker ready" in line for line in lines), "the worker", 120)
    t0 = time.monotonic()
    with caplog.at_level("WARNING", logger="cde.gateway"):
        _stop([worker], timeout=1.0)
    took = time.monotonic() - t0
    reader.join(10)
    out = "".join(lines)
    assert worker.returncode == -signal.SIGKILL, out
    assert 1.0 <= took < 1.0 + STACKS_S + 5, took
    assert f"worker pid {worker.pid} still running 1 s after SIGTERM" in caplog.text
    # faulthandler's dump of the engine thread, in the loop that never saw the stop
    assert "most recent call first" in out and "in serve_forever" in out, out
