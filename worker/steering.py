"""Concept steering (reference semantics: `SteerlingGenerator._prepare_steering`,
`_build_relu_mask`, `_resolve_alpha`).

The direction is the L2-normalised sum of the chosen known-concept embeddings; with `normalize`
the strength reads in logit units (divided by the direction's peak LM-head alignment). It is
added after every layer i with i + 1 >= inject_layer, at still-masked positions only; the
optional ReLU mask subtracts strength * relu(E_c . W_vocab) from the token logits.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch
from cde.shared.config import ModelConfig
from cde.shared.protocol import SteeringSpec

if TYPE_CHECKING:
    from cde.worker.model import SteerlingModel


@dataclass
class SteeringState:
    direction: torch.Tensor  # [D] in the model dtype
    base_alpha: float
    inject_layer: int
    schedule: str
    cutoff_tokens: int
    relu_mask: torch.Tensor | None  # [V] float32


def _vocab_alignment(lm: torch.Tensor, vectors: torch.Tensor, chunk: int = 8192) -> torch.Tensor:
    """vectors [K, D] float32 . W_vocab^T in float32 like the reference, without a float32 copy of
    the whole LM head (1.6 GB at 8B): [K, V]."""
    return torch.cat([vectors @ lm[i : i + chunk].float().t() for i in range(0, lm.shape[0], chunk)], dim=1)


@torch.inference_mode()
def prepare_steering(model: SteerlingModel, cfg: ModelConfig, spec: SteeringSpec) -> SteeringState:
    dtype = next(model.parameters()).dtype
    lm = model.transformer.lm_head.weight  # [V, D]
    emb_table = model.known_head.concept_embedding.weight
    direction = torch.zeros(cfg.n_embd, dtype=dtype, device=lm.device)
    base_alpha = 0.0
    if spec.concepts:
        vec = emb_table[torch.tensor(spec.concepts, device=lm.device)].float().sum(0)
        unit = vec / (vec.norm(p=2) + 1e-12)
        peak = max(float(_vocab_alignment(lm, unit[None]).max()), 1e-6)
        base_alpha = spec.strength / peak if spec.normalize else spec.strength
        direction = unit.to(dtype)
    relu = None
    if spec.relu_logit_mask:
        ids = torch.tensor(list(spec.relu_logit_mask), device=lm.device)
        strengths = torch.tensor(list(spec.relu_logit_mask.values()), device=lm.device, dtype=torch.float32)
        align = _vocab_alignment(lm, emb_table[ids].float())  # [K, V]
        relu = (strengths[:, None] * align.clamp_min(0.0)).sum(0)
    return SteeringState(direction, float(base_alpha), spec.inject_layer, spec.schedule, spec.cutoff_tokens, relu)


@torch.inference_mode()
def concept_top_tokens(model: SteerlingModel, concept_id: int, k: int) -> tuple[list[int], list[float]]:
    """The k vocabulary tokens the known concept most promotes, with their alignment scores
    (reference: `SteerlingGenerator.concept_top_tokens`), computed on the model's device."""
    lm = model.transformer.lm_head.weight
    emb = model.known_head.concept_embedding.weight[concept_id].float()
    unit = emb / (emb.norm() + 1e-12)
    values, indices = _vocab_alignment(lm, unit[None])[0].topk(k)
    return indices.tolist(), values.tolist()


def alpha_now(state: SteeringState, committed: int) -> float:
    """Injection strength for the next step, given how many tokens the request has committed."""
    if state.schedule == "hard_cutoff" and committed >= state.cutoff_tokens:
        return 0.0
    return state.base_alpha
