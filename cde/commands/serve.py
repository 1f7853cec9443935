"""Serve a model over the OpenAI API: the HTTP gateway plus one worker process per GPU."""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import logging
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Awaitable, Callable
from pathlib import Path

from cde.cli_types import positive_int, positive_seconds
from cde.commands.api_key_args import api_key, auth_headers
from cde.commands.gateway import add_http_arguments, build_state, check_port
from cde.commands.model_args import add_model_arguments, resolve_model_args
from cde.commands.settings_builder import engine_args
from cde.commands.worker import (
    DEVICE_HELP,
    DEVICES,
    DTYPE_HELP,
    DTYPES,
    add_async_scheduling_arguments,
    add_attention_arguments,
    add_fair_share_arguments,
    add_prefix_cache_arguments,
    add_quantization_arguments,
    add_thread_arguments,
)
from cde.gateway.interrupts import Interrupts
from cde.shared.config import PAGE
from cde.shared.logs import setup_logging
from cde.shared.settings import WorkerSettings

log = logging.getLogger("cde.gateway")


def add_arguments(p: argparse.ArgumentParser) -> None:
    add_model_arguments(p)
    p.add_argument("--workers", type=positive_int, help="worker processes (default: one per GPU, or 1 on CPU)")
    p.add_argument("--device", default="auto", choices=DEVICES, help=DEVICE_HELP)
    p.add_argument("--dtype", default="auto", choices=DTYPES, help=DTYPE_HELP)
    p.add_argument("--max-running", type=positive_int, default=16, help="requests each worker decodes concurrently")
    add_fair_share_arguments(p)
    p.add_argument(
        "--startup-timeout", type=positive_seconds, default=600.0, help="seconds to wait for the workers to load"
    )
    add_thread_arguments(p)
    add_attention_arguments(p)
    add_quantization_arguments(p)
    add_prefix_cache_arguments(p)
    add_async_scheduling_arguments(p)
    add_http_arguments(p)
    p.add_argument(
        "--warm-up",
        default="auto",
        choices=["auto", "on", "off"],
        help="send two requests through the HTTP path before saying ready (auto: when serving on GPUs)",
    )


def _gpus(device: str) -> list[str]:
    if device == "cpu":
        return []
    # Asked even when CUDA_VISIBLE_DEVICES names GPUs: a CPU build of torch (or no driver) cannot
    # use them, and a worker told to would fail its load on torch's AssertionError. Asked in a
    # child process: the gateway itself never touches torch.
    res = subprocess.run([sys.executable, "-m", "cde.worker.devices", device], capture_output=True, text=True)
    if res.returncode == 2:  # the reason this device cannot be used, one line
        raise SystemExit(f"cde serve: {res.stderr.strip()}")
    if res.returncode != 0:
        raise SystemExit(f"cde serve: torch could not be imported to look for GPUs: {res.stderr.strip()[-300:]}")
    return res.stdout.split()


def _spawn(settings: WorkerSettings, n: int, gpus: list[str], sockdir: str, procs: list[subprocess.Popen]) -> list[str]:
    """n workers, each given `settings` (its own endpoint) as one message; each is in `procs` as
    soon as it starts (an interrupt may come between two). From the main thread: a worker's
    PR_SET_PDEATHSIG (`cde.commands.worker.die_with_parent`) fires when the thread that started it
    ends, which must be this process's end."""
    endpoints = []
    for i in range(n):
        endpoint = f"ipc://{sockdir}/worker-{i}"
        env = dict(os.environ)
        env.pop("CDE_API_KEY", None)  # a worker needs no gateway secret
        if gpus:
            env["CUDA_VISIBLE_DEVICES"] = gpus[i % len(gpus)]
        message = dataclasses.replace(settings, bind=endpoint).to_json()
        cmd = [sys.executable, "-m", "cde", "worker", "--settings-json", message]
        # Own process group: a terminal Ctrl-C reaches only us, and we stop the workers after
        # the gateway has drained its requests.
        procs.append(subprocess.Popen(cmd, env=env, process_group=0))
        endpoints.append(endpoint)
    return endpoints


WORKER_STOP_S = 10.0  # from SIGTERM to SIGKILL: a worker's stop is its current pass and its socket's 1 s linger
STACKS_S = 2.0  # for a worker that outlived it to write its threads' stacks before the kill


def _stop(procs: list[subprocess.Popen], timeout: float = WORKER_STOP_S) -> None:
    for p in procs:
        if p.poll() is None:
            p.terminate()
            p.send_signal(signal.SIGCONT)  # a stopped worker would never act on the SIGTERM
    deadline = time.monotonic() + timeout
    for p in procs:
        try:
            p.wait(max(deadline - time.monotonic(), 0.1))
        except subprocess.TimeoutExpired:
            # Where it hangs is the one clue to why (a device call that never returns, a lock): its
            # threads' stacks go to the stderr it shares with us, then the kill.
            log.warning(
                "worker pid %d still running %g s after SIGTERM: its threads' stacks follow, then SIGKILL",
                p.pid,
                timeout,
            )
            kill_showing_stacks(p)


def kill_showing_stacks(p: subprocess.Popen) -> int:
    """SIGUSR1 (every thread's stack to the process's stderr, cde/cli.py), STACKS_S to write
    them, then SIGKILL: the exit status."""
    p.send_signal(signal.SIGUSR1)
    with contextlib.suppress(subprocess.TimeoutExpired):
        return p.wait(STACKS_S)  # SIGUSR1 before cde/cli.py registers it ends the process
    p.kill()
    return p.wait()


