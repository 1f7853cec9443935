"""Clients that hang up mid-stream: their requests are aborted in the workers, KV pages and
running slots come back, and the server stays fast."""

import asyncio
import time

import httpx
import pytest

from tests.api_server import ServerProcess

pytestmark = pytest.mark.serial  # "the server stays fast": a wall-clock bound, alone on the machine


@pytest.fixture(scope="module")
def server(tiny_dir):
    # Base model: no end-of-turn token, so every request runs to its max_tokens unless aborted.
    srv = ServerProcess(tiny_dir, "--served-model-name", "tiny")
    yield srv
    srv.stop()


def wait_idle(server, timeout=15.0) -> dict:
    deadline = time.monotonic() + timeout
    while True:
        m = server.metrics()
        assert m["cde_worker_up"] == 2, "a worker went down"
        busy = {
            k: m[k]
            for k in (
                "cde_worker_running_requests",
                "cde_worker_waiting_requests",
                "cde_worker_kv_pages_used",
                "cde_gateway_outstanding_requests",
            )
            if m[k]
        }
        if not busy:
            return m
        assert time.monotonic() < deadline, f"still busy after {timeout}s: {busy}"
        time.sleep(0.2)


async def test_50_streams_25_disconnect(server):
    url = server.base_url + "/completions"
    short = {"model": "tiny", "prompt": "x", "max_tokens": 63, "temperature": 0, "tokens_per_step": 16, "stream": True}
    # The ones we hang up on would run for 250 more steps: if the abort did not reach the worker,
    # their pages would stay in use long after the short ones finished.
    long = {**short, "max_tokens": 1000, "tokens_per_step": 4}

    async def one(client, i):
        async with client.stream("POST", url, json=long if i % 2 else short) as r:
            assert r.status_code == 200
            async for line in r.aiter_lines():
                if not line.startswith("data: "):
                    continue
                if i % 2:
                    return "hung up"  # leaving the block closes the connection mid-stream
                if line == "data: [DONE]":
                    return "done"
        return "truncated"

    limits = httpx.Limits(max_connections=60, max_keepalive_connections=0)
    async with httpx.AsyncClient(timeout=120, limits=limits) as client:
        results = await asyncio.gather(*(one(client, i) for i in range(50)))
    assert results.count("done") == 25 and results.count("hung up") == 25

    m = await asyncio.to_thread(wait_idle, server, 10.0)
    assert m["cde_kv_pages_free"] > 0
    t0 = time.monotonic()
    async with httpx.AsyncClient(timeout=60) as client:
        r = await client.post(url, json={**short, "stream": False})
    assert r.status_code == 200 and r.json()["choices"][0]["finish_reason"] == "length"
    assert time.monotonic() - t0 < 10


async def test_non_streaming_disconnect_aborts(server):
    body = {"model": "tiny", "prompt": "x", "max_tokens": 1000, "temperature": 0}  # 1000 steps
    async with httpx.AsyncClient(timeout=1.0) as client:
        with pytest.raises(httpx.ReadTimeout):
            await client.post(server.base_url + "/completions", json=body)
    await asyncio.to_thread(wait_idle, server, 3.0)
