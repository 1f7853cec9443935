"""POST /v1/chat/completions (instruct checkpoints: the Llama-3-style template in the tokenizer)."""

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
from cde.gateway.generation import Choice, Delta
from cde.gateway.json_out import JsonResponse
from cde.gateway.logprobs_render import chat_logprobs
from cde.gateway.logs import ContentLog, response_id
from cde.gateway.params import check_prompt
from cde.gateway.prompts import encode_chat
from cde.gateway.schemas import ChatCompletionRequest
from cde.gateway.structured import check_grammar
from cde.gateway.tool_output import StreamedAnswer, answer_message
from cde.gateway.tools import active_tools, chat_grammar, render_messages
from cde.shared.tokenizer import get_tokenizer
from starlette.requests import Request
from starlette.responses import Response


async def create_chat_completion(request: Request) -> Response:
    state, body, info = await open_request(request, ChatCompletionRequest)
    if not info.instruct:
        raise invalid(
            f"model `{body.model}` is a base checkpoint without a chat template; use /v1/completions",
            "model",
            "chat_not_supported",
        )
    if body.max_tokens is not None and body.max_completion_tokens is not None:
        raise invalid("set max_tokens or max_completion_tokens, not both", "max_completion_tokens")
    if body.top_logprobs is not None and not body.logprobs:
        raise invalid("top_logprobs needs logprobs: true", "top_logprobs")
    tok = get_tokenizer(True)
    tools = active_tools(body)
    constraint = chat_grammar(body, tools)
    if constraint is not None:
        await check_grammar(*constraint, info)
    prompt = await encode_chat(tok, render_messages(body), info)
    if len(prompt) >= info.context_len:
        raise invalid(
            f"the messages take {len(prompt)} tokens; this model's context is {info.context_len}",
            "messages",
            "context_length_exceeded",
        )
    # OpenAI's default is "until done": whatever the context leaves.
    max_tokens = body.max_completion_tokens or body.max_tokens or info.context_len - len(prompt)
    check_prompt(
        prompt, max_tokens, info, "messages", "max_completion_tokens" if body.max_completion_tokens else "max_tokens"
    )
    chat_id = response_id(request, "chatcmpl")
    content = ContentLog(state.log_requests, chat_id)
    content.asked(messages=[m.model_dump(exclude_none=True) for m in body.messages])
    grammar = constraint[0] if constraint else None
    reqs, gen = await start_generation(
        state, body, [prompt], max_tokens, info, tok, chat_id, client_identity(request), grammar
    )
    created = int(time.time())

    # As vLLM: the prompt's ids on the response (streamed: its first chunk), the choices' own on them.
    prompt_ids = {"prompt_token_ids": prompt} if body.return_token_ids else {}

    def extras(c: dict, token_ids: list[int], attribution: dict | None) -> dict:
        if body.return_token_ids:
            c["token_ids"] = token_ids
        if attribution is not None:
            c["attribution"] = attribution
        return c

    if body.stream:
        with_usage = include_usage(body)
        head = {
            "id": chat_id,
            "object": "chat.completion.chunk",
            "created": created,
            "model": body.model,
            **({"usage": None} if with_usage else {}),
        }
        role = {"role": "assistant", "content": ""}
        answers = [StreamedAnswer(bool(tools)) for _ in reqs]

        def chunk(d: Delta, first: bool) -> dict:
            delta, finish_reason = answers[d.index].delta(d.text, d.finish_reason)
            c = {
                "index": d.index,
                "delta": delta,
                "logprobs": None if d.logprobs is None else chat_logprobs(tok, d.token_ids, d.logprobs),
                "finish_reason": finish_reason,
            }
            return {**head, "choices": [extras(c, d.token_ids, d.attribution)]}

        return stream_response(
            gen,
            content,
            head,
            "chat.completion.step",
            (
                {
                    **head,
                    "choices": [{"index": i, "delta": dict(role), "logprobs": None, "finish_reason": None}],
                    **(prompt_ids if i == 0 else {}),
                }
                for i in range(len(reqs))
            ),
            chunk,
            set(),
            (lambda: {**head, "choices": [], "usage": usage(gen, len(prompt), len(reqs))}) if with_usage else None,
        )

    def choice(c: Choice) -> dict:
        message, finish_reason = answer_message(c.text, c.finish_reason, bool(tools))
        logprobs = None if c.logprobs is None else chat_logprobs(tok, c.token_ids, c.logprobs)
        return {"index": c.index, "message": message, "logprobs": logprobs, "finish_reason": finish_reason}

    async def complete() -> Response:
        choices = [extras(choice(c), c.token_ids, c.attribution) for c in await gen.collect()]
        content.answered({c["index"]: c["message"]["content"] for c in choices})
        return JsonResponse(
            {
                "id": chat_id,
                "object": "chat.completion",
                "created": created,
                "model": body.model,
                "choices": choices,
                "usage": usage(gen, len(prompt), len(reqs)),
                **prompt_ids,
            }
        )

    return await respond_when_done(request, gen, complete)
