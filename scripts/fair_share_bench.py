"""Issue 32's fair-share measurement on a CPU: `cde serve` (the built-in demo model, one worker,
--max-running 16) with one client sending `n: 16` long requests, alone and then with a second
client (another loopback address) sending short requests one after another. Prints, per run,
the total throughput and, for the second client, how long each request waited for its first
block against the first client's time per block.

    python scripts/fair_share_bench.py [--max-tokens 128] [--short-tokens 16] [--model DIR]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import sys
import time
from pathlib import Path

import httpx

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from tests.api_server import ServerProcess

MODEL = "cde-reference"  # the demo's name; another checkpoint is served under it too


async def long_client(url: str, max_tokens: int) -> tuple[int, float, float]:
    """One `n: 16` request, streamed: its tokens, when it ended, and when its first block came
    (its prefill and one block's 64 steps: the block time under this load)."""
    body = {"model": MODEL, "prompt": "Once upon a time", "max_tokens": max_tokens, "n": 16}
    body |= {"temperature": 0, "stream": True, "stream_options": {"include_usage": True}}
    t0, first, tokens = time.perf_counter(), 0.0, 0
    async with (
        httpx.AsyncClient(timeout=3600) as http,
        http.stream("POST", url + "/v1/completions", json=body) as r,
    ):
        async for line in r.aiter_lines():
            if not line.startswith("data: {"):
                continue
            event = json.loads(line[6:])
            if event.get("usage"):
                tokens = event["usage"]["completion_tokens"]
            if not first and any(c.get("text") for c in event.get("choices", [])):
                first = time.perf_counter() - t0
    return tokens, time.perf_counter(), first


async def short_client(url: str, tokens: int, until: asyncio.Task) -> list[tuple[float, int]]:
    """Requests one after another until `until` is done: per request, the wait for its first
    block (streamed) and its tokens."""
    out = []
    transport = httpx.AsyncHTTPTransport(local_address="127.0.0.2")
    async with httpx.AsyncClient(timeout=3600, transport=transport) as http:
        while not until.done():
            body = {"model": MODEL, "prompt": "2 + 2 =", "max_tokens": tokens, "stream": True}
            body |= {"temperature": 0, "stream_options": {"include_usage": True}}
            t0, first, n = time.perf_counter(), None, 0
            async with http.stream("POST", url + "/v1/completions", json=body) as r:
                async for line in r.aiter_lines():
                    if line.startswith("data: {") and first is None:
                        first = time.perf_counter() - t0
                    if line.startswith("data: {") and (usage := json.loads(line[6:]).get("usage")):
                        n = usage["completion_tokens"]
            out.append((first or 0.0, n))
            await asyncio.sleep(0.5)
    return out


async def run(url: str, max_tokens: int, short_tokens: int, with_second: bool) -> dict:
    t0 = time.perf_counter()
    long = asyncio.create_task(long_client(url, max_tokens))
    short = asyncio.create_task(short_client(url, short_tokens, long)) if with_second else None
    long_tokens, long_end, first_block = await long
    waits = await short if short is not None else []
    elapsed = long_end - t0
    short_tokens_done = sum(n for _, n in waits)
    return {
        "elapsed_s": elapsed,
        "tokens": long_tokens + short_tokens_done,
        "tok_per_s": (long_tokens + short_tokens_done) / elapsed,
        "first_block_waits_s": [round(w, 2) for w, _ in waits],
        "block_time_s": first_block,
    }


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--max-tokens", type=int, default=128)
    p.add_argument("--short-tokens", type=int, default=16)
    p.add_argument("--model", help="a checkpoint directory (default: the built-in demo model)")
    args = p.parse_args()
    served = ["--served-model-name", MODEL] if args.model else []
    srv = ServerProcess(args.model, "--max-running", "16", *served, workers=1, timeout=600)
    try:
        alone = asyncio.run(run(srv.url, args.max_tokens, args.short_tokens, False))
        shared = asyncio.run(run(srv.url, args.max_tokens, args.short_tokens, True))
    finally:
        srv.stop()
    for name, r in (("one client", alone), ("two clients", shared)):
        print(f"{name}: {r['tokens']} tokens in {r['elapsed_s']:.1f} s = {r['tok_per_s']:.1f} tok/s")
    waits = shared["first_block_waits_s"]
    print(
        f"second client: {len(waits)} requests, first block after median {statistics.median(waits):.2f} s, "
        f"max {max(waits):.2f} s; the first client's block time {shared['block_time_s']:.2f} s "
        f"({alone['block_time_s']:.2f} s alone)"
    )
    print(f"throughput two clients / one client: {shared['tok_per_s'] / alone['tok_per_s']:.3f}")


if __name__ == "__main__":
    main()
