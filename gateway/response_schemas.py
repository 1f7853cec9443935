"""What /v1/completions and /v1/chat/completions answer, whole and streamed: OpenAI's shapes, with
vLLM's `token_ids`/`prompt_token_ids` and CDE's `attribution` and `stream_denoise` step events.
/openapi.json is generated from these (gateway/openapi.py), and the routes build them
(gateway/completion_render.py, gateway/chat_render.py).

Presence: a field without a default is always in the JSON (null included). An `Omitted[...]`
field (vLLM's and CDE's additions) is left out while None, and its schema has no null. A chunk's
`usage` is written only when the route set it (`exclude_unset`, gateway/json_out.py): on every
chunk of a stream that asked for it (null until the last), on no chunk of one that did not, as
OpenAI does."""

from __future__ import annotations

from typing import Annotated, Literal, TypeVar

from cde.gateway.attribution_schemas import Attribution, StepAttribution
from pydantic import BaseModel, ConfigDict, Field, with_config
from typing_extensions import TypedDict

T = TypeVar("T")


def _is_none(value: object) -> bool:
    return value is None


def _never_null(schema: dict) -> None:
    """An omitted field's schema is its type's: None is never written. (Not SkipJsonSchema[None]:
    it doubles the field's validation time, and chunks are built per token.)"""
    del schema["default"]
    (written,) = [option for option in schema.pop("anyOf") if option != {"type": "null"}]
    schema.update(written)


Omitted = Annotated[T | None, Field(exclude_if=_is_none, json_schema_extra=_never_null)]

# "abort": a worker that ended the request on its own (the gateway's own aborts answer nobody).
FinishReason = Literal["stop", "length", "tool_calls", "abort"]


class ResponseModel(BaseModel):
    # A non-finite float (an attribution over activations that overflowed) is written as null:
    # strict JSON parsers refuse NaN and Infinity.
    model_config = ConfigDict(extra="forbid", ser_json_inf_nan="null")


class PromptTokensDetails(ResponseModel):
    cached_tokens: int  # of the prompt tokens, those the workers' prefix caches held (docs/api.md)


class Usage(ResponseModel):
    prompt_tokens: int
    completion_tokens: int  # the tokens of the returned text (docs/api.md)
    total_tokens: int
    prompt_tokens_details: Omitted[PromptTokensDetails] = None  # not in a stream's usage so far

    @classmethod
    def of(cls, prompt_tokens: int, completion_tokens: int, cached_tokens: int) -> Usage:
        return cls(
            prompt_tokens=prompt_tokens,
            completion_tokens=completion_tokens,
            total_tokens=prompt_tokens + completion_tokens,
            prompt_tokens_details=PromptTokensDetails(cached_tokens=cached_tokens),
        )

    @classmethod
    def so_far(cls, prompt_tokens: int, completion_tokens: int) -> Usage:
        """A stream's usage before its end (vLLM's continuous_usage_stats): the cached tokens are
        known once the first block is back, so they come with the last chunk only."""
        return cls(
            prompt_tokens=prompt_tokens,
            completion_tokens=completion_tokens,
            total_tokens=prompt_tokens + completion_tokens,
        )


# ---- /v1/completions ----------------------------------------------------------------------------


class CompletionLogprobs(ResponseModel):
    """The legacy shape: per token its text, logprob, best alternatives and character offset."""

    tokens: list[str]
    token_logprobs: list[float]
    top_logprobs: list[dict[str, float]]
    text_offset: list[int]


class CompletionChoice(ResponseModel):
    index: int
    text: str
    logprobs: CompletionLogprobs | None
    finish_reason: FinishReason | None
    token_ids: Omitted[list[int]] = None  # return_token_ids
    prompt_token_ids: Omitted[list[int]] = None  # return_token_ids: the choice's first chunk
    attribution: Omitted[Attribution] = None


class CompletionResponse(ResponseModel):
    id: str
    object: Literal["text_completion"]
    created: int
    model: str
    choices: list[CompletionChoice]
    usage: Usage


class CompletionChunk(ResponseModel):
    """One SSE event of a streamed completion (OpenAI streams `text_completion` objects too)."""

    id: str
    object: Literal["text_completion"]
    created: int
    model: str
    choices: list[CompletionChoice]
    usage: Usage | None = None  # stream_options.include_usage


