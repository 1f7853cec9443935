"""The worker process: one engine behind a ZeroMQ ROUTER socket.

Engine thread: `receive (drain new requests/aborts without blocking) -> engine.step() -> send
BlockResults`, blocking only while idle. An I/O thread owns the sockets and answers Pings from
a stats snapshot, so liveness does not depend on how long one forward pass takes (a big batch on
a busy CPU, or a first CUDA-graph capture, can take seconds). The ROUTER side lets several
gateways share a worker: each request remembers which peer sent it.

A peer on the worker port need not be our gateway: no frame may end either thread. The I/O thread
decodes only small frames (a Ping is ~30 bytes) and hands large ones undecoded to the engine
thread, so that no request, however heavy, delays a heartbeat; every frame and message is
handled under its own `except`, and a request is checked against the model's bounds (and for a
request id already in flight) before the engine sees it.
"""

from __future__ import annotations

import logging
import os
import queue
import signal
import threading
import time
import traceback
import uuid
from pathlib import Path

import zmq
from cde.shared.curve import CurveServer
from cde.shared.limits import check_request, clip
from cde.shared.protocol import (
    AbortRequest,
    BlockResult,
    ConceptInfo,
    ConceptQuery,
    GenerateRequest,
    Heartbeat,
    Ping,
)
from cde.shared.wire import MAX_FRAME_BYTES, WireError, decode, encode
from cde.worker.engine import Engine

log = logging.getLogger("cde.worker")

IDLE_WAIT_S = 0.1  # how often an idle engine thread checks for shutdown
SMALL_FRAME_BYTES = 4096  # decoded on the I/O thread; larger frames are decoded by the engine thread
LOG_CHARS = 300  # of an error text quoting a peer's frame
PAGE_BYTES = os.sysconf("SC_PAGE_SIZE")


def resident_bytes() -> int:
    try:
        return int(Path("/proc/self/statm").read_text().split()[1]) * PAGE_BYTES
    except (OSError, IndexError, ValueError):
        return 0


