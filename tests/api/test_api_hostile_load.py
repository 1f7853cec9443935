"""Issue 32's second penetration test, replayed against a real `cde serve` (one worker, the tiny
instruct model) serving an 8B-sized concept catalog (40,000 rows, 1-4 word names, 8-30 word
descriptions): while hostile searches and steering labels arrive, `/health` answers within
100 ms and a concurrent stream loses nothing; every hostile request gets its answer within 1 s;
one client's `n` cannot keep another client's request from starting; connection exhaustion from
one address leaves the others served, and every refusal is logged and counted; the API key is
refused on the command line and never reaches a worker. (Findings 3 and 4, on the worker's own
socket: tests/worker/test_worker_hardening.py; finding 8, the unpacker: test_demo_model.py.)"""

import asyncio
import json
import os
import random
import socket
import subprocess
import sys
import threading
import time
from urllib.parse import urlparse

import httpx
import pytest
from cde.shared.catalog import write_catalog

from tests.api_server import REPO, ServerProcess, pid_alive

# /health latencies and gateway times of hostile requests: wall-clock bounds, alone on the machine
pytestmark = [pytest.mark.serial, pytest.mark.slow]

KEY = "hostile-suite-key"
AUTH = {"Authorization": f"Bearer {KEY}"}
ROWS = 40_000
HEADER_TIMEOUT = 3
MAX_CONNECTIONS = 64  # per address: 48 (3/4)
COMMON = ["a", "the", "of", "and", "to", "in", "is", "for", "with", "on"]


def catalog_rows() -> list[dict]:
    rng = random.Random(32)
    vocab = [f"w{i}x" for i in range(3000)]
    return [
        {
            "concept_id": cid,
            "concept_name": " ".join(rng.choices(vocab, k=rng.randint(1, 4))),
            "concept_description": " ".join(rng.choices(vocab + COMMON * 60, k=rng.randint(8, 30))),
            "head": "known" if cid % 3 else "unknown",
        }
        for cid in range(ROWS)
    ]


@pytest.fixture(scope="module")
def server(tiny_instruct_dir, tmp_path_factory):
    path = write_catalog(tmp_path_factory.mktemp("catalog") / "labels.parquet", catalog_rows())
    srv = ServerProcess(
        tiny_instruct_dir,
        "--concept-labels",
        str(path),
        "--served-model-name",
        "tiny",
        "--max-running",
        "4",
        "--max-connections",
        str(MAX_CONNECTIONS),
        "--header-timeout",
        str(HEADER_TIMEOUT),
        workers=1,
        env={"CDE_API_KEY": KEY},
    )
    yield srv
    srv.stop()


class HealthProbe:
    """/health every 20 ms on its own thread and connection: the latencies."""

    def __init__(self, url: str):
        self.url, self.latencies = url + "/health", []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        with httpx.Client(timeout=30) as http:
            while not self._stop.is_set():
                t0 = time.perf_counter()
                assert http.get(self.url).status_code == 200
                self.latencies.append(time.perf_counter() - t0)
                self._stop.wait(0.02)

    def __enter__(self) -> "HealthProbe":
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join()

    def slower_than(self, seconds: float) -> int:
        return sum(latency >= seconds for latency in self.latencies)


def steer(label, **extra) -> dict:
    return {"model": "tiny", "prompt": "hi", "max_tokens": 4, "steering": {"concepts": [label]}, **extra}


