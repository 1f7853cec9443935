"""Faults with real processes and real signals: a worker that stops answering (SIGSTOP) and comes
back (SIGCONT), a worker that starts after its gateway and one restarted on the same endpoint,
and SIGTERM draining `cde serve` (new requests 503, in-flight ones finish or get an error)."""

import asyncio
import os
import signal
import socket
import subprocess
import sys

import httpx
import pytest

from tests.api_server import LONG, REPO, ServerProcess, pid_alive, read_events, stream_outcome
from tests.cde_procs import Gateway, TinyWorker, wait_for

HEARTBEAT_TIMEOUT, SHUTDOWN_TIMEOUT = 2, 3
ORIGIN = "https://app.example"  # --allowed-origins
SHORT = {"model": "tiny", "prompt": "y", "max_tokens": 120, "temperature": 0, "tokens_per_step": 8}


@pytest.fixture(scope="module")
def server(tiny_dir):
    srv = ServerProcess(
        tiny_dir,
        "--served-model-name",
        "tiny",
        "--heartbeat-timeout",
        str(HEARTBEAT_TIMEOUT),
        "--shutdown-timeout",
        str(SHUTDOWN_TIMEOUT),
        "--allowed-origins",
        ORIGIN,
    )
    yield srv
    srv.stop()


async def first_blocks(server, seen: float, n: int) -> None:
    """Until `n` more streams have their first block (each then sits on its worker)."""
    await asyncio.to_thread(
        wait_for, lambda: server.metrics()["cde_time_to_first_block_seconds_count"] >= seen + n, "first blocks"
    )


async def test_stopped_worker_is_failed_by_heartbeat_timeout_and_readmitted_after_sigcont(server):
    url = server.base_url + "/completions"
    victim = server.worker_pids()[0]
    stopped = asyncio.Event()
    async with httpx.AsyncClient(timeout=60) as http:

        async def one():
            async with http.stream("POST", url, json={**LONG, "tokens_per_step": 4}) as r:
                events = read_events(r)
                await anext(events)
                await stopped.wait()
                return await stream_outcome(events)

        seen = server.metrics()["cde_time_to_first_block_seconds_count"]
        tasks = [asyncio.create_task(one()) for _ in range(2)]  # least-loaded routing: one per worker
        await first_blocks(server, seen, 2)
        os.kill(victim, signal.SIGSTOP)
        try:
            stopped.set()
            results = sorted(await asyncio.wait_for(asyncio.gather(*tasks), 60))
            assert results[0][0] == "error" and "worker-0" in results[0][1] and "no heartbeat" in results[0][1]
            assert results[1][:2] == ("finished", "length")  # the other worker's, served to the end
            workers = server.health()[1]["workers"]
            assert [w["alive"] for w in workers] == [False, True] and "no heartbeat" in workers[0]["reason"]
            r = await http.post(url, json=SHORT)  # the other worker serves new requests
            assert r.status_code == 200 and r.json()["choices"][0]["finish_reason"] == "length"
        finally:
            os.kill(victim, signal.SIGCONT)

        await asyncio.to_thread(wait_for, lambda: server.health()[1]["workers"][0]["alive"], "re-admission")
        await asyncio.to_thread(
            wait_for,
            lambda: server.metrics()["cde_worker_running_requests"] == 0,
            "the resumed worker to drop the request that was failed while it was stopped",
        )
        # Both workers take requests again: two at once land one on each.
        bodies = [{**SHORT, "stream": True, "max_tokens": 200, "tokens_per_step": 2} for _ in range(2)]
        streams = [http.stream("POST", url, json=b) for b in bodies]
        responses = [await s.__aenter__() for s in streams]  # headers: the request is queued at its worker
        m = server.metrics()
        assert m['cde_gateway_outstanding_requests{worker="worker-0"}'] == 1
        assert m['cde_gateway_outstanding_requests{worker="worker-1"}'] == 1
        for r, s in zip(responses, streams):
            events = [e async for e in read_events(r)]
            assert events[-1] == "[DONE]" and events[-2]["choices"][0]["finish_reason"] == "length"
            await s.__aexit__(None, None, None)


