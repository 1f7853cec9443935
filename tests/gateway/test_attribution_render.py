"""gateway/attribution_render.py: a choice's attribution is over its completion's tokens, taken by
position (holes left masked before <|eot_id|> included), and its last chunk ends where EOT ended
the generation."""

import numpy as np
from cde.gateway.attribution_render import renderer
from cde.gateway.concepts import ConceptLabels
from cde.gateway.model_info import ModelInfo
from cde.shared.chunk_attribution import aggregate
from cde.shared.packed_attribution import PackedAttribution
from cde.shared.protocol import AttributionSpec, GenerateRequest
from cde.shared.tokenizer import Tokenizer

from tests.shared.test_packed_attribution import records

PROMPT = 64


def render(recs: list[dict], completion_tokens: int, end: int | None) -> dict:
    req = GenerateRequest("r", [1] * PROMPT, attribution=AttributionSpec(per_token=True))
    info = ModelInfo("m", 4096, 100352, True, 2, 8)
    out = renderer([req], Tokenizer(), ConceptLabels(), info)(
        0, [PackedAttribution.from_records(recs)], completion_tokens, end
    )
    assert out is not None
    return dict(out)


def test_the_completion_is_its_first_tokens_by_position_and_ends_at_eot():
    recs = records(6, 3, 2, seed=1)
    for r, p in zip(recs, (67, 68, 69, 73, 74, 75)):  # masked holes at 64-66 and 70-72
        r["position"] = p
    out = render(recs[::-1], completion_tokens=6, end=80)  # EOT at 80: 76-79 never unmasked
    assert [t["offset"] for t in out["tokens"]] == [3, 4, 5, 9, 10, 11]
    [chunk] = out["chunks"]
    assert (chunk["start"], chunk["end"]) == (0, 16)
    top_k = AttributionSpec().top_k
    expected = aggregate(recs, Tokenizer().decode, prompt_len=PROMPT, n_known=8, top_k=top_k, end=80)["chunks"][0]
    np.testing.assert_array_equal(
        [c["contribution"] for c in chunk["concepts"]], [c["contribution"] for c in expected["concepts"]]
    )


def test_a_stop_string_cut_keeps_the_tokens_before_it():
    recs = records(6, 3, 2, seed=2)
    for r, p in zip(recs, (64, 65, 70, 71, 72, 73)):
        r["position"] = p
    out = render(recs, completion_tokens=4, end=None)  # a stop string cut the text after 4 tokens
    assert [t["offset"] for t in out["tokens"]] == [0, 1, 6, 7]
    assert out["chunks"][-1]["end"] == 8
