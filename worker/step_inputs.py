"""The host side of one step's selection: which hidden rows get logits, and every request's
sampling parameters, sent to the device in two asynchronous copies (one int64, one float32)."""

from __future__ import annotations

from dataclasses import dataclass

import torch
from cde.shared.config import PAGE
from cde.worker.constraint import Constraint, GrammarInputs
from cde.worker.logit_rules import RequestLogitRules
from cde.worker.plan import PlannedItem
from cde.worker.sampler import ReferenceSelection, SamplingBatch
from cde.worker.staging import Staging


@dataclass
class StepInputs:
    rows: torch.Tensor  # [R] rows of the flattened hidden states that get logits
    slots: torch.Tensor  # [S] their request slots
    sampling: SamplingBatch


def eligible_rows(step_indices: list[int], items: list[PlannedItem]) -> tuple[list[int], list[int], list[int]]:
    """The positions that get logits: every still-masked position of each step item (`items`, at
    `step_indices` in the pass) that may be unmasked. Returns their rows in the flattened hidden
    states, the [S, 64] grid mapping a position to its logits row (-1: none) and the step item
    (index into step_indices) of each row."""
    rows: list
    rows, grid, row_item = [], [], []
    for n, (i, item) in enumerate(zip(step_indices, items)):
        for p, ok in enumerate(item.eligible):
            grid.append(len(rows) if ok else -1)
            if ok:
                rows.append(i * PAGE + p)
                row_item.append(n)
    return rows, grid, row_item


def reference_spans(items: list[PlannedItem]) -> list[tuple[int, int, int]]:
    """(step item, still-masked positions n, picks m = min(k, n)) of the step items that unmask a
    fixed k per step (sampler.ReferenceSelection); n leaves out the positions that the picks an
    item carries (worker/carried_picks.py) take on the device."""
    spans = []
    for s, it in enumerate(items):
        r = it.request
        masked = sum(it.eligible) - it.carried_picks
        if r.confidence_threshold is None and not r.constrained and masked > 0:
            spans.append((s, masked, min(r.tokens_per_step, masked)))
    return spans


class StepInputBuilder:
    def __init__(
        self, device: torch.device, banned: torch.Tensor, seen: torch.Tensor, rules: RequestLogitRules, vocab_size: int
    ) -> None:
        self.ints = Staging(device, torch.int64)
        self.floats = Staging(device, torch.float32)
        self.banned, self.seen, self.rules = banned, seen, rules
        self.grammar = GrammarInputs(device, vocab_size)

    def build(
        self,
        step_indices: list[int],
        items: list[PlannedItem],
        relu_masks: list[torch.Tensor | None],
        constraints: list[Constraint | None],
    ) -> StepInputs:
        """Per step item (`items`, at `step_indices` in the pass): relu_masks, its steering ReLU
        logit mask (a device tensor) or None; constraints, its grammar's matcher or None."""
        reqs = [it.request for it in items]
        rows, grid, row_item = eligible_rows(step_indices, items)
        thresholds = [r.confidence_threshold for r in reqs]
        rep = [r.repetition_penalty for r in reqs]
        penalized = any(x != 1.0 for x in rep)
        any_relu = any(m is not None for m in relu_masks)
        # A confidence threshold may unmask any number of positions.
        thresholded = any(x is not None and not r.constrained for x, r in zip(thresholds, reqs))
        max_select = PAGE if thresholded else max(r.tokens_per_step for r in reqs)
        spans = reference_spans(items)
        (
            rows_t,
            slots,
            grid_t,
            row_item_t,
            n_select,
            top_k,
            entropy,
            seed,
            step,
            rep_rows,
            relu_rows,
            ref_items,
        ) = self.ints.stage(
            rows,
            [it.slot for it in items],
            grid,
            row_item,
            [r.tokens_per_step for r in reqs],
            [r.top_k for r in reqs],
            [int(r.entropy_sampling) for r in reqs],
            [r.sampling_key for r in reqs],
            [it.step for it in items],
            # The rows the item-wise rules change (sampler.adjust_logits leaves the others alone).
            [r for r, n in enumerate(row_item) if rep[n] != 1.0] if penalized else [],
            [r for r, n in enumerate(row_item) if relu_masks[n] is not None] if any_relu else [],
            [s for s, _, m in spans for _ in range(m)],
        )
        threshold, temperature, top_p, rep_t, ref_ranks = self.floats.stage(
            [2.0 if x is None or r.constrained else x for x, r in zip(thresholds, reqs)],
            [r.temperature for r in reqs],
            [r.top_p for r in reqs],
            rep,
            [max_select - j for _, _, m in spans for j in range(m)],
        )
        sampling = SamplingBatch(
            grid=grid_t.view(len(items), PAGE),
            row_item=row_item_t,
            n_select=n_select,
            threshold=threshold,
            temperature=temperature,
            top_p=top_p,
            top_k=top_k,
            entropy=entropy.bool(),
            seed=seed,
            step=step,
            banned=self.banned,
            max_select=max_select,
            any_sampling=any(r.entropy_sampling or (r.temperature > 0 and r.top_p > 0) for r in reqs),
            any_entropy=any(r.entropy_sampling for r in reqs),
            rep_penalty=rep_t if penalized else None,
            seen=self.seen[slots] if penalized else None,
            rep_rows=rep_rows if penalized else None,
            relu_mask=(
                torch.stack(
                    [m if m is not None else torch.zeros_like(self.seen[0], dtype=torch.float32) for m in relu_masks]
                )
                if any_relu
                else None
            ),
            relu_rows=relu_rows if any_relu else None,
            rules=self.rules.build(items, slots, grid),
            reference=ReferenceSelection(spans, ref_ranks, ref_items) if spans else None,
        )
        if any(c is not None for c in constraints):
            self.grammar.add_to(sampling, constraints, grid)
        return StepInputs(rows_t, slots, sampling)
