"""The worker's check of every GenerateRequest field (shared/request_bounds.py): each value past
its bound is refused with the field named, each value at its bound passes, and no field of the
request or of a spec it carries is left without a rule."""

import dataclasses
import math
import typing

import pytest
from cde.shared.config import MASK_ID
from cde.shared.limits import (
    INT_MAX,
    MAX_INPUT_ATTRIBUTION_WORK,
    MAX_REPETITION_PENALTY,
    MAX_STEERING_STRENGTH,
    MIN_REPETITION_PENALTY,
    LimitError,
)
from cde.shared.protocol import (
    AttributionSpec,
    FlashBlockSpec,
    GenerateRequest,
    InputAttributionSpec,
    SteeringSpec,
)
from cde.shared.request_bounds import BOUNDS, check_generate_request


@dataclasses.dataclass
class Model:
    context_len: int = 256
    vocab_size: int = 1000
    n_layers: int = 8
    n_concepts: int = 96


MODEL = Model()


def _req(**kw) -> GenerateRequest:
    return GenerateRequest("r", [1], **kw)


def _nested_classes(cls: type) -> set[type]:
    """`cls` and every dataclass its fields' types name, however deep."""
    found = {cls}
    for hint in typing.get_type_hints(cls).values():
        for arg in (hint, *typing.get_args(hint)):
            if dataclasses.is_dataclass(arg) and arg not in found:
                found |= _nested_classes(arg)
    return found


def test_every_field_has_a_rule():
    for cls in _nested_classes(GenerateRequest):
        missing = {f.name for f in dataclasses.fields(cls)} - set(BOUNDS.get(cls, {}))
        assert not missing, f"{cls.__name__}: add a rule for {sorted(missing)} to shared/request_bounds.py"


@pytest.mark.parametrize(
    ("req", "param"),
    [
        (_req(top_k=2**63), "top_k"),  # finding 3: overflowed the int64 staging buffer
        (_req(top_k=-1), "top_k"),
        (_req(temperature=math.nan), "temperature"),
        (_req(temperature=1e300), "temperature"),
        (_req(top_p=1.5), "top_p"),
        (_req(repetition_penalty=0.0), "repetition_penalty"),
        (_req(repetition_penalty=math.inf), "repetition_penalty"),
        (_req(repetition_penalty=1e-40), "repetition_penalty"),  # 0 in float32: logits / 0
        (_req(repetition_penalty=MAX_REPETITION_PENALTY * 2), "repetition_penalty"),
        (_req(seed=2**64), "seed"),
        (_req(tokens_per_step=65), "tokens_per_step"),
        (_req(tokens_per_step=0), "tokens_per_step"),
        (_req(confidence_threshold=-0.5), "confidence_threshold"),
        (_req(max_tokens=0), "max_tokens"),
        (_req(max_tokens=2**40), "max_tokens"),
        (_req(max_tokens=256), "max_tokens"),  # past the context
        (_req(stop=["s"] * 17), "stop"),
        (_req(stop=["s" * 1001]), "stop"),
        (_req(stop_token_ids=[1] * 65), "stop_token_ids"),
        (_req(stop_token_ids=[1000]), "stop_token_ids"),
        (GenerateRequest("r" * 257, [1]), "request_id"),
        (_req(client="c" * 129), "client"),
        (GenerateRequest("r", [1000]), "prompt"),
        (_req(steering=SteeringSpec([1] * 97)), "steering.concepts"),
        (_req(steering=SteeringSpec([96])), "steering.concepts"),
        (_req(steering=SteeringSpec([-1])), "steering.concepts"),
        (_req(steering=SteeringSpec([1], relu_logit_mask={i: 1.0 for i in range(97)})), "steering.relu_logit_mask"),
        (_req(steering=SteeringSpec([1], strength=MAX_STEERING_STRENGTH * 1.01)), "steering.strength"),
        (_req(steering=SteeringSpec([1], strength=float("nan"))), "steering.strength"),
        (_req(steering=SteeringSpec([1], relu_logit_mask={1: float("inf")})), "steering.relu_logit_mask"),
        (_req(steering=SteeringSpec([1], inject_layer=-1)), "steering.inject_layer"),
        (_req(steering=SteeringSpec([1], inject_layer=2**31)), "steering.inject_layer"),
        (_req(steering=SteeringSpec([1], schedule="sometimes")), "steering.schedule"),
        (_req(steering=SteeringSpec([1], cutoff_tokens=2**63)), "steering.cutoff_tokens"),
        (_req(attribution=AttributionSpec(top_k=2**63)), "attribution.top_k"),
        (_req(attribution=AttributionSpec(chunking="page")), "attribution.chunking"),
        (_req(attribution=AttributionSpec(inputs=InputAttributionSpec(steps=65))), "attribution.inputs.steps"),
        (_req(attribution=AttributionSpec(inputs=InputAttributionSpec(top_k=0))), "attribution.inputs.top_k"),
        (_req(attribution=AttributionSpec(inputs=InputAttributionSpec(scope="x"))), "attribution.inputs.scope"),
        (_req(flashblock=FlashBlockSpec(tau=-1)), "flashblock.tau"),
        (_req(flashblock=FlashBlockSpec(max_reuse=2**63)), "flashblock.max_reuse"),
        (_req(frequency_penalty=2.5), "frequency_penalty"),
        (_req(presence_penalty=math.nan), "presence_penalty"),
        (_req(logit_bias={1000: 1.0}), "logit_bias.1000"),
        (_req(logit_bias={5: -101.0}), "logit_bias.5"),
        (_req(logit_bias={i: 1.0 for i in range(1025)}), "logit_bias"),
        (_req(min_tokens=-1), "min_tokens"),
        (_req(max_tokens=4, min_tokens=5), "min_tokens"),
    ],
)
def test_a_value_past_its_bound_is_refused_naming_the_field(req, param):
    with pytest.raises(LimitError) as caught:
        check_generate_request(req, MODEL)
    assert caught.value.param == param, caught.value


