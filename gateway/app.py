"""The Starlette app: thin routes over the handlers, OpenAI-style errors, the middleware."""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import AsyncIterator
from pathlib import Path

from cde.gateway.chat import create_chat_completion
from cde.gateway.completions import create_completion
from cde.gateway.concept_routes import get_concept, list_concepts
from cde.gateway.errors import (
    ApiError,
    GenerationError,
    api_error_handler,
    http_error_handler,
    unhandled_error_handler,
)
from cde.gateway.http_limits import HttpLimits
from cde.gateway.json_out import JsonResponse
from cde.gateway.middleware import ApiKey, BodyLimit, HostCheck, RequestLog, with_cors
from cde.gateway.openapi import openapi_schema
from cde.gateway.response_schemas import ModelCard, ModelList
from cde.gateway.state import ServerState
from cde.gateway.tokenize_routes import detokenize, tokenize
from cde.shared.tokenizer import get_tokenizer
from starlette.applications import Starlette
from starlette.exceptions import HTTPException
from starlette.middleware import Middleware
from starlette.requests import ClientDisconnect, Request
from starlette.responses import FileResponse, JSONResponse, Response
from starlette.routing import Mount, Route
from starlette.staticfiles import StaticFiles

STATIC = Path(__file__).parent / "static"


def _model_card(state: ServerState) -> ModelCard:
    info = state.live_info
    return ModelCard(
        id=state.api_name(info),
        object="model",
        created=int(time.time()),
        owned_by="cde",
        root=state.model_root or info.name,
        parent=None,
        max_model_len=info.context_len,
    )


async def models(request: Request) -> Response:
    state: ServerState = request.app.state.cde
    return JsonResponse(ModelList(object="list", data=[_model_card(state)] if state.router.model_info else []))


async def model(request: Request) -> Response:
    state: ServerState = request.app.state.cde
    state.model_info(request.path_params["model"])
    return JsonResponse(_model_card(state))


async def health(request: Request) -> Response:
    router = request.app.state.cde.router
    # Endpoints (ipc paths) and pids only for a key holder: the probe is open to anyone.
    private = request.state.authorized
    workers = [
        {
            "name": w.name,
            "alive": w.alive,
            "outstanding": len(w.inflight),
            **({"endpoint": w.endpoint} if private else {}),
            **({"pid": w.process.pid} if w.process and private else {}),
            **({"reason": w.down_reason} if not w.alive else {}),
        }
        for w in router.links
    ]
    ok = any(w.alive for w in router.links)
    return JSONResponse({"status": "ok" if ok else "unavailable", "workers": workers}, status_code=200 if ok else 503)


async def metrics(request: Request) -> Response:
    state: ServerState = request.app.state.cde
    return Response(state.metrics.render(state.router.links), media_type=state.metrics.content_type)


async def openapi(request: Request) -> Response:
    state: ServerState = request.app.state.cde
    info = state.live_info if state.router.model_info else None
    return JSONResponse(openapi_schema(state.model_name, info, state.api_key is not None))


async def playground(request: Request) -> Response:
    return FileResponse(STATIC / "index.html")


async def generation_error_handler(request: Request, exc: GenerationError) -> Response:
    return exc.error.response()


async def client_gone_handler(request: Request, exc: ClientDisconnect) -> Response:
    # Hung up while sending the body: not a server error, and nobody receives this answer.
    return Response(status_code=499)  # nginx's "client closed request"


DEFAULT_MAX_REQUEST_BYTES = 4 << 20
DEFAULT_LIMITS = HttpLimits()


def create_app(
    state: ServerState,
    wait_for_workers: float | None = None,
    max_request_bytes: int = DEFAULT_MAX_REQUEST_BYTES,
    limits: HttpLimits = DEFAULT_LIMITS,
) -> Starlette:
    """`wait_for_workers`: seconds to wait at startup for every worker to answer (`cde serve`);
    None starts serving at once (a standalone gateway, whose workers may come later)."""

    @contextlib.asynccontextmanager
    async def lifespan(app: Starlette) -> AsyncIterator[None]:
        await state.router.start()
        try:
            if wait_for_workers is not None:
                await state.router.wait_ready(wait_for_workers)
                info = state.router.model_info
                if info is not None:  # loaded now, on a thread: at first use it held the event loop ~0.5 s
                    await asyncio.to_thread(get_tokenizer, info.instruct)
            yield
        finally:
            await state.router.stop()

    app = Starlette(
        routes=[
            Route("/v1/completions", create_completion, methods=["POST"]),
            Route("/v1/chat/completions", create_chat_completion, methods=["POST"]),
            Route("/v1/models", models, methods=["GET"]),
            Route("/v1/models/{model:path}", model, methods=["GET"]),
            Route("/tokenize", tokenize, methods=["POST"]),
            Route("/detokenize", detokenize, methods=["POST"]),
            Route("/v1/concepts", list_concepts, methods=["GET"]),
            Route("/v1/concepts/{concept_id}", get_concept, methods=["GET"]),
            Route("/health", health, methods=["GET"]),
            Route("/metrics", metrics, methods=["GET"]),
            Route("/openapi.json", openapi, methods=["GET"]),
            Route("/", playground, methods=["GET"]),
            Mount("/static", StaticFiles(directory=STATIC), name="static"),
        ],
        middleware=[
            Middleware(RequestLog, metrics=state.metrics),
            Middleware(HostCheck, limits=limits),
            Middleware(with_cors, limits=limits),
            Middleware(BodyLimit, max_bytes=max_request_bytes, timeout=limits.body_timeout),
            Middleware(ApiKey, api_key=state.api_key),
        ],
        exception_handlers={
            ApiError: api_error_handler,
            GenerationError: generation_error_handler,
            ClientDisconnect: client_gone_handler,
            HTTPException: http_error_handler,
            Exception: unhandled_error_handler,
        },
        lifespan=lifespan,
    )
    app.state.cde = state
    app.state.limits = limits  # the listener's share (`gateway.http_server.serve_http`)
    return app
