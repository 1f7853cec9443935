"""Per-request logit rules that the reference does not have, from the OpenAI API and vLLM:
frequency and presence penalties, logit_bias, and min_tokens' ban of the end tokens.

Applied inside the batch, to each request's own rows, after the steering mask and the repetition
penalty and before the bans of EOS/mask/pad:

    logit[t] - count[t] * frequency_penalty - (count[t] > 0) * presence_penalty + logit_bias[t]

where count[t] is how often the request has generated t so far. In block diffusion "so far" is
the tokens it has unmasked: every earlier block and the positions of the active block unmasked
in earlier steps (the prompt does not count, as in OpenAI's definition). min_tokens sets EOT and
the request's stop_token_ids to -inf at a position while fewer than min_tokens generated tokens
are unmasked before it, so an end token there still leaves min_tokens tokens in the output.

A pass without any of these rules builds nothing; the counts table is allocated by the first
request with a penalty and a request's row is cleared when it takes its slot.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from cde.shared.config import MASK_ID, PAGE
from cde.worker.plan import PlannedItem, RequestParams
from cde.worker.staging import Staging


@dataclass
class LogitRules:
    """One pass's rules, per step item S (rows of the logits map to items by `row_item`)."""

    offset: torch.Tensor | None  # [S, V] float: bias - penalties, None when no item has either
    offset_rows: torch.Tensor | None  # [O] the logits rows of the items that have either
    penalized: bool  # some item has a penalty: the pass's picks are counted (`record`)
    ban_rows: torch.Tensor | None  # [M] logits rows where ban_tokens[m] is -inf (min_tokens)
    ban_tokens: torch.Tensor | None  # [M]

    def apply(self, x: torch.Tensor, row_item: torch.Tensor) -> None:
        """Apply the rules to x [R, V] float32 logits, in place (only the rows of items that have one)."""
        if self.offset is not None and self.offset_rows is not None:
            add_item_rows(x, self.offset_rows, row_item, self.offset)
        if self.ban_rows is not None and self.ban_tokens is not None:
            x.index_put_((self.ban_rows, self.ban_tokens), torch.tensor(float("-inf"), device=x.device))


def sync_is_free(t: torch.Tensor, override: bool | None = None) -> bool:
    """Whether to take a data-dependent shape (a sync): on the CPU a sync costs nothing; CUDA keeps
    static shapes so a pass never waits on the host. `override` (tests) picks either form."""
    return t.device.type == "cpu" if override is None else override


def add_item_rows(
    x: torch.Tensor,
    rows: torch.Tensor,
    row_item: torch.Tensor,
    table: torch.Tensor,
    alpha: float = 1.0,
    runs: bool | None = None,
) -> None:
    """x[rows] += alpha * table[row_item[rows]], in place, for distinct rows (an item's rules on its
    logits rows). `runs` (default: where a sync is free) adds each item's row of the table to its
    run of consecutive rows as a broadcast view, where the other form gathers a [rows, V] copy of
    the table first. One addition per element either way: the same bits."""
    items = row_item[rows]
    if not sync_is_free(x, runs):
        x.index_add_(0, rows, table[items], alpha=alpha)
        return
    r, it = rows.tolist(), items.tolist()
    start = 0
    for end in range(1, len(r) + 1):
        if end == len(r) or it[end] != it[start] or r[end] != r[end - 1] + 1:
            x[r[start] : r[end - 1] + 1].add_(table[it[start]], alpha=alpha)
            start = end


def end_bans(item: PlannedItem, rows: list[int]) -> list[tuple[int, int]]:
    """(logits row, token) pairs min_tokens bans for one step item; rows[p] is the logits row of
    block position p (-1: not eligible). A position is free once min_tokens generated tokens are
    unmasked before it (counted at the start of the step, so a pick of the same step never
    lifts a ban early)."""
    req = item.request
    ends = req.end_ids
    before = item.generated
    if not ends or before >= req.min_tokens:
        return []
    start = max(req.prompt_len - item.block * PAGE, 0)
    out = []
    for p in range(start, PAGE):
        if rows[p] >= 0 and before < req.min_tokens:
            out += [(rows[p], t) for t in ends]
        before += item.tokens[p] != MASK_ID
    return out


