"""Run the gateway app under uvicorn, announce its URL once it is listening, and drain on SIGTERM.

Draining: the first SIGTERM/SIGINT keeps the socket open but answers every new request 503 (so a
load balancer or a retrying client moves on instead of meeting a refused connection), lets the
requests in flight finish for up to `shutdown_timeout` seconds, then ends the stragglers with an
explicit error and exits. A second signal ends them at once and exits, as does a signal during the
startup (uvicorn's, or one `Interrupts` recorded before it); `serve_http` then raises
KeyboardInterrupt (the command says `interrupted`).

uvicorn's HTTP/1.1 protocol is extended with what it lacks against slow or many clients: a
deadline for a request's headers, a cap on open connections (`gateway.http_limits`), and no
connection left open after an answer given before the request's body arrived."""

from __future__ import annotations

import asyncio
import contextlib
import functools
import json
import logging
import signal
import time
import uuid
from collections.abc import Awaitable, Callable
from types import FrameType
from typing import TYPE_CHECKING, Any

import h11
import uvicorn
from cde.gateway.errors import ApiError
from cde.gateway.http_limits import HttpLimits
from cde.gateway.metrics import Metrics
from cde.gateway.middleware import RequestLog, record_response, with_cors
from starlette.responses import JSONResponse
from starlette.types import ASGIApp, Message, Receive, Scope, Send
from uvicorn.protocols.http.h11_impl import H11Protocol

if TYPE_CHECKING:
    from cde.gateway.interrupts import Interrupts
    from cde.gateway.router import Router
    from starlette.applications import Starlette

log = logging.getLogger("cde.gateway")

MAX_HEAD_BYTES = 16 << 10  # a request's line and headers (h11 bounds an incomplete head by it too)
STRAGGLER_GRACE_S = 2.0  # after the drain deadline: time for the error events to reach clients


class DrainGate:
    """ASGI wrapper: counts HTTP requests in flight; once draining, refuses new ones with 503.
    Refuses a request whose line and headers pass MAX_HEAD_BYTES with 431, before anything."""

    def __init__(self, app: ASGIApp, metrics: Metrics, limits: HttpLimits) -> None:
        self.app = app
        self.metrics = metrics
        self.limits = limits  # its refusals name an allowed page's origin too
        self.active = 0
        self.draining = False

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "lifespan":
            return await self.app(scope, receive, functools.partial(_startup_failure_in_one_line, send))
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        err = None
        if _head_bytes(scope) > MAX_HEAD_BYTES:
            err = ApiError(431, f"the request line and headers exceed {MAX_HEAD_BYTES} bytes", code="headers_too_large")
        elif self.draining and scope["path"] != "/metrics":
            err = ApiError(503, "the server is shutting down", code="shutting_down")
        if err is not None:
            refusal = JSONResponse(err.body(), err.status, headers={"Connection": "close"})
            return await RequestLog(with_cors(refusal, self.limits), self.metrics)(scope, receive, send)
        self.active += 1
        try:
            await self.app(scope, receive, send)
        finally:
            self.active -= 1


def _head_bytes(scope: Scope) -> int:
    """The request line and headers as parsed (h11 bounds a head still incomplete by
    MAX_HEAD_BYTES; one that completes within a read, which asyncio makes up to 256 KiB, it takes
    whole, whatever its line endings)."""
    line = len(scope["method"]) + len(scope.get("raw_path") or b"") + len(scope.get("query_string") or b"") + 12
    return line + sum(len(name) + len(value) + 4 for name, value in scope["headers"])


async def _startup_failure_in_one_line(send: Send, message: Message) -> None:
    """Starlette reports a failed startup (a worker that died loading its model) with the whole
    traceback, which uvicorn logs; the reason is its last line."""
    if message["type"] == "lifespan.startup.failed" and message.get("message"):
        message = {**message, "message": message["message"].strip().splitlines()[-1]}
    await send(message)


