"""Steering and attribution through the API of a real `cde serve` (tiny base model, CPU, one
worker, the official `openai` client) equal the official package on the same checkpoint:

- each preset, with its own defaults, against the official recipe with *its* defaults, streamed
  or not
  (`SteeringConfig.injection`, `SteeringConfig.injection_relu`); one token per step and eight
  (the official linear schedule over max_new_tokens / 8 steps unmasks eight per step, as
  `tokens_per_step: 8` does); `"group": true` is compared the same way in test_group_steering.py;
- per-token attribution of a steered generation against the official `FaithfulConceptAttributor`
  (its generator steered by the same recipe, its labels from the same catalog) and against CDE's
  engine in this process.

Everything is compared with the reference, never with the server's own earlier output, so a
worker that dropped the request's steering or a preset with a wrong default fails here.
"""

import numpy as np
import openai
import pytest
import torch
from cde.shared.catalog import write_catalog
from cde.shared.config import preset
from cde.shared.protocol import AttributionSpec, GenerateRequest, SteeringSpec
from cde.worker.engine import Engine, EngineArgs

from tests.api_server import ServerProcess
from tests.catalog_fixture import catalog_rows
from tests.oracle import greedy_config
from tests.parity.test_attribution_parity import text_prompt

pytestmark = pytest.mark.reference

N_NEW = 64
N_LAYERS = preset("tiny").n_layers
TOL = {"rtol": 1e-4, "atol": 1e-5}


@pytest.fixture(scope="module")
def catalog_path(tmp_path_factory):
    return write_catalog(tmp_path_factory.mktemp("catalog") / "concept_labels.parquet", catalog_rows())


@pytest.fixture(scope="module")
def server(tiny_dir, catalog_path):
    srv = ServerProcess(tiny_dir, "--served-model-name", "tiny", "--concept-labels", str(catalog_path), workers=1)
    yield srv
    srv.stop()


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=server.base_url, api_key="unused", max_retries=0, timeout=120)


@pytest.fixture(scope="module")
def official(tiny_dir):
    from tests.oracle import official_generator

    return official_generator(tiny_dir)


def complete(client, prompt: list[int], per_step: int, **extra):
    r = client.completions.create(
        model="tiny",
        prompt=[prompt],
        max_tokens=N_NEW,
        temperature=0,
        extra_body={"tokens_per_step": per_step, "return_token_ids": True, **extra},
    )
    (choice,) = r.choices
    assert choice.finish_reason == "length"
    return choice


def recipe(name: str, concepts: list[int], n_layers: int = N_LAYERS):
    """The official recipe of a preset, with the recipe's own defaults."""
    from steerling.configs.steering import SteeringConfig

    if name == "amplify":
        ref = SteeringConfig.injection(concepts)
        # It injects from layer 8; a model with fewer layers gets its last one (CDE's documented
        # clamp, tests/gateway/test_gateway_params.py): every other field stays the recipe's.
        return ref if ref.inject_layer <= n_layers else ref.model_copy(update={"inject_layer": n_layers})
    return SteeringConfig.injection_relu(concepts[0], concepts[1:])


def preset_spec(name: str, concepts: list[int], n_layers: int) -> SteeringSpec:
    """What the gateway makes of `{"concepts": concepts, "preset": name}` on a model of n_layers."""
    from cde.gateway.concepts import ConceptLabels
    from cde.gateway.model_info import ModelInfo
    from cde.gateway.params import generate_requests
    from cde.gateway.schemas import CompletionRequest

    info = ModelInfo("m", context_len=4096, vocab_size=100281, instruct=False, n_layers=n_layers, n_concepts=100)
    body = CompletionRequest(model="m", prompt="x", steering={"concepts": concepts, "preset": name})
    (req,) = generate_requests(body, [[1]], 16, info, ConceptLabels(), "c")
    return req.steering


