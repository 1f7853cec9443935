"""A request slot reused: whatever per-request state a finished request left in its slot (tokens
seen for the repetition penalty, counts for the frequency and presence penalties, logit bias,
steering vectors and ReLU masks, FlashBlock's cached attention, attribution, the sampler's seed
and step), the next request on that slot decodes exactly as it does on a fresh engine. One slot
(max_running=1), so every request reuses it; between the two runs of the probe, a request with
every feature on, whose prompt holds the probe's own tokens (so that leftover penalty bits land
on exactly the tokens the probe picks)."""

import pytest
from cde.shared.config import PAGE
from cde.shared.protocol import AttributionSpec, FlashBlockSpec, GenerateRequest, SteeringSpec
from cde.worker.engine import Engine, EngineArgs

PROMPT = list(range(3000, 3040))
BASE = {"max_tokens": PAGE + 8, "tokens_per_step": 16}
FEATURES = {
    "plain": {},
    "repetition_penalty": {"repetition_penalty": 2.0},
    "steering": {"steering": SteeringSpec([5, 6], strength=6.0, inject_layer=1, relu_logit_mask={7: 3.0})},
    "flashblock": {"flashblock": FlashBlockSpec(tau=3, max_reuse=4)},
    "attribution": {"attribution": AttributionSpec(top_k=4)},
    "sampling": {"temperature": 0.9, "top_p": 0.9, "top_k": 50, "seed": 11},
    "logit_rules": {"frequency_penalty": 1.5, "presence_penalty": 1.0, "logit_bias": {9: 5.0}, "min_tokens": 40},
    "entropy_sampling": {"temperature": 1.0, "entropy_sampling": True, "seed": 12},
}


def everything_on(prompt: list[int]) -> GenerateRequest:
    return GenerateRequest(
        "dirty",
        prompt,
        max_tokens=24,
        tokens_per_step=8,
        temperature=0.7,
        seed=99,
        repetition_penalty=1.7,
        frequency_penalty=2.0,
        presence_penalty=-1.0,
        logit_bias={7: 8.0, 11: -20.0},
        min_tokens=10,
        steering=SteeringSpec([1, 2], strength=-9.0, inject_layer=0, relu_logit_mask={3: 5.0}, schedule="fixed"),
        flashblock=FlashBlockSpec(tau=1, max_reuse=2),
        attribution=AttributionSpec(top_k=3),
    )


def run(engine: Engine, req: GenerateRequest) -> tuple[list[int], list]:
    """The request's tokens and its attribution records (none when not asked)."""
    tokens, records = [], []
    engine.add_request(req)
    while engine.has_work():
        for res in engine.step():
            tokens += res.token_ids
            records += res.attribution.records() if res.attribution is not None else []
    return tokens, records


@pytest.mark.parametrize("feature", FEATURES)
def test_a_reused_slot_decodes_as_a_fresh_engine(tiny_dir, feature):
    engine = Engine(EngineArgs(str(tiny_dir), max_running=1))
    probe = lambda: GenerateRequest("probe", PROMPT, **BASE, **FEATURES[feature])
    fresh = run(engine, probe())
    run(engine, everything_on(PROMPT + fresh[0]))
    assert run(engine, probe()) == fresh
