"""The engine's speed against what reaches an HTTP client (issue 19's table), in one run.

1. `cde bench engine --compare-attribution`: the engine alone, every concurrency, attribution
   off and on.
2. `cde serve` of the same checkpoint (its warm-up on), then: the first request after startup
   (one streamed request, attribution off), and `cde bench serve` for every cell with the same
   prompts' shape (random token ids), max_tokens and tokens per step, and greedy like the engine
   bench (`temperature: 0`: the API's default of 1 samples, and sampling over the vocabulary
   costs the device time per pass that the engine bench does not spend). A cell's requests go
   out at once from `--client-processes` ceil(c / 8) processes, at most 8 per process, over
   connections opened beforehand: one Python client spends ~3 ms of CPU per request, so 32 from
   one process reach the server over ~0.1-0.2 s, while the engine bench adds all of them before
   its first step (issue 19). The engine's time to the first block counts from the burst's start,
   HTTP's from each request's start, which with 8 per process is within ~3 ms of the release.

Prints a markdown table (engine and HTTP tok/s, their ratio, median time to the first block of
both) and the first request's time, and writes everything as JSON. The engine and the server run
one after the other, never together.

    python scripts/http_vs_engine.py --model /tmp/m8b --out $OUT                 # GPU (gpu_run.sh http)
    python scripts/http_vs_engine.py --preset tiny --device cpu --max-tokens 16 --tokens-per-step 8
"""

from __future__ import annotations

import argparse
import atexit
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx

from cde.commands.bench_roofline import host_gap_ms

PY = [sys.executable, "-m", "cde"]


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    src = p.add_mutually_exclusive_group(required=True)
    src.add_argument("--model", help="checkpoint directory")
    src.add_argument("--preset", help="write a random-weight checkpoint of this preset first (e.g. tiny)")
    p.add_argument("--device", default="auto", choices=["auto", "cpu", "cuda"])
    p.add_argument("--concurrency", default="1,32", help="comma-separated request counts")
    p.add_argument("--prompt-len", type=int, default=64, help="prompt length in token ids")
    p.add_argument("--max-tokens", type=int, default=256)
    p.add_argument("--tokens-per-step", type=int, default=1)
    p.add_argument("--requests-at-1", type=int, default=3, help="requests of the concurrency-1 HTTP cells (in turn)")
    p.add_argument("--out", default=os.environ.get("OUT", "."), help="folder for the JSON and logs")
    p.add_argument("--startup-timeout", type=float, default=900.0)
    return p.parse_args(argv)


def run_engine(args: argparse.Namespace, model: str, out: Path) -> tuple[str, dict[tuple[int, bool], dict]]:
    """The card the engine ran on, and its bench's rows per (concurrency, attribution)."""
    path = out / "engine.json"
    cmd = [
        *PY,
        "bench",
        "engine",
        "--model",
        model,
        "--device",
        args.device,
        "--concurrency",
        args.concurrency,
        "--prompt-len",
        str(args.prompt_len),
        "--max-tokens",
        str(args.max_tokens),
        "--tokens-per-step",
        str(args.tokens_per_step),
        "--compare-attribution",
        "--json",
        str(path),
    ]
    with open(out / "engine.log", "w") as log:
        subprocess.run(cmd, stdout=log, stderr=subprocess.STDOUT, check=True)
    report = json.loads(path.read_text())
    return report["device"], {(r["concurrency"], r["attribution"]): r for r in report["results"]}


