"""Prompt text to token ids for the generation routes, bounded before any work is spent on it.

Tokenizing is superlinear on some text (1 MB of spaces: 1 s; 4 MB: 7 s), and a body may hold
4 MB. No token of the tokenizer is longer than MAX_TOKEN_BYTES, so a text of more bytes than
that times the context cannot fit and is refused untokenized; a long text that may fit is
tokenized on a thread (tiktoken releases the GIL), so the event loop keeps serving meanwhile."""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from cde.gateway.errors import invalid
from cde.gateway.model_info import ModelInfo
from cde.gateway.tool_format import calls_text

if TYPE_CHECKING:
    from cde.gateway.chat_schemas import ChatMessage
    from cde.shared.tokenizer import Tokenizer

MAX_TOKEN_BYTES = 128  # the longest token of cl100k_base (special tokens in text are encoded as text)
THREAD_CHARS = 64 << 10
MIN_MESSAGE_TOKENS = 5  # the chat template's header start, role, header end, "\n\n" and end of turn


def _check_fits(texts: list[str], info: ModelInfo, param: str) -> None:
    size = sum(len(t.encode("utf-8")) for t in texts)
    if size > MAX_TOKEN_BYTES * info.context_len:
        raise invalid(
            f"This model's maximum context length is {info.context_len} tokens; the {param} ({size} bytes) "
            f"is longer than that. Shorten the {param}.",
            param,
            "context_length_exceeded",
        )


async def _run(work: Callable[[], Any], chars: int) -> Any:
    return await asyncio.to_thread(work) if chars > THREAD_CHARS else work()


async def encode_prompts(tok: Tokenizer, texts: list[str], info: ModelInfo) -> list[list[int]]:
    for text in texts:
        _check_fits([text], info, "prompt")
    return await _run(lambda: [tok.encode(t) for t in texts], sum(map(len, texts)))


def template_messages(messages: list[ChatMessage]) -> list[dict]:
    """The API's messages as the chat template takes them (a developer message is a system one; an
    assistant's tool calls follow its content, gateway/tools.py)."""
    return [
        {"role": "system" if m.role == "developer" else m.role, "content": m.text() + calls_text(m)} for m in messages
    ]


async def encode_chat(
    tok: Tokenizer,
    messages: list[dict],
    info: ModelInfo,
    add_generation_prompt: bool = True,
    continue_final_message: bool = False,
) -> list[int]:
    """The chat template's ids of `messages`; `continue_final_message` (vLLM's, with
    add_generation_prompt false) leaves the last message open: its end of turn is left out."""
    if add_generation_prompt and continue_final_message:
        raise invalid("set add_generation_prompt to false to continue the final message", "continue_final_message")
    if len(messages) * MIN_MESSAGE_TOKENS >= info.context_len:
        raise invalid(
            f"{len(messages)} messages take more than this model's context of {info.context_len} tokens",
            "messages",
            "context_length_exceeded",
        )
    contents = [m["content"] for m in messages]
    _check_fits(contents, info, "messages")
    ids = await _run(lambda: tok.chat_prompt(messages, add_generation_prompt), sum(map(len, contents)))
    return ids[:-1] if continue_final_message else ids  # the template ends each message with <|eot_id|>
