"""Logs, request ids and worker metrics of a real `cde serve`."""

import json
import threading
import time

import httpx
import pytest

from tests.api_server import ServerProcess

MODEL = "tiny"
GAUGES = (
    "cde_worker_waiting_requests",
    "cde_worker_running_requests",
    "cde_worker_kv_pages_used",
    "cde_worker_kv_pages_total",
)


@pytest.fixture(scope="module")
def server(tiny_instruct_dir):
    # One request decodes at a time, so a second one waits.
    srv = ServerProcess(tiny_instruct_dir, "--served-model-name", MODEL, "--max-running", "1", workers=1)
    yield srv
    srv.stop()


def json_logs(server) -> list[dict]:
    return [json.loads(line) for line in server.output if line.startswith("{")]


def test_request_id_ties_header_body_and_logs(server):
    r = httpx.post(
        server.base_url + "/completions",
        timeout=60,
        json={"model": MODEL, "prompt": "hi", "max_tokens": 2, "tokens_per_step": 2},
    )
    rid = r.json()["id"]
    assert r.headers["x-request-id"] == rid and rid.startswith("cmpl-")
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline:
        logs = [e for e in json_logs(server) if str(e.get("request_id", "")).startswith(rid)]
        if any(e["msg"] == "request" for e in logs):
            break
        time.sleep(0.1)
    access = [e for e in logs if e["msg"] == "request"]
    assert access and access[0]["status"] == 200 and access[0]["path"] == "/v1/completions"
    worker = {e["msg"] for e in logs if e["component"] == "worker"}
    assert {"request admitted", "request finished"} <= worker
    # Errors carry an id too.
    bad = httpx.post(server.base_url + "/completions", json={"model": MODEL}, timeout=60)
    assert bad.status_code == 400 and bad.headers["x-request-id"].startswith("req-")


def test_a_request_its_client_leaves_has_its_last_worker_line(server):
    """A hang-up mid-stream aborts the request on the worker, whose log ends it as every other."""
    body = {"model": MODEL, "prompt": "count", "max_tokens": 256, "tokens_per_step": 1, "stream": True}
    with httpx.stream("POST", server.base_url + "/completions", json=body, timeout=60) as r:
        rid = r.headers["x-request-id"]
        next(line for line in r.iter_lines() if line.startswith("data: "))  # the first block, then gone
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline:
        ends = [e for e in json_logs(server) if e["msg"] == "request finished" and e["request_id"].startswith(rid)]
        if ends:
            break
        time.sleep(0.1)
    assert [e["finish_reason"] for e in ends] == ["abort"]


def _gauges(server) -> dict[str, float]:
    m = server.metrics()
    return {g: m[f'{g}{{worker="worker-0"}}'] for g in GAUGES}


def test_worker_gauges_move_during_requests_and_return_to_zero(server):
    assert _gauges(server)["cde_worker_kv_pages_total"] > 0
    body = {"model": MODEL, "prompt": "count", "max_tokens": 128, "tokens_per_step": 1}
    results = []
    threads = [
        threading.Thread(
            target=lambda: results.append(
                httpx.post(server.base_url + "/completions", json=body, timeout=300).status_code
            )
        )
        for _ in range(2)
    ]
    for t in threads:
        t.start()
    seen = {g: 0.0 for g in GAUGES}
    while any(t.is_alive() for t in threads):
        for g, v in _gauges(server).items():
            seen[g] = max(seen[g], v)
        time.sleep(0.1)
    assert results == [200, 200]
    assert seen["cde_worker_running_requests"] == 1  # --max-running 1
    assert seen["cde_worker_waiting_requests"] >= 1
    assert seen["cde_worker_kv_pages_used"] >= 1
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline and any(
        v for g, v in _gauges(server).items() if g != "cde_worker_kv_pages_total"
    ):
        time.sleep(0.2)
    after = _gauges(server)
    assert after["cde_worker_running_requests"] == after["cde_worker_waiting_requests"] == 0
    assert after["cde_worker_kv_pages_used"] == 0 and after["cde_worker_kv_pages_total"] > 0


def _pass_counters(server) -> tuple[float, float]:
    m = server.metrics()
    return m['cde_worker_forward_passes{worker="worker-0"}'], m['cde_worker_device_idle_seconds{worker="worker-0"}']


def test_forward_passes_and_the_hosts_share_of_them(server):
    passes0, idle0 = _pass_counters(server)
    body = {"model": MODEL, "prompt": "count", "max_tokens": 16, "tokens_per_step": 1}
    assert httpx.post(server.base_url + "/completions", json=body, timeout=300).status_code == 200
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline and _pass_counters(server)[0] < passes0 + 16:
        time.sleep(0.1)
    passes, idle = _pass_counters(server)
    assert passes >= passes0 + 16  # one token per pass, and the prompt's
    # On the CPU a launch computes its pass: the "idle" between two is the host's work between them.
    assert idle > idle0
    time.sleep(1.5)  # the worker waits for work now: not the host's lateness, so not counted
    assert _pass_counters(server) == (passes, idle)


def test_every_log_line_is_json_with_component(server):
    # Last in this module: the requests above made the workers log too.
    lines = [line for line in server.output if line.strip()]
    banners = [line for line in lines if not line.startswith("{")]
    assert all(b.startswith(("CDE serving", "CDE worker ready")) for b in banners), banners
    logs = json_logs(server)
    assert logs and {entry["component"] for entry in logs} == {"gateway", "worker"}
    assert all({"ts", "level", "msg", "pid"} <= set(entry) for entry in logs)
