"""The request flow that /v1/completions and /v1/chat/completions share: the body read and checked
against the live model, the Generation of its choices, and the two ways the answer goes out (an
SSE stream of chunks as the choices' blocks arrive, or one JSON body once all have finished).
Each route keeps only what differs: its prompts, and a `Renderer` of its response objects."""

from __future__ import annotations

from collections.abc import AsyncIterator, Sequence
from dataclasses import dataclass
from typing import Literal, Protocol, TypeVar

from cde.gateway.attribution_render import renderer
from cde.gateway.denoise import StepDelta, denoise_views
from cde.gateway.errors import invalid
from cde.gateway.generation import Choice, Delta, Generation, encode_requests
from cde.gateway.http_utils import read_body, until_disconnect
from cde.gateway.json_out import JsonResponse
from cde.gateway.model_info import ModelInfo
from cde.gateway.params import generate_requests, stop_list
from cde.gateway.request_logs import ContentLog
from cde.gateway.response_schemas import (
    ChatCompletionChunk,
    ChatCompletionResponse,
    CompletionChunk,
    CompletionResponse,
    ResponseModel,
    StepChunk,
    Usage,
)
from cde.gateway.schemas import SamplingParams
from cde.gateway.sse import Chunk, EventStreamResponse, SseEvent
from cde.gateway.state import ServerState
from cde.shared.tokenizer import Tokenizer
from starlette.requests import Request
from starlette.responses import Response

B = TypeVar("B", bound=SamplingParams)


async def open_request(request: Request, schema: type[B]) -> tuple[ServerState, B, ModelInfo]:
    """The parsed body, with the live model's limits (404 for another model's name, 503 without a
    worker) and its stream options checked."""
    state: ServerState = request.app.state.cde
    body = await read_body(request, schema)
    info = state.model_info(body.model)
    if body.stream_options is not None and not body.stream:
        raise invalid("stream_options is only allowed when stream is true", "stream_options")
    return state, body, info


class StreamUsage:
    """A stream's usage: with `stream_options.include_usage` it ends with a usage chunk and its other
    chunks carry `usage`, null or, with vLLM's `continuous_usage_stats`, as vLLM has it, the usage so
    far of the chunk's choice (its prompt, its tokens)."""

    def __init__(self, body: SamplingParams) -> None:
        options = body.stream_options
        self.last = bool(options and options.include_usage)
        self.continuous = bool(options and options.continuous_usage_stats)  # read under `last` only
        self.completion_tokens: dict[int, int] = {}  # per choice, so far

    def count(self, delta: Delta) -> None:
        self.completion_tokens[delta.index] = self.completion_tokens.get(delta.index, 0) + len(delta.token_ids)

    def set_on(self, chunk: ChatCompletionChunk | CompletionChunk, index: int, prompt_tokens: int) -> None:
        if self.last:  # set, so written: null before the last chunk, or the usage so far
            so_far = Usage.so_far(prompt_tokens, self.completion_tokens.get(index, 0))
            chunk.usage = so_far if self.continuous else None


async def start_generation(
    state: ServerState,
    body: SamplingParams,
    prompts: list[list[int]],
    max_tokens: int | None,
    info: ModelInfo,
    tokenizer: Tokenizer,
    response_id: str,
    client: str,
    constraint: tuple[str, str] | None = None,
) -> Generation:
    """The engine requests of every (prompt, choice) of `client` (gateway/client_identity.py),
    submitted to the workers; `constraint`, (grammar, the field it came from), constrains them all
    (gateway/structured.py)."""
    grammar, grammar_param = constraint or (None, None)
    reqs = generate_requests(body, prompts, max_tokens, info, state.labels, response_id, client, grammar)
    frames = await encode_requests(reqs)
    gen = Generation(
        state.router,
        state.metrics,
        reqs,
        frames,
        tokenizer,
        stop_list(body),
        body.include_stop_str_in_output,
        renderer(reqs, tokenizer, state.labels, info),
        denoise_views(reqs, tokenizer, state.labels, info),
        grammar_param,
    )
    state.metrics.prompt_tokens.inc(sum(len(p) for p in prompts))
    return gen


@dataclass(frozen=True)
class ResponseHead:
    """What every object of one response shares."""

    id: str
    created: int
    model: str

    def step_event(self, obj: Literal["text_completion.step", "chat.completion.step"], delta: StepDelta) -> SseEvent:
        """A `stream_denoise` step as CDE's own SSE event kind."""
        chunk = StepChunk(id=self.id, object=obj, created=self.created, model=self.model, choices=[delta.payload])
        return SseEvent("step", chunk)


class Renderer(Protocol):
    """The response objects of one request (gateway/completion_render.py, gateway/chat_render.py)."""

    def opening(self) -> Sequence[ResponseModel]:
        """The chunks a stream starts with, before any choice has text."""
        ...

    def chunk(self, delta: Delta) -> ResponseModel | None:
        """The delta's chunk; None where it has nothing to tell the client."""
        ...

    def step(self, delta: StepDelta) -> SseEvent: ...

    def last_chunk(self, completion_tokens: int, cached_tokens: int) -> ResponseModel | None:
        """The usage chunk that ends a stream which asked for it."""
        ...

    def response(
        self, choices: list[Choice], completion_tokens: int, cached_tokens: int
    ) -> CompletionResponse | ChatCompletionResponse:
        """The JSON body of the whole answer."""
        ...


async def answer(request: Request, body: SamplingParams, gen: Generation, content: ContentLog, r: Renderer) -> Response:
    """An SSE stream of `r`'s chunks when the body asked for one, else its JSON body."""
    if body.stream:
        return _stream(gen, content, r, body.n)
    return await _respond_when_done(request, gen, content, r, body.n)  # n: choices per prompt (usage)


def _stream(gen: Generation, content: ContentLog, r: Renderer, n: int) -> Response:
    """The `opening` chunks, then one chunk per delta of the choices as they come, with a step
    event per denoising step, then the usage chunk, if any."""

    async def chunks() -> AsyncIterator[Chunk]:
        for c in r.opening():
            yield c
        async for d in gen.stream():
            event = r.step(d) if isinstance(d, StepDelta) else r.chunk(d)
            if event is not None:
                yield event
        last = r.last_chunk(gen.completion_tokens, gen.cached_tokens(n))
        if last is not None:
            yield last

    return EventStreamResponse(content.streamed(chunks()), on_close=gen.close)


async def _respond_when_done(request: Request, gen: Generation, content: ContentLog, r: Renderer, n: int) -> Response:
    """The JSON answer once every choice finished, unless the client hangs up first; the choices
    still running then are aborted."""

    async def complete() -> Response:
        choices = await gen.collect()
        response = r.response(choices, gen.completion_tokens, gen.cached_tokens(n))
        content.answered(response)
        return JsonResponse(response)

    try:
        return await until_disconnect(request, complete())
    finally:
        gen.close()
