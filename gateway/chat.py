"""POST /v1/chat/completions (instruct checkpoints: the Llama-3-style template in the tokenizer)."""

from __future__ import annotations

import asyncio
import time

from cde.gateway.chat_render import ChatRenderer
from cde.gateway.chat_schemas import ChatCompletionRequest
from cde.gateway.client_identity import client_identity
from cde.gateway.completion_flow import ResponseHead, answer, open_request, start_generation
from cde.gateway.errors import invalid
from cde.gateway.params import check_prompt, truncated, until_the_context
from cde.gateway.prompts import encode_chat
from cde.gateway.request_logs import ContentLog, response_id
from cde.gateway.structured import check_grammar
from cde.gateway.tools import active_tools, chat_grammar, render_messages
from cde.shared.tokenizer import get_tokenizer
from starlette.requests import Request
from starlette.responses import Response


async def create_chat_completion(request: Request) -> Response:
    state, body, info = await open_request(request, ChatCompletionRequest)
    if not info.instruct:
        raise invalid(
            f"model `{state.api_name(info)}` is a base checkpoint without a chat template; use /v1/completions",
            "model",
            "chat_not_supported",
        )
    if body.max_tokens is not None and body.max_completion_tokens is not None:
        raise invalid("set max_tokens or max_completion_tokens, not both", "max_completion_tokens")
    if body.top_logprobs and not body.logprobs:  # 0 asks for nothing (vLLM refuses above 0 only)
        raise invalid("top_logprobs needs logprobs: true", "top_logprobs")
    tok = get_tokenizer(True)
    tools = active_tools(body)
    # A schema's checks and llguidance's conversion take tens of ms at the 32 Ki-character bound:
    # on a thread, as long prompts are tokenized (docs/security.md).
    constraint = await asyncio.to_thread(chat_grammar, body, tools)
    if constraint is not None:
        if body.continue_final_message:
            raise invalid(
                f"continue_final_message cannot be combined with {constraint[1]}: its grammar holds the "
                "whole answer from its start, not the rest of a message",
                "continue_final_message",
            )
        await check_grammar(*constraint, info, request)
    prompt = truncated(
        await encode_chat(
            tok,
            render_messages(body.messages, body.tools),
            info,
            body.add_generation_prompt,
            body.continue_final_message,
        ),
        body,
    )
    if len(prompt) >= info.context_len:
        raise invalid(
            f"the messages take {len(prompt)} tokens; this model's context is {info.context_len}",
            "messages",
            "context_length_exceeded",
        )
    max_tokens = until_the_context(prompt, body.max_completion_tokens or body.max_tokens, info)
    check_prompt(
        prompt, max_tokens, info, "messages", "max_completion_tokens" if body.max_completion_tokens else "max_tokens"
    )
    chat_id = response_id(request, "chatcmpl")
    content = ContentLog(state.log_requests, chat_id)
    content.asked(messages=[m.model_dump(exclude_none=True) for m in body.messages])
    gen = await start_generation(
        state, body, [prompt], max_tokens, info, tok, chat_id, client_identity(request), constraint
    )
    head = ResponseHead(chat_id, int(time.time()), state.api_name(info))
    return await answer(request, body, gen, content, ChatRenderer(body, head, prompt, bool(tools), tok))