HOSTILE = [
    # finding 2: 999 characters of "a " over the whole catalog: the index answers it
    ("GET", "/v1/concepts", {"search": ("a " * 500)[:999], "limit": "1000", "head": "any"}, None, 200, None),
    ("GET", "/v1/concepts", {"search": " ".join(COMMON * 90)[:999], "limit": "1000"}, None, 200, None),
    # regex terms (a character other than letters, digits, _) are bounded: 400 past 16
    ("GET", "/v1/concepts", {"search": " ".join(f"w{i}x-" for i in range(40))}, None, 400, "search"),
    ("GET", "/v1/concepts", {"search": "-" * 999, "head": "any"}, None, 200, None),
    # finding 1: an unknown label of 1 MB, in steering, in the ReLU mask and in chat
    ("POST", "/v1/completions", None, steer("e " * 500_000), 400, "steering.concepts"),
    (
        "POST",
        "/v1/completions",
        None,
        {"model": "tiny", "prompt": "hi", "steering": {"relu_logit_mask": {"e " * 500_000: 1.0}}},
        400,
        "steering.relu_logit_mask",
    ),
    (
        "POST",
        "/v1/chat/completions",
        None,
        {"model": "tiny", "messages": [{"role": "user", "content": "hi"}], "steering": {"concepts": ["e " * 500_000]}},
        400,
        "steering.concepts",
    ),
    # the longest label allowed, of the catalog's commonest words: the hint comes from the index
    ("POST", "/v1/completions", None, steer(" ".join(COMMON * 30)[:256]), 400, "steering.concepts"),
    # finding 5: input attribution past its work budget (steps 64 over 448 tokens)
    (
        "POST",
        "/v1/completions",
        None,
        {"model": "tiny", "prompt": [1] * 64, "max_tokens": 448, "attribution": {"inputs": {"steps": 64}}},
        400,
        "attribution.inputs.steps",
    ),
]


async def _stream(http: httpx.AsyncClient, url: str) -> tuple[int, int, float]:
    """A legitimate stream: the completion tokens it delivered, the count its usage reports (the
    instruct model may sample its end of turn before max_tokens), and the longest gap between two
    events."""
    body = {
        "model": "tiny",
        "prompt": "hello",
        "max_tokens": 64,
        "stream": True,
        "return_token_ids": True,
        "stream_options": {"include_usage": True},
    }
    tokens, generated, last, gap = 0, 0, time.perf_counter(), 0.0
    async with http.stream("POST", url + "/v1/completions", json=body, headers=AUTH) as r:
        assert r.status_code == 200
        async for line in r.aiter_lines():
            if line.startswith("data: {"):
                now = time.perf_counter()
                gap, last = max(gap, now - last), now
                chunk = json.loads(line[6:])
                tokens += sum(len(c.get("token_ids") or []) for c in chunk.get("choices", []))
                generated = (chunk.get("usage") or {}).get("completion_tokens", generated)
    return tokens, generated, gap


def gateway_ms(server, request_id: str) -> float:
    """The request's duration in the gateway's access log (its own clock: the test machine's load
    on the client side does not count)."""
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline:
        for line in reversed(server.output):
            if request_id in line and '"msg": "request"' in line:
                return json.loads(line)["duration_ms"]
        time.sleep(0.05)
    raise AssertionError(f"no access line for {request_id}")


