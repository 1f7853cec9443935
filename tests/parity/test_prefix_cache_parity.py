"""With the prefix cache on, greedy and steered decoding are still token-for-token the official
generator's (float32 CPU): prompts sharing one, two or all of their full pages, decoded in one
batch (the pages written by one request, read by the others) and again later (every page found
parked from the first round, no prefill at all: its own second page too).

Four tokens per step (the official linear schedule, tests/parity/test_parity.py): the pages are
the prompt's, read by every step alike, and the reference recomputes the whole sequence at each
of its steps, so a quarter of them is a quarter of this test's time."""

import pytest
import torch
from cde.shared.config import PAGE
from cde.shared.protocol import GenerateRequest
from cde.worker.engine import Engine, EngineArgs

from tests.parity.test_parity import reference_tokens
from tests.parity.test_steering_parity import N_NEW, amplify, reference_steered

pytestmark = pytest.mark.reference
PER_STEP = 4


def prompt(n: int, seed: int) -> list[int]:
    return torch.randint(0, 100000, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


def test_cached_pages_decode_as_the_official_generator(tiny_dir):
    from tests.oracle import official_generator

    base = prompt(2 * PAGE, 21)
    prompts = {"two": base, "one": base[:PAGE] + prompt(PAGE, 22), "three": base + prompt(PAGE, 23)}
    ours, ref = amplify([3, 17, 40], 1)
    gen = official_generator(tiny_dir)
    expected = {name: reference_tokens(tiny_dir, p, N_NEW, PER_STEP) for name, p in prompts.items()}
    expected["three-steered"] = reference_steered(gen, prompts["three"], ref, PER_STEP)
    assert expected["three-steered"] != expected["three"], "steering had no effect"

    engine = Engine(EngineArgs(str(tiny_dir)))
    for round_, cached in ((1, None), (2, {"two": 128, "one": 128, "three": 192, "three-steered": 192})):
        reqs = [GenerateRequest(f"{name}/{round_}", p, N_NEW, tokens_per_step=PER_STEP) for name, p in prompts.items()]
        reqs.append(
            GenerateRequest(f"three-steered/{round_}", prompts["three"], N_NEW, tokens_per_step=PER_STEP, steering=ours)
        )
        got, hits = {}, {}
        for r in reqs:
            engine.add_request(r)
        while engine.has_work():
            for res in engine.step():
                name = res.request_id.split("/")[0]
                got[name] = got.get(name, []) + res.token_ids
                hits[name] = res.cached_tokens
        assert got == expected, f"round {round_}"
        if cached is None:  # one batch: "two" or "three" wrote the shared pages, the others read them
            assert sum(hits.values()) >= 64 + 128 + 128
        else:
            assert hits == cached
