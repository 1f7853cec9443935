"""Attribution's batched chunk top-k (every chunk's top-k in one call, then the reference's
sequential merge) selects exactly what chunk-by-chunk streaming selects, ties included: the
small random model saturates its discovered-concept logits at the clamp, so ties are common."""

import pytest
import torch
import torch.nn.functional as F

from worker import attribution
from worker.attribution import LOGIT_CLAMP, streaming_topk
from worker.checkpoint import load_checkpoint


def chunk_by_chunk(x, weight, n, k, block, by_sigmoid):
    """The reference's loop, verbatim in structure: one chunk's logits at a time."""
    top_v = torch.full((x.shape[0], k), float("-inf"))
    top_i = torch.zeros((x.shape[0], k), dtype=torch.long)
    for start in range(0, n, block):
        end = min(start + block, n)
        logits = F.linear(x, weight[start:end]).float().clamp(-LOGIT_CLAMP, LOGIT_CLAMP)
        scores = torch.sigmoid(logits) if by_sigmoid else logits
        v, i = scores.topk(min(k, end - start), dim=1)
        i = i + start
        if v.shape[1] < k:
            v, i = F.pad(v, (0, k - v.shape[1]), value=float("-inf")), F.pad(i, (0, k - i.shape[1]))
        top_v, sel = torch.cat([top_v, v], 1).topk(k, dim=1)
        top_i = torch.cat([top_i, i], 1).gather(1, sel)
    return top_i


@pytest.mark.parametrize("group,rows", [(attribution.GROUP_LOGITS, attribution.MAX_ROWS), (1000, 5)])
def test_batched_chunk_topk_equals_chunk_by_chunk(small_dir, monkeypatch, group, rows):
    # small groups and row passes: several groups per head and several passes per call
    monkeypatch.setattr(attribution, "GROUP_LOGITS", group)
    monkeypatch.setattr(attribution, "MAX_ROWS", rows)
    cfg, model = load_checkpoint(str(small_dir), dtype=torch.float32, device="cpu")
    g = torch.Generator().manual_seed(0)
    hidden = torch.randn(37, cfg.n_embd, generator=g)
    compressed = F.linear(hidden, model.unknown_head.predictor_down.weight)
    up = model.unknown_head.predictor_up.weight.detach()
    with torch.inference_mode():
        ref = chunk_by_chunk(compressed, up, cfg.n_unknown_concepts, cfg.unknown_topk, cfg.concept_block_size, False)
        ours, _ = streaming_topk(compressed, up, cfg.n_unknown_concepts, cfg.unknown_topk, cfg.concept_block_size, False)
        clamped = (F.linear(compressed, up) >= LOGIT_CLAMP).sum().item()
        # a last chunk shorter than k (n = 2 * block + 3)
        n = 2 * 40 + 3
        ref_short = chunk_by_chunk(compressed, up, n, 64, 40, True)
        ours_short, _ = streaming_topk(compressed, up, n, 64, 40, True)
    assert clamped > 100  # ties at the clamp really are exercised
    assert torch.equal(ours, ref)
    assert torch.equal(ours_short, ref_short)
