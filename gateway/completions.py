"""POST /v1/completions."""

from __future__ import annotations

import asyncio
import time

from cde.gateway.client_identity import client_identity
from cde.gateway.completion_flow import ResponseHead, answer, open_request, start_generation
from cde.gateway.completion_render import CompletionRenderer
from cde.gateway.errors import invalid
from cde.gateway.model_info import ModelInfo
from cde.gateway.params import check_prompt, truncated, until_the_context
from cde.gateway.prompts import encode_prompts
from cde.gateway.request_logs import ContentLog, response_id
from cde.gateway.schemas import CompletionRequest
from cde.gateway.structured import check_grammar, format_grammar
from cde.shared.limits import MAX_CHOICES
from cde.shared.tokenizer import Tokenizer, get_tokenizer
from starlette.requests import Request
from starlette.responses import Response


async def _prompts(prompt: str | list, tokenizer: Tokenizer, info: ModelInfo) -> list[list[int]]:
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
        raise invalid("best_of must equal n: CDE does not rank candidates", "best_of", "unsupported_value")
    if body.echo and body.logprobs is not None:
        raise invalid(
            "echo with logprobs is not supported: the prompt's tokens have no log-probabilities in a "
            "diffusion model (nothing predicts them left to right); ask for logprobs without echo",
            "echo",
        )
    tok = get_tokenizer(info.instruct)
    prompts = [truncated(ids, body) for ids in await _prompts(body.prompt, tok, info)]
    if len(prompts) * body.n > MAX_CHOICES:
        raise invalid(f"{len(prompts)} prompts x n={body.n} choices is more than {MAX_CHOICES} in one request", "n")
    for ids in prompts:
        check_prompt(ids, until_the_context(ids, body.max_tokens, info), info, "prompt")
    cmpl_id = response_id(request, "cmpl")
    content = ContentLog(state.log_requests, cmpl_id)
    content.asked(prompt=body.prompt)
    constraint = (  # on a thread, as in gateway/chat.py
        await asyncio.to_thread(format_grammar, None, body.structured_outputs)
        if body.structured_outputs is not None
        else None
    )
    if constraint is not None:
        await check_grammar(*constraint, info, request)
    gen = await start_generation(
        state, body, prompts, body.max_tokens, info, tok, cmpl_id, client_identity(request), constraint
    )
    head = ResponseHead(cmpl_id, int(time.time()), state.api_name(info))
    return await answer(request, body, gen, content, CompletionRenderer(body, head, prompts, tok))