async def test_sigterm_refuses_new_requests_drains_then_fails_stragglers(server):
    pids = server.worker_pids()
    url = server.base_url + "/completions"
    async with httpx.AsyncClient(timeout=60) as http:

        async def stream(body):
            async with http.stream("POST", url, json=body) as r:
                events = read_events(r)
                first = await anext(events)
                return [first] + [e async for e in events]

        seen = server.metrics()["cde_time_to_first_block_seconds_count"]
        # The long one needs ~900 steps, far beyond the shutdown timeout; the short one ~15.
        long = asyncio.create_task(stream(LONG))
        short = asyncio.create_task(stream({**SHORT, "stream": True}))
        await first_blocks(server, seen, 2)
        server.proc.send_signal(signal.SIGTERM)
        await asyncio.to_thread(wait_for, lambda: server.health()[0] == 503, "draining")
        r = await http.post(url, json=SHORT)
        assert r.status_code == 503 and r.json()["error"]["code"] == "shutting_down"
        # A page of --allowed-origins reads the 503 (a browser would report a network error).
        r = await http.post(url, json=SHORT, headers={"Origin": ORIGIN})
        assert r.status_code == 503 and r.headers["access-control-allow-origin"] == ORIGIN
        ask = {"Origin": ORIGIN, "Access-Control-Request-Method": "POST"}
        r = await http.options(url, headers=ask)
        assert r.status_code == 200 and r.headers["access-control-allow-origin"] == ORIGIN
        short_events, long_events = await asyncio.wait_for(asyncio.gather(short, long), 30)

    assert short_events[-1] == "[DONE]" and short_events[-2]["choices"][0]["finish_reason"] == "length"
    assert long_events[-1] == "[DONE]" and "shut down" in long_events[-2]["error"]["message"]
    assert server.proc.wait(30) == 0
    wait_for(lambda: not any(pid_alive(p) for p in pids), "the workers to exit (orphans?)", 10)


def free_tcp_endpoint() -> str:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return f"tcp://127.0.0.1:{s.getsockname()[1]}"


def start_worker(model_dir, endpoint: str) -> subprocess.Popen:
    cmd = [sys.executable, "-m", "cde", "worker", "--model", str(model_dir), "--bind", endpoint, "--device", "cpu"]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "CDE_LOG_LEVEL": "WARNING"}
    return subprocess.Popen(cmd, cwd=REPO, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)


async def test_late_worker_and_restarted_worker_are_admitted(tiny_dir):
    endpoint = free_tcp_endpoint()
    gateway = ServerProcess(
        tiny_dir,
        "--worker",
        endpoint,
        "--served-model-name",
        "tiny",
        "--heartbeat-timeout",
        str(HEARTBEAT_TIMEOUT),
        command="gateway",
    )
    workers = []
    url = gateway.base_url + "/completions"
    try:
        async with httpx.AsyncClient(timeout=60) as http:
            status, health = gateway.health()
            assert status == 503 and health["workers"][0]["alive"] is False
            r = await http.post(url, json=SHORT)
            assert r.status_code == 503 and r.json()["error"]["code"] == "no_worker"

            workers.append(start_worker(tiny_dir, endpoint))  # the gateway has been up all along
            await asyncio.to_thread(wait_for, lambda: gateway.health()[0] == 200, "the late worker", 60)
            r = await http.post(url, json=SHORT)
            assert r.status_code == 200 and r.json()["choices"][0]["finish_reason"] == "length"

            async with http.stream("POST", url, json=LONG) as r:
                events = read_events(r)
                await anext(events)
                workers[0].kill()  # no process handle in the gateway: only the heartbeats tell
                error = await asyncio.wait_for(anext(events), 30)
                assert "no heartbeat" in error["error"]["message"]
                assert await anext(events) == "[DONE]"
            assert gateway.health()[0] == 503

            workers.append(start_worker(tiny_dir, endpoint))  # the same endpoint, a new process
            await asyncio.to_thread(wait_for, lambda: gateway.health()[0] == 200, "the restarted worker", 60)
            r = await http.post(url, json=SHORT)
            assert r.status_code == 200 and r.json()["choices"][0]["finish_reason"] == "length"
    finally:
        for w in workers:
            w.kill()
            w.wait()
        assert gateway.stop() == 0


async def test_a_request_sent_to_a_dead_worker_is_not_run_by_its_restart(tiny_dir):
    """Sent while the old process lies dead but is not yet seen as dead, the request waits in
    the gateway's socket and reaches the new process when it connects; its client gets the error
    of the restart, and the new process is told to stop it rather than run it to its length."""
    first = TinyWorker(tiny_dir)
    port = first.endpoint.rsplit(":", 1)[1]
    gateway = Gateway("--worker", first.endpoint, "--served-model-name", "tiny", "--heartbeat-timeout", "60")
    second = None
    try:
        gateway.wait_health(200, timeout=60)
        first.proc.kill()
        first.proc.wait()
        url = gateway.url + "/v1/completions"
        async with httpx.AsyncClient(timeout=120) as http, http.stream("POST", url, json=LONG) as r:
            events = read_events(r)
            second = TinyWorker(tiny_dir, port=int(port))
            error = await asyncio.wait_for(anext(events), 90)
            assert "restarted; the request was lost" in error["error"]["message"]
        finished = second.wait_for(r'"msg": "request finished".*"finish_reason": "(\w+)"', timeout=60)
        assert finished.group(1) == "abort"
    finally:
        for p in (gateway, first, second):
            if p is not None:
                p.stop()
