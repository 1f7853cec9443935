"""worker/carried_picks.py: the picks of the pass in flight complete the pass planned ahead of
them on the device, in the CUDA-graph bucket's packed token rows as in the eager tokens, checked
against placing them by hand."""

import random

import torch
from cde.shared.config import MASK_ID, PAGE, preset
from cde.shared.protocol import GenerateRequest
from cde.worker.carried_picks import stage_carried
from cde.worker.cuda_graphs import pack, views
from cde.worker.plan import PlannedItem, StepPlan
from cde.worker.sequence import request_params
from cde.worker.staging import Staging


def _pass(rng: random.Random) -> tuple[StepPlan, torch.Tensor, torch.Tensor, torch.Tensor]:
    """A plan ahead of a pass of 4 step items (its selection: positions, tokens, valid [4, 3]):
    a prefill (no carry), two items carrying step 1's and step 3's picks, a commit carrying step 0's."""
    req = request_params(GenerateRequest("r", [5] * 10), eot_id=None, constrained=False)
    tokens = [MASK_ID] * PAGE
    eligible = tuple(rng.random() < 0.7 for _ in range(PAGE))
    items = (
        PlannedItem(0, req, 0, tuple(range(PAGE)), 1, (1,), is_step=False),
        PlannedItem(1, req, 2, tuple(tokens), 5, (3, 4, 5), is_step=True, eligible=eligible, carry=1),
        PlannedItem(2, req, 1, tuple(tokens), 7, (6, 7), is_step=False, carry=0),
        PlannedItem(3, req, 0, tuple(tokens), 8, (8,), is_step=True, eligible=eligible, carry=3),
    )
    positions = torch.stack([torch.tensor(rng.sample(range(PAGE), 3)) for _ in range(4)])
    chosen = torch.randint(1000, 2000, (4, 3))
    valid = torch.tensor([[True, True, False], [True, False, False], [False, False, False], [True, True, True]])
    return StepPlan(items), positions, chosen, valid


def _by_hand(plan, positions, chosen, valid) -> tuple[list[list[int]], list[list[int]]]:
    """Each item's tokens and each step item's grid row (-1: not eligible) after placing its picks."""
    tokens, grid = [], []
    for it in plan.items:
        row = list(it.tokens)
        taken = set()
        if it.carry >= 0:
            for p, t, ok in zip(positions[it.carry].tolist(), chosen[it.carry].tolist(), valid[it.carry].tolist()):
                if ok:
                    row[p] = t
                    taken.add(p)
        tokens.append(row)
        if it.is_step:
            grid.append([p if ok and p not in taken else -1 for p, ok in enumerate(it.eligible)])
    return tokens, grid


def test_picks_complete_the_eager_tokens_and_the_grid():
    plan, positions, chosen, valid = _pass(random.Random(0))
    carried = stage_carried(Staging("cpu", torch.int64), plan, (positions, chosen, valid))
    tokens = torch.tensor([it.tokens for it in plan.items])
    carried.into_tokens(tokens)
    grid = torch.tensor([[p if ok else -1 for p, ok in enumerate(it.eligible)] for it in plan.step_items])
    carried.out_of_grid(grid)
    want_tokens, want_grid = _by_hand(plan, positions, chosen, valid)
    assert tokens.tolist() == want_tokens
    assert grid.tolist() == want_grid
    assert tokens[0].tolist() == list(range(PAGE))  # the item that carries nothing is as planned


def test_picks_complete_a_packed_bucket_and_nothing_else():
    """The graph path: the rows of the bucket's packed buffer that `views` says are the tokens,
    padding items and the other columns (page table, blocks, ...) untouched."""
    plan, positions, chosen, valid = _pass(random.Random(1))
    cfg = preset("tiny")
    items = plan.items
    ints = torch.tensor(
        pack(
            8,
            [it.tokens for it in items],
            [it.block for it in items],
            [it.page for it in items],
            [it.pages for it in items],
            [cfg.n_layers + 1] * len(items),
            None,
            scratch_page=99,
            scratch_slot=7,
            width=cfg.max_blocks,
            no_injection=cfg.n_layers + 1,
        )
    )
    before = ints.clone()
    carried = stage_carried(Staging("cpu", torch.int64), plan, (positions, chosen, valid))
    carried.into_tokens(views(ints, 8, cfg.max_blocks)[0][: len(items)])
    want, _ = _by_hand(plan, positions, chosen, valid)
    assert views(ints, 8, cfg.max_blocks)[0][: len(items)].tolist() == want
    changed = (ints != before).nonzero().flatten()
    assert len(changed) > 0 and changed.max() < len(items) * PAGE


def test_a_plan_that_carries_nothing_stages_nothing():
    plan, positions, chosen, valid = _pass(random.Random(2))
    plain = StepPlan(tuple(it._replace(carry=-1) for it in plan.items))
    assert stage_carried(Staging("cpu", torch.int64), plain, (positions, chosen, valid)) is None
