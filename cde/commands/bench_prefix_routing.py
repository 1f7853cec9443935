"""Prefix routing benchmark: the prefix cache's hit rate and the load balance over workers, with
the gateway's router routing by prompt prefix and by another policy (round robin), in one run.

Starts `--workers` real `cde worker` processes (CPU), then for each policy a real Router (the
gateway's, over ZeroMQ) sends `--requests` requests whose prompts are one of `--prefixes` system
prompts of `--prefix-tokens` tokens plus a distinct tail, in a seeded random order, at most
`--concurrency` in flight. Each policy gets system prompts of its own, so nothing the first cached
helps the second. Hit rate: cached prompt tokens (usage.prompt_tokens_details.cached_tokens) over
the tokens of full prompt pages (what a prefix cache can hold); with P prefixes of R requests each
the first of each prefix on a worker is a miss, so 1 - 1/R is the best a router can do."""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import subprocess
import sys
import tempfile
import time
from collections import Counter

from cde.commands.model_args import add_model_arguments, resolve_model_args
from cde.shared.config import PAGE

POLICIES = ("round-robin", "least-loaded", "prefix")


def add_arguments(p: argparse.ArgumentParser) -> None:
    src = p.add_mutually_exclusive_group()
    add_model_arguments(p, into=src)
    src.add_argument(
        "--preset",
        default="tiny",
        help="write a random-weight checkpoint of this preset first (default: %(default)s, unless --model)",
    )
    options = [
        ("--workers", 2, "worker processes"),
        ("--max-running", 16, "requests each worker decodes concurrently"),
        ("--prefixes", 8, "distinct system prompts"),
        ("--prefix-tokens", 1024, "tokens of each system prompt"),
        ("--tail-tokens", 16, "distinct tokens after the system prompt"),
        ("--requests", 64, "requests per policy"),
        ("--concurrency", 16, "requests in flight at most"),
        ("--max-tokens", 4, "tokens each request generates"),
    ]
    for flag, default, text in options:
        p.add_argument(flag, type=int, default=default, help=text + " (default: %(default)s)")
    p.add_argument(
        "--policies",
        default="round-robin,prefix",
        help=f"comma-separated, of {', '.join(POLICIES)} (default: %(default)s)",
    )
    p.add_argument("--json", help="write the results as JSON here (default: only the table)")


def prompts(args: argparse.Namespace, seed: int) -> list[list[int]]:
    """One prompt per request: a system prompt (each as often, in a seeded random order: in strict
    turns, round robin over an even number of workers would keep every prefix on one worker),
    then a distinct tail."""
    rng = random.Random(seed)
    systems = [[rng.randrange(1000, 100000) for _ in range(args.prefix_tokens)] for _ in range(args.prefixes)]
    order = [i % args.prefixes for i in range(args.requests)]
    rng.shuffle(order)
    return [systems[p] + [rng.randrange(1000, 100000) for _ in range(args.tail_tokens)] for p in order]


async def run_policy(endpoints: list[str], policy: str, reqs: list[list[int]], args: argparse.Namespace) -> dict:
    from cde.gateway.router import Router
    from cde.shared.protocol import BlockResult, GenerateRequest
    from cde.shared.wire import encode

    router = Router(endpoints, routing=policy, fetch_catalogs=False)
    await router.start()
    try:
        await router.wait_ready(600)
        slots = asyncio.Semaphore(args.concurrency)
        served: list[str] = []
        cached: list[int] = []

        async def one(i: int, prompt: list[int]) -> None:
            async with slots:
                req = GenerateRequest(f"{policy}-{i}", prompt, max_tokens=args.max_tokens, tokens_per_step=4)
                handle = router.submit(req, encode(req))
                served.append(handle.link.name)
                last = [r async for r in handle.results()][-1]
                if not isinstance(last, BlockResult) or last.finish_reason not in ("length", "stop"):
                    raise RuntimeError(f"request {i} ended with {last}")
                cached.append(last.cached_tokens)

        t0 = time.perf_counter()
        await asyncio.gather(*(one(i, p) for i, p in enumerate(reqs)))
        seconds = time.perf_counter() - t0
    finally:
        await router.stop()
    per_worker = Counter(served)
    counts = [per_worker.get(f"worker-{i}", 0) for i in range(len(endpoints))]
    full = sum(len(p) // PAGE * PAGE for p in reqs)
    return {
        "policy": policy,
        "requests": len(reqs),
        "hit_rate": sum(cached) / full,
        "requests_per_worker": counts,
        "max_min_ratio": max(counts) / min(counts) if min(counts) else float("inf"),
        "seconds": seconds,
    }


def bench(args: argparse.Namespace, model_dir: str) -> list[dict]:
    with tempfile.TemporaryDirectory(prefix="cde-routing-") as sockdir:
        endpoints = [f"ipc://{sockdir}/worker-{i}" for i in range(args.workers)]
        workers = [
            subprocess.Popen(
                [sys.executable, "-m", "cde", "worker", "--model", model_dir, "--bind", ep, "--device", "cpu"]
                + ["--max-running", str(args.max_running), "--host-workers", str(args.workers)],
                stdout=subprocess.DEVNULL,
                env={**os.environ, "CDE_LOG_LEVEL": "WARNING"},  # not a line per request
            )
            for ep in endpoints
        ]
        try:
            return [
                asyncio.run(run_policy(endpoints, policy, prompts(args, seed=n), args))
                for n, policy in enumerate(args.policies.split(","))
            ]
        finally:
            for w in workers:
                w.terminate()
            for w in workers:
                w.wait(30)


def run(args: argparse.Namespace) -> int:
    unknown = set(args.policies.split(",")) - set(POLICIES)
    if unknown:
        raise SystemExit(f"cde bench prefix-routing: unknown policy {', '.join(sorted(unknown))}")
    with tempfile.TemporaryDirectory(prefix="cde-routing-model-") as tmp:
        if args.model is None:
            from cde.worker.checkpoint import make_model

            context = -(-(args.prefix_tokens + args.tail_tokens + args.max_tokens) // PAGE) * PAGE
            # the preset with a context that holds the prompts (tiny's is 1,024)
            model_dir = str(make_model(args.preset, tmp, seed=0, overrides={"block_size": max(context, 1024)}))
        else:
            resolve_model_args(args, "bench prefix-routing")
            model_dir = args.model
        results = bench(args, model_dir)
    print("policy | requests | hit rate | requests per worker | max/min | s")
    for r in results:
        print(
            f"{r['policy']} | {r['requests']} | {r['hit_rate']:.1%} | {r['requests_per_worker']} | "
            f"{r['max_min_ratio']:.2f} | {r['seconds']:.1f}"
        )
    if args.json:
        with open(args.json, "w") as f:
            json.dump(results, f, indent=2)
    return 0
