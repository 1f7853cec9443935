"""Request bodies of the chat API (`/v1/chat/completions`): the messages and their content
parts, and the chat fields beside the sampling ones (gateway/schemas.py, whose rules hold here
too: refused what CDE cannot honour, accepted and ignored what changes nothing)."""

from __future__ import annotations

from typing import Annotated, Any, Literal

from cde.gateway.body import Body
from cde.gateway.schemas import SamplingParams, given, only, reject
from cde.gateway.structured_schemas import ResponseFormat, ToolCall, ToolChoice, ToolSpec
from cde.shared.limits import INT_MAX, MAX_CHOICES, MAX_TOOL_CALL_ID_CHARS, MAX_TOOLS, MAX_TOP_LOGPROBS
from pydantic import Discriminator, Field, model_validator


class PromptCacheOptions(Body):
    mode: Literal["implicit", "explicit"] | None = None
    ttl: Literal["30m"] | None = None


class PromptCacheBreakpoint(Body):
    mode: Literal["explicit"]
    ttl: Literal["30m", "12h"] | None = None


class TextPart(Body):
    type: Literal["text"]
    text: str
    prompt_cache_breakpoint: PromptCacheBreakpoint | None = None  # OpenAI's cache hint: accepted, ignored


class RefusalPart(Body):
    """An assistant reply's refusal as a content part (OpenAI's assistant message): its text, as
    vLLM renders it."""

    type: Literal["refusal"]
    refusal: str

    @property
    def text(self) -> str:
        return self.refusal


_ContentPart = Annotated[TextPart | RefusalPart, Discriminator("type")]  # another type is an error naming it


# What the openai SDK's `message.model_dump()` carries back into a history as null: nothing to render.
_DUMPED_NULLS = frozenset({"audio", "function_call", "tool_calls", "reasoning_content"})


class ChatMessage(Body):
    role: Literal["system", "developer", "user", "assistant", "tool"]
    # Absent is null: OpenAI's assistant message with tool_calls needs none (litellm leaves it out);
    # any other message needs it (_reply_fields).
    content: str | list[_ContentPart] | None = None
    name: str | None = None  # accepted, not rendered: the template has no place for it
    # An assistant reply's refusal text, url citations and the SDK's parse() result, as a reply
    # appended to the history carries them: they change nothing about the prompt (vLLM ignores
    # them too).
    refusal: str | None = None
    annotations: list[dict[str, Any]] | None = None
    parsed: Any = None
    tool_calls: list[ToolCall] | None = Field(None, max_length=MAX_CHOICES)  # assistant turns
    tool_call_id: str | None = Field(None, max_length=MAX_TOOL_CALL_ID_CHARS)  # tool turns

    @model_validator(mode="before")
    @classmethod
    def _drop_dumped_nulls(cls, v: Any) -> Any:
        if isinstance(v, dict):
            return {k: x for k, x in v.items() if not (x is None and k in _DUMPED_NULLS)}
        return v

    @model_validator(mode="after")
    def _reply_fields(self) -> ChatMessage:
        if self.role != "assistant":
            for name in ("refusal", "annotations", "parsed"):
                if getattr(self, name) is not None:
                    raise ValueError(f"{name} belongs to assistant messages only")
        if self.role != "assistant" and any(isinstance(p, RefusalPart) for p in self.content or ()):
            raise ValueError("a refusal content part belongs to assistant messages only")
        if self.content is None and not (self.role == "assistant" and self.tool_calls):
            raise ValueError("content may be null or absent only in an assistant message with tool_calls")
        if self.tool_calls and self.role != "assistant":
            raise ValueError("only assistant messages have tool_calls")
        if (self.role == "tool") != (self.tool_call_id is not None):
            raise ValueError("a tool message has a tool_call_id, and only a tool message")
        return self

    def text(self) -> str:
        if self.content is None:
            return ""
        if isinstance(self.content, str):
            return self.content
        # vLLM's joiner: two parts are two lines, not one run-on word
        return "\n".join(p.text for p in self.content)


class ChatCompletionRequest(SamplingParams):
    messages: list[ChatMessage] = Field(min_length=1)
    max_completion_tokens: int | None = Field(None, ge=1, le=INT_MAX)
    modalities: list[Literal["text"]] | None = Field(None, description='only ["text"]: the model writes text')
    prediction: dict[str, Any] | None = Field(None, description="accepted, ignored: it never changes the output")
    # OpenAI's prompt-cache hints (accepted, ignored like prompt_cache_key: caching never changes the output)
    prompt_cache_options: PromptCacheOptions | None = None
    prompt_cache_retention: Literal["in_memory", "24h"] | None = None
    # Refused: each would change the output and CDE cannot honour it.
    functions: list[Any] | None = Field(None, **only(None))
    function_call: Any = Field(None, **only(None))
    audio: dict[str, Any] | None = Field(None, **only(None))
    web_search_options: dict[str, Any] | None = Field(None, **only(None))
    reasoning_effort: str | None = Field(None, **only(None, "none"))
    verbosity: str | None = Field(None, **only(None))
    logprobs: bool | None = False
    top_logprobs: int | None = Field(None, ge=0, le=MAX_TOP_LOGPROBS)
    response_format: ResponseFormat | None = None
    tools: list[ToolSpec] | None = Field(None, max_length=MAX_TOOLS)
    tool_choice: ToolChoice | None = None
    parallel_tool_calls: bool = Field(True, description="false: at most one tool call per answer")
    add_generation_prompt: bool = Field(True, description="vLLM's: false ends the prompt after the messages")
    continue_final_message: bool = Field(
        False, description="vLLM's: the last message left open (no end of turn) for the answer to continue"
    )
    _no_functions = reject("functions", "function_call", when=given, hint=" (the legacy form of tools)")
    _no_audio = reject("audio", when=given, hint=" (the model writes text only)")
    _no_search = reject("web_search_options", when=given, hint=" (CDE has no web search)")
    _no_reasoning = reject(
        "reasoning_effort", when=lambda v: v not in (None, "none"), hint=" (Steerling has no reasoning mode)"
    )
    _no_verbosity = reject("verbosity", when=given, hint=" (no control of the answer's length but max_tokens)")

    def logprob_alternatives(self) -> int | None:
        return (self.top_logprobs or 0) if self.logprobs else None
