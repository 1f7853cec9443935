"""Ties in selection's confidence, against the official generator (float32 CPU, live).

Where float32 softmax saturates at 1.0, several still-masked positions share the top confidence,
and which of them a step unmasks is torch.topk's tie order on the tensor it is given: the
reference's is the confidences of the block's still-masked positions alone, in position order.
The checkpoint's final norm is scaled up until a third of a block's first-step confidences tie at
1.0; the parity checkpoints never tie, so they cannot tell the tie order apart."""

import pytest
import torch
from cde.shared.config import preset
from cde.shared.protocol import GenerateRequest
from cde.worker.engine import Engine, EngineArgs

from tests.oracle import greedy_config, official_generator, write_with_official_classes

pytestmark = pytest.mark.reference

N_NEW = 64


@pytest.fixture(scope="module")
def saturated_dir(tmp_path_factory):
    return write_with_official_classes(preset("tiny"), tmp_path_factory.mktemp("saturated"), seed=4, ln_f_scale=200.0)


def prompt(seed: int) -> list[int]:
    return torch.randint(0, 100000, (64,), generator=torch.Generator().manual_seed(seed)).tolist()


def reference(gen, p: list[int], per_step: int) -> list[int]:
    return gen.generate_full(torch.tensor([p]), greedy_config(N_NEW, per_step)).tokens[len(p) :].tolist()


def test_the_first_step_ties(saturated_dir):
    """Not vacuous: many of the first step's confidences are exactly the top one."""
    gen = official_generator(saturated_dir)
    x = torch.tensor([prompt(0) + [gen.mask_token_id] * 64])
    with torch.inference_mode():
        logits = gen._forward(x)[0, 64:].float()
        logits[:, [gen.eos_token_id, gen.mask_token_id, gen.pad_token_id]] = float("-inf")
        conf = torch.softmax(logits, -1).max(-1).values
    assert int((conf == 1.0).sum()) >= 8


@pytest.mark.parametrize("per_step", [1, 4])
@pytest.mark.parametrize("ahead", [False, True], ids=["planned-after", "planned-ahead"])
def test_greedy_under_ties_matches_official(saturated_dir, per_step, ahead):
    """Each request alone and in one batch with a request of another k and one with a confidence
    threshold (what the batch holds must not move a tie); planned ahead, the positions the pass in
    flight picks leave the packed confidences on the device."""
    gen = official_generator(saturated_dir)
    engine = Engine(EngineArgs(str(saturated_dir), async_scheduling=ahead))
    p = prompt(1)  # its ties fall otherwise under a rule of CDE's own, at both k
    alone = engine.generate([GenerateRequest("p", p, max_tokens=N_NEW, tokens_per_step=per_step)])["p"]
    batched = engine.generate(
        [
            GenerateRequest("p", p, max_tokens=N_NEW, tokens_per_step=per_step),
            GenerateRequest("k", prompt(9), max_tokens=N_NEW, tokens_per_step=3 if per_step == 1 else 1),
            GenerateRequest("threshold", prompt(8), max_tokens=N_NEW, confidence_threshold=0.5),
        ]
    )["p"]
    ref = reference(gen, p, per_step)
    assert alone == ref
    assert batched == ref
