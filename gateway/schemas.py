"""Request bodies of the OpenAI-compatible API (the source of /openapi.json too): the sampling
fields every completion takes, and `/v1/completions`'; the chat ones build on them
(gateway/chat_schemas.py).

Unknown fields are rejected, and so are known OpenAI fields whose meaning CDE cannot honour
(`suffix`, `web_search_options`, ...): silently ignoring them would change what the caller asked
for. Fields that change nothing about the output (`metadata`, `store`, `user`, ...) are accepted
and ignored, as vLLM does. docs/api.md's compatibility table lists every field, and
tests/api/test_api_compat.py holds this file to it.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING, Annotated, Any, Literal, TypeVar

from cde.gateway.body import Body
from cde.gateway.errors import UNSUPPORTED
from cde.gateway.structured_schemas import StructuredOutputs
from cde.shared.limits import (
    INT_MAX,
    MAX_ATTRIBUTION_TOP_K,
    MAX_CHOICES,
    MAX_COMPLETION_LOGPROBS,
    MAX_CONCEPT_LIST,
    MAX_FLASHBLOCK_KNOB,
    MAX_INPUT_ATTRIBUTION_STEPS,
    MAX_INPUT_ATTRIBUTION_TOP_K,
    MAX_LOGIT_BIAS,
    MAX_LOGIT_BIAS_VALUE,
    MAX_METADATA_KEY_CHARS,
    MAX_METADATA_PAIRS,
    MAX_METADATA_VALUE_CHARS,
    MAX_N,
    MAX_PENALTY,
    MAX_REPETITION_PENALTY,
    MAX_STEERING_STRENGTH,
    MAX_STOP_CHARS,
    MAX_STOP_TOKEN_IDS,
    MAX_STOPS,
    MAX_TEMPERATURE,
    MAX_TOKENS_PER_STEP,
    MIN_REPETITION_PENALTY,
    SEED_MAX,
    SEED_MIN,
)
from cde.shared.protocol import AttributionSpec, FlashBlockSpec, InputAttributionSpec
from pydantic import (
    Discriminator,
    Field,
    StringConstraints,
    Tag,
    field_validator,
)
from pydantic_core import PydanticCustomError

if TYPE_CHECKING:
    from pydantic import ValidationInfo

T = TypeVar("T")


def reject(*fields: str, when: Callable[[Any], bool] = bool, hint: str = "") -> Any:
    """A validator refusing `fields` whenever `when(value)` holds: an OpenAI field CDE cannot
    honour is an error, never silently ignored; its code is OpenAI's for a parameter it knows and
    refuses (gateway/errors.py), which clients that drop such a parameter and retry look for."""

    def check(cls: type, v: Any, info: ValidationInfo) -> Any:
        if when(v):
            raise PydanticCustomError(UNSUPPORTED, f"'{info.field_name}'{hint} is not supported by CDE")
        return v

    return field_validator(*fields)(classmethod(check))


def given(v: object) -> bool:
    return v is not None


def documented_as(schema: dict) -> dict:
    """Field kwargs replacing the field's /openapi.json schema by `schema`: what its validator
    really enforces, so that schema-driven clients (and fuzzers) know it."""

    def replace(s: dict) -> None:
        s.clear()
        s.update(schema)

    return {"json_schema_extra": replace}


def only(*values: Any) -> dict:
    """An OpenAI field CDE accepts only with its "off" values."""
    return documented_as({"enum": list(values)})


_STOP = {"type": "string", "minLength": 1, "maxLength": MAX_STOP_CHARS}


_NonEmpty = Annotated[list[T], Field(min_length=1)]
_MetadataKey = Annotated[str, StringConstraints(max_length=MAX_METADATA_KEY_CHARS)]
_MetadataValue = Annotated[str, StringConstraints(max_length=MAX_METADATA_VALUE_CHARS)]
_Batch = Annotated[list[T], Field(min_length=1, max_length=MAX_CHOICES)]


def _prompt_shape(v: Any) -> str | None:
    """Which of the prompt forms `v` is meant to be, so that its errors name what is wrong with
    that form (not why it is not one of the others); None for none of them."""
    if isinstance(v, str):
        return "Text"
    if not isinstance(v, list):
        return None
    first = v[0] if isinstance(v, list) and v else None
    return "Texts" if isinstance(first, str) else "TokenLists" if isinstance(first, list) else "Tokens"


_Prompt = Annotated[
    Annotated[str, Tag("Text")]
    | Annotated[_Batch[str], Tag("Texts")]
    | Annotated[_NonEmpty[int], Tag("Tokens")]
    | Annotated[_Batch[_NonEmpty[int]], Tag("TokenLists")],
    Discriminator(
        _prompt_shape,
        custom_error_type="prompt_type",
        custom_error_message="a prompt is a string, an array of strings, an array of token ids "
        "or an array of token-id arrays",
    ),
]


class StreamOptions(Body):
    include_usage: bool = False
    continuous_usage_stats: bool = False  # vLLM's: with include_usage, every chunk has the usage so far
    include_obfuscation: bool | None = None  # accepted, ignored: CDE pads no stream event


_Strength = Annotated[float, Field(ge=-MAX_STEERING_STRENGTH, le=MAX_STEERING_STRENGTH)]


class SteeringParams(Body):
    """Concept steering. A preset fills defaults; explicit fields override it."""

    concepts: list[int | str] = Field(
        default_factory=list,
        max_length=MAX_CONCEPT_LIST,
        description="known-concept ids, or labels (at most the model's n_concepts)",
    )
    strength: float | None = Field(None, ge=-MAX_STEERING_STRENGTH, le=MAX_STEERING_STRENGTH)
    normalize: bool | None = None
    inject_layer: int | None = Field(None, ge=0, le=INT_MAX)
    schedule: Literal["fixed", "hard_cutoff"] | None = None
    cutoff_tokens: int | None = Field(None, ge=1, le=INT_MAX)  # the official SteeringConfig's bound
    relu_logit_mask: dict[str, _Strength] | None = Field(
        None, max_length=MAX_CONCEPT_LIST, description="concept id (or label) -> strength"
    )
    preset: Literal["amplify", "suppress"] | None = None
    group: bool = Field(
        False,
        description="expand each concept to its concept-catalog group (ConceptCatalog.group); "
        "suppress masks the first concept only",
    )


class InputAttributionParams(Body):
    """Input attribution: integrated gradients over the snapshot each token was committed from."""

    top_k: int = Field(
        InputAttributionSpec.top_k,
        ge=1,
        le=MAX_INPUT_ATTRIBUTION_TOP_K,
        description="input positions listed per token and per chunk",
    )
    steps: int = Field(
        InputAttributionSpec.steps,
        ge=1,
        le=MAX_INPUT_ATTRIBUTION_STEPS,
        description="interpolation steps (right Riemann; 1: input x gradient)",
    )
    scope: Literal["prompt", "all"] = Field("prompt", description="all: the generated tokens seen count too")


class AttributionParams(Body):
    top_k: int = Field(AttributionSpec.top_k, ge=1, le=MAX_ATTRIBUTION_TOP_K)
    per_token: bool = False
    chunking: Literal["block", "endofchunk"] = "block"
    inputs: InputAttributionParams | None = None


class FlashBlockParams(Body):
    """FlashBlock: reuse the attention to the cached pages across the steps of a block."""

    tau: int = Field(
        FlashBlockSpec.tau,
        ge=0,
        le=MAX_FLASHBLOCK_KNOB,
        description="recompute after a step that unmasked at least tau tokens",
    )
    max_reuse: int = Field(
        FlashBlockSpec.max_reuse, ge=0, le=MAX_FLASHBLOCK_KNOB, description="recompute after this many reuses in a row"
    )


class SamplingParams(Body):
    model: str | None = Field(None, description="the served model's name; left out: the served model (as vLLM)")
    max_tokens: int | None = Field(None, ge=1, le=INT_MAX)
    temperature: float = Field(1.0, ge=0.0, le=MAX_TEMPERATURE)
    top_p: float = Field(1.0, gt=0.0, le=1.0)
    n: int = Field(1, ge=1, le=MAX_N)
    stream: bool = False
    stream_options: StreamOptions | None = None
    stop: str | list[str] | None = Field(
        None,
        **documented_as({"anyOf": [_STOP, {"type": "array", "items": _STOP, "maxItems": MAX_STOPS}, {"type": "null"}]}),
    )
    seed: int | None = Field(None, ge=SEED_MIN, le=SEED_MAX)
    presence_penalty: float | None = Field(0.0, ge=-MAX_PENALTY, le=MAX_PENALTY)
    frequency_penalty: float | None = Field(0.0, ge=-MAX_PENALTY, le=MAX_PENALTY)
    logit_bias: dict[str, float] | None = Field(
        None,
        max_length=MAX_LOGIT_BIAS,
        description=f"token id (a decimal string) -> bias in [-{MAX_LOGIT_BIAS_VALUE:g}, {MAX_LOGIT_BIAS_VALUE:g}]",
    )
    # Accepted and ignored: they change nothing about the output (OpenAI's bookkeeping, caching
    # and abuse-monitoring hints).
    user: str | None = None
    metadata: dict[_MetadataKey, _MetadataValue] | None = Field(None, max_length=MAX_METADATA_PAIRS)
    store: bool | None = None
    service_tier: Literal["auto", "default", "flex", "scale", "priority", "fast"] | None = None
    prompt_cache_key: str | None = None
    safety_identifier: str | None = None
    # CDE / vLLM extensions
    top_k: int = Field(0, ge=-1, le=INT_MAX, description="0 or -1: off")
    repetition_penalty: float = Field(1.0, ge=MIN_REPETITION_PENALTY, le=MAX_REPETITION_PENALTY)
    stop_token_ids: list[int] | None = Field(None, max_length=MAX_STOP_TOKEN_IDS)
    include_stop_str_in_output: bool = Field(False, description="vLLM's: the stop string stays at the text's end")
    truncate_prompt_tokens: int | None = Field(
        None, ge=1, le=INT_MAX, description="vLLM's: only the prompt's last k tokens are fed (left truncation)"
    )
    tokens_per_step: int = Field(1, ge=1, le=MAX_TOKENS_PER_STEP, description="tokens unmasked per denoising step")
    confidence_threshold: float | None = Field(None, gt=0.0, le=1.0)
    entropy_sampling: bool = False
    return_token_ids: bool = False
    steering: SteeringParams | None = None
    attribution: bool | AttributionParams | None = None
    flashblock: bool | FlashBlockParams | None = Field(
        None,
        description="false: exact attention; true or {tau, max_reuse}: FlashBlock reuse; absent: the server's default",
    )
    stream_denoise: bool = Field(False, description="with stream: also an SSE `step` event per denoising step")
    ignore_eos: bool = Field(False, description="EOT does not end the sequence (vLLM)")
    # vLLM's, accepted at the values that change nothing here: special tokens never reach the text,
    # and min_p 0 keeps every token
    skip_special_tokens: bool = Field(True, **only(True))
    min_p: float | None = Field(None, **only(None, 0))
    min_tokens: int = Field(0, ge=0, le=INT_MAX, description="EOT and stop_token_ids banned before this many (vLLM)")
    stream_granularity: Literal["token", "block"] | None = Field(
        None,
        description="with stream: token: each block's committed left prefix as it grows; block: a chunk per "
        "block; absent: token, or block with stream_denoise (its step events carry every token as it lands)",
    )
    structured_outputs: StructuredOutputs | None = Field(
        None, description="constrained decoding (vLLM's extension): json, json_object, regex, choice or grammar"
    )

    def logprob_alternatives(self) -> int | None:
        """Top alternatives per generated token that the request asks for; None: no logprobs."""
        return None

    _special_tokens_kept = reject("skip_special_tokens", when=lambda v: v is False, hint=" false")
    _min_p = reject("min_p", when=lambda v: v not in (None, 0), hint=" other than 0")

    @field_validator("stop")
    @classmethod
    def _stops(cls, v: Any) -> Any:
        stops = [v] if isinstance(v, str) else (v or [])
        if len(stops) > MAX_STOPS:
            raise ValueError(f"at most {MAX_STOPS} stop sequences")
        if any(not s or len(s) > MAX_STOP_CHARS for s in stops):
            raise ValueError(f"stop sequences must be non-empty strings of at most {MAX_STOP_CHARS} characters")
        return v


class CompletionRequest(SamplingParams):
    prompt: _Prompt
    max_tokens: int | None = Field(16, ge=1, le=INT_MAX)
    echo: bool = False
    suffix: str | None = Field(None, **only(None, ""))
    best_of: int | None = Field(None, ge=1, le=MAX_N)
    logprobs: int | None = Field(None, ge=0, le=MAX_COMPLETION_LOGPROBS)

    _no_suffix = reject("suffix")

    def logprob_alternatives(self) -> int | None:
        return self.logprobs
