"""Greedy decoding is token-for-token the official generator's (`generate_full`), float32 CPU."""

import pytest
import torch

from shared.protocol import GenerateRequest
from worker.engine import Engine, EngineArgs

pytestmark = pytest.mark.reference

PROMPT_LENGTHS = (64, 128, 192)


def reference_tokens(model_dir, prompt: list[int], max_new: int) -> list[int]:
    from steerling.configs.generation import GenerationConfig

    from tests.oracle import official_generator

    gen = official_generator(model_dir)
    cfg = GenerationConfig(max_new_tokens=max_new, steps=max_new, temperature=0, use_entropy_sampling=False,
                           top_p=0, repetition_penalty=1)
    out = gen.generate_full(torch.tensor([prompt]), cfg)
    return out.tokens[len(prompt):].tolist()


def prompts(seed: int) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(0, 100000, (n,), generator=g).tolist() for n in PROMPT_LENGTHS]


@pytest.mark.parametrize("which", ["tiny_dir", "small_dir", "tiny_official_dir"])
def test_greedy_matches_official_generator(which, request):
    model_dir = request.getfixturevalue(which)
    engine = Engine(EngineArgs(str(model_dir)))
    ps = prompts(seed=len(which))
    reqs = []
    for i, p in enumerate(ps):
        reqs += [GenerateRequest(f"{i}-128", p, max_tokens=128), GenerateRequest(f"{i}-256", p, max_tokens=256)]
    ours = engine.generate(reqs)
    for i, p in enumerate(ps):
        # Block-causal attention: the first 128 tokens of a 256-token run are the 128-token run.
        ref = reference_tokens(model_dir, p, 256)
        assert ours[f"{i}-256"] == ref
        assert ours[f"{i}-128"] == ref[:128]
