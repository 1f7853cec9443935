"""Attribution's batched chunk top-k (every chunk's top-k in one call, then the reference's
sequential merge) selects exactly what the official heads select, ties included: the small random
model saturates its discovered-concept logits at the clamp, so ties are common. The references
are the official routines themselves on the same checkpoint: the known head's forward, the
discovered head's `_compute_unknown_topk`, and `ConceptHead.linear_features_topk_streaming` for
a last chunk shorter than k."""

import pytest
import torch
import torch.nn.functional as F
from cde.worker import concept_contributions as attribution
from cde.worker.checkpoint import load_checkpoint
from cde.worker.concept_contributions import LOGIT_CLAMP, known_topk, streaming_topk, unknown_topk

from tests.oracle import official_model

pytestmark = pytest.mark.reference


@pytest.mark.parametrize("group,rows", [(attribution.GROUP_LOGITS, attribution.MAX_ROWS), (1000, 5)])
def test_batched_chunk_topk_equals_the_official_heads(small_dir, monkeypatch, group, rows):
    from steerling.models.interpretable.concept_head import ConceptHead

    # small groups and row passes: several groups per head and several passes per call
    monkeypatch.setattr(attribution, "GROUP_LOGITS", group)
    monkeypatch.setattr(attribution, "MAX_ROWS", rows)
    cfg, model = load_checkpoint(str(small_dir), dtype=torch.float32, device="cpu")
    official, _ = official_model(small_dir)
    hidden = torch.randn(37, cfg.n_embd, generator=torch.Generator().manual_seed(0))
    up = model.unknown_head.predictor_up.weight.detach()
    with torch.inference_mode():
        compressed = F.linear(hidden, model.unknown_head.predictor_down.weight)
        clamped = (F.linear(compressed, up) >= LOGIT_CLAMP).sum().item()
        ours_known, ours_known_logits = known_topk(model, cfg, hidden)
        ref_known = official.known_head(hidden[None])
        ours_unknown, ours_unknown_logits = unknown_topk(model, cfg, hidden)
        ref_unknown, ref_unknown_logits = official._compute_unknown_topk(hidden[None], cfg.unknown_topk)
        # a last chunk shorter than k (n = 2 * block + 3), ranked by sigmoid
        n = 2 * 40 + 3
        ours_short, _ = streaming_topk(compressed, up, n, 64, 40, True)
        _, ref_short, _ = ConceptHead.linear_features_topk_streaming(
            compressed[None], up[:n], torch.zeros(n, up.shape[1]), k=64, block_size=40
        )
    assert clamped > 100  # ties at the clamp really are exercised
    assert torch.equal(ours_known, ref_known.topk_indices[0])
    assert torch.allclose(ours_known_logits, ref_known.topk_logits[0], atol=1e-5)
    assert torch.equal(ours_unknown, ref_unknown[0])
    assert torch.allclose(ours_unknown_logits, ref_unknown_logits[0], atol=1e-5)
    assert torch.equal(ours_short, ref_short[0])


@pytest.mark.parametrize(
    "overrides",
    [
        {"topk_known": 200, "topk_known_features": 200},
        {"topk_known": 4, "topk_known_features": 120},
        {"unknown_topk": 300},
    ],
    ids=["known-wider-than-its-head", "features-wider-than-the-head", "discovered-wider-than-its-head"],
)
def test_a_top_k_wider_than_its_head_takes_every_concept_as_the_official_heads(tmp_path, overrides):
    """The heads' top-k widths are config values: one wider than its head selects every concept,
    as the official heads do, and attribution reports that many (it once packed the config's
    width, and the first attributed block failed)."""
    from cde.shared.protocol import AttributionSpec, GenerateRequest
    from cde.worker.checkpoint import make_model
    from cde.worker.engine import Engine, EngineArgs

    model_dir = make_model("tiny", tmp_path / "wide", seed=1, overrides=overrides)
    cfg, model = load_checkpoint(str(model_dir), dtype=torch.float32, device="cpu")
    official, _ = official_model(model_dir)
    hidden = torch.randn(5, cfg.n_embd, generator=torch.Generator().manual_seed(0))
    with torch.inference_mode():
        known, _ = known_topk(model, cfg, hidden)
        unknown, _ = unknown_topk(model, cfg, hidden)
        ref_unknown, _ = official._compute_unknown_topk(hidden[None], cfg.unknown_topk)
        assert torch.equal(known, official.known_head(hidden[None]).topk_indices[0])
    assert torch.equal(unknown, ref_unknown[0])
    engine = Engine(EngineArgs(str(model_dir)))
    engine.add_request(GenerateRequest("a", [1] * 64, max_tokens=8, tokens_per_step=8, attribution=AttributionSpec()))
    records = []
    while engine.has_work():
        records += [r for res in engine.step() for r in res.attribution]
    assert len(records) == 8
    assert {(len(r["known"]), len(r["discovered"])) for r in records} == {(known.shape[1], unknown.shape[1])}
