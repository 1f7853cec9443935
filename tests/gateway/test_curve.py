"""CURVE between real `cde gateway` and `cde worker` processes over TCP: the authorized gateway is
served; a gateway with an unknown key, or the wrong worker key, gets an explicit 503 and a reason
in /health and in both logs, never a hung request."""

import re
import time

import pytest

from tests.cde_procs import CdeProcess, TinyWorker


@pytest.fixture(scope="module")
def keys(tmp_path_factory):
    d = tmp_path_factory.mktemp("keys")
    gen = CdeProcess("keys", "generate", str(d), "--name", "worker", "--name", "gateway", "--name", "intruder")
    assert gen.proc.wait(30) == 0, gen.output
    allowed = d / "allowed"
    allowed.mkdir()
    (allowed / "gateway.key").write_bytes((d / "gateway.key").read_bytes())
    return d


@pytest.fixture(scope="module")
def worker(tiny_dir, keys):
    w = TinyWorker(
        tiny_dir,
        "--curve-secret-key",
        str(keys / "worker.key_secret"),
        "--curve-authorized-keys",
        str(keys / "allowed"),
    )
    w.wait_for("worker ready .*CURVE")
    yield w
    assert w.stop() == 0


def test_keys_files(keys):
    assert (keys / "worker.key_secret").stat().st_mode & 0o077 == 0  # secret keys are owner-only
    assert "secret-key" not in (keys / "worker.key").read_text()
    assert "secret-key" in (keys / "worker.key_secret").read_text()


def test_authorized_gateway_is_served(worker, keys, gateways):
    g = gateways(
        "--worker",
        worker.endpoint,
        "--curve-secret-key",
        str(keys / "gateway.key_secret"),
        "--curve-server-key",
        str(keys / "worker.key"),
    )
    g.wait_health(200)
    r = g.complete()
    assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 8


def test_plain_gateway_cannot_talk_to_a_curve_worker(worker, gateways):
    g = gateways("--worker", worker.endpoint)
    time.sleep(2)  # several reconnect rounds: none may get through
    assert g.health()[0] == 503
    assert g.complete().json()["error"]["code"] == "no_worker"


@pytest.mark.parametrize(
    "secret, server, reason",
    [
        ("intruder.key_secret", "worker.key", "not in the worker's --curve-authorized-keys"),
        ("gateway.key_secret", "intruder.key", "--curve-server-key is not this worker's public key"),
    ],
)
def test_wrong_keys_get_no_service_and_a_reason(worker, keys, gateways, secret, server, reason):
    g = gateways(
        "--worker", worker.endpoint, "--curve-secret-key", str(keys / secret), "--curve-server-key", str(keys / server)
    )
    deadline = time.monotonic() + 20
    while reason not in (g.health()[1]["workers"][0].get("reason") or ""):
        assert time.monotonic() < deadline, g.health()
        time.sleep(0.1)
    assert g.health()[0] == 503
    r = g.complete(timeout=5)  # an explicit error at once, not a wait for the worker
    assert r.status_code == 503 and r.json()["error"]["code"] == "no_worker"
    g.wait_for(re.escape(reason))  # logged by the gateway
    if secret == "intruder.key_secret":
        intruder = (keys / "intruder.key").read_text().split('public-key = "')[1].split('"')[0]
        worker.wait_for(re.escape(f"rejected a gateway with CURVE public key {intruder}"))


def test_bad_key_files_are_reported_before_serving(keys, tmp_path):
    g = CdeProcess(
        "gateway",
        "--worker",
        "tcp://127.0.0.1:1",
        "--curve-secret-key",
        str(keys / "gateway.key"),
        "--curve-server-key",
        str(keys / "worker.key"),
    )
    assert g.proc.wait(30) == 1 and "holds no secret key" in g.output
    w = CdeProcess(
        "worker", "--curve-secret-key", str(keys / "worker.key_secret"), "--curve-authorized-keys", str(tmp_path)
    )
    assert w.proc.wait(30) == 1 and "no public keys" in w.output
