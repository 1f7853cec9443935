"""Concept attribution once per completed block, for the requests that receive it with their block.

Attribution is faithful to the pass that commits a token: that pass's final hidden state at the
token's position, the token, and its logit there. Only requests that stream the denoising
(`stream_denoise`) need the records at every step, in their step events; every other request
gets them with its block. So a pass copies the rows it commits into its request slot's rows of a
device stash (a few small copies on the forward stream, only when such a request is in the pass),
and when a block completes one attribution runs over its kept positions. Once per block instead
of once per step: the concept predictors' weights (about 330 MB on the 8B) are read and the
chunked top-k merges (about 40 latency-bound kernels a call) run once per 64 tokens.

A slot has two sets of rows, one for its even blocks and one for its odd ones: a pass planned
ahead (worker/plan_ahead.py) is launched before the engine learns that the pass in flight
completes a block, so the next block's first step writes its picks before the completed block's
rows are gathered; in the other set, they never overwrite them.
"""

from __future__ import annotations

import torch
from cde.shared.config import PAGE
from cde.worker.staging import Staging


class AttributionStash:
    def __init__(self, max_running: int, n_embd: int, dtype: torch.dtype, device: torch.device) -> None:
        rows = (2 * max_running + 1) * PAGE  # the last rows take the picks that commit nothing
        self.h = torch.zeros(rows, n_embd, dtype=dtype, device=device)
        self.tok = torch.zeros(rows, dtype=torch.long, device=device)
        self.target = torch.zeros(rows, dtype=dtype, device=device)
        self.scratch = 2 * max_running * PAGE
        self.rows = Staging(device, torch.int64)
        self.keys = Staging(device, torch.int64)

    @staticmethod
    def key(slot: int, block: int) -> int:
        """The set of rows of a request slot's block (64 rows, one per position)."""
        return 2 * slot + block % 2

    def stage_keys(self, items: list[tuple[int, int]]) -> torch.Tensor:
        """(slot, block) per step item of a pass -> their keys [S] on the device."""
        (keys,) = self.keys.stage([self.key(slot, block) for slot, block in items])
        return keys

    def write(
        self,
        keys: torch.Tensor,
        positions: torch.Tensor,
        valid: torch.Tensor,
        hidden: torch.Tensor,
        tokens: torch.Tensor,
        target: torch.Tensor,
    ) -> None:
        """A pass's picks: keys [S] (`stage_keys`), positions and valid [S, K] (within the block),
        their hidden states [S * K, D], tokens [S, K] and target logits [S * K]. Static shapes, no
        host sync."""
        dest = torch.where(valid, keys[:, None] * PAGE + positions, self.scratch).reshape(-1)
        self.h.index_copy_(0, dest, hidden)
        self.tok.index_copy_(0, dest, tokens.reshape(-1))
        self.target.index_copy_(0, dest, target)

    def gather(self, blocks: list[tuple[int, list[int]]]) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """(key, positions within the block) per block -> their hidden states, tokens and target
        logits, block after block, copied on the current stream."""
        (idx,) = self.rows.stage([key * PAGE + q for key, positions in blocks for q in positions])
        return self.h[idx], self.tok[idx], self.target[idx]
