"""Run the gateway app under uvicorn, announce its URL once it is listening, and drain on SIGTERM.

Draining: the first SIGTERM/SIGINT keeps the socket open but answers every new request 503 (so a
load balancer or a retrying client moves on instead of meeting a refused connection), lets the
requests in flight finish for up to `shutdown_timeout` seconds, then ends the stragglers with an
explicit error and exits. A second signal exits at once."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time

import uvicorn
from starlette.responses import JSONResponse

from gateway.errors import ApiError

log = logging.getLogger("cde.gateway")

STRAGGLER_GRACE_S = 2.0  # after the drain deadline: time for the error events to reach clients


class DrainGate:
    """ASGI wrapper: counts HTTP requests in flight; once draining, refuses new ones with 503."""

    def __init__(self, app):
        self.app = app
        self.active = 0
        self.draining = False

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        if self.draining and scope["path"] != "/metrics":
            err = ApiError(503, "the server is shutting down", code="shutting_down")
            return await JSONResponse(err.body(), 503, headers={"Connection": "close"})(scope, receive, send)
        self.active += 1
        try:
            await self.app(scope, receive, send)
        finally:
            self.active -= 1


class DrainingServer(uvicorn.Server):
    def __init__(self, config: uvicorn.Config, gate: DrainGate):
        super().__init__(config)
        self.gate = gate

    def handle_exit(self, sig, frame) -> None:
        # Not recorded for re-raising: the drain is the whole of our answer to the signal.
        if self.gate.draining or not self.started:
            self.should_exit = self.force_exit = True
        else:
            log.warning("draining: refusing new requests, %d in flight", self.gate.active)
            self.gate.draining = True


async def _drain(server: DrainingServer, gate: DrainGate, router, timeout: float) -> None:
    while not gate.draining:
        await asyncio.sleep(0.05)
    deadline = time.monotonic() + timeout
    while gate.active and time.monotonic() < deadline and not server.should_exit:
        await asyncio.sleep(0.05)
    if gate.active:
        log.warning("shutdown timeout: failing %d request(s) still in flight", gate.active)
        router.fail_all("the server shut down before the request finished")
        deadline = time.monotonic() + STRAGGLER_GRACE_S
        while gate.active and time.monotonic() < deadline:
            await asyncio.sleep(0.05)
    server.should_exit = True


def serve_http(app, host: str, port: int, *, banner: str, shutdown_timeout: float = 30.0,
               log_level: str = "warning") -> int:
    """Blocks until a signal has drained the server; the caller's cleanup (stopping workers) runs
    afterwards. Returns 1 if startup failed or was interrupted."""
    gate = DrainGate(app)
    # log_config=None: uvicorn's loggers go through the process's JSON handler; the gateway
    # writes its own access log line (with the request id).
    config = uvicorn.Config(gate, host=host, port=port, log_level=log_level, lifespan="on",
                            timeout_graceful_shutdown=STRAGGLER_GRACE_S, log_config=None, access_log=False)
    server = DrainingServer(config, gate)

    async def main() -> int:
        task = asyncio.create_task(server.serve())
        while not server.started and not task.done():
            if server.should_exit:  # a signal while the workers load: do not wait for them
                task.cancel()
            await asyncio.sleep(0.05)
        if not server.started:
            with contextlib.suppress(asyncio.CancelledError):
                await task
            return 1
        bound = server.servers[0].sockets[0].getsockname()[1]
        shown = f"[{host}]" if ":" in host else host
        print(banner.format(url=f"http://{shown}:{bound}"), flush=True)
        drain = asyncio.create_task(_drain(server, gate, app.state.cde.router, shutdown_timeout))
        await task
        drain.cancel()
        return 0

    try:
        return asyncio.run(main())
    except (KeyboardInterrupt, SystemExit):
        return 1
