"""Server-sent events: `data: <json>` per chunk, an error event if generation fails after the
stream started (the status line is long gone by then), and always `data: [DONE]` at the end.
CDE's own event kinds (`step`, asked for with `stream_denoise`) carry an `event:` line, so clients
that only know OpenAI's unnamed events can tell them apart."""

from __future__ import annotations

import contextlib
import logging
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass

import anyio
from cde.gateway.errors import ApiError, GenerationError
from cde.gateway.json_out import dumps
from pydantic import BaseModel
from starlette.responses import StreamingResponse
from starlette.types import Receive, Scope, Send

log = logging.getLogger("cde.gateway")

DONE = b"data: [DONE]\n\n"


@dataclass
class SseEvent:
    kind: str
    data: BaseModel


Chunk = BaseModel | SseEvent  # an unnamed event (OpenAI's chunks), or one of CDE's named ones


def event(obj: BaseModel | dict, kind: str | None = None) -> bytes:
    head = b"event: " + kind.encode() + b"\n" if kind else b""
    return head + b"data: " + dumps(obj) + b"\n\n"


async def events(chunks: AsyncIterator[Chunk]) -> AsyncIterator[bytes]:
    try:
        async for chunk in chunks:
            yield event(chunk.data, chunk.kind) if isinstance(chunk, SseEvent) else event(chunk)
    except GenerationError as exc:
        yield event(exc.error.body())
    except Exception:
        log.exception("stream failed")
        yield event(ApiError(500, "internal server error").body())
    yield DONE


class EventStreamResponse(StreamingResponse):
    """Stops the generation the moment the client disconnects. Starlette, under ASGI spec 2.4,
    would only notice at the next write, which can be a whole 64-token block (or a long queue
    wait) away, holding the worker's KV pages all that time."""

    def __init__(self, chunks: AsyncIterator[Chunk], on_close: Callable[[], None]):
        super().__init__(
            events(chunks),
            media_type="text/event-stream",
            headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"},
        )
        self.on_close = on_close  # also runs when the client left before the first chunk

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        try:
            async with anyio.create_task_group() as tg:

                async def stream() -> None:
                    with contextlib.suppress(OSError):  # the client went away mid-write
                        await self.stream_response(send)
                    tg.cancel_scope.cancel()

                tg.start_soon(stream)
                await self.listen_for_disconnect(receive)
                tg.cancel_scope.cancel()
        finally:
            self.on_close()