class Server:
    """`cde serve` in its own process group, stopped with SIGTERM."""

    def __init__(self, args: argparse.Namespace, model: str, out: Path, max_running: int):
        self.log_path = out / "serve.log"
        self.log = open(self.log_path, "w")  # noqa: SIM115 (closed in stop)
        cmd = [*PY, "serve", "--model", model, "--device", args.device, "--port", "0", "--warm-up", "on"]
        # One client measuring the whole batch: the default per-client cap (3/4 of the slots, kept
        # free for other clients: docs/security.md) would hold a quarter of the requests back.
        cmd += ["--max-running", str(max_running), "--max-running-per-client", str(max_running), "--log-level", "info"]
        self.t0 = time.monotonic()
        self.proc = subprocess.Popen(cmd, stdout=self.log, stderr=subprocess.STDOUT, process_group=0)
        deadline = self.t0 + args.startup_timeout
        while True:
            found = re.search(r"at (http://\S+)/v1.*\(ready in ([\d.]+) s\)", self.log_path.read_text())
            if found:
                self.url, self.ready_s = found[1], float(found[2])
                return
            if self.proc.poll() is not None or time.monotonic() > deadline:
                self.stop()
                raise SystemExit(f"cde serve did not become ready; see {self.log_path}")
            time.sleep(0.5)

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(60)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        self.log.close()


def first_request(url: str, args: argparse.Namespace) -> dict:
    """One streamed request (attribution off): time to its first block and to its end."""
    import random

    rng = random.Random(12345)
    body = {
        "model": httpx.get(url + "/v1/models", timeout=30).json()["data"][0]["id"],
        "prompt": [rng.randrange(1000, 100000) for _ in range(args.prompt_len)],
        "max_tokens": args.max_tokens,
        "tokens_per_step": args.tokens_per_step,
        "temperature": 0,
        "stream": True,
        "stream_granularity": "block",  # its first chunk is its first block
    }
    t0 = time.perf_counter()
    ttfb = None
    with httpx.stream("POST", url + "/v1/completions", json=body, timeout=600) as r:
        r.raise_for_status()
        for line in r.iter_lines():
            if ttfb is None and line.startswith("data: {"):
                ttfb = time.perf_counter() - t0
    return {"ttfb_s": ttfb, "e2e_s": time.perf_counter() - t0}


REQUESTS_PER_CLIENT = 8  # at most, per client process of `cde bench serve`


