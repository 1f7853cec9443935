"""POST /v1/completions."""

from __future__ import annotations

import time

from cde.gateway.client_identity import client_identity
from cde.gateway.completion_flow import (
    include_usage,
    open_request,
    respond_when_done,
    start_generation,
    stream_response,
    usage,
)
from cde.gateway.errors import invalid
from cde.gateway.generation import Delta, TokenLogprob
from cde.gateway.json_out import JsonResponse
from cde.gateway.logprobs_render import CompletionLogprobs
from cde.gateway.logs import ContentLog, response_id
from cde.gateway.params import check_prompt
from cde.gateway.prompts import encode_prompts
from cde.gateway.schemas import MAX_CHOICES, CompletionRequest
from cde.gateway.structured import check_grammar, format_grammar
from cde.shared.protocol import Heartbeat
from cde.shared.tokenizer import Tokenizer, get_tokenizer
from starlette.requests import Request
from starlette.responses import Response


async def _prompts(prompt: str | list, tokenizer: Tokenizer, info: Heartbeat) -> list[list[int]]:
    if isinstance(prompt, str):
        return await encode_prompts(tokenizer, [prompt], info)
    if not prompt:
        raise invalid("the prompt must not be empty", "prompt")
    if isinstance(prompt[0], str):
        return await encode_prompts(tokenizer, prompt, info)
    if isinstance(prompt[0], int):
        return [list(prompt)]
    return [list(p) for p in prompt]


async def create_completion(request: Request) -> Response:
    state, body, info = await open_request(request, CompletionRequest)
    if body.best_of is not None and body.best_of != body.n:
        raise invalid("best_of must equal n: CDE does not rank candidates", "best_of")
    if body.echo and body.logprobs is not None:
        raise invalid(
            "echo with logprobs is not supported: the prompt's tokens have no log-probabilities in a "
            "diffusion model (nothing predicts them left to right); ask for logprobs without echo",
            "echo",
        )
    tok = get_tokenizer(info.instruct)
    prompts = await _prompts(body.prompt, tok, info)
    if len(prompts) * body.n > MAX_CHOICES:
        raise invalid(f"{len(prompts)} prompts x n={body.n} choices is more than {MAX_CHOICES} in one request", "n")
    for ids in prompts:
        check_prompt(ids, body.max_tokens, info, "prompt")
    cmpl_id = response_id(request, "cmpl")
    content = ContentLog(state.log_requests, cmpl_id)
    content.asked(prompt=body.prompt)
    constraint = format_grammar(None, body.structured_outputs)
    if constraint is not None:
        await check_grammar(*constraint, info)
    grammar = constraint[0] if constraint else None
    reqs, gen = await start_generation(
        state, body, prompts, body.max_tokens, info, tok, cmpl_id, client_identity(request), grammar
    )
    n_prompt = sum(len(p) for p in prompts)
    prompt_of = [prompts[i // body.n] for i in range(len(reqs))]
    head = {"id": cmpl_id, "object": "text_completion", "created": int(time.time()), "model": body.model}

    renders = [CompletionLogprobs(tok) for _ in reqs]

    def choice(
        index: int,
        text: str,
        token_ids: list[int],
        finish_reason: str | None,
        attribution: dict | None,
        first: bool,
        logprobs: list[TokenLogprob] | None = None,
    ) -> dict:
        rendered = None if logprobs is None else renders[index].render(token_ids, logprobs)
        c = {"index": index, "text": text, "logprobs": rendered, "finish_reason": finish_reason}
        if body.return_token_ids:
            c["token_ids"] = token_ids
            if first:
                c["prompt_token_ids"] = prompt_of[index]
        if attribution is not None:
            c["attribution"] = attribution
        return c

    if body.stream:
        with_usage = include_usage(body)
        extra = {"usage": None} if with_usage else {}
        echoed = range(len(reqs)) if body.echo else range(0)

        def chunk(d: Delta, first: bool) -> dict:
            return {
                **head,
                "choices": [choice(d.index, d.text, d.token_ids, d.finish_reason, d.attribution, first, d.logprobs)],
                **extra,
            }

        return stream_response(
            gen,
            content,
            head,
            "text_completion.step",
            ({**head, "choices": [choice(i, tok.decode(prompt_of[i]), [], None, None, True)], **extra} for i in echoed),
            chunk,
            set(echoed),
            (lambda: {**head, "choices": [], "usage": usage(gen, n_prompt, body.n)}) if with_usage else None,
        )

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
                c.logprobs,
            )
            for c in results
        ]
        content.answered({c["index"]: c["text"] for c in choices})
        return JsonResponse({**head, "choices": choices, "usage": usage(gen, n_prompt, body.n)})

    return await respond_when_done(request, gen, complete)
