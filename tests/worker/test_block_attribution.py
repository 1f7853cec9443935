"""worker/block_attribution.py through the engine: a request that does not stream the denoising
gets its concept attribution computed once per completed block, from the rows its passes
stashed, and it equals what the per-step path (a request that streams the denoising, otherwise
the same) carries in its blocks: same tokens, positions, steps and concepts, the same numbers."""

import numpy as np
import pytest
from cde.shared.config import PAGE
from cde.shared.protocol import AttributionSpec, BlockResult, GenerateRequest
from cde.worker.engine import Engine, EngineArgs

PROMPT = list(range(3000, 3000 + PAGE + 20))  # the first generated block shares its page with the prompt


@pytest.fixture(scope="module")
def engine(tiny_dir):
    return Engine(EngineArgs(str(tiny_dir), max_running=4))


def run(engine: Engine, requests: list[GenerateRequest]) -> dict[str, list[BlockResult]]:
    for r in requests:
        engine.add_request(r)
    blocks: dict[str, list[BlockResult]] = {r.request_id: [] for r in requests}
    while engine.has_work():
        for res in engine.step():
            if isinstance(res, BlockResult):
                blocks[res.request_id].append(res)
    return blocks


def assert_same(per_block: BlockResult, per_step: BlockResult) -> None:
    assert per_block.token_ids == per_step.token_ids
    got, want = per_block.attribution.arrays(), per_step.attribution.arrays()
    assert len(per_block.attribution) == len(per_block.token_ids) > 0
    for name in ("token_ids", "positions", "steps", "known_ids", "discovered_ids"):
        assert np.array_equal(got[name], want[name]), name
    for name in set(want) - {"token_ids", "positions", "steps", "known_ids", "discovered_ids"}:
        assert np.allclose(got[name], want[name], rtol=1e-5, atol=1e-6), name


@pytest.mark.parametrize(
    "params",
    [
        {"max_tokens": 2 * PAGE},  # greedy, two blocks and a part
        # several picks a step, the last of a block fewer than asked (44 = 14 x 3 + 2, 56 = 18 x 3 + 2)
        {"max_tokens": 100, "temperature": 1.0, "seed": 7, "tokens_per_step": 3},
    ],
    ids=["greedy", "sampled_3_per_step"],
)
def test_per_block_attribution_equals_the_per_step_path(engine, params):
    spec = AttributionSpec(top_k=4)
    # In one batch: the per-step request's passes carry the per-block ones' stashed rows, and the
    # two per-block requests complete their blocks in the same pass (one launch for both).
    blocks = run(
        engine,
        [
            GenerateRequest("step", PROMPT, attribution=spec, stream_denoise=True, **params),
            GenerateRequest("block", PROMPT, attribution=spec, **params),
            GenerateRequest("block2", PROMPT, attribution=spec, **params),
        ],
    )
    assert len(blocks["step"]) == len(blocks["block"]) == len(blocks["block2"]) >= 2
    for per_step, per_block, twin in zip(blocks["step"], blocks["block"], blocks["block2"]):
        assert_same(per_block, per_step)
        assert_same(twin, per_step)


def test_a_slot_taken_over_attributes_the_new_request(tiny_dir):
    """One slot: each request's blocks come from its own stashed rows, not its predecessor's."""
    engine = Engine(EngineArgs(str(tiny_dir), max_running=1))
    spec = AttributionSpec(top_k=4)
    first = run(engine, [GenerateRequest("a", PROMPT, attribution=spec, max_tokens=PAGE)])["a"]
    other = list(range(5000, 5000 + PAGE))
    second = run(engine, [GenerateRequest("b", other, attribution=spec, max_tokens=PAGE)])["b"]
    again = run(engine, [GenerateRequest("c", other, attribution=spec, max_tokens=PAGE, stream_denoise=True)])["c"]
    assert first[0].token_ids != second[0].token_ids
    assert_same(second[0], again[0])


def test_a_request_without_step_events_is_attributed_once_per_block(engine, monkeypatch):
    """The point of the stash: one attribution call per completed block, not one per step."""
    calls = []
    launch = engine.runner.attribution.launch
    monkeypatch.setattr(engine.runner.attribution, "launch", lambda *a: (calls.append(a[0].shape[0]), launch(*a))[1])
    spec = AttributionSpec(top_k=4)
    blocks = run(engine, [GenerateRequest("once", PROMPT, attribution=spec, max_tokens=2 * PAGE)])["once"]
    assert calls == [len(b.token_ids) for b in blocks]
    calls.clear()
    streamed = run(engine, [GenerateRequest("steps", PROMPT, attribution=spec, max_tokens=PAGE, stream_denoise=True)])
    assert streamed["steps"][-1].finish_reason == "length"
    assert len(calls) == PAGE  # one token per step: a call per step
