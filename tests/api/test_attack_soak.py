"""A bounded soak on loopback: a real `cde serve` under the penetration test's attacks at once
(slow and idle connections, slow bodies, hang-ups, huge requests, foreign Hosts and doubled keys,
poison frames and duplicate request ids on the worker's own socket) while an honest client keeps
asking. /health stays 200, every honest request is answered in full, the worker never restarts,
and nothing in the logs is a 500 or a traceback."""

import contextlib
import json
import socket
import threading
import time
from urllib.parse import urlparse

import httpx
import msgpack
import pytest
import zmq
from cde.shared.protocol import GenerateRequest
from cde.shared.wire import encode

from tests.api_server import ServerProcess

KEY = "soak-key"
AUTH = {"Authorization": f"Bearer {KEY}"}
ATTACK_S = 15.0  # every attacker stops by then (several rounds of the 1-2 s timeouts), each loop bounded in count too
MAX_ROUNDS = 400

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def server(tiny_instruct_dir, tmp_path_factory):
    key_file = tmp_path_factory.mktemp("key") / "key"
    key_file.write_text(KEY)
    srv = ServerProcess(
        tiny_instruct_dir,
        "--api-key-file",
        str(key_file),
        "--served-model-name",
        "tiny",
        "--header-timeout",
        "1",
        "--body-timeout",
        "2",
        "--keep-alive-timeout",
        "1",
        "--max-connections",
        "64",
        "--heartbeat-timeout",
        "2",
        workers=1,
    )
    yield srv
    srv.stop()


class Attack:
    def __init__(self, server):
        url = urlparse(server.url)
        self.server, self.addr = server, (url.hostname, url.port)
        self.until = time.monotonic() + ATTACK_S
        self.threads: list[threading.Thread] = []

    def rounds(self):
        for i in range(MAX_ROUNDS):
            if time.monotonic() > self.until:
                return
            yield i

    def spawn(self, fn, *args) -> None:
        t = threading.Thread(target=self._guard, args=(fn, *args), daemon=True)
        t.start()
        self.threads.append(t)

    def _guard(self, fn, *args) -> None:
        # the server hanging up on an attacker is the point
        with contextlib.suppress(OSError, httpx.HTTPError, zmq.ZMQError):
            fn(*args)

    def raw(self, data: bytes, hold: float, drip: bool = False) -> None:
        """Sends `data`, then holds the connection for `hold` seconds, a byte every 0.2 s if `drip`."""
        with socket.create_connection(self.addr, timeout=5) as s:
            s.sendall(data)
            end = min(time.monotonic() + hold, self.until)
            while time.monotonic() < end:
                if drip:
                    s.sendall(b" ")
                time.sleep(0.2)

    # ---- the attacks --------------------------------------------------------------------------
    def slowloris(self) -> None:
        for _ in self.rounds():
            self._guard(self.raw, b"GET /health HTTP/1.1\r\nHost: 127.0.0.1\r\nX-a: ", 1.5)

    def slow_body(self) -> None:
        head = (
            b"POST /v1/completions HTTP/1.1\r\nHost: 127.0.0.1\r\nAuthorization: Bearer "
            + KEY.encode()
            + b"\r\nContent-Type: application/json\r\nContent-Length: 5000\r\n\r\n{"
        )
        for _ in self.rounds():
            self._guard(self.raw, head, 4.0, True)

    def hang_ups(self) -> None:
        head = (
            b"POST /v1/chat/completions HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
            b"Authorization: Bearer " + KEY.encode() + b'\r\nContent-Length: 900\r\n\r\n{"model": '
        )
        for _ in self.rounds():
            self._guard(self.raw, head, 0.05)
            time.sleep(0.1)

    def huge_requests(self) -> None:
        body = {"model": "tiny", "prompt": "hi", "n": 16, "steering": {"concepts": [1] * 500_000}}
        for _ in self.rounds():
            r = httpx.post(self.server.base_url + "/completions", json=body, headers=AUTH, timeout=60)
            assert r.status_code == 400
            time.sleep(0.2)

    def bad_headers(self) -> None:
        for i in self.rounds():
            headers = [("Host", "rebind.example")] if i % 2 else []
            headers += [("Authorization", f"Bearer {KEY}"), ("Authorization", "Bearer x")]
            r = httpx.get(self.server.base_url + "/models", headers=httpx.Headers(headers), timeout=10)
            assert r.status_code == 400
            time.sleep(0.05)

    def worker_socket(self, endpoint: str) -> None:
        """Poison frames, and a duplicate of one of our own requests' ids, straight to the worker."""
        sock = zmq.Context.instance().socket(zmq.DEALER)
        sock.setsockopt(zmq.LINGER, 0)
        sock.connect(endpoint)
        poison = [msgpack.packb({"type": {"a": 1}}), msgpack.packb({"type": "y" * 1_000_000}), b"\x81\x91\x01\x02"]
        try:
            for _ in self.rounds():
                body = {"model": "tiny", "prompt": "dup", "max_tokens": 64, "tokens_per_step": 4, "stream": True}
                with httpx.stream(
                    "POST", self.server.base_url + "/completions", json=body, headers=AUTH, timeout=60
                ) as r:
                    lines = r.iter_lines()
                    first = next(line for line in lines if line.startswith("data: "))
                    rid = json.loads(first[6:])["id"] + "-0-0"  # the gateway's id for choice 0
                    for frame in [*poison, encode(GenerateRequest(rid, [1, 2], max_tokens=4))]:
                        sock.send(frame)
                    for _ in lines:
                        pass
        finally:
            sock.close()


