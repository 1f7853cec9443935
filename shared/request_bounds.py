"""Every field of a `GenerateRequest`, checked against its bound before any tensor is built.

A peer on the worker port need not be our gateway, and one value the engine cannot represent
(`top_k: 2**63` overflowed the int64 staging buffer) must fail that request alone, at the door.
The bounds are one table per message class, the gateway's schemas stating the same numbers
(shared/limits.py); `tests/shared/test_request_bounds.py` fails when a field of
`GenerateRequest` or of a spec it carries has no entry here, so a new field cannot be forgotten:
add its rule to the table of its class (a numeric range, a set of choices, a length, or a
function for what depends on the model)."""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable
from typing import Any, Protocol

from cde.shared.limits import (
    INT_MAX,
    MAX_ATTRIBUTION_TOP_K,
    MAX_CLIENT_CHARS,
    MAX_FLASHBLOCK_KNOB,
    MAX_GRAMMAR_CHARS,
    MAX_INPUT_ATTRIBUTION_STEPS,
    MAX_INPUT_ATTRIBUTION_TOP_K,
    MAX_LOGIT_BIAS,
    MAX_LOGIT_BIAS_VALUE,
    MAX_PENALTY,
    MAX_REPETITION_PENALTY,
    MAX_REQUEST_ID_CHARS,
    MAX_STEERING_STRENGTH,
    MAX_STOP_CHARS,
    MAX_STOP_TOKEN_IDS,
    MAX_STOPS,
    MAX_TEMPERATURE,
    MAX_TOKENS_PER_STEP,
    MAX_TOP_LOGPROBS,
    MIN_REPETITION_PENALTY,
    SEED_MAX,
    SEED_MIN,
    LimitError,
    check_context,
    check_input_attribution_work,
    check_prompt_ids,
    check_token_ids,
)
from cde.shared.protocol import (
    AttributionSpec,
    FlashBlockSpec,
    GenerateRequest,
    InputAttributionSpec,
    SteeringSpec,
)


class ModelBounds(Protocol):
    """What the served model accepts (a ModelConfig, or the Heartbeat that reports it)."""

    @property
    def context_len(self) -> int: ...
    @property
    def vocab_size(self) -> int: ...
    @property
    def n_layers(self) -> int: ...
    @property
    def n_concepts(self) -> int: ...


Rule = Callable[[Any, ModelBounds, str], None]


def _range(lo: float, hi: float | Callable[[ModelBounds], float], above_lo: bool = False) -> Rule:
    """A finite number in [lo, hi] ((lo, hi] when `above_lo`; hi may depend on the model);
    bools are not numbers here."""

    def check(value: Any, model: ModelBounds, param: str) -> None:
        top = hi(model) if callable(hi) else hi
        if isinstance(value, bool) or not isinstance(value, int | float) or not math.isfinite(value):
            raise LimitError(f"{param} must be a finite number", param)
        if not (lo < value if above_lo else lo <= value) or value > top:
            low = "(" if above_lo else "["
            raise LimitError(f"{param} must be in {low}{_bound(lo)}, {_bound(top)}], got {_short(value)}", param)

    return check


def _optional(rule: Rule) -> Rule:
    def check(value: Any, model: ModelBounds, param: str) -> None:
        if value is not None:
            rule(value, model, param)

    return check


def _choice(*allowed: object) -> Rule:
    def check(value: Any, model: ModelBounds, param: str) -> None:
        if value not in allowed:
            raise LimitError(f"{param} must be one of {list(allowed)}", param)

    return check


def _text(max_chars: int) -> Rule:
    def check(value: Any, model: ModelBounds, param: str) -> None:
        if len(value) > max_chars:
            raise LimitError(f"{param} is longer than {max_chars} characters", param)

    return check


def _any(value: Any, model: ModelBounds, param: str) -> None:
    """A bool, or a field whose type alone bounds it (the wire decoder checks types)."""


def _stops(value: list[str], model: ModelBounds, param: str) -> None:
    if len(value) > MAX_STOPS or any(len(s) > MAX_STOP_CHARS for s in value):
        raise LimitError(f"at most {MAX_STOPS} stop strings of at most {MAX_STOP_CHARS} characters", param)


def _stop_token_ids(value: list[int], model: ModelBounds, param: str) -> None:
    if len(value) > MAX_STOP_TOKEN_IDS:
        raise LimitError(f"at most {MAX_STOP_TOKEN_IDS} stop token ids", param)
    check_token_ids(value, model.vocab_size, param)


def _concept_ids(ids: Any, model: ModelBounds, param: str) -> None:
    # By length before any entry is looked at: a longer list can only repeat ids.
    if len(ids) > model.n_concepts:
        raise LimitError(f"{param} names more concepts than the model's {model.n_concepts}", param)
    bad = next((c for c in ids if not 0 <= c < model.n_concepts), None)
    if bad is not None:
        raise LimitError(f"unknown concept id {_short(bad)} in {param}", param)


def _relu_mask(mask: dict[int, float], model: ModelBounds, param: str) -> None:
    _concept_ids(mask, model, param)
    strength = _range(-MAX_STEERING_STRENGTH, MAX_STEERING_STRENGTH)
    for value in mask.values():
        strength(value, model, param)


