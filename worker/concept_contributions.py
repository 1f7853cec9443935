"""Faithful concept attribution on the device (reference: `FaithfulConceptAttributor`,
`AttributionAccumulator.commit`, `ConceptHead.linear_features_topk_streaming` / `_factorized`).

Given the final hidden states of the positions committed in a step (gathered across every
request of the batch that asked for attribution), computes in one batched pass per position:
the known head's top-k concepts, the discovered head's top-k through the rank-r factorisation,
each concept's contribution `sigmoid(logit_i) * (E_i . W_y)` to the committed token's logit and
the residual epsilon. The result is one packed float64 tensor, so the runner can bring it to the
host in the same copy as the chosen tokens.

Top-k selection replays the reference's streaming merge chunk by chunk (same chunk boundaries,
same candidate order), so ties and near-ties resolve the same way: saturated logits (clamped at
+-15) tie often. The chunks' own top-ks are taken in batched calls, GROUP_LOGITS concepts at a
time (eight 4096-concept chunks on the 8B); only the small merges stay sequential. The discovered
head never has more than `positions x GROUP_LOGITS` logits alive, never all 101,196.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F
from cde.shared.config import ModelConfig

if TYPE_CHECKING:
    from cde.worker.model import SteerlingModel

LOGIT_CLAMP = 15.0


GROUP_LOGITS = 1 << 15  # concept logits alive per position at once (the reference's own [k, r] second pass)
MAX_ROWS = 2048  # positions per pass: at most 256 MB of float32 logits alive
EMBEDDED = 1 << 22  # discovered-concept embedding values alive at once ([positions, k, D]: 8 positions on the 8B)


def streaming_topk(
    x: torch.Tensor, weight: torch.Tensor, n: int, k: int, block: int, by_sigmoid: bool
) -> tuple[torch.Tensor, torch.Tensor]:
    """Top-k of `x @ weight[:n].T` per row, merged `block` concepts at a time like the
    reference. x is the (possibly compressed) hidden state [P, d]; the weight's dtype follows x.
    Returns indices [P, k] and the logits recomputed for them (clamped), like the reference's
    second pass."""
    k = min(k, n)
    top_i = torch.cat(
        [_merged_topk(x[r : r + MAX_ROWS], weight, n, k, block, by_sigmoid) for r in range(0, x.shape[0], MAX_ROWS)]
    )
    picked = F.embedding(top_i, weight)  # [P, k, d]
    logits = torch.einsum("bd,bkd->bk", x.float(), picked.float()).clamp(-LOGIT_CLAMP, LOGIT_CLAMP)
    return top_i, logits


def _merged_topk(x: torch.Tensor, weight: torch.Tensor, n: int, k: int, block: int, by_sigmoid: bool) -> torch.Tensor:
    top_v = torch.full((x.shape[0], k), float("-inf"), device=x.device)
    top_i = torch.zeros((x.shape[0], k), dtype=torch.long, device=x.device)
    span = max(1, GROUP_LOGITS // block) * block
    for start in range(0, n, span):
        chunk_v, chunk_i = _chunk_topks(x, weight[start : min(start + span, n)], start, k, block, by_sigmoid)
        for c in range(chunk_v.shape[1]):
            # The reference merges the running top-k with the chunk's by one top-k over both.
            top_v, sel = torch.cat([top_v, chunk_v[:, c]], 1).topk(k, dim=1)
            top_i = torch.cat([top_i, chunk_i[:, c]], 1).gather(1, sel)
    return top_i


def _chunk_topks(
    x: torch.Tensor, weight: torch.Tensor, offset: int, k: int, block: int, by_sigmoid: bool
) -> tuple[torch.Tensor, torch.Tensor]:
    """The top-k of every `block`-concept chunk of `weight` in one call: [P, chunks, k] scores
    and concept ids. A chunk shorter than k is padded with -inf at id 0, as in the reference."""
    logits = F.linear(x, weight.to(x.dtype)).float().clamp(-LOGIT_CLAMP, LOGIT_CLAMP)
    scores = torch.sigmoid(logits) if by_sigmoid else logits
    chunks = -(-weight.shape[0] // block)
    scores = F.pad(scores, (0, chunks * block - weight.shape[0]), value=float("-inf")).view(x.shape[0], chunks, block)
    v, i = scores.topk(min(k, block), dim=2)
    i = i + offset + torch.arange(0, chunks * block, block, device=x.device)[None, :, None]
    i = torch.where(torch.isneginf(v), 0, i)
    if v.shape[2] < k:
        v, i = F.pad(v, (0, k - v.shape[2]), value=float("-inf")), F.pad(i, (0, k - i.shape[2]))
    return v, i


def known_topk(model: SteerlingModel, cfg: ModelConfig, hidden: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The known head's features top-k ranked by sigmoid weight, then (when the head keeps more
    features than it reports) the `topk_known` largest logits among them."""
    weight = model.known_head.concept_predictor.weight
    idx, logits = streaming_topk(
        hidden, weight, cfg.n_concepts, cfg.known_topk_features, cfg.concept_block_size, by_sigmoid=True
    )
    if idx.shape[-1] > cfg.topk_known:
        _, sel = logits.topk(cfg.topk_known, dim=-1)
        idx, logits = idx.gather(-1, sel), logits.gather(-1, sel)
    return idx, logits