class WorkerServer:
    def __init__(
        self,
        engine: Engine,
        bind: str,
        model_name: str | None = None,
        parent_pid: int | None = None,
        curve: CurveServer | None = None,
    ):
        self.engine = engine
        self.model_name = model_name or Path(engine.args.model).resolve().name
        self.parent_pid = parent_pid
        self.boot_id = uuid.uuid4().hex
        self.ctx = zmq.Context()
        self.sock = self.ctx.socket(zmq.ROUTER)
        self.sock.setsockopt(zmq.LINGER, 1000)
        self.sock.setsockopt(zmq.MAXMSGSIZE, MAX_FRAME_BYTES)  # a larger frame disconnects its sender
        self._auth = curve.secure(self.ctx, self.sock) if curve is not None else None
        self.sock.bind(bind)
        # Engine thread -> I/O thread: [peer, frame] to forward (zmq sockets are single-threaded).
        outbox = f"inproc://outbox-{self.boot_id}"
        self._out_pull = self.ctx.socket(zmq.PULL)
        self._out_pull.bind(outbox)
        self._out_push = self.ctx.socket(zmq.PUSH)
        self._out_push.connect(outbox)
        # [peer, message], or [peer, frame] still to decode (a large one)
        self.inbox: queue.SimpleQueue[tuple[bytes, object]] = queue.SimpleQueue()
        self.owner: dict[str, bytes] = {}  # request id -> identity of the gateway that sent it
        self.stopping = False
        self._io_done = False
        self._stats = engine.stats()
        self._rate_at = (time.monotonic(), 0)
        self._steps_per_s = 0.0

    def request_stop(self, *_):
        self.stopping = True

    # ---- engine thread ------------------------------------------------------------------------
    def serve_forever(self) -> None:
        io = threading.Thread(target=self._io_loop, name="cde-worker-io", daemon=True)
        io.start()
        while not self.stopping:
            self._receive(block=not self.engine.has_work())
            if self.engine.has_work():
                self._step()
            elif self.parent_pid is not None and os.getppid() != self.parent_pid:
                log.warning("parent process exited; stopping")
                break
        self._fail_all("worker is shutting down")
        self._io_done = True
        io.join()
        if self._auth is not None:
            self._auth.stop()
        self.ctx.term()

    def _receive(self, block: bool) -> None:
        try:
            item = self.inbox.get(timeout=IDLE_WAIT_S) if block else self.inbox.get_nowait()
            while True:
                self._handle(*item)
                item = self.inbox.get_nowait()
        except queue.Empty:
            pass

    def _handle(self, peer: bytes, msg) -> None:
        try:
            if isinstance(msg, bytes):
                msg = decode(msg)
            self._dispatch(peer, msg)
        except WireError as exc:
            log.warning("dropped bad frame: %s", exc)
        except Exception as exc:  # a bug on one message must not stop the engine thread
            log.error("message failed: %s", clip(repr(exc), LOG_CHARS))
        self._stats = self.engine.stats()

    def _dispatch(self, peer: bytes, msg) -> None:
        if isinstance(msg, GenerateRequest):
            self._admit(peer, msg)
        elif isinstance(msg, AbortRequest):
            if self.owner.get(msg.request_id) == peer:  # only its sender stops a request
                self.engine.abort(msg.request_id)
                del self.owner[msg.request_id]
        elif isinstance(msg, ConceptQuery):
            self._send(peer, self._concept_info(msg))

    def _admit(self, peer: bytes, req: GenerateRequest) -> None:
        rid = clip(req.request_id, 100)
        try:
            # A second request under an id in flight would share its pages and results: refused
            # alone, before the engine (whose step would fail for every request it runs).
            if req.request_id in self.owner:
                raise ValueError(f"request id {rid!r} is already in flight")
            check_request(req, self.engine.cfg.n_concepts)
            self.engine.add_request(req)
        except ValueError as exc:
            error = clip(str(exc), LOG_CHARS)
            log.warning("request refused", extra={"request_id": rid, "error": error})
            # Its error goes only to its sender; a duplicate's never reaches the original's owner.
            self._send(peer, BlockResult(req.request_id, [], True, "error", error=error))
            return
        log.info(
            "request admitted",
            extra={"request_id": rid, "prompt_tokens": len(req.prompt_ids), "max_tokens": req.max_tokens},
        )
        self.owner[req.request_id] = peer

    def _concept_info(self, query: ConceptQuery) -> ConceptInfo:
        # On the engine thread: it owns the model and the device.
        try:
            token_ids, scores = self.engine.concept_top_tokens(query.concept_id, query.k)
        except ValueError as exc:
            return ConceptInfo(query.query_id, error=str(exc))
        return ConceptInfo(query.query_id, token_ids, scores)

    def _step(self) -> None:
        try:
            results = self.engine.step()
        except Exception:  # a bug or device error: fail these requests, keep the worker serving
            log.error("engine step failed:\n%s", traceback.format_exc())
            self._fail_all("engine error during generation")
            return
        self._stats = self.engine.stats()
        for res in results:
            peer = self.owner.get(res.request_id)
            if isinstance(res, BlockResult) and res.finished:
                self.owner.pop(res.request_id, None)
                log.info("request finished", extra={"request_id": res.request_id, "finish_reason": res.finish_reason})
            if peer is not None:
                self._send(peer, res)

    def _fail_all(self, message: str) -> None:
        for rid, peer in list(self.owner.items()):
            self.engine.abort(rid)
            self._send(peer, BlockResult(rid, [], True, "error", error=message))
        self.owner.clear()
        self._stats = self.engine.stats()

    def _send(self, peer: bytes, msg) -> None:
        self._out_push.send_multipart([peer, encode(msg)])

    # ---- I/O thread ---------------------------------------------------------------------------
    def _io_loop(self) -> None:
        poller = zmq.Poller()
        poller.register(self.sock, zmq.POLLIN)
        poller.register(self._out_pull, zmq.POLLIN)
        while not self._io_done:
            events = dict(poller.poll(100))
            if self.sock in events:
                self._read_requests()
            if self._out_pull in events:
                self._forward_results()
        self._forward_results()  # the shutdown errors
        for s in (self.sock, self._out_pull, self._out_push):
            s.close()

    def _read_requests(self) -> None:
        while True:
            try:
                parts = self.sock.recv_multipart(zmq.NOBLOCK)
            except zmq.Again:
                return
            try:
                self._route(*parts)
            except WireError as exc:
                log.warning("dropped bad frame: %s", exc)
            except Exception as exc:  # not a [peer, frame] message, or a bug: the next frame still comes
                log.error("frame failed: %s", clip(repr(exc), LOG_CHARS))

    def _route(self, peer: bytes, frame: bytes) -> None:
        if len(frame) > SMALL_FRAME_BYTES:
            self.inbox.put((peer, frame))
            return
        msg = decode(frame)
        if isinstance(msg, Ping):
            self.sock.send_multipart([peer, encode(self._heartbeat())])
        else:
            self.inbox.put((peer, msg))

    def _forward_results(self) -> None:
        while True:
            try:
                # ROUTER drops messages to peers that went away instead of blocking: what we want.
                self.sock.send_multipart(self._out_pull.recv_multipart(zmq.NOBLOCK))
            except zmq.Again:
                return

    def _heartbeat(self) -> Heartbeat:
        stats = self._stats
        now = time.monotonic()
        t0, n0 = self._rate_at
        if now - t0 >= 0.5:
            self._steps_per_s = (stats["forward_passes"] - n0) / (now - t0)
            self._rate_at = (now, stats["forward_passes"])
        cfg = self.engine.cfg
        return Heartbeat(
            boot_id=self.boot_id,
            model=self.model_name,
            block_size=cfg.block_size,
            vocab_size=cfg.vocab_size,
            instruct=cfg.instruct,
            n_layers=cfg.n_layers,
            n_concepts=cfg.n_concepts,
            max_running=self.engine.args.max_running,
            running=stats["running"],
            waiting=stats["waiting"],
            pages_used=stats["pages_used"],
            pages_free=stats["pages_free"],
            steps_per_s=round(self._steps_per_s, 2),
            forward_passes=stats["forward_passes"],
            rss_bytes=resident_bytes(),
        )


def run_worker(
    engine: Engine,
    bind: str,
    model_name: str | None = None,
    parent_pid: int | None = None,
    curve: CurveServer | None = None,
) -> None:
    server = WorkerServer(engine, bind, model_name, parent_pid, curve)
    signal.signal(signal.SIGTERM, server.request_stop)
    signal.signal(signal.SIGINT, server.request_stop)
    print(f"CDE worker ready on {bind} ({server.model_name}{', CURVE' if curve else ''})", flush=True)
    server.serve_forever()
