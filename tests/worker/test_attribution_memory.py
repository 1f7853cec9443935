"""Attribution at Steerling-8B shapes never builds a tensor over all 101,196 discovered concepts:
every tensor an op produces is recorded (meta device, so nothing is allocated) and the
discovered head's per-position intermediates stay within positions x GROUP_LOGITS (a group of
streamed concept blocks, no more than the reference's own positions x top-k x rank second pass),
but for the selected concepts' embeddings, EMBEDDED values at a time."""

import torch
from cde.shared.config import preset
from cde.worker import concept_contributions as attribution
from cde.worker.model import SteerlingModel

from tests.worker.test_memory import ShapeWatch

P = 3  # committed positions in the step (distinct from every model dimension)


def meta_8b():
    cfg = preset("8b")
    with torch.device("meta"):
        model = SteerlingModel(cfg).to(torch.bfloat16)
    hidden = torch.empty(P, cfg.n_embd, dtype=torch.bfloat16, device="meta")
    tokens = torch.zeros(P, dtype=torch.long, device="meta")
    return cfg, model, hidden, tokens


def test_no_full_width_unknown_tensor():
    cfg, model, hidden, tokens = meta_8b()
    with ShapeWatch() as log:
        packed = attribution.attribute(model, cfg, hidden, tokens, torch.empty(P, device="meta"))
    assert packed.shape == (P, attribution.width(cfg))
    wide = [(f, s) for f, s in log.shapes if any(d >= cfg.n_unknown_concepts for d in s)]
    assert not wide, wide


def test_unknown_head_intermediates_bounded_by_positions_x_block():
    cfg, model, hidden, tokens = meta_8b()
    with ShapeWatch() as log:
        idx, _ = attribution.unknown_topk(model, cfg, hidden)
        attribution.unknown_alignment(model, idx, model.transformer.lm_head.weight[tokens].float())
    assert idx.shape == (P, cfg.unknown_topk)
    # Per position: a group of streamed logit blocks, then the k selected concepts' rank-r rows
    # (the reference's own [P, k, r] second pass) and their embeddings [P, k, D] as the reference
    # builds them, a few positions at a time; never [P, n_unknown].
    per_position = [s for _, s in log.shapes if s and s[0] == P]
    group = attribution.GROUP_LOGITS
    assert group <= cfg.unknown_topk * cfg.factorize_rank < cfg.n_unknown_concepts
    embedded = [s for s in per_position if tuple(s) == (P, cfg.unknown_topk, cfg.n_embd)]
    assert embedded and P * cfg.unknown_topk * cfg.n_embd <= attribution.EMBEDDED
    assert max(torch.Size(s).numel() for s in per_position if s not in embedded) <= P * group
    # The rest are slices of the weights, one group of concept blocks at a time.
    others = [s for _, s in log.shapes if not s or s[0] != P]
    assert max(torch.Size(s).numel() for s in others) <= group * cfg.factorize_rank


def test_discovered_embeddings_are_built_a_few_positions_at_a_time():
    cfg, model, _, _ = meta_8b()
    many = 20  # more positions than EMBEDDED holds at once on the 8B
    idx = torch.zeros(many, cfg.unknown_topk, dtype=torch.long, device="meta")
    w_y = torch.empty(many, cfg.n_embd, device="meta")
    with ShapeWatch() as log:
        out = attribution.unknown_alignment(model, idx, w_y)
    assert out.shape == (many, cfg.unknown_topk)
    widest = max(torch.Size(s).numel() for _, s in log.shapes if len(s) == 3)
    assert cfg.unknown_topk * cfg.n_embd <= widest <= attribution.EMBEDDED
