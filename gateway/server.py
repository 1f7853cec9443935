"""Run the gateway app under uvicorn and announce its URL once it is listening."""

from __future__ import annotations

import asyncio
import signal

import uvicorn


def _exit_on_sigterm(signum, frame):
    raise SystemExit(0)


def serve_http(app, host: str, port: int, *, banner: str, shutdown_timeout: float = 30.0,
               log_level: str = "warning") -> int:
    """Blocks until SIGINT/SIGTERM. uvicorn drains in-flight requests (up to `shutdown_timeout`
    seconds) and then re-raises the signal, which lands here as KeyboardInterrupt/SystemExit so
    the caller's cleanup (stopping workers) still runs. Returns 1 if startup failed."""
    signal.signal(signal.SIGTERM, _exit_on_sigterm)
    # log_config=None: uvicorn's loggers go through the process's JSON handler; the gateway
    # writes its own access log line (with the request id).
    config = uvicorn.Config(app, host=host, port=port, log_level=log_level, lifespan="on",
                            timeout_graceful_shutdown=shutdown_timeout, log_config=None, access_log=False)
    server = uvicorn.Server(config)

    async def main() -> int:
        task = asyncio.create_task(server.serve())
        while not server.started and not task.done():
            await asyncio.sleep(0.05)
        if server.started:
            bound = server.servers[0].sockets[0].getsockname()[1]
            shown = f"[{host}]" if ":" in host else host
            print(banner.format(url=f"http://{shown}:{bound}"), flush=True)
        await task
        return 0 if server.started else 1

    try:
        return asyncio.run(main())
    except (KeyboardInterrupt, SystemExit):
        return 0
