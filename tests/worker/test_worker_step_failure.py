"""The worker's engine-failure path with real processes: a `cde gateway` and a worker process
over ZeroMQ, the worker with a planted fault (tests/faulty_worker.py). When one request makes
the launch of a pass fail (its values, its staging, its sampling), that request fails alone and
the others in flight finish with the official output. When the failure is not one request's
(reading a pass's picks: where a CUDA device error surfaces), every request in flight on that
worker fails (a stream gets an error event, a plain request a 500), its pages are freed, and the
same worker process keeps serving: a request sent afterwards decodes exactly as the official
generator does."""

import asyncio
import json
import time

import httpx
import pytest
import torch

from tests.cde_procs import Gateway, TinyWorker
from tests.faulty_worker import ADMIT_FAULT, LAUNCH_FAULT, STALL_FAULT, STALL_S, SYNC_FAULT

N_NEW, PER_STEP = 64, 8
PROMPT = torch.randint(0, 100000, (64,), generator=torch.Generator().manual_seed(11)).tolist()


@pytest.fixture(scope="module")
def cluster(tiny_dir):
    worker = TinyWorker(tiny_dir, "--max-running", "4", module="tests.faulty_worker")
    gateway = None
    try:
        worker.wait_for("worker ready")
        gateway = Gateway("--worker", worker.endpoint, "--heartbeat-timeout", "5", "--engine-stall-timeout", "3")
        gateway.wait_health(200)
        yield worker, gateway
    finally:
        for p in (gateway, worker):
            if p is not None:
                p.stop()


def _official(tiny_dir, per_step: int) -> list[int]:
    from tests.oracle import greedy_config, official_generator

    cfg = greedy_config(N_NEW, per_step)
    return official_generator(tiny_dir).generate_full(torch.tensor([PROMPT]), cfg).tokens[len(PROMPT) :].tolist()


@pytest.fixture(scope="module")
def official_tokens(tiny_dir) -> list[int]:
    return _official(tiny_dir, PER_STEP)


@pytest.fixture(scope="module")
def official_tokens_one_per_step(tiny_dir) -> list[int]:
    return _official(tiny_dir, 1)


def body(prompt: list[int], max_tokens: int, **extra) -> dict:
    return {"model": "tiny", "prompt": [prompt], "max_tokens": max_tokens, "temperature": 0, **extra}


async def stream_until_error(http: httpx.AsyncClient, url: str, started: asyncio.Event) -> dict:
    """A long stream: sets `started` at its first block, returns its error event."""
    async with http.stream("POST", url, json=body([5, 6, 7], 900, stream=True)) as r:
        assert r.status_code == 200
        async for line in r.aiter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            event = json.loads(line[6:])
            if "error" in event:
                return event["error"]
            started.set()
    raise AssertionError("the stream ended without an error")


async def stream_tokens(http: httpx.AsyncClient, url: str, started: asyncio.Event) -> list[int]:
    """The official prompt, streamed one token per step: its token ids (set `started` at the first)."""
    ids: list[int] = []
    payload = body(PROMPT, N_NEW, stream=True, return_token_ids=True)
    async with http.stream("POST", url, json=payload) as r:
        assert r.status_code == 200
        async for line in r.aiter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            event = json.loads(line[6:])
            assert "error" not in event, event
            ids += event["choices"][0].get("token_ids") or []
            started.set()
    return ids


async def test_a_request_that_fails_its_pass_fails_alone(cluster, official_tokens_one_per_step):
    """Issue 32: one request whose pass cannot be built (a planted fault in the launch of any pass
    that holds its step) fails alone; the two requests decoding beside it finish with the
    official output, and the worker never fails its whole batch."""
    worker, gateway = cluster
    url = gateway.url + "/v1/completions"
    failures = worker.output.count("engine step failed")
    async with httpx.AsyncClient(timeout=120) as http:
        started = [asyncio.Event(), asyncio.Event()]
        streams = [asyncio.create_task(stream_tokens(http, url, e)) for e in started]
        for e in started:
            await asyncio.wait_for(e.wait(), 60)
        faulty = await http.post(url, json=body([LAUNCH_FAULT, 1, 2], 16))
        tokens = await asyncio.wait_for(asyncio.gather(*streams), 120)
    assert faulty.status_code == 500 and "engine error on this request" in faulty.json()["error"]["message"]
    assert tokens == [official_tokens_one_per_step] * 2
    worker.wait_for("fails its pass alone", 10)
    assert worker.output.count("engine step failed") == failures