def honest(server) -> list[str]:
    """One round of an honest client; returns what went wrong, if anything."""
    problems = []
    status = httpx.get(server.url + "/health", timeout=10).status_code
    if status != 200:
        problems.append(f"/health {status}")
    r = httpx.post(
        server.base_url + "/completions",
        headers=AUTH,
        timeout=60,
        json={"model": "tiny", "prompt": "hello", "max_tokens": 8, "tokens_per_step": 4, "n": 2},
    )
    if r.status_code != 200 or [c["finish_reason"] for c in r.json()["choices"]] != ["length"] * 2:
        problems.append(f"completion {r.status_code} {r.text[:200]}")
    body = {
        "model": "tiny",
        "messages": [{"role": "user", "content": "hi"}],
        "max_tokens": 8,
        "stream": True,
        "attribution": True,
        "steering": {"concepts": [3], "strength": 100},
    }
    with httpx.stream("POST", server.base_url + "/chat/completions", json=body, headers=AUTH, timeout=60) as s:
        events = [line[6:] for line in s.iter_lines() if line.startswith("data: ")]
    chunks = [json.loads(e) for e in events[:-1]]
    # Judged on the parsed chunks, not on substrings: sampled text or a concept label may
    # contain "error", and a sampled end of text finishes with "stop" before max_tokens.
    finishes = [c["finish_reason"] for chunk in chunks for c in chunk.get("choices", []) if c.get("finish_reason")]
    errors = [chunk for chunk in chunks if "error" in chunk]
    if s.status_code != 200 or events[-1:] != ["[DONE]"] or errors or finishes not in (["length"], ["stop"]):
        problems.append(f"stream {s.status_code} {events[-2:]}")
    return problems


def test_attacks_leave_honest_clients_served(server):
    (worker,) = httpx.get(server.url + "/health", headers=AUTH).json()["workers"]
    attack = Attack(server)
    for _ in range(12):
        attack.spawn(attack.slowloris)
    for fn in (attack.slow_body, attack.slow_body, attack.hang_ups, attack.huge_requests, attack.bad_headers):
        attack.spawn(fn)
    attack.spawn(attack.worker_socket, worker["endpoint"])
    rounds, problems = 0, []
    while time.monotonic() < attack.until:
        problems += honest(server)
        rounds += 1
    for t in attack.threads:
        t.join(30)
    assert not any(t.is_alive() for t in attack.threads)
    assert not problems, problems
    assert rounds >= 2  # each round overlapped the attacks (a round takes ~2 s on an idle 2-core machine)
    (after,) = httpx.get(server.url + "/health", headers=AUTH).json()["workers"]
    assert after["pid"] == worker["pid"] and after["alive"] and after["outstanding"] == 0
    logs = "".join(server.output)
    assert "Traceback" not in logs and '"status": 500' not in logs
    assert '"status": 499' in logs and '"status": 408' in logs  # the attacks did reach the server