def test_bounds_are_written_as_given():
    """An integral bound in full (the CLI printed `[1, 2.14748e+09]` for max_tokens)."""
    with pytest.raises(LimitError, match=r"must be in \[1e-06, 1000000\], got 1e-09"):
        check_generate_request(_req(repetition_penalty=1e-9), MODEL)
    with pytest.raises(LimitError, match=rf"top_k must be in \[0, {INT_MAX}\]"):
        check_generate_request(_req(top_k=-2), MODEL)


def test_a_prompt_may_not_hold_a_mask():
    """The official generator never unmasks a prompt position; cached prompt pages cannot keep a
    mask there as it does (re-steered and re-read every step), so it is refused, naming the prompt."""
    full_vocab = Model(vocab_size=MASK_ID + 1)
    check_generate_request(GenerateRequest("r", [1, MASK_ID - 1]), full_vocab)
    with pytest.raises(LimitError, match=r"<\|mask\|>\) at prompt position 1") as caught:
        check_generate_request(GenerateRequest("r", [1, MASK_ID, 2]), full_vocab)
    assert caught.value.param == "prompt"


def test_values_at_the_bounds_pass():
    check_generate_request(
        GenerateRequest(
            "r" * 256,
            [999] * 128,
            max_tokens=128,
            temperature=2.0,
            top_p=1.0,
            top_k=INT_MAX,
            repetition_penalty=MIN_REPETITION_PENALTY,
            seed=2**64 - 1,
            tokens_per_step=64,
            confidence_threshold=1.0,
            stop=["s" * 1000] * 16,
            stop_token_ids=[999] * 64,
            frequency_penalty=-2.0,
            presence_penalty=2.0,
            logit_bias={i: (-1) ** i * 100.0 for i in range(1000)},
            min_tokens=128,
            steering=SteeringSpec(
                [95] * 96,
                strength=-MAX_STEERING_STRENGTH,
                inject_layer=8,
                cutoff_tokens=INT_MAX,
                relu_logit_mask={i: MAX_STEERING_STRENGTH for i in range(96)},
            ),
            attribution=AttributionSpec(top_k=128, inputs=InputAttributionSpec(top_k=256, steps=64)),
            flashblock=FlashBlockSpec(64, 64),
            client="c" * 128,
        ),
        Model(context_len=MAX_INPUT_ATTRIBUTION_WORK),
    )


def test_input_attribution_work_is_bounded():
    """steps x tokens x (prompt + tokens): finding 5's steps 64 over 448 tokens is refused."""
    big = Model(context_len=4096)
    ia = AttributionSpec(inputs=InputAttributionSpec(steps=64))
    with pytest.raises(LimitError) as caught:
        check_generate_request(GenerateRequest("r", [1] * 64, max_tokens=448, attribution=ia), big)
    assert caught.value.param == "attribution.inputs.steps"
    # 8 steps over 64 tokens after 64: 65,536, far inside.
    ok = AttributionSpec(inputs=InputAttributionSpec(steps=8))
    check_generate_request(GenerateRequest("r", [1] * 64, max_tokens=64, attribution=ok), big)


def test_input_attribution_needs_a_server_that_can_run_it():
    """Over FP8 weights (`--quantization fp8`) the engine passes input_attribution=False: the
    same entry point refuses it, naming the field; a request that does not ask passes."""
    ia = AttributionSpec(inputs=InputAttributionSpec(steps=1))
    with pytest.raises(LimitError, match="unquantized") as caught:
        check_generate_request(GenerateRequest("r", [1] * 8, max_tokens=8, attribution=ia), MODEL, False)
    assert caught.value.param == "attribution.inputs"
    check_generate_request(GenerateRequest("r", [1] * 8, max_tokens=8, attribution=AttributionSpec()), MODEL, False)


def test_the_context_error_names_what_to_change():
    from cde.shared.limits import check_context

    with pytest.raises(
        LimitError, match=r"prompt \(10 tokens\) \+ max_tokens \(5\) exceeds .* or lower max_tokens"
    ) as e:
        check_context(10, 5, 12)
    assert e.value.param == "max_tokens"
    with pytest.raises(LimitError) as e:  # /tokenize: nothing to generate, only the prompt to shorten
        check_context(13, 0, 12)
    assert e.value.param == "prompt" and "max_tokens" not in str(e.value)
    # A prompt that fills the context, max_tokens null (defaulted to 1): the prompt alone is named
    with pytest.raises(LimitError, match=r"fills the context, leaving no room to generate") as e:
        check_context(12, 1, 12, "messages", "max_completion_tokens")
    assert e.value.param == "messages" and "max_completion_tokens" not in str(e.value)
