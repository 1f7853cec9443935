"""POST /v1/chat/completions (instruct checkpoints: the Llama-3-style template in the tokenizer)."""

from __future__ import annotations

import time

from cde.gateway.attribution_render import renderer
from cde.gateway.completions import check_stream_options, usage
from cde.gateway.denoise import StepDelta, denoise_views, step_event
from cde.gateway.errors import invalid
from cde.gateway.generation import Generation, encode_requests
from cde.gateway.http_utils import read_body, until_disconnect
from cde.gateway.json_out import JsonResponse
from cde.gateway.logs import ContentLog, response_id
from cde.gateway.params import check_prompt, generate_requests, stop_list
from cde.gateway.prompts import encode_chat
from cde.gateway.schemas import ChatCompletionRequest
from cde.gateway.sse import EventStreamResponse
from cde.gateway.state import ServerState
from cde.shared.tokenizer import get_tokenizer
from starlette.requests import Request
from starlette.responses import Response


async def create_chat_completion(request: Request) -> Response:
    state: ServerState = request.app.state.cde
    body = await read_body(request, ChatCompletionRequest)
    info = state.model_info(body.model)
    check_stream_options(body)
    if not info.instruct:
        raise invalid(
            f"model `{body.model}` is a base checkpoint without a chat template; use /v1/completions",
            "model",
            "chat_not_supported",
        )
    if body.max_tokens is not None and body.max_completion_tokens is not None:
        raise invalid("set max_tokens or max_completion_tokens, not both", "max_completion_tokens")
    tok = get_tokenizer(True)
    prompt = await encode_chat(
        tok, [{"role": "system" if m.role == "developer" else m.role, "content": m.text()} for m in body.messages], info
    )
    if len(prompt) >= info.block_size:
        raise invalid(
            f"the messages take {len(prompt)} tokens; this model's context is {info.block_size}",
            "messages",
            "context_length_exceeded",
        )
    # OpenAI's default is "until done": whatever the context leaves.
    max_tokens = body.max_completion_tokens or body.max_tokens or info.block_size - len(prompt)
    check_prompt(
        prompt, max_tokens, info, "messages", "max_completion_tokens" if body.max_completion_tokens else "max_tokens"
    )
    chat_id = response_id(request, "chatcmpl")
    content = ContentLog(state.log_requests, chat_id)
    content.asked(messages=[m.model_dump(exclude_none=True) for m in body.messages])
    reqs = generate_requests(body, [prompt], max_tokens, info, state.labels, chat_id)
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
    state.metrics.prompt_tokens.inc(len(prompt))
    created = int(time.time())

    def extras(c: dict, token_ids: list[int], attribution, first: bool) -> dict:
        if body.return_token_ids:
            c["token_ids"] = token_ids
            if first:
                c["prompt_token_ids"] = prompt
        if attribution is not None:
            c["attribution"] = attribution
        return c

    if body.stream:
        include_usage = bool(body.stream_options and body.stream_options.include_usage)
        head = {
            "id": chat_id,
            "object": "chat.completion.chunk",
            "created": created,
            "model": body.model,
            **({"usage": None} if include_usage else {}),
        }

        async def chunks():
            for i in range(len(reqs)):
                delta = {"role": "assistant", "content": ""}
                yield {**head, "choices": [{"index": i, "delta": delta, "logprobs": None, "finish_reason": None}]}
            started = set()
            async for d in gen.stream():
                if isinstance(d, StepDelta):
                    yield step_event(head, "chat.completion.step", d)
                    continue
                c = {
                    "index": d.index,
                    "delta": {"content": d.text} if d.text else {},
                    "logprobs": None,
                    "finish_reason": d.finish_reason,
                }
                yield {**head, "choices": [extras(c, d.token_ids, d.attribution, d.index not in started)]}
                started.add(d.index)
            if include_usage:
                yield {**head, "choices": [], "usage": usage(len(prompt), gen.completion_tokens)}

        return EventStreamResponse(content.streamed(chunks()), on_close=gen.close)

    async def complete() -> Response:
        choices = [
            extras(
                {
                    "index": c.index,
                    "message": {"role": "assistant", "content": c.text},
                    "logprobs": None,
                    "finish_reason": c.finish_reason,
                },
                c.token_ids,
                c.attribution,
                True,
            )
            for c in await gen.collect()
        ]
        content.answered({c["index"]: c["message"]["content"] for c in choices})
        return JsonResponse(
            {
                "id": chat_id,
                "object": "chat.completion",
                "created": created,
                "model": body.model,
                "choices": choices,
                "usage": usage(len(prompt), gen.completion_tokens),
            }
        )

    try:
        return await until_disconnect(request, complete())
    finally:
        gen.close()