async def test_a_request_whose_admission_fails_gets_an_error_not_a_hang(cluster, official_tokens):
    """A bug in checking a request (not a ValueError refusal: a field without its rule raised
    KeyError once) answers that request with an error at once; the worker goes on serving."""
    worker, gateway = cluster
    url = gateway.url + "/v1/completions"
    before = gateway.metrics()
    async with httpx.AsyncClient(timeout=60) as http:
        faulty = await http.post(url, json=body([ADMIT_FAULT, 1, 2], 16))
        after = await http.post(url, json=body(PROMPT, N_NEW, tokens_per_step=PER_STEP, return_token_ids=True))
    assert faulty.status_code == 500 and "failed to admit" in faulty.json()["error"]["message"]
    worker.wait_for("admission failed", 10)
    assert after.status_code == 200 and after.json()["choices"][0]["token_ids"] == official_tokens
    # The failure is counted as one, and it had no first block: the latency samples are `after`'s.
    m, failed = gateway.metrics(), 'cde_requests_finished_total{finish_reason="error"}'
    first = "cde_time_to_first_block_seconds_count"
    assert m[failed] - before.get(failed, 0) == 1 and m[first] - before.get(first, 0) == 1


async def test_failed_step_fails_every_request_in_flight_and_the_worker_keeps_serving(cluster, official_tokens):
    fault = SYNC_FAULT
    worker, gateway = cluster
    url = gateway.url + "/v1/completions"
    failures = worker.output.count("engine step failed")
    async with httpx.AsyncClient(timeout=120) as http:
        started = [asyncio.Event(), asyncio.Event()]
        streams = [asyncio.create_task(stream_until_error(http, url, e)) for e in started]
        for e in started:
            await asyncio.wait_for(e.wait(), 60)
        faulty = await http.post(url, json=body([fault, 1, 2], 16))
        errors = await asyncio.wait_for(asyncio.gather(*streams), 60)

        assert faulty.status_code == 500 and faulty.json()["error"]["code"] == "generation_failed"
        for err in [faulty.json()["error"], *errors]:
            assert "engine error during generation" in err["message"], err
        assert worker.proc.poll() is None
        health = gateway.wait_health(200)
        assert [w["alive"] for w in health["workers"]] == [True]

        # The same process serves on, from a clean state, and decodes as the reference does.
        r = await http.post(url, json=body(PROMPT, N_NEW, tokens_per_step=PER_STEP, return_token_ids=True))
        assert r.status_code == 200, r.text
        assert r.json()["choices"][0]["token_ids"] == official_tokens
    # Every page back (the gateway learns it from the next heartbeats).
    deadline = time.monotonic() + 10
    while (m := gateway.metrics())["cde_worker_kv_pages_used"]:
        assert time.monotonic() < deadline, m
        time.sleep(0.2)
    assert m["cde_worker_running_requests"] == 0
    # One failed step, not one per step from then on.
    assert worker.output.count("engine step failed") == failures + 1, worker.output


async def test_a_stuck_engine_fails_its_requests_and_its_worker_is_back_once_it_moves(cluster, official_tokens):
    """The engine thread held (a hung device) while the I/O thread answers every Ping: after
    --engine-stall-timeout (3 s) its request fails, and the worker counts as down until its engine
    moves again; then it is told to drop that request, and serves the next one exactly."""
    worker, gateway = cluster
    url = gateway.url + "/v1/completions"
    aborted = worker.output.count('"finish_reason": "abort"')
    async with httpx.AsyncClient(timeout=60) as http:
        started = time.monotonic()
        stuck = await http.post(url, json=body([STALL_FAULT, 1, 2], 16))
        waited = time.monotonic() - started
        assert stuck.status_code >= 500 and "made no progress for 3s" in stuck.json()["error"]["message"]
        assert waited < STALL_S - 2  # failed by the gateway, not by the engine's coming back
        for _ in range(20):  # its answered Pings do not bring it back while its engine stands still
            assert gateway.health()[0] == 503
            await asyncio.sleep(0.1)
        gateway.wait_health(200, timeout=30)
        after = await http.post(url, json=body(PROMPT, N_NEW, tokens_per_step=PER_STEP, return_token_ids=True))
    assert after.status_code == 200 and after.json()["choices"][0]["token_ids"] == official_tokens
    deadline = time.monotonic() + 10
    while worker.output.count('"finish_reason": "abort"') == aborted:  # the stuck one's, when its engine moved
        assert time.monotonic() < deadline, worker.output[-4000:]
        time.sleep(0.1)
