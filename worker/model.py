"""The Steerling architecture as a pure compute graph over 64-token blocks.

Module names mirror the published weight names (`transformer.blocks.{i}.attn.c_attn.weight`, ...)
so a checkpoint loads with `load_state_dict(strict=True)`. The forward pass takes a batch of
*items*: each item is one 64-token block of one request at an absolute block index; attention goes
over the paged KV cache (kernels/) with metadata built by the model runner, so this file knows
nothing of pages, requests or scheduling. It stops after the last block's attention: the rest works
row by row, and worker/last_block.py runs it on the rows that are read.
"""

from __future__ import annotations

from typing import cast

import torch
import torch.nn as nn
import torch.nn.functional as F
from cde.kernels.flex_paged_attention import flex_paged_attention
from cde.kernels.paged_attention import PagedBatch, paged_attention
from cde.kernels.qkv_rope import fused_input_stage, qkv_rope_write
from cde.kernels.stream_ops import rms_norm, swiglu
from cde.shared.config import ModelConfig
from cde.worker.last_block import TailInputs
from cde.worker.rope import apply_rope

BLOCK_LINEARS = ("attn.c_attn", "attn.c_proj", "mlp.c_fc", "mlp.c_proj")  # a block's linear layers, by path
# What a block hands the next one beside its output x: None, or (FP8 blocks) x's rows quantized for
# c_attn, (e4m3 rows [M, D], float32 scales [M]).
HandedOn = tuple[torch.Tensor, torch.Tensor] | None


def embedding(num: int, dim: int) -> nn.Embedding:
    """nn.Embedding, left unfilled on the meta device, where the worker builds the model before it
    loads the weights: there nn.Embedding's init (normal_) runs a Python reference op that imports
    TorchDynamo, about 2 s of every worker's start for values nobody reads. Anywhere else it is
    initialized as nn.Embedding initializes it."""
    weight = torch.empty(num, dim)
    emb = nn.Embedding(num, dim, _weight=weight)
    if not weight.is_meta:
        emb.reset_parameters()
    return emb


class RMSNorm(nn.Module):
    def __init__(self, size: int, eps: float):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(size))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return rms_norm(x, self.weight, self.eps)