class GuardedH11Protocol(H11Protocol):
    """A connection must deliver each request's line and headers within `header_timeout` of its
    first byte (or of the connection's start): else a 408 if it sent something, and closed.
    Beyond `max_connections` open at once, or `max_connections_per_client` from its address, a
    connection's request gets a 503 and it is closed. Both answers are logged and counted like
    every other response."""

    def __init__(self, *args: Any, limits: HttpLimits, metrics: Metrics | None = None, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.limits, self.metrics = limits, metrics
        self.peer_host = ""
        self._head_timer: asyncio.TimerHandle | None = None
        self._head_bytes = False

    def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]  # as H11Protocol's
        super().connection_made(transport)
        peer = transport.get_extra_info("peername")
        self.peer_host = peer[0] if isinstance(peer, tuple) else str(peer)
        # A scan of the open connections (at most a few thousand) per new one, on connect only.
        same = sum(getattr(c, "peer_host", None) == self.peer_host for c in self.connections)
        if len(self.connections) > self.limits.max_connections or same > self.limits.per_client_connections:
            self.app = RequestLog(with_cors(_too_many_connections, self.limits), self.metrics)
        self.app = self._saying_close(self.app)
        self._arm()

    def data_received(self, data: bytes) -> None:
        super().data_received(data)
        if self.conn.their_state is h11.IDLE:  # a request's head still (or newly) incomplete
            self._head_bytes = True
            if self._head_timer is None:
                self._arm()
        else:
            self._disarm()

    def connection_lost(self, exc: Exception | None) -> None:
        self._disarm()
        super().connection_lost(exc)

    def on_response_complete(self) -> None:
        super().on_response_complete()
        if self.conn.their_state is h11.SEND_BODY and not self.transport.is_closing():
            # Answered before its body arrived (a 401, a 413 from Content-Length, a 404): the rest
            # is of no use, and each byte of it would re-arm uvicorn's keep-alive timer, so a
            # client trickling it held the connection past every timeout.
            self.transport.close()

    def _saying_close(self, app: ASGIApp) -> ASGIApp:
        """A response that starts before its request's body is in says `Connection: close`, as
        `on_response_complete` closes the connection after it: a client that kept the connection
        for its next request would meet a reset there."""

        async def marked_app(scope: Scope, receive: Receive, send: Send) -> None:
            async def marked(message: Message) -> None:
                if message["type"] == "http.response.start" and self.conn.their_state is h11.SEND_BODY:
                    headers = list(message.get("headers", []))
                    if all(name.lower() != b"connection" for name, _ in headers):
                        message = {**message, "headers": [*headers, (b"connection", b"close")]}
                await send(message)

            await app(scope, receive, marked)

        return marked_app

    def _arm(self) -> None:
        self._head_timer = self.loop.call_later(self.limits.header_timeout, self._head_timeout)

    def _disarm(self) -> None:
        if self._head_timer is not None:
            self._head_timer.cancel()
        self._head_timer, self._head_bytes = None, False

    def _head_timeout(self) -> None:
        self._head_timer = None
        if self.conn.their_state is not h11.IDLE or self.transport.is_closing():
            return
        if self._head_bytes:  # written raw: h11 answers no request it has not parsed
            err = ApiError(
                408,
                f"the request headers did not arrive within {self.limits.header_timeout:g} s",
                None,
                "request_timeout",
            )
            body = json.dumps(err.body()).encode()
            self.transport.write(
                b"HTTP/1.1 408 Request Timeout\r\ncontent-type: application/json\r\n"
                b"connection: close\r\ncontent-length: %d\r\n\r\n%s" % (len(body), body)
            )
            started = time.monotonic() - self.limits.header_timeout
            record_response(self.metrics, f"req-{uuid.uuid4().hex}", "-", "-", 408, started)
        self.transport.close()


async def _too_many_connections(scope: Scope, receive: Receive, send: Send) -> None:
    err = ApiError(
        503,
        "too many connections, retry later",
        None,
        "too_many_connections",
        {"Connection": "close", "Retry-After": "1"},
    )
    await err.response()(scope, receive, send)


class DrainingServer(uvicorn.Server):
    def __init__(self, config: uvicorn.Config, gate: DrainGate):
        super().__init__(config)
        self.gate = gate
        self.interrupted = False  # a signal cut the startup or the drain short

    def handle_exit(self, sig: int, frame: FrameType | None) -> None:
        # Not recorded for re-raising: the drain is the whole of our answer to the signal.
        if self.gate.draining or not self.started:
            # `serve_http` cancels a startup, `_drain` fails the requests in flight. Not
            # force_exit: uvicorn would skip the app's shutdown, and the task left waiting for it
            # would end in a CancelledError traceback.
            self.interrupted = self.should_exit = True
        else:
            log.warning("draining: refusing new requests, %d in flight", self.gate.active)
            self.gate.draining = True


