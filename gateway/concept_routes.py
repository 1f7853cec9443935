"""GET /v1/concepts (list or search the concept catalog) and GET /v1/concepts/{id} (a known
concept's catalog fields, its group, and what it promotes: the vocabulary tokens its embedding
aligns with most, computed by a worker)."""

from __future__ import annotations

import asyncio
import re
from itertools import islice

from cde.gateway.errors import ApiError, invalid
from cde.gateway.state import ServerState
from cde.shared.limits import MAX_SEARCH_CHARS
from cde.shared.tokenizer import get_tokenizer
from starlette.requests import Request
from starlette.responses import JSONResponse, Response

DEFAULT_LIMIT, MAX_LIMIT = 20, 1000
DEFAULT_K, MAX_K = 15, 100
HEADS = {"known": "known", "unknown": "unknown", "any": None}
_BOOLS = {"true": True, "1": True, "false": False, "0": False}


def _ascii_int(raw: str) -> int | None:
    """An integer written in ASCII digits (Python's int() also takes spaces, "_" and other
    scripts' digits, which no client means as an id)."""
    return int(raw) if re.fullmatch(r"-?[0-9]{1,18}", raw) else None


def _int_param(request: Request, name: str, default: int, lo: int, hi: int) -> int:
    raw = request.query_params.get(name)
    if raw is None:
        return default
    value = _ascii_int(raw)
    if value is None:
        raise invalid(f"Invalid value for '{name}': expected an integer, got {raw!r}", name)
    if not lo <= value <= hi:
        raise invalid(f"Invalid value for '{name}': must be in [{lo}, {hi}], got {value}", name)
    return value


def _bool_param(request: Request, name: str, default: bool) -> bool:
    raw = request.query_params.get(name)
    if raw is None:
        return default
    if raw.lower() not in _BOOLS:
        raise invalid(f"Invalid value for '{name}': expected true or false, got {raw!r}", name)
    return _BOOLS[raw.lower()]


def _head_param(request: Request, default: str | None) -> str | None:
    raw = request.query_params.get("head")
    if raw is None:
        return default
    if raw not in HEADS:
        raise invalid(f"Invalid value for 'head': expected one of {sorted(HEADS)}, got {raw!r}", "head")
    return HEADS[raw]


async def list_concepts(request: Request) -> Response:
    state: ServerState = request.app.state.cde
    limit = _int_param(request, "limit", DEFAULT_LIMIT, 1, MAX_LIMIT)
    search = request.query_params.get("search", "")
    if len(search) > MAX_SEARCH_CHARS:
        raise invalid(f"Invalid value for 'search': at most {MAX_SEARCH_CHARS} characters, got {len(search)}", "search")
    n_concepts = state.live_info.n_concepts
    # A search ranks steerable known concepts unless told otherwise, as the official one does;
    # a plain listing is the whole catalog unless filtered.
    head = _head_param(request, "known" if search else None)
    steerable_only = _bool_param(request, "steerable_only", bool(search))
    if search:  # milliseconds from the index (shared/catalog_index.py), yet off the event loop
        data = await asyncio.to_thread(
            state.labels.search, search, n_concepts, limit=limit, steerable_only=steerable_only, head=head
        )
    else:
        data = list(islice(state.labels.listing(n_concepts, steerable_only=steerable_only, head=head), limit))
    return JSONResponse({"object": "list", "data": data})


def _known_concept_id(raw: str, n_concepts: int) -> int:
    concept_id = _ascii_int(raw)
    if concept_id is None:
        raise invalid(f"Invalid concept id {raw!r}: expected an integer", "id")
    if not 0 <= concept_id < n_concepts:
        raise ApiError(
            404,
            f"The concept `{concept_id}` does not exist (known concepts are [0, {n_concepts}))",
            "id",
            "concept_not_found",
        )
    return concept_id


async def get_concept(request: Request) -> Response:
    state: ServerState = request.app.state.cde
    info = state.live_info
    concept_id = _known_concept_id(request.path_params["concept_id"], info.n_concepts)
    k = _int_param(request, "k", DEFAULT_K, 1, MAX_K)
    reply = await state.router.concept_top_tokens(concept_id, k)
    tok = get_tokenizer(info.instruct)
    top = [{"token": tok.decode([t]), "token_id": t, "score": s} for t, s in zip(reply.token_ids, reply.scores)]
    return JSONResponse(
        state.labels.entry(concept_id, info.n_concepts) | {"group": state.labels.group(concept_id), "top_tokens": top}
    )
