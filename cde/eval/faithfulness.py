"""Is attribution faithful? Suppressing the concept attribution credits most for a token should
lower that token's logit more than suppressing another active concept.

On the dense forward (cde/train/train_model.py, proven equal to the official model's), over topic
replies written by the generator (seeded; "Tell me about <topic>." and a paragraph of it): at a
position p of the reply, mask p (the state in which a token is committed), read the known head at p
(top-k concepts, contribution sigmoid(logit_i) * E_i . W_y as the engine reports it), then suppress
c = the top contributor and c = a random other active concept (sigmoid weight > 0.5, else any
other of the top-k) as the `suppress` preset does (cde/shared/suppress_preset.py):
- its injection, STRENGTH * unit(E_c) after every block i with i + 1 >= inject_layer, at p;
- its ReLU logit mask, which takes RELU_MASK * relu(E_c . W_y) off the target logit.
The drop is the target logit's fall. Both are reported: the whole preset (what a user's suppress
request does) and its injection alone (how the trunk carries a concept direction).
"""

from __future__ import annotations

import random
from typing import Any

import torch

from cde.shared import suppress_preset
from cde.shared.config import MASK_ID
from cde.shared.tokenizer import get_tokenizer
from cde.train.text import paragraph
from cde.train.train_model import TrainModel, block_causal_mask
from cde.train.vocab import TOPICS


@torch.no_grad()
def _state(model: TrainModel, ids: torch.Tensor, p: int, direction: torch.Tensor | None = None) -> Any:
    """The final-norm hidden state at p, masked, with the suppress preset's injection along
    `direction` when given."""
    x = ids.clone()
    x[0, p] = MASK_ID
    pos = torch.arange(ids.shape[1], device=ids.device)[None]
    inject = gates = None
    if direction is not None:
        inject = torch.zeros(1, ids.shape[1], model.cfg.n_embd, device=ids.device)
        inject[0, p] = suppress_preset.STRENGTH * direction
        layer = suppress_preset.inject_layer(model.cfg.n_layers)
        gates = (torch.arange(1, model.cfg.n_layers + 1, device=ids.device) >= layer).float()[:, None]
    return model.hidden(x, pos, block_causal_mask(torch.zeros_like(ids)), inject, gates)[0, p]


@torch.no_grad()
def logit_drops(model: TrainModel, n_topics: int, per_reply: int = 8, seed: int = 0) -> dict:
    tok = get_tokenizer(True)
    rng = random.Random(f"faithfulness:{seed}")
    emb = model.known_head.concept_embedding.weight
    k = min(model.cfg.topk_known, model.cfg.n_concepts)
    # Per position, the (top, other) drops: the whole preset's, then its injection's alone.
    preset: list[tuple[float, float]] = []
    injection: list[tuple[float, float]] = []
    for topic in TOPICS[:n_topics]:
        head = tok.chat_prompt([{"role": "user", "content": f"Tell me about {topic.phrase}."}])
        body = tok.encode(paragraph(rng, topic=topic).text)
        ids = torch.tensor([head + body], device=emb.device)
        # A token the model has no row for (a word the generator learnt after this model was
        # trained) has no W_y to attribute to.
        known = [p for p in range(len(head), ids.shape[1]) if int(model.lookup[ids[0, p]]) < model.n_used]
        for p in rng.sample(known, min(per_reply, len(known))):
            w_y = model.transformer.tok_emb.weight[model.lookup[ids[0, p]]]
            h = _state(model, ids, p)
            weights = torch.sigmoid(model.known_logits(h).clamp(-15, 15))
            top_w, top_i = weights.topk(k)
            contribution = top_w * (emb[top_i] @ w_y)
            first = int(contribution.argmax())
            others = [i for i in range(k) if i != first and top_w[i] > 0.5] or [i for i in range(k) if i != first]
            base = float(h @ w_y)
            inj, full = [], []
            for i in (first, rng.choice(others)):
                e = emb[top_i[i]]
                drop = base - float(_state(model, ids, p, e / e.norm()) @ w_y)
                inj.append(drop)
                full.append(drop + suppress_preset.RELU_MASK * max(float(e @ w_y), 0.0))
            injection.append((inj[0], inj[1]))
            preset.append((full[0], full[1]))
    return {"positions": len(preset), **_summary(preset), "injection": _summary(injection)}


def _summary(pairs: list[tuple[float, float]]) -> dict:
    n = max(len(pairs), 1)
    return {
        "drop_top": sum(t for t, _ in pairs) / n,
        "drop_other": sum(o for _, o in pairs) / n,
        "top_beats_other": sum(t > o for t, o in pairs) / n,
    }
