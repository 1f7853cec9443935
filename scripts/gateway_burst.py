"""How long a burst of concurrent streaming completions takes to get through the gateway (issue 19:
at 32 requests on the H200, most of the burst entered the engine ~0.2 s after it was sent).

Starts `cde worker` (CPU) and `cde gateway` in front of it, the gateway with a timing hook (its
ZeroMQ send loop writes the wall time of every frame it sends), fires N concurrent streaming
completions at once (random prompt token ids, greedy, `attribution` off then on), and reports per
round, relative to the burst's start: when the gateway sent the last GenerateRequest to the worker
(the spread that the gateway's per-request work causes), when the worker logged "request admitted"
(between engine steps: on the CPU a step of the `tiny` model takes long, so this one measures the
worker more than the gateway), and the gateway process's CPU time per request until its last send.
Also when each POST reached the gateway's first middleware, and the client's CPU time per request:
with `--client httpx` (an AsyncClient like `cde bench serve`'s) the client paces the burst, with
`--client raw` (every request written at once on connections opened beforehand) only the gateway
does; with `--client bench` the burst is sent by `cde bench serve`'s own functions
(`--client-processes N`; run the script from outside the repository with PYTHONPATH at another
checkout to time that checkout's client), timed from the client's release (when it starts
sending, after spawning its processes and opening its connections). A warm-up burst (the
tokenizer loads on the first request) comes first, unreported in the rounds. `--profile` also
records the gateway with py-spy during the rounds and prints its top functions. The streams are
closed once every request reached the worker (the rounds measure admission only; `--client bench`
completes them, with `--bench-max-tokens`).

    python -m cde make-model --preset tiny /tmp/tiny
    python scripts/gateway_burst.py --model /tmp/tiny --profile
"""

from __future__ import annotations

import argparse
import asyncio
import collections
import json
import math
import os
import random
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx

PY = [sys.executable, "-m", "cde"]

# Runs in the gateway process before `cde gateway`: every frame the send loop hands to ZeroMQ is
# appended to a file with its wall time (GenerateRequests are told apart afterwards, by decoding),
# and so is the arrival of every POST at the gateway's first middleware (uvicorn has parsed it).
HOOK = """
import sys, time, base64
from cde.gateway import worker_link
_path = sys.argv.pop(1)
_out = open(_path, "a", buffering=1)
async def _send_loop(self):
    while True:
        frame = await self._outbox.get()
        await self.sock.send(frame)
        _out.write(repr(time.time()) + " " + base64.b64encode(frame).decode() + "\\n")
worker_link.WorkerLink._send_loop = _send_loop
from cde.gateway import middleware
_call = middleware.RequestLog.__call__
async def _arrived(self, scope, receive, send):
    if scope["type"] == "http" and scope["method"] == "POST":
        _out.write(repr(time.time()) + " A\\n")
    return await _call(self, scope, receive, send)
middleware.RequestLog.__call__ = _arrived
from cde.cli import main
sys.exit(main())
"""


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", required=True, help="checkpoint directory (e.g. `cde make-model --preset tiny`)")
    p.add_argument("--requests", type=int, default=32)
    p.add_argument("--prompt-len", type=int, default=64)
    p.add_argument("--max-tokens", type=int, default=64)
    p.add_argument("--rounds", type=int, default=3, help="bursts per attribution setting (after one warm-up burst)")
    p.add_argument("--port", type=int, default=18932)
    p.add_argument(
        "--client",
        default="httpx",
        choices=["httpx", "raw", "bench"],
        help="httpx: an AsyncClient like `cde bench serve`'s; raw: every request written at once on open sockets; "
        "bench: `cde bench serve` itself",
    )
    p.add_argument("--client-processes", type=int, default=1, help="of `cde bench serve` (--client bench)")
    p.add_argument(
        "--bench-max-tokens", type=int, default=8, help="max_tokens of `--client bench` (it waits for every completion)"
    )
    p.add_argument("--profile", action="store_true", help="py-spy the gateway during the bursts")
    p.add_argument("--out", default=None, help="folder for logs and the profile (default: a temporary one)")
    return p.parse_args(argv)


