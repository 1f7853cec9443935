"""gateway/metrics.py + middleware.RequestLog: every HTTP response is counted by its status, so
errors show in /metrics (an app in-process, no worker: nothing here needs one)."""

import re

from cde.gateway.app import create_app
from cde.gateway.router import Router
from cde.gateway.state import ServerState
from starlette.testclient import TestClient


def responses(client: TestClient) -> dict[str, float]:
    text = client.get("/metrics").text
    return {s: float(v) for s, v in re.findall(r'^cde_http_responses_total\{status="(\d+)"\} (\S+)$', text, re.M)}


def test_responses_are_counted_by_status() -> None:
    with TestClient(create_app(ServerState(Router([]))), base_url="http://127.0.0.1") as client:
        before = responses(client)
        r = client.post("/v1/completions", content=b"{not json", headers={"content-type": "application/json"})
        assert r.status_code == 400
        assert client.get("/no/such/route").status_code == 404
        # no worker: a 503 from the route's error, counted like any other
        assert client.post("/v1/completions", json={"model": "m", "prompt": "hi"}).status_code == 503
        after = responses(client)
    assert after.get("400", 0) - before.get("400", 0) == 1
    assert after.get("404", 0) - before.get("404", 0) == 1
    assert after.get("503", 0) - before.get("503", 0) == 1
    assert after["200"] >= 1  # the first scrape
