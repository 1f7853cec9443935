"""HTTP load generator against a running OpenAI-compatible server, in the style of `vllm bench serve`.

Requests arrive as a Poisson process at `--request-rate` (inf: all at once), at most
`--max-concurrency` in flight, each a streaming completion, sent from this process or split over
`--client-processes` (cde/commands/load_processes.py), on keep-alive connections opened before the
clock starts. Reports throughput, time to first token (TTFT), the gaps between SSE chunks with text
(ITL: CDE streams each block's committed left prefix as it grows), time per output token after the
first (TPOT), beside them the block figures (time to the first complete 64-token block, TTFB, and
the gaps between blocks, from the token ids each chunk carries), end-to-end latency, and failures
by kind."""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import random

import httpx
import numpy as np

from cde.commands.api_key_args import add_api_key_arguments, api_key, auth_headers
from cde.commands.load_client import Outcome, write_json
from cde.commands.load_processes import send_all, split

# A word list, wrapped by hand rather than one word a line.
# fmt: off
WORDS = [
    "the", "of", "and", "to", "in", "is", "that", "for", "it", "as", "with", "was", "on", "be", "by", "this", "are",
    "from", "at", "or", "an", "have", "not", "but", "they", "which", "one", "you", "were", "all", "we", "can", "her",
    "has", "there", "been", "if", "more", "when", "will", "would", "who", "so", "no",
]
# fmt: on


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--url", default="http://127.0.0.1:8000", help="server base URL (with or without /v1)")
    p.add_argument("--model", help="model name (default: the first of /v1/models)")
    p.add_argument("--num-prompts", type=int, default=100, help="requests to send")
    p.add_argument(
        "--request-rate", type=float, default=math.inf, help="requests per second, Poisson (inf: all at once)"
    )
    p.add_argument("--max-concurrency", type=int, help="requests in flight at most (default: no limit)")
    p.add_argument("--prompt-len", type=int, default=32, help="prompt length in words (about one token each)")
    p.add_argument(
        "--prompt-ids",
        action="store_true",
        help="send each prompt as --prompt-len random token ids (as `cde bench engine` does), not words",
    )
    p.add_argument("--max-tokens", type=int, default=64, help="tokens each request generates")
    p.add_argument(
        "--extra-body",
        type=json.loads,
        default={},
        metavar="JSON",
        help='extra request fields, e.g. \'{"tokens_per_step": 4, "attribution": true}\'',
    )
    add_api_key_arguments(p, "send `Authorization: Bearer KEY`")
    p.add_argument("--timeout", type=float, default=600.0, help="seconds one request may take")
    p.add_argument("--seed", type=int, default=0, help="prompts and arrival times")
    p.add_argument(
        "--client-processes",
        type=int,
        default=1,
        metavar="N",
        help="send from N client processes (each its own event loop, httpx client and pre-opened connections), "
        "the requests dealt out round-robin and released together; each draws Poisson arrivals at RATE/N and "
        "keeps its even share of --max-concurrency in flight. One process spends ~3 ms of CPU per request, so a "
        "burst of 32 leaves it over ~0.1-0.2 s; use enough processes that each sends at most ~8 (default 1)",
    )
    p.add_argument("--json", metavar="OUT", help="also write the results as JSON here (default: only the table)")


def api_base(url: str) -> str:
    url = url.rstrip("/")
    return url if url.endswith("/v1") else url + "/v1"


async def first_model(client: httpx.AsyncClient, base: str, headers: dict) -> str:
    try:
        r = await client.get(base + "/models", headers=headers)
    except httpx.HTTPError as exc:
        raise SystemExit(f"cannot reach {base}: {exc!r}") from None
    if r.status_code != 200:
        raise SystemExit(f"{base}/models answered {r.status_code}: {r.text[:200]}")
    models = r.json()["data"]
    if not models:
        raise SystemExit(f"{base}/models lists no model (are the workers up?)")
    return models[0]["id"]


def _ms(values: list[float]) -> dict:
    if not values:
        return {"mean": None, "median": None, "p99": None}
    a = np.asarray(values) * 1000
    return {"mean": float(a.mean()), "median": float(np.median(a)), "p99": float(np.percentile(a, 99))}


