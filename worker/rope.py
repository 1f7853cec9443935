"""Rotary position embedding: the cos/sin tables of absolute positions and their rotation of
queries and keys, in float32 like the reference (CUDA's fused input stage, kernels/qkv_rope.py,
rotates as `apply_rope` does)."""

from __future__ import annotations

import torch
from cde.shared.config import ModelConfig


def rope_tables(
    cfg: ModelConfig, n_positions: int, device: torch.device | str | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """cos, sin of shape [n_positions, head_dim], computed in fp32 like the reference."""
    dim = cfg.head_dim
    inv_freq = 1.0 / (cfg.rope_base ** (torch.arange(0, dim, 2, device=device, dtype=torch.float) / dim))
    freqs = torch.outer(torch.arange(n_positions, device=device, dtype=torch.float), inv_freq)
    angles = torch.cat((freqs, freqs), dim=-1)
    return angles.cos(), angles.sin()


def apply_rope(t: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """t: [N, heads, 64, Dh]; cos/sin: [N, 1, 64, Dh] fp32."""
    tf = t.float()
    x1, x2 = tf.chunk(2, dim=-1)
    rotated = torch.cat((-x2, x1), dim=-1)
    return (tf * cos + rotated * sin).to(t.dtype)
