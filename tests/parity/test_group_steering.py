"""Steering through the concept catalog: `"group": true` through a real `cde serve` (tiny model,
float32 CPU, the real openai client) is token-for-token the official generator steered with the
official group recipes on the same parquet (`SteeringConfig.injection_relu(id, group_concept_ids=
ConceptCatalog.group(id))` for suppress, `SteeringConfig.injection(ConceptCatalog.group(id))` for
amplify); labels resolve by catalog name; bad group requests are 400s naming the field."""

import random

import openai
import pytest
from cde.gateway.concepts import ConceptLabels
from cde.gateway.errors import ApiError
from cde.gateway.model_info import ModelInfo
from cde.gateway.params import generate_requests
from cde.gateway.schemas import CompletionRequest
from cde.shared.catalog import Catalog, write_catalog

from tests.api_server import ServerProcess
from tests.catalog_fixture import N_KNOWN, SHARED_NAME, catalog_rows
from tests.parity.test_steering_parity import N_NEW, reference_steered

pytestmark = pytest.mark.reference

PROMPT = [random.Random(7).randrange(100000) for _ in range(64)]  # one full block: decodes as the reference
INFO = ModelInfo("m", context_len=1024, vocab_size=100281, instruct=False, n_layers=2, n_concepts=N_KNOWN)


@pytest.fixture(scope="module")
def catalog_path(tmp_path_factory):
    return write_catalog(tmp_path_factory.mktemp("catalog") / "concept_labels.parquet", catalog_rows())


@pytest.fixture(scope="module")
def official_catalog(catalog_path):
    import pandas as pd
    from steerling.concepts import ConceptCatalog

    return ConceptCatalog(pd.read_parquet(catalog_path))


@pytest.fixture(scope="module")
def server(tiny_dir, catalog_path):
    srv = ServerProcess(tiny_dir, "--concept-labels", str(catalog_path), workers=1)
    yield srv
    srv.stop()


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=server.base_url, api_key="none")


@pytest.fixture(scope="module")
def generator(tiny_dir):
    from tests.oracle import official_generator

    return official_generator(tiny_dir)


def complete(client, steering: dict) -> list[int]:
    model = client.models.list().data[0].id
    out = client.completions.create(
        model=model,
        prompt=PROMPT,
        max_tokens=N_NEW,
        temperature=0,
        extra_body={"steering": steering, "return_token_ids": True},
    )
    return out.choices[0].token_ids


def test_group_suppress_is_the_official_group_injection(client, generator, official_catalog):
    from steerling.configs.steering import SteeringConfig

    ref = SteeringConfig.injection_relu(9, group_concept_ids=official_catalog.group(9))
    assert len(ref.concept_ids) > 1
    got = complete(client, {"concepts": ["harbor lights"], "group": True, "preset": "suppress"})
    assert got == reference_steered(generator, PROMPT, ref)
    assert got != complete(client, {"concepts": ["harbor lights"], "preset": "suppress"}), "the group had no effect"


def test_group_amplify_injects_the_group(client, generator, official_catalog):
    from steerling.configs.steering import SteeringConfig

    ref = SteeringConfig.injection(official_catalog.group(21), mai_lm_target=8.0, inject_layer=1, cutoff_tokens=32)
    got = complete(client, {"concepts": ["volcanic ash"], "group": True, "preset": "amplify", "inject_layer": 1})
    assert got == reference_steered(generator, PROMPT, ref)
    assert got != complete(client, {"concepts": ["volcanic ash"], "preset": "amplify", "inject_layer": 1})


def test_a_concept_of_no_group_is_its_own_group(client, official_catalog):
    """`ConceptCatalog.group` of a concept in no group is the concept alone."""
    lonely = next(c for c in official_catalog.to_df()["concept_id"] if official_catalog.get(int(c)).group_id is None)
    assert official_catalog.group(int(lonely)) == [int(lonely)]
    steering = {"concepts": [int(lonely)], "preset": "amplify", "inject_layer": 1}
    assert complete(client, {**steering, "group": True}) == complete(client, steering)


@pytest.mark.parametrize(
    ("steering", "param", "says"),
    [
        ({"concepts": ["mixed tide"], "group": True}, "steering.group", f"includes concept {N_KNOWN}"),
        ({"relu_logit_mask": {"9": 5}, "group": True}, "steering.group", "none are given"),
        ({"concepts": [SHARED_NAME]}, "steering.concepts", "names several known concepts (60, 61)"),
        ({"concepts": ["harbour lights"]}, "steering.concepts", "search finds 'harbor lights' (#9)"),
    ],
)
def test_bad_requests_name_the_field(client, steering, param, says):
    with pytest.raises(openai.BadRequestError) as e:
        complete(client, steering)
    error = e.value.response.json()["error"]
    assert error["param"] == param and says in error["message"], error


def steering_spec(labels: ConceptLabels, **steering):
    body = CompletionRequest(model="m", prompt="x", steering=steering)
    return generate_requests(body, [[1]], 4, INFO, labels, "t")[0].steering


CATALOG = ConceptLabels(Catalog.from_rows(catalog_rows()))


@pytest.mark.parametrize("label", ["harbor lights", "Known: harbor lights", "HARBOR LIGHTS", "#9", 9])
def test_labels_resolve_by_catalog_name(label):
    assert steering_spec(CATALOG, concepts=[label]).concepts == [9]


def test_groups_of_several_concepts_are_joined_without_repeats_and_mask_the_first():
    from steerling.configs.steering import SteeringConfig

    spec = steering_spec(CATALOG, concepts=[9, 8, 21], group=True, preset="suppress")
    assert spec.concepts == [9, 8, 11, 12, 13, 14, 21, 16, 17, 18, 19, 22, 23]
    ref = SteeringConfig.injection_relu(9, group_concept_ids=spec.concepts[1:])
    assert (spec.concepts, spec.relu_logit_mask) == (ref.concept_ids, ref.relu_logit_mask)


def test_group_without_a_catalog_is_a_400():
    with pytest.raises(ApiError) as e:
        steering_spec(ConceptLabels(), concepts=[3], group=True)
    assert e.value.param == "steering.group" and "needs a concept catalog" in e.value.message