@pytest.mark.parametrize("n_layers", [32, N_LAYERS])
@pytest.mark.parametrize("name", ["amplify", "suppress"])
def test_preset_fields_are_the_official_recipe(name, n_layers):
    """Field by field, fast: the API tests below show the same end to end. The official
    injection_relu leaves inject_layer unset (its generator then injects from n_layers // 2)."""
    concepts = [5, 9, 7]
    ours, ref = preset_spec(name, concepts, n_layers), recipe(name, concepts, n_layers)
    assert (ours.concepts, ours.strength, ours.normalize, ours.schedule, ours.cutoff_tokens, ours.relu_logit_mask) == (
        ref.concept_ids,
        ref.mai_lm_target,
        ref.normalize_mai_lm_target,
        ref.inject_alpha_schedule,
        ref.cutoff_tokens,
        ref.relu_logit_mask or {},
    )
    assert ours.inject_layer == (ref.inject_layer if ref.inject_layer is not None else n_layers // 2)


PROMPT = torch.randint(0, 100000, (64,), generator=torch.Generator().manual_seed(7)).tolist()


@pytest.mark.parametrize(
    "name,concepts,per_step",
    [
        ("amplify", [3, 17, 40], 1),
        ("suppress", [7, 11, 30], 8),
        ("amplify", [5], 8),
        ("suppress", [12], 4),
    ],
)
def test_preset_equals_official_recipe(client, official, name, concepts, per_step):
    steered = complete(client, PROMPT, per_step, steering={"concepts": concepts, "preset": name})
    ref = official.generate_steered(torch.tensor([PROMPT]), greedy_config(N_NEW, per_step), recipe(name, concepts))
    assert steered.token_ids == ref.tokens[len(PROMPT) :].tolist()
    plain = complete(client, PROMPT, per_step)
    assert steered.token_ids != plain.token_ids, "steering had no effect: the comparison would be vacuous"


def test_streamed_steering_equals_official_recipe(client, official):
    concepts, per_step = [7, 11, 30], 8
    chunks = client.completions.create(
        model="tiny",
        prompt=[PROMPT],
        max_tokens=N_NEW,
        temperature=0,
        stream=True,
        extra_body={
            "tokens_per_step": per_step,
            "return_token_ids": True,
            "steering": {"concepts": concepts, "preset": "suppress"},
        },
    )
    tokens = [t for c in chunks for t in c.choices[0].model_extra.get("token_ids") or []]
    ref = official.generate_steered(
        torch.tensor([PROMPT]), greedy_config(N_NEW, per_step), recipe("suppress", concepts)
    )
    assert tokens == ref.tokens[len(PROMPT) :].tolist()


# ---- attribution -------------------------------------------------------------------------------
def by_concept(kind_rows) -> dict[int, tuple[float, float]]:
    return {int(i): (float(w), float(c)) for i, w, c in kind_rows}


def from_api(token: dict) -> dict:
    """An API per-token attribution entry in the engine record's terms."""
    out = {"token_id": token["token_id"], "target_logit": token["target_logit"], "epsilon": token["epsilon"]}
    for kind in ("known", "discovered"):
        out[kind] = by_concept(
            (c["id"], c["weight"], c["contribution"]) for c in token["concepts"] if c["type"] == kind
        )
    return out


def from_engine(record: dict) -> dict:
    return {
        "token_id": record["token_id"],
        "target_logit": record["target_logit"],
        "epsilon": record["epsilon"],
        "known": by_concept(record["known"]),
        "discovered": by_concept(record["discovered"]),
    }


def from_official(attr, p: int) -> dict:
    out = {
        "token_id": int(attr.target_token_ids[0, p]),
        "target_logit": float(attr.target_logits[0, p]),
        "epsilon": float(attr.epsilon_contribution[0, p]),
    }
    for kind, idx, w, c in (
        ("known", attr.known_indices, attr.known_weights, attr.known_contributions),
        ("discovered", attr.unk_indices, attr.unk_weights, attr.unk_contributions),
    ):
        out[kind] = by_concept(zip(idx[0, p].tolist(), w[0, p].tolist(), c[0, p].tolist()))
    return out


def assert_same(got: dict, want: dict, tol: dict, where) -> None:
    assert got["token_id"] == want["token_id"], where
    np.testing.assert_allclose(
        [got["target_logit"], got["epsilon"]], [want["target_logit"], want["epsilon"]], err_msg=str(where), **tol
    )
    for kind in ("known", "discovered"):
        assert got[kind].keys() == want[kind].keys(), (where, kind)
        ids = sorted(want[kind])
        np.testing.assert_allclose(
            [got[kind][i] for i in ids], [want[kind][i] for i in ids], err_msg=str((where, kind)), **tol
        )


def official_steered_attribution(official, text: str, per_step: int, steering, labels_path):
    """The official attributor over a generation steered by `steering`: its generator runs
    `generate_full(..., steering=..., step_callback=...)`, which threads attribution through the
    same injected pass (the official generator's own support for both at once)."""
    from steerling.attribution.concept_attribution import FaithfulConceptAttributor

    attributor = FaithfulConceptAttributor(official, concepts_path=labels_path)
    plain = official.generate_full
    official.generate_full = lambda prompt, config, step_callback=None: plain(
        prompt, config, steering=steering, step_callback=step_callback
    )
    try:
        out, chunks = attributor.attribute(text, greedy_config(N_NEW, per_step))
    finally:
        del official.generate_full
    return out, chunks, attributor.last_attribution


def test_steered_attribution_equals_official_and_engine(client, official, tiny_dir, catalog_path):
    text, ids = text_prompt()
    per_step, concepts = 8, [7, 11, 30]
    attribution = {"top_k": 128, "per_token": True, "chunking": "endofchunk"}  # top_k above the heads': every concept
    choice = complete(
        client, ids, per_step, steering={"concepts": concepts, "preset": "suppress"}, attribution=attribution
    )
    api = choice.model_extra["attribution"]
    out, ref_chunks, attr = official_steered_attribution(
        official, text, per_step, recipe("suppress", concepts), catalog_path
    )
    assert choice.token_ids == out.tokens[len(ids) :].tolist()
    assert [t["offset"] for t in api["tokens"]] == list(range(N_NEW))
    for t in api["tokens"]:
        assert_same(from_api(t), from_official(attr, len(ids) + t["offset"]), TOL, t["offset"])

    # The API's chunks are the official chunk results, labels from the catalog included.
    assert len(api["chunks"]) == len(ref_chunks)
    for chunk, (entries, eps_pct) in zip(api["chunks"], ref_chunks):
        got = {(c["label"], c["type"]): c["contribution"] for c in chunk["concepts"]}
        want = {(e["label"], e["type"]): e["contribution"] for e in entries}
        assert got.keys() == want.keys()
        np.testing.assert_allclose([got[k] for k in want], list(want.values()), **TOL)
        np.testing.assert_allclose(chunk["epsilon_pct"], eps_pct, **TOL)

    # And the engine's records of the same request (the preset spelled out) are what the API returned.
    spec = SteeringSpec(
        concepts,
        strength=-7.0,
        normalize=False,
        inject_layer=N_LAYERS // 2,
        schedule="fixed",
        relu_logit_mask={concepts[0]: 20.0},
    )
    engine = Engine(EngineArgs(str(tiny_dir)))
    engine.add_request(
        GenerateRequest(
            "a",
            ids,
            max_tokens=N_NEW,
            tokens_per_step=per_step,
            steering=spec,
            attribution=AttributionSpec(top_k=128, per_token=True, chunking="endofchunk"),
        )
    )
    records = []
    while engine.has_work():
        for res in engine.step():
            records += res.attribution or []
    assert [r["position"] - len(ids) for r in records] == [t["offset"] for t in api["tokens"]]
    for r, t in zip(records, api["tokens"]):
        assert_same(from_api(t), from_engine(r), {"rtol": 1e-6, "atol": 1e-7}, t["offset"])


def test_streamed_attribution_is_the_unstreamed_one_in_the_finish_event(client):
    """docs/api.md: streamed, the choice's whole attribution object comes with its finish_reason
    (a chunk counts from the completion's start and may span two decode blocks), equal to the
    unstreamed answer's; no earlier event carries one."""
    args = dict(model="tiny", prompt=[PROMPT], max_tokens=2 * 64, temperature=0)
    extra = {"tokens_per_step": 8, "attribution": {"top_k": 3}}
    whole = client.completions.create(**args, extra_body=extra).choices[0].model_extra["attribution"]
    events = [c.choices[0] for c in client.completions.create(**args, stream=True, extra_body=extra) if c.choices]
    carrying = [n for n, c in enumerate(events) if (c.model_extra or {}).get("attribution")]
    assert carrying == [len(events) - 1] and events[-1].finish_reason == "length"
    assert events[-1].model_extra["attribution"] == whole and len(whole["chunks"]) == 2
