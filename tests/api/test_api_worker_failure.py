"""Failure handling of a real `cde serve` (tiny base model, 2 workers): overload, a worker
killed mid-generation, and a clean SIGTERM shutdown."""

import asyncio
import os
import signal
import time

import httpx
import openai
import pytest

from tests.api_server import LONG, ServerProcess, pid_alive, read_events, stream_outcome

# A killed worker's requests fail within 5 s, and a drain's timing: alone on the machine.
pytestmark = pytest.mark.serial

MAX_RUNNING, MAX_QUEUE = 3, 1  # capacity: 4 requests per worker


@pytest.fixture(scope="module")
def server(tiny_dir):
    srv = ServerProcess(
        tiny_dir,
        "--served-model-name",
        "tiny",
        "--max-running",
        str(MAX_RUNNING),
        "--max-queue",
        str(MAX_QUEUE),
        "--shutdown-timeout",
        "10",
    )
    yield srv
    srv.stop()


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=server.base_url, api_key="unused", max_retries=0, timeout=60)


def test_chat_on_base_model_is_400(client):
    with pytest.raises(openai.BadRequestError) as e:
        client.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "hi"}], max_tokens=4)
    assert e.value.body["param"] == "model" and "chat template" in e.value.body["message"]


async def test_overload_is_429_with_retry_after(server):
    capacity = 2 * (MAX_RUNNING + MAX_QUEUE)
    url = server.base_url + "/completions"
    async with httpx.AsyncClient(timeout=60, limits=httpx.Limits(max_keepalive_connections=0)) as client:
        streams = [client.stream("POST", url, json=LONG) for _ in range(capacity)]
        responses = [await s.__aenter__() for s in streams]  # headers arrive once the request is queued
        assert [r.status_code for r in responses] == [200] * capacity
        r = await client.post(url, json={**LONG, "stream": False})
        assert r.status_code == 429 and r.headers["retry-after"] == "1"
        assert r.json()["error"]["type"] == "rate_limit_error"
        for s in streams:
            await s.__aexit__(None, None, None)
    deadline = time.monotonic() + 15
    while server.metrics()["cde_gateway_outstanding_requests"]:
        assert time.monotonic() < deadline
        await asyncio.sleep(0.2)


async def test_killed_worker_fails_its_requests_and_others_keep_serving(server, client):
    url = server.base_url + "/completions"
    victim_pid = server.worker_pids()[0]
    async with httpx.AsyncClient(timeout=60) as http:

        async def one():
            async with http.stream("POST", url, json={**LONG, "tokens_per_step": 4}) as r:
                events = read_events(r)
                first = await anext(events)
                assert first["choices"][0]["finish_reason"] is None
                await killed.wait()
                return await stream_outcome(events)

        killed = asyncio.Event()
        before = server.metrics()
        seen = before["cde_time_to_first_block_seconds_count"]
        tasks = [asyncio.create_task(one()) for _ in range(4)]
        # Every stream has its first block: the least-loaded routing put two on each worker.
        while server.metrics()["cde_time_to_first_block_seconds_count"] < seen + 4:
            await asyncio.sleep(0.1)
        os.kill(victim_pid, signal.SIGKILL)
        killed.set()
        results = await asyncio.wait_for(asyncio.gather(*tasks), 60)

    # The victim's two fail within 5 s; the survivor serves its two to the end.
    assert sorted(r[0] for r in results) == ["error", "error", "finished", "finished"], results
    for outcome, detail, seconds in results:
        assert (seconds < 5 and "worker-0" in detail) if outcome == "error" else detail == "length"

    status, health = server.health()
    assert status == 200
    assert [w["alive"] for w in health["workers"]] == [False, True]
    assert "exited" in health["workers"][0]["reason"]
    m = server.metrics()
    assert m['cde_worker_up{worker="worker-0"}'] == 0 and m['cde_worker_up{worker="worker-1"}'] == 1
    failed = 'cde_requests_finished_total{finish_reason="error"}'  # streams' failures are seen too
    assert m[failed] - before.get(failed, 0) == 2
    for _ in range(3):  # everything now lands on the survivor
        r = client.completions.create(
            model="tiny", prompt="still there?", max_tokens=8, temperature=0, extra_body={"tokens_per_step": 8}
        )
        assert r.choices[0].finish_reason == "length"


async def test_sigterm_drains_requests_and_leaves_no_processes(server):
    pids = [pid for pid in server.worker_pids() if pid_alive(pid)]
    assert pids
    body = {**LONG, "max_tokens": 120, "tokens_per_step": 8}
    async with (
        httpx.AsyncClient(timeout=60) as http,
        http.stream("POST", server.base_url + "/completions", json=body) as r,
    ):
        events = read_events(r)
        await anext(events)
        server.proc.send_signal(signal.SIGTERM)
        rest = [e async for e in events]
    assert rest[-1] == "[DONE]"
    assert rest[-2]["choices"][0]["finish_reason"] == "length"  # the in-flight request finished
    assert server.proc.wait(30) == 0
    deadline = time.monotonic() + 10
    while any(pid_alive(p) for p in pids):
        assert time.monotonic() < deadline, "orphan worker processes"
        time.sleep(0.1)
