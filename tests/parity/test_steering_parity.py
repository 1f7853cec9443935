"""Steered greedy decoding is token-for-token the official `generate_steered` (float32 CPU), for
both supported recipes: `SteeringConfig.injection` (amplify: normalised strength, hard cutoff) and
`SteeringConfig.injection_relu` (suppress: raw negative alpha, fixed schedule, ReLU logit mask).

The prompt is the preset's 64-token golden prompt (scripts/record_goldens.py, checked against the
checkpoint's SHA-256)."""

import json

import pytest
import torch
from cde.shared.protocol import GenerateRequest, SteeringSpec
from cde.worker.engine import Engine, EngineArgs

from tests.parity.test_parity import checkpoint_sha256, golden_path

pytestmark = pytest.mark.reference

N_NEW = 64
PER_STEP = 4  # test_steered_greedy_matches_official's


def amplify(concepts: list[int], inject_layer: int):
    from steerling.configs.steering import SteeringConfig

    ours = SteeringSpec(
        concepts, strength=8.0, normalize=True, inject_layer=inject_layer, schedule="hard_cutoff", cutoff_tokens=32
    )
    return ours, SteeringConfig.injection(concepts, mai_lm_target=8.0, inject_layer=inject_layer, cutoff_tokens=32)


def suppress(concept: int, group: list[int], inject_layer: int):
    from steerling.configs.steering import SteeringConfig

    ref = SteeringConfig.injection_relu(
        concept, group, mai_lm_target=-7.0, inject_layer=inject_layer, relu_strength=20.0
    )
    ours = SteeringSpec(
        ref.concept_ids,
        strength=-7.0,
        normalize=False,
        inject_layer=inject_layer,
        schedule="fixed",
        relu_logit_mask={concept: 20.0},
    )
    return ours, ref


CASES = {
    "amplify-l1": lambda: amplify([3, 17, 40], 1),
    "amplify-l2": lambda: amplify([5], 2),
    "suppress-l1": lambda: suppress(7, [11, 30], 1),
    "suppress-l2": lambda: suppress(12, [], 2),
    "suppress-past-depth": lambda: suppress(12, [], 9),  # injects at no layer: the ReLU mask alone
}


def reference_steered(gen, prompt: list[int], steering, per_step: int = 1) -> list[int]:
    from tests.oracle import greedy_config

    cfg = greedy_config(N_NEW, per_step)
    out = gen.generate_steered(torch.tensor([prompt]), cfg, steering)
    return out.tokens[len(prompt) :].tolist()


def golden_unsteered(preset: str, model_dir) -> tuple[list[int], list[int]]:
    """The preset's 64-token golden prompt and the official generator's unsteered greedy tokens
    for it (the first N_NEW of the recorded 256: attention is block-causal)."""
    golden = json.loads(golden_path(preset).read_text())
    assert golden["safetensors_sha256"] == checkpoint_sha256(model_dir), "re-record: scripts/record_goldens.py"
    prompt = golden["prompts"][0]
    assert len(prompt) == 64
    return prompt, golden["tokens"][0][:N_NEW]


# Each recipe at both inject layers, split over the two presets (a reference run costs ~15 s).
@pytest.mark.parametrize(
    "which,cases",
    [("tiny_dir", ["amplify-l1", "suppress-l2", "suppress-past-depth"]), ("small_dir", ["amplify-l2", "suppress-l1"])],
)
def test_steered_greedy_matches_official(which, cases, request):
    from tests.oracle import official_generator

    model_dir = request.getfixturevalue(which)
    gen = official_generator(model_dir)
    prompt, _ = golden_unsteered(which.removesuffix("_dir"), model_dir)
    specs = {name: CASES[name]() for name in cases}
    engine = Engine(EngineArgs(str(model_dir)))
    # Four tokens a step, both sides (16 passes, not 64: the official loop is the slow half); one
    # token a step is the CLI's and the group tests' (tests/cli/test_cli.py, test_group_steering.py).
    reqs = [
        GenerateRequest(name, prompt, max_tokens=N_NEW, tokens_per_step=PER_STEP, steering=ours)
        for name, (ours, _) in [*specs.items(), ("plain", (None, None))]
    ]
    got = engine.generate(reqs)
    for name, (_, ref) in specs.items():
        assert got[name] == reference_steered(gen, prompt, ref, PER_STEP), name
        assert got[name] != got["plain"], f"{name}: steering had no effect, the test would be vacuous"
