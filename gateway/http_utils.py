"""Reading request bodies into schemas, and dropping work for clients that hung up."""

from __future__ import annotations

import asyncio
import contextlib
from typing import TypeVar

from pydantic import BaseModel, ValidationError
from starlette.requests import Request
from starlette.responses import Response

from gateway.errors import from_validation_error, parse_json_body

M = TypeVar("M", bound=BaseModel)


async def read_body(request: Request, schema: type[M]) -> M:
    data = parse_json_body(await request.body(), request.headers.get("content-type", ""))
    try:
        return schema.model_validate(data)
    except ValidationError as exc:
        raise from_validation_error(exc) from None


async def until_disconnect(request: Request, work) -> Response:
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
