"""The Steerling model as trained: CDE's own modules (worker/model.py: the same blocks, norms,
heads and parameter names as the published layout) with a dense block-causal attention instead
of the paged one, and a compact vocabulary.

Compact vocabulary: the data uses a few thousand of cl100k's 100,284 ids. The model holds rows
for those (`used`) only; every other id shares one all-zero row, which is exactly how the
exported checkpoint stores them (zero rows compress to nothing). With tied embeddings a zero row's
logit is 0, so the softmax over the full vocabulary equals one over the used ids plus a single
logit log(n_unused) standing for all the others (`UNUSED`, the last column of `logits`).

The attention mask is built from each position's document and block: a query sees a key iff both
are in the same document and key_block <= query_block (the reference's block-causal rule on
absolute blocks; documents start on block boundaries). `clean_noisy_mask` lays a clean copy and a
noisy copy of a row side by side: the noisy block b sees clean blocks < b and itself, which is
what the engine computes when it denoises block b over the cached earlier blocks.
"""

from __future__ import annotations

import math

import torch
import torch.nn as nn

from cde.shared.config import PAGE, ModelConfig
from cde.worker.model import Block, KnownHead, RMSNorm, UnknownHead
from cde.worker.rope import rope_tables


def block_causal_mask(doc: torch.Tensor) -> torch.Tensor:
    """[B, T] document ids -> [B, 1, T, T] bool (True: may attend)."""
    t = doc.shape[1]
    blk = torch.arange(t, device=doc.device) // PAGE
    return ((doc[:, :, None] == doc[:, None, :]) & (blk[None, :, None] >= blk[None, None, :]))[:, None]


def clean_noisy_mask(doc: torch.Tensor) -> torch.Tensor:
    """[B, L] document ids -> [B, 1, 2L, 2L] for the row [clean | noisy]."""
    length = doc.shape[1]
    blk = torch.arange(length, device=doc.device) // PAGE
    same = doc[:, :, None] == doc[:, None, :]
    before = blk[:, None] > blk[None, :]
    clean = same & (before | (blk[:, None] == blk[None, :]))[None]
    noisy_own = same & (blk[:, None] == blk[None, :])[None]
    top = torch.cat([clean, torch.zeros_like(clean)], dim=2)
    bottom = torch.cat([same & before[None], noisy_own], dim=2)
    return torch.cat([top, bottom], dim=1)[:, None]


class Trunk(nn.Module):
    """transformer.*: tok_emb over the used ids, CDE's blocks, ln_f."""

    def __init__(self, cfg: ModelConfig, n_used: int):
        super().__init__()
        self.tok_emb = nn.Embedding(n_used, cfg.n_embd)
        self.blocks = nn.ModuleList(Block(cfg) for _ in range(cfg.n_layers))
        self.ln_f = RMSNorm(cfg.n_embd, cfg.norm_eps)


class TrainModel(nn.Module):
    def __init__(self, cfg: ModelConfig, used: list[int]):
        super().__init__()
        self.cfg = cfg
        self.transformer = Trunk(cfg, len(used))
        self.known_head = KnownHead(cfg)
        self.unknown_head = UnknownHead(cfg)
        self.register_buffer("used", torch.tensor(used, dtype=torch.long), persistent=False)
        lookup = torch.full((cfg.vocab_size,), len(used), dtype=torch.long)
        lookup[self.used] = torch.arange(len(used))
        self.register_buffer("lookup", lookup, persistent=False)  # vocab id -> compact id (UNUSED for the rest)
        cos, sin = rope_tables(cfg, cfg.context_len)
        self.register_buffer("cos", cos, persistent=False)
        self.register_buffer("sin", sin, persistent=False)
        self.log_unused = math.log(cfg.vocab_size - len(used))
        self.apply(self._init)

    @property
    def n_used(self) -> int:
        return self.used.shape[0]

    def _init(self, m: nn.Module) -> None:
        if isinstance(m, (nn.Linear, nn.Embedding)):
            nn.init.normal_(m.weight, std=0.02)

    def embed(self, ids: torch.Tensor) -> torch.Tensor:
        idx = self.lookup[ids]
        known = idx < self.n_used
        return self.transformer.tok_emb(idx.clamp(max=self.n_used - 1)) * known[..., None]

    def residual(
        self,
        ids: torch.Tensor,
        pos: torch.Tensor,
        mask: torch.Tensor | None,
        inject: torch.Tensor | None = None,
        gates: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """The residual stream after the last block, before the final norm [B, T, D]. inject
        [B, T, D] (steering, zero where off) is added after block i where gates[i] ([L, B]) is 1 —
        the engine's rule i + 1 >= inject_layer."""
        cos, sin = self.cos[pos][:, None], self.sin[pos][:, None]
        x = self.embed(ids)
        for i, block in enumerate(self.transformer.blocks):
            x = block.dense(x, cos, sin, mask)
            if inject is not None:
                x = x + gates[i][:, None, None].to(x.dtype) * inject.to(x.dtype)
        return x

    def hidden(
        self,
        ids: torch.Tensor,
        pos: torch.Tensor,
        mask: torch.Tensor | None,
        inject: torch.Tensor | None = None,
        gates: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """Final-norm hidden states [B, T, D]."""
        return self.transformer.ln_f(self.residual(ids, pos, mask, inject, gates))

    def logits(self, h: torch.Tensor, weight: torch.Tensor | None = None) -> torch.Tensor:
        """[..., n_used + 1]: the used ids' logits, then the one logit of all unused ids."""
        w = self.transformer.tok_emb.weight if weight is None else weight
        z = h @ w.t().to(h.dtype)
        return torch.cat([z, z.new_full((*z.shape[:-1], 1), self.log_unused)], dim=-1)

    def peak_alignment(self, unit: torch.Tensor) -> torch.Tensor:
        """max over the full vocabulary of lm_head @ unit (the unused rows give 0), [K, D] -> [K],
        floored like the engine's steering normalisation."""
        z = unit.float() @ self.transformer.tok_emb.weight.float().t()
        return z.max(dim=-1).values.clamp_min(0.0).clamp_min(1e-6)

    # ---- concept heads (the reference's top-k feature paths) ---------------------------------
    def known_logits(self, h: torch.Tensor) -> torch.Tensor:
        return self.known_head.concept_predictor(h)[..., : self.cfg.n_concepts].float()

    def known_features(self, h: torch.Tensor, detach_weights: bool = False) -> torch.Tensor:
        w = torch.sigmoid(self.known_logits(h).clamp(-15, 15))
        w = w.detach() if detach_weights else w
        top_w, top_i = w.topk(min(self.cfg.known_topk_features, self.cfg.n_concepts), dim=-1)
        emb = self.known_head.concept_embedding(top_i).float()
        return torch.einsum("...k,...kd->...d", top_w, emb)

    def unknown_features(self, h: torch.Tensor) -> torch.Tensor:
        head, cfg = self.unknown_head, self.cfg
        z = head.predictor_up(head.predictor_down(h))[..., : cfg.n_unknown_concepts].float().clamp(-15, 15)
        top_z, top_i = z.topk(min(cfg.unknown_topk, cfg.n_unknown_concepts), dim=-1)
        coef = torch.einsum("...k,...kr->...r", torch.sigmoid(top_z), head.embedding_coef(top_i).float())
        return coef @ head.embedding_basis.weight.float().t()
