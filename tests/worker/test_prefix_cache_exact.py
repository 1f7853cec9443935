"""The prefix cache changes no output: with the cache on, every request gives what the engine without
it gives (`--no-prefix-cache`), float32 CPU. Tokens, concept attribution (1e-6), input attribution,
steered, FlashBlock, structured-output and sampled requests, over prompts that share no full page,
some, or all of them (with and without a partial tail page), in the same batch and across time
(a second round finds the first round's pages parked). And fp8 (the CPU emulation of the scaled
GEMMs), whose prompt pages are shared the same way. tests/parity/test_prefix_cache_parity.py
compares the cached engine with the official generator."""

from __future__ import annotations

import copy

import numpy as np
import pytest
import torch
from cde.shared.config import PAGE
from cde.shared.grammar import json_schema_grammar
from cde.shared.protocol import (
    AttributionSpec,
    BlockResult,
    FlashBlockSpec,
    GenerateRequest,
    InputAttributionSpec,
    SteeringSpec,
)
from cde.worker.engine import Engine, EngineArgs

from tests.worker.test_mixed_batch import assert_same_attribution


def prompt(n: int, seed: int) -> list[int]:
    return torch.randint(0, 100000, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


BASE = prompt(3 * PAGE, 1)
PROMPTS = {
    "none": prompt(150, 2),  # its two full pages are its own
    "some": BASE[: 2 * PAGE] + prompt(40, 3),  # shares two of BASE's pages, then a tail of its own
    "all": BASE,  # every page full and shared: no prefill at all once cached
    "all+tail": BASE + prompt(30, 4),  # every full page shared, and a partial tail page
}
SCHEMA = {"type": "object", "properties": {"n": {"type": "integer"}}, "required": ["n"]}
FEATURES = {
    "greedy": {},
    "steered": {"steering": SteeringSpec([3, 17], strength=8.0, inject_layer=1, schedule="fixed")},
    "attributed": {"attribution": AttributionSpec()},
    "inputs": {"attribution": AttributionSpec(inputs=InputAttributionSpec(top_k=3, steps=1))},
    "flashblock": {"flashblock": FlashBlockSpec(tau=2, max_reuse=4), "tokens_per_step": 2},
    "structured": {"grammar": json_schema_grammar(SCHEMA)},
    "sampled": {"temperature": 0.8, "top_p": 0.9, "seed": 7},
}


EVERY_PROMPT = ("greedy", "steered")  # the others (slower on the CPU) take two: some pages shared, all


def requests(round_: int, features=FEATURES) -> list[GenerateRequest]:
    """40 new tokens, 4 per step: "none" and "all+tail" commit their first block and go on."""
    return [
        GenerateRequest(f"{p}/{f}/{round_}", PROMPTS[p], max_tokens=40, **{"tokens_per_step": 4, **kw})
        for f, kw in features.items()
        for p in (PROMPTS if f in EVERY_PROMPT else ("some", "all+tail"))
    ]


def run(engine: Engine, reqs: list[GenerateRequest]) -> dict[str, list[BlockResult]]:
    """Block results per request (the round's number cut from its id); requests join two per step."""
    out: dict[str, list[BlockResult]] = {r.request_id.rsplit("/", 1)[0]: [] for r in reqs}
    pending = list(reqs)
    while pending or engine.has_work():
        for _ in range(2):
            if pending:
                engine.add_request(copy.deepcopy(pending.pop(0)))
        for res in engine.step():
            if isinstance(res, BlockResult):
                out[res.request_id.rsplit("/", 1)[0]].append(res)
    return out


def assert_same(cached: list[BlockResult], plain: list[BlockResult], name: str, rtol: float = 1e-6) -> None:
    assert [b.token_ids for b in cached] == [b.token_ids for b in plain], name
    assert [b.finish_reason for b in cached] == [b.finish_reason for b in plain], name
    assert_same_attribution(
        [r for b in cached for r in (b.attribution or [])], [r for b in plain for r in (b.attribution or [])], rtol
    )
    for a, b in zip(cached, plain):
        assert (a.input_attribution is None) == (b.input_attribution is None), name
        if a.input_attribution is not None:
            ia, ib = a.input_attribution, b.input_attribution
            for field in ("positions", "top_positions", "top_token_ids", "chunk_spans", "chunk_positions"):
                assert getattr(ia, field) == getattr(ib, field), (name, field)
            np.testing.assert_allclose(ia.top_scores, ib.top_scores, rtol=rtol, atol=1e-7)


@pytest.fixture(scope="module")
def plain(tiny_dir) -> dict[str, list[BlockResult]]:
    engine = Engine(EngineArgs(str(tiny_dir), prefix_cache=False))
    return run(engine, requests(0))


def test_cache_on_equals_cache_off_in_one_batch_and_across_time(tiny_dir, plain):
    engine = Engine(EngineArgs(str(tiny_dir), max_running=8))  # 18 requests: some wait for a slot
    full_pages = {name: len(PROMPTS[name.split("/")[0]]) // PAGE * PAGE for name in plain}
    assert len(full_pages) == 18
    total = 0
    for round_ in (1, 2):
        cached = run(engine, requests(round_))
        for name, blocks in plain.items():
            assert_same(cached[name], blocks, f"{name}, round {round_}")
        hits = {name: blocks[-1].cached_tokens for name, blocks in cached.items()}
        total += sum(hits.values())
        if round_ == 2:  # every full prompt page was cached by round 1
            assert hits == full_pages
        else:  # the first of each prefix wrote its pages, the others shared them
            assert 0 < sum(hits.values()) < sum(full_pages.values())
    stats = engine.stats()
    assert (stats.cache_hit_tokens, stats.cache_query_tokens) == (total, 2 * sum(full_pages.values()))
    assert plain["all/greedy"] != plain["all/steered"], "steering had no effect: the shared pages were not tested"


def test_fp8_prompt_pages_are_shared_exactly(tiny_dir):
    # 8 tokens a step: fp8 is emulated in bfloat16 on the CPU, where a pass is ~4x float32's.
    features = {f: {**FEATURES[f], "tokens_per_step": 8} for f in ("greedy", "steered", "attributed")}
    off = run(Engine(EngineArgs(str(tiny_dir), quantization="fp8", prefix_cache=False)), requests(0, features))
    engine = Engine(EngineArgs(str(tiny_dir), quantization="fp8"))
    for round_ in (1, 2):
        on = run(engine, requests(round_, features))
        for name, blocks in off.items():  # bfloat16: attribution values to its rounding, tokens exactly
            assert [b.token_ids for b in on[name]] == [b.token_ids for b in blocks], name
    assert engine.stats().cache_hit_tokens > 0
