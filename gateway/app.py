"""The Starlette app: thin routes over the handlers, OpenAI-style errors, optional API key."""

from __future__ import annotations

import contextlib
import time
from pathlib import Path

from starlette.applications import Starlette
from starlette.exceptions import HTTPException
from starlette.middleware import Middleware
from starlette.requests import Request
from starlette.responses import FileResponse, JSONResponse, Response
from starlette.routing import Mount, Route
from starlette.staticfiles import StaticFiles

from gateway.chat import create_chat_completion
from gateway.completions import create_completion
from gateway.concept_routes import get_concept, list_concepts
from gateway.errors import (
    ApiError, GenerationError, api_error_handler, http_error_handler, unhandled_error_handler,
)
from gateway.openapi import openapi_schema
from gateway.state import ServerState

# Probes, scrapes and the playground's files stay open when an API key is set (the page asks
# for the key and sends it with its API calls).
PUBLIC_PATHS = {"/", "/health", "/metrics", "/openapi.json"}
STATIC = Path(__file__).parent / "static"


def _public(path: str) -> bool:
    return path in PUBLIC_PATHS or path.startswith("/static/")


class ApiKeyMiddleware:
    def __init__(self, app, state: ServerState):
        self.app, self.state = app, state

    async def __call__(self, scope, receive, send):
        if scope["type"] == "http" and not _public(scope["path"]):
            header = dict(scope["headers"]).get(b"authorization", b"").decode("latin-1")
            if not self.state.authorized(header):
                err = ApiError(401, "Incorrect API key provided.", None, "invalid_api_key",
                               {"WWW-Authenticate": "Bearer"})
                return await err.response()(scope, receive, send)
        await self.app(scope, receive, send)


def _model_card(state: ServerState) -> dict:
    return {"id": state.model_name, "object": "model", "created": int(time.time()), "owned_by": "cde",
            "max_model_len": state.router.info.block_size}


async def models(request: Request) -> Response:
    state: ServerState = request.app.state.cde
    return JSONResponse({"object": "list", "data": [_model_card(state)] if state.router.info else []})


async def model(request: Request) -> Response:
    state: ServerState = request.app.state.cde
    state.model_info(request.path_params["model"])
    return JSONResponse(_model_card(state))


async def health(request: Request) -> Response:
    router = request.app.state.cde.router
    workers = [{"name": w.name, "endpoint": w.endpoint, "alive": w.alive, "outstanding": len(w.inflight),
                **({"pid": w.process.pid} if w.process else {}),
                **({"reason": w.down_reason} if not w.alive else {})} for w in router.links]
    ok = any(w.alive for w in router.links)
    return JSONResponse({"status": "ok" if ok else "unavailable", "workers": workers}, status_code=200 if ok else 503)


async def metrics(request: Request) -> Response:
    state: ServerState = request.app.state.cde
    return Response(state.metrics.render(state.router.links), media_type=state.metrics.content_type)


async def openapi(request: Request) -> Response:
    return JSONResponse(openapi_schema())


async def playground(request: Request) -> Response:
    return FileResponse(STATIC / "index.html")


async def generation_error_handler(request: Request, exc: GenerationError) -> Response:
    return ApiError(500, str(exc), code="generation_failed").response()


def create_app(state: ServerState, wait_for_workers: float | None = None) -> Starlette:
    """`wait_for_workers`: seconds to wait at startup for every worker to answer (`cde serve`);
    None starts serving at once (a standalone gateway, whose workers may come later)."""

    @contextlib.asynccontextmanager
    async def lifespan(app):
        await state.router.start()
        try:
            if wait_for_workers is not None:
                await state.router.wait_ready(wait_for_workers)
            yield
        finally:
            await state.router.stop()

    app = Starlette(
        routes=[
            Route("/v1/completions", create_completion, methods=["POST"]),
            Route("/v1/chat/completions", create_chat_completion, methods=["POST"]),
            Route("/v1/models", models, methods=["GET"]),
            Route("/v1/models/{model:path}", model, methods=["GET"]),
            Route("/v1/concepts", list_concepts, methods=["GET"]),
            Route("/v1/concepts/{concept_id}", get_concept, methods=["GET"]),
            Route("/health", health, methods=["GET"]),
            Route("/metrics", metrics, methods=["GET"]),
            Route("/openapi.json", openapi, methods=["GET"]),
            Route("/", playground, methods=["GET"]),
            Mount("/static", StaticFiles(directory=STATIC), name="static"),
        ],
        middleware=[Middleware(ApiKeyMiddleware, state=state)],
        exception_handlers={ApiError: api_error_handler, GenerationError: generation_error_handler,
                            HTTPException: http_error_handler, Exception: unhandled_error_handler},
        lifespan=lifespan,
    )
    app.state.cde = state
    return app