async def test_hostile_input_keeps_the_gateway_responsive(server):
    async with httpx.AsyncClient(timeout=60) as http:
        with HealthProbe(server.url) as probe:
            stream = asyncio.create_task(_stream(http, server.url))
            for method, path, params, body, status, param in HOSTILE:
                r = await http.request(method, server.url + path, params=params, json=body, headers=AUTH)
                assert r.status_code == status, (path, r.text[:300])
                if param is not None:
                    assert r.json()["error"]["param"] == param
                took = gateway_ms(server, r.headers["x-request-id"])
                assert took < 1000, (path, str(params or body)[:80], took)
            tokens, generated, _gap = await stream
    assert 0 < tokens == generated <= 64  # the stream lost nothing of what the worker generated
    # The freezes this replays were 1 s to 101 s. 99% of the probes answer within 100 ms, and one
    # may be late when there are fewer than 200 (on a shared 2-core machine at load 10 the probe's
    # own thread is sometimes not scheduled for a tenth of a second: CI saw one of 0.28 s); the
    # slowest within 0.5 s.
    n, slow = len(probe.latencies), probe.slower_than(0.1)
    assert n > 10
    assert slow <= max(1, n // 100) and max(probe.latencies) < 0.5, (n, slow, max(probe.latencies))


async def test_one_clients_n_does_not_keep_another_waiting(server):
    """Finding 5: one client's `n` took every decoding slot, and another client's 16-token request
    waited for all of them to end. With 4 slots, one client holds at most 3: the other client's
    request (from another address) starts at once and ends long before the first client's."""
    first = {"model": "tiny", "prompt": "one", "max_tokens": 128, "n": 4, "tokens_per_step": 1}
    second = {"model": "tiny", "prompt": "two", "max_tokens": 16, "tokens_per_step": 1}
    other = httpx.AsyncHTTPTransport(local_address="127.0.0.2")
    async with httpx.AsyncClient(timeout=120) as a, httpx.AsyncClient(timeout=120, transport=other) as b:
        t0 = time.perf_counter()
        big = asyncio.create_task(a.post(server.url + "/v1/completions", json=first, headers=AUTH))
        await asyncio.sleep(0.5)  # admitted, decoding
        r = await b.post(server.url + "/v1/completions", json=second, headers=AUTH)
        small_s = time.perf_counter() - t0
        assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 16
        assert (await big).status_code == 200
        big_s = time.perf_counter() - t0
    assert small_s < 0.5 * big_s, (small_s, big_s)


def _connect(server, source: str) -> socket.socket:
    url = urlparse(server.url)
    return socket.create_connection((url.hostname, url.port), timeout=15, source_address=(source, 0))


def test_one_address_cannot_take_every_connection(server):
    """Finding 6: idle sockets from one address gave every client 503. Now an address holds at
    most 3/4 of the connections; the 503s and the header-timeout 408s are in the access log and
    in cde_http_responses_total."""
    before = server.metrics()
    held = [_connect(server, "127.0.0.1") for _ in range(MAX_CONNECTIONS * 3 // 4)]
    try:
        time.sleep(0.3)
        with _connect(server, "127.0.0.1") as extra:
            extra.sendall(b"GET /health HTTP/1.1\r\nHost: 127.0.0.1\r\n\r\n")
            assert b" 503 " in extra.recv(4096).split(b"\r\n")[0]
        other = httpx.Client(transport=httpx.HTTPTransport(local_address="127.0.0.2"))
        assert other.get(server.url + "/health").status_code == 200
        held[0].sendall(b"GET /health HTTP/1.1\r\n")  # and never the rest
        assert b" 408 " in held[0].recv(4096).split(b"\r\n")[0]
    finally:
        for s in held:
            s.close()
    after = server.metrics()
    for status in ("503", "408"):
        name = f'cde_http_responses_total{{status="{status}"}}'
        assert after.get(name, 0) > before.get(name, 0), status
    log = "".join(server.output)
    assert '"status": 503' in log and '"status": 408' in log


def test_the_key_stays_off_command_lines_and_out_of_workers(server):
    """Finding 7: `--api-key KEY` is refused (it shows in /proc/PID/cmdline), and the workers
    `cde serve` starts do not inherit CDE_API_KEY."""
    r = subprocess.run(
        [sys.executable, "-m", "cde", "serve", "--api-key", "secret"], cwd=REPO, capture_output=True, text=True
    )
    assert r.returncode == 2 and "CDE_API_KEY" in r.stderr and "--api-key-file" in r.stderr
    pids = [w["pid"] for w in httpx.get(server.url + "/health", headers=AUTH).json()["workers"]]
    assert pids and all(pid_alive(p) for p in pids)
    for pid in pids:
        with open(f"/proc/{pid}/environ", "rb") as f:
            assert b"CDE_API_KEY=" not in f.read()


def test_client_commands_take_the_key_as_the_server_does(server, tmp_path):
    """`cde bench serve` (as `bench soak` and `eval --url`) sends the key of $CDE_API_KEY or
    --api-key-file, and refuses it on the command line; without it the server answers 401."""

    def bench(*args: str, env: dict[str, str]) -> subprocess.CompletedProcess:
        cmd = [sys.executable, "-m", "cde", "bench", "serve", "--url", server.url, "--num-prompts", "2"]
        cmd += ["--max-tokens", "4", "--prompt-len", "8", "--json", str(tmp_path / "b.json"), *args]
        return subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, timeout=120, env=env)

    plain = {k: v for k, v in os.environ.items() if k != "CDE_API_KEY"}
    assert bench(env={**plain, "CDE_API_KEY": KEY}).returncode == 0
    (tmp_path / "key").write_text(KEY + "\n")
    assert bench("--api-key-file", str(tmp_path / "key"), env=plain).returncode == 0
    assert bench(env=plain).returncode != 0
    refused = bench("--api-key", KEY, env=plain)
    assert refused.returncode == 2 and "--api-key-file" in refused.stderr