def cpu_seconds(pid: int) -> float:
    fields = Path(f"/proc/{pid}/stat").read_text().rpartition(")")[2].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def sends(path: Path, since: float) -> tuple[dict[str, float], list[float]]:
    """request id -> wall time the gateway sent its GenerateRequest, and the times POSTs arrived
    at the gateway's first middleware, both after `since`."""
    import base64

    from cde.shared.protocol import GenerateRequest
    from cde.shared.wire import decode

    out: dict[str, float] = {}
    arrived: list[float] = []
    for line in path.read_text().splitlines():
        ts, _, frame = line.partition(" ")
        if float(ts) < since:
            continue
        if frame == "A":
            arrived.append(float(ts))
            continue
        msg = decode(base64.b64decode(frame))
        if isinstance(msg, GenerateRequest):
            out[msg.request_id] = float(ts)
    return out, sorted(arrived)


def admissions(path: Path, since: float) -> dict[str, float]:
    out: dict[str, float] = {}
    for line in path.read_text(errors="replace").splitlines():
        if '"request admitted"' not in line:
            continue
        try:
            rec = json.loads(line)
        except ValueError:
            continue
        if rec["ts"] >= since - 0.01:
            out[rec["request_id"]] = rec["ts"]
    return out


def bench_burst(url: str, args: argparse.Namespace, attribution: bool, gw_pid: int, sent_log: Path) -> dict:
    """The burst as `cde bench serve` sends it, all at once: its own functions (this checkout's, or
    those of the checkout on PYTHONPATH), timed from its release, the moment it starts sending."""
    from cde.commands import bench_serve

    base, n, rng = url + "/v1", args.requests, random.Random(0)
    extra = {"temperature": 0, "attribution": attribution, "tokens_per_step": args.bench_max_tokens}
    opts = argparse.Namespace(
        prompt_ids=True, prompt_len=args.prompt_len, num_prompts=n, max_tokens=args.bench_max_tokens, extra_body=extra
    )
    bodies = bench_serve.make_bodies(opts, args.served_name, rng)
    clock = time.time() - time.perf_counter()  # perf_counter is CLOCK_MONOTONIC, the same in every process
    if hasattr(bench_serve, "run_load"):  # before --client-processes: one client, connections opened in the burst

        async def old() -> tuple[list, float]:
            limits = httpx.Limits(max_connections=None, max_keepalive_connections=n)
            async with httpx.AsyncClient(timeout=600, limits=limits) as client:
                await bench_serve.first_model(client, base, {})  # as `bench` did: one connection open
                release = time.perf_counter()
                outcomes, _ = await bench_serve.run_load(client, base + "/completions", bodies, math.inf, n, rng, {})
                return outcomes, release

        outcomes, release = asyncio.run(old())
    else:
        from cde.commands import load_processes as lp

        shares = lp.split(bodies, math.inf, n, rng, args.client_processes)
        if len(shares) == 1:
            runs = [asyncio.run(lp.client_run(base, shares[0], {}, 600, lambda: None))]
        else:
            runs = lp.run_processes(base, shares, {}, 600)
        outcomes, release = [o for r in runs for o in r.outcomes], min(r.released for r in runs)
    failed = [o for o in outcomes if o.status != "ok"]
    if failed:
        raise RuntimeError(f"{len(failed)} requests failed, e.g. {failed[0].kind}: {failed[0].message}")
    t0 = release + clock
    sent, arrived = sends(sent_log, t0 - 0.001)
    return timings(sent, arrived, t0, args, attribution, None)


