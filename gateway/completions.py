"""POST /v1/completions."""

from __future__ import annotations

import time

from cde.gateway.attribution_render import renderer
from cde.gateway.denoise import StepDelta, denoise_views, step_event
from cde.gateway.errors import invalid
from cde.gateway.generation import Generation, encode_requests
from cde.gateway.http_utils import read_body, until_disconnect
from cde.gateway.json_out import JsonResponse
from cde.gateway.logs import ContentLog, response_id
from cde.gateway.params import check_prompt, generate_requests, stop_list
from cde.gateway.prompts import encode_prompts
from cde.gateway.schemas import MAX_CHOICES, CompletionRequest
from cde.gateway.sse import EventStreamResponse
from cde.gateway.state import ServerState
from cde.shared.tokenizer import get_tokenizer
from starlette.requests import Request
from starlette.responses import Response


async def _prompts(prompt, tokenizer, info) -> list[list[int]]:
    if isinstance(prompt, str):
        return await encode_prompts(tokenizer, [prompt], info)
    if not prompt:
        raise invalid("the prompt must not be empty", "prompt")
    if isinstance(prompt[0], str):
        return await encode_prompts(tokenizer, prompt, info)
    if isinstance(prompt[0], int):
        return [list(prompt)]
    return [list(p) for p in prompt]


def check_stream_options(body) -> None:
    if body.stream_options is not None and not body.stream:
        raise invalid("stream_options is only allowed when stream is true", "stream_options")


def usage(prompt_tokens: int, completion_tokens: int) -> dict:
    return {
        "prompt_tokens": prompt_tokens,
        "completion_tokens": completion_tokens,
        "total_tokens": prompt_tokens + completion_tokens,
    }


async def create_completion(request: Request) -> Response:
    state: ServerState = request.app.state.cde
    body = await read_body(request, CompletionRequest)
    info = state.model_info(body.model)
    check_stream_options(body)
    if body.best_of is not None and body.best_of != body.n:
        raise invalid("best_of must equal n: CDE does not rank candidates (no logprobs)", "best_of")
    tok = get_tokenizer(info.instruct)
    prompts = await _prompts(body.prompt, tok, info)
    if len(prompts) * body.n > MAX_CHOICES:
        raise invalid(f"{len(prompts)} prompts x n={body.n} choices is more than {MAX_CHOICES} in one request", "n")
    for ids in prompts:
        check_prompt(ids, body.max_tokens, info, "prompt")
    cmpl_id = response_id(request, "cmpl")
    content = ContentLog(state.log_requests, cmpl_id)
    content.asked(prompt=body.prompt)
    reqs = generate_requests(body, prompts, body.max_tokens, info, state.labels, cmpl_id)
    frames = await encode_requests(reqs)
    gen = Generation(
        state.router,
        state.metrics,
        reqs,
        frames,
        tok,
        stop_list(body),
        renderer(reqs, tok, state.labels, info),
        denoise_views(reqs, tok, state.labels, info),
    )
    n_prompt = sum(len(p) for p in prompts)
    state.metrics.prompt_tokens.inc(n_prompt)
    prompt_of = [prompts[i // body.n] for i in range(len(reqs))]
    head = {"id": cmpl_id, "object": "text_completion", "created": int(time.time()), "model": body.model}

    def choice(index: int, text: str, token_ids: list[int], finish_reason, attribution, first: bool) -> dict:
        c = {"index": index, "text": text, "logprobs": None, "finish_reason": finish_reason}
        if body.return_token_ids:
            c["token_ids"] = token_ids
            if first:
                c["prompt_token_ids"] = prompt_of[index]
        if attribution is not None:
            c["attribution"] = attribution
        return c

    if body.stream:
        include_usage = bool(body.stream_options and body.stream_options.include_usage)

        async def chunks():
            extra = {"usage": None} if include_usage else {}
            if body.echo:
                for i in range(len(reqs)):
                    yield {**head, "choices": [choice(i, tok.decode(prompt_of[i]), [], None, None, True)], **extra}
            started = set(range(len(reqs))) if body.echo else set()
            async for d in gen.stream():
                if isinstance(d, StepDelta):
                    yield step_event(head, "text_completion.step", d)
                    continue
                first = d.index not in started
                started.add(d.index)
                yield {
                    **head,
                    "choices": [choice(d.index, d.text, d.token_ids, d.finish_reason, d.attribution, first)],
                    **extra,
                }
            if include_usage:
                yield {**head, "choices": [], "usage": usage(n_prompt, gen.completion_tokens)}

        return EventStreamResponse(content.streamed(chunks()), on_close=gen.close)

    async def complete() -> Response:
        results = await gen.collect()
        choices = [
            choice(
                c.index,
                (tok.decode(prompt_of[c.index]) if body.echo else "") + c.text,
                c.token_ids,
                c.finish_reason,
                c.attribution,
                True,
            )
            for c in results
        ]
        content.answered({c["index"]: c["text"] for c in choices})
        return JsonResponse({**head, "choices": choices, "usage": usage(n_prompt, gen.completion_tokens)})

    try:
        return await until_disconnect(request, complete())
    finally:
        gen.close()
