"""API request -> GenerateRequest: steering presets, overrides, concept labels, n and seeds."""

import pytest
from cde.gateway.concepts import ConceptLabels
from cde.gateway.errors import ApiError
from cde.gateway.model_info import ModelInfo
from cde.gateway.params import check_prompt, generate_requests
from cde.gateway.schemas import CompletionRequest
from cde.shared.catalog import Catalog
from cde.shared.config import MASK_ID
from cde.shared.protocol import AttributionSpec
from pydantic import ValidationError

INFO = ModelInfo("m", context_len=4096, vocab_size=100281, instruct=False, n_layers=32, n_concepts=100)
LABELS = ConceptLabels(
    Catalog.from_rows(
        [
            {"concept_id": 7, "concept_name": "dogs", "head": "known"},
            {"concept_id": 300, "concept_name": "cats", "head": "unknown"},
        ]
    )
)


def build(**fields):
    body = CompletionRequest(model="m", prompt="x", **fields)
    return generate_requests(body, [[1, 2]], body.max_tokens, INFO, LABELS, "cmpl-t")


def test_a_prompt_of_ids_with_a_mask_is_a_400_on_the_prompt():
    with pytest.raises(ApiError) as e:
        check_prompt([1, MASK_ID], 4, INFO, "prompt")
    assert e.value.param == "prompt" and "<|mask|>" in e.value.message


# The presets' own values are compared with the official recipes in test_api_steering.py.
def test_explicit_fields_override_the_preset():
    (req,) = build(steering={"concepts": ["Known: #5"], "preset": "suppress", "strength": -3, "inject_layer": 4})
    s = req.steering
    assert (s.strength, s.normalize, s.inject_layer, s.schedule) == (-3.0, False, 4, "fixed")
    assert s.relu_logit_mask == {5: 20.0}


@pytest.mark.reference
@pytest.mark.parametrize("concepts", [[12, 30, 12], [12, "Known: #12", 30, 30], [30, 12, 30]])
def test_suppress_sums_the_focal_concept_once_as_the_official_recipe(concepts):
    from steerling.configs.steering import SteeringConfig

    (req,) = build(steering={"concepts": concepts, "preset": "suppress"})
    focal, *rest = (int(str(c).removeprefix("Known: #")) for c in concepts)
    assert req.steering.concepts == SteeringConfig.injection_relu(focal, rest).concept_ids
    assert req.steering.relu_logit_mask == {focal: 20.0}


def test_cutoff_tokens_is_at_least_one_as_the_official_field():
    with pytest.raises(ValidationError, match="cutoff_tokens"):
        CompletionRequest(model="m", prompt="x", steering={"concepts": [1], "cutoff_tokens": 0})


def test_a_name_that_reads_as_an_id_is_that_concept():
    """docs/api.md: a catalog name as written, or as attribution labels it, is that concept;
    an id form that no name matches is still an id."""
    labels = ConceptLabels(
        Catalog.from_rows([{"concept_id": 1, "concept_name": "42"}, {"concept_id": 2, "concept_name": "#3"}])
    )
    resolved = [labels.resolve(c, 100, "c") for c in ("42", "Known: 42", labels.labels.label(1, "known"), "#3", "43")]
    assert resolved == [1, 1, 1, 2, 43]


def test_explicit_relu_mask_by_label():
    (req,) = build(steering={"concepts": [1], "relu_logit_mask": {"dogs": 2.5, "#9": 1}})
    assert req.steering.relu_logit_mask == {7: 2.5, 9: 1.0}


@pytest.mark.parametrize(
    "steering, param",
    [
        ({"concepts": []}, "steering.concepts"),
        ({"concepts": ["cats"]}, "steering.concepts"),
        ({"concepts": [100]}, "steering.concepts"),
        ({"relu_logit_mask": {"1": 1.0}, "preset": "suppress"}, "steering.concepts"),
    ],
)
def test_bad_steering(steering, param):
    with pytest.raises(ApiError) as e:
        build(steering=steering)
    assert e.value.param == param


def test_n_choices_get_distinct_reproducible_seeds_and_attribution():
    reqs = build(n=3, seed=10, attribution=True, stop="\n", top_k=-1)
    assert [r.seed for r in reqs] == [10, 11, 12]
    # all 64 bits go to the worker (its sampler folds them into its key), wrapping past the top
    assert [r.seed for r in build(n=2, seed=1 << 40)] == [1 << 40, (1 << 40) + 1]
    assert [r.seed for r in build(n=2, seed=(1 << 64) - 1)] == [(1 << 64) - 1, 0]
    assert [r.request_id for r in reqs] == ["cmpl-t-0-0", "cmpl-t-0-1", "cmpl-t-0-2"]
    assert reqs[0].attribution == AttributionSpec() and reqs[0].stop == ["\n"] and reqs[0].top_k == 0


def test_flashblock_field():
    from cde.shared.protocol import FlashBlockSpec
    from pydantic import ValidationError

    assert build()[0].flashblock is None  # the worker's default applies
    assert build(flashblock=False)[0].flashblock is False
    assert build(flashblock=True)[0].flashblock == FlashBlockSpec()
    assert build(flashblock={"tau": 3, "max_reuse": 5})[0].flashblock == FlashBlockSpec(3, 5)
    with pytest.raises(ValidationError, match="max_reuse"):
        build(flashblock={"tau": 3, "max_reuse": -1})