# ---- /v1/chat/completions -----------------------------------------------------------------------


# Per token and per alternative (up to 20 a token): plain dicts, which pydantic-core checks in a
# fraction of a model's time.
@with_config(ConfigDict(extra="forbid"))
class TopLogprob(TypedDict):
    token: str
    logprob: float
    bytes: list[int] | None  # the token's UTF-8 bytes (a token may hold part of a character); a special's: null


@with_config(ConfigDict(extra="forbid"))
class TokenLogprob(TopLogprob):
    top_logprobs: list[TopLogprob]


class ChatLogprobs(ResponseModel):
    content: list[TokenLogprob]
    refusal: None


class FunctionCall(ResponseModel):
    name: str
    arguments: str  # a JSON object, as text (cut short when finish_reason is "length")


class MessageToolCall(ResponseModel):
    id: str
    type: Literal["function"]
    function: FunctionCall


class DeltaFunction(ResponseModel):
    name: Omitted[str] = None  # in the call's first chunk
    arguments: str  # this chunk's piece of the arguments' text


class DeltaToolCall(ResponseModel):
    """A streamed call: its first chunk has its id, type and name, the next ones more of its
    arguments; joined per index, they are the call."""

    index: int  # of the call in the answer
    id: Omitted[str] = None
    type: Omitted[Literal["function"]] = None
    function: DeltaFunction


class AssistantMessage(ResponseModel):
    role: Literal["assistant"]
    content: str | None  # null for an answer of tool calls
    tool_calls: Omitted[list[MessageToolCall]] = None


class ChatChoice(ResponseModel):
    index: int
    message: AssistantMessage
    logprobs: ChatLogprobs | None
    finish_reason: FinishReason | None
    token_ids: Omitted[list[int]] = None  # return_token_ids
    attribution: Omitted[Attribution] = None


class ChatCompletionResponse(ResponseModel):
    id: str
    object: Literal["chat.completion"]
    created: int
    model: str
    choices: list[ChatChoice]
    usage: Usage
    prompt_token_ids: Omitted[list[int]] = None  # return_token_ids


class ChatDelta(ResponseModel):
    """What a chunk adds to the message: the role (first chunk), text, or pieces of the calls."""

    role: Omitted[Literal["assistant"]] = None
    content: Omitted[str] = None
    tool_calls: Omitted[list[DeltaToolCall]] = None


class ChatStreamChoice(ResponseModel):
    index: int
    delta: ChatDelta
    logprobs: ChatLogprobs | None
    finish_reason: FinishReason | None
    token_ids: Omitted[list[int]] = None
    attribution: Omitted[Attribution] = None


class ChatCompletionChunk(ResponseModel):
    id: str
    object: Literal["chat.completion.chunk"]
    created: int
    model: str
    choices: list[ChatStreamChoice]
    usage: Usage | None = None  # stream_options.include_usage
    prompt_token_ids: Omitted[list[int]] = None  # return_token_ids: the first chunk


# ---- stream_denoise: SSE `step` events (both routes) -------------------------------------------


class DenoiseStep(ResponseModel):
    """What one denoising step of a choice unmasked (offsets count from the completion's start)."""

    index: int
    block: int  # the completion's blocks count from 0
    block_offset: int  # offset of the block's first cell (< 0: it holds the prompt's tail)
    step: int
    offsets: list[int]
    token_ids: list[int]
    tokens: list[str]
    attribution: Omitted[StepAttribution] = None


class StepChunk(ResponseModel):
    id: str
    object: Literal["text_completion.step", "chat.completion.step"]
    created: int
    model: str
    choices: list[DenoiseStep]


# ---- /v1/models ---------------------------------------------------------------------------------


class ModelCard(ResponseModel):
    id: str  # the served name
    object: Literal["model"]
    created: int
    owned_by: str
    root: str  # as vLLM: the checkpoint served, its path or Hub id
    parent: None  # for adapters, which CDE has none of
    max_model_len: int


class ModelList(ResponseModel):
    object: Literal["list"]
    data: list[ModelCard]  # the served model; empty while no worker is alive