async def _drain(server: DrainingServer, gate: DrainGate, router: Router, timeout: float) -> None:
    while not gate.draining:
        await asyncio.sleep(0.05)
    deadline = time.monotonic() + timeout
    while gate.active and time.monotonic() < deadline and not server.interrupted:
        await asyncio.sleep(0.05)
    if gate.active:
        why = "interrupted" if server.interrupted else "shutdown timeout"
        log.warning("%s: failing %d request(s) still in flight", why, gate.active)
        router.fail_all("the server shut down before the request finished")
        deadline = time.monotonic() + STRAGGLER_GRACE_S
        while gate.active and time.monotonic() < deadline:
            await asyncio.sleep(0.05)
    server.should_exit = True


def serve_http(
    app: Starlette,
    host: str,
    port: int,
    *,
    banner: str,
    shutdown_timeout: float = 30.0,
    log_level: str = "warning",
    warm_up: Callable[[str], Awaitable[None]] | None = None,
    interrupts: Interrupts | None = None,
) -> int:
    """Blocks until a signal has drained the server; the caller's cleanup (stopping workers) runs
    afterwards. Returns 1 if startup failed; raises KeyboardInterrupt if a signal cut the startup
    or the drain short. `warm_up(url)` runs once the port is bound, before the banner (requests
    through the real HTTP path: the first client's is not the first)."""
    limits: HttpLimits = app.state.limits
    gate = DrainGate(app, app.state.cde.metrics, limits)
    # log_config=None: uvicorn's loggers go through the process's JSON handler; the gateway
    # writes its own access log line (with the request id).
    config = uvicorn.Config(
        gate,
        host=host,
        port=port,
        log_level=log_level,
        lifespan="on",
        timeout_graceful_shutdown=STRAGGLER_GRACE_S,  # type: ignore[arg-type]  # uvicorn takes a float
        log_config=None,
        access_log=False,
        http=functools.partial(GuardedH11Protocol, limits=limits, metrics=app.state.cde.metrics),  # type: ignore[arg-type]  # a protocol factory
        timeout_keep_alive=limits.keep_alive_timeout,  # type: ignore[arg-type]  # uvicorn takes a float
        h11_max_incomplete_event_size=MAX_HEAD_BYTES,
    )
    server = DrainingServer(config, gate)

    def stop_serving() -> bool:  # the router's, once every worker `cde serve` started has exited
        if not server.started or gate.draining:
            return False
        server.handle_exit(signal.SIGTERM, None)  # a drain, as on a process manager's stop
        return True

    app.state.cde.router.stop_serving = stop_serving

    async def serve() -> None:
        # uvicorn ends a failed startup (a port in use, a worker that died) with sys.exit: caught
        # here, inside the task, or asyncio logs the task's SystemExit with a traceback.
        with contextlib.suppress(SystemExit):
            await server.serve()

    async def main() -> int:
        task = asyncio.create_task(serve())
        while not server.started and not task.done():
            if interrupts is not None and interrupts.received:  # before uvicorn's handlers took over
                server.interrupted = server.should_exit = True
            if server.should_exit:  # a signal while the workers load: do not wait for them
                task.cancel()
            await asyncio.sleep(0.05)
        if not server.started:
            with contextlib.suppress(asyncio.CancelledError):
                await task
            if server.interrupted:
                # The app's startup, cancelled with the loop, would report itself failed with a
                # CancelledError: the interrupt is the caller's to report.
                logging.getLogger("uvicorn.error").disabled = True
            return 1
        bound = server.servers[0].sockets[0].getsockname()[1]
        shown = f"[{host}]" if ":" in host else host
        if warm_up is not None:
            await warm_up(f"http://{shown}:{bound}")
        print(banner.format(url=f"http://{shown}:{bound}"), flush=True)
        drain = asyncio.create_task(_drain(server, gate, app.state.cde.router, shutdown_timeout))
        await task
        drain.cancel()
        return 0

    try:
        code = asyncio.run(main())
    except SystemExit:
        return 1
    if server.interrupted:
        raise KeyboardInterrupt
    return code
