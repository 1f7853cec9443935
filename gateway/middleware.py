"""ASGI middleware around every route: the request id and access log with the security headers,
the Host check, the body's size limit and deadline, and the API key. Each answers in the OpenAI
error shape."""

from __future__ import annotations

import asyncio
import hashlib
import hmac
import logging
import time
import uuid

from cde.gateway.errors import ApiError
from cde.gateway.http_limits import HttpLimits
from cde.gateway.metrics import Metrics
from starlette.middleware.cors import CORSMiddleware
from starlette.types import ASGIApp, Message, Receive, Scope, Send

log = logging.getLogger("cde.gateway")

# Probes, scrapes and the playground's files stay open when an API key is set (the page asks
# for the key and sends it with its API calls).
PUBLIC_PATHS = {"/", "/health", "/metrics", "/openapi.json"}


# The playground page holds an API key field: no framing, no inline or foreign script, style or
# connection, no sniffing, no referrer. Harmless on the JSON routes, so sent with every response.
SECURITY_HEADERS = [
    (b"content-security-policy", b"default-src 'self'; frame-ancestors 'none'; base-uri 'none'; form-action 'self'"),
    (b"x-content-type-options", b"nosniff"),
    (b"x-frame-options", b"DENY"),
    (b"referrer-policy", b"no-referrer"),
]


def is_public(path: str) -> bool:
    return path in PUBLIC_PATHS or path.startswith("/static/")


def header_values(scope: Scope, name: bytes) -> list[bytes]:
    return [v for k, v in scope["headers"] if k == name]


class RequestLog:
    """Gives each request an id (`x-request-id`; generation routes turn it into the response `id`,
    which is also the prefix of the ids the workers log), logs one line when it ends and counts
    its status in `metrics` (`cde_http_responses_total`; a request that raised counts as 500)."""

    def __init__(self, app: ASGIApp, metrics: Metrics | None = None) -> None:
        self.app = app
        self.metrics = metrics

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        state = scope.setdefault("state", {})
        state["request_id"] = f"req-{uuid.uuid4().hex}"
        started, status = time.monotonic(), [500]

        async def send_with_id(message: Message) -> None:
            if message["type"] == "http.response.start":
                status[0] = message["status"]
                headers = [h for h in message.get("headers", []) if h[0].lower() != b"x-request-id"]
                message = {
                    **message,
                    "headers": [*headers, *SECURITY_HEADERS, (b"x-request-id", state["request_id"].encode())],
                }
            await send(message)

        try:
            await self.app(scope, receive, send_with_id)
        finally:
            record_response(self.metrics, state["request_id"], scope["method"], scope["path"], status[0], started)


def record_response(
    metrics: Metrics | None, request_id: str, method: str, path: str, status: int, started: float
) -> None:
    """The access log line and `cde_http_responses_total` of one response: every response the
    server sends comes through here, those written below the app (a 408 for headers that never
    finished, a 503 for a connection past the cap) included."""
    if metrics is not None:
        metrics.http_responses.labels(str(status)).inc()
    log.info(
        "request",
        extra={
            "request_id": request_id,
            "method": method,
            "path": path,
            "status": status,
            "duration_ms": round((time.monotonic() - started) * 1000, 1),
        },
    )


def with_cors(app: ASGIApp, limits: HttpLimits) -> ASGIApp:
    """Browser pages of `--allowed-origins` may call the API: their preflights are answered before
    the API key is asked for (a browser sends none with them), and every answer, errors, the
    drain's 503 and the connection cap's included (`gateway.http_server`), names their origin."""
    if not limits.allowed_origins:
        return app
    origins = list(limits.allowed_origins)
    return CORSMiddleware(app, allow_origins=origins, allow_methods=["GET", "POST"], allow_headers=["*"], max_age=600)


class HostCheck:
    """Answers only the Host names of `limits` (by default, a loopback listener answers only
    loopback names): a web page whose DNS name an attacker points at 127.0.0.1 (DNS rebinding)
    gets a 400 instead of the API, and no redirect ever carries a foreign Host."""

    def __init__(self, app: ASGIApp, limits: HttpLimits) -> None:
        self.app, self.limits = app, limits

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "http":
            hosts = header_values(scope, b"host")
            name = hosts[0].decode("latin-1").lower() if hosts else ""
            name = name[1:].partition("]")[0] if name.startswith("[") else name.rpartition(":")[0] or name
            if len(hosts) > 1 or (hosts and not self.limits.host_allowed(name.rstrip("."))):
                err = ApiError(400, "this Host header is not served here (see --allowed-hosts)", None, "invalid_host")
                return await err.response()(scope, receive, send)
        await self.app(scope, receive, send)


class BodyLimit:
    """Refuses bodies over `max_bytes` with 413: at once when Content-Length says so, else the
    moment the streamed body passes the limit, without reading the rest; and bodies that take
    longer than `timeout` seconds to arrive with 408 (a slow client holds no request open)."""

    def __init__(self, app: ASGIApp, max_bytes: int, timeout: float) -> None:
        self.app, self.max_bytes, self.timeout = app, max_bytes, timeout

    def _too_large(self) -> ApiError:
        return ApiError(413, f"Request body too large: the limit is {self.max_bytes} bytes", None, "request_too_large")

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        length = dict(scope["headers"]).get(b"content-length", b"")
        if length.isdigit() and int(length) > self.max_bytes:
            return await self._too_large().response()(scope, receive, send)
        seen, deadline, done = 0, time.monotonic() + self.timeout, False

        async def counted() -> Message:
            nonlocal seen, done
            if done:  # the body is in: a disconnect may be awaited as long as the response runs
                return await receive()
            try:
                message = await asyncio.wait_for(receive(), max(deadline - time.monotonic(), 0))
            except TimeoutError:  # raised inside request.body(): the route's error handler answers
                raise ApiError(
                    408,
                    f"the request body did not arrive within {self.timeout:g} s",
                    None,
                    "request_timeout",
                    {"Connection": "close"},
                ) from None
            if message["type"] == "http.request":
                seen += len(message.get("body", b""))
                if seen > self.max_bytes:
                    raise self._too_large()
                done = not message.get("more_body", False)
            return message

        await self.app(scope, counted, send)


class ApiKey:
    """`Authorization: Bearer KEY` on every non-public route. Both sides are hashed first, so the
    constant-time compare leaks neither the key's bytes nor its length."""

    def __init__(self, app: ASGIApp, api_key: str | None) -> None:
        self.app = app
        self.digest = None if api_key is None else hashlib.sha256(api_key.encode()).digest()

    def authorized(self, header: bytes) -> bool:
        if self.digest is None:
            return True
        scheme, _, token = header.partition(b" ")
        offered = hashlib.sha256(token.strip()).digest()
        return hmac.compare_digest(offered, self.digest) and scheme.lower() == b"bearer"

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        offered = header_values(scope, b"authorization")
        if len(offered) > 1:  # which one counts would depend on the proxy in front: neither does
            err = ApiError(400, "more than one Authorization header", None, "duplicate_authorization")
            return await err.response()(scope, receive, send)
        authorized = self.authorized(offered[0] if offered else b"")
        if not authorized and not is_public(scope["path"]):
            err = ApiError(401, "Incorrect API key provided.", None, "invalid_api_key", {"WWW-Authenticate": "Bearer"})
            return await err.response()(scope, receive, send)
        state = scope.setdefault("state", {})
        state["authorized"] = authorized  # public routes show more to a key holder
        state["keyed"] = self.digest is not None  # the key is part of the client's identity
        await self.app(scope, receive, send)
