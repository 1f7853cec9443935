"""The faithfulness term: suppressing the concept attribution credits most for a token must lower
that token's logit more than suppressing another active concept (what `cde eval`'s faithfulness
section measures, cde/eval/faithfulness.py, with the `suppress` preset's injection).

Why a term of its own: on the model trained without it the top contributor's drop beat another
active concept's at only 58.6% of positions, and neither the concept's weight nor its direction's
alignment with the token predicted the drop (70.8% and 51.6%): the trunk's blocks after the
injection decide it (docs/reference-model.md). So the term runs that injection through them.

On a share of the rows, at masked positions of topic documents: from the main forward's hidden
state (detached), the known head's top-k contributions sigmoid(logit_i) * E_i . W_y name the top
contributor and another concept (a random active one, weight > 0.5, else any other of the top-k).
Two more forwards of those rows inject the preset's STRENGTH * unit(E_c) of each at those
positions after block i with i + 1 >= inject_layer. The drops' difference is the difference of the
two injected logits of the token (the uninjected logit cancels); a hinge asks it to be at least
`margin`. Gradients reach the trunk and the concept directions, not which concepts were picked.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import cast

import torch
import torch.nn.functional as F

from cde.shared import suppress_preset
from cde.train.train_model import TrainModel, clean_noisy_mask


def picks(model: TrainModel, h: torch.Tensor, w_y: torch.Tensor, gen: torch.Generator) -> torch.Tensor:
    """[N, D] hidden states and token rows -> [2, N] concept ids: the top contributor, another."""
    with torch.no_grad():
        k = min(model.cfg.topk_known, model.cfg.n_concepts)
        top_w, top_i = torch.sigmoid(model.known_logits(h).clamp(-15, 15)).topk(k, dim=-1)
        emb = model.known_head.concept_embedding(top_i).float()
        contribution = top_w * torch.einsum("nkd,nd->nk", emb, w_y)
        first = contribution.argmax(-1)
        # A random other: active ones score in (1, 2), the rest in (0, 1), the top -1.
        score = torch.rand(top_w.shape, generator=gen, device=h.device) + (top_w > 0.5).float()
        score.scatter_(1, first[:, None], -1.0)
        other = score.argmax(-1)
        return torch.stack([top_i.gather(1, first[:, None])[:, 0], top_i.gather(1, other[:, None])[:, 0]])


def faithful(
    model: TrainModel,
    batch: dict,
    noisy: torch.Tensor,
    at: torch.Tensor,
    hidden: torch.Tensor,
    gen: torch.Generator,
    margin: float,
    residual_fn: Callable[..., torch.Tensor],
) -> torch.Tensor:
    """at [R, L]: the positions to measure in the batch's first R rows (a fixed R: the compiled
    forward sees one shape); hidden [B, L, D]: the noisy copy's final-norm states of the main
    forward."""
    if not at.any():
        return hidden.sum() * 0
    n = at.shape[0]
    ids, pos, doc = (batch[k][:n] for k in ("ids", "pos", "doc"))
    length, d = ids.shape[1], hidden.shape[-1]
    r, p = at.nonzero(as_tuple=True)
    lookup = cast(torch.Tensor, model.lookup)  # a buffer: nn.Module's attribute type is wider
    w_y = model.transformer.tok_emb.weight[lookup[ids[r, p]]]
    chosen = picks(model, hidden[r, p].float().detach(), w_y.float().detach(), gen)  # [2, N]
    emb = model.known_head.concept_embedding(chosen).float()
    unit = emb / (emb.norm(dim=-1, keepdim=True) + 1e-12)
    inject = torch.zeros(2, n, 2 * length, d, device=ids.device, dtype=unit.dtype)
    inject[:, r, length + p] = suppress_preset.STRENGTH * unit
    n_layers = model.cfg.n_layers
    gates = (torch.arange(1, n_layers + 1, device=ids.device) >= suppress_preset.inject_layer(n_layers)).float()
    residual = residual_fn(
        torch.cat([ids, noisy[:n]], 1).repeat(2, 1),
        torch.cat([pos, pos], 1).long().repeat(2, 1),
        clean_noisy_mask(doc.long()).repeat(2, 1, 1, 1),
        inject.flatten(0, 1),
        gates[:, None].expand(-1, 2 * n),
    )[:, length:]
    states = model.transformer.ln_f(residual).view(2, n, length, d)[:, r, p].float()
    top_logit, other_logit = (states * w_y.float()).sum(-1)
    # drop_top - drop_other = (base - top_logit) - (base - other_logit)
    return F.relu(margin - (other_logit - top_logit)).mean()
