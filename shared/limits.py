"""Bounds on what one generation request may carry. The gateway's schemas state them (a 400
naming the field); the worker re-checks every GenerateRequest that reaches its socket, since a
peer on the worker port need not be our gateway. Lists are bounded by what the model can use,
so that no request costs more to encode, send or check than the model could ever act on."""

from __future__ import annotations

import math

from cde.shared.protocol import FlashBlockSpec, GenerateRequest

MAX_STOPS = 16
MAX_STOP_CHARS = 1000  # a stop string longer than this is not a stop, it is a payload
MAX_STOP_TOKEN_IDS = 64
MAX_REQUEST_ID_CHARS = 256
# Steering strengths (in logit units when normalized) and ReLU-mask strengths: a 100-logit shift
# already saturates the softmax (e^-100 underflows float32); far larger values overflow the
# residual stream to inf/NaN and only produce degenerate text.
MAX_STEERING_STRENGTH = 100.0
# Before the model is known (schema validation), concept lists are capped at a size above any
# Steerling's known head (33,732 at 8B); the model's own n_concepts then bounds them exactly.
MAX_CONCEPT_LIST = 1 << 16


class LimitError(ValueError):
    """A request outside what the served model accepts. The gateway answers it with a 400 naming
    `param` (with `code`, when OpenAI has one); the worker refuses the request with its message."""

    def __init__(self, message: str, param: str, code: str | None = None) -> None:
        super().__init__(message)
        self.param, self.code = param, code


def check_context(
    prompt_len: int,
    max_tokens: int,
    context_len: int,
    prompt_param: str = "prompt",
    max_tokens_param: str = "max_tokens",
) -> None:
    """The prompt and the tokens to generate must fit the model's context. The error names the
    field to change: the prompt when it alone fills the context, else `max_tokens_param`."""
    if prompt_len + max_tokens > context_len:
        raise LimitError(
            f"This model's maximum context length is {context_len} tokens; the prompt ({prompt_len} tokens) + "
            f"{max_tokens_param} ({max_tokens}) exceeds the context. Shorten the prompt or lower {max_tokens_param}.",
            prompt_param if prompt_len >= context_len else max_tokens_param,
            "context_length_exceeded",
        )


def check_token_ids(ids: list[int], vocab_size: int, param: str) -> None:
    """Every id must be in the model's vocabulary. Walks the whole list: check the context first."""
    bad = next((t for t in ids if not 0 <= t < vocab_size), None)
    if bad is not None:
        raise LimitError(f"token id {bad} is outside the vocabulary [0, {vocab_size})", param)


# The API's cap on FlashBlock's knobs (gateway/schemas.py): a block has 64 positions, so neither a
# larger tau nor a larger max_reuse changes anything.
MAX_FLASHBLOCK_KNOB = 64


def check_flashblock(spec: FlashBlockSpec) -> None:
    """FlashBlock's two knobs may not be negative: the rule of the worker (every request) and of
    `cde serve/worker --flashblock-*`; the API's schema states it as ge=0."""
    if not (spec.tau >= 0 and spec.max_reuse >= 0):
        raise LimitError("flashblock tau and max_reuse must be >= 0", "flashblock")


def clip(text: str, limit: int) -> str:
    """Text that may quote a peer or a client, cut for an error message or a log line."""
    return text if len(text) <= limit else f"{text[:limit]}... ({len(text) - limit} more characters)"


def check_request(req: GenerateRequest, n_concepts: int) -> None:
    """Raise ValueError for a request outside these bounds (its lists checked by length first,
    so a huge one is refused without being walked)."""
    if len(req.request_id) > MAX_REQUEST_ID_CHARS:
        raise ValueError(f"request_id is longer than {MAX_REQUEST_ID_CHARS} characters")
    if len(req.stop) > MAX_STOPS or any(len(s) > MAX_STOP_CHARS for s in req.stop):
        raise ValueError(f"at most {MAX_STOPS} stop strings of at most {MAX_STOP_CHARS} characters")
    if len(req.stop_token_ids) > MAX_STOP_TOKEN_IDS:
        raise ValueError(f"at most {MAX_STOP_TOKEN_IDS} stop token ids")
    s = req.steering
    if s is None:
        return
    if len(s.concepts) > n_concepts or len(s.relu_logit_mask) > n_concepts:
        raise ValueError(f"steering names more concepts than the model's {n_concepts}")
    if not all(_strength_ok(v) for v in [s.strength, *s.relu_logit_mask.values()]):
        raise ValueError(f"steering strengths must be finite and within +-{MAX_STEERING_STRENGTH:g}")


def _strength_ok(value: float) -> bool:
    return math.isfinite(value) and abs(value) <= MAX_STEERING_STRENGTH
