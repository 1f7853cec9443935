"""A block cut short by a stop carries attribution for the tokens it keeps and no others: one
concept-attribution record and one input-attribution target per kept token, at the kept
positions, with the kept tokens (a seeded sample run once without the stop gives the expected
tokens; their positions follow from the prompt's length)."""

import pytest
from cde.shared.config import PAGE
from cde.shared.protocol import AttributionSpec, BlockResult, GenerateRequest, InputAttributionSpec
from cde.worker.engine import Engine, EngineArgs

PROMPT = list(range(2000, 2000 + PAGE))  # generated token i sits at position 64 + i
SAMPLED = {"max_tokens": PAGE, "temperature": 1.0, "seed": 1, "tokens_per_step": 32}
KEPT = 19  # the stop token is the 20th: the block keeps 19 of its 64 tokens


@pytest.fixture(scope="module")
def engine(tiny_dir):
    return Engine(EngineArgs(str(tiny_dir), max_running=2))


# stream_denoise: the records come per step (all the block's picks, cut at the block's end), else
# once per block (worker/block_attribution.py)
@pytest.mark.parametrize("stream_denoise", [False, True], ids=["per_block", "per_step"])
def test_a_block_cut_by_a_stop_carries_only_its_tokens_records(engine, stream_denoise):
    unstopped = engine.generate([GenerateRequest("free", PROMPT, **SAMPLED)])["free"]
    stop_id = unstopped[KEPT]
    assert stop_id not in unstopped[:KEPT]
    attribution = AttributionSpec(top_k=4, inputs=InputAttributionSpec(top_k=4, steps=1))
    engine.add_request(
        GenerateRequest(
            "cut", PROMPT, **SAMPLED, stop_token_ids=[stop_id], attribution=attribution, stream_denoise=stream_denoise
        )
    )
    results = []
    while engine.has_work():
        results += engine.step()
    [block] = [r for r in results if isinstance(r, BlockResult)]
    kept, positions = unstopped[:KEPT], list(range(PAGE, PAGE + KEPT))
    assert (block.token_ids, block.finish_reason) == (kept, "stop")
    records = block.attribution.records()
    assert [r["position"] for r in records] == positions
    assert [r["token_id"] for r in records] == kept
    inputs = block.input_attribution
    assert (inputs.positions, inputs.token_ids) == (positions, kept)
    assert len(inputs.top_positions) == len(inputs.top_scores) == KEPT
