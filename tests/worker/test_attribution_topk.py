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