def check_logit_bias(bias: dict[int, float], model: ModelBounds, param: str = "logit_bias") -> None:
    """Token ids in the vocabulary, biases in OpenAI's [-100, 100]; a bad entry names itself
    (`logit_bias.<id>`), as the gateway's 400 does."""
    if len(bias) > MAX_LOGIT_BIAS:
        raise LimitError(f"at most {MAX_LOGIT_BIAS} {param} entries", param)
    for token, value in bias.items():
        entry = f"{param}.{token}"
        check_token_ids([token], model.vocab_size, entry)
        _range(-MAX_LOGIT_BIAS_VALUE, MAX_LOGIT_BIAS_VALUE)(value, model, entry)


def check_min_tokens(min_tokens: int, max_tokens: int) -> None:
    if min_tokens > max_tokens:
        raise LimitError(f"min_tokens ({min_tokens}) must not exceed max_tokens ({max_tokens})", "min_tokens")


def _bound(x: float) -> str:
    """An integral bound in full (2147483647, not 2.14748e+09), any other one short."""
    return str(int(x)) if float(x).is_integer() and abs(x) < 1e18 else f"{x:g}"


def _short(value: object) -> str:
    return repr(value)[:40]


_STRENGTH = _range(-MAX_STEERING_STRENGTH, MAX_STEERING_STRENGTH)

# One table per message class: field name -> rule. The prompt and max_tokens are checked together
# (the context) after the table.
BOUNDS: dict[type, dict[str, Rule]] = {
    GenerateRequest: {
        "request_id": _text(MAX_REQUEST_ID_CHARS),
        "prompt_ids": _any,  # by the context and the vocabulary, below
        "max_tokens": _range(1, INT_MAX),
        "temperature": _range(0, MAX_TEMPERATURE),
        "top_p": _range(0, 1),
        "top_k": _range(0, INT_MAX),
        "entropy_sampling": _any,
        "repetition_penalty": _range(MIN_REPETITION_PENALTY, MAX_REPETITION_PENALTY),
        "seed": _optional(_range(SEED_MIN, SEED_MAX)),
        "tokens_per_step": _range(1, MAX_TOKENS_PER_STEP),
        "confidence_threshold": _optional(_range(0, 1)),
        "stop": _stops,
        "stop_token_ids": _stop_token_ids,
        "steering": _any,  # its own table
        "attribution": _any,
        "stream_denoise": _any,
        "flashblock": _any,
        "client": _text(MAX_CLIENT_CHARS),
        "frequency_penalty": _range(-MAX_PENALTY, MAX_PENALTY),
        "presence_penalty": _range(-MAX_PENALTY, MAX_PENALTY),
        "logit_bias": check_logit_bias,
        "min_tokens": _range(0, INT_MAX),  # and at most max_tokens, below
        "ignore_eos": _any,
        "include_stop_str_in_output": _any,
        "stream_tokens": _any,
        "logprobs": _optional(_range(0, MAX_TOP_LOGPROBS)),  # alternatives per token: one top-k over the vocabulary
        "grammar": _optional(_text(MAX_GRAMMAR_CHARS)),  # and compiled under llguidance's limits (shared/grammar.py)
    },
    SteeringSpec: {
        "concepts": _concept_ids,
        "strength": _STRENGTH,
        "normalize": _any,
        "inject_layer": _range(0, INT_MAX),  # past the last layer: no injection, as the official model
        "schedule": _choice("fixed", "hard_cutoff"),
        "cutoff_tokens": _range(1, INT_MAX),
        "relu_logit_mask": _relu_mask,
    },
    AttributionSpec: {
        "top_k": _range(1, MAX_ATTRIBUTION_TOP_K),
        "per_token": _any,
        "chunking": _choice("block", "endofchunk"),
        "inputs": _any,
    },
    InputAttributionSpec: {
        "top_k": _range(1, MAX_INPUT_ATTRIBUTION_TOP_K),
        "steps": _range(1, MAX_INPUT_ATTRIBUTION_STEPS),
        "scope": _choice("prompt", "all"),
    },
    FlashBlockSpec: {
        "tau": _range(0, MAX_FLASHBLOCK_KNOB),
        "max_reuse": _range(0, MAX_FLASHBLOCK_KNOB),
    },
}


def check_fields(message: object, model: ModelBounds, prefix: str = "") -> None:
    """Each field of `message` by its class's table, then each nested spec the same way."""
    rules = BOUNDS[type(message)]
    for f in dataclasses.fields(message):  # type: ignore[arg-type]  # a dataclass of BOUNDS
        value = getattr(message, f.name)
        param = prefix + f.name
        rules[f.name](value, model, param)
        if type(value) in BOUNDS:
            check_fields(value, model, param + ".")


def check_generate_request(req: GenerateRequest, model: ModelBounds, input_attribution: bool = True) -> None:
    """Raise LimitError (a ValueError) naming the first field of `req` outside what `model`
    accepts: every rule a request must pass, the one entry point of the worker's admission and of
    the gateway's model-dependent checks. `input_attribution`: whether the server can run it (not
    over FP8 weights, whose linear layers have no backward). Cheap: lists are checked by length
    before they are walked, the prompt last."""
    check_fields(req, model)
    check_context(len(req.prompt_ids), req.max_tokens, model.context_len)
    check_min_tokens(req.min_tokens, req.max_tokens)
    inputs = req.attribution.inputs if req.attribution is not None else None
    if inputs is not None:
        if not input_attribution:
            raise LimitError(
                "input attribution needs the unquantized model (this worker serves --quantization fp8)",
                "attribution.inputs",
            )
        check_input_attribution_work(inputs.steps, len(req.prompt_ids), req.max_tokens, "attribution.inputs.steps")
    check_prompt_ids(req.prompt_ids, model.vocab_size, "prompt")
