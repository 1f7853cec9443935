"""Soak a running server with mixed requests for a while, then check that it is still healthy.

Requests (streaming and not, n=2, steering, attribution, stop strings, chat) are drawn from a
pool whose members were each run alone first; some streams are hung up mid-way and some
non-streaming requests get a short client deadline. Checks afterwards (exit code 1 if any fails):
every request completed with exactly its run-alone output or got an explicit error; no server
errors; running, waiting and KV pages back to 0 on every worker; gateway and worker resident
memory (from /metrics, read from /proc by each process) flat from start to end."""

from __future__ import annotations

import argparse
import asyncio
import random
import time

import httpx

from cde.commands.api_key_args import add_api_key_arguments, api_key, auth_headers
from cde.commands.bench_serve import api_base, first_model
from cde.commands.load_client import metric_samples, send, write_json
from cde.commands.soak_mix import build_pool, invalid_spec, is_server_error, stop_spec, verify

IDLE_GAUGES = (
    "cde_worker_running_requests",
    "cde_worker_waiting_requests",
    "cde_worker_kv_pages_used",
    "cde_gateway_outstanding_requests",
)


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--url", default="http://127.0.0.1:8000", help="server base URL (with or without /v1)")
    p.add_argument("--model", help="model name (default: the first of /v1/models)")
    p.add_argument("--duration", type=float, default=300.0, help="seconds of load (after the reference runs)")
    p.add_argument(
        "--num-requests",
        type=int,
        help="stop after this many requests instead (whichever comes first; default: no count, only --duration)",
    )
    p.add_argument("--concurrency", type=int, default=8, help="requests in flight")
    p.add_argument("--pool-size", type=int, default=24, help="distinct requests (each also gets a stop-string twin)")
    p.add_argument(
        "--max-tokens",
        type=int,
        default=150,
        help="the longest request (two or three blocks: hang-ups land mid-stream)",
    )
    p.add_argument("--hang-up", type=float, default=0.15, help="share of streams the client closes mid-way")
    p.add_argument("--deadline", type=float, default=0.15, help="share of other requests with a short client deadline")
    p.add_argument("--rss-slack-mb", type=float, default=64.0, help="resident memory growth allowed per process")
    p.add_argument("--allow-server-errors", action="store_true", help="for soaks with injected faults")
    add_api_key_arguments(p, "send `Authorization: Bearer KEY`")
    p.add_argument("--seed", type=int, default=0, help="the mix of requests and their prompts")
    p.add_argument("--json", metavar="OUT", help="also write the results as JSON here (default: only the report)")


async def read_metrics(client: httpx.AsyncClient, url: str) -> dict[str, float]:
    return metric_samples((await client.get(url + "/metrics")).text)


def resident_mb(m: dict[str, float]) -> dict[str, float]:
    rss = {"gateway": m.get("process_resident_memory_bytes", 0.0) / 2**20}
    for key, value in m.items():
        if key.startswith("cde_worker_resident_memory_bytes{"):
            rss[key.split('"')[1]] = value / 2**20
    return rss


async def wait_idle(client: httpx.AsyncClient, url: str, timeout: float) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        m = await read_metrics(client, url)
        if not any(m.get(g) for g in IDLE_GAUGES):
            return
        await asyncio.sleep(0.25)


async def soak(args: argparse.Namespace) -> dict:
    base, headers = api_base(args.url), auth_headers(api_key(args))
    root = base[: -len("/v1")]
    rng = random.Random(args.seed)
    problems: list[str] = []
    async with httpx.AsyncClient(
        timeout=600, headers=headers, limits=httpx.Limits(max_keepalive_connections=args.concurrency)
    ) as client:
        model = args.model or await first_model(client, base, {})
        probe = await send(
            client,
            base + "/chat/completions",
            {"model": model, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 1},
        )
        pool = build_pool(rng, model, args.pool_size, chat=probe.status == "ok", max_tokens=args.max_tokens)

        # Reference outputs: every spec alone on an idle server.
        refs = [await send(client, base + s.path, s.body) for s in pool]
        for spec, ref in list(zip(pool, refs)):
            twin = stop_spec(spec, ref) if spec.kind == "greedy" else None
            if twin is not None:
                pool.append(twin)
                refs.append(await send(client, base + twin.path, twin.body))
                if refs[-1].finish.get(0) != "stop":
                    problems.append(f"stop string {twin.body['stop']} did not stop its own text: {refs[-1].finish}")
        problems += [
            f"reference run of a {s.kind} request failed: {r.kind} {r.message}"
            for s, r in zip(pool, refs)
            if r.status != "ok"
        ]
        invalid = invalid_spec(model)

        # Warm-up: the pool at full concurrency on every worker (the router spreads a round over
        # them), so the resident-memory baseline is taken after each has run batches as large as
        # the soak's (first-time allocations of bigger batches are not growth: one batch's
        # logits alone can pass the slack), and after a fresh heartbeat has reported it.
        m = await read_metrics(client, root)
        width = args.concurrency * max(1, sum(1 for k in m if k.startswith("cde_worker_up{")))
        warm = [pool[i % len(pool)] for i in range(max(len(pool), width))]
        for at in range(0, len(warm), width):
            await asyncio.gather(*(send(client, base + s.path, s.body) for s in warm[at : at + width]))
        await asyncio.sleep(1.0)
        start = await read_metrics(client, root)
        peak = resident_mb(start)
        records: list = []
        end_at, t0 = time.monotonic() + args.duration, time.perf_counter()

        async def runner() -> None:
            while time.monotonic() < end_at and (args.num_requests is None or len(records) < args.num_requests):
                i = rng.randrange(len(pool) + 1)
                spec, ref = (pool[i], refs[i]) if i < len(pool) else (invalid, None)
                hang_up = deadline = None
                if spec.body.get("stream") and rng.random() < args.hang_up:
                    hang_up = rng.randint(1, 2)
                elif rng.random() < args.deadline:
                    deadline = rng.uniform(0.05, 1.0)
                records.append(None)  # claims its slot before the request, so --num-requests holds
                slot = len(records) - 1
                out = await send(client, base + spec.path, spec.body, hang_up_after=hang_up, deadline=deadline)
                records[slot] = (spec, ref, out, deadline)

        async def sample_memory() -> None:
            while True:
                await asyncio.sleep(2.0)
                for proc, mb in resident_mb(await read_metrics(client, root)).items():
                    peak[proc] = max(peak.get(proc, 0.0), mb)

        sampler = asyncio.create_task(sample_memory())
        await asyncio.gather(*(runner() for _ in range(args.concurrency)))
        sampler.cancel()
        duration = time.perf_counter() - t0
        await wait_idle(client, root, 30.0)
        await asyncio.sleep(1.0)  # a worker hands its batches' memory back once idle; a fresh heartbeat reports it
        end = await read_metrics(client, root)
    return judge(args, records, problems, start, end, peak, duration)


