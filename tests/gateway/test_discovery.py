"""`cde gateway --worker-dns NAME:PORT` against real worker processes: the gateway connects to
what NAME resolves to, serves through it, and lives through the worker going away and coming back
(several A records at once: scripts/netns_test.sh)."""

import re

from tests.cde_procs import Gateway, TinyWorker, free_port


def start_worker(tiny_dir, port) -> TinyWorker:
    w = TinyWorker(tiny_dir, port=port)
    w.wait_for("worker ready")
    return w


def test_gateway_discovers_workers_by_dns(tiny_dir):
    port = free_port()
    gateway = Gateway("--worker-dns", f"localhost:{port}", "--dns-interval", "0.5", "--heartbeat-timeout", "2")
    worker = start_worker(tiny_dir, port)
    try:
        health = gateway.wait_health(200)
        assert [(w["name"], w["endpoint"]) for w in health["workers"]] == [
            (f"127.0.0.1:{port}", f"tcp://127.0.0.1:{port}")
        ]
        gateway.wait_for(re.escape(f"discovered worker tcp://127.0.0.1:{port} (localhost)"))
        assert gateway.complete().status_code == 200

        assert worker.stop() == 0
        gateway.wait_health(503)
        assert gateway.complete().json()["error"]["code"] == "no_worker"

        worker = start_worker(tiny_dir, port)  # same address: the kept link reconnects
        assert len(gateway.wait_health(200)["workers"]) == 1
        assert gateway.complete().status_code == 200
    finally:
        worker.stop()
        assert gateway.stop() == 0


def test_unresolvable_name_is_logged_and_requests_fail_fast():
    gateway = Gateway("--worker-dns", "no-such-worker.invalid:5555", "--dns-interval", "0.5")
    try:
        gateway.wait_for(r"cannot resolve workers at no-such-worker\.invalid")
        status, health = gateway.health()
        assert status == 503 and health["workers"] == []
        r = gateway.complete(timeout=5)  # an explicit error at once, not a wait for some worker
        assert r.status_code == 503 and r.json()["error"]["code"] == "no_worker"
    finally:
        assert gateway.stop() == 0
