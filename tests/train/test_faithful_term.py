"""The faithfulness training term measures what `cde eval`'s faithfulness section measures: with
one masked position, its hinge reads drop(top) - drop(other) of the eval's dense forward on the
document alone (cde/eval/faithfulness.py), for the concepts it picked."""

import pytest
import torch
from cde.shared.config import MASK_ID

from cde.eval.faithfulness import _state
from cde.train.faithful_term import faithful, picks
from cde.train.loop import Options, build
from cde.train.objective import Weights, losses
from cde.train.program import model_config
from cde.train.reference_concepts import concepts
from cde.train.rows import make_batch
from cde.train.samples import TEXT
from cde.train.token_set import used_ids
from cde.train.train_model import clean_noisy_mask


@pytest.fixture(scope="module")
def setup():
    model, _, topics = build(Options(out="", config=model_config("mini")), used_ids(sample_docs=500))
    return model.eval(), topics, make_batch(0, 0, 4, 256, len(concepts()))


def _topic_position(model, batch):
    """(row, position) of a TEXT token of a topic document, with a row for its token."""
    steer_of = torch.gather(batch["steer"], 1, batch["doc"].long().clamp_min(0))
    ok = (batch["kinds"] == TEXT) & (steer_of >= 0) & (batch["doc"] >= 0) & (model.lookup[batch["ids"]] < model.n_used)
    r, p = ok.nonzero()[len(ok.nonzero()) // 2].tolist()
    return r, p


def test_the_hinge_reads_the_eval_drops_of_the_picked_concepts(setup):
    model, _, batch = setup
    r, p = _topic_position(model, batch)
    ids, length = batch["ids"], batch["ids"].shape[1]
    noisy = ids.clone()
    noisy[r, p] = MASK_ID
    at = torch.zeros_like(ids, dtype=torch.bool)
    at[r, p] = True
    with torch.no_grad():
        x = torch.cat([ids, noisy], 1)
        pos = torch.cat([batch["pos"], batch["pos"]], 1).long()
        hidden = model.hidden(x, pos, clean_noisy_mask(batch["doc"].long()))[:, length:]
        margin = 1000.0  # never met: the hinge returns margin - (drop_top - drop_other)
        loss = faithful(model, batch, noisy, at, hidden, torch.Generator().manual_seed(3), margin, model.residual)
    w_y = model.transformer.tok_emb.weight[model.lookup[ids[r, p]]].detach()
    top, other = picks(model, hidden[r, p][None], w_y[None], torch.Generator().manual_seed(3))[:, 0].tolist()

    # The eval's forward: the document alone, from position 0, only p masked.
    span = batch["doc"][r] == batch["doc"][r, p]
    start = int(span.nonzero()[0])
    doc_ids = ids[r, span][None]
    emb = model.known_head.concept_embedding.weight.detach()
    base = float(_state(model, doc_ids, p - start) @ w_y)
    drop = {c: base - float(_state(model, doc_ids, p - start, emb[c] / emb[c].norm()) @ w_y) for c in (top, other)}
    assert top != other
    assert float(loss) == pytest.approx(margin - (drop[top] - drop[other]), abs=1e-3)

    # The top pick is the largest contribution among the known head's top-k by weight.
    weights = torch.sigmoid(model.known_logits(hidden[r, p]).clamp(-15, 15)).detach()
    top_k = weights.topk(model.cfg.topk_known).indices
    contribution = {int(c): float(weights[c] * (emb[c] @ w_y)) for c in top_k}
    assert top == max(contribution, key=contribution.get)


def test_the_term_is_off_at_weight_zero_and_trains_the_trunk_and_directions(setup):
    model, topics, batch = setup
    out = losses(model, topics, batch, torch.Generator().manual_seed(0), Weights(faithful_weight=0.0))
    assert out["faithful"].item() == 0.0
    model.zero_grad()
    w = Weights(faithful_share=1.0, faithful_margin=1000.0)
    out = losses(model, topics, batch, torch.Generator().manual_seed(0), w)
    out["faithful"].backward()
    assert out["faithful"].item() > 0
    assert model.transformer.blocks[-1].attn.c_proj.weight.grad.abs().sum() > 0
    assert model.known_head.concept_embedding.weight.grad.abs().sum() > 0
    model.zero_grad()
