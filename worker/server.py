"""The worker process loop: one engine behind a ZeroMQ ROUTER socket.

`receive (drain new requests/aborts without blocking) -> engine.step() -> send BlockResults`,
blocking on the socket only when the engine is idle. The ROUTER side lets several gateways share
a worker: every request remembers which peer sent it, and each Ping is answered to its sender.
"""

from __future__ import annotations

import logging
import os
import signal
import time
import traceback
import uuid
from pathlib import Path

import zmq

from shared.protocol import AbortRequest, BlockResult, GenerateRequest, Heartbeat, Ping
from shared.wire import WireError, decode, encode
from worker.engine import Engine

log = logging.getLogger("cde.worker")

IDLE_POLL_MS = 100  # how often an idle worker checks for shutdown


class WorkerServer:
    def __init__(self, engine: Engine, bind: str, model_name: str | None = None, parent_pid: int | None = None):
        self.engine = engine
        self.model_name = model_name or Path(engine.args.model).resolve().name
        self.parent_pid = parent_pid
        self.boot_id = uuid.uuid4().hex
        self.ctx = zmq.Context()
        self.sock = self.ctx.socket(zmq.ROUTER)
        self.sock.setsockopt(zmq.LINGER, 1000)
        self.sock.bind(bind)
        self.owner: dict[str, bytes] = {}  # request id -> identity of the gateway that sent it
        self.stopping = False
        self._rate_at = (time.monotonic(), 0)
        self._steps_per_s = 0.0

    def request_stop(self, *_):
        self.stopping = True

    # ---- loop ---------------------------------------------------------------------------------
    def serve_forever(self) -> None:
        while not self.stopping:
            busy = self.engine.has_work()
            if self.sock.poll(0 if busy else IDLE_POLL_MS):
                self._drain()
            if self.engine.has_work():
                self._step()
            elif self.parent_pid is not None and os.getppid() != self.parent_pid:
                log.warning("parent process exited; stopping")
                break
        self._fail_all("worker is shutting down")
        self.sock.close()
        self.ctx.term()

    def _drain(self) -> None:
        while True:
            try:
                peer, frame = self.sock.recv_multipart(zmq.NOBLOCK)
            except zmq.Again:
                return
            except ValueError:  # not a [peer, frame] message
                continue
            try:
                self._handle(peer, decode(frame))
            except WireError as exc:
                log.warning("dropped bad frame: %s", exc)

    def _handle(self, peer: bytes, msg) -> None:
        if isinstance(msg, GenerateRequest):
            try:
                self.engine.add_request(msg)
            except ValueError as exc:
                self._send(peer, BlockResult(msg.request_id, [], True, "error", error=str(exc)))
                return
            self.owner[msg.request_id] = peer
        elif isinstance(msg, AbortRequest):
            self.engine.abort(msg.request_id)
            self.owner.pop(msg.request_id, None)
        elif isinstance(msg, Ping):
            self._send(peer, self._heartbeat())

    def _step(self) -> None:
        try:
            results = self.engine.step()
        except Exception:  # a bug or device error must not take the other requests' gateway down
            log.error("engine step failed:\n%s", traceback.format_exc())
            self._fail_all("engine error during generation")
            return
        for res in results:
            peer = self.owner.get(res.request_id)
            if res.finished:
                self.owner.pop(res.request_id, None)
            if peer is not None:
                self._send(peer, res)

    def _fail_all(self, message: str) -> None:
        for rid, peer in list(self.owner.items()):
            self.engine.abort(rid)
            self._send(peer, BlockResult(rid, [], True, "error", error=message))
        self.owner.clear()

    def _send(self, peer: bytes, msg) -> None:
        # ROUTER drops messages to peers that went away instead of blocking: what we want.
        self.sock.send_multipart([peer, encode(msg)])

    def _heartbeat(self) -> Heartbeat:
        stats = self.engine.stats()
        now = time.monotonic()
        t0, n0 = self._rate_at
        if now - t0 >= 0.5:
            self._steps_per_s = (stats["forward_passes"] - n0) / (now - t0)
            self._rate_at = (now, stats["forward_passes"])
        cfg = self.engine.cfg
        return Heartbeat(
            boot_id=self.boot_id, model=self.model_name, block_size=cfg.block_size,
            vocab_size=cfg.vocab_size, instruct=cfg.instruct, n_layers=cfg.n_layers,
            n_concepts=cfg.n_concepts, max_running=self.engine.args.max_running,
            running=stats["running"], waiting=stats["waiting"], pages_used=stats["pages_used"],
            pages_free=stats["pages_free"], steps_per_s=round(self._steps_per_s, 2),
            forward_passes=stats["forward_passes"],
        )


def run_worker(engine: Engine, bind: str, model_name: str | None = None, parent_pid: int | None = None) -> None:
    server = WorkerServer(engine, bind, model_name, parent_pid)
    signal.signal(signal.SIGTERM, server.request_stop)
    signal.signal(signal.SIGINT, server.request_stop)
    print(f"CDE worker ready on {bind} ({server.model_name})", flush=True)
    server.serve_forever()
