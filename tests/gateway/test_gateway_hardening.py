"""A real `cde gateway` in front of a fake worker (a ROUTER socket driven by this test) that sends
frames no worker of ours would: the gateway's receive loop survives every one of them, /health
stays 200 while heartbeats keep coming, and requests are still served."""

import asyncio
import threading
import time

import msgpack
import pytest
import zmq
from cde.gateway.router import Router
from cde.shared.protocol import BlockResult, GenerateRequest, Heartbeat, Ping
from cde.shared.wire import WireError, decode, encode

from tests.cde_procs import Gateway, free_port

HEARTBEAT_TIMEOUT = 2.0

POISON = [
    msgpack.packb({"type": {"a": 1}}),  # killed the receive loop: unhashable type
    msgpack.packb({"type": "x" * 3_000_000}),
    b"\x81\x91\x01\x02",  # an array as a map key
    msgpack.packb({"type": "Heartbeat", "boot_id": 1}),
    msgpack.packb({"type": "BlockResult", "request_id": "nobody", "token_ids": [1], "finished": "yes"}),
    encode(BlockResult("nobody-in-flight", [1, 2], True, "length")),
    b"\xc1",
]


class FakeWorker:
    """Answers Pings with Heartbeats and each GenerateRequest with one finished block (but keeps
    those whose id starts with `hold` running forever); sends whatever `inject` is given to the
    gateway it heard from."""

    def __init__(self, endpoint: str):
        self.sock = zmq.Context.instance().socket(zmq.ROUTER)
        self.sock.setsockopt(zmq.LINGER, 0)
        self.sock.bind(endpoint)
        self.gateway: bytes | None = None
        self.outbox: list[bytes] = []
        self.running = True
        self.thread = threading.Thread(target=self._loop, daemon=True)
        self.thread.start()

    def inject(self, frames: list[bytes]) -> None:
        self.outbox += frames

    def _loop(self) -> None:
        while self.running:
            while self.outbox and self.gateway is not None:
                self.sock.send_multipart([self.gateway, self.outbox.pop(0)])
            if not self.sock.poll(50):
                continue
            self.gateway, frame = self.sock.recv_multipart()
            try:
                msg = decode(frame)
            except WireError:
                continue
            if isinstance(msg, Ping):
                reply = Heartbeat("boot-1", "tiny", 1024, 100281, False, 2, 96, 4)
            elif isinstance(msg, GenerateRequest) and not msg.request_id.startswith("hold"):
                reply = BlockResult(msg.request_id, [9906, 1917], True, "length", prompt_tokens=len(msg.prompt_ids))
            else:
                continue
            self.sock.send_multipart([self.gateway, encode(reply)])

    def stop(self) -> None:
        self.running = False
        self.thread.join(5)
        self.sock.close()


@pytest.fixture
def fake_and_gateway():
    endpoint = f"tcp://127.0.0.1:{free_port()}"
    fake = FakeWorker(endpoint)
    gateway = Gateway("--worker", endpoint, "--heartbeat-timeout", str(HEARTBEAT_TIMEOUT))
    yield fake, gateway
    gateway.stop()
    fake.stop()


def test_no_frame_from_a_worker_stops_the_gateway(fake_and_gateway):
    fake, gateway = fake_and_gateway
    gateway.wait_health(200)
    fake.inject(POISON * 3)
    deadline = time.monotonic() + 3 * HEARTBEAT_TIMEOUT  # long enough for a dead loop to show
    while time.monotonic() < deadline:
        status, health = gateway.health()
        assert status == 200, (health, gateway.output[-3000:])
        time.sleep(0.2)
    r = gateway.complete()
    assert r.status_code == 200 and r.json()["choices"][0]["finish_reason"] == "length"
    gateway.wait_for("dropped bad frame")
    assert max(len(line) for line in gateway.lines) < 4000, "a worker's frame went whole into the log"


@pytest.mark.serial  # heartbeat timeouts of a second: alone on the machine
async def test_a_stalled_event_loop_does_not_mark_a_live_worker_down():
    endpoint = f"tcp://127.0.0.1:{free_port()}"
    fake = FakeWorker(endpoint)
    router = Router([endpoint], heartbeat_interval=0.2, heartbeat_timeout=1.0)
    await router.start()
    try:
        await router.wait_ready(10)
        req = GenerateRequest("hold-1", [1, 2])
        handle = router.submit(req, encode(req))
        time.sleep(2.5)  # the event loop blocked (a long parse, a GC pause) while the worker is fine
        await asyncio.sleep(1.0)
        # Never marked down, not even for a moment: that fails every request in flight on it.
        assert router.links[0].alive and not handle.done
        fake.stop()  # a worker that really went silent is still found
        await asyncio.sleep(2.0)
        assert not router.links[0].alive and "no heartbeat" in router.links[0].down_reason
    finally:
        await router.stop()
        fake.stop()