def warm_up(api_key: str | None, max_tokens: int, tokens_per_step: int) -> Callable[[str], Awaitable[None]]:
    """Requests sent through the bound port before the server says it is ready: a streamed greedy
    one with attribution, then a plain sampled one. The first client then finds the HTTP path, the
    tokenizer, the attribution render, JSON and both selection paths already run once (the first
    request after startup measured 0.875 s on an H200 where the rest had 0.403 s). A failure is
    logged, never fatal."""

    async def run(url: str) -> None:
        import httpx

        headers = auth_headers(api_key)
        t0 = time.monotonic()
        try:
            async with httpx.AsyncClient(base_url=url, headers=headers, timeout=120) as client:
                model = (await client.get("/v1/models")).json()["data"][0]["id"]
                body = {"model": model, "prompt": "Hello", "max_tokens": max_tokens, "tokens_per_step": tokens_per_step}
                # Greedy with attribution, then sampled without: both selection paths run once.
                streamed = {**body, "stream": True, "attribution": {"per_token": True}, "temperature": 0}
                async with client.stream("POST", "/v1/completions", json=streamed) as r:
                    async for _ in r.aiter_bytes():
                        pass
                (await client.post("/v1/completions", json=body)).raise_for_status()
        except (httpx.HTTPError, KeyError, IndexError, ValueError) as exc:
            log.warning("warm-up request failed: %s", exc)
            return
        log.info("warm-up requests done", extra={"seconds": round(time.monotonic() - t0, 3)})

    return run


class _ReadyBanner:
    """The startup line: `serve_http` formats it once the workers are ready and the port is
    bound, so the time to ready it reports is the one a client sees."""

    def __init__(self, text: str, t0: float):
        self.text, self.t0 = text, t0

    def format(self, url: str) -> str:
        return self.text.format(url=url) + f" (ready in {time.monotonic() - self.t0:.1f} s)"


def _warm_up(args: argparse.Namespace, gpus: list[str]) -> Callable[[str], Awaitable[None]] | None:
    if args.warm_up == "off" or (args.warm_up == "auto" and not gpus):
        return None
    # On a GPU one whole block as a client sends it (~0.4 s at 8B); on a CPU one step of 16 tokens.
    key = api_key(args)
    return warm_up(key, PAGE, 1) if gpus else warm_up(key, 16, 16)


def run(args: argparse.Namespace) -> int:
    # SIGTERM as Ctrl-C: either one during the start-up, or one that cuts the drain short, ends
    # here after the cleanup (`cde serve: interrupted`).
    interrupts = Interrupts()
    code = _serve(args, interrupts)
    interrupts.raise_if_received()  # one that came while the workers stopped
    return code


def _serve(args: argparse.Namespace, interrupts: Interrupts) -> int:
    from cde.cli import STARTED
    from cde.gateway.app import create_app
    from cde.gateway.http_limits import from_args as limits_from_args
    from cde.gateway.http_server import serve_http

    setup_logging("gateway", args.log_level)
    engine = engine_args(args)  # bad flags fail here, before any model work, not in every worker
    # Resolved once here (one download, one progress bar); the workers get the local directory.
    hub_id = resolve_model_args(args, "serve")
    check_port(args.host, args.port, "serve")
    args.served_model_name = args.served_model_name or hub_id
    # The name clients send, as the workers report it (a directory is served under its own name).
    name = args.served_model_name or Path(args.model).resolve().name
    gpus = _gpus(args.device)
    n = args.workers or max(len(gpus), 1)
    settings = WorkerSettings(
        engine=dataclasses.replace(engine, model=args.model, device="cuda" if gpus else "cpu"),
        bind="",  # each worker's own, set by _spawn
        served_model_name=args.served_model_name,
        parent_pid=os.getpid(),
        host_workers=n,  # CPU workers share the cores: each sets its threads from them (worker.cpu_threads)
        threads=args.threads,
        concept_labels=args.concept_labels,  # the catalog other gateways fetch from these workers too
    )
    interrupts.defer()  # from here on, there are workers to stop
    sockdir = tempfile.mkdtemp(prefix="cde-")
    procs: list[subprocess.Popen] = []
    try:
        endpoints = _spawn(settings, n, gpus, sockdir, procs)
        state = build_state(args, endpoints, procs, model_dir=args.model, model_root=hub_id)
        app = create_app(
            state,
            wait_for_workers=args.startup_timeout,
            max_request_bytes=args.max_request_bytes,
            limits=limits_from_args(args),
        )
        where = f"{n} worker{'s' if n > 1 else ''} on {'GPU ' + ','.join(gpus) if gpus else 'CPU'}"
        banner = _ReadyBanner(f"CDE serving {name} ({where}) at {{url}}/v1, playground {{url}}/", STARTED)
        code = serve_http(
            app,
            args.host,
            args.port,
            banner=banner,  # type: ignore[arg-type]  # a str-like with .format(), formatted when ready
            shutdown_timeout=args.shutdown_timeout,
            log_level=args.log_level,
            warm_up=_warm_up(args, gpus),
            interrupts=interrupts,
        )
        if state.router.workers_gone:
            raise SystemExit(f"cde serve: stopped, as every worker exited ({state.router.workers_gone})")
        return code
    finally:
        try:
            _stop(procs)
        finally:  # a signal cut the stop short: the workers still end with us (PR_SET_PDEATHSIG)
            shutil.rmtree(sockdir, ignore_errors=True)
