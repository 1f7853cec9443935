"""Reading request bodies into schemas, and dropping work for clients that hung up."""

from __future__ import annotations

import asyncio
import contextlib
import json
import re
from collections.abc import Awaitable
from typing import Any, TypeVar

from cde.gateway.errors import from_validation_error, invalid
from pydantic import BaseModel, ValidationError
from starlette.requests import Request
from starlette.responses import Response

M = TypeVar("M", bound=BaseModel)

# A JSON escape of a UTF-16 surrogate: once the body's bytes are decoded strictly, the only way a
# lone surrogate (which no UTF-8 encoder, tokenizer or JSON response can carry) gets into it.
_SURROGATE_ESCAPE = re.compile(r"\\u[dD][89a-fA-F]")


def parse_json_body(raw: bytes, content_type: str, from_a_page: bool) -> object:
    """A body sent without a Content-Type is read as JSON, as vLLM (FastAPI) reads it: Python's
    `requests.post(url, data=json.dumps(...))` sends none. Not from a web page (`from_a_page`: the
    request has an Origin): a browser sends a binary body without a Content-Type and without
    asking first (no CORS preflight), so any page could make a local server generate."""
    if (content_type or from_a_page) and content_type.split(";")[0].strip().lower() != "application/json":
        raise invalid(
            f"Unsupported content type {content_type or '(none)'!r}; send application/json",
            None,
            "unsupported_content_type",
        )
    try:
        # Strictly, where json.loads(bytes) would let the bytes of a lone surrogate through.
        text = raw.decode(json.detect_encoding(raw))
        data = json.loads(text)
    except RecursionError:
        raise invalid("Malformed JSON body: nested too deeply", None, "invalid_json") from None
    except ValueError as exc:  # bad syntax, bad UTF-8, an integer of more than 4300 digits
        raise invalid(f"Malformed JSON body: {exc}", None, "invalid_json") from None
    if _SURROGATE_ESCAPE.search(text):
        _check_unicode(data, [])
    return data


def _check_unicode(value: Any, path: list) -> None:
    strings = [value] if isinstance(value, str) else []
    if isinstance(value, dict):
        strings = list(value)
        for k, v in value.items():
            _check_unicode(v, [*path, k])
    elif isinstance(value, list):
        for i, v in enumerate(value):
            _check_unicode(v, [*path, i])
    for s in strings:
        try:
            s.encode("utf-8")
        except UnicodeEncodeError:
            param = ".".join(str(p) for p in path) or None
            raise invalid("Invalid Unicode: a string holds a lone UTF-16 surrogate", param, "invalid_json") from None


async def read_body(request: Request, schema: type[M]) -> M:
    data = parse_json_body(await request.body(), request.headers.get("content-type", ""), "origin" in request.headers)
    try:
        return schema.model_validate(data)
    except ValidationError as exc:
        raise from_validation_error(exc) from None
    except RecursionError:  # nesting the JSON parser accepted but validation cannot follow
        raise invalid("request body nested too deeply", None, "invalid_json") from None


async def until_disconnect(request: Request, work: Awaitable[Response]) -> Response:
    """Run a non-streaming generation, cancelling it (and so aborting it in the worker) if the
    client disconnects first: nobody would read the answer."""
    task = asyncio.ensure_future(work)

    async def disconnected() -> None:
        while (await request.receive())["type"] != "http.disconnect":
            pass

    watcher = asyncio.ensure_future(disconnected())
    try:
        await asyncio.wait({task, watcher}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        watcher.cancel()
        if not task.done():
            task.cancel()
    if task.cancelled() or not task.done():
        with contextlib.suppress(asyncio.CancelledError):
            await task
        return Response(status_code=499)  # nginx's "client closed request"; nobody receives it
    return task.result()
