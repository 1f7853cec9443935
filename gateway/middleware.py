"""ASGI middleware around every route: the request id and access log, the body size limit and
the API key. Each answers in the OpenAI error shape."""

from __future__ import annotations

import hashlib
import hmac
import logging
import time
import uuid

from gateway.errors import ApiError

log = logging.getLogger("cde.gateway")

# Probes, scrapes and the playground's files stay open when an API key is set (the page asks
# for the key and sends it with its API calls).
PUBLIC_PATHS = {"/", "/health", "/metrics", "/openapi.json"}


def is_public(path: str) -> bool:
    return path in PUBLIC_PATHS or path.startswith("/static/")


class RequestLog:
    """Gives each request an id (`x-request-id`; generation routes turn it into the response `id`,
    which is also the prefix of the ids the workers log) and logs one line when it ends."""

    def __init__(self, app):
        self.app = app

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        state = scope.setdefault("state", {})
        state["request_id"] = f"req-{uuid.uuid4().hex}"
        started, status = time.monotonic(), [500]

        async def send_with_id(message):
            if message["type"] == "http.response.start":
                status[0] = message["status"]
                headers = [h for h in message.get("headers", []) if h[0].lower() != b"x-request-id"]
                message = {**message, "headers": [*headers, (b"x-request-id", state["request_id"].encode())]}
            await send(message)

        try:
            await self.app(scope, receive, send_with_id)
        finally:
            log.info("request", extra={"request_id": state["request_id"], "method": scope["method"],
                                       "path": scope["path"], "status": status[0],
                                       "duration_ms": round((time.monotonic() - started) * 1000, 1)})


class BodyLimit:
    """Refuses bodies over `max_bytes` with 413: at once when Content-Length says so, else the
    moment the streamed body passes the limit, without reading the rest."""

    def __init__(self, app, max_bytes: int):
        self.app, self.max_bytes = app, max_bytes

    def _too_large(self) -> ApiError:
        return ApiError(413, f"Request body too large: the limit is {self.max_bytes} bytes", None,
                        "request_too_large")

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        length = dict(scope["headers"]).get(b"content-length", b"")
        if length.isdigit() and int(length) > self.max_bytes:
            return await self._too_large().response()(scope, receive, send)
        seen = 0

        async def counted():
            nonlocal seen
            message = await receive()
            if message["type"] == "http.request":
                seen += len(message.get("body", b""))
                if seen > self.max_bytes:
                    raise self._too_large()  # inside request.body(): the route's error handler answers
            return message

        await self.app(scope, counted, send)


class ApiKey:
    """`Authorization: Bearer KEY` on every non-public route. Both sides are hashed first, so the
    constant-time compare leaks neither the key's bytes nor its length."""

    def __init__(self, app, api_key: str | None):
        self.app = app
        self.digest = None if api_key is None else hashlib.sha256(api_key.encode()).digest()

    def authorized(self, header: bytes) -> bool:
        if self.digest is None:
            return True
        scheme, _, token = header.partition(b" ")
        offered = hashlib.sha256(token.strip()).digest()
        return hmac.compare_digest(offered, self.digest) and scheme.lower() == b"bearer"

    async def __call__(self, scope, receive, send):
        if scope["type"] == "http" and not is_public(scope["path"]):
            if not self.authorized(dict(scope["headers"]).get(b"authorization", b"")):
                err = ApiError(401, "Incorrect API key provided.", None, "invalid_api_key",
                               {"WWW-Authenticate": "Bearer"})
                return await err.response()(scope, receive, send)
        await self.app(scope, receive, send)
