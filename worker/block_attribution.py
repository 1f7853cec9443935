"""Concept attribution once per completed block, for the requests that receive it with their block.

Attribution is faithful to the pass that commits a token: that pass's final hidden state at the
token's position, the token, and its logit there. Only requests that stream the denoising
(`stream_denoise`) need the records at every step, in their step events; every other request
gets them with its block. So a pass copies the rows it commits into its request slot's rows of a
device stash (a few small copies on the forward stream, only when such a request is in the pass),
and when a block completes one attribution runs over its kept positions. Once per block instead
of once per step: the concept predictors' weights (about 330 MB on the 8B) are read and the
chunked top-k merges (about 40 latency-bound kernels a call) run once per 64 tokens.

The engine gathers a completed block's rows before it launches the next pass (worker/engine.py),
so the forward stream orders the read before the next block's writes to the same slot.
"""

from __future__ import annotations

import torch
from cde.shared.config import PAGE
from cde.worker.staging import Staging


class AttributionStash:
    def __init__(self, max_running: int, n_embd: int, dtype: torch.dtype, device: torch.device) -> None:
        rows = (max_running + 1) * PAGE  # the last slot's rows take the picks that commit nothing
        self.h = torch.zeros(rows, n_embd, dtype=dtype, device=device)
        self.tok = torch.zeros(rows, dtype=torch.long, device=device)
        self.target = torch.zeros(rows, dtype=dtype, device=device)
        self.scratch = max_running * PAGE
        self.rows = Staging(device, torch.int64)

    def write(
        self,
        slots: torch.Tensor,
        positions: torch.Tensor,
        valid: torch.Tensor,
        hidden: torch.Tensor,
        tokens: torch.Tensor,
        target: torch.Tensor,
    ) -> None:
        """A pass's picks: slots [S], positions and valid [S, K] (within the block), their hidden
        states [S * K, D], tokens [S, K] and target logits [S * K]. Static shapes, no host sync."""
        dest = torch.where(valid, slots[:, None] * PAGE + positions, self.scratch).reshape(-1)
        self.h.index_copy_(0, dest, hidden)
        self.tok.index_copy_(0, dest, tokens.reshape(-1))
        self.target.index_copy_(0, dest, target)

    def gather(self, blocks: list[tuple[int, list[int]]]) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """(slot, positions within the block) per block -> their hidden states, tokens and target
        logits, block after block, copied on the current stream."""
        (idx,) = self.rows.stage([slot * PAGE + q for slot, positions in blocks for q in positions])
        return self.h[idx], self.tok[idx], self.target[idx]
