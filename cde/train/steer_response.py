"""How far the amplify injection moves the logits: the largest logit change per unit of strength,
at the amplify preset's layer, on the masked first reply block of a neutral prompt, mean over the
topic concepts. Normalised steering promises 1.0 ("strength reads in logit units"); the injection
is added before the final norm, so a trunk that raises its residual rms or lowers the final gain
damps it. Issue 27's retrain read 0.08 against the shipped model's 0.18 and lost amplify: this is
the number to watch on a snapshot before spending a device run."""

from __future__ import annotations

from typing import cast

import torch

from cde.shared.config import MASK_ID, PAGE
from cde.shared.protocol import SteeringSpec
from cde.shared.tokenizer import get_tokenizer
from cde.train.reference_concepts import topic_concept
from cde.train.samples import NEUTRAL_PROMPTS
from cde.train.train_model import TrainModel, block_causal_mask
from cde.train.vocab import TOPICS


@torch.no_grad()
def logits_per_strength(model: TrainModel, strength: float = 8.0) -> float:
    tok = get_tokenizer(True)
    head = tok.chat_prompt([{"role": "user", "content": NEUTRAL_PROMPTS[0]}])
    n = PAGE * (len(head) // PAGE + 1)
    lookup = cast(torch.Tensor, model.lookup)  # a buffer: nn.Module's attribute type is wider
    ids = torch.tensor([head + [MASK_ID] * (n - len(head))], device=lookup.device)
    pos = torch.arange(n, device=ids.device)[None]
    mask = block_causal_mask(torch.zeros_like(ids))
    masked = ids[0] == MASK_ID
    layers = model.cfg.n_layers
    # the amplify preset's inject_layer (gateway/params.py: SteeringSpec's), clamped to the model's layers
    amplify_layer = min(SteeringSpec.inject_layer, layers)
    gates = (torch.arange(1, layers + 1, device=ids.device) >= amplify_layer).float()[:, None]
    # the used ids only: the last column is the constant logit of all unused ids
    base = model.logits(model.hidden(ids, pos, mask)[0, masked].float())[:, :-1]
    emb = model.known_head.concept_embedding.weight.float()
    moves = []
    for topic in TOPICS:
        unit = emb[topic_concept(topic.name)] / emb[topic_concept(topic.name)].norm()
        alpha = strength / float(model.peak_alignment(unit[None]))
        inject = torch.zeros(1, n, model.cfg.n_embd, device=ids.device)
        inject[0, masked] = alpha * unit
        steered = model.logits(model.hidden(ids, pos, mask, inject, gates)[0, masked].float())[:, :-1]
        moves.append(float((steered - base).max(-1).values.mean()) / strength)
    return sum(moves) / len(moves)
