"""The response objects of one /v1/chat/completions request: its SSE chunks (the role first, then
the choices' deltas, tool calls as they are written, then the usage chunk) or its JSON
body."""

from __future__ import annotations

from typing import TYPE_CHECKING

from cde.gateway.chat_schemas import ChatCompletionRequest
from cde.gateway.completion_flow import ResponseHead, StreamUsage
from cde.gateway.denoise import StepDelta
from cde.gateway.generation import Choice, Delta, TokenLogprob
from cde.gateway.logprobs_render import chat_logprobs
from cde.gateway.response_schemas import (
    ChatChoice,
    ChatCompletionChunk,
    ChatCompletionResponse,
    ChatDelta,
    ChatLogprobs,
    ChatStreamChoice,
    Usage,
)
from cde.gateway.sse import SseEvent
from cde.gateway.tool_output import StreamedAnswer, answer_message

if TYPE_CHECKING:
    from cde.shared.tokenizer import Tokenizer


class ChatRenderer:
    def __init__(
        self, body: ChatCompletionRequest, head: ResponseHead, prompt: list[int], tools: bool, tokenizer: Tokenizer
    ) -> None:
        """`tools`: the request has tools, so an answer may be calls (gateway/tool_output.py)."""
        self.body, self.head, self.prompt, self.tools, self.tokenizer = body, head, prompt, tools, tokenizer
        self.answers = [StreamedAnswer(tools, body.tool_choice) for _ in range(body.n)]
        self.usage = StreamUsage(body)

    def opening(self) -> list[ChatCompletionChunk]:
        """Each choice's role; as vLLM, the prompt's ids on the response's first chunk. Its content
        is OpenAI's: "" opens a text answer; with tools the answer may be calls, whose message has
        no content (null, as unstreamed), so the role goes alone and the text comes with its own
        first delta (gateway/tool_output.py)."""
        content = None if self.tools else ""
        chunks = []
        for i in range(self.body.n):
            role = ChatStreamChoice(
                index=i, delta=ChatDelta(role="assistant", content=content), logprobs=None, finish_reason=None
            )
            chunks.append(self._chunk(role, self._prompt_ids() if i == 0 else None))
        return chunks

    def chunk(self, d: Delta) -> ChatCompletionChunk | None:
        self.usage.count(d)
        delta, finish_reason = self.answers[d.index].delta(d.text, d.finish_reason)
        # Text held while it may open a tool call, and nothing else to tell: OpenAI sends no empty delta.
        told = d.logprobs is not None or d.attribution is not None or (self.body.return_token_ids and d.token_ids)
        if delta == ChatDelta() and finish_reason is None and not told:
            return None
        choice = ChatStreamChoice(
            index=d.index,
            delta=delta,
            logprobs=self._logprobs(d.token_ids, d.logprobs),
            finish_reason=finish_reason,
            token_ids=d.token_ids if self.body.return_token_ids else None,
            attribution=d.attribution,
        )
        return self._chunk(choice)

    def step(self, d: StepDelta) -> SseEvent:
        return self.head.step_event("chat.completion.step", d)

    def last_chunk(self, completion_tokens: int, cached_tokens: int) -> ChatCompletionChunk | None:
        if not self.usage.last:
            return None
        h = self.head
        return ChatCompletionChunk(
            id=h.id,
            object="chat.completion.chunk",
            created=h.created,
            model=h.model,
            choices=[],
            usage=Usage.of(len(self.prompt), completion_tokens, cached_tokens),
        )

    def response(self, choices: list[Choice], completion_tokens: int, cached_tokens: int) -> ChatCompletionResponse:
        h = self.head
        return ChatCompletionResponse(
            id=h.id,
            object="chat.completion",
            created=h.created,
            model=h.model,
            choices=[self._choice(c) for c in choices],
            usage=Usage.of(len(self.prompt), completion_tokens, cached_tokens),
            prompt_token_ids=self._prompt_ids(),
        )

    def _choice(self, c: Choice) -> ChatChoice:
        message, finish_reason = answer_message(c.text, c.finish_reason, self.tools, self.body.tool_choice)
        return ChatChoice(
            index=c.index,
            message=message,
            logprobs=self._logprobs(c.token_ids, c.logprobs),
            finish_reason=finish_reason,
            token_ids=c.token_ids if self.body.return_token_ids else None,
            attribution=c.attribution,
        )

    def _chunk(self, choice: ChatStreamChoice, prompt_token_ids: list[int] | None = None) -> ChatCompletionChunk:
        h = self.head
        chunk = ChatCompletionChunk(
            id=h.id,
            object="chat.completion.chunk",
            created=h.created,
            model=h.model,
            choices=[choice],
            prompt_token_ids=prompt_token_ids,
        )
        self.usage.set_on(chunk, choice.index, len(self.prompt))
        return chunk

    def _logprobs(self, token_ids: list[int], rows: list[TokenLogprob] | None) -> ChatLogprobs | None:
        return None if rows is None else chat_logprobs(self.tokenizer, token_ids, rows)

    def _prompt_ids(self) -> list[int] | None:
        return self.prompt if self.body.return_token_ids else None