async def burst(url: str, args: argparse.Namespace, attribution: bool, gw_pid: int, sent_log: Path) -> dict:
    rng = random.Random(0)
    bodies = [
        {
            "model": args.served_name,
            "prompt": [rng.randrange(100, 1000) for _ in range(args.prompt_len)],
            "max_tokens": args.max_tokens,
            "temperature": 0,
            "stream": True,
            "attribution": attribution,
        }
        for _ in range(args.requests)
    ]
    n = args.requests
    if args.client == "raw":
        # Every request prepared and its connection open: at t0 all 32 are written at once, so
        # the spread until the last send is the gateway's own.
        port = int(url.rpartition(":")[2])
        conns = [await asyncio.open_connection("127.0.0.1", port) for _ in range(n)]
        wire = []
        for b in bodies:
            data = json.dumps(b).encode()
            head = f"POST /v1/completions HTTP/1.1\r\nHost: 127.0.0.1:{port}\r\nContent-Type: application/json\r\n"
            wire.append(head.encode() + f"Content-Length: {len(data)}\r\n\r\n".encode() + data)
        cpu0, me0, t0 = cpu_seconds(gw_pid), time.process_time(), time.time()
        for (_, w), req in zip(conns, wire):
            w.write(req)
        await asyncio.gather(*(w.drain() for _, w in conns))
        sent, arrived, cpu1, me1 = await wait_sent(sent_log, t0, n, gw_pid)
        await asyncio.sleep(0.5)
        for _, w in conns:
            w.close()
    else:
        limits = httpx.Limits(max_connections=n, max_keepalive_connections=n)
        async with httpx.AsyncClient(base_url=url, timeout=120, limits=limits) as client:
            # Open the connections first (as a benchmark client with keep-alive would have them).
            await asyncio.gather(*(client.get("/health") for _ in range(n)))

            async def one(i: int) -> None:
                async with client.stream("POST", "/v1/completions", json=bodies[i]) as r:
                    r.raise_for_status()
                    async for _ in r.aiter_raw():
                        pass

            cpu0, me0, t0 = cpu_seconds(gw_pid), time.process_time(), time.time()
            tasks = [asyncio.create_task(one(i)) for i in range(n)]
            sent, arrived, cpu1, me1 = await wait_sent(sent_log, t0, n, gw_pid)
            await asyncio.sleep(0.5)
            for t in tasks:
                t.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)
    return timings(sent, arrived, t0, args, attribution, (cpu1 - cpu0, me1 - me0))


