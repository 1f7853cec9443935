"""The gateway's connection to one worker: a DEALER socket, the requests in flight on it, and
what its last heartbeat said. The worker end may be anything that listens on its endpoint: no
frame it sends can end the receive loop (each is handled under its own `except`, its error text
clipped), and frames over `MAX_FRAME_BYTES` are refused by the socket itself."""

from __future__ import annotations

import asyncio
import logging
import math
import subprocess
import time
import uuid
from collections.abc import AsyncIterator
from typing import Any

import zmq
import zmq.asyncio
from cde.gateway.model_info import ModelInfo
from cde.shared.curve import CurveClient
from cde.shared.limits import clip
from cde.shared.protocol import (
    PROTOCOL_VERSION,
    AbortRequest,
    BlockResult,
    CatalogPart,
    CatalogQuery,
    ConceptInfo,
    ConceptQuery,
    EngineResult,
    GenerateRequest,
    Heartbeat,
    Ping,
    PrefixResult,
    StepResult,
)
from cde.shared.wire import MAX_FRAME_BYTES, WireError, decode, encode

log = logging.getLogger("cde.gateway")


def _final(result: EngineResult) -> bool:
    return isinstance(result, BlockResult) and result.finished


class RequestHandle:
    """One generation in flight: its BlockResults arrive in order, the last one `finished`
    (with `stream_denoise`, each preceded by the StepResults of its block; with `stream_tokens`, by
    the PrefixResults of its block)."""

    def __init__(self, request_id: str, link: WorkerLink, client: str = ""):
        self.request_id = request_id
        self.client = client  # GenerateRequest.client: the router's per-client cap counts these
        self.link = link
        self.done = False
        self._queue: asyncio.Queue[EngineResult] = asyncio.Queue()

    def deliver(self, result: EngineResult) -> None:
        if _final(result):
            self._close()
        self._queue.put_nowait(result)

    async def results(self) -> AsyncIterator[EngineResult]:
        while True:
            result = await self._queue.get()
            yield result
            if _final(result):
                return

    def abort(self) -> None:
        """Stop generating (client went away): frees the worker's pages. No-op once finished.
        Synchronous, so it is safe in `finally` blocks of cancelled tasks."""
        if not self.done:
            self._close()
            self.link.send(AbortRequest(self.request_id))

    def _close(self) -> None:
        self.done = True
        self.link.inflight.pop(self.request_id, None)


