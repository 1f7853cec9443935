"""Prefix cache benchmark (offline engine): the same workloads with the prefix cache off, then on,
in one engine and one run (issue 30's H200 figures; docs/benchmarks.md).

1. shared prefix: `--concurrency` requests arrive together, one `--prefix-tokens` prefix each
   followed by a distinct `--tail-tokens` tail, `--max-tokens` new tokens: time to the first
   denoising step and to the first block (mean over the requests), and total throughput.
2. second turn: a first request of `--history-tokens` - 64 prompt tokens generates 64, then a second
   resends its prompt and answer plus a 64-token user message (the history, `--history-tokens`
   long): the second turn's time to its first step and first block.

Each workload gets random tokens of its own per phase, so the cache-on phase starts cold: what it
shares, it wrote itself."""

from __future__ import annotations

import argparse
import json
import random
import tempfile
import time
from dataclasses import dataclass

from cde.commands.model_args import add_model_arguments, resolve_model_args
from cde.commands.worker import DEVICE_HELP, DEVICES, DTYPE_HELP, DTYPES
from cde.shared.config import PAGE
from cde.shared.protocol import BlockResult, GenerateRequest, StepResult
from cde.shared.settings import EngineArgs
from cde.worker.engine import Engine


def add_arguments(p: argparse.ArgumentParser) -> None:
    src = p.add_mutually_exclusive_group()
    add_model_arguments(p, into=src)
    src.add_argument(
        "--preset", help="write a random-weight checkpoint of this preset first (e.g. 8b; default: --model's)"
    )
    options = [
        ("--concurrency", 32, "requests sharing the prefix"),
        ("--prefix-tokens", 3840, "tokens of the shared prefix"),
        ("--tail-tokens", 64, "distinct tokens after it"),
        ("--max-tokens", 256, "tokens each shared-prefix request generates"),
        ("--history-tokens", 3008, "tokens the second turn resends (prompt and answer of the first, and a message)"),
    ]
    for flag, default, text in options:
        p.add_argument(flag, type=int, default=default, help=text + " (default: %(default)s)")
    p.add_argument("--device", default="auto", choices=DEVICES, help=DEVICE_HELP)
    p.add_argument("--dtype", default="auto", choices=DTYPES, help=DTYPE_HELP)
    p.add_argument("--json", help="write the results as JSON here (default: only the table)")


def tokens(rng: random.Random, n: int) -> list[int]:
    return [rng.randrange(1000, 100000) for _ in range(n)]


@dataclass
class Timing:
    first_step_s: float = 0.0  # from the requests' arrival
    first_block_s: float = 0.0
    tokens: int = 0
    cached: int = 0


def timed(engine: Engine, reqs: list[GenerateRequest]) -> tuple[dict[str, Timing], float]:
    """Run `reqs` (arriving together) to the end: per request its Timing, and the wall time."""
    t0 = time.perf_counter()
    for r in reqs:
        engine.add_request(r)
    out = {r.request_id: Timing() for r in reqs}
    while engine.has_work():
        for res in engine.step():
            o, now = out[res.request_id], time.perf_counter() - t0
            if isinstance(res, StepResult) and not o.first_step_s:
                o.first_step_s = now
            if isinstance(res, BlockResult):
                o.first_block_s = o.first_block_s or now
                o.tokens += len(res.token_ids)
                o.cached = res.cached_tokens
    return out, time.perf_counter() - t0


def shared_prefix(engine: Engine, args: argparse.Namespace, rng: random.Random, tag: str) -> dict:
    prefix = tokens(rng, args.prefix_tokens)
    reqs = [
        GenerateRequest(f"{tag}-{i}", prefix + tokens(rng, args.tail_tokens), args.max_tokens, stream_denoise=True)
        for i in range(args.concurrency)
    ]
    out, wall = timed(engine, reqs)
    n = len(out)
    return {
        "workload": "shared prefix",
        "first_step_s": sum(o.first_step_s for o in out.values()) / n,
        "first_block_s": sum(o.first_block_s for o in out.values()) / n,
        "tok_per_s": sum(o.tokens for o in out.values()) / wall,
        "cached_tokens": sum(o.cached for o in out.values()),
    }


def second_turn(engine: Engine, args: argparse.Namespace, rng: random.Random, tag: str) -> dict:
    first = GenerateRequest(f"{tag}-turn1", tokens(rng, args.history_tokens - 2 * PAGE), PAGE, ignore_eos=True)
    answer = engine.generate([first])[first.request_id]
    history = first.prompt_ids + answer + tokens(rng, args.history_tokens - len(first.prompt_ids) - len(answer))
    out, _ = timed(engine, [GenerateRequest(f"{tag}-turn2", history, PAGE, stream_denoise=True)])
    o = out[f"{tag}-turn2"]
    return {
        "workload": "second turn",
        "first_step_s": o.first_step_s,
        "first_block_s": o.first_block_s,
        "tok_per_s": None,
        "cached_tokens": o.cached,
    }


def run(args: argparse.Namespace) -> int:
    with tempfile.TemporaryDirectory(prefix="cde-bench-prefix-") as tmp:
        if args.preset:
            from cde.worker.checkpoint import make_model

            model_dir = str(make_model(args.preset, tmp, seed=0))
        else:
            resolve_model_args(args, "bench prefix-cache")
            model_dir = args.model
        engine = Engine(EngineArgs(model_dir, device=args.device, dtype=args.dtype, max_running=args.concurrency))
    cache = engine.scheduler.prefix_cache
    if cache is None:  # built with the cache on, always: EngineArgs.prefix_cache defaults to True
        raise SystemExit("cde bench prefix-cache: the engine has no prefix cache")
    rng = random.Random(0)
    shared_prefix(engine, args, rng, "warm")  # the host side's first passes of each size
    results = []
    for on in (False, True):
        cache.enabled = on
        for workload in (shared_prefix, second_turn):
            res = workload(engine, args, rng, f"{'on' if on else 'off'}-{workload.__name__}")
            res["cache"] = "on" if on else "off"
            results.append(res)
            print(json.dumps(res), flush=True)
    print("workload | cache | first step s | first block s | tok/s | cached tokens")
    for r in results:
        tps = "—" if r["tok_per_s"] is None else f"{r['tok_per_s']:.1f}"
        print(
            f"{r['workload']} | {r['cache']} | {r['first_step_s']:.3f} | {r['first_block_s']:.3f} | {tps} | "
            f"{r['cached_tokens']}"
        )
    if args.json:
        with open(args.json, "w") as f:
            json.dump(results, f, indent=2)
    return 0