def summarize(outcomes: list[Outcome], duration: float) -> dict:
    ok = [o for o in outcomes if o.status == "ok"]
    failures: dict[str, int] = {}
    for o in outcomes:
        if o.status != "ok":
            failures[o.kind] = failures.get(o.kind, 0) + 1
    output = sum(o.completion_tokens for o in ok)
    block_times = [o.block_times() for o in ok]
    tpot = [(o.latency - o.ttft) / (o.completion_tokens - 1) for o in ok if o.completion_tokens > 1 and o.ttft]
    return {
        "successful_requests": len(ok),
        "failed_requests": len(outcomes) - len(ok),
        "duration_s": duration,
        "total_input_tokens": sum(o.prompt_tokens for o in ok),
        "total_output_tokens": output,
        "request_throughput": len(ok) / duration,
        "output_throughput": output / duration,
        "ttft_ms": _ms([o.ttft for o in ok if o.ttft is not None]),
        "tpot_ms": _ms(tpot),
        "itl_ms": _ms([g for o in ok for g in o.itl]),
        "ttfb_ms": _ms([blocks[0] for blocks in block_times if blocks]),
        "inter_block_ms": _ms([b - a for blocks in block_times for a, b in zip(blocks, blocks[1:])]),
        "e2e_latency_ms": _ms([o.latency for o in ok]),
        "failures": failures,
    }


def print_report(s: dict) -> None:
    line = "{:<40}{:>12}"
    print("{:=^52}".format(" Serving Benchmark Result "))
    for label, key, fmt in (
        ("Successful requests:", "successful_requests", "{}"),
        ("Failed requests:", "failed_requests", "{}"),
        ("Benchmark duration (s):", "duration_s", "{:.2f}"),
        ("Total input tokens:", "total_input_tokens", "{}"),
        ("Total generated tokens:", "total_output_tokens", "{}"),
        ("Request throughput (req/s):", "request_throughput", "{:.2f}"),
        ("Output token throughput (tok/s):", "output_throughput", "{:.2f}"),
    ):
        print(line.format(label, fmt.format(s[key])))
    for title, key, name in (
        ("Time to First Token", "ttft_ms", "TTFT"),
        ("Time per Output Token (excl. 1st token)", "tpot_ms", "TPOT"),
        ("Inter-token Latency (between chunks)", "itl_ms", "ITL"),
        ("Time to First Block", "ttfb_ms", "TTFB"),
        ("Inter-block Latency", "inter_block_ms", "IBL"),
        ("End-to-end Latency", "e2e_latency_ms", "E2EL"),
    ):
        print(f"{title:-^52}")
        for stat in ("mean", "median", "p99"):
            value = s[key][stat]
            print(line.format(f"{stat.capitalize()} {name} (ms):", "-" if value is None else f"{value:.2f}"))
    if s["failures"]:
        print("{:-^52}".format("Failures by kind"))
        for kind, count in sorted(s["failures"].items()):
            print(line.format(f"{kind}:", count))
    print("=" * 52)


def make_prompt(args: argparse.Namespace, rng: random.Random) -> str | list[int]:
    if args.prompt_ids:
        return [rng.randrange(1000, 100000) for _ in range(args.prompt_len)]
    return " ".join(rng.choice(WORDS) for _ in range(args.prompt_len))


def make_bodies(args: argparse.Namespace, model: str, rng: random.Random) -> list[dict]:
    return [
        {
            "model": model,
            "prompt": make_prompt(args, rng),
            "max_tokens": args.max_tokens,
            "stream": True,
            "stream_options": {"include_usage": True},
            "return_token_ids": True,  # each chunk's tokens: when each block was complete
            **args.extra_body,
        }
        for _ in range(args.num_prompts)
    ]


async def lookup_model(base: str, headers: dict, timeout: float) -> str:
    async with httpx.AsyncClient(timeout=timeout) as client:
        return await first_model(client, base, headers)


def bench(args: argparse.Namespace) -> dict:
    if args.client_processes < 1:
        raise SystemExit("--client-processes must be at least 1")
    base, headers = api_base(args.url), auth_headers(api_key(args))
    rng = random.Random(args.seed)
    model = args.model or asyncio.run(lookup_model(base, headers, args.timeout))
    bodies = make_bodies(args, model, rng)
    shares = split(bodies, args.request_rate, args.max_concurrency, rng, args.client_processes)
    outcomes, duration = send_all(base, shares, headers, args.timeout)
    return {
        "model": model,
        "num_prompts": args.num_prompts,
        "request_rate": str(args.request_rate),
        "max_concurrency": args.max_concurrency,
        "client_processes": args.client_processes,
        **summarize(outcomes, duration),
    }


def run(args: argparse.Namespace) -> int:
    summary = bench(args)
    print_report(summary)
    write_json(summary, args.json)
    return 0 if summary["successful_requests"] else 1
