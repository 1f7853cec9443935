"""Per-request logging in the gateway: the response id that ties the `x-request-id` header, the
access log line and the workers' log lines together, and, only with `--log-requests`, what was
asked and answered."""

from __future__ import annotations

import logging
from collections.abc import AsyncIterator
from typing import Any

from cde.gateway.response_schemas import (
    ChatChoice,
    ChatCompletionChunk,
    ChatCompletionResponse,
    ChatStreamChoice,
    CompletionChoice,
    CompletionChunk,
    CompletionResponse,
)
from starlette.requests import Request

log = logging.getLogger("cde.gateway")


def response_id(request: Request, prefix: str) -> str:
    """`cmpl-<hex>` from the request's `req-<hex>`; the response header and the access log then
    carry the id the client sees in the body (engine request ids extend it: `<id>-<prompt>-<n>`)."""
    rid = f"{prefix}-{request.state.request_id.removeprefix('req-')}"
    request.state.request_id = rid
    return rid


class ContentLog:
    """Prompts and generated text of one request, logged only when the operator opted in."""

    def __init__(self, enabled: bool, request_id: str):
        self.enabled, self.request_id = enabled, request_id

    def asked(self, **content: Any) -> None:
        if self.enabled:
            log.info("request content", extra={"request_id": self.request_id, **content})

    def answered(self, response: CompletionResponse | ChatCompletionResponse) -> None:
        if self.enabled:
            self._log_texts({c.index: _text(c) for c in response.choices})

    def _log_texts(self, texts: dict[int, str]) -> None:
        log.info("response content", extra={"request_id": self.request_id, "choices": texts})

    async def streamed(self, chunks: AsyncIterator) -> AsyncIterator:
        """Passes the SSE chunks on, logging each choice's whole text at the end (from the
        OpenAI chunks; `stream_denoise` step events only preview what those will say)."""
        texts: dict[int, str] = {}
        try:
            async for chunk in chunks:
                if self.enabled and isinstance(chunk, CompletionChunk | ChatCompletionChunk):
                    for c in chunk.choices:
                        texts[c.index] = texts.get(c.index, "") + _text(c)
                yield chunk
        finally:
            if self.enabled:
                self._log_texts(texts)


def _text(choice: CompletionChoice | ChatChoice | ChatStreamChoice) -> str:
    if isinstance(choice, CompletionChoice):
        return choice.text
    if isinstance(choice, ChatChoice):
        return choice.message.content or ""
    return choice.delta.content or ""
