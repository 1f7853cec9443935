"""API request -> engine `GenerateRequest`s: the steering presets and concept labels, then the
checks that need the model (context length, vocabulary, layers, concepts) by the function the
worker's admission runs too (shared/request_bounds.py): answering here gives the client a 400
naming the field instead of a failed stream."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

from cde.gateway.concepts import ConceptLabels
from cde.gateway.errors import invalid
from cde.gateway.model_info import ModelInfo
from cde.gateway.schemas import SamplingParams, SteeringParams
from cde.shared import suppress_preset
from cde.shared.limits import SEED_MAX, LimitError, check_context, check_prompt_ids
from cde.shared.protocol import (
    AttributionSpec,
    FlashBlockSpec,
    GenerateRequest,
    InputAttributionSpec,
    SteeringSpec,
)
from cde.shared.request_bounds import check_generate_request


def truncated(ids: list[int], body: SamplingParams) -> list[int]:
    """A prompt's ids as fed: with vLLM's truncate_prompt_tokens k, its last k."""
    k = body.truncate_prompt_tokens
    return ids[-k:] if k is not None else ids


def stop_list(body: SamplingParams) -> list[str]:
    return [body.stop] if isinstance(body.stop, str) else list(body.stop or [])


def until_the_context(ids: list[int], max_tokens: int | None, info: ModelInfo) -> int:
    """`max_tokens`, or where it is null (OpenAI's "until done") whatever the context leaves after
    the prompt: at least 1, so that a prompt filling the context fails check_prompt, naming it."""
    return max_tokens if max_tokens is not None else max(info.context_len - len(ids), 1)


def check_prompt(
    ids: list[int], max_tokens: int, info: ModelInfo, param: str, max_tokens_param: str = "max_tokens"
) -> None:
    """`param` names the prompt's field, `max_tokens_param` the field max_tokens came from: the
    error names the one to change (a prompt that alone fills the context: the prompt)."""
    if not ids:
        raise invalid("the prompt must not be empty", param)
    with as_invalid():
        check_context(len(ids), max_tokens, info.context_len, param, max_tokens_param)
        check_prompt_ids(ids, info.vocab_size, param)


@contextlib.contextmanager
def as_invalid() -> Iterator[None]:
    """A LimitError (the rules the worker checks too, shared/limits.py) as the client's 400."""
    try:
        yield
    except LimitError as exc:
        raise invalid(str(exc), exc.param, exc.code) from None


def generate_requests(
    body: SamplingParams,
    prompts: list[list[int]],
    max_tokens: int | None,
    info: ModelInfo,
    labels: ConceptLabels,
    prefix: str,
    client: str = "",
    grammar: str | None = None,
) -> list[GenerateRequest]:
    """One engine request per (prompt, choice), in OpenAI choice order (prompt-major), each
    checked by the worker's rules; `max_tokens` None: until_the_context, per prompt."""
    if body.stream_denoise and not body.stream:
        raise invalid("stream_denoise streams the denoising steps: it needs stream: true", "stream_denoise")
    steering = _steering(body.steering, info, labels) if body.steering is not None else None
    attribution = _attribution(body.attribution)
    logit_bias = _logit_bias(body.logit_bias)
    out = []
    for p, ids in enumerate(prompts):
        for i in range(body.n):
            out.append(
                GenerateRequest(
                    request_id=f"{prefix}-{p}-{i}",
                    prompt_ids=ids,
                    max_tokens=until_the_context(ids, max_tokens, info),
                    temperature=body.temperature,
                    top_p=body.top_p,
                    top_k=max(body.top_k, 0),
                    entropy_sampling=body.entropy_sampling,
                    repetition_penalty=body.repetition_penalty,
                    # n samples of one seeded request must differ from each other yet be reproducible.
                    seed=None if body.seed is None else (body.seed + i) % (SEED_MAX + 1),
                    tokens_per_step=body.tokens_per_step,
                    confidence_threshold=body.confidence_threshold,
                    stop=stop_list(body),
                    stop_token_ids=list(body.stop_token_ids or []),
                    steering=steering,
                    attribution=attribution,
                    flashblock=_flashblock(body.flashblock),
                    stream_denoise=body.stream_denoise,
                    client=client,
                    frequency_penalty=body.frequency_penalty or 0.0,
                    presence_penalty=body.presence_penalty or 0.0,
                    logit_bias=logit_bias,
                    min_tokens=body.min_tokens,
                    ignore_eos=body.ignore_eos,
                    include_stop_str_in_output=body.include_stop_str_in_output,
                    stream_tokens=body.stream and _granularity(body) == "token",
                    logprobs=body.logprob_alternatives(),
                    grammar=grammar,
                )
            )
            if i == 0:  # the choices of one prompt differ only in their id and seed
                with as_invalid():
                    check_generate_request(out[-1], info)
    return out


def _logit_bias(bias: dict[str, float] | None) -> dict[int, float]:
    """OpenAI's token-id strings as ids; a key that is not one names itself in the 400."""
    out = {}
    for key, value in (bias or {}).items():
        if not (key.isascii() and key.isdecimal()):
            raise invalid(f"a logit_bias key is a token id, not {key!r}", f"logit_bias.{key}")
        if int(key) in out:  # "5" and "05": which bias was meant?
            raise invalid(f"logit_bias gives token id {int(key)} twice", f"logit_bias.{key}")
        out[int(key)] = value
    return out


def _granularity(body: SamplingParams) -> str:
    """Token streaming by default; stream_denoise keeps its block events (the playground and
    its clients read a text chunk as a block's end) unless token is asked for."""
    return body.stream_granularity or ("block" if body.stream_denoise else "token")


def _flashblock(value: Any) -> FlashBlockSpec | bool | None:
    if value is None or value is False:
        return value
    if value is True:
        return FlashBlockSpec()
    return FlashBlockSpec(tau=value.tau, max_reuse=value.max_reuse)


def _attribution(value: Any) -> AttributionSpec | None:
    if value is None or value is False:
        return None
    if value is True:
        return AttributionSpec()
    inputs = value.inputs and InputAttributionSpec(
        top_k=value.inputs.top_k, steps=value.inputs.steps, scope=value.inputs.scope
    )
    return AttributionSpec(top_k=value.top_k, per_token=value.per_token, chunking=value.chunking, inputs=inputs)


def _preset(name: str | None, info: ModelInfo, first_concept: int | None) -> dict:
    # Presets are tuned for the 32-layer 8B; on smaller models the layer is clamped to exist.
    if name == "suppress":
        if first_concept is None:
            raise invalid("the suppress preset needs at least one concept", "steering.concepts")
        return dict(
            strength=suppress_preset.STRENGTH,
            normalize=False,
            inject_layer=suppress_preset.inject_layer(info.n_layers),
            schedule="fixed",
            cutoff_tokens=suppress_preset.CUTOFF_TOKENS,
            relu_logit_mask={first_concept: suppress_preset.RELU_MASK},
        )
    # "amplify", and the defaults when no preset is named: the wire's own (SteeringSpec).
    amplify = SteeringSpec(concepts=[])
    return dict(
        strength=amplify.strength,
        normalize=amplify.normalize,
        inject_layer=min(amplify.inject_layer, info.n_layers),
        schedule=amplify.schedule,
        cutoff_tokens=amplify.cutoff_tokens,
        relu_logit_mask={},
    )


def _steering(s: SteeringParams, info: ModelInfo, labels: ConceptLabels) -> SteeringSpec:
    # Bounded by what the model can use before any entry is resolved: a longer list only repeats ids.
    for param, given in (("steering.concepts", s.concepts), ("steering.relu_logit_mask", s.relu_logit_mask or ())):
        if len(given) > info.n_concepts:
            raise invalid(f"{len(given)} concepts given; the model has {info.n_concepts}", param)
    concepts = [labels.resolve(c, info.n_concepts, "steering.concepts") for c in s.concepts]
    if s.group:  # the official group injection: one summed direction over the group's members
        concepts = labels.expand_groups(concepts, info.n_concepts)
    if s.preset == "suppress" and concepts:  # the official injection_relu: the focal concept once
        concepts = [concepts[0], *(c for c in concepts[1:] if c != concepts[0])]
    mask = None
    if s.relu_logit_mask is not None:
        mask = {labels.resolve(k, info.n_concepts, "steering.relu_logit_mask"): v for k, v in s.relu_logit_mask.items()}
        if len(mask) < len(s.relu_logit_mask):  # two keys (an id and a label) naming one concept
            raise invalid("relu_logit_mask names a concept twice", "steering.relu_logit_mask")
    if not concepts and not mask:
        raise invalid("steering needs at least one concept", "steering.concepts")
    spec = _preset(s.preset, info, concepts[0] if concepts else None)
    fields = s.model_dump(exclude={"concepts", "relu_logit_mask", "preset", "group"})
    explicit = {k: v for k, v in fields.items() if v is not None}
    spec.update(explicit)
    if mask is not None:
        spec["relu_logit_mask"] = mask
    return SteeringSpec(concepts=concepts, **spec)
