"""The response objects of one /v1/completions request: its SSE chunks (echo first, then the
choices' deltas, then the usage chunk) or its JSON body."""

from __future__ import annotations

from typing import TYPE_CHECKING

from cde.gateway.attribution_schemas import Attribution
from cde.gateway.completion_flow import ResponseHead, StreamUsage
from cde.gateway.denoise import StepDelta
from cde.gateway.generation import Choice, Delta, TokenLogprob
from cde.gateway.logprobs_render import CompletionLogprobsRenderer
from cde.gateway.response_schemas import (
    CompletionChoice,
    CompletionChunk,
    CompletionResponse,
    FinishReason,
    Usage,
)
from cde.gateway.schemas import CompletionRequest
from cde.gateway.sse import SseEvent

if TYPE_CHECKING:
    from cde.shared.tokenizer import Tokenizer


class CompletionRenderer:
    def __init__(
        self, body: CompletionRequest, head: ResponseHead, prompts: list[list[int]], tokenizer: Tokenizer
    ) -> None:
        """`prompts`: the request's prompts as token ids; choice i answers prompt i // n."""
        self.body, self.head, self.tokenizer = body, head, tokenizer
        n_choices = len(prompts) * body.n
        self.prompt_of = [prompts[i // body.n] for i in range(n_choices)]
        self.prompt_tokens = sum(len(p) for p in prompts)
        self.logprobs = [CompletionLogprobsRenderer(tokenizer) for _ in range(n_choices)]
        self.usage = StreamUsage(body)
        self.started: set[int] = set()  # choices whose first chunk went out (with prompt_token_ids)

    def opening(self) -> list[CompletionChunk]:
        """With echo, each choice's prompt text comes first."""
        if not self.body.echo:
            return []
        return [self._chunk(self._choice(i, self._echo(i), [], None, None, None)) for i in range(len(self.prompt_of))]

    def chunk(self, d: Delta) -> CompletionChunk:
        self.usage.count(d)
        return self._chunk(self._choice(d.index, d.text, d.token_ids, d.finish_reason, d.attribution, d.logprobs))

    def step(self, d: StepDelta) -> SseEvent:
        return self.head.step_event("text_completion.step", d)

    def last_chunk(self, completion_tokens: int, cached_tokens: int) -> CompletionChunk | None:
        if not self.usage.last:
            return None
        h = self.head
        usage = Usage.of(self.prompt_tokens, completion_tokens, cached_tokens)
        return CompletionChunk(
            id=h.id, object="text_completion", created=h.created, model=h.model, choices=[], usage=usage
        )

    def response(self, choices: list[Choice], completion_tokens: int, cached_tokens: int) -> CompletionResponse:
        h = self.head
        return CompletionResponse(
            id=h.id,
            object="text_completion",
            created=h.created,
            model=h.model,
            choices=[self._whole(c) for c in choices],
            usage=Usage.of(self.prompt_tokens, completion_tokens, cached_tokens),
        )

    def _whole(self, c: Choice) -> CompletionChoice:
        return self._choice(
            c.index, self._echo(c.index) + c.text, c.token_ids, c.finish_reason, c.attribution, c.logprobs
        )

    def _echo(self, index: int) -> str:
        return self.tokenizer.decode(self.prompt_of[index]) if self.body.echo else ""

    def _chunk(self, choice: CompletionChoice) -> CompletionChunk:
        h = self.head
        chunk = CompletionChunk(id=h.id, object="text_completion", created=h.created, model=h.model, choices=[choice])
        self.usage.set_on(chunk, choice.index, len(self.prompt_of[choice.index]))
        return chunk

    def _choice(
        self,
        index: int,
        text: str,
        token_ids: list[int],
        finish_reason: FinishReason | None,
        attribution: Attribution | None,
        logprobs: list[TokenLogprob] | None,
    ) -> CompletionChoice:
        # As vLLM: the prompt's ids on the choice's first chunk (the whole choice, unstreamed).
        first = index not in self.started
        self.started.add(index)
        ids = self.body.return_token_ids
        return CompletionChoice(
            index=index,
            text=text,
            logprobs=None if logprobs is None else self.logprobs[index].render(token_ids, logprobs),
            finish_reason=finish_reason,
            token_ids=token_ids if ids else None,
            prompt_token_ids=self.prompt_of[index] if ids and first else None,
            attribution=attribution,
        )
