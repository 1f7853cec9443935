"""Who a request comes from, for the fair share (the worker's per-client cap on running slots and
round-robin admission, the gateway's per-client cap on requests in flight): the client's address,
qualified by its API key when the server has one (a digest, never the key). With the one key a
server has today the address tells clients apart; should keys become several, the key does too."""

from __future__ import annotations

import hashlib

from starlette.requests import Request


def client_identity(request: Request) -> str:
    host = request.client.host if request.client is not None else "unknown"
    auth = request.headers.get("authorization") if request.scope.get("state", {}).get("keyed") else None
    if not auth:
        return host
    return f"{hashlib.sha256(auth.encode()).hexdigest()[:12]}@{host}"
