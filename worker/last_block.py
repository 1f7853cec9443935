"""The last transformer block's row-wise work, done only on the rows whose logits are read.

A pass writes every item's K/V, but reads its final hidden states only at the rows that get
logits: the still-masked positions of its step items. Everything after the last block's attention
works row by row (its residual adds and norms, the MLP, the steering add, the final norm), so the
pass stops there (`SteerlingModel.forward` returns `TailInputs`) and `finish` computes the rest
for those rows alone: about half of a pass's rows at 32 requests, none in a prefill pass. Row by
row, the computation is the same.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch
from cde.shared.config import PAGE

if TYPE_CHECKING:
    from cde.worker.model import SteerlingModel


@dataclass
class TailInputs:
    """What the last block's tail needs of a pass of N items, per row."""

    x: torch.Tensor  # [N, 64, D] the last block's input
    a: torch.Tensor  # [N, 64, D] its attention's output, after c_proj
    inject: torch.Tensor  # [N, 64, D] the steering vector at the rows that steer, else zero
    gate: torch.Tensor  # [N, 64] the last layer's steering gate, 0 or 1 (so the products are exact)

    def first(self, n: int) -> TailInputs:
        """The first n items' (a padded bucket's real ones)."""
        return TailInputs(self.x[:n], self.a[:n], self.inject[:n], self.gate[:n])


def tail_rows(
    model: SteerlingModel,
    x: torch.Tensor,
    a: torch.Tensor,
    inject: torch.Tensor,
    gate: torch.Tensor,
    rows: torch.Tensor,
) -> torch.Tensor:
    """The final-norm hidden states [R, D] of `rows` (a multiple of 64) of a pass's flattened
    tail inputs (x, a, inject [M, D], gate [M]). Each row goes through the block as an item of one
    token, so the block's row-wise code runs as it is. The CUDA path compiles this function."""
    x, _ = model.transformer.last.tail(x[rows, None], a[rows, None], inject[rows, None], gate[rows])
    return model.transformer.ln_f(x)[:, 0]


RowsTail = Callable[..., torch.Tensor]  # tail_rows, or its compiled twin
# The (items, pages of rows) whose tails compile every variant of the compiled `tail_rows` that
# passes run: one item's page (shapes are static on first sight); two pages of two items (the sizes
# turn symbolic, and StreamLinear guards on taking its 64-row path or not); one page of two items.
# Every pass falls into one (tests/worker/test_last_block.py runs passes of 1 to 64 items).
TAIL_VARIANTS = ((1, 1), (2, 2), (2, 1))


def finish(model: SteerlingModel, tail: TailInputs, rows: torch.Tensor, run: RowsTail = tail_rows) -> torch.Tensor:
    """The final-norm hidden states [R, D] of `rows` (int64 indices into the pass's flattened N * 64
    rows), in their order: the last block's tail, then ln_f."""
    if rows.numel() == 0:
        return tail.x.new_empty(0, tail.x.shape[-1])
    width = tail.x.shape[-1]
    # An FP8 block also quantizes its output for a next block's c_attn that is not there: R rows
    # of one fused op, a small price for keeping one tail for every block.
    out = run(
        model,
        tail.x.reshape(-1, width),
        tail.a.reshape(-1, width),
        tail.inject.reshape(-1, width),
        tail.gate.reshape(-1),
        whole_pages(rows),
    )
    return out[: rows.numel()]


def whole_pages(rows: torch.Tensor) -> torch.Tensor:
    """rows padded to a multiple of 64 with copies of the last: every kernel of the tail then sees
    a row count that a pass's items give it (the split-K GEMMs' 64 of one request, the Triton
    kernels' multiples of 64), and one request's tail the shapes of its whole pass."""
    pad = -rows.numel() % PAGE
    return torch.cat((rows, rows[-1:].expand(pad))) if pad else rows
