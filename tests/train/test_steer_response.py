"""The amplify response measure against the formula worked out by hand on a model whose blocks are
the identity (their norm gains zeroed: post-norm blocks then add nothing), so the final hidden
state of a masked position is ln_f(e_mask + alpha * u) and the logits are W @ that."""

import torch
from cde.shared.config import MASK_ID

from cde.train.loop import Options, build
from cde.train.program import model_config
from cde.train.reference_concepts import topic_concept
from cde.train.steer_response import logits_per_strength
from cde.train.token_set import used_ids
from cde.train.vocab import TOPICS


def test_logit_change_per_strength_matches_the_hand_formula():
    torch.manual_seed(0)
    model, _, _ = build(Options(out="", config=model_config("mini")), used_ids(sample_docs=200))
    model.eval()
    with torch.no_grad():
        for block in model.transformer.blocks:
            block.ln_1.weight.zero_()
            block.ln_2.weight.zero_()
        model.transformer.ln_f.weight.fill_(1.5)
    w = model.transformer.tok_emb.weight.detach()
    e = w[model.lookup[MASK_ID]]
    eps = model.cfg.norm_eps

    def final(x: torch.Tensor) -> torch.Tensor:
        return 1.5 * x / torch.sqrt(x.pow(2).mean() + eps)

    # A strength small enough that alpha * u does not swamp the mask embedding (random init: W @ u
    # peaks near 0.1, so alpha = 0.2 against |e| ~ 0.3): the final norm's damping shows.
    strength, moves = 0.02, []
    emb = model.known_head.concept_embedding.weight.detach()
    for t in TOPICS:
        u = emb[topic_concept(t.name)] / emb[topic_concept(t.name)].norm()
        alpha = strength / (w @ u).max().clamp_min(1e-6)
        moves.append(float((w @ final(e + alpha * u) - w @ final(e)).max()) / strength)
    expected = sum(moves) / len(moves)
    assert abs(logits_per_strength(model, strength) - expected) < 1e-4