def judge(
    args: argparse.Namespace,
    records: list,
    problems: list,
    start: dict[str, float],
    end: dict[str, float],
    peak: dict[str, float],
    duration: float,
) -> dict:
    outcomes: dict[str, int] = {}
    by_kind: dict[str, int] = {}
    errors: dict[str, int] = {}
    for spec, ref, out, deadline in records:
        outcomes[out.status] = outcomes.get(out.status, 0) + 1
        by_kind[spec.kind] = by_kind.get(spec.kind, 0) + 1
        if out.status == "error":
            errors[out.kind] = errors.get(out.kind, 0) + 1
        wrong = verify(spec, ref, out, deadline)
        if wrong:
            problems.append(f"{spec.kind} request {spec.body}: {wrong}")
        elif is_server_error(out) and not args.allow_server_errors:
            problems.append(f"server error on a {spec.kind} request: {out.kind} {out.message}")
    busy = {g: end.get(g, 0.0) for g in IDLE_GAUGES if end.get(g)}
    if busy:
        problems.append(f"not idle 30 s after the load: {busy}")
    workers_up, workers = end.get("cde_worker_up", 0), len([k for k in end if k.startswith("cde_worker_up{")])
    if workers_up != workers:
        problems.append(f"only {workers_up:g} of {workers} workers up at the end")
    rss_start, rss_end = resident_mb(start), resident_mb(end)
    for proc, mb in rss_start.items():
        if rss_end.get(proc, 0.0) - mb > args.rss_slack_mb:
            problems.append(f"{proc} resident memory grew {mb:.0f} -> {rss_end[proc]:.0f} MB")
    return {
        "requests": len(records),
        "duration_s": round(duration, 1),
        "outcomes": outcomes,
        "kinds": by_kind,
        "explicit_errors": errors,
        "rss_mb": {
            p: {"start": round(mb, 1), "peak": round(peak.get(p, mb), 1), "end": round(rss_end.get(p, 0.0), 1)}
            for p, mb in rss_start.items()
        },
        "idle_at_end": {g: end.get(g, 0.0) for g in IDLE_GAUGES},
        "problems": problems,
        "passed": not problems,
    }


def print_report(r: dict) -> None:
    print(f"soak: {r['requests']} requests in {r['duration_s']} s")
    print("  kinds:    " + ", ".join(f"{k} {v}" for k, v in sorted(r["kinds"].items())))
    print("  outcomes: " + ", ".join(f"{k} {v}" for k, v in sorted(r["outcomes"].items())))
    if r["explicit_errors"]:
        print("  explicit errors: " + ", ".join(f"{k} {v}" for k, v in sorted(r["explicit_errors"].items())))
    print("  idle after: " + ", ".join(f"{k.removeprefix('cde_')} {v:g}" for k, v in r["idle_at_end"].items()))
    for proc, mb in r["rss_mb"].items():
        print(f"  RSS {proc:<9} start {mb['start']:8.1f} MB  peak {mb['peak']:8.1f} MB  end {mb['end']:8.1f} MB")
    for p in r["problems"]:
        print("  FAIL " + p)
    print("PASS" if r["passed"] else f"FAIL ({len(r['problems'])} problems)")


def run(args: argparse.Namespace) -> int:
    report = asyncio.run(soak(args))
    print_report(report)
    write_json(report, args.json)
    return 0 if report["passed"] else 1
