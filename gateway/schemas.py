"""Request bodies of the OpenAI-compatible API (the source of /openapi.json too).

Unknown fields are rejected, and so are known OpenAI fields whose meaning CDE cannot honour
(logprobs, penalties, logit_bias, suffix): silently ignoring them would change what the caller
asked for.
"""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator


class _Body(BaseModel):
    model_config = ConfigDict(extra="forbid")


def _reject(*fields: str, when=bool, hint: str = ""):
    """A validator refusing `fields` whenever `when(value)` holds: an OpenAI field CDE cannot
    honour is an error, never silently ignored."""

    def check(cls, v, info):
        if when(v):
            raise ValueError(f"{info.field_name}{hint} is not supported by CDE")
        return v

    return field_validator(*fields)(classmethod(check))


def _given(v) -> bool:
    return v is not None


class StreamOptions(_Body):
    include_usage: bool = False


class SteeringParams(_Body):
    """Concept steering. A preset fills defaults; explicit fields override it."""

    concepts: list[int | str] = Field(default_factory=list, description="known-concept ids, or labels")
    strength: float | None = None
    normalize: bool | None = None
    inject_layer: int | None = Field(None, ge=0)
    schedule: Literal["fixed", "hard_cutoff"] | None = None
    cutoff_tokens: int | None = Field(None, ge=0)
    relu_logit_mask: dict[str, float] | None = Field(None, description="concept id (or label) -> strength")
    preset: Literal["amplify", "suppress"] | None = None


class AttributionParams(_Body):
    top_k: int = Field(10, ge=1, le=128)
    per_token: bool = False
    chunking: Literal["block", "endofchunk"] = "block"


class FlashBlockParams(_Body):
    """FlashBlock: reuse the attention to the cached pages across the steps of a block."""

    tau: int = Field(2, ge=0, le=64, description="recompute after a step that unmasked at least tau tokens")
    max_reuse: int = Field(16, ge=0, le=64, description="recompute after this many reuses in a row")


class SamplingParams(_Body):
    model: str
    max_tokens: int | None = Field(None, ge=1)
    temperature: float = Field(1.0, ge=0.0, le=2.0)
    top_p: float = Field(1.0, gt=0.0, le=1.0)
    n: int = Field(1, ge=1, le=16)
    stream: bool = False
    stream_options: StreamOptions | None = None
    stop: str | list[str] | None = None
    seed: int | None = None
    user: str | None = None
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    logit_bias: dict[str, float] | None = None
    # CDE / vLLM extensions
    top_k: int = Field(0, ge=-1, description="0 or -1: off")
    repetition_penalty: float = Field(1.0, gt=0.0)
    stop_token_ids: list[int] | None = None
    tokens_per_step: int = Field(1, ge=1, le=64, description="tokens unmasked per denoising step")
    confidence_threshold: float | None = Field(None, gt=0.0, le=1.0)
    entropy_sampling: bool = False
    return_token_ids: bool = False
    steering: SteeringParams | None = None
    attribution: bool | AttributionParams | None = None
    flashblock: bool | FlashBlockParams | None = Field(
        None, description="false: exact attention; true or {tau, max_reuse}: FlashBlock reuse; absent: the server's default")
    stream_denoise: bool = Field(False, description="with stream: also an SSE `step` event per denoising step")

    _no_penalties = _reject("presence_penalty", "frequency_penalty", hint=" (use repetition_penalty)")
    _no_logit_bias = _reject("logit_bias")

    @field_validator("stop")
    @classmethod
    def _stops(cls, v):
        stops = [v] if isinstance(v, str) else (v or [])
        if len(stops) > 16:
            raise ValueError("at most 16 stop sequences")
        if any(not s for s in stops):
            raise ValueError("stop sequences must be non-empty strings")
        return v


class CompletionRequest(SamplingParams):
    prompt: str | list[str] | list[int] | list[list[int]]
    max_tokens: int | None = Field(16, ge=1)
    echo: bool = False
    suffix: str | None = None
    best_of: int | None = Field(None, ge=1)
    logprobs: int | None = None

    _no_suffix = _reject("suffix")
    _no_logprobs = _reject("logprobs", when=_given)


class TextPart(_Body):
    type: Literal["text"]
    text: str


class ChatMessage(_Body):
    role: Literal["system", "developer", "user", "assistant"]
    content: str | list[TextPart]
    name: str | None = None

    def text(self) -> str:
        return self.content if isinstance(self.content, str) else "".join(p.text for p in self.content)


class ResponseFormat(_Body):
    type: Literal["text"]


class ChatCompletionRequest(SamplingParams):
    messages: list[ChatMessage] = Field(min_length=1)
    max_completion_tokens: int | None = Field(None, ge=1)
    logprobs: bool = False
    top_logprobs: int | None = None
    response_format: ResponseFormat | None = None

    _no_logprobs = _reject("logprobs")
    _no_top_logprobs = _reject("top_logprobs", when=_given)