class RequestLogitRules:
    """The device state of the rules (the per-slot counts) and the per-pass inputs."""

    def __init__(self, device: torch.device, width: int, max_running: int) -> None:
        self.device, self.width, self.max_running = device, width, max_running
        self.counts: torch.Tensor | None = None  # [max_running + 1, width] int32, the first penalty allocates it
        self.ints = Staging(device, torch.int64)
        self.floats = Staging(device, torch.float32)

    def start(self, slot: int, params: RequestParams) -> None:
        """A request takes its slot: a fresh count row when it has a penalty (only such requests read it)."""
        if not params.penalized:
            return
        if self.counts is None:
            self.counts = torch.zeros(self.max_running + 1, self.width, dtype=torch.int32, device=self.device)
        self.counts[slot] = 0

    def build(self, items: list[PlannedItem], slots: torch.Tensor, grid: list[int]) -> LogitRules | None:
        """The pass's rules for its step items (their `slots` on the device, `grid` the [S * 64]
        logits row of each block position), or None when no item has any."""
        reqs = [it.request for it in items]
        penalized = any(r.penalized for r in reqs)
        biased = [(n, t, v) for n, r in enumerate(reqs) for t, v in r.logit_bias]
        bans: list[tuple[int, int]] = []
        for n, it in enumerate(items):
            if it.request.min_tokens:
                bans += end_bans(it, grid[n * PAGE : (n + 1) * PAGE])
        if not (penalized or biased or bans):
            return None
        offset_items = {n for n, r in enumerate(reqs) if r.penalized} | {n for n, _, _ in biased}
        offset_rows = [r for n in sorted(offset_items) for r in grid[n * PAGE : (n + 1) * PAGE] if r >= 0]
        bias_items, bias_tokens, ban_rows, ban_tokens, offset_rows_t = self.ints.stage(
            [n for n, _, _ in biased],
            [t for _, t, _ in biased],
            [r for r, _ in bans],
            [t for _, t in bans],
            offset_rows,
        )
        frequency, presence, bias_values = self.floats.stage(
            [r.frequency_penalty for r in reqs], [r.presence_penalty for r in reqs], [v for _, _, v in biased]
        )
        # Per item, not per row: one [S, V] table, added to the rows in one gather.
        offset = None
        if biased:
            offset = torch.zeros(len(reqs), self.width, device=self.device)
            offset.index_put_((bias_items, bias_tokens), bias_values, accumulate=True)
        if penalized and self.counts is not None:
            counts = self.counts[slots].float()
            penalty = counts * frequency[:, None] + (counts > 0) * presence[:, None]
            offset = -penalty if offset is None else offset - penalty
        return LogitRules(
            offset=offset,
            offset_rows=offset_rows_t if offset is not None else None,
            penalized=penalized,
            ban_rows=ban_rows if bans else None,
            ban_tokens=ban_tokens if bans else None,
        )

    def record(self, rules: LogitRules | None, slots: torch.Tensor, tokens: torch.Tensor, valid: torch.Tensor) -> None:
        """Count the tokens a pass unmasked ([S, K] with their validity) for the requests with a penalty."""
        if rules is None or not rules.penalized or self.counts is None:
            return
        self.count(torch.where(valid, slots[:, None], self.max_running), tokens)  # the spare row takes the rest

    def count(self, rows: torch.Tensor, tokens: torch.Tensor) -> None:
        """Add one to counts[row, token] per pair (a pair given twice adds two)."""
        if self.counts is not None:
            self.counts.index_put_((rows, tokens), torch.ones_like(tokens, dtype=torch.int32), accumulate=True)