def client_processes(c: int) -> int:
    """Enough `cde bench serve` processes that none sends more than REQUESTS_PER_CLIENT of a
    c-request burst (the concurrency-1 cells send one request at a time: one process)."""
    return -(-c // REQUESTS_PER_CLIENT)


WORKER_FIGURES = ("cde_worker_forward_passes", "cde_worker_device_idle_seconds")


def worker_figures(url: str) -> tuple[float, float]:
    """The worker's forward passes and its device's waits for the host, since it started, once
    its heartbeat has caught up with the last pass (the same figures in two scrapes 0.5 s apart)."""
    last = None
    for _ in range(20):
        text = httpx.get(url + "/metrics", timeout=30).text
        now = tuple(float(re.search(rf"^{name}{{[^}}]*}} (\S+)$", text, re.M)[1]) for name in WORKER_FIGURES)
        if now == last:
            break
        last = now
        time.sleep(0.5)
    return now


def run_http(args: argparse.Namespace, url: str, c: int, attribution: bool, out: Path) -> dict:
    path = out / f"http_c{c}_{'attr' if attribution else 'plain'}.json"
    extra = {"tokens_per_step": args.tokens_per_step, "attribution": attribution, "temperature": 0}
    cmd = [*PY, "bench", "serve", "--url", url, "--prompt-ids", "--prompt-len", str(args.prompt_len)]
    cmd += ["--max-tokens", str(args.max_tokens), "--extra-body", json.dumps(extra), "--json", str(path)]
    cmd += ["--num-prompts", str(args.requests_at_1 if c == 1 else c), "--max-concurrency", str(c)]
    cmd += ["--client-processes", str(client_processes(c))]
    passes0, idle0 = worker_figures(url)
    subprocess.run(cmd, stdout=subprocess.DEVNULL, check=True)
    passes, idle = worker_figures(url)
    result = json.loads(path.read_text())
    result["worker_forward_passes"] = int(passes - passes0)
    result["worker_idle_ms_per_pass"] = (idle - idle0) * 1e3 / max(1, passes - passes0)
    return result


def table(cells: list[dict]) -> str:
    lines = [
        "| concurrency | attribution | engine tok/s | HTTP tok/s | HTTP vs engine "
        "| engine TTFB s (median) | HTTP TTFB s (median) | HTTP TTFT s (median) "
        "| passes, engine / HTTP | ms per pass, engine / HTTP | host gap ms per pass, engine / HTTP |",
        "| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |",
    ]
    for c in cells:
        lines.append(
            f"| {c['concurrency']} | {'on' if c['attribution'] else 'off'} | {c['engine_tok_s']:.1f} | "
            f"{c['http_tok_s']:.1f} | {100 * (c['http_tok_s'] / c['engine_tok_s'] - 1):+.1f}% | "
            f"{c['engine_ttfb_s']:.3f} | {c['http_ttfb_s']:.3f} | {c['http_ttft_s']:.3f} | "
            f"{c['engine_passes']} / {c['http_passes']} | "
            f"{c['engine_ms_per_pass']:.2f} / {c['http_ms_per_pass']:.2f} | "
            f"{c['engine_gap_ms']:.2f} / {c['http_gap_ms']:.2f} |"
        )
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    levels = [int(x) for x in args.concurrency.split(",")]
    model = args.model
    if model is None:
        model = tempfile.mkdtemp(prefix=f"cde-{args.preset}-")
        atexit.register(shutil.rmtree, model, ignore_errors=True)  # a random 8b is 16 GB of /tmp
        subprocess.run([*PY, "make-model", "--preset", args.preset, model], stdout=subprocess.DEVNULL, check=True)
    t0 = time.monotonic()
    device, engine = run_engine(args, model, out)
    engine_s = time.monotonic() - t0
    server = Server(args, model, out, max(levels))
    try:
        first = first_request(server.url, args)
        http = {(c, a): run_http(args, server.url, c, a, out) for c in levels for a in (False, True)}
    finally:
        server.stop()
    cells = []
    for (c, attribution), h in http.items():
        e = engine[(c, attribution)]
        cells.append(
            {
                "concurrency": c,
                "attribution": attribution,
                "engine_tok_s": e["output_tok_per_s"],
                "http_tok_s": h["output_throughput"],
                # The engine's first blocks all complete in the same passes: its mean is its median.
                "engine_ttfb_s": e.get("time_to_first_block_median_s", e["time_to_first_block_s"]),
                # From the token ids of its streamed chunks (cde bench serve's block figures).
                "http_ttfb_s": h["ttfb_ms"]["median"] / 1e3,
                "http_ttft_s": h["ttft_ms"]["median"] / 1e3,
                # Where a difference comes from: more passes (requests arriving over several of
                # them), slower passes, or the device waiting longer for the host between them.
                "engine_passes": e["forward_passes"],
                "http_passes": h["worker_forward_passes"],
                "engine_ms_per_pass": e["wall_s"] * 1e3 / e["forward_passes"],
                "http_ms_per_pass": h["duration_s"] * 1e3 / max(1, h["worker_forward_passes"]),
                "engine_gap_ms": host_gap_ms(e),
                "http_gap_ms": h["worker_idle_ms_per_pass"],
                "http_failed_requests": h["failed_requests"],
                "http_client_processes": h["client_processes"],
            }
        )
    rest = next(c["http_ttfb_s"] for c in cells if c["concurrency"] == min(levels) and not c["attribution"])
    text = table(cells)
    text += (
        f"\n\nFirst request after startup: time to first block {first['ttfb_s']:.3f} s "
        f"({100 * (first['ttfb_s'] / rest - 1):+.1f}% vs the median of the rest, {rest:.3f} s), "
        f"end to end {first['e2e_s']:.3f} s. Server ready in {server.ready_s:.1f} s (warm-up included); "
        f"engine bench {engine_s:.0f} s."
    )
    print(text, flush=True)
    summary = {
        "args": vars(args),
        "device": device,
        "cells": cells,
        "first_request": first,
        "first_vs_median": first["ttfb_s"] / rest - 1,
        "server_ready_s": server.ready_s,
    }
    (out / "http_vs_engine.json").write_text(json.dumps(summary, indent=2))
    (out / "http_vs_engine.md").write_text(text + "\n")
    return 0 if all(c["http_failed_requests"] == 0 for c in cells) else 1


if __name__ == "__main__":
    sys.exit(main())