def unknown_topk(model: SteerlingModel, cfg: ModelConfig, hidden: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The discovered head's top-k by logit, entirely in the rank-r space."""
    head = model.unknown_head
    compressed = F.linear(hidden, head.predictor_down.weight).float()  # [P, r]
    return streaming_topk(
        compressed,
        head.predictor_up.weight,
        cfg.n_unknown_concepts,
        cfg.unknown_topk,
        cfg.concept_block_size,
        by_sigmoid=False,
    )


def unknown_alignment(model: SteerlingModel, idx: torch.Tensor, w_y: torch.Tensor) -> torch.Tensor:
    """E_i . W_y for discovered concepts, with E_i = basis(coef_i) built as the reference builds
    it, in the model's dtype: in bfloat16 its rounding moves a contribution by ~1e-3 of the
    largest, so the rank-r shortcut (W_y projected onto the basis) would not be the official
    value. A few positions at a time, so at most EMBEDDED values are alive."""
    head = model.unknown_head
    k, d = idx.shape[1], w_y.shape[1]
    rows = max(1, EMBEDDED // (k * d))
    parts = [
        torch.einsum(
            "pkd,pd->pk",
            F.linear(F.embedding(idx[r : r + rows], head.embedding_coef.weight), head.embedding_basis.weight).float(),
            w_y[r : r + rows],
        )
        for r in range(0, idx.shape[0], rows)
    ]
    return torch.cat(parts) if parts else w_y.new_zeros(0, k)


def attribute(
    model: SteerlingModel, cfg: ModelConfig, hidden: torch.Tensor, tokens: torch.Tensor, target_logits: torch.Tensor
) -> torch.Tensor:
    """hidden [P, D] final-norm states of committed positions, tokens [P], target_logits [P] (the
    token's logit in the committing pass). Returns packed [P, width(cfg)] float64 (see `width`)."""
    w_y = model.transformer.lm_head.weight[tokens].float()  # [P, D]
    k_idx, k_logits = known_topk(model, cfg, hidden)
    k_emb = model.known_head.concept_embedding.weight[k_idx].float()  # [P, k, D]
    k_w = torch.sigmoid(k_logits)
    k_c = k_w * torch.einsum("pkd,pd->pk", k_emb, w_y)
    u_idx, u_logits = unknown_topk(model, cfg, hidden)
    u_w = torch.sigmoid(u_logits)
    u_c = u_w * unknown_alignment(model, u_idx, w_y)
    target = target_logits.float()
    eps = target - k_c.sum(-1) - u_c.sum(-1)
    cols = [target[:, None], eps[:, None], k_idx, k_w, k_c, u_idx, u_w, u_c]
    return torch.cat([c.double() for c in cols], dim=1)


def head_widths(cfg: ModelConfig) -> tuple[int, int]:
    """The concepts a position reports per head: (known, discovered); a top-k wider than its
    head takes every concept, as `streaming_topk` does."""
    return min(cfg.topk_known, cfg.known_topk_features, cfg.n_concepts), min(cfg.unknown_topk, cfg.n_unknown_concepts)


def width(cfg: ModelConfig) -> int:
    """Columns of a packed row: target, epsilon, then ids, weights, contributions per head (the
    layout `shared.packed_attribution.PackedAttribution.from_rows` reads)."""
    kk, ku = head_widths(cfg)
    return 2 + 3 * kk + 3 * ku
