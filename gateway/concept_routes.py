"""GET /v1/concepts (search the concept labels) and GET /v1/concepts/{id} (what a known concept
promotes: the vocabulary tokens its embedding aligns with most, computed by a worker)."""

from __future__ import annotations

from itertools import islice

from starlette.requests import Request
from starlette.responses import JSONResponse, Response

from gateway.errors import ApiError, invalid
from gateway.state import ServerState
from shared.protocol import Heartbeat
from shared.tokenizer import get_tokenizer

DEFAULT_LIMIT, MAX_LIMIT = 20, 1000
DEFAULT_K, MAX_K = 15, 100


def _int_param(request: Request, name: str, default: int, lo: int, hi: int) -> int:
    raw = request.query_params.get(name)
    if raw is None:
        return default
    try:
        value = int(raw)
    except ValueError:
        raise invalid(f"Invalid value for '{name}': expected an integer, got {raw!r}", name) from None
    if not lo <= value <= hi:
        raise invalid(f"Invalid value for '{name}': must be in [{lo}, {hi}], got {value}", name)
    return value


def _live_info(state: ServerState) -> Heartbeat:
    info = state.router.info
    if info is None:
        raise ApiError(503, "no worker is available", code="no_worker")
    return info


async def list_concepts(request: Request) -> Response:
    state: ServerState = request.app.state.cde
    limit = _int_param(request, "limit", DEFAULT_LIMIT, 1, MAX_LIMIT)
    search = request.query_params.get("search", "").lower()
    catalog = state.labels.catalog(_live_info(state).n_concepts)
    hits = (c for c in catalog if search in c["label"].lower())
    return JSONResponse({"object": "list", "data": list(islice(hits, limit))})


def _known_concept_id(raw: str, n_concepts: int) -> int:
    try:
        concept_id = int(raw)
    except ValueError:
        raise invalid(f"Invalid concept id {raw!r}: expected an integer", "id") from None
    if not 0 <= concept_id < n_concepts:
        raise ApiError(404, f"The concept `{concept_id}` does not exist (known concepts are [0, {n_concepts}))",
                       "id", "concept_not_found")
    return concept_id


async def get_concept(request: Request) -> Response:
    state: ServerState = request.app.state.cde
    info = _live_info(state)
    concept_id = _known_concept_id(request.path_params["concept_id"], info.n_concepts)
    k = _int_param(request, "k", DEFAULT_K, 1, MAX_K)
    reply = await state.router.concept_top_tokens(concept_id, k)
    tok = get_tokenizer(info.instruct)
    top = [{"token": tok.decode([t]), "token_id": t, "score": s} for t, s in zip(reply.token_ids, reply.scores)]
    return JSONResponse({"id": concept_id, "type": "known", "label": state.labels.label(concept_id), "top_tokens": top})
