"""How `cde bench serve` sends its requests: from this process, or split over several client
processes (`--client-processes`) so that a burst leaves the way a fleet of clients would send it.

One Python process with one httpx client spends a few milliseconds of CPU per request (building it,
h11, the event loop), so 32 requests "sent at once" leave it over 0.1 to 0.2 s (issue 19). With N
processes the requests are dealt out round-robin; each process has its own event loop, httpx client
and keep-alive connections, opened before the clock starts, and a barrier releases them together.
`time.perf_counter` is CLOCK_MONOTONIC on Linux, so the processes' times compare: the run lasts from
the first release to the last completion."""

from __future__ import annotations

import asyncio
import math
import multiprocessing
import queue
import random
import time
import traceback
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import httpx

from cde.commands.load_client import Outcome, send

BARRIER_TIMEOUT_S = 120.0  # for every process to start and open its connections


@dataclass
class Share:
    """One client process's part of the load."""

    bodies: list[dict]
    rate: float  # requests per second, Poisson (inf: all at once)
    max_concurrency: int | None
    rng: random.Random  # arrival times


@dataclass
class Run:
    outcomes: list[Outcome]
    released: float  # perf_counter when this client started sending
    ended: float  # perf_counter when its last request completed


def split(bodies: list[dict], rate: float, max_concurrency: int | None, rng: random.Random, n: int) -> list[Share]:
    """Deals `bodies` out round-robin over `n` processes. Each draws Poisson arrivals at rate/n (n
    independent Poisson streams add up to one at `rate`) and has its even part of `max_concurrency`."""
    if n == 1:
        return [Share(bodies, rate, max_concurrency, rng)]
    if n > len(bodies):
        raise SystemExit(f"--client-processes {n} is more than --num-prompts {len(bodies)}")
    if max_concurrency is not None and n > max_concurrency:
        raise SystemExit(f"--client-processes {n} is more than --max-concurrency {max_concurrency}")
    shares = []
    for i in range(n):
        limit = None if max_concurrency is None else max_concurrency // n + (i < max_concurrency % n)
        shares.append(Share(bodies[i::n], rate / n, limit, random.Random(rng.getrandbits(64))))
    return shares


async def open_connections(client: httpx.AsyncClient, url: str, headers: dict, n: int) -> None:
    """Leaves `n` keep-alive connections in `client`'s pool: `n` GETs of `url`, each holding its
    connection until all are open, then read to the end (which returns the connection to the pool)."""
    opened, all_open = [0], asyncio.Event()

    async def hold() -> None:
        async with client.stream("GET", url, headers=headers) as r:
            opened[0] += 1
            if opened[0] == n:
                all_open.set()
            await all_open.wait()
            await r.aread()
            if r.status_code != 200:
                raise SystemExit(f"{url} answered {r.status_code}: {r.text[:200]}")

    try:
        await asyncio.gather(*(hold() for _ in range(n)))
    except httpx.HTTPError as exc:
        raise SystemExit(f"cannot reach {url}: {exc!r}") from None


async def client_run(base: str, share: Share, headers: dict, timeout: float, ready: Callable[[], None]) -> Run:
    """Opens the connections the share needs at once, calls `ready` (the barrier: it returns when
    every client is ready), then sends the share's bodies to base/completions."""
    n = len(share.bodies)
    conns = max(1, min(n, share.max_concurrency or n))
    limits = httpx.Limits(max_connections=None, max_keepalive_connections=conns)
    async with httpx.AsyncClient(timeout=timeout, limits=limits) as client:
        ready()  # every process is up before any opens its connections (the server keeps idle ones 5 s)
        await open_connections(client, base + "/models", headers, conns)
        ready()
        limit = asyncio.Semaphore(conns)
        url = base + "/completions"

        async def one(body: dict) -> Outcome:
            async with limit:
                return await send(client, url, body, headers=headers)

        released = time.perf_counter()
        tasks = []
        for body in share.bodies:
            tasks.append(asyncio.create_task(one(body)))
            if share.rate != math.inf:
                await asyncio.sleep(share.rng.expovariate(share.rate))
        outcomes = await asyncio.gather(*tasks)
        return Run(list(outcomes), released, time.perf_counter())


def _child(i: int, base: str, share: Share, headers: dict, timeout: float, barrier: Any, results: Any) -> None:
    try:
        run = asyncio.run(client_run(base, share, headers, timeout, lambda: barrier.wait(BARRIER_TIMEOUT_S)))
        results.put((i, run))
    except BaseException as exc:  # reported to the parent, whatever it was
        barrier.abort()  # the others stop waiting
        why = str(exc) if isinstance(exc, SystemExit) else f"{exc!r}\n{traceback.format_exc()}"
        results.put((i, f"client process {i}: {why}"))


def run_processes(base: str, shares: list[Share], headers: dict, timeout: float) -> list[Run]:
    """Runs each share in its own process ('spawn': a fresh interpreter, no inherited event loop or
    sockets); returns their runs in the shares' order."""
    ctx = multiprocessing.get_context("spawn")
    barrier, results = ctx.Barrier(len(shares)), ctx.Queue()
    procs = [
        ctx.Process(target=_child, args=(i, base, s, headers, timeout, barrier, results), daemon=True)
        for i, s in enumerate(shares)
    ]
    for p in procs:
        p.start()
    runs: dict[int, Run] = {}
    errors: dict[int, str] = {}
    silent: set[int] = set()  # exited without a report at the last look
    try:
        while len(runs) + len(errors) < len(procs):
            try:
                i, got = results.get(timeout=1.0)
            except queue.Empty:
                # Each process reports before it exits; one that has exited, and still has not
                # reported a second later, never will (killed, or its result could not be sent).
                gone = {i for i, p in enumerate(procs) if p.exitcode is not None and i not in runs and i not in errors}
                if gone & silent:
                    i = min(gone & silent)
                    errors[i] = f"client process {i} exited ({procs[i].exitcode}) without its results"
                    barrier.abort()
                    break
                silent = gone
                continue
            if isinstance(got, str):
                errors[i] = got
            else:
                runs[i] = got
    finally:
        for p in procs:
            p.join(5)
            if p.is_alive():
                p.kill()
                p.join()
    if errors:
        raise SystemExit(min(errors.values(), key=lambda e: "BrokenBarrierError" in e))  # the cause, not an abort
    return [runs[i] for i in range(len(shares))]


def send_all(base: str, shares: list[Share], headers: dict, timeout: float) -> tuple[list[Outcome], float]:
    """Every share's outcomes in the order of the bodies before `split`, and the run's duration
    from the first release to the last completion."""
    if len(shares) == 1:
        runs = [asyncio.run(client_run(base, shares[0], headers, timeout, lambda: None))]
    else:
        runs = run_processes(base, shares, headers, timeout)
    n = len(runs)
    outcomes = [runs[j % n].outcomes[j // n] for j in range(sum(len(r.outcomes) for r in runs))]
    return outcomes, max(r.ended for r in runs) - min(r.released for r in runs)
