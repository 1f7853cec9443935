"""The request flow that /v1/completions and /v1/chat/completions share: the body read and checked
against the live model, the Generation of its choices, and the two ways the answer goes out (an
SSE stream of chunks as the choices' blocks arrive, or one JSON body once all have finished).
Each route keeps only what differs: its prompts and its chunk and choice shapes."""

from __future__ import annotations

from collections.abc import AsyncIterator, Awaitable, Callable, Iterable
from typing import TypeVar

from cde.gateway.attribution_render import renderer
from cde.gateway.denoise import StepDelta, denoise_views, step_event
from cde.gateway.errors import invalid
from cde.gateway.generation import Delta, Generation, encode_requests
from cde.gateway.http_utils import read_body, until_disconnect
from cde.gateway.logs import ContentLog
from cde.gateway.params import generate_requests, stop_list
from cde.gateway.schemas import SamplingParams
from cde.gateway.sse import EventStreamResponse, SseEvent
from cde.gateway.state import ServerState
from cde.shared.protocol import GenerateRequest, Heartbeat
from cde.shared.tokenizer import Tokenizer
from starlette.requests import Request
from starlette.responses import Response

B = TypeVar("B", bound=SamplingParams)


async def open_request(request: Request, schema: type[B]) -> tuple[ServerState, B, Heartbeat]:
    """The parsed body, with the live model's limits (404 for another model's name, 503 without a
    worker) and its stream options checked."""
    state: ServerState = request.app.state.cde
    body = await read_body(request, schema)
    info = state.model_info(body.model)
    if body.stream_options is not None and not body.stream:
        raise invalid("stream_options is only allowed when stream is true", "stream_options")
    return state, body, info


def usage(gen: Generation, prompt_tokens: int, choices_per_prompt: int) -> dict:
    """OpenAI's usage object, once the choices have finished; cached_tokens: of the prompt tokens,
    those the workers' prefix caches held (Generation.cached_tokens)."""
    return {
        "prompt_tokens": prompt_tokens,
        "completion_tokens": gen.completion_tokens,
        "total_tokens": prompt_tokens + gen.completion_tokens,
        "prompt_tokens_details": {"cached_tokens": gen.cached_tokens(choices_per_prompt)},
    }


def include_usage(body: SamplingParams) -> bool:
    """Whether a stream ends with a usage chunk (and its other chunks carry `usage: null`)."""
    return bool(body.stream_options and body.stream_options.include_usage)


async def start_generation(
    state: ServerState,
    body: SamplingParams,
    prompts: list[list[int]],
    max_tokens: int,
    info: Heartbeat,
    tokenizer: Tokenizer,
    response_id: str,
    client: str,
    grammar: str | None = None,
) -> tuple[list[GenerateRequest], Generation]:
    """The engine requests of every (prompt, choice) of `client` (gateway/client_identity.py),
    submitted to the workers; `grammar` constrains them all (gateway/structured.py)."""
    reqs = generate_requests(body, prompts, max_tokens, info, state.labels, response_id, client, grammar)
    frames = await encode_requests(reqs)
    gen = Generation(
        state.router,
        state.metrics,
        reqs,
        frames,
        tokenizer,
        stop_list(body),
        renderer(reqs, tokenizer, state.labels, info),
        denoise_views(reqs, tokenizer, state.labels, info),
    )
    state.metrics.prompt_tokens.inc(sum(len(p) for p in prompts))
    return reqs, gen


def stream_response(
    gen: Generation,
    content: ContentLog,
    head: dict,
    step_object: str,
    opening: Iterable[dict],
    chunk: Callable[[Delta, bool], dict],
    started: set[int],
    final: Callable[[], dict] | None,
) -> Response:
    """The SSE answer: the `opening` chunks, then one chunk per delta of the choices as they come
    (`chunk(delta, first)`, first: the choice's first chunk, unless its index is in `started`)
    with a step event per denoising step, then `final()`'s chunk, if any."""

    async def chunks() -> AsyncIterator[dict | SseEvent]:
        for c in opening:
            yield c
        async for d in gen.stream():
            if isinstance(d, StepDelta):
                yield step_event(head, step_object, d)
                continue
            first = d.index not in started
            started.add(d.index)
            yield chunk(d, first)
        if final is not None:
            yield final()

    return EventStreamResponse(content.streamed(chunks()), on_close=gen.close)


async def respond_when_done(request: Request, gen: Generation, complete: Callable[[], Awaitable[Response]]) -> Response:
    """The JSON answer once every choice finished (`complete`), unless the client hangs up first;
    the choices still running then are aborted."""
    try:
        return await until_disconnect(request, complete())
    finally:
        gen.close()