class Attention(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.cfg = cfg
        kv = cfg.n_kv_heads * cfg.head_dim
        self.c_attn = nn.Linear(cfg.n_embd, cfg.n_embd + 2 * kv, bias=False)
        self.c_proj = nn.Linear(cfg.n_embd, cfg.n_embd, bias=False)
        if cfg.use_qk_norm:
            self.q_norm = RMSNorm(cfg.head_dim, cfg.norm_eps)
            self.k_norm = RMSNorm(cfg.head_dim, cfg.norm_eps)

    def qkv(
        self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """[N, T, D] -> q [N, H, T, hd], k and v [N, KV, T, hd]: clipped, QK-normed, rotated (the
        part of attention that any attention kernel shares; cde/train/train_model.py's dense one too)."""
        return self.split_heads(self.c_attn(x), cos, sin)

    def split_heads(
        self, qkv: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """c_attn's output [N, T, D + 2 KV] -> `qkv`'s q, k, v."""
        cfg = self.cfg
        n, t, _ = qkv.shape
        if cfg.clip_qkv is not None:
            qkv = qkv.clamp(min=-cfg.clip_qkv, max=cfg.clip_qkv)
        kv = cfg.n_kv_heads * cfg.head_dim
        q, k, v = qkv.split([cfg.n_embd, kv, kv], dim=-1)
        q = q.reshape(n, t, cfg.n_head, cfg.head_dim).transpose(1, 2)
        k = k.reshape(n, t, cfg.n_kv_heads, cfg.head_dim).transpose(1, 2)
        v = v.reshape(n, t, cfg.n_kv_heads, cfg.head_dim).transpose(1, 2)
        if cfg.use_qk_norm:
            q, k = self.q_norm(q), self.k_norm(k)
        return apply_rope(q, cos, sin), apply_rope(k, cos, sin), v

    def forward(
        self,
        x: torch.Tensor,
        cos: torch.Tensor,
        sin: torch.Tensor,
        cache: tuple[torch.Tensor, torch.Tensor],
        meta: PagedBatch,
    ) -> torch.Tensor:
        return self.attend(self.c_attn(x), cos, sin, cache, meta)

    def attend(
        self,
        qkv: torch.Tensor,
        cos: torch.Tensor,
        sin: torch.Tensor,
        cache: tuple[torch.Tensor, torch.Tensor],
        meta: PagedBatch,
    ) -> torch.Tensor:
        """Attention from c_attn's output [N, T, D + 2 KV] on (the FP8 block gives it from rows
        quantized before)."""
        mask = meta.block_mask
        if mask is not None and meta.flashblock is None and fused_input_stage(qkv, self.cfg.head_dim):
            # CUDA: `qkv` and the cache writes as one kernel, q left packed for the attention.
            cfg, qk_norm = self.cfg, self.cfg.use_qk_norm
            q = qkv_rope_write(
                qkv,
                self.q_norm.weight if qk_norm else None,
                self.k_norm.weight if qk_norm else None,
                cos[:, 0],
                sin[:, 0],
                cache[0],
                cache[1],
                meta.write_pages,
                cfg.clip_qkv,
                cfg.norm_eps,
                cfg.n_head,
                mask.group,
            )
            y = flex_paged_attention(q, cache[0], cache[1], mask)
        else:
            q, k, v = self.split_heads(qkv, cos, sin)
            y = paged_attention(q, k, v.contiguous(), cache, meta)
        return self.project(y)

    def project(self, y: torch.Tensor) -> torch.Tensor:
        """c_proj of the attention's output y [N, H, T, Dh], its heads joined per token -> [N, T, D]
        (the FP8 attention, worker/fp8.py, joins and quantizes them in one kernel)."""
        n, _, t, _ = y.shape
        return self.c_proj(y.transpose(1, 2).reshape(n, t, self.cfg.n_embd))

    def dense(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        """Attention over the whole sequence with a boolean mask instead of the paged cache (the
        training forward, input attribution's replay). KV heads are repeated by hand rather than
        enable_gqa: CUDA's memory-efficient SDPA kernel, the one that takes a mask and has a
        backward, does not group queries itself."""
        q, k, v = self.qkv(x, cos, sin)
        group = self.cfg.n_head // self.cfg.n_kv_heads
        k, v = k.repeat_interleave(group, dim=1), v.repeat_interleave(group, dim=1)
        return self.project(F.scaled_dot_product_attention(q, k, v, attn_mask=mask))


class MLP(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.c_fc = nn.Linear(cfg.n_embd, 2 * cfg.ffn_size, bias=False)
        self.c_proj = nn.Linear(cfg.ffn_size, cfg.n_embd, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.c_proj(swiglu(self.c_fc(x)))


class Block(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.post_norm = cfg.norm_order == "post"
        self.ln_1 = RMSNorm(cfg.n_embd, cfg.norm_eps)
        self.ln_2 = RMSNorm(cfg.n_embd, cfg.norm_eps)
        self.attn = Attention(cfg)
        self.mlp = MLP(cfg)

    def forward(
        self,
        x: torch.Tensor,
        cos: torch.Tensor,
        sin: torch.Tensor,
        cache: tuple[torch.Tensor, torch.Tensor],
        meta: PagedBatch,
        inject: torch.Tensor,
        gate: torch.Tensor,
        handed: HandedOn = None,
    ) -> tuple[torch.Tensor, HandedOn]:
        """`head`, then `tail`: one computation, which the compiled block fuses across the two (a
        pass's last block runs them apart, worker/last_block.py)."""
        return self.tail(x, self.head(x, cos, sin, cache, meta, handed), inject, gate)

    def head(
        self,
        x: torch.Tensor,
        cos: torch.Tensor,
        sin: torch.Tensor,
        cache: tuple[torch.Tensor, torch.Tensor],
        meta: PagedBatch,
        handed: HandedOn = None,
    ) -> torch.Tensor:
        """The attention's output after c_proj [N, 64, D], x's K/V written: the one part of the
        block that mixes rows. `handed`: what the block before handed on with x."""
        if self.post_norm:
            return self.attn.attend(self.attn_input(x, handed), cos, sin, cache, meta)
        return self.attn(self.ln_1(x), cos, sin, cache, meta)

    def tail(
        self, x: torch.Tensor, a: torch.Tensor, inject: torch.Tensor, gate: torch.Tensor
    ) -> tuple[torch.Tensor, HandedOn]:
        """The rest, row by row, from x and the attention's output a: the residuals, the MLP and
        the steering `gate * inject` added after the block ([N] and [N, T, D]; added here, it
        fuses into the last residual add). Returns the block's output and what it hands on (None;
        an FP8 block, worker/fp8.py, hands on its output already quantized for the next c_attn)."""
        if self.post_norm:
            x, m = self.attn_residual_and_mlp(x, a)
            return self.residual_out(x, m, inject, gate)
        x = x + a
        x = x + self.mlp(self.ln_2(x))
        return x + gate[:, None, None] * inject, None

    def attn_input(self, x: torch.Tensor, handed: HandedOn) -> torch.Tensor:
        """Post-norm: c_attn's output on x (the FP8 block multiplies the rows handed on instead)."""
        return self.attn.c_attn(x)

    def residual_out(
        self, x: torch.Tensor, m: torch.Tensor, inject: torch.Tensor, gate: torch.Tensor
    ) -> tuple[torch.Tensor, HandedOn]:
        """Post-norm, after the MLP's output m: the block's output x + ln_2(m) plus the steering, and
        what it hands on (None; the FP8 block fuses the add, the norm, the steering and the next
        c_attn's activation quantization here)."""
        return x + self.ln_2(m) + gate[:, None, None] * inject, None

    def attn_residual_and_mlp(self, x: torch.Tensor, a: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Post-norm, between attention's output a and the MLP's: the residual x + ln_1(a) and the
        MLP's output on it (the FP8 block, worker/fp8.py, fuses the add, the norm and c_fc's
        activation quantization here)."""
        x = x + self.ln_1(a)
        return x, self.mlp(x)

    def dense(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        """The block over the whole sequence with `Attention.dense` (no cache, no steering)."""
        if self.post_norm:
            x, m = self.attn_residual_and_mlp(x, self.attn.dense(x, cos, sin, mask))
            return x + self.ln_2(m)
        x = x + self.attn.dense(self.ln_1(x), cos, sin, mask)
        return x + self.mlp(self.ln_2(x))


class Transformer(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.tok_emb = embedding(cfg.vocab_size, cfg.n_embd)
        self.blocks = nn.ModuleList(Block(cfg) for _ in range(cfg.n_layers))
        self.ln_f = RMSNorm(cfg.n_embd, cfg.norm_eps)
        self.lm_head = nn.Linear(cfg.n_embd, cfg.vocab_size, bias=False)
        if cfg.weight_sharing:
            self.tok_emb.weight = self.lm_head.weight

    @property
    def last(self) -> Block:
        """The last block, whose attention ends a pass (worker/last_block.py)."""
        return cast(Block, self.blocks[-1])


class KnownHead(nn.Module):
    """Dense known-concept head: logits = W_pred h, features = sum_topk sigmoid(logit) E."""

    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.concept_predictor = nn.Linear(cfg.n_embd, cfg.known_padded, bias=False)
        self.concept_embedding = embedding(cfg.known_padded, cfg.n_embd)


class UnknownHead(nn.Module):
    """Factorized discovered-concept head: predictor = up @ down, embeddings = coef @ basis (rank r)."""

    def __init__(self, cfg: ModelConfig):
        super().__init__()
        r = cfg.factorize_rank
        self.predictor_down = nn.Linear(cfg.n_embd, r, bias=False)
        self.predictor_up = nn.Linear(r, cfg.unknown_padded, bias=False)
        self.embedding_coef = embedding(cfg.unknown_padded, r)
        self.embedding_basis = nn.Linear(r, cfg.n_embd, bias=False)


class SteerlingModel(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.cfg = cfg
        self.transformer = Transformer(cfg)
        self.known_head = KnownHead(cfg)
        self.unknown_head = UnknownHead(cfg)

    def forward(
        self,
        tokens: torch.Tensor,  # [N, 64] token ids (mask ids at still-masked positions)
        cos: torch.Tensor,  # [N, 1, 64, Dh] fp32 rope tables at the items' absolute positions
        sin: torch.Tensor,
        caches: list[tuple],  # per layer (K, V) caches [KVH, P, 64, Dh] (+ FlashBlock's (A, L))
        meta: PagedBatch,
        steer_vec: torch.Tensor,  # [N, D] alpha * direction (zero when a request does not steer)
        steer_from: torch.Tensor,  # [N] int: inject after layer i when i + 1 >= steer_from
        steer_positions: torch.Tensor,  # [N, 64] bool: still-masked positions
    ) -> TailInputs:
        """Every block up to the last one's attention (every item's K/V written), and what the
        rest needs: `finish` (worker/last_block.py) gives the final-norm hidden states of the rows
        read. Token logits are lm_head of those (with the epsilon correction the concept heads
        compose back to exactly such a vector)."""
        x = self.transformer.tok_emb(tokens)
        inject = steer_vec[:, None, :] * steer_positions[:, :, None].to(steer_vec.dtype)
        # Always in the graph: the gates are data, so steering on/off never changes the graph.
        layers = torch.arange(1, len(self.transformer.blocks) + 1, device=steer_from.device)
        gates = (steer_from[None, :] <= layers[:, None]).to(x.dtype)  # [L, N]
        handed: HandedOn = None
        for i, block in enumerate(self.transformer.blocks[:-1]):
            x, handed = block(x, cos, sin, caches[i], meta, inject, gates[i], handed)
        a = self.transformer.last.head(x, cos, sin, caches[-1], meta, handed)
        return TailInputs(x, a, inject, gates[-1][:, None].expand_as(steer_positions).contiguous())

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.transformer.lm_head(hidden)
