"""The picks of the pass in flight, completing on the device a pass planned ahead of them
(worker/plan_ahead.py).

An item planned ahead holds its request's tokens as they were before the last step
(`PlannedItem.carry` names that step). Its picks never come to the host before the next launch:
their positions, tokens and validity ([S, K], the sampler's output) stay on the device, and two
scatters on the forward stream finish the new pass's inputs, ordered after the selection that
wrote them. The item's tokens get the picked tokens; a step item's logits grid (worker/
step_inputs.py) loses the picked positions, so they are never selected again. The host planned
their logits rows too (it did not know which they are): computed, never read.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from cde.worker.plan import StepPlan
from cde.worker.staging import Staging

Selected = tuple[torch.Tensor, torch.Tensor, torch.Tensor]  # a pass's positions, tokens, valid: [S, K]


@dataclass
class CarriedPicks:
    selected: Selected  # of the pass in flight
    item_dst: torch.Tensor  # [C] items of the new pass that carry picks
    item_src: torch.Tensor  # [C] the step items (of the pass in flight) whose picks they carry
    step_dst: torch.Tensor  # [G] the same, for the new pass's step items, by their place among them
    step_src: torch.Tensor  # [G]

    def into_tokens(self, tokens: torch.Tensor) -> None:
        """tokens [N, 64] of the new pass's items, in place: the picks placed."""
        positions, chosen, valid = self.selected
        rows = self.item_dst[:, None].expand(-1, positions.shape[1])
        cols = positions[self.item_src]
        tokens[rows, cols] = torch.where(valid[self.item_src], chosen[self.item_src], tokens[rows, cols])

    def out_of_grid(self, grid: torch.Tensor) -> None:
        """grid [S, 64] of the new pass's step items, in place: the picked positions no longer eligible."""
        positions, _, valid = self.selected
        rows = self.step_dst[:, None].expand(-1, positions.shape[1])
        cols = positions[self.step_src]
        grid[rows, cols] = torch.where(valid[self.step_src], -1, grid[rows, cols])


def stage_carried(staging: Staging, plan: StepPlan, selected: Selected) -> CarriedPicks | None:
    """The carries of `plan` (planned ahead of the pass that `selected` came from), sent in one
    asynchronous copy; None when no item carries any."""
    items = [(i, it.carry) for i, it in enumerate(plan.items) if it.carry >= 0]
    if not items:
        return None
    steps = [(n, it.carry) for n, it in enumerate(plan.step_items) if it.carry >= 0]
    item_dst, item_src, step_dst, step_src = staging.stage(
        [i for i, _ in items], [c for _, c in items], [n for n, _ in steps], [c for _, c in steps]
    )
    return CarriedPicks(selected, item_dst, item_src, step_dst, step_src)
