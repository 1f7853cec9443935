"""Request bodies of vLLM's /tokenize and /detokenize (gateway/tokenize_routes.py); the chat form
takes the messages of gateway/schemas.py's chat request."""

from __future__ import annotations

from typing import Annotated, Any

from cde.gateway.body import Body
from cde.gateway.chat_schemas import ChatMessage
from cde.gateway.structured_schemas import ToolSpec
from cde.shared.limits import MAX_TOOLS
from pydantic import Discriminator, Field, RootModel, Tag


class TokenizeCompletionRequest(Body):
    """vLLM's POST /tokenize, prompt form. add_special_tokens as the official tokenizer's flag:
    <|bos|> before and <|endoftext|> after (completions feed a prompt without them)."""

    model: str | None = None
    prompt: str
    add_special_tokens: bool = True
    return_token_strs: bool | None = False


class TokenizeChatRequest(Body):
    """vLLM's POST /tokenize, messages form: the ids /v1/chat/completions would feed the model
    (with `tools`, their system turn first, as a chat request with those tools)."""

    model: str | None = None
    messages: list[ChatMessage] = Field(min_length=1)
    tools: list[ToolSpec] | None = Field(None, max_length=MAX_TOOLS)
    add_generation_prompt: bool = True
    continue_final_message: bool = False
    add_special_tokens: bool = False
    return_token_strs: bool | None = False


class TokenizeRequest(RootModel[Any]):
    """Either form; as vLLM, a body with `messages` is the chat form."""

    root: Annotated[
        Annotated[TokenizeChatRequest, Tag("Chat")] | Annotated[TokenizeCompletionRequest, Tag("Prompt")],
        Discriminator(lambda v: "Chat" if isinstance(v, dict) and "messages" in v else "Prompt"),
    ]


class DetokenizeRequest(Body):
    model: str | None = None
    tokens: list[int]
