"""Is attribution faithful? Suppressing the concept attribution credits most for a token should
lower that token's logit more than suppressing another active concept.

On the dense forward (cde/train/train_model.py, proven equal to the official model's), over topic
replies written by the generator (seeded; "Tell me about <topic>." and a paragraph of it): at a
position p of the reply, mask p (the state in which a token is committed), read the known head at p
(top-k concepts, contribution sigmoid(logit_i) * E_i . W_y as the engine reports it), then run
again with the `suppress` preset's injection, -strength * unit(E_c) after every block i with
i + 1 >= inject_layer at p, for c = the top contributor and for c = a random other active concept
(sigmoid weight > 0.5, else any other of the top-k). The drop is the target logit's fall.
"""

from __future__ import annotations

import random
from typing import Any

import torch

from cde.shared.config import MASK_ID
from cde.shared.tokenizer import get_tokenizer
from cde.train.text import paragraph
from cde.train.train_model import TrainModel, block_causal_mask
from cde.train.vocab import TOPICS


@torch.no_grad()
def _state(
    model: TrainModel, ids: torch.Tensor, p: int, direction: torch.Tensor | None = None, strength: float = 0.0
) -> Any:
    x = ids.clone()
    x[0, p] = MASK_ID
    pos = torch.arange(ids.shape[1], device=ids.device)[None]
    inject = gates = None
    if direction is not None:
        inject = torch.zeros(1, ids.shape[1], model.cfg.n_embd, device=ids.device)
        inject[0, p] = -strength * direction
        layer = max(1, model.cfg.n_layers // 2)
        gates = (torch.arange(1, model.cfg.n_layers + 1, device=ids.device) >= layer).float()[:, None]
    return model.hidden(x, pos, block_causal_mask(torch.zeros_like(ids)), inject, gates)[0, p]


@torch.no_grad()
def logit_drops(model: TrainModel, n_topics: int, per_reply: int = 8, strength: float = 7.0, seed: int = 0) -> dict:
    tok = get_tokenizer(True)
    rng = random.Random(f"faithfulness:{seed}")
    emb = model.known_head.concept_embedding.weight
    k = min(model.cfg.topk_known, model.cfg.n_concepts)
    top_drops, other_drops, wins = [], [], 0
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
            drops = []
            for i in (first, rng.choice(others)):
                unit = emb[top_i[i]] / emb[top_i[i]].norm()
                drops.append(base - float(_state(model, ids, p, unit, strength) @ w_y))
            top_drops.append(drops[0])
            other_drops.append(drops[1])
            wins += drops[0] > drops[1]
    n = max(len(top_drops), 1)
    return {
        "positions": len(top_drops),
        "drop_top": sum(top_drops) / n,
        "drop_other": sum(other_drops) / n,
        "top_beats_other": wins / n,
    }