def timings(
    sent: dict[str, float],
    arrived: list[float],
    t0: float,
    args: argparse.Namespace,
    attribution: bool,
    cpu: tuple[float, float] | None,
) -> dict:
    """The burst's times relative to `t0`; `cpu`: the gateway's and the client's CPU seconds."""
    rel = sorted(v - t0 for v in sent.values())
    arr = [a - t0 for a in arrived]
    # The gateway's wall time from a POST's arrival to its send, pairing the k-th arrival with the
    # k-th send (requests may overtake each other, so this is the mean over the burst).
    lag = [s - a for s, a in zip(rel, arr)]
    return {
        "t0": t0,
        "client": args.client,
        "attribution": attribution,
        "sent": len(rel),
        "first_send_s": rel[0] if rel else None,
        "median_send_s": rel[len(rel) // 2] if rel else None,
        "last_send_s": rel[-1] if rel else None,
        "gateway_cpu_ms_per_request": cpu[0] * 1000 / max(len(rel), 1) if cpu else None,
        "first_arrival_s": arr[0] if arr else None,
        "last_arrival_s": arr[-1] if arr else None,
        "mean_arrival_to_send_ms": 1000 * sum(lag) / len(lag) if lag else None,
        # the client's CPU until the last send (polling the send log included)
        "client_cpu_ms_per_request": cpu[1] * 1000 / max(len(rel), 1) if cpu else None,
    }


def one_burst(url: str, args: argparse.Namespace, attribution: bool, gw_pid: int, sent_log: Path) -> dict:
    if args.client == "bench":
        return bench_burst(url, args, attribution, gw_pid, sent_log)
    return asyncio.run(burst(url, args, attribution, gw_pid, sent_log))


async def wait_sent(
    sent_log: Path, t0: float, n: int, gw_pid: int
) -> tuple[dict[str, float], list[float], float, float]:
    """Polls the send log until `n` GenerateRequests went out (60 s at most); then the gateway's
    CPU seconds and this process's."""
    sent: dict[str, float] = {}
    arrived: list[float] = []
    while time.time() < t0 + 60:
        await asyncio.sleep(0.02)
        sent, arrived = sends(sent_log, t0)
        if len(sent) >= n:
            break
    return sent, arrived, cpu_seconds(gw_pid), time.process_time()


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    out = Path(args.out or tempfile.mkdtemp(prefix="gateway-burst-"))
    out.mkdir(parents=True, exist_ok=True)
    endpoint = f"ipc://{out}/worker.sock"
    worker_log, gw_log, sent_log = out / "worker.log", out / "gateway.log", out / "sent.log"
    sent_log.write_text("")
    # One torch thread: the worker's steps leave the other core to the gateway and the client.
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    worker = subprocess.Popen(
        [
            *PY,
            "worker",
            "--model",
            args.model,
            "--device",
            "cpu",
            "--bind",
            endpoint,
            "--max-running",
            str(args.requests),
        ],
        stdout=worker_log.open("w"),
        stderr=subprocess.STDOUT,
        env=env,
    )
    gw_cmd = [sys.executable, "-c", HOOK, str(sent_log), "gateway", "--worker", endpoint, "--port", str(args.port)]
    gateway = subprocess.Popen(gw_cmd, stdout=gw_log.open("w"), stderr=subprocess.STDOUT, env=env)
    url = f"http://127.0.0.1:{args.port}"
    spy = None
    try:
        deadline = time.time() + 120
        while True:
            try:
                if httpx.get(url + "/health", timeout=2).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            if time.time() > deadline or gateway.poll() is not None or worker.poll() is not None:
                raise RuntimeError(f"not ready; see {out}")
            time.sleep(0.2)
        args.served_name = httpx.get(url + "/v1/models", timeout=10).json()["data"][0]["id"]  # the folder's name
        # The first burst after startup also loads the tokenizer (on the event loop): a warm-up.
        warm = one_burst(url, args, False, gateway.pid, sent_log)
        print(f"warm-up burst: last send {warm['last_send_s']:.3f} s", flush=True)
        time.sleep(2.0)
        if args.profile:
            spy = subprocess.Popen(
                ["py-spy", "record", "--pid", str(gateway.pid), "-r", "1000", "--format", "raw"]
                + ["-o", str(out / "gateway.pyspy.txt"), "--nonblocking"],
                stdout=subprocess.DEVNULL,
                stderr=subprocess.DEVNULL,
            )
            time.sleep(1.0)
        results = []
        for attribution in (False, True):
            for r in range(args.rounds):
                res = one_burst(url, args, attribution, gateway.pid, sent_log)
                time.sleep(1.0)  # the worker logs its admissions between steps
                adm = sorted(v - res["t0"] for v in admissions(worker_log, res["t0"]).values())
                res["admitted"] = len(adm)
                res["last_admitted_s"] = adm[-1] if adm else None
                res["round"] = r
                results.append(res)
                cpu = (
                    f"client CPU {res['client_cpu_ms_per_request']:.2f} ms/request, "
                    f"gateway CPU {res['gateway_cpu_ms_per_request']:.2f} ms/request (until the last send), "
                    if res["client_cpu_ms_per_request"] is not None
                    else ""
                )
                print(
                    f"attribution={'on ' if attribution else 'off'} round {r}: sent {res['sent']}/{args.requests}, "
                    f"gateway send first/median/last {res['first_send_s']:.3f}/{res['median_send_s']:.3f}/"
                    f"{res['last_send_s']:.3f} s, arrived at the gateway first/last {res['first_arrival_s']:.3f}/"
                    f"{res['last_arrival_s']:.3f} s, arrival to send {res['mean_arrival_to_send_ms']:.1f} ms, "
                    f"{cpu}worker admitted {res['admitted']}, last at "
                    f"{res['last_admitted_s'] if adm else float('nan'):.3f} s",
                    flush=True,
                )
                time.sleep(1.0)  # the aborts drain
        (out / "results.json").write_text(json.dumps(results, indent=1))
    finally:
        if spy is not None:
            spy.send_signal(signal.SIGINT)
            spy.wait(30)
        for proc in (gateway, worker):
            proc.send_signal(signal.SIGINT)
        for proc in (gateway, worker):
            try:
                proc.wait(20)
            except subprocess.TimeoutExpired:
                proc.kill()
    if spy is not None and (out / "gateway.pyspy.txt").exists():
        top(out / "gateway.pyspy.txt")
    print(f"logs and results in {out}")
    return 0


def top(path: Path, k: int = 25) -> None:
    """Self and inclusive sample counts per function of py-spy's raw (collapsed) output."""
    own: collections.Counter[str] = collections.Counter()
    incl: collections.Counter[str] = collections.Counter()
    total = 0
    for line in path.read_text().splitlines():
        stack, _, count = line.rpartition(" ")
        c = int(count)
        frames = stack.split(";")
        total += c
        own[frames[-1]] += c
        for f in set(frames):
            incl[f] += c
    print(f"py-spy: {total} samples of the gateway's busy threads")
    print("top self:")
    for f, c in own.most_common(k):
        print(f"  {c:6d} {100 * c / total:5.1f}%  {f}")
    print("top inclusive:")
    for f, c in incl.most_common(k):
        print(f"  {c:6d} {100 * c / total:5.1f}%  {f}")


if __name__ == "__main__":
    sys.exit(main())
