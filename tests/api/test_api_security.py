"""Security defaults of `cde serve`: the API key, loopback-only listeners, and request content
kept out of the logs unless `--log-requests`."""

import argparse
import hmac
import os
import stat
import time
import uuid

import httpx
import pytest
from cde.gateway import middleware

from tests.api_server import ServerProcess

KEY = "s3cret-key"
MODEL = "tiny"


@pytest.fixture(scope="module")
def server(tiny_instruct_dir):
    srv = ServerProcess(tiny_instruct_dir, "--served-model-name", MODEL, workers=1, env={"CDE_API_KEY": KEY})
    yield srv
    srv.stop()


def completion(server, prompt: str, headers: dict):
    body = {"model": MODEL, "prompt": prompt, "max_tokens": 4, "tokens_per_step": 4}
    return httpx.post(server.base_url + "/completions", json=body, headers=headers, timeout=60)


@pytest.mark.parametrize(
    "header", [None, "Bearer wrong", f"Basic {KEY}", KEY, f"Bearer {KEY}x", "Bearer", f"Bearer {KEY[:-1]}"]
)
def test_bad_or_missing_key_is_401_in_openai_shape(server, header):
    headers = {"Authorization": header} if header is not None else {}
    for r in (completion(server, "hi", headers), httpx.get(server.base_url + "/models", headers=headers)):
        assert r.status_code == 401 and r.headers["www-authenticate"] == "Bearer"
        assert r.json() == {
            "error": {
                "message": "Incorrect API key provided.",
                "type": "invalid_request_error",  # OpenAI's body for a wrong key
                "param": None,
                "code": "invalid_api_key",
            }
        }


def test_right_key_works_and_probes_stay_open(server):
    assert completion(server, "hi", {"Authorization": f"Bearer {KEY}"}).status_code == 200
    assert completion(server, "hi", {"Authorization": f"bearer  {KEY}"}).status_code == 200
    for path in ("/health", "/metrics", "/openapi.json"):
        assert httpx.get(server.url + path).status_code == 200


def test_key_compare_is_constant_time(monkeypatch):
    calls, compare = [], hmac.compare_digest

    def recording(a, b):
        calls.append((a, b))
        return compare(a, b)

    monkeypatch.setattr(middleware.hmac, "compare_digest", recording)
    check = middleware.ApiKey(None, KEY)
    assert check.authorized(f"Bearer {KEY}".encode()) and not check.authorized(b"Bearer nope")
    # Fixed-length digests are compared, whatever the length of what was offered.
    assert len(calls) == 2 and all(len(a) == len(b) == 32 for a, b in calls)


def test_listeners_default_to_loopback(server):
    from cde.commands import gateway, serve, worker

    for module in (serve, gateway):
        p = argparse.ArgumentParser()
        module.add_arguments(p)
        assert p.parse_args(["--worker", "x"] if module is gateway else []).host == "127.0.0.1"
    p = argparse.ArgumentParser()
    worker.add_arguments(p)
    assert p.parse_args([]).bind.startswith("tcp://127.0.0.1:")
    assert server.url.startswith("http://127.0.0.1:")
    # `cde serve` talks to its workers over IPC sockets in a directory only its user can enter
    # (shown in /health to a key holder only).
    (w,) = httpx.get(server.url + "/health", headers={"Authorization": f"Bearer {KEY}"}).json()["workers"]
    assert w["endpoint"].startswith("ipc://")
    sockdir = os.path.dirname(w["endpoint"].removeprefix("ipc://"))
    assert stat.S_IMODE(os.stat(sockdir).st_mode) == 0o700


def _served_with_marker(server, headers) -> tuple[str, str]:
    marker = f"marker-{uuid.uuid4().hex}"
    r = completion(server, f"tell me about {marker}", headers)
    assert r.status_code == 200
    chat = httpx.post(
        server.base_url + "/chat/completions",
        headers=headers,
        timeout=60,
        json={"model": MODEL, "messages": [{"role": "user", "content": marker}], "max_tokens": 4, "tokens_per_step": 4},
    )
    assert chat.status_code == 200
    return marker, r.json()["id"]


def _wait_for_log(server, text: str) -> str:
    deadline = time.monotonic() + 10
    while text not in "".join(server.output) and time.monotonic() < deadline:
        time.sleep(0.1)
    return "".join(server.output)


def test_request_content_is_not_logged_by_default(server):
    marker, cmpl_id = _served_with_marker(server, {"Authorization": f"Bearer {KEY}"})
    logs = _wait_for_log(server, cmpl_id)
    assert cmpl_id in logs  # the request was logged...
    assert marker not in logs  # ...but not what it said


def test_log_requests_logs_content(tiny_instruct_dir):
    srv = ServerProcess(tiny_instruct_dir, "--served-model-name", MODEL, "--log-requests", workers=1)
    try:
        marker, cmpl_id = _served_with_marker(srv, {})
        logs = _wait_for_log(srv, marker)
    finally:
        srv.stop()
    assert marker in logs and cmpl_id in logs