class WorkerLink:
    def __init__(
        self,
        name: str,
        endpoint: str,
        ctx: zmq.asyncio.Context,
        identity: bytes,
        process: subprocess.Popen | None = None,
        curve: CurveClient | None = None,
    ):
        self.name, self.endpoint, self.process, self.curve = name, endpoint, process, curve
        self.sock = ctx.socket(zmq.DEALER)
        # A fixed identity keeps the worker's replies routable across reconnects.
        self.sock.setsockopt(zmq.IDENTITY, identity)
        self.sock.setsockopt(zmq.LINGER, 0)
        self.sock.setsockopt(zmq.MAXMSGSIZE, MAX_FRAME_BYTES)
        if curve is not None:
            curve.secure(self.sock)
        self.sock.connect(endpoint)
        self._outbox: asyncio.Queue[bytes] = asyncio.Queue()
        self.inflight: dict[str, RequestHandle] = {}
        self.queries: dict[str, asyncio.Future[ConceptInfo]] = {}
        self._catalog_part: asyncio.Future[CatalogPart] | None = None  # one fetch at a time (worker_catalogs)
        self.heartbeat: Heartbeat | None = None  # the last one: the worker's identity and load
        self.model: ModelInfo | None = None  # what it serves, as the routes read it
        self.alive = False
        self.last_seen = -math.inf
        self.progress_seen = -math.inf  # when its engine_beats last moved
        self.down_reason: str | None = "not connected yet"
        self._tasks: list[asyncio.Task] = []

    def start(self) -> None:
        self._tasks = [asyncio.create_task(self._send_loop()), asyncio.create_task(self._recv_loop())]
        if self.curve is not None:  # a refused handshake shows as the reason in /health, not as silence
            self._tasks.append(asyncio.create_task(self.curve.watch(self.sock, self.name, self.mark_down)))

    async def close(self) -> None:
        for t in self._tasks:
            t.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)
        self.sock.close()

    # ---- traffic ------------------------------------------------------------------------------
    def send(self, msg: Any) -> None:
        self._outbox.put_nowait(encode(msg))

    def ping(self) -> None:
        # A dead remote worker would otherwise collect an ever-growing backlog of pings.
        if self._outbox.empty():
            self.send(Ping(time.time()))

    def submit(self, req: GenerateRequest, frame: bytes) -> RequestHandle:
        """`frame`: `req` encoded (by `shared.wire.encode_all`, with the other choices of its API request)."""
        handle = RequestHandle(req.request_id, self, req.client)
        self.inflight[req.request_id] = handle
        self._outbox.put_nowait(frame)
        return handle

    async def query_concept(self, concept_id: int, k: int, timeout: float) -> ConceptInfo:
        query = ConceptQuery(uuid.uuid4().hex, concept_id, k)
        reply = asyncio.get_running_loop().create_future()
        self.queries[query.query_id] = reply
        self.send(query)
        try:
            return await asyncio.wait_for(reply, timeout)
        finally:
            self.queries.pop(query.query_id, None)

    async def fetch_catalog_part(self, offset: int, timeout: float) -> CatalogPart:
        reply: asyncio.Future[CatalogPart] = asyncio.get_running_loop().create_future()
        self._catalog_part = reply
        self.send(CatalogQuery(offset))
        try:
            return await asyncio.wait_for(reply, timeout)
        finally:
            self._catalog_part = None

    def fail_all(self, message: str, *, abort: bool = False) -> None:
        """Ends every request in flight with an explicit error; `abort` also tells the worker to
        stop them (it may still be alive: stalled, or we are shutting down)."""
        for rid, handle in list(self.inflight.items()):
            if abort:
                self.send(AbortRequest(rid))
            handle.deliver(BlockResult(rid, [], True, "error", error=message))
        for qid in list(self.queries):
            self._answer(ConceptInfo(qid, error=message))

    def _answer(self, info: ConceptInfo) -> None:
        reply = self.queries.get(info.query_id)
        if reply is not None and not reply.done():  # a late answer after a timeout is dropped
            reply.set_result(info)

    async def _send_loop(self) -> None:
        while True:
            await self.sock.send(await self._outbox.get())

    async def _recv_loop(self) -> None:
        while True:
            frame = await self.sock.recv()
            try:
                self._on_frame(frame)
            except WireError as exc:
                log.warning("%s: dropped bad frame: %s", self.name, exc)
            except Exception as exc:  # a bug on one frame: the heartbeats after it must still count
                log.error("%s: frame failed: %s", self.name, clip(repr(exc), 300))

    def _on_frame(self, frame: bytes) -> None:
        msg = decode(frame)
        if isinstance(msg, BlockResult | StepResult | PrefixResult):
            handle = self.inflight.get(msg.request_id)
            if handle is not None:
                handle.deliver(msg)
        elif isinstance(msg, ConceptInfo):
            self._answer(msg)
        elif isinstance(msg, CatalogPart):
            if self._catalog_part is not None and not self._catalog_part.done():
                self._catalog_part.set_result(msg)
        elif isinstance(msg, Heartbeat):
            self._on_heartbeat(msg)

    def _on_heartbeat(self, hb: Heartbeat) -> None:
        if hb.protocol_version != PROTOCOL_VERSION:
            self.mark_down(f"speaks protocol {hb.protocol_version}, gateway speaks {PROTOCOL_VERSION}")
            return
        if self.heartbeat is not None and hb.boot_id != self.heartbeat.boot_id:
            # Requests sent while the old process lay dead reach the new one on its connect: told
            # to stop, it does not run them for clients that got their error.
            self.fail_all(f"{self.name} restarted; the request was lost", abort=True)
        moved = self.heartbeat is None or (hb.boot_id, hb.engine_beats) != (
            self.heartbeat.boot_id,
            self.heartbeat.engine_beats,
        )
        self.heartbeat = hb
        self.model = ModelInfo.from_heartbeat(hb)
        self.last_seen = time.monotonic()
        if moved:
            self.progress_seen = self.last_seen
        # Answered Pings alone do not bring back a worker whose engine is stuck: its engine moves.
        if not self.alive and moved and self.exit_code() is None:
            log.info("%s is up (%s, %d running)", self.name, hb.model, hb.running)
            self.alive, self.down_reason = True, None

    # ---- liveness -----------------------------------------------------------------------------
    def exit_code(self) -> int | None:
        return self.process.poll() if self.process is not None else None

    def check(self, timeout: float, stall_timeout: float) -> None:
        code = self.exit_code()
        now = time.monotonic()
        if code is not None:
            self.mark_down(f"process exited with code {code}")
        elif self.alive and now - self.last_seen > timeout:
            self.mark_down(f"no heartbeat for {timeout:g}s")
        elif self.alive and now - self.progress_seen > stall_timeout:
            self.mark_down(f"its engine made no progress for {stall_timeout:g}s (a hung device or a stuck step)")

    def mark_down(self, reason: str) -> None:
        if self.alive:
            log.error("%s is down: %s", self.name, reason)
        self.alive, self.down_reason = False, reason
        # Maybe only stalled (SIGSTOP, a hung device): when it resumes it must not keep generating
        # for requests whose clients already got their error.
        self.fail_all(f"{self.name} failed: {reason}", abort=self.exit_code() is None)
